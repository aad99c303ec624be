//! Writing a paused VM into a store: runs of chunks on several threads (read, zero check,
//! BLAKE3, zstd — each distinct chunk once; the chunks' hashes are also what a restore checks
//! memory against, so no other pass over memory is made), each run's new chunks put as one
//! pack; then the state object, then the manifest in one atomic put. An interrupted write
//! leaves packs but no manifest: no snapshot that looks complete (and [`crate::gc`] collects
//! its packs later).
//!
//! A chunk the store holds already (in a pack or object some snapshot's manifest lists, or a
//! chunk object of a store written before packs) is not stored again: the new manifest points
//! at it where it is.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use guestmem_contract::component::{ComponentState, Machine};
use guestmem_memory::GuestMemory;
use guestmem_snapshot::SavedState;
use guestmem_sys::to_usize;
use guestmem_tracking::{any_dirty, DirtyBitmap};
use guestmem_vm::{Vm, VmConfig};
use serde::Serialize;

use crate::chunk::{self, Hash, Loc, Stored, CHUNK_BYTES, ZSTD_LEVEL};
use crate::gc::Lease;
use crate::manifest::{
    manifest_key, state_key, ChunkRef, PackTable, StoreBase, StoreManifest, StoreRegion, FORMAT,
    VERSION,
};
use crate::objects::ObjectStore;

/// How many chunks of guest memory (in memory order) one thread takes at a time; their new
/// chunks make one pack (about 16 MiB of guest memory: a few MiB stored, a restore's window
/// or two).
pub const PACK_CHUNKS: usize = 64;
use crate::{Error, Result};

/// What a write did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StoreWriteReport {
    /// The snapshot as a URL-like name (`STORE/NAME`).
    pub snapshot: String,
    /// Guest memory covered (every region, the sys region included).
    pub memory_bytes: u64,
    /// Chunks of guest memory.
    pub chunks: u64,
    /// All-zero chunks (not stored).
    pub zero_chunks: u64,
    /// A diff's chunks left to its base.
    pub inherited_chunks: u64,
    /// Chunks whose bytes were already in the store (or earlier in this write).
    pub deduplicated_chunks: u64,
    /// Chunks put by this write, and their stored (compressed) bytes.
    pub new_chunks: u64,
    /// Packs put by this write (its new chunks are in them).
    pub new_packs: u64,
    /// Their stored bytes.
    pub new_stored_bytes: u64,
    /// Stored bytes of the distinct chunks the manifest itself lists (its base's not counted).
    pub stored_bytes: u64,
    /// How long the write took, in ms.
    pub write_ms: f64,
    /// Threads that compressed and put the chunks.
    pub threads: usize,
}

/// How many threads compress and put chunks: every core for a local store; more for a remote
/// one, whose puts mostly wait on the network.
pub(crate) fn threads(objects: &dyn ObjectStore) -> usize {
    let cores = std::thread::available_parallelism().map_or(2, std::num::NonZero::get);
    if objects.remote() {
        cores.max(8)
    } else {
        cores
    }
}

/// Writes a snapshot of `vm` (paused: holding `&Vm` proves no vCPU runs) as `name` into
/// `objects`, replacing a snapshot of that name. With `diff`, a diff over snapshot `base` of
/// the same store: only chunks holding a page that `dirty` reports (a tracker started when the
/// base was taken) are read; the others are inherited.
pub fn write(
    objects: &dyn ObjectStore,
    name: &str,
    vm: &Vm,
    diff: Option<(&str, &[DirtyBitmap])>,
) -> Result<StoreWriteReport> {
    let state = guestmem_contract::payload_state(vm)?;
    write_state(objects, name, vm.config(), vm.memory(), state, &[], diff)
}

/// [`write()`] of any VMM's VM (a [`Machine`], paused, its devices too: nothing writes its
/// memory until the write returns), its state being what [`Machine::save`] gives, with its
/// `components`' states beside it for a restore to hand back.
pub fn write_machine<M: Machine + ?Sized>(
    objects: &dyn ObjectStore,
    name: &str,
    machine: &mut M,
    components: &[ComponentState],
    diff: Option<(&str, &[DirtyBitmap])>,
) -> Result<StoreWriteReport> {
    let state = machine.save()?;
    let machine: &M = machine;
    write_state(
        objects,
        name,
        machine.config(),
        machine.memory(),
        state,
        components,
        diff,
    )
}

