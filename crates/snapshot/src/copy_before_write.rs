//! A live snapshot's copy-before-write (see [`crate::live`] for when it is used and why): the
//! pause write-protects the chunks the snapshot needs (userfaultfd, see
//! `guestmem_paging::write_protect`) and the guest resumes at once; the chunks are then stored
//! from guest memory in order, each unprotected as soon as its bytes are copied out, while a
//! write to a chunk not stored yet is held until the handler has copied that chunk (the bytes
//! it had at the pause) aside and unprotected it. Those copies are stored first, to give their
//! memory back; when they reach [`crate::live::LiveOptions::held_bytes`], the handler waits
//! for the store to drain some before it copies another, so the guest's writes, not host
//! memory, absorb a store slower than the guest.
//!
//! Every chunk the snapshot needs is in exactly one state: protected (its bytes in guest
//! memory are those at the pause, since no write gets through), held (a copy of them),
//! or taken (stored, or being stored, from one of the two). A per-chunk lock makes the
//! handler's copy and the store's read of one chunk exclusive; the store takes each chunk
//! once, so every chunk is stored once (the bytes stored are a paused write's, plus nothing).

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use guestmem_memory::{GuestMemory, PAGE_SIZE};
use guestmem_paging::write_protect::{WpHandle, WpRange, WriteProtect};
use guestmem_sys::to_usize;

use crate::sink::{ChunkSource, LiveSink};
use crate::{Error, Result};

/// One needed chunk's state (see the module docs).
enum Slot {
    /// Not part of this snapshot (a diff's clean chunk), never protected.
    Unneeded,
    /// Write-protected: guest memory holds its bytes at the pause.
    Protected,
    /// Copied aside by the handler before a write; unprotected.
    Held(Vec<u8>),
    /// Taken by the store; unprotected.
    Taken,
}

/// What the handler copied and is holding.
#[derive(Default)]
struct Held {
    /// Chunks copied before their write, oldest first (some may be taken since).
    queue: VecDeque<(usize, usize)>,
    bytes: u64,
    peak: u64,
    /// Pages in the chunks the handler copied.
    pages: u64,
    /// Set when the snapshot ends (done or failed): the handler no longer waits or copies.
    stopping: bool,
}

/// Before the pause: the pages the guest wrote since they were protected (each unprotected
/// at its write), to protect again.
#[derive(Default)]
struct Phase {
    /// Set at the pause: from then on a fault means copy-before-write.
    snapshot: bool,
    /// Host ranges (a page of the region's size each) unprotected since their last
    /// protection.
    rearm: Vec<(usize, usize)>,
}

/// The chunks of one copy-before-write snapshot, shared by the store and the handler.
pub(crate) struct Chunks {
    memory: Arc<GuestMemory>,
    phase: Mutex<Phase>,
    chunk: u64,
    slots: Vec<Vec<Mutex<Slot>>>,
    held: Mutex<Held>,
    drained: Condvar,
    budget: u64,
    handle: WpHandle,
}

/// What the copy-before-write part of a live snapshot did.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct CbwStats {
    pub(crate) write_faults: u64,
    pub(crate) copied_pages: u64,
    pub(crate) held_peak_bytes: u64,
    pub(crate) chunks: u64,
    pub(crate) bytes: u64,
}

/// The write-protect registration of `memory`'s regions that `pick` selects (before the pause;
/// nothing is protected yet), with the chunk bookkeeping and the fault handler started.
pub(crate) struct Armed {
    wp: WriteProtect,
    chunks: Arc<Chunks>,
    /// The registered ranges (host address, bytes).
    ranges: Vec<(usize, usize)>,
}

/// How the protection was set up: before the pause, and within it.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct ArmStats {
    /// Protecting all memory, while the guest ran, in ms.
    pub(crate) pre_arm_ms: f64,
    /// Rounds of protecting again what the guest wrote meanwhile, before the pause.
    pub(crate) rearm_rounds: u64,
}

impl Chunks {
    fn len_of(&self, ri: usize, ci: usize) -> u64 {
        let size = self.memory.regions()[ri].size();
        self.chunk.min(size - ci as u64 * self.chunk)
    }

    fn host_of(&self, ri: usize, ci: usize) -> usize {
        self.memory.regions()[ri].host_addr() as usize + to_usize(ci as u64 * self.chunk)
    }

    /// The region and chunk of host address `addr`.
    fn locate(&self, addr: usize) -> Option<(usize, usize)> {
        self.memory
            .regions()
            .iter()
            .enumerate()
            .find_map(|(ri, r)| {
                let host = r.host_addr() as usize;
                (addr >= host && addr < host + to_usize(r.size()))
                    .then(|| (ri, to_usize((addr - host) as u64 / self.chunk)))
            })
    }

