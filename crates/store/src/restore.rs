//! Restoring a VM from a store snapshot: in full (every chunk fetched, checked and copied in,
//! the regions' digests compared, before any vCPU runs) or lazily (the guest runs at once while
//! a pager per RAM region brings the chunks in — the recorded working set first — each chunk
//! checked before any of its bytes reach the guest). A guest_memfd region is paged through KVM
//! Userfault, as a flat snapshot's is ([`start_region_pagers`]), and refused naming it where the
//! kernel lacks it.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use guestmem_contract::component::ComponentState;
use guestmem_contract::{payload_state_of, MachineBuilder, SharedFiles, TargetMachine, VmBuilder};
use guestmem_memory::{GuestMemory, PAGE_SIZE};
use guestmem_pageserver::{self as firecracker, PeerRestoredVm, ServedMemory, ServedRegion};
use guestmem_paging::{PageSource, Pager, PagerConfig, UserfaultPager};
use guestmem_snapshot::SavedState;
use guestmem_snapshot::{start_region_pagers, PreparedVm, RegionPagers, WorkingSetRegion};
use guestmem_vm::{layout, Vm};
use serde::{Deserialize, Serialize};

use crate::backend::Backend;
use crate::cache::ChunkCache;
use crate::chunk::{Hash, Stored};
use crate::manifest::{resolve, state_key, working_set_key, Resolved, StoreManifest};
use crate::source::{parallel, Fetcher, StoreSource, Want};

/// The nice value of a lazy restore's background fetches (prefetch and sweep) unless its
/// configuration names one ([`PagerConfig::background_nice`]).
pub const LAZY_BACKGROUND_NICE: i32 = 10;
/// How many chunks of a full restore one thread fetches and copies in at a time.
const RUN_CHUNKS: usize = 16;
use crate::{Error, Result};

/// A store snapshot whose manifest (and base chain) and state have been read and checked.
pub struct StoreSnapshot {
    /// Its manifest.
    pub manifest: StoreManifest,
    /// The VM's state as its machine saved it, for [`TargetMachine::restore`] (guestmem's own
    /// VM's: its vCPU and VM state).
    pub machine: Vec<u8>,
    /// The states of the components saved with it (`write_machine`), for the restored VM's
    /// components of the same names.
    pub components: Vec<ComponentState>,
    /// Every chunk, a diff's base entries resolved.
    pub resolved: Resolved,
    /// What gets its chunks (through the host's chunk cache for S3).
    pub fetcher: Arc<Fetcher>,
}

/// The state object of `manifest`'s snapshot, checked against the manifest.
pub fn read_state(backend: &dyn Backend, manifest: &StoreManifest) -> Result<Vec<u8>> {
    check_state(backend, manifest, backend.get(&state_key(&manifest.name))?)
}

/// `bytes`, read as `manifest`'s state object, if they are what the manifest says.
fn check_state(backend: &dyn Backend, manifest: &StoreManifest, bytes: Vec<u8>) -> Result<Vec<u8>> {
    let key = state_key(&manifest.name);
    if bytes.len() as u64 != manifest.state_bytes {
        let what = if (bytes.len() as u64) < manifest.state_bytes {
            "truncated"
        } else {
            "longer than written"
        };
        return Err(Error::Corrupt(format!(
            "{}: {key}: {} bytes, the manifest says {}: {what}",
            backend.describe(),
            bytes.len(),
            manifest.state_bytes
        )));
    }
    let hash = blake3::hash(&bytes).to_hex().to_string();
    if hash != manifest.state_blake3 {
        return Err(Error::Corrupt(format!(
            "{}: {key}: BLAKE3 {hash}, the manifest says {}",
            backend.describe(),
            manifest.state_blake3
        )));
    }
    Ok(bytes)
}

