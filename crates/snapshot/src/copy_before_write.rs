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

use crate::live::{ChunkSource, LiveSink};
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

/// The chunks of one copy-before-write snapshot, shared by the store and the handler.
pub(crate) struct Chunks {
    memory: Arc<GuestMemory>,
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
        let page = addr & !(to_usize(PAGE_SIZE) - 1);
        let Some((ri, ci)) = self.locate(addr) else {
            return self
                .handle
                .wake(page, to_usize(PAGE_SIZE))
                .map_err(|e| e.to_string());
        };
        let len = self.len_of(ri, ci);
        self.wait_for_room(len);
        let mut slot = self.slots[ri][ci].lock().expect("not poisoned");
        if !matches!(*slot, Slot::Protected) {
            drop(slot);
            return self
                .handle
                .wake(page, to_usize(PAGE_SIZE))
                .map_err(|e| e.to_string());
        }
        let mut copy = vec![0u8; to_usize(len)];
        self.copy_out(ri, ci, &mut copy)
            .map_err(|e| format!("copying a chunk before its write: {e}"))?;
        self.handle
            .unprotect(self.host_of(ri, ci), to_usize(len))
            .map_err(|e| e.to_string())?;
        *slot = Slot::Held(copy);
        drop(slot);
        let mut held = self.held.lock().expect("not poisoned");
        held.queue.push_back((ri, ci));
        held.bytes += len;
        held.peak = held.peak.max(held.bytes);
        held.pages += len / PAGE_SIZE;
        Ok(())
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
    /// those at the pause), then unprotects it.
    fn read(&self, region: usize, index: usize, _gpa: u64, buf: &mut [u8]) -> Result<()> {
        let mut slot = self.slots[region][index].lock().expect("not poisoned");
        match std::mem::replace(&mut *slot, Slot::Taken) {
            Slot::Protected => {
                self.copy_out(region, index, buf)?;
                self.handle
                    .unprotect(self.host_of(region, index), buf.len())?;
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
        let mut wp = WriteProtect::register(ranges)?;
        let chunks = Arc::new(Chunks {
            memory: memory.clone(),
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
        Ok(Armed { wp, chunks })
    }

    /// During the pause: write-protects `todo` (sorted), runs of consecutive chunks in one
    /// call each. Returns how long that took, in ms.
    pub(crate) fn protect(&self, todo: &[(usize, usize)]) -> Result<f64> {
        let t = Instant::now();
        let c = &self.chunks;
        let mut i = 0;
        while i < todo.len() {
            let (ri, first) = todo[i];
            let mut end = i + 1;
            while end < todo.len() && todo[end] == (ri, first + (end - i)) {
                end += 1;
            }
            for ci in first..first + (end - i) {
                *c.slots[ri][ci].lock().expect("not poisoned") = Slot::Protected;
            }
            let last = first + (end - i) - 1;
            let len = (last - first) as u64 * c.chunk + c.len_of(ri, last);
            self.wp.protect(c.host_of(ri, first), to_usize(len))?;
            i = end;
        }
        Ok(t.elapsed().as_secs_f64() * 1e3)
    }

    /// After the pause: stores every chunk of `todo` into `sink` (see the module docs), the
    /// held copies first, `batch` chunks per call; then lets everything go.
    pub(crate) fn store<S: LiveSink>(
        self,
        sink: &mut S,
        todo: &[(usize, usize)],
        batch: usize,
    ) -> Result<CbwStats> {
        let stored = self.store_all(sink, todo, batch.max(1));
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
