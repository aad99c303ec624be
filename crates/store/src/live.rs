//! Live snapshots into a store: the rounds of `guestmem_snapshot::live` (see
//! there for the design and why), each round's chunks hashed, compressed and put as packs
//! while the guest runs, a chunk dirtied again stored again under its new hash; the manifest
//! names each chunk's last version, and is put last, as a paused write's is. The versions a
//! later round replaced stay in their packs until [`crate::gc`] collects them.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use guestmem_contract::component::{Components, Machine};
use guestmem_memory::GuestMemory;
use guestmem_snapshot::live::{capture, ChunkSource, LiveOptions, LiveReport, LiveSink};
use guestmem_sys::to_usize;
use guestmem_tracking::{DirtyBitmap, Tracker};

use crate::chunk::{Hash, Stored, CHUNK_BYTES};
use crate::gc::Lease;
use crate::manifest::{ChunkRef, PackTable, StoreRegion};
use crate::objects::ObjectStore;
use crate::write::{
    base_of, check_name, commit, known_claims, saved_state_json, sealed_manifest, store_jobs,
    stored_bytes, threads, Counts, Job, StoreWriteReport,
};
use crate::{Error, Result};

/// What [`write_machine_live`] did.
#[derive(Debug)]
pub struct StoreLiveWrite {
    /// The snapshot as written; its counts of new chunks and bytes cover every round (a chunk
    /// stored again counts again).
    pub report: StoreWriteReport,
    /// The rounds and the pause.
    pub live: LiveReport,
    /// With [`LiveOptions::keep_tracking`]: the tracker, reporting writes since the pause.
    pub tracker: Option<Tracker>,
}

/// The chunks put so far, and what each chunk of guest memory holds now.
struct StoreSink<'a> {
    objects: &'a dyn ObjectStore,
    threads: usize,
    known: Mutex<HashMap<Hash, Option<Stored>>>,
    /// Per region, per chunk: `None` not stored yet, `Some(None)` zero, else its hash.
    chunks: Vec<Vec<Option<Option<Hash>>>>,
    counts: Counts,
    /// The store's own error, when a round failed on it.
    failed: Option<Error>,
}

impl LiveSink for StoreSink<'_> {
    fn chunk_bytes(&self) -> u64 {
        CHUNK_BYTES
    }

    /// Every chunk is stored whole (hashed and compressed).
    fn cost(&self, chunks: u64, _dirty_bytes: u64) -> u64 {
        chunks * CHUNK_BYTES
    }

    /// A pack of chunks per writer thread: the store writes one pack per thread at a time,
    /// and a batch of one pack kept every thread but one idle.
    fn batch_chunks(&self) -> usize {
        self.threads.max(1) * crate::write::PACK_CHUNKS
    }

    fn store(
        &mut self,
        memory: &GuestMemory,
        source: &dyn ChunkSource,
        chunks: &[(usize, usize)],
        _dirty: Option<&[DirtyBitmap]>,
    ) -> guestmem_snapshot::Result<u64> {
        let regions = memory.regions();
        let jobs: Vec<Job> = chunks
            .iter()
            .map(|&(region, index)| {
                let r = &regions[region];
                let offset = index as u64 * CHUNK_BYTES;
                Job {
                    region,
                    index,
                    gpa: r.gpa() + offset,
                    len: to_usize(CHUNK_BYTES.min(r.size() - offset)),
                }
            })
            .collect();
        let read = |job: &Job, buf: &mut [u8]| -> Result<()> {
            Ok(source.read(job.region, job.index, job.gpa, buf)?)
        };
        match store_jobs(
            self.objects,
            memory,
            &jobs,
            &self.known,
            self.threads,
            Some(&read),
        ) {
            Ok((results, counts)) => {
                for (ri, ci, h) in results {
                    self.chunks[ri][ci] = Some(h);
                }
                self.counts.new_chunks += counts.new_chunks;
                self.counts.new_bytes += counts.new_bytes;
                self.counts.dedup += counts.dedup;
                self.counts.packs += counts.packs;
                Ok(counts.new_bytes)
            }
            Err(e) => {
                let message = format!(
                    "{}: a round's chunks were not stored",
                    self.objects.describe()
                );
                self.failed = Some(e);
                Err(guestmem_snapshot::Error::Write(message))
            }
        }
    }
}

/// Writes a snapshot of the running `machine` and its `components` as `name` into `objects`
/// while they run (see the module docs); they run again on return, error or not. A snapshot
/// of that name is replaced only when the new manifest is put; a failed write puts none. With
/// `base` (a snapshot of the same store, and the tracker started when it was taken), a diff
/// that stores only the chunks written since.
pub fn write_machine_live<M: Machine + ?Sized>(
    objects: &dyn ObjectStore,
    name: &str,
    machine: &mut M,
    components: &mut Components<'_>,
    base: Option<(&str, Tracker)>,
    opts: &LiveOptions,
) -> Result<StoreLiveWrite> {
    let t = Instant::now();
    check_name(name)?;
    let _lease = Lease::acquire(objects, "write", name)?;
    let (base, tracker) = match base {
        None => (None, None),
        Some((base_name, tracker)) => match base_of(objects, name, base_name, machine.config()) {
            Ok(b) => (Some(b), Some(tracker)),
            Err(e) => {
                let _ = tracker.stop();
                return Err(e);
            }
        },
    };
    let mut sink = StoreSink {
        objects,
        threads: threads(objects),
        known: Mutex::new(known_claims(objects)?),
        chunks: machine
            .memory()
            .regions()
            .iter()
            .map(|r| vec![None; to_usize(r.size().div_ceil(CHUNK_BYTES))])
            .collect(),
        counts: Counts::default(),
        failed: None,
    };
    let captured = match capture(machine, components, &mut sink, tracker, opts) {
        Ok(c) => c,
        Err(e) => return Err(sink.failed.take().unwrap_or(Error::Snapshot(e))),
    };
    let state_json = saved_state_json(captured.machine, captured.components);
    let diff = base.is_some();
    let known = sink.known.into_inner().expect("not poisoned");
    let mut table = PackTable::default();
    let mut report = StoreWriteReport::new(objects, name, sink.threads, sink.counts);
    let mut regions = Vec::new();
    for (region, chunks) in machine.memory().regions().iter().zip(sink.chunks) {
        let mut refs = Vec::with_capacity(chunks.len());
        for (ci, c) in chunks.into_iter().enumerate() {
            refs.push(match c {
                None if diff => ChunkRef::Base,
                None => {
                    return Err(Error::Write(format!(
                        "{}/{name}: region '{}' chunk {ci} was never stored",
                        objects.describe(),
                        region.name()
                    )))
                }
                Some(None) => ChunkRef::Zero,
                Some(Some(h)) => table.entry(&known[&h].expect("every claimed chunk was put")),
            });
        }
        report.count_region(region.size(), &refs);
        regions.push(StoreRegion {
            spec: region.spec().clone(),
            digest: None,
            chunks: refs,
        });
    }
    let manifest = sealed_manifest(name, machine.config(), table, regions, &state_json, base);
    report.stored_bytes = stored_bytes(&manifest);
    if let Err(e) = commit(objects, &manifest, &state_json) {
        if let Some(tracker) = captured.tracker {
            let _ = tracker.stop();
        }
        return Err(e);
    }
    report.write_ms = t.elapsed().as_secs_f64() * 1e3;
    let mut live = captured.report;
    live.total_ms = report.write_ms;
    Ok(StoreLiveWrite {
        report,
        live,
        tracker: captured.tracker,
    })
}