/// Writes the snapshot of a paused VM of `config` whose memory is `memory` and whose machine
/// saved `state`.
fn write_state(
    objects: &dyn ObjectStore,
    name: &str,
    config: &VmConfig,
    memory: &GuestMemory,
    state: Vec<u8>,
    components: &[ComponentState],
    diff: Option<(&str, &[DirtyBitmap])>,
) -> Result<StoreWriteReport> {
    let t = Instant::now();
    check_name(name)?;
    let _lease = Lease::acquire(objects, "write", name)?;
    let base = match diff {
        None => None,
        Some((base_name, _)) => Some(base_of(objects, name, base_name, config)?),
    };
    let state_json = saved_state_json(state, components.to_vec());

    // What the store already holds: those chunks are not put again.
    let known = Mutex::new(known_claims(objects)?);
    let (jobs, mut entries) = plan_jobs(memory, diff.map(|(_, d)| d));
    let threads = threads(objects);
    let (results, counts) = store_jobs(objects, memory, &jobs, &known, threads, None)?;
    let known = known.into_inner().expect("not poisoned");
    let mut table = PackTable::default();
    for (ri, ci, h) in results {
        entries[ri][ci] = Some(match h {
            None => ChunkRef::Zero,
            Some(hash) => table.entry(&known[&hash].expect("every claimed chunk was put")),
        });
    }

    let mut report = StoreWriteReport::new(objects, name, threads, counts);
    let regions: Vec<StoreRegion> = memory
        .regions()
        .iter()
        .zip(entries)
        .map(|(region, e)| {
            let chunks: Vec<ChunkRef> = e
                .into_iter()
                .map(|c| c.expect("every chunk done"))
                .collect();
            report.count_region(region.size(), &chunks);
            StoreRegion {
                spec: region.spec().clone(),
                digest: None,
                chunks,
            }
        })
        .collect();
    let manifest = sealed_manifest(name, config, table, regions, &state_json, base);
    report.stored_bytes = stored_bytes(&manifest);
    commit(objects, &manifest, &state_json)?;
    report.write_ms = t.elapsed().as_secs_f64() * 1e3;
    Ok(report)
}

impl StoreWriteReport {
    /// The report of a write of `name` into `objects` on `threads` threads that put `counts`;
    /// its per-region counts are added by [`Self::count_region`].
    pub(crate) fn new(
        objects: &dyn ObjectStore,
        name: &str,
        threads: usize,
        counts: Counts,
    ) -> Self {
        StoreWriteReport {
            snapshot: format!("{}/{name}", objects.describe()),
            threads,
            new_chunks: counts.new_chunks,
            new_stored_bytes: counts.new_bytes,
            new_packs: counts.packs,
            deduplicated_chunks: counts.dedup,
            ..Default::default()
        }
    }

    /// Counts a region of `size` bytes whose chunks are `chunks`.
    pub(crate) fn count_region(&mut self, size: u64, chunks: &[ChunkRef]) {
        self.memory_bytes += size;
        self.chunks += chunks.len() as u64;
        self.zero_chunks += chunks.iter().filter(|c| **c == ChunkRef::Zero).count() as u64;
        self.inherited_chunks += chunks.iter().filter(|c| **c == ChunkRef::Base).count() as u64;
    }
}

/// The state object's bytes: the machine's saved `state` and its components' states.
pub(crate) fn saved_state_json(state: Vec<u8>, components: Vec<ComponentState>) -> Vec<u8> {
    serde_json::to_vec(&SavedState {
        machine: state,
        components,
    })
    .expect("a saved state serializes")
}

/// The chunks the store already holds, each claimed as put (a write does not put them again).
pub(crate) fn known_claims(objects: &dyn ObjectStore) -> Result<HashMap<Hash, Option<Stored>>> {
    Ok(known_chunks(objects)?
        .into_iter()
        .map(|(h, c)| (h, Some(c)))
        .collect())
}