impl StoreSnapshot {
    /// Opens snapshot `name` of `backend`: manifest, base chain, state. A remote store's
    /// chunks go through `cache` (the host's chunk cache) when given. The state object is
    /// read while the manifest is (one round trip to a remote store, not two), and checked
    /// against the manifest once both are in.
    pub fn open(
        backend: Arc<dyn Backend>,
        name: &str,
        cache: Option<ChunkCache>,
    ) -> Result<StoreSnapshot> {
        let (manifest, state) = std::thread::scope(|s| {
            let state = s.spawn(|| backend.get(&state_key(name)));
            let manifest = StoreManifest::load(&*backend, name);
            (
                manifest,
                state.join().expect("reading the state object panicked"),
            )
        });
        // A missing or damaged manifest explains itself before any state error does.
        let manifest = manifest?;
        let resolved = resolve(&*backend, &manifest)?;
        let state_json = check_state(&*backend, &manifest, state?)?;
        let label = format!("{}/{}", backend.describe(), state_key(name));
        let (machine, components) = if manifest.version < 2 {
            // Version 1 kept guestmem's own VM state alone, as its machine saves it.
            guestmem_snapshot::parse_state(&state_json, manifest.config.vcpus, Path::new(&label))?;
            (state_json, Vec::new())
        } else {
            let saved: SavedState =
                serde_json::from_slice(&state_json).map_err(|source| Error::Json {
                    store: backend.describe(),
                    key: state_key(name),
                    source,
                })?;
            (saved.machine, saved.components)
        };
        Ok(StoreSnapshot {
            manifest,
            machine,
            components,
            resolved,
            fetcher: Arc::new(Fetcher::new(backend, cache)),
        })
    }

    /// The store it is in.
    pub fn backend(&self) -> &dyn Backend {
        &**self.fetcher.backend()
    }

    fn label(&self, region: usize) -> String {
        format!(
            "{}/{} region '{}'",
            self.backend().describe(),
            self.manifest.name,
            self.manifest.regions[region].spec.name
        )
    }

    /// Fetches, checks and copies every non-zero chunk of region `index` into `memory`
    /// (zero pages of a chunk are left alone: fresh memory reads as zeros).
    fn copy_region(&self, memory: &GuestMemory, index: usize, threads: usize) -> Result<()> {
        let region = &self.manifest.regions[index];
        let cb = self.manifest.chunk_bytes;
        let label = self.label(index);
        let jobs: Vec<(usize, Stored)> = self.resolved[index]
            .iter()
            .enumerate()
            .filter_map(|(i, c)| c.map(|c| (i, c)))
            .collect();
        // Runs of chunks, each fetched by one thread (neighbours in a pack with one read)
        // while the others fetch and decompress theirs.
        let runs: Vec<&[(usize, Stored)]> = jobs.chunks(RUN_CHUNKS).collect();
        parallel(runs, threads, |run| {
            let mut bufs: Vec<Vec<u8>> = run
                .iter()
                .map(|&(i, _)| vec![0u8; region.chunk_len(cb, i) as usize])
                .collect();
            let wants = run
                .iter()
                .zip(bufs.iter_mut())
                .map(|(&(i, chunk), out)| Want {
                    chunk,
                    out,
                    what: format!("{label} chunk {i} (offset {:#x})", i as u64 * cb),
                })
                .collect();
            self.fetcher.fetch(wants, 1)?;
            for (&(i, _), buf) in run.iter().zip(&bufs) {
                write_non_zero(memory, region.spec.gpa + i as u64 * cb, buf)?;
            }
            Ok(())
        })
    }

    /// Checks `memory` (this snapshot's layout, restored) chunk by chunk against the manifest,
    /// on several threads: each data chunk's BLAKE3 hash, and zero chunks all zero (each chunk
    /// was checked when it was fetched; this catches one placed wrong). Names the first chunk
    /// that differs.
    pub fn check_memory(&self, memory: &GuestMemory) -> Result<()> {
        let threads = self.threads();
        (0..self.manifest.regions.len()).try_for_each(|i| self.check_region(memory, i, threads))
    }

    /// [`StoreSnapshot::check_memory`] for region `index`.
    fn check_region(&self, memory: &GuestMemory, index: usize, threads: usize) -> Result<()> {
        let region = &self.manifest.regions[index];
        let cb = self.manifest.chunk_bytes;
        let label = self.label(index);
        let jobs: Vec<(usize, Option<Hash>)> = self.resolved[index]
            .iter()
            .enumerate()
            .map(|(i, c)| (i, c.map(|c| c.hash)))
            .collect();
        let batch = 16;
        let batches: Vec<&[(usize, Option<Hash>)]> = jobs.chunks(batch).collect();
        parallel(batches, threads, |batch| {
            let mut buf = vec![0u8; cb as usize];
            for &(i, hash) in batch {
                let len = region.chunk_len(cb, i) as usize;
                let bytes = &mut buf[..len];
                memory.read(region.spec.gpa + i as u64 * cb, bytes)?;
                let right = match hash {
                    Some(h) => crate::chunk::hash(bytes) == h,
                    None => crate::chunk::is_zero(bytes),
                };
                if !right {
                    return Err(Error::Corrupt(format!(
                        "{label} chunk {i} (offset {:#x}): restored memory differs from the \
                         manifest's {}; the guest was not resumed",
                        i as u64 * cb,
                        hash.map_or("zero chunk".to_string(), |h| format!(
                            "hash {}",
                            crate::chunk::hex(&h)
                        ))
                    )));
                }
            }
            Ok(())
        })
    }

