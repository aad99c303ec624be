//! Writing a paused VM into a store: chunks on several threads (read, zero check, BLAKE3,
//! zstd, put — each distinct chunk once; the chunks' hashes are also what a restore checks
//! memory against, so no other pass over memory is made), then the state object, then the manifest in one
//! atomic put. An interrupted write leaves chunks but no manifest: no snapshot that looks
//! complete (and [`crate::gc`] collects its chunks later).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use guestmem_memory::PAGE_SIZE;
use guestmem_tracking::DirtyBitmap;
use guestmem_vm::Vm;
use serde::Serialize;

use crate::backend::Backend;
use crate::chunk::{self, Hash, CHUNK_BYTES, ZSTD_LEVEL};
use crate::gc::Lease;
use crate::manifest::{
    manifest_key, state_key, ChunkRef, StoreBase, StoreManifest, StoreRegion, FORMAT, VERSION,
};
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
fn threads(backend: &dyn Backend) -> usize {
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    if backend.remote() {
        cores.max(8)
    } else {
        cores
    }
}

/// Writes a snapshot of `vm` (paused: holding `&Vm` proves no vCPU runs) as `name` into
/// `backend`, replacing a snapshot of that name. With `diff`, a diff over snapshot `base` of
/// the same store: only chunks holding a page that `dirty` reports (a tracker started when the
/// base was taken) are read; the others are inherited.
pub fn write(
    backend: &dyn Backend,
    name: &str,
    vm: &Vm,
    diff: Option<(&str, &[DirtyBitmap])>,
) -> Result<StoreWriteReport> {
    let t = Instant::now();
    check_name(name)?;
    let _lease = Lease::acquire(backend, "write", name)?;
    let base = match diff {
        None => None,
        Some((base_name, _)) => {
            if base_name == name {
                return Err(Error::Write(format!(
                    "{}/{name}: a diff cannot replace its own base",
                    backend.describe()
                )));
            }
            let base = StoreManifest::load(backend, base_name)?;
            if base.config != *vm.config() || base.chunk_bytes != CHUNK_BYTES {
                return Err(Error::Write(format!(
                    "{}/{base_name}: the base snapshot is of another VM configuration or chunk \
                     size",
                    backend.describe()
                )));
            }
            Some(StoreBase {
                name: base_name.to_string(),
                checksum: base.checksum,
            })
        }
    };
    let dirty = diff.map(|(_, d)| d);

    let state = vm.save_state()?;
    let state_json = serde_json::to_vec(&state).expect("VM state serializes");

    // What the store already holds: those chunks are not put again.
    let mut known: HashMap<Hash, u64> = HashMap::new();
    for o in backend.list("chunks/")? {
        if let Some(h) = chunk::hash_of_key(&o.key) {
            known.insert(h, o.size);
        }
    }

    struct Job {
        region: usize,
        index: usize,
        gpa: u64,
        len: usize,
    }
    let memory = vm.memory();
    let mut jobs = Vec::new();
    let mut entries: Vec<Vec<Option<ChunkRef>>> = Vec::new();
    for (ri, region) in memory.regions().iter().enumerate() {
        let n = region.size().div_ceil(CHUNK_BYTES) as usize;
        let mut e = vec![None; n];
        for (index, slot) in e.iter_mut().enumerate() {
            let offset = index as u64 * CHUNK_BYTES;
            let len = CHUNK_BYTES.min(region.size() - offset) as usize;
            let gpa = region.gpa() + offset;
            if let Some(dirty) = dirty {
                let written = dirty.iter().any(|d| {
                    (gpa..gpa + len as u64)
                        .step_by(PAGE_SIZE as usize)
                        .any(|p| d.contains(p))
                });
                if !written {
                    *slot = Some(ChunkRef::Base);
                    continue;
                }
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

    let threads = threads(backend);
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let first_error: Mutex<Option<Error>> = Mutex::new(None);
    let known = Mutex::new(known);
    let results: Mutex<Vec<(usize, usize, Option<Hash>)>> = Mutex::new(Vec::new());
    let (new_chunks, new_bytes, dedup) = (AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0));
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                let mut compressor =
                    zstd::bulk::Compressor::new(ZSTD_LEVEL).expect("a zstd compressor");
                let mut mine = Vec::new();
                let run = |job: &Job, c: &mut zstd::bulk::Compressor<'_>| -> Result<Option<Hash>> {
                    // SAFETY: the VM is paused (holding `&Vm` proves no vCPU runs) and
                    // guestmem's VM has no other thread writing its memory; the chunk is read
                    // in place (zero check, hash, compression) rather than copied first.
                    let bytes = unsafe { memory.bytes(job.gpa, job.len as u64) }?;
                    if chunk::is_zero(bytes) {
                        return Ok(None);
                    }
                    let h = chunk::hash(bytes);
                    let claimed = {
                        let mut k = known.lock().expect("not poisoned");
                        match k.entry(h) {
                            std::collections::hash_map::Entry::Occupied(_) => false,
                            std::collections::hash_map::Entry::Vacant(v) => {
                                v.insert(0);
                                true
                            }
                        }
                    };
                    if claimed {
                        let stored = chunk::encode(c, bytes);
                        backend.put_chunk(&chunk::key(&h), &stored)?;
                        known
                            .lock()
                            .expect("not poisoned")
                            .insert(h, stored.len() as u64);
                        new_chunks.fetch_add(1, Ordering::Relaxed);
                        new_bytes.fetch_add(stored.len() as u64, Ordering::Relaxed);
                    } else {
                        dedup.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(Some(h))
                };
                while !failed.load(Ordering::Relaxed) {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(job) = jobs.get(i) else { break };
                    match run(job, &mut compressor) {
                        Ok(h) => mine.push((job.region, job.index, h)),
                        Err(e) => {
                            failed.store(true, Ordering::Relaxed);
                            first_error.lock().expect("not poisoned").get_or_insert(e);
                            break;
                        }
                    }
                }
                results.lock().expect("not poisoned").extend(mine);
            });
        }
    });
    if let Some(e) = first_error.into_inner().expect("not poisoned") {
        return Err(e);
    }
    let known = known.into_inner().expect("not poisoned");
    for (ri, ci, h) in results.into_inner().expect("not poisoned") {
        entries[ri][ci] = Some(match h {
            None => ChunkRef::Zero,
            Some(hash) => ChunkRef::Data {
                hash,
                stored: known[&hash],
            },
        });
    }

    let mut report = StoreWriteReport {
        snapshot: format!("{}/{name}", backend.describe()),
        threads,
        new_chunks: new_chunks.into_inner(),
        new_stored_bytes: new_bytes.into_inner(),
        deduplicated_chunks: dedup.into_inner(),
        ..Default::default()
    };
    let regions: Vec<StoreRegion> = memory
        .regions()
        .iter()
        .zip(entries)
        .map(|(region, e)| {
            let chunks: Vec<ChunkRef> = e
                .into_iter()
                .map(|c| c.expect("every chunk done"))
                .collect();
            report.memory_bytes += region.size();
            report.chunks += chunks.len() as u64;
            report.zero_chunks += chunks.iter().filter(|c| **c == ChunkRef::Zero).count() as u64;
            report.inherited_chunks +=
                chunks.iter().filter(|c| **c == ChunkRef::Base).count() as u64;
            StoreRegion {
                spec: region.spec().clone(),
                digest: None,
                chunks,
            }
        })
        .collect();
    let mut manifest = StoreManifest {
        format: FORMAT.into(),
        version: VERSION,
        name: name.to_string(),
        config: vm.config().clone(),
        chunk_bytes: CHUNK_BYTES,
        regions,
        state_bytes: state_json.len() as u64,
        state_blake3: blake3::hash(&state_json).to_hex().to_string(),
        base,
        checksum: String::new(),
    };
    manifest.seal();
    report.stored_bytes = stored_bytes(&manifest);
    commit(backend, &manifest, &state_json)?;
    report.write_ms = t.elapsed().as_secs_f64() * 1e3;
    Ok(report)
}

/// The stored bytes of the distinct chunks `manifest` itself lists.
pub fn stored_bytes(manifest: &StoreManifest) -> u64 {
    let mut seen = std::collections::HashSet::new();
    manifest
        .data_chunks()
        .filter(|(h, _)| seen.insert(*h))
        .map(|(_, n)| n)
        .sum()
}

/// Puts the state object, then the manifest (the last step: the snapshot exists from here).
pub(crate) fn commit(backend: &dyn Backend, manifest: &StoreManifest, state: &[u8]) -> Result<()> {
    backend.sync()?;
    backend.put(&state_key(&manifest.name), state)?;
    let json = serde_json::to_vec_pretty(manifest).expect("a manifest serializes");
    backend.put(&manifest_key(&manifest.name), &json)
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