    /// Copies chunk `(ri, ci)` out of guest memory into `buf` (its length).
    fn copy_out(&self, ri: usize, ci: usize, buf: &mut [u8]) -> Result<()> {
        let gpa = self.memory.regions()[ri].gpa() + ci as u64 * self.chunk;
        Ok(GuestMemory::read(&self.memory, gpa, buf)?)
    }

    /// The handler's work for a write at `addr`: a protected chunk copied aside and
    /// unprotected (once the held copies leave room), anything else only woken.
    fn on_fault(&self, addr: usize) -> std::result::Result<(), String> {
        let Some((ri, ci)) = self.locate(addr) else {
            let page = addr & !(to_usize(PAGE_SIZE) - 1);
            return self
                .handle
                .wake(page, to_usize(PAGE_SIZE))
                .map_err(|e| e.to_string());
        };
        {
            let mut phase = self.phase.lock().expect("not poisoned");
            if !phase.snapshot {
                // Before the pause: the write is part of what the snapshot will hold; the
                // page is let go now and protected again before (or at) the pause.
                let granule = to_usize(self.memory.regions()[ri].backend().page_size());
                let page = addr & !(granule - 1);
                self.handle
                    .unprotect(page, granule)
                    .map_err(|e| e.to_string())?;
                phase.rearm.push((page, granule));
                return Ok(());
            }
        }
        let unit = self.unit(ri, ci);
        let protected = unit
            .chunks
            .clone()
            .filter(|&c| {
                matches!(
                    *self.slots[ri][c].lock().expect("not poisoned"),
                    Slot::Protected
                )
            })
            .map(|c| self.len_of(ri, c))
            .sum();
        self.wait_for_room(protected);
        // Every chunk of the unit still protected is copied, in order, each under its lock,
        // all locks held until the unit is unprotected (the store takes one lock at a time).
        let mut slots: Vec<_> = unit
            .chunks
            .clone()
            .map(|c| (c, self.slots[ri][c].lock().expect("not poisoned")))
            .collect();
        let mut copied = Vec::new();
        for (c, slot) in &mut slots {
            if matches!(**slot, Slot::Protected) {
                let mut copy = vec![0u8; to_usize(self.len_of(ri, *c))];
                self.copy_out(ri, *c, &mut copy)
                    .map_err(|e| format!("copying a chunk before its write: {e}"))?;
                **slot = Slot::Held(copy);
                copied.push((ri, *c));
            }
        }
        self.handle
            .unprotect(unit.host, unit.len)
            .map_err(|e| e.to_string())?;
        drop(slots);
        let mut held = self.held.lock().expect("not poisoned");
        for &(ri, c) in &copied {
            let len = self.len_of(ri, c);
            held.queue.push_back((ri, c));
            held.bytes += len;
            held.pages += len / PAGE_SIZE;
        }
        held.peak = held.peak.max(held.bytes);
        Ok(())
    }

    /// The unit of protection around chunk `(ri, ci)`: the chunk itself, or on a region of
    /// huge pages larger than a chunk, the huge page holding it (write-protect applies to a
    /// whole huge page).
    fn unit(&self, ri: usize, ci: usize) -> Unit {
        let region = &self.memory.regions()[ri];
        let per = to_usize((region.backend().page_size() / self.chunk).max(1));
        let first = ci / per * per;
        let last = (first + per).min(self.slots[ri].len());
        let len = (last - 1 - first) as u64 * self.chunk + self.len_of(ri, last - 1);
        Unit {
            chunks: first..last,
            host: self.host_of(ri, first),
            len: to_usize(len),
        }
    }

    /// Waits (bounded by the store's progress, or the snapshot's end) until `len` more bytes
    /// of held copies fit the budget.
    fn wait_for_room(&self, len: u64) {
        let mut held = self.held.lock().expect("not poisoned");
        while !held.stopping && held.bytes > 0 && held.bytes + len > self.budget {
            held = self
                .drained
                .wait_timeout(held, Duration::from_millis(50))
                .expect("not poisoned")
                .0;
        }
    }

    /// Ends the handler's waits and copies (the snapshot is done or failed).
    fn stop(&self) {
        self.held.lock().expect("not poisoned").stopping = true;
        self.drained.notify_all();
    }
}