    /// Fetches and checks every non-zero chunk of the sys region (page tables, payload,
    /// control blocks; a few MiB): (guest address, bytes), to be written with
    /// [`write_non_zero`] once the VM exists.
    pub(crate) fn fetch_sys(&self) -> Result<Vec<(u64, Vec<u8>)>> {
        let Some(index) = self
            .manifest
            .regions
            .iter()
            .position(|r| r.spec.gpa == layout::SYS_GPA)
        else {
            return Ok(Vec::new());
        };
        let region = &self.manifest.regions[index];
        let cb = self.manifest.chunk_bytes;
        let label = self.label(index);
        let chunks: Vec<(usize, Stored)> = self.resolved[index]
            .iter()
            .enumerate()
            .filter_map(|(i, c)| c.map(|c| (i, c)))
            .collect();
        let mut out: Vec<(u64, Vec<u8>)> = chunks
            .iter()
            .map(|&(i, _)| {
                let len = region.chunk_len(cb, i) as usize;
                (region.spec.gpa + i as u64 * cb, vec![0u8; len])
            })
            .collect();
        let wants = chunks
            .iter()
            .zip(out.iter_mut())
            .map(|(&(i, chunk), slot)| Want {
                chunk,
                out: &mut slot.1,
                what: format!("{label} chunk {i} (offset {:#x})", i as u64 * cb),
            })
            .collect();
        self.fetcher.fetch(wants, self.threads())?;
        Ok(out)
    }

    fn threads(&self) -> usize {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        if self.backend().remote() {
            cores.max(8)
        } else {
            cores
        }
    }

    /// "STORE/NAME", in messages.
    pub fn describe(&self) -> String {
        format!(
            "store snapshot {}/{}",
            self.backend().describe(),
            self.manifest.name
        )
    }

    /// The VM `builder` builds for the snapshot's configuration, its layout checked.
    fn build<B: MachineBuilder>(&self, builder: &mut B) -> Result<B::Machine> {
        self.check_vm(builder.build(&self.manifest.config, SharedFiles::new())?)
    }

    fn new_vm(&self) -> Result<Vm> {
        self.build(&mut VmBuilder)
    }

    /// The VM of `prepared`, if the snapshot was taken of a VM of its configuration (else
    /// refused naming what differs), its layout checked.
    pub(crate) fn prepared_vm(&self, prepared: PreparedVm) -> Result<Vm> {
        let vm = prepared.take(&self.manifest.config, &self.describe())?;
        self.check_vm(vm)
    }

    fn check_vm<M: TargetMachine>(&self, vm: M) -> Result<M> {
        let built: Vec<_> = vm.memory().regions().iter().map(|r| r.spec()).collect();
        let saved: Vec<_> = self.manifest.regions.iter().map(|r| &r.spec).collect();
        if built != saved {
            return Err(Error::Layout(format!(
                "the snapshot's regions {saved:?} differ from those its configuration builds \
                 here {built:?}"
            )));
        }
        Ok(vm)
    }

    /// Builds a VM with every chunk fetched, checked and copied in, memory then checked
    /// chunk by chunk against the manifest, and the vCPU state restored; the caller resumes it.
    pub fn restore_full(&self) -> Result<Vm> {
        self.full_on(self.new_vm()?)
    }

    /// [`StoreSnapshot::restore_full`] into the VM `builder` builds for the snapshot's
    /// configuration (a VMM's own VM), handed the machine state the snapshot holds
    /// ([`TargetMachine::restore`]); the caller restores its components from
    /// [`StoreSnapshot::components`] and resumes it.
    pub fn restore_full_with<B: MachineBuilder>(&self, builder: &mut B) -> Result<B::Machine> {
        self.full_on(self.build(builder)?)
    }