/// The chunks of `memory` to store, and per region, per chunk, its entry so far: a diff's
/// chunk holding no page that `dirty` reports is left to the base (`Some(ChunkRef::Base)`),
/// every other chunk is a job (`None` until stored).
fn plan_jobs(
    memory: &GuestMemory,
    dirty: Option<&[DirtyBitmap]>,
) -> (Vec<Job>, Vec<Vec<Option<ChunkRef>>>) {
    let mut jobs = Vec::new();
    let mut entries = Vec::new();
    for (ri, region) in memory.regions().iter().enumerate() {
        let n = to_usize(region.size().div_ceil(CHUNK_BYTES));
        let mut e = vec![None; n];
        for (index, slot) in e.iter_mut().enumerate() {
            let offset = index as u64 * CHUNK_BYTES;
            let len = to_usize(CHUNK_BYTES.min(region.size() - offset));
            let gpa = region.gpa() + offset;
            if dirty.is_some_and(|d| !any_dirty(d, gpa, len as u64)) {
                *slot = Some(ChunkRef::Base);
                continue;
            }
            jobs.push(Job {
                region: ri,
                index,
                gpa,
                len,
            });
        }
        entries.push(e);
    }
    (jobs, entries)
}

/// The manifest of snapshot `name` of a VM of `config`, sealed: its `regions`, the packs of
/// `table`, the state object `state_json` and the diff's `base`.
pub(crate) fn sealed_manifest(
    name: &str,
    config: &VmConfig,
    table: PackTable,
    regions: Vec<StoreRegion>,
    state_json: &[u8],
    base: Option<StoreBase>,
) -> StoreManifest {
    let mut manifest = StoreManifest {
        format: FORMAT.into(),
        version: VERSION,
        name: name.to_string(),
        config: config.clone(),
        chunk_bytes: CHUNK_BYTES,
        packs: table.into_ids(),
        regions,
        state_bytes: state_json.len() as u64,
        state_blake3: blake3::hash(state_json).to_hex().to_string(),
        base,
        writer: Some(guestmem_sys::release::Writer::this()),
        checksum: String::new(),
    };
    manifest.seal();
    manifest
}

/// One chunk of guest memory to store: chunk `index` of region `region`, `len` bytes at `gpa`.
pub(crate) struct Job {
    pub(crate) region: usize,
    pub(crate) index: usize,
    pub(crate) gpa: u64,
    pub(crate) len: usize,
}

/// What [`store_jobs`] put.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Counts {
    pub(crate) new_chunks: u64,
    pub(crate) new_bytes: u64,
    pub(crate) dedup: u64,
    pub(crate) packs: u64,
}

/// How [`store_jobs`] gets a chunk's bytes when it does not read them in place: into the
/// buffer, a copy (the guest may be writing its memory: the bytes hashed are the bytes stored).
pub(crate) type ReadChunk<'a> = &'a (dyn Fn(&Job, &mut [u8]) -> Result<()> + Sync);

/// One job's result: its region, its index, and its hash (`None` for a zero chunk).
type Placed = (usize, usize, Option<Hash>);

/// Stores `jobs` on `threads` threads, runs of [`PACK_CHUNKS`] at a time, each run's chunks new
/// to the store (not in `known`, which gains them) as one pack. Each chunk is read with `copy`,
/// or without it in place from `memory` (the VM is paused). Returns each job's (region, index,
/// hash; `None` for a zero chunk).
pub(crate) fn store_jobs(
    objects: &dyn ObjectStore,
    memory: &GuestMemory,
    jobs: &[Job],
    known: &Mutex<HashMap<Hash, Option<Stored>>>,
    threads: usize,
    copy: Option<ReadChunk<'_>>,
) -> Result<(Vec<Placed>, Counts)> {
    let runs: Vec<&[Job]> = jobs.chunks(PACK_CHUNKS).collect();
    let packer = Packer {
        objects,
        memory,
        known,
        copy,
        new_chunks: AtomicU64::new(0),
        new_bytes: AtomicU64::new(0),
        dedup: AtomicU64::new(0),
        packs: AtomicU64::new(0),
    };
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let first_error: Mutex<Option<Error>> = Mutex::new(None);
    let results: Mutex<Vec<Placed>> = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                let mut compressor =
                    zstd::bulk::Compressor::new(ZSTD_LEVEL).expect("a zstd compressor");
                let mut mine = Vec::new();
                let mut copied = vec![
                    0u8;
                    if copy.is_some() {
                        to_usize(CHUNK_BYTES)
                    } else {
                        0
                    }
                ];
                while !failed.load(Ordering::Relaxed) {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(r) = runs.get(i) else { break };
                    if let Err(e) = packer.run(r, &mut compressor, &mut copied, &mut mine) {
                        failed.store(true, Ordering::Relaxed);
                        first_error.lock().expect("not poisoned").get_or_insert(e);
                        break;
                    }
                }
                results.lock().expect("not poisoned").extend(mine);
            });
        }
    });
    if let Some(e) = first_error.into_inner().expect("not poisoned") {
        return Err(e);
    }
    let counts = Counts {
        new_chunks: packer.new_chunks.into_inner(),
        new_bytes: packer.new_bytes.into_inner(),
        dedup: packer.dedup.into_inner(),
        packs: packer.packs.into_inner(),
    };
    Ok((results.into_inner().expect("not poisoned"), counts))
}

