//! A store snapshot opened for restore: its manifest, state and resolved chunks, and what makes
//! it a [`SnapshotImage`] for the restore engine ([`guestmem_snapshot::restore`]): its chunk
//! sources (each chunk checked against its hash before any of it is copied or served), its
//! full copy (chunks fetched on several threads, then every chunk's hash compared in memory),
//! its working set. Full, lazy and page-server restores are the engine's; map mode is refused
//! (a store holds compressed objects, not a file to map).

use std::path::Path;
use std::sync::Arc;

use guestmem_contract::component::ComponentState;
use guestmem_memory::{GuestMemory, Region, RegionSpec, PAGE_SIZE};
use guestmem_paging::{PageSource, PagerConfig};
use guestmem_snapshot::{
    RestoreMode, Result as SnapshotResult, SavedState, SnapshotImage, WorkingSetRegion,
};
use guestmem_sys::to_usize;
use guestmem_vm::VmConfig;
use serde::{Deserialize, Serialize};

use crate::cache::ChunkCache;
use crate::chunk::{Hash, Stored};
use crate::ledger::Ledger;
use crate::manifest::{resolve, state_key, working_set_key, Resolved, StoreManifest};
use crate::objects::ObjectStore;
use crate::pages::{parallel, Fetcher, StorePages, Want};

/// How many chunks of a full restore one thread fetches and copies in at a time.
const RUN_CHUNKS: usize = 16;
use crate::{Error, Result};

/// A store snapshot whose manifest (and base chain) and state have been read and checked.
#[derive(Debug)]
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
    /// The chunks its page sources fetched, for a failure to name those never fetched.
    ledger: Arc<Ledger>,
}

/// The state object of `manifest`'s snapshot, checked against the manifest.
pub fn read_state(objects: &dyn ObjectStore, manifest: &StoreManifest) -> Result<Vec<u8>> {
    check_state(objects, manifest, objects.get(&state_key(&manifest.name))?)
}

/// `bytes`, read as `manifest`'s state object, if they are what the manifest says.
fn check_state(
    objects: &dyn ObjectStore,
    manifest: &StoreManifest,
    bytes: Vec<u8>,
) -> Result<Vec<u8>> {
    let key = state_key(&manifest.name);
    if bytes.len() as u64 != manifest.state_bytes {
        let what = if (bytes.len() as u64) < manifest.state_bytes {
            "truncated"
        } else {
            "longer than written"
        };
        return Err(Error::Corrupt(format!(
            "{}: {key}: {} bytes, the manifest says {}: {what}",
            objects.describe(),
            bytes.len(),
            manifest.state_bytes
        )));
    }
    let hash = blake3::hash(&bytes).to_hex().to_string();
    if hash != manifest.state_blake3 {
        return Err(Error::Corrupt(format!(
            "{}: {key}: BLAKE3 {hash}, the manifest says {}",
            objects.describe(),
            manifest.state_blake3
        )));
    }
    Ok(bytes)
}

impl StoreSnapshot {
    /// Opens snapshot `name` of `objects`: manifest, base chain, state. A remote store's
    /// chunks go through `cache` (the host's chunk cache) when given. The state object is
    /// read while the manifest is (one round trip to a remote store, not two), and checked
    /// against the manifest once both are in.
    pub fn open(
        objects: Arc<dyn ObjectStore>,
        name: &str,
        cache: Option<ChunkCache>,
    ) -> Result<StoreSnapshot> {
        let (manifest, state) = std::thread::scope(|s| {
            let state = s.spawn(|| objects.get(&state_key(name)));
            let manifest = StoreManifest::load(&*objects, name);
            (
                manifest,
                state.join().expect("reading the state object panicked"),
            )
        });
        // A missing or damaged manifest explains itself before any state error does.
        let manifest = manifest?;
        let resolved = resolve(&*objects, &manifest)?;
        let state_json = check_state(&*objects, &manifest, state?)?;
        let label = format!("{}/{}", objects.describe(), state_key(name));
        let (machine, components) = if manifest.version < 2 {
            // Version 1 kept guestmem's own VM state alone, as its machine saves it.
            guestmem_snapshot::parse_state(&state_json, manifest.config.vcpus, Path::new(&label))?;
            (state_json, Vec::new())
        } else {
            let saved: SavedState =
                serde_json::from_slice(&state_json).map_err(|source| Error::Json {
                    store: objects.describe(),
                    key: state_key(name),
                    source,
                })?;
            (saved.machine, saved.components)
        };
        let ledger = Arc::new(Ledger::new(
            resolved
                .iter()
                .enumerate()
                .map(|(i, chunks)| {
                    let label = format!(
                        "{}/{} region '{}'",
                        objects.describe(),
                        manifest.name,
                        manifest.regions[i].spec.name
                    );
                    (label, chunks.iter().map(Option::is_some).collect())
                })
                .collect(),
        ));
        Ok(StoreSnapshot {
            manifest,
            machine,
            components,
            resolved,
            fetcher: Arc::new(Fetcher::new(objects, cache)),
            ledger,
        })
    }

