//! A cache of host mappings for the VMM's device accesses: the userspace counterpart of KVM's
//! `gfn_to_pfn_cache` (the mapping cache).
//!
//! A [`CachedMapping`] covers one guest physical range (a virtqueue, a status page, a clock
//! page). It keeps the host pointer of that range and the slot generation it was checked at, and
//! revalidates (a fresh lookup in the slot table) only when the generation changed: every
//! memslot change and every discard of guest pages bumps it (see `MemslotManager::commit`).
//! Accesses are bounds-checked and copy through raw pointers (volatile for the `u64` accessors);
//! no Rust reference into guest memory is ever made. Writes mark the region's VMM dirty marks.
//!
//! # Concurrency
//!
//! Device threads use handles while another thread changes memslots. Two rules make that safe:
//!
//! * **The host mapping outlives every handle that may use it.** A handle pins the slot's
//!   `Arc<Region>`; a removed region is unmapped only when the last handle refreshed away from it.
//! * **No access straddles a change.** Each handle has an `inflight` flag. An access sets it,
//!   then loads the generation; only if that equals the handle's generation does it touch
//!   memory, then it clears the flag (Release). A change, under the slot table's write lock,
//!   bumps the generation (SeqCst), runs `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)` (a full
//!   fence on every running thread of the process) and then waits until every handle
//!   overlapping the affected range has its flag clear, before it tells KVM or discards pages.
//!   This is the store-then-load (Dekker) pattern with an asymmetric fence, as in userspace
//!   RCU: the access side has only a compiler fence between its flag store and its generation
//!   load, and the membarrier makes it a full fence whenever a change needs it. So either the
//!   access saw the new generation (and revalidates, which takes the table's read lock and so
//!   waits for the change to finish), or the change saw its flag and waits for it to end. A
//!   write never lands in a slot after its removal, a move or a discard began, and an access
//!   to a removed range gets [`Error::NoMemslot`], not memory.
//!
//! The fast path is two plain stores, one load and the copy (plus the dirty mark for writes):
//! no lock, no atomic read-modify-write, and no shared cache line that changes except the
//! generation. A handle is used by one thread at a time (it is `Send`, not `Sync`); make one
//! handle per device thread.

use guestmem_sys::to_usize;
use std::cell::RefCell;
use std::sync::atomic::{compiler_fence, AtomicBool, Ordering};
use std::sync::Arc;

use crate::{Error, MemslotManager, Region, Result};

/// What the manager knows of a handle: its guest range and whether it is inside an access.
#[derive(Debug)]
pub(crate) struct HandleState {
    gpa: u64,
    len: u64,
    inflight: AtomicBool,
}

impl HandleState {
    pub(crate) fn overlaps(&self, gpa: u64, len: u64) -> bool {
        self.gpa < gpa.saturating_add(len) && gpa < self.gpa + self.len
    }

    /// Spins until the handle's current access (if any) has ended.
    pub(crate) fn wait_idle(&self) {
        let mut spins = 0u32;
        while self.inflight.load(Ordering::Acquire) {
            spins += 1;
            if spins < 1000 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }
}

/// The host mapping a handle last validated.
#[derive(Debug)]
struct Pinned {
    generation: u64,
    host: *mut u8,
    /// Keeps the mapping alive, and receives the VMM dirty marks.
    region: Arc<Region>,
    region_offset: u64,
}

/// A guest physical range that device code accesses again and again. Made by
/// [`MemslotManager::map`].
#[derive(Debug)]
pub struct CachedMapping {
    manager: Arc<MemslotManager>,
    state: Arc<HandleState>,
    pinned: RefCell<Option<Pinned>>,
}

// SAFETY: the raw pointer in `pinned` points into a mapping kept alive by the `Arc<Region>` next
// to it; moving the handle to another thread moves that ownership with it. The handle is not
// `Sync` (RefCell), so only one thread accesses through it at a time.
unsafe impl Send for CachedMapping {}

impl CachedMapping {
    pub(crate) fn new(manager: Arc<MemslotManager>, gpa: u64, len: u64) -> Result<CachedMapping> {
        if gpa.checked_add(len).is_none() || len == 0 {
            return Err(Error::NoMemslot { gpa, len });
        }
        let handle = CachedMapping {
            manager,
            state: Arc::new(HandleState {
                gpa,
                len,
                inflight: AtomicBool::new(false),
            }),
            pinned: RefCell::new(None),
        };
        handle.refresh()?;
        Ok(handle)
    }