/// What [`store_jobs`]'s threads share: where chunks come from and go, and the counts.
struct Packer<'a> {
    objects: &'a dyn ObjectStore,
    memory: &'a GuestMemory,
    known: &'a Mutex<HashMap<Hash, Option<Stored>>>,
    copy: Option<ReadChunk<'a>>,
    new_chunks: AtomicU64,
    new_bytes: AtomicU64,
    dedup: AtomicU64,
    packs: AtomicU64,
}

impl Packer<'_> {
    /// One run: its chunks hashed (into `mine`) and, those new to the store, compressed into
    /// one pack, put when the run is done. `copied` is the buffer a chunk is copied into.
    fn run(
        &self,
        run: &[Job],
        c: &mut zstd::bulk::Compressor<'_>,
        copied: &mut [u8],
        mine: &mut Vec<Placed>,
    ) -> Result<()> {
        let mut pack = Vec::new();
        let mut placed: Vec<(Hash, u64, u64)> = Vec::new();
        for job in run {
            let bytes = if let Some(read) = self.copy {
                read(job, &mut copied[..job.len])?;
                &copied[..job.len]
            } else {
                // SAFETY: the VM is paused (holding `&Vm` proves no vCPU of
                // guestmem's VM runs, and it has no other thread writing its
                // memory; `write_machine`'s caller paused its machine and
                // devices); the chunk is read in place (zero check, hash,
                // compression), not copied.
                unsafe { self.memory.bytes(job.gpa, job.len as u64) }?
            };
            if chunk::is_zero(bytes) {
                mine.push((job.region, job.index, None));
                continue;
            }
            let h = chunk::hash(bytes);
            mine.push((job.region, job.index, Some(h)));
            if !self.claim(h) {
                self.dedup.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let stored = chunk::encode(c, bytes);
            placed.push((h, pack.len() as u64, stored.len() as u64));
            pack.extend_from_slice(&stored);
        }
        if placed.is_empty() {
            return Ok(());
        }
        self.put_pack(&pack, placed)
    }

    /// Whether this thread is the first to store `h` (it is then known, not yet stored).
    fn claim(&self, h: Hash) -> bool {
        let mut k = self.known.lock().expect("not poisoned");
        match k.entry(h) {
            std::collections::hash_map::Entry::Occupied(_) => false,
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(None);
                true
            }
        }
    }

    /// Puts `pack`, whose chunks are `placed` (hash, offset, stored length), and records where
    /// each of them is.
    fn put_pack(&self, pack: &[u8], placed: Vec<(Hash, u64, u64)>) -> Result<()> {
        // The pack's id names its contents: the hashes of its chunks, in order.
        let mut id = blake3::Hasher::new();
        for (h, _, _) in &placed {
            id.update(h);
        }
        let id = *id.finalize().as_bytes();
        self.objects.put_chunk(&chunk::pack_key(&id), pack)?;
        self.packs.fetch_add(1, Ordering::Relaxed);
        self.new_chunks
            .fetch_add(placed.len() as u64, Ordering::Relaxed);
        self.new_bytes
            .fetch_add(pack.len() as u64, Ordering::Relaxed);
        let mut k = self.known.lock().expect("not poisoned");
        for (hash, offset, stored) in placed {
            k.insert(
                hash,
                Some(Stored {
                    hash,
                    stored,
                    loc: Loc::Pack { id, offset },
                }),
            );
        }
        Ok(())
    }
}