impl ChunkSource for Chunks {
    /// Takes the chunk: its held copy, or its bytes from guest memory (still protected, so
    /// those at the pause), then unprotects its unit once no chunk of it is protected.
    fn read(&self, region: usize, index: usize, _gpa: u64, buf: &mut [u8]) -> Result<()> {
        let mut slot = self.slots[region][index].lock().expect("not poisoned");
        match std::mem::replace(&mut *slot, Slot::Taken) {
            Slot::Protected => {
                self.copy_out(region, index, buf)?;
                drop(slot);
                let unit = self.unit(region, index);
                let done = unit.chunks.clone().all(|c| {
                    !matches!(
                        *self.slots[region][c].lock().expect("not poisoned"),
                        Slot::Protected
                    )
                });
                if done {
                    self.handle.unprotect(unit.host, unit.len)?;
                }
            }
            Slot::Held(copy) => {
                buf.copy_from_slice(&copy);
                drop(slot);
                self.held.lock().expect("not poisoned").bytes -= copy.len() as u64;
                self.drained.notify_all();
            }
            Slot::Taken | Slot::Unneeded => {
                return Err(Error::Write(format!(
                    "region {region} chunk {index}: taken twice, or not part of the snapshot"
                )))
            }
        }
        Ok(())
    }
}

/// Chunks that write-protect lets go together, and their host range.
struct Unit {
    chunks: std::ops::Range<usize>,
    host: usize,
    len: usize,
}

impl Armed {
    /// Registers the regions `pick` selects for write-protect and starts the handler; the
    /// chunks stay unprotected until [`Armed::protect`].
    pub(crate) fn register(
        memory: &Arc<GuestMemory>,
        chunk: u64,
        budget: u64,
        pick: impl Fn(&guestmem_memory::Region) -> bool,
    ) -> Result<Armed> {
        let ranges: Vec<WpRange> = memory
            .regions()
            .iter()
            .filter(|r| pick(r))
            .map(|r| WpRange {
                name: r.name().to_string(),
                addr: r.host_addr() as usize,
                len: to_usize(r.size()),
                file_backed: r.backend().is_shared(),
            })
            .collect();
        let hosts = ranges.iter().map(|r| (r.addr, r.len)).collect();
        let mut wp = WriteProtect::register(ranges)?;
        let chunks = Arc::new(Chunks {
            memory: memory.clone(),
            phase: Mutex::new(Phase::default()),
            chunk,
            slots: memory
                .regions()
                .iter()
                .map(|r| {
                    (0..r.size().div_ceil(chunk))
                        .map(|_| Mutex::new(Slot::Unneeded))
                        .collect()
                })
                .collect(),
            held: Mutex::new(Held::default()),
            drained: Condvar::new(),
            budget: budget.max(chunk),
            handle: wp.handle(),
        });
        let handler = chunks.clone();
        wp.serve(move |_, addr| handler.on_fault(addr))?;
        Ok(Armed {
            wp,
            chunks,
            ranges: hosts,
        })
    }

    /// Before the pause, while the guest runs: protects all the registered memory (what takes
    /// time: every page-table entry, and KVM's mappings of it dropped), then protects again,
    /// in rounds, the pages the guest wrote meanwhile, until they are few (`rearm_bytes`) or
    /// the rounds run out. What is left is protected within the pause
    /// ([`Armed::protect`]), in proportion to those few pages, not to memory.
    pub(crate) fn pre_arm(&self, rearm_bytes: u64, max_rounds: u64) -> Result<ArmStats> {
        let t = Instant::now();
        for &(addr, len) in &self.ranges {
            self.wp.protect(addr, len)?;
        }
        let mut stats = ArmStats {
            pre_arm_ms: t.elapsed().as_secs_f64() * 1e3,
            ..ArmStats::default()
        };
        while stats.rearm_rounds < max_rounds {
            let pages = std::mem::take(&mut self.chunks.phase.lock().expect("not poisoned").rearm);
            if pages.iter().map(|p| p.1 as u64).sum::<u64>() <= rearm_bytes {
                self.chunks
                    .phase
                    .lock()
                    .expect("not poisoned")
                    .rearm
                    .extend(pages);
                break;
            }
            self.protect_pages(pages, |_| true)?;
            stats.rearm_rounds += 1;
        }
        Ok(stats)
    }

    /// Protects the pages `pages` (host address and length, any order) that `keep` selects,
    /// runs of neighbours in one call each. Returns the bytes protected.
    fn protect_pages(
        &self,
        mut pages: Vec<(usize, usize)>,
        keep: impl Fn(usize) -> bool,
    ) -> Result<u64> {
        pages.sort_unstable();
        pages.dedup();
        pages.retain(|&(p, _)| keep(p));
        let mut i = 0;
        let mut bytes = 0;
        while i < pages.len() {
            let (start, mut end) = (pages[i].0, pages[i].0 + pages[i].1);
            i += 1;
            while i < pages.len() && pages[i].0 == end {
                end += pages[i].1;
                i += 1;
            }
            self.wp.protect(start, end - start)?;
            bytes += (end - start) as u64;
        }
        Ok(bytes)
    }