    pub(crate) fn state(&self) -> &Arc<HandleState> {
        &self.state
    }

    /// The guest physical address of the range's first byte.
    pub fn gpa(&self) -> u64 {
        self.state.gpa
    }

    /// The range's length in bytes.
    pub fn len(&self) -> u64 {
        self.state.len
    }

    /// Whether it holds no mapping.
    pub fn is_empty(&self) -> bool {
        self.state.len == 0
    }

    /// Reads the little-endian u64 at `offset` in the range (volatile).
    #[inline]
    pub fn read_u64(&self, offset: u64) -> Result<u64> {
        self.access(offset, 8, false, |p| {
            // SAFETY: `access` checked that 8 bytes at `p` lie in a live, current mapping; a
            // [u8; 8] read needs no alignment.
            u64::from_le_bytes(unsafe { std::ptr::read_volatile(p as *const [u8; 8]) })
        })
    }

    /// Writes the little-endian u64 `value` at `offset` in the range (volatile), marking the
    /// page VMM-dirty.
    #[inline]
    pub fn write_u64(&self, offset: u64, value: u64) -> Result<()> {
        self.access(offset, 8, true, |p| {
            // SAFETY: as in `read_u64`.
            unsafe { std::ptr::write_volatile(p.cast::<[u8; 8]>(), value.to_le_bytes()) }
        })
    }

    /// Copies `buf.len()` bytes at `offset` in the range into `buf`.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.access(offset, buf.len() as u64, false, |p| {
            // SAFETY: `access` checked the bytes at `p`; `buf` is a distinct host buffer.
            unsafe { std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr(), buf.len()) }
        })
    }

    /// Copies `data` to `offset` in the range, marking the pages VMM-dirty.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.access(offset, data.len() as u64, true, |p| {
            // SAFETY: as in `read`, with the roles swapped.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) }
        })
    }

    /// Runs `op` on the host address of `[offset, offset + len)` of the range while no memslot
    /// change or discard of the range can run (see the module docs), revalidating first if the
    /// generation moved on.
    fn access<T>(
        &self,
        offset: u64,
        len: u64,
        write: bool,
        op: impl FnOnce(*mut u8) -> T,
    ) -> Result<T> {
        if offset
            .checked_add(len)
            .is_none_or(|end| end > self.state.len)
        {
            return Err(Error::OutsideMapping {
                gpa: self.state.gpa,
                size: self.state.len,
                offset,
                len,
            });
        }
        loop {
            self.state.inflight.store(true, Ordering::Relaxed);
            // A full fence only when a change runs: its membarrier upgrades this one.
            compiler_fence(Ordering::SeqCst);
            let generation = self.manager.generation.load(Ordering::Acquire);
            if let Some(p) = self.pinned.borrow().as_ref() {
                if p.generation == generation {
                    if write {
                        p.region.vmm_dirty().mark(p.region_offset + offset, len);
                    }
                    // SAFETY: offset + len <= the range's length, and the range lies in the
                    // pinned mapping (checked by `refresh` at this generation).
                    let out = op(unsafe { p.host.add(to_usize(offset)) });
                    self.state.inflight.store(false, Ordering::Release);
                    return Ok(out);
                }
            }
            self.state.inflight.store(false, Ordering::Release);
            self.refresh()?;
        }
    }

    /// Looks the range up again in the slot table (waiting for any change in progress).
    fn refresh(&self) -> Result<()> {
        let table = self.manager.table();
        let generation = self.manager.generation();
        let (gpa, len) = (self.state.gpa, self.state.len);
        let pinned = table.lookup(gpa, len).map(|slot| {
            let (host, region_offset) = slot.host_range(gpa, len).expect("looked up");
            Pinned {
                generation,
                host,
                region: slot.region.clone(),
                region_offset,
            }
        });
        let found = pinned.is_some();
        *self.pinned.borrow_mut() = pinned;
        if found {
            Ok(())
        } else {
            Err(Error::NoMemslot { gpa, len })
        }
    }
}
