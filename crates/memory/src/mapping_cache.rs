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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Backend, RegionSpec, SlotFlags, PAGE_SIZE};
    use std::time::{Duration, Instant};

    const GPA: u64 = 0x1_0000_0000;

    fn manager() -> (kvm_ioctls::VmFd, Arc<MemslotManager>) {
        let vm = kvm_ioctls::Kvm::new()
            .expect("/dev/kvm")
            .create_vm()
            .expect("a VM");
        let slots = Arc::new(MemslotManager::new(&vm).unwrap());
        (vm, slots)
    }

    fn region(name: &str, size: u64) -> Arc<Region> {
        let spec = RegionSpec::new(name, GPA, size, Backend::Memfd);
        Arc::new(Region::create(spec, None).expect("region"))
    }

    /// Two ranges overlap when they share a byte; ranges that touch do not.
    #[test]
    fn handle_ranges_overlap_when_they_share_a_byte() {
        let h = HandleState {
            gpa: 0x1000,
            len: 0x100,
            inflight: AtomicBool::new(false),
        };
        assert!(h.overlaps(0x1000, 1));
        assert!(h.overlaps(0x10ff, 1));
        assert!(h.overlaps(0, 0x1001));
        assert!(h.overlaps(0x1080, u64::MAX), "a length that overflows");
        assert!(!h.overlaps(0x1100, 0x1000), "starts at its end");
        assert!(!h.overlaps(0, 0x1000), "ends at its start");
    }

    /// A range that is empty or wraps around is refused; the u64 accessors are little-endian
    /// and a write marks exactly its pages VMM-dirty, at the window's offset in the region.
    #[test]
    fn handles_copy_exact_bytes_and_mark_their_pages() {
        let (_vm, slots) = manager();
        let r = region("m", 8 * PAGE_SIZE);
        slots
            .add(&r, 2 * PAGE_SIZE, 4 * PAGE_SIZE, GPA, SlotFlags::default())
            .unwrap();
        for (gpa, len) in [(GPA, 0), (u64::MAX - 4, 8)] {
            assert!(matches!(
                slots.map(gpa, len),
                Err(Error::NoMemslot { gpa: g, len: l }) if g == gpa && l == len
            ));
        }
        let h = slots.map(GPA + PAGE_SIZE, 2 * PAGE_SIZE).unwrap();
        assert_eq!(
            (h.gpa(), h.len(), h.is_empty()),
            (GPA + PAGE_SIZE, 2 * PAGE_SIZE, false)
        );
        r.vmm_dirty().take();
        h.write_u64(PAGE_SIZE - 4, 0x0807_0605_0403_0201).unwrap();
        let mut bytes = [0u8; 8];
        slots.read(GPA + 2 * PAGE_SIZE - 4, &mut bytes).unwrap();
        assert_eq!(bytes, [1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(h.read_u64(PAGE_SIZE - 4).unwrap(), 0x0807_0605_0403_0201);
        // The write straddled the handle's pages 0 and 1: the region's pages 3 and 4.
        let marked: Vec<u64> = (0..8).filter(|&p| r.vmm_dirty().is_marked(p)).collect();
        assert_eq!(marked, vec![3, 4]);
        let mut buf = [0u8; 3];
        h.read(PAGE_SIZE - 2, &mut buf).unwrap();
        assert_eq!(buf, [3, 4, 5]);
        // Reads mark nothing.
        r.vmm_dirty().take();
        h.read_u64(0).unwrap();
        assert!((0..8).all(|p| !r.vmm_dirty().is_marked(p)));
    }

    /// A handle follows the slot table: after its slot moved away it finds no memslot; once a
    /// slot maps its range again it reaches the new slot's memory.
    #[test]
    fn a_handle_revalidates_after_a_change() {
        let (_vm, slots) = manager();
        let (a, b) = (region("a", 2 * PAGE_SIZE), region("b", 2 * PAGE_SIZE));
        let id = slots
            .add(&a, 0, 2 * PAGE_SIZE, GPA, SlotFlags::default())
            .unwrap();
        slots.write(GPA + 16, &[0xaa; 8]).unwrap();
        let h = slots.map(GPA + 16, 8).unwrap();
        assert_eq!(h.read_u64(0).unwrap(), 0xaaaa_aaaa_aaaa_aaaa);
        slots.move_to(id, GPA + 0x10_0000).unwrap();
        assert!(matches!(h.read_u64(0), Err(Error::NoMemslot { .. })));
        assert!(matches!(h.write(0, &[1]), Err(Error::NoMemslot { .. })));
        let other = slots
            .add(&b, 0, 2 * PAGE_SIZE, GPA, SlotFlags::default())
            .unwrap();
        slots.write(GPA + 16, &[0xbb; 8]).unwrap();
        assert_eq!(h.read_u64(0).unwrap(), 0xbbbb_bbbb_bbbb_bbbb);
        h.write(0, &[0xcc; 8]).unwrap();
        // The write went to region b, region a is untouched.
        let mut got = [0u8; 8];
        slots.read(GPA + 16, &mut got).unwrap();
        assert_eq!(got, [0xcc; 8]);
        slots.read(GPA + 0x10_0000 + 16, &mut got).unwrap();
        assert_eq!(got, [0xaa; 8]);
        slots.remove(other).unwrap();
        assert!(matches!(h.read(0, &mut got), Err(Error::NoMemslot { .. })));
    }

    /// A change of flags alone keeps the mapping, so it does not wait for a handle inside an
    /// access; a move does, until the access ends.
    #[test]
    fn only_a_change_of_mapping_waits_for_handles_in_an_access() {
        let (_vm, slots) = manager();
        let r = region("w", 4 * PAGE_SIZE);
        let id = slots
            .add(&r, 0, 4 * PAGE_SIZE, GPA, SlotFlags::default())
            .unwrap();
        let handle = slots.map(GPA + PAGE_SIZE, 8).unwrap();
        // An access in progress, as `CachedMapping::access` marks it.
        handle
            .state()
            .inflight
            .store(true, std::sync::atomic::Ordering::Release);
        let started = Instant::now();
        let logging = SlotFlags {
            log_dirty_pages: true,
            read_only: false,
        };
        slots.set_flags(id, logging).unwrap();
        assert!(started.elapsed() < Duration::from_millis(150));

        let state = handle.state().clone();
        let ender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            state
                .inflight
                .store(false, std::sync::atomic::Ordering::Release);
        });
        let started = Instant::now();
        slots.move_to(id, GPA + 0x10_0000).unwrap();
        assert!(
            started.elapsed() >= Duration::from_millis(200),
            "the move did not wait for the access: {:?}",
            started.elapsed()
        );
        ender.join().unwrap();
        assert!(matches!(
            handle.read_u64(0),
            Err(Error::NoMemslot { gpa, len: 8 }) if gpa == GPA + PAGE_SIZE
        ));
        assert_eq!(slots.slot(id).unwrap().flags, logging);
    }
}