    /// [`StoreSnapshot::restore_full`] into `prepared`, a VM built ahead of time for the
    /// snapshot's configuration (see [`PreparedVm`]); a snapshot of another configuration is
    /// refused naming what differs, before any chunk is fetched.
    pub fn restore_full_into(&self, prepared: PreparedVm) -> Result<Vm> {
        self.full_on(self.prepared_vm(prepared)?)
    }

    fn full_on<M: TargetMachine>(&self, mut vm: M) -> Result<M> {
        let threads = self.threads();
        for i in 0..self.manifest.regions.len() {
            self.copy_region(vm.memory(), i, threads)?;
        }
        self.check_memory(vm.memory())?;
        vm.restore(&self.machine)?;
        Ok(vm)
    }

    /// Builds a VM whose RAM arrives on demand from the store (see the module docs); the sys
    /// region is copied in at once. With a recorded working set and `config.prefetch` empty,
    /// the pagers fetch that working set first.
    pub fn restore_lazy(&self, config: &PagerConfig) -> Result<LazyStoreVm> {
        self.restore_lazy_with(&mut VmBuilder, config)
    }

    /// [`StoreSnapshot::restore_lazy`] into the VM `builder` builds for the snapshot's
    /// configuration (a VMM's own VM): the pagers are armed on its RAM, then it is handed the
    /// machine state the snapshot holds ([`TargetMachine::restore`]).
    pub fn restore_lazy_with<B: MachineBuilder>(
        &self,
        builder: &mut B,
        config: &PagerConfig,
    ) -> Result<LazyStoreVm<B::Machine>> {
        let t = Instant::now();
        self.lazy_on(|| self.build(builder), config, t)
    }

    /// [`StoreSnapshot::restore_lazy`] into `prepared`, a VM built ahead of time for the
    /// snapshot's configuration (see [`PreparedVm`]): the pagers are armed on its memory, so
    /// the restore leaves out creating the VM and registering its memslots. A snapshot of
    /// another configuration is refused naming what differs, before any chunk is fetched.
    pub fn restore_lazy_into(
        &self,
        prepared: PreparedVm,
        config: &PagerConfig,
    ) -> Result<LazyStoreVm> {
        let t = Instant::now();
        // Checked before any chunk is fetched.
        let vm = self.prepared_vm(prepared)?;
        self.lazy_on(|| Ok(vm), config, t)
    }

    /// Fetches, checks and copies in the sys region (page tables, payload, control blocks).
    fn copy_sys(&self, vm: &Vm) -> Result<()> {
        for (gpa, bytes) in self.fetch_sys()? {
            write_non_zero(vm.memory(), gpa, &bytes)?;
        }
        Ok(())
    }

    /// The page source of RAM region `i` (each chunk checked against its hash as it is
    /// decompressed).
    fn source(&self, i: usize) -> StoreSource {
        StoreSource::new(
            self.fetcher.clone(),
            self.resolved[i].clone(),
            self.manifest.chunk_bytes,
            self.manifest.regions[i].spec.size,
            self.label(i),
        )
    }

    /// The snapshot's RAM (every region but the sys region, back to back in manifest order)
    /// for a Firecracker page server (`guestmem page-server --snapshot s3://…`): each region
    /// served by a [`StoreSource`], which checks every chunk's hash before any of it is served.
    pub fn served_memory(&self) -> ServedMemory {
        let regions = self
            .manifest
            .regions
            .iter()
            .enumerate()
            .filter(|(_, r)| r.spec.gpa != layout::SYS_GPA)
            .map(|(i, r)| ServedRegion {
                name: r.spec.name.clone(),
                size: r.spec.size,
                source: Arc::new(self.source(i)),
            })
            .collect();
        ServedMemory::Regions {
            label: format!(
                "{} (each chunk checked against its BLAKE3 hash before it is served)",
                self.describe()
            ),
            regions,
        }
    }

    /// The VMM side of a Firecracker page server serving this snapshot: builds the VM, copies
    /// in the sys region (checked), registers the RAM on a userfaultfd and hands it to the
    /// server on `socket` (see [`firecracker::hand_ram_to_server`]); the server brings the RAM.
    /// The caller resumes the VM.
    pub fn restore_lazy_via_socket(&self, socket: &Path) -> Result<PeerRestoredVm> {
        let vm = self.new_vm()?;
        self.copy_sys(&vm)?;
        let state = payload_state_of(&self.machine)?;
        Ok(firecracker::hand_ram_to_server(vm, &state, socket)?)
    }