    /// During the pause (after [`Armed::pre_arm`]): from now on a write copies its chunk
    /// first; the chunks of `todo` (sorted) are the snapshot's, and the pages written since
    /// their last protection are protected again (those of `todo`'s chunks). Returns the
    /// bytes protected again.
    pub(crate) fn protect(&self, todo: &[(usize, usize)]) -> Result<u64> {
        let c = &self.chunks;
        let mut phase = c.phase.lock().expect("not poisoned");
        phase.snapshot = true;
        for &(ri, ci) in todo {
            *c.slots[ri][ci].lock().expect("not poisoned") = Slot::Protected;
        }
        let pages = std::mem::take(&mut phase.rearm);
        self.protect_pages(pages, |p| {
            c.locate(p).is_some_and(|(ri, ci)| {
                matches!(
                    *c.slots[ri][ci].lock().expect("not poisoned"),
                    Slot::Protected
                )
            })
        })
    }

    /// After the pause: lets the chunks go that the snapshot does not need (a diff's clean
    /// ones), whole units of them, runs of units in one call each.
    fn release_unneeded(&self) -> Result<()> {
        let c = &self.chunks;
        for (ri, slots) in c.slots.iter().enumerate() {
            let host = c.memory.regions()[ri].host_addr() as usize;
            if !self.ranges.iter().any(|&(a, _)| a == host) {
                continue;
            }
            let unneeded = |u: &Unit| {
                u.chunks
                    .clone()
                    .all(|i| matches!(*slots[i].lock().expect("not poisoned"), Slot::Unneeded))
            };
            let mut run: Option<(usize, usize)> = None;
            let mut ci = 0;
            while ci < slots.len() {
                let unit = c.unit(ri, ci);
                ci = unit.chunks.end;
                match (unneeded(&unit), run) {
                    (true, Some((start, len))) if start + len == unit.host => {
                        run = Some((start, len + unit.len));
                    }
                    (true, _) => {
                        if let Some((start, len)) = run.replace((unit.host, unit.len)) {
                            c.handle.unprotect(start, len)?;
                        }
                    }
                    (false, _) => {
                        if let Some((start, len)) = run.take() {
                            c.handle.unprotect(start, len)?;
                        }
                    }
                }
            }
            if let Some((start, len)) = run {
                c.handle.unprotect(start, len)?;
            }
        }
        Ok(())
    }

    /// After the pause: stores every chunk of `todo` into `sink` (see the module docs), the
    /// held copies first, `batch` chunks per call; then lets everything go.
    pub(crate) fn store<S: LiveSink>(
        self,
        sink: &mut S,
        todo: &[(usize, usize)],
        batch: usize,
    ) -> Result<CbwStats> {
        let stored = self
            .release_unneeded()
            .and_then(|()| self.store_all(sink, todo, batch.max(1)));
        self.chunks.stop();
        let held = {
            let h = self.chunks.held.lock().expect("not poisoned");
            (h.pages, h.peak)
        };
        let faults = self.wp.faults();
        let released = self.wp.finish();
        let (chunks, bytes) = stored?;
        released?;
        Ok(CbwStats {
            write_faults: faults,
            copied_pages: held.0,
            held_peak_bytes: held.1,
            chunks,
            bytes,
        })
    }

    fn store_all<S: LiveSink>(
        &self,
        sink: &mut S,
        todo: &[(usize, usize)],
        batch: usize,
    ) -> Result<(u64, u64)> {
        let c = &self.chunks;
        let memory = c.memory.clone();
        let mut claimed: Vec<Vec<bool>> = c.slots.iter().map(|s| vec![false; s.len()]).collect();
        let (mut next, mut chunks, mut bytes) = (0, 0u64, 0u64);
        loop {
            if let Some(why) = self.wp.failure() {
                return Err(Error::Write(format!(
                    "the write-protect handler failed: {why}"
                )));
            }
            let mut this: Vec<(usize, usize)> = Vec::with_capacity(batch);
            {
                let mut held = c.held.lock().expect("not poisoned");
                while this.len() < batch {
                    let Some((ri, ci)) = held.queue.pop_front() else {
                        break;
                    };
                    if !std::mem::replace(&mut claimed[ri][ci], true) {
                        this.push((ri, ci));
                    }
                }
            }
            while this.len() < batch && next < todo.len() {
                let (ri, ci) = todo[next];
                next += 1;
                if !std::mem::replace(&mut claimed[ri][ci], true) {
                    this.push((ri, ci));
                }
            }
            if this.is_empty() {
                return Ok((chunks, bytes));
            }
            this.sort_unstable();
            bytes += sink.store(&memory, &**c, &this, None)?;
            chunks += this.len() as u64;
        }
    }
}