    /// The store it is in.
    pub fn object_store(&self) -> &dyn ObjectStore {
        &**self.fetcher.object_store()
    }

    fn label(&self, region: usize) -> String {
        format!(
            "{}/{} region '{}'",
            self.object_store().describe(),
            self.manifest.name,
            self.manifest.regions[region].spec.name
        )
    }

    /// Fetches, checks and copies every non-zero chunk of region `index` into `memory`
    /// (zero pages of a chunk are left alone: fresh memory reads as zeros).
    fn copy_region_on(&self, memory: &GuestMemory, index: usize, threads: usize) -> Result<()> {
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
        self.ledger.use_region(index);
        parallel(runs, threads, |run| {
            let mut bufs: Vec<Vec<u8>> = run
                .iter()
                .map(|&(i, _)| vec![0u8; to_usize(region.chunk_len(cb, i))])
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
                self.ledger.mark(index, i as u64);
                for r in non_zero_runs(buf) {
                    memory.write(region.spec.gpa + (i as u64 * cb) + r.start as u64, &buf[r])?;
                }
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
            let mut buf = vec![0u8; to_usize(cb)];
            for &(i, hash) in batch {
                let len = to_usize(region.chunk_len(cb, i));
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

    /// Fetches and checks every non-zero chunk of region `index` (on several threads): its
    /// non-zero pages as (region offset, bytes), to be written once the VM exists.
    fn fetch_region(&self, index: usize) -> Result<Vec<(u64, Vec<u8>)>> {
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
                let len = to_usize(region.chunk_len(cb, i));
                (i as u64 * cb, vec![0u8; len])
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
        self.ledger.use_region(index);
        self.fetcher.fetch(wants, self.threads())?;
        for &(i, _) in &chunks {
            self.ledger.mark(index, i as u64);
        }
        Ok(out
            .iter()
            .flat_map(|(offset, buf)| {
                non_zero_runs(buf).map(move |r| (offset + r.start as u64, buf[r].to_vec()))
            })
            .collect())
    }

    fn threads(&self) -> usize {
        let cores = std::thread::available_parallelism().map_or(2, std::num::NonZero::get);
        if self.object_store().remote() {
            cores.max(8)
        } else {
            cores
        }
    }

    /// "STORE/NAME", in messages.
    pub fn describe(&self) -> String {
        format!(
            "store snapshot {}/{}",
            self.object_store().describe(),
            self.manifest.name
        )
    }

    /// The page source of RAM region `i` (each chunk checked against its hash as it is
    /// decompressed).
    fn source(&self, i: usize) -> StorePages {
        StorePages::in_ledger(
            self.fetcher.clone(),
            self.resolved[i].clone(),
            self.manifest.chunk_bytes,
            self.manifest.regions[i].spec.size,
            self.label(i),
            self.ledger.clone(),
            i,
        )
    }

    /// The working set an earlier lazy restore recorded, if any; one recorded for another
    /// manifest, damaged, or naming offsets outside its regions is refused, saying so.
    pub fn working_set(&self) -> Result<Option<StoreWorkingSet>> {
        let key = working_set_key(&self.manifest.name);
        let bytes = match self.object_store().get(&key) {
            Ok(bytes) => bytes,
            Err(e) if e.is_missing() => return Ok(None),
            Err(e) => return Err(e),
        };
        let store = self.object_store().describe();
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

    /// Writes `regions` as the snapshot's working set (replacing any).
    fn put_working_set(&self, regions: Vec<WorkingSetRegion>) -> Result<()> {
        let mut ws = StoreWorkingSet {
            format: WORKING_SET_FORMAT.into(),
            manifest_checksum: self.manifest.checksum.clone(),
            regions,
            checksum: String::new(),
        };
        ws.checksum = ws.compute_checksum();
        let json = serde_json::to_vec(&ws).expect("a working set serializes");
        self.object_store()
            .put(&working_set_key(&self.manifest.name), &json)
    }
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

/// The runs of non-zero pages of `buf` (fresh guest memory reads as zeros already).
fn non_zero_runs(buf: &[u8]) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
    let page = to_usize(PAGE_SIZE);
    let len = buf.len();
    let zero = move |p: usize| crate::chunk::is_zero(&buf[p..(p + page).min(len)]);
    let mut p = 0;
    std::iter::from_fn(move || {
        while p < len && zero(p) {
            p += page;
        }
        if p >= len {
            return None;
        }
        let start = p;
        while p < len && !zero(p) {
            p += page;
        }
        Some(start..p.min(len))
    })
}

/// The store's errors, as the restore engine carries them.
fn image_error(e: Error) -> guestmem_snapshot::Error {
    match e {
        Error::Snapshot(e) => e,
        e => guestmem_snapshot::Error::Image(Box::new(e)),
    }
}

/// A store snapshot as the restore engine reads it: each chunk checked against its hash as it
/// is decompressed, before any of it is copied or served.
impl SnapshotImage for StoreSnapshot {
    fn describe(&self) -> String {
        StoreSnapshot::describe(self)
    }

    fn config(&self) -> &VmConfig {
        &self.manifest.config
    }

    fn regions(&self) -> Vec<&RegionSpec> {
        self.manifest.regions.iter().map(|r| &r.spec).collect()
    }

    fn chunk_check(&self) -> &'static str {
        "against its BLAKE3 hash"
    }

    fn identity(&self) -> &str {
        &self.manifest.checksum
    }

    fn machine_state(&self) -> &[u8] {
        &self.machine
    }

    fn components(&self) -> &[ComponentState] {
        &self.components
    }

    fn check_mode(&self, mode: &RestoreMode) -> SnapshotResult<()> {
        match mode {
            RestoreMode::Map => Err(map_refused(self)),
            RestoreMode::Full | RestoreMode::Lazy(_) | RestoreMode::PageServer(_) => Ok(()),
        }
    }

    fn page_source(&self, index: usize) -> SnapshotResult<Arc<dyn PageSource>> {
        Ok(Arc::new(self.source(index)))
    }

    fn copy_region(&self, memory: &GuestMemory, index: usize) -> SnapshotResult<()> {
        self.copy_region_on(memory, index, self.threads())
            .map_err(image_error)
    }

    fn read_region(&self, index: usize) -> SnapshotResult<Vec<(u64, Vec<u8>)>> {
        self.fetch_region(index).map_err(image_error)
    }

    fn map_region(&self, _region: &Region, _index: usize) -> SnapshotResult<()> {
        Err(map_refused(self))
    }

    fn check_restored(&self, memory: &GuestMemory) -> SnapshotResult<()> {
        self.check_memory(memory).map_err(image_error)
    }

    fn reads_overlap_build(&self) -> bool {
        true
    }

    fn tune_pager(&self, config: &mut PagerConfig) {
        // A fault waits for one store chunk, not a 2 MiB window of them (the guest runs
        // sooner); readahead and the background sweep keep several in flight.
        config.fault_around = config.fault_around.min(self.manifest.chunk_bytes);
        config.readahead_chunks = config.readahead_chunks.max(8);
        config.readahead_threads = config.readahead_threads.max(2);
    }

    fn recorded_working_set(&self) -> SnapshotResult<Option<Vec<WorkingSetRegion>>> {
        Ok(self
            .working_set()
            .map_err(image_error)?
            .map(|ws| ws.regions))
    }

    fn write_working_set(&self, regions: Vec<WorkingSetRegion>) -> SnapshotResult<()> {
        self.put_working_set(regions).map_err(image_error)
    }
}

/// Why a store snapshot cannot be restored in map mode.
fn map_refused(snapshot: &StoreSnapshot) -> guestmem_snapshot::Error {
    guestmem_snapshot::Error::Layout(format!(
        "{}: a store snapshot's chunks are compressed objects, not a memory file to map: \
         restore it in full mode or lazily",
        snapshot.describe()
    ))
}