/// How a diff `name` of a VM of `config` names its base `base_name` (of the same store and
/// configuration, and not `name` itself).
pub(crate) fn base_of(
    objects: &dyn ObjectStore,
    name: &str,
    base_name: &str,
    config: &VmConfig,
) -> Result<StoreBase> {
    if base_name == name {
        return Err(Error::Write(format!(
            "{}/{name}: a diff cannot replace its own base",
            objects.describe()
        )));
    }
    let base = StoreManifest::load(objects, base_name)?;
    if base.config != *config || base.chunk_bytes != CHUNK_BYTES {
        return Err(Error::Write(format!(
            "{}/{base_name}: the base snapshot is of another VM configuration or chunk size",
            objects.describe()
        )));
    }
    Ok(StoreBase {
        name: base_name.to_string(),
        checksum: base.checksum,
    })
}

/// The stored bytes of the distinct chunks `manifest` itself lists.
pub fn stored_bytes(manifest: &StoreManifest) -> u64 {
    let mut seen = std::collections::HashSet::new();
    manifest
        .data_chunks()
        .filter(|c| seen.insert(c.hash))
        .map(|c| c.stored)
        .sum()
}

/// Every chunk the store holds where a snapshot can point at it: the chunks every readable
/// manifest lists (an unreadable one is skipped, its chunks then stored again), and the chunk
/// objects of a store written before packs; a chunk is pointed at only where its object or
/// pack is listed. Read under a write lease (see [`crate::gc`]): a
/// collection does not remove them meanwhile.
pub fn known_chunks(objects: &dyn ObjectStore) -> Result<HashMap<Hash, Stored>> {
    let mut known = HashMap::new();
    for o in objects.list("chunks/")? {
        if let Some(hash) = chunk::hash_of_key(&o.key) {
            known.insert(
                hash,
                Stored {
                    hash,
                    stored: o.size,
                    loc: Loc::Object,
                },
            );
        }
    }
    let names: Vec<String> = objects
        .list("snapshots/")?
        .into_iter()
        .filter_map(|o| {
            let name = o.key.strip_prefix("snapshots/")?;
            Some(name.strip_suffix("/manifest.json")?.to_string())
        })
        .collect();
    let manifests = Mutex::new(Vec::new());
    crate::pages::parallel(names, threads(objects), |name| {
        match StoreManifest::load(objects, &name) {
            Ok(m) => manifests.lock().expect("not poisoned").push(m),
            Err(e) => tracing::warn!(
                "{}: snapshot '{name}' unreadable, its chunks not reused: {}",
                objects.describe(),
                crate::chain_text(&e)
            ),
        }
        Ok(())
    })?;
    // Only chunks whose pack is there (a damaged store's missing pack is not pointed at).
    let packs: HashSet<Hash> = objects
        .list("packs/")?
        .into_iter()
        .filter_map(|o| chunk::pack_of_key(&o.key))
        .collect();
    for m in manifests.into_inner().expect("not poisoned") {
        for c in m.data_chunks() {
            if matches!(c.loc, Loc::Pack { id, .. } if packs.contains(&id)) {
                known.entry(c.hash).or_insert(c);
            }
        }
    }
    Ok(known)
}

/// Puts the state object, then the manifest (the last step: the snapshot exists from here).
pub(crate) fn commit(
    objects: &dyn ObjectStore,
    manifest: &StoreManifest,
    state: &[u8],
) -> Result<()> {
    objects.sync()?;
    objects.put(&state_key(&manifest.name), state)?;
    let json = serde_json::to_vec_pretty(manifest).expect("a manifest serializes");
    objects.put(&manifest_key(&manifest.name), &json)
}

/// A snapshot name is one path element of plain characters.
pub fn check_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name != "."
        && name != ".."
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '+' | '='));
    if ok {
        Ok(())
    } else {
        Err(Error::Location(format!(
            "'{name}': a snapshot name is one path element of letters, digits and -_.+="
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_region_adds_its_zero_and_inherited_chunks_to_the_report() {
        let mut report = StoreWriteReport::default();
        report.count_region(
            3 * CHUNK_BYTES,
            &[ChunkRef::Zero, ChunkRef::Base, ChunkRef::Zero],
        );
        report.count_region(CHUNK_BYTES, &[ChunkRef::Base]);
        assert_eq!(report.memory_bytes, 4 * CHUNK_BYTES);
        assert_eq!(report.chunks, 4);
        assert_eq!(report.zero_chunks, 2);
        assert_eq!(report.inherited_chunks, 2);
    }
}