    /// Arms a lazy restore on the VM `vm` builds. The sys region's chunks and the working set
    /// are read while it builds (against a remote store, the VM's creation and the round
    /// trips overlap).
    fn lazy_on<M: TargetMachine>(
        &self,
        vm: impl FnOnce() -> Result<M>,
        config: &PagerConfig,
        t: Instant,
    ) -> Result<LazyStoreVm<M>> {
        let (vm, sys, working_set) = std::thread::scope(|s| {
            let sys = s.spawn(|| self.fetch_sys());
            let working_set = s.spawn(|| {
                if config.prefetch.is_empty() {
                    self.working_set()
                } else {
                    Ok(None)
                }
            });
            let vm = vm();
            (
                vm,
                sys.join().expect("fetching the sys region panicked"),
                working_set
                    .join()
                    .expect("reading the working set panicked"),
            )
        });
        let mut vm = vm?;
        for (gpa, bytes) in sys? {
            write_non_zero(vm.memory(), gpa, &bytes)?;
        }
        let working_set = working_set?;
        let RegionPagers {
            pagers,
            userfault_pagers,
        } = self.start_pagers(&vm, config, working_set.as_ref())?;
        vm.restore(&self.machine)?;
        Ok(LazyStoreVm {
            pagers,
            userfault_pagers,
            vm,
            ready: t.elapsed(),
            prefetched: working_set.is_some(),
        })
    }

    /// Arms the pagers of every RAM region of `vm` (the sys region already in place): each
    /// region's chunks come from the store, checked against their hashes, the working set
    /// (`working_set`, when `config.prefetch` is empty) first.
    pub(crate) fn start_pagers<M: TargetMachine>(
        &self,
        vm: &M,
        config: &PagerConfig,
        working_set: Option<&StoreWorkingSet>,
    ) -> Result<RegionPagers> {
        let memory = vm.memory().clone();
        let abort = vm.abort_handle();
        // The same pagers as a flat snapshot's lazy restore (KVM Userfault for guest_memfd),
        // the source being the store's chunks, each checked against its hash.
        Ok(start_region_pagers(&memory, |i, _| {
            let source: Arc<dyn PageSource> = Arc::new(self.source(i));
            let mut config = PagerConfig {
                abort: abort.clone(),
                realtime_handlers: true,
                // A fault waits for one store chunk, not a 2 MiB window of them (the guest
                // runs sooner); readahead and the background sweep keep several in flight.
                fault_around: config.fault_around.min(self.manifest.chunk_bytes),
                readahead_chunks: config.readahead_chunks.max(8),
                readahead_threads: config.readahead_threads.max(2),
                // The working-set prefetch and the sweep yield to the guests' faults and to
                // other restores on a busy host.
                background_nice: config.background_nice.or(Some(LAZY_BACKGROUND_NICE)),
                ..config.clone()
            };
            if let Some(ws) = working_set {
                let name = &self.manifest.regions[i].spec.name;
                config.prefetch = ws
                    .regions
                    .iter()
                    .find(|r| &r.name == name)
                    .map(|r| r.chunks.clone())
                    .unwrap_or_default();
            }
            // Clones share the pages of this very snapshot: its manifest checksum names them.
            config.share = config.share.map(|s| s.of(&self.manifest.checksum));
            Ok((source, config))
        })?)
    }

    /// The working set an earlier lazy restore recorded, if any; one recorded for another
    /// manifest, damaged, or naming offsets outside its regions is refused, saying so.
    pub fn working_set(&self) -> Result<Option<StoreWorkingSet>> {
        let key = working_set_key(&self.manifest.name);
        let bytes = match self.backend().get(&key) {
            Ok(bytes) => bytes,
            Err(e) if e.is_missing() => return Ok(None),
            Err(e) => return Err(e),
        };
        let store = self.backend().describe();
        let bad = |why: String| Error::Corrupt(format!("{store}: {key}: {why}; delete it"));
        let ws: StoreWorkingSet = serde_json::from_slice(&bytes).map_err(|e| Error::Json {
            store: store.clone(),
            key: key.clone(),
            source: e,
        })?;
        if ws.format != WORKING_SET_FORMAT || ws.manifest_checksum != self.manifest.checksum {
            return Err(bad("recorded for another snapshot".into()));
        }
        if ws.compute_checksum() != ws.checksum {
            return Err(bad("its contents do not match its checksum".into()));
        }
        for r in &ws.regions {
            let Some(image) = self.manifest.regions.iter().find(|i| i.spec.name == r.name) else {
                return Err(bad(format!("no region '{}' in the snapshot", r.name)));
            };
            if let Some(c) = r.chunks.iter().find(|&&c| c >= image.spec.size) {
                return Err(bad(format!("{c:#x} is outside region '{}'", r.name)));
            }
        }
        Ok(Some(ws))
    }

    /// Records the chunks the guest of `lazy` faulted on, in order, for the next lazy restore
    /// of this snapshot (on any host) to fetch first. Returns how many it lists.
    pub fn record_working_set<M: TargetMachine>(&self, vm: &M, pagers: &[Pager]) -> Result<usize> {
        self.record_working_set_with(vm, pagers, &[])
    }

    /// [`StoreSnapshot::record_working_set`] with the KVM Userfault pagers of the guest_memfd
    /// regions too ([`LazyStoreVm::userfault_pagers`]).
    pub fn record_working_set_with<M: TargetMachine>(
        &self,
        vm: &M,
        pagers: &[Pager],
        userfault_pagers: &[UserfaultPager],
    ) -> Result<usize> {
        let regions = guestmem_snapshot::regions_of_pagers(vm.memory(), pagers, userfault_pagers);
        let n = regions.iter().map(|r| r.chunks.len()).sum();
        let mut ws = StoreWorkingSet {
            format: WORKING_SET_FORMAT.into(),
            manifest_checksum: self.manifest.checksum.clone(),
            regions,
            checksum: String::new(),
        };
        ws.checksum = ws.compute_checksum();
        let json = serde_json::to_vec(&ws).expect("a working set serializes");
        self.backend()
            .put(&working_set_key(&self.manifest.name), &json)?;
        Ok(n)
    }
}

/// A VM restored lazily from a store; the pagers go before the VM (field order).
pub struct LazyStoreVm<M = Vm> {
    /// The userfaultfd pagers bringing its memory in (guest_memfd regions left out).
    pub pagers: Vec<Pager>,
    /// The KVM Userfault pagers bringing its guest_memfd regions in (see [`UserfaultPager`]):
    /// the vCPU loop hands them its userfault exits.
    pub userfault_pagers: Vec<UserfaultPager>,
    /// The VM.
    pub vm: M,
    /// From the start of the restore to the vCPUs being ready.
    pub ready: Duration,
    /// Whether the pagers fetch a recorded working set first.
    pub prefetched: bool,
}

/// The format name of a store snapshot's working set.
pub const WORKING_SET_FORMAT: &str = "guestmem-store-working-set";

/// `snapshots/NAME/working-set.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreWorkingSet {
    /// The format's name ([`WORKING_SET_FORMAT`]).
    pub format: String,
    /// The checksum of the manifest it was recorded against.
    pub manifest_checksum: String,
    /// Per region, the chunks faulted on first.
    pub regions: Vec<WorkingSetRegion>,
    /// BLAKE3 of the canonical form with this field empty.
    pub checksum: String,
}

impl StoreWorkingSet {
    fn compute_checksum(&self) -> String {
        let mut c = self.clone();
        c.checksum.clear();
        guestmem_snapshot::canonical_checksum(&c)
    }
}

/// Writes the non-zero pages of `buf` at `gpa` (fresh guest memory reads as zeros already).
pub(crate) fn write_non_zero(memory: &GuestMemory, gpa: u64, buf: &[u8]) -> Result<()> {
    let page = PAGE_SIZE as usize;
    let len = buf.len();
    let mut p = 0;
    while p < len {
        if crate::chunk::is_zero(&buf[p..(p + page).min(len)]) {
            p += page;
            continue;
        }
        let start = p;
        while p < len && !crate::chunk::is_zero(&buf[p..(p + page).min(len)]) {
            p += page;
        }
        memory.write(gpa + start as u64, &buf[start..p.min(len)])?;
    }
    Ok(())
}
