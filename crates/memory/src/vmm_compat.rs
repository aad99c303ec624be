//! guestmem memory behind the `vm_memory` 0.18 traits, so that code written
//! against vm-memory (`virtio-queue`, vhost-user backends, loaders) runs on guestmem's regions
//! and its writes are tracked.
//!
//! - [`VmRegion`] is a window of one [`Region`]'s host mapping placed at a guest physical
//!   address (a whole region, or a memslot's window) and implements [`GuestMemoryRegion`]. It
//!   keeps its `Arc<Region>`, so the memory stays mapped for as long as anyone holds it.
//! - Its bitmap, [`RegionBitmap`] / [`MarksSlice`], is the region's own VMM-side
//!   [`DirtyMarks`]: every write through vm-memory's `Bytes`,
//!   `VolatileSlice`, `VolatileRef` or `Writer` marks the pages it touched there, and the dirty
//!   tracker (crates/tracking) merges those marks into every harvest, as it does for guestmem's
//!   own writes. (Raw pointers from `get_host_address` are not tracked: their users must mark
//!   what they write, as vm-memory documents.)
//! - [`VmGuestMemory`] is vm-memory's [`GuestRegionCollection`] of `VmRegion`s: the
//!   [`GuestMemoryBackend`](::vm_memory::GuestMemoryBackend). [`GuestMemory::vm_memory`] makes one over a VM's regions,
//!   [`vm_memory_of_slots`] over memslots.
//! - [`SlotAddressSpace`] is a [`GuestAddressSpace`] that follows a [`MemslotManager`]: each
//!   `memory()` hands out the current snapshot, and a snapshot is rebuilt and swapped in
//!   atomically (vm-memory's [`GuestMemoryAtomic`], an `ArcSwap`) after any memslot change. A
//!   reader holding an older snapshot keeps valid memory: the snapshot holds the old regions'
//!   `Arc`s, so they stay mapped until it is dropped (it does then address the old layout).
//!
//! guest_memfd regions are refused ([`VmRegion::new`] fails naming the region) or, in a
//! [`SlotAddressSpace`], left out: vm-memory hands out host pointers and slices that outlive
//! any check, and guest_memfd memory is the memory whose host access KVM may take away
//! (conversion to private); a vm-memory access there fails as an unmapped address instead.

use guestmem_sys::to_usize;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use ::vm_memory::bitmap::{Bitmap, BitmapSlice, WithBitmapSlice, BS};
use ::vm_memory::{
    GuestAddress, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryError, GuestMemoryLoadGuard,
    GuestMemoryRegion, GuestMemoryRegionBytes, GuestMemoryResult, GuestRegionCollection,
    GuestUsize, MemoryRegionAddress, VolatileSlice,
};

use crate::{Backend, DirtyMarks, Error, GuestMemory, Memslot, MemslotManager, Region, Result};
use crate::{HUGE_PAGE_SIZE, PAGE_SIZE};

/// A VM's guest memory as a vm-memory [`GuestMemoryBackend`](::vm_memory::GuestMemoryBackend).
pub type VmGuestMemory = GuestRegionCollection<VmRegion>;

/// The dirty bitmap of a [`VmRegion`]: the region's VMM-side [`DirtyMarks`], seen from the
/// region offset where the window starts.
#[derive(Clone)]
pub struct RegionBitmap {
    region: Arc<Region>,
    /// Region offset of the window's first byte.
    base: u64,
}

impl fmt::Debug for RegionBitmap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegionBitmap")
            .field("region", &self.region.name())
            .field("base", &self.base)
            .finish()
    }
}

impl<'a> WithBitmapSlice<'a> for RegionBitmap {
    type S = MarksSlice<'a>;
}

impl Bitmap for RegionBitmap {
    fn mark_dirty(&self, offset: usize, len: usize) {
        self.slice_at(0).mark_dirty(offset, len);
    }

    fn dirty_at(&self, offset: usize) -> bool {
        self.slice_at(0).dirty_at(offset)
    }

    fn slice_at(&self, offset: usize) -> MarksSlice<'_> {
        MarksSlice {
            marks: self.region.vmm_dirty(),
            base: self.base + offset as u64,
        }
    }
}

/// A [`RegionBitmap`] from some offset on: what a [`VolatileSlice`] carries, marking the
/// region's [`DirtyMarks`] at `base + offset` for a write at `offset` of the slice.
#[derive(Clone, Copy)]
pub struct MarksSlice<'a> {
    marks: &'a DirtyMarks,
    /// Region offset of the slice's first byte.
    base: u64,
}

impl fmt::Debug for MarksSlice<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MarksSlice")
            .field("base", &self.base)
            .finish()
    }
}

impl<'a> WithBitmapSlice<'a> for MarksSlice<'_> {
    type S = Self;
}

impl BitmapSlice for MarksSlice<'_> {}

impl Bitmap for MarksSlice<'_> {
    fn mark_dirty(&self, offset: usize, len: usize) {
        self.marks.mark(self.base + offset as u64, len as u64);
    }

    fn dirty_at(&self, offset: usize) -> bool {
        self.marks
            .is_marked((self.base + offset as u64) / PAGE_SIZE)
    }

    fn slice_at(&self, offset: usize) -> Self {
        MarksSlice {
            marks: self.marks,
            base: self.base + offset as u64,
        }
    }
}

/// A window `[offset, offset + len)` of a [`Region`]'s host mapping at guest address `gpa`,
/// as a vm-memory [`GuestMemoryRegion`] (with `Bytes<MemoryRegionAddress>` from
/// [`GuestMemoryRegionBytes`]). Writes through it mark the region's VMM-side dirty marks.
#[derive(Debug, Clone)]
pub struct VmRegion {
    bitmap: RegionBitmap,
    gpa: u64,
    len: u64,
}

impl VmRegion {
    /// The whole of `region`, at the guest address it was created for.
    pub fn new(region: &Arc<Region>) -> Result<VmRegion> {
        VmRegion::window(region, 0, region.size(), region.gpa())
    }

    /// The window of a memslot: `slot.size` bytes of its region from `slot.region_offset`, at
    /// `slot.gpa`.
    pub fn of_slot(slot: &Memslot) -> Result<VmRegion> {
        VmRegion::window(&slot.region, slot.region_offset, slot.size, slot.gpa)
    }

    /// `len` bytes of `region` from region offset `offset`, at guest address `gpa`. Refuses a
    /// guest_memfd region, an empty window, one outside the region, and one whose guest range
    /// overflows.
    pub fn window(region: &Arc<Region>, offset: u64, len: u64, gpa: u64) -> Result<VmRegion> {
        let refuse = |reason: String| Error::VmMemory {
            region: region.name().to_owned(),
            reason,
        };
        if region.backend() == Backend::GuestMemfd {
            return Err(refuse(
                "it is backed by a guest_memfd, whose host access KVM may revoke \
                 (vm-memory hands out host pointers that outlive any check)"
                    .into(),
            ));
        }
        if len == 0
            || offset
                .checked_add(len)
                .is_none_or(|end| end > region.size())
            || gpa.checked_add(len).is_none()
        {
            return Err(refuse(format!(
                "window {offset:#x}+{len:#x} at guest address {gpa:#x} is empty, outside the \
                 region (size {:#x}) or overflows the guest address space",
                region.size()
            )));
        }
        Ok(VmRegion {
            bitmap: RegionBitmap {
                region: Arc::clone(region),
                base: offset,
            },
            gpa,
            len,
        })
    }

    /// The guestmem region this window is of.
    pub fn region(&self) -> &Arc<Region> {
        &self.bitmap.region
    }

    /// The region offset of the window's first byte.
    pub fn region_offset(&self) -> u64 {
        self.bitmap.base
    }
}

impl GuestMemoryRegion for VmRegion {
    type B = RegionBitmap;

    fn len(&self) -> GuestUsize {
        self.len
    }

    fn start_addr(&self) -> GuestAddress {
        GuestAddress(self.gpa)
    }

    fn bitmap(&self) -> MarksSlice<'_> {
        self.bitmap.slice_at(0)
    }

    fn get_host_address(&self, addr: MemoryRegionAddress) -> GuestMemoryResult<*mut u8> {
        self.check_address(addr)
            .and_then(|addr| {
                self.region()
                    .host_range(self.region().gpa() + self.region_offset() + addr.0, 1)
            })
            .ok_or(GuestMemoryError::InvalidBackendAddress)
    }

    fn get_slice(
        &self,
        offset: MemoryRegionAddress,
        count: usize,
    ) -> GuestMemoryResult<VolatileSlice<'_, BS<'_, RegionBitmap>>> {
        let end = offset.0.checked_add(count as u64);
        if end.is_none_or(|end| end > self.len) {
            return Err(GuestMemoryError::InvalidBackendAddress);
        }
        let region_offset = self.region_offset() + offset.0;
        let host = self
            .region()
            .host_range(self.region().gpa() + region_offset, count as u64)
            .ok_or(GuestMemoryError::InvalidBackendAddress)?;
        // SAFETY: `host_range` checked that `count` bytes at `host` lie inside the region's
        // mapping, which stays mapped while `self` (which holds the `Arc<Region>`) lives, and
        // the slice borrows `self`. A `VolatileSlice` accesses memory only by volatile copies,
        // as guestmem's own accessors do, since the guest may change it at any time.
        Ok(unsafe {
            VolatileSlice::with_bitmap(host, count, self.bitmap.slice_at(to_usize(offset.0)), None)
        })
    }

    fn is_hugetlbfs(&self) -> Option<bool> {
        Some(self.region().backend().page_size() == HUGE_PAGE_SIZE)
    }
}

impl GuestMemoryRegionBytes for VmRegion {}

/// The regions of `slots` (guest_memfd slots left out) as a vm-memory backend, in guest
/// address order.
pub fn vm_memory_of_slots(slots: &[Memslot]) -> Result<VmGuestMemory> {
    collection(
        slots
            .iter()
            .filter(|s| !s.guest_memfd())
            .map(VmRegion::of_slot)
            .collect::<Result<Vec<_>>>()?,
    )
}

/// Sorts `regions` by guest address into a collection (an empty one for no regions).
fn collection(mut regions: Vec<VmRegion>) -> Result<VmGuestMemory> {
    if regions.is_empty() {
        return Ok(VmGuestMemory::new());
    }
    regions.sort_by_key(|r| r.gpa);
    let names: Vec<String> = regions.iter().map(|r| r.region().name().into()).collect();
    VmGuestMemory::from_regions(regions).map_err(|e| Error::VmMemory {
        region: names.join("', '"),
        reason: e.to_string(),
    })
}

impl GuestMemory {
    /// Every region, at the guest address it was created for, as a vm-memory backend. Fails,
    /// naming the region, when one is a guest_memfd (see the [module](self) documentation).
    ///
    /// This is the layout at creation; after memslot changes use a [`SlotAddressSpace`].
    pub fn vm_memory(&self) -> Result<VmGuestMemory> {
        collection(
            self.regions()
                .iter()
                .map(VmRegion::new)
                .collect::<Result<Vec<_>>>()?,
        )
    }
}

/// A vm-memory [`GuestAddressSpace`] that follows a VM's memslots: `memory()` returns the
/// snapshot of the current slots (guest_memfd slots left out). Clones share the snapshot.
///
/// Each `memory()` compares the manager's generation with the snapshot's; after a change it
/// builds a new [`VmGuestMemory`] from the slots and swaps it in ([`GuestMemoryAtomic`]).
/// Guards taken earlier keep their snapshot, and with it the `Arc<Region>`s it holds, so the
/// memory they address stays mapped (though it may no longer be where the guest sees it).
#[derive(Clone)]
pub struct SlotAddressSpace {
    inner: Arc<SlotSpaceInner>,
}

struct SlotSpaceInner {
    manager: Arc<MemslotManager>,
    atomic: GuestMemoryAtomic<VmGuestMemory>,
    /// The manager's generation the current snapshot was built at.
    generation: AtomicU64,
    /// Serialises rebuilds (readers never wait for it).
    rebuild: Mutex<()>,
}

impl fmt::Debug for SlotAddressSpace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlotAddressSpace")
            .field("generation", &self.inner.generation.load(Ordering::Acquire))
            .finish()
    }
}

impl SlotAddressSpace {
    /// An address space over `manager`'s slots as they are now and as they will be.
    pub fn new(manager: Arc<MemslotManager>) -> Result<SlotAddressSpace> {
        let generation = manager.generation();
        let memory = vm_memory_of_slots(&manager.slots())?;
        Ok(SlotAddressSpace {
            inner: Arc::new(SlotSpaceInner {
                manager,
                atomic: GuestMemoryAtomic::new(memory),
                generation: AtomicU64::new(generation),
                rebuild: Mutex::new(()),
            }),
        })
    }

    /// Rebuilds the snapshot if the slots changed since it was built. Done by `memory()`; call
    /// it to surface a failure, which `memory()` can only log (it keeps the old snapshot).
    pub fn refresh(&self) -> Result<()> {
        let inner = &self.inner;
        if inner.manager.generation() == inner.generation.load(Ordering::Acquire) {
            return Ok(());
        }
        let _rebuild = inner
            .rebuild
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Read the generation before the slots: the slots are then at least that new, and a
        // change after it bumps the generation again, so the next call rebuilds once more.
        let generation = inner.manager.generation();
        if generation == inner.generation.load(Ordering::Acquire) {
            return Ok(());
        }
        let memory = vm_memory_of_slots(&inner.manager.slots())?;
        inner
            .atomic
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .replace(memory);
        inner.generation.store(generation, Ordering::Release);
        Ok(())
    }
}

impl GuestAddressSpace for SlotAddressSpace {
    type M = VmGuestMemory;
    type T = GuestMemoryLoadGuard<VmGuestMemory>;

    fn memory(&self) -> Self::T {
        if let Err(e) = self.refresh() {
            tracing::warn!(
                "vm-memory view of the memslots kept at its last layout: {}",
                guestmem_sys::error_chain(&e, ": ")
            );
        }
        self.inner.atomic.memory()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{RegionSpec, SlotFlags};
    use ::vm_memory::{Bytes, GuestMemoryBackend, Le32};

    fn marked_pages(region: &Region) -> Vec<u64> {
        let mut pages = vec![];
        region.vmm_dirty().take_each(|w, mut bits| {
            while bits != 0 {
                pages.push(w as u64 * 64 + u64::from(bits.trailing_zeros()));
                bits &= bits - 1;
            }
        });
        pages
    }

    /// Two adjacent regions, "lo" [0x10000, 0x20000) and "hi" [0x20000, 0x30000), then a gap.
    fn two_regions() -> GuestMemory {
        GuestMemory::new(
            &[
                RegionSpec::new("lo", 0x10000, 0x10000, Backend::Memfd),
                RegionSpec::new("hi", 0x20000, 0x10000, Backend::Anon),
            ],
            None,
        )
        .unwrap()
    }

    /// What vm-memory writes, guestmem reads, and the reverse; `write_obj` lands at the GPA.
    #[test]
    fn vm_memory_and_guestmem_see_the_same_bytes() {
        let mem = two_regions();
        let vm = mem.vm_memory().unwrap();
        assert_eq!(vm.num_regions(), 2);

        vm.write_obj(0x1122_3344_5566_7788u64, GuestAddress(0x10ff8))
            .unwrap();
        assert_eq!(mem.read_u64(0x10ff8).unwrap(), 0x1122_3344_5566_7788);
        let data: Vec<u8> = (0..100u8).collect();
        vm.write_slice(&data, GuestAddress(0x23000)).unwrap();
        let mut back = vec![0; 100];
        mem.read(0x23000, &mut back).unwrap();
        assert_eq!(back, data);

        mem.write(0x1a000, b"from guestmem").unwrap();
        let mut seen = [0u8; 13];
        vm.read_slice(&mut seen, GuestAddress(0x1a000)).unwrap();
        assert_eq!(&seen, b"from guestmem");
        mem.write_u64(0x2fff8, 42).unwrap();
        assert_eq!(vm.read_obj::<u64>(GuestAddress(0x2fff8)).unwrap(), 42);
    }

    /// vm-memory splits an access across adjacent regions into one slice per region (both
    /// halves land), and fails one that runs into unmapped memory after writing what fits.
    #[test]
    fn accesses_split_at_a_region_boundary_and_stop_at_a_gap() {
        let mem = two_regions();
        let vm = mem.vm_memory().unwrap();
        let data: Vec<u8> = (1..=32u8).collect();
        vm.write_slice(&data, GuestAddress(0x1fff0)).unwrap();
        let (mut lo, mut hi) = ([0u8; 16], [0u8; 16]);
        mem.read(0x1fff0, &mut lo).unwrap();
        mem.read(0x20000, &mut hi).unwrap();
        assert_eq!(lo[..], data[..16]);
        assert_eq!(hi[..], data[16..]);
        let mut back = [0u8; 32];
        vm.read_slice(&mut back, GuestAddress(0x1fff0)).unwrap();
        assert_eq!(back[..], data[..]);

        match vm.write_slice(&data, GuestAddress(0x2fff0)) {
            Err(GuestMemoryError::PartialBuffer {
                expected: 32,
                completed: 16,
            }) => {}
            other => panic!("expected a partial write of 16 bytes, got {other:?}"),
        }
        assert!(vm.write_slice(&[1], GuestAddress(0x30000)).is_err());
        assert!(vm.get_host_address(GuestAddress(0x30000)).is_err());
        assert_eq!(
            vm.get_host_address(GuestAddress(0x20010)).unwrap(),
            mem.find(0x20010, 1).unwrap().1
        );
    }

    /// Every vm-memory write marks exactly the pages it touched, in the region it touched;
    /// reads mark nothing.
    #[test]
    fn vm_memory_writes_mark_exactly_the_written_pages() {
        let mem = two_regions();
        let vm = mem.vm_memory().unwrap();
        let (lo, hi) = (&mem.regions()[0], &mem.regions()[1]);
        lo.vmm_dirty().take();
        hi.vmm_dirty().take();

        vm.write_obj(7u32, GuestAddress(0x12ffe)).unwrap(); // lo pages 2 and 3
        vm.write_slice(&[9; 8], GuestAddress(0x1fffc)).unwrap(); // lo page 15, hi page 0
        vm.store(5u64, GuestAddress(0x25000), Ordering::SeqCst)
            .unwrap(); // hi page 5
        let slice = vm.get_slice(GuestAddress(0x27000), 4096).unwrap();
        slice.write_obj(1u8, 100).unwrap(); // hi page 7
        let _: u64 = vm.read_obj(GuestAddress(0x2a000)).unwrap();
        let mut buf = [0u8; 64];
        vm.read_slice(&mut buf, GuestAddress(0x1b000)).unwrap();

        // vm-memory's view of the marks is guestmem's: region offsets, one bit per page.
        let lo_bitmap = vm.find_region(GuestAddress(0x10000)).unwrap().bitmap();
        assert!(lo_bitmap.dirty_at(0x3fff) && !lo_bitmap.dirty_at(0x4000));
        assert_eq!(marked_pages(lo), [2, 3, 15]);
        assert_eq!(marked_pages(hi), [0, 5, 7]);
    }

    /// A window of a region at another guest address marks the region's pages, not the
    /// window's, and refuses windows outside the region.
    #[test]
    fn a_window_marks_the_pages_of_its_region() {
        let mem = two_regions();
        let hi = &mem.regions()[1];
        let window = VmRegion::window(hi, 0x4000, 0x8000, 0x100_0000).unwrap();
        let vm = VmGuestMemory::from_regions(vec![window]).unwrap();
        vm.write_obj(0xabu8, GuestAddress(0x100_1000)).unwrap();
        assert_eq!(mem.read_u64(0x25000).unwrap() & 0xff, 0xab);
        assert_eq!(marked_pages(hi), [5]);
        let e = VmRegion::window(hi, 0x8000, 0x9000, 0).unwrap_err();
        assert!(e.to_string().contains("region 'hi'"), "{e}");
    }

    fn kvm_vm() -> kvm_ioctls::VmFd {
        kvm_ioctls::Kvm::new()
            .expect("/dev/kvm opens")
            .create_vm()
            .expect("KVM_CREATE_VM")
    }

    /// A guest_memfd region is refused by name; in a slot address space it is left out
    /// (its addresses are unmapped to vm-memory) while the other slots work.
    #[test]
    fn a_guest_memfd_region_is_refused_by_name() {
        let vm = kvm_vm();
        let mem = GuestMemory::new(
            &[
                RegionSpec::new("private", 0x100000, 0x10000, Backend::GuestMemfd),
                RegionSpec::new("ram", 0, 0x10000, Backend::Anon),
            ],
            Some(&vm),
        )
        .unwrap();
        let e = mem.vm_memory().unwrap_err();
        let msg = e.to_string();
        assert!(
            matches!(e, Error::VmMemory { ref region, .. } if region == "private")
                && msg.contains("guest_memfd"),
            "{msg}"
        );

        mem.register(&vm).unwrap();
        let space = SlotAddressSpace::new(Arc::clone(mem.memslots().unwrap())).unwrap();
        let view = space.memory();
        assert_eq!(view.num_regions(), 1);
        assert!(view.write_obj(1u8, GuestAddress(0x100000)).is_err());
        view.write_obj(2u8, GuestAddress(0x1000)).unwrap();
        assert_eq!(mem.read_u64(0x1000).unwrap(), 2);
    }

    /// After a memslot moves and its region is otherwise dropped, a view taken before still
    /// reads (and writes) that region's memory; a fresh view sees the slot at its new place.
    #[test]
    fn an_old_view_keeps_its_memory_after_a_memslot_change() {
        let vm = kvm_vm();
        let manager = Arc::new(MemslotManager::new(&vm).unwrap());
        let region = Arc::new(
            Region::create(RegionSpec::new("ram", 0, 0x20000, Backend::Memfd), None).unwrap(),
        );
        let slot = manager
            .add(&region, 0, 0x20000, 0, SlotFlags::default())
            .unwrap();
        let space = SlotAddressSpace::new(Arc::clone(&manager)).unwrap();
        let old = space.memory();
        old.write_obj(0xfeed_u32, GuestAddress(0x3000)).unwrap();

        manager.move_to(slot, 0x40000).unwrap();
        let new = space.memory();
        assert!(new.read_obj::<u32>(GuestAddress(0x3000)).is_err());
        assert_eq!(new.read_obj::<u32>(GuestAddress(0x43000)).unwrap(), 0xfeed);

        manager.remove(slot).unwrap();
        drop(region);
        drop(new);
        assert_eq!(space.memory().num_regions(), 0);
        // Only `old` holds the region now: its memory is still mapped and still the same.
        assert_eq!(old.read_obj::<u32>(GuestAddress(0x3000)).unwrap(), 0xfeed);
        old.write_obj(0xbeef_u32, GuestAddress(0x3000)).unwrap();
        assert_eq!(old.read_obj::<u32>(GuestAddress(0x3000)).unwrap(), 0xbeef);
    }

    /// Readers taking views while another thread moves a memslot back and forth always find
    /// the region's bytes where their own view places it.
    #[test]
    fn views_stay_consistent_while_memslots_move() {
        let vm = kvm_vm();
        let manager = Arc::new(MemslotManager::new(&vm).unwrap());
        let region = Arc::new(
            Region::create(RegionSpec::new("ram", 0, 0x10000, Backend::Anon), None).unwrap(),
        );
        let slot = manager
            .add(&region, 0, 0x10000, 0, SlotFlags::default())
            .unwrap();
        let space = SlotAddressSpace::new(Arc::clone(&manager)).unwrap();
        space
            .memory()
            .write_obj(0x5eed_u64, GuestAddress(0x3000))
            .unwrap();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let (space, stop) = (space.clone(), Arc::clone(&stop));
                std::thread::spawn(move || {
                    let mut starts = std::collections::BTreeSet::new();
                    while !stop.load(Ordering::Relaxed) {
                        let view = space.memory();
                        let start = view.iter().next().unwrap().start_addr();
                        let at = GuestAddress(start.0 + 0x3000);
                        assert_eq!(view.read_obj::<u64>(at).unwrap(), 0x5eed);
                        starts.insert(start.0);
                    }
                    starts
                })
            })
            .collect();
        for i in 1..=200u64 {
            manager.move_to(slot, (i % 2) * 0x100000).unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        for reader in readers {
            let starts = reader.join().unwrap();
            assert!(
                starts.iter().all(|s| [0, 0x100000].contains(s)),
                "{starts:?}"
            );
        }
        assert_eq!(space.memory().iter().next().unwrap().start_addr().0, 0);
    }

    /// A virtio split queue laid out in guestmem memory: the device (virtio-queue) walks a
    /// two-descriptor chain, reads the request, writes its answer into the guest's buffer and
    /// returns the chain; the answer is in guest memory and its page (and the used ring's) are
    /// in the dirty marks, while the pages it only read are not.
    #[test]
    fn virtio_queue_device_writes_are_tracked() {
        use virtio_queue::desc::split::Descriptor;
        use virtio_queue::desc::RawDescriptor;
        use virtio_queue::{Queue, QueueOwnedT, QueueT};

        const DESC: u64 = 0x1000;
        const AVAIL: u64 = 0x2000;
        const USED: u64 = 0x3000;
        const REQUEST: u64 = 0x5000;
        const REPLY: u64 = 0x8000;
        let mem =
            GuestMemory::new(&[RegionSpec::new("ram", 0, 0x10000, Backend::Memfd)], None).unwrap();
        let ram = &mem.regions()[0];
        // The driver's side, written through guestmem: a readable request then a writable
        // reply buffer, chained, and the avail ring offering the chain's head.
        mem.write(REQUEST, b"ping").unwrap();
        let descriptors = [
            Descriptor::new(REQUEST, 4, 1 /* NEXT */, 1),
            Descriptor::new(REPLY, 64, 2 /* WRITE */, 0),
        ];
        let vm = mem.vm_memory().unwrap();
        for (i, d) in descriptors.into_iter().enumerate() {
            vm.write_obj(RawDescriptor::from(d), GuestAddress(DESC + 16 * i as u64))
                .unwrap();
        }
        mem.write(AVAIL, &[0, 0, 1, 0, 0, 0]).unwrap(); // flags 0, idx 1, ring[0] = 0
        ram.vmm_dirty().take();

        let mut queue = Queue::new(16).unwrap();
        queue.set_size(16);
        queue
            .try_set_desc_table_address(GuestAddress(DESC))
            .unwrap();
        queue
            .try_set_avail_ring_address(GuestAddress(AVAIL))
            .unwrap();
        queue.try_set_used_ring_address(GuestAddress(USED)).unwrap();
        queue.set_ready(true);
        assert!(queue.is_valid(&vm));

        let chain = queue.iter(&vm).unwrap().next().expect("one chain offered");
        let head = chain.head_index();
        let mut request = [0u8; 4];
        std::io::Read::read_exact(&mut chain.clone().reader(&vm).unwrap(), &mut request).unwrap();
        assert_eq!(&request, b"ping");
        let mut writer = chain.writer(&vm).unwrap();
        use std::io::Write;
        writer.write_all(b"pong").unwrap();
        writer.write_obj(Le32::from(7)).unwrap();
        queue.add_used(&vm, head, 8).unwrap();

        let mut reply = [0u8; 8];
        mem.read(REPLY, &mut reply).unwrap();
        assert_eq!(&reply, b"pong\x07\0\0\0");
        // The used ring: flags, idx = 1, then element 0 = (id 0, len 8).
        let mut used = [0u8; 12];
        mem.read(USED, &mut used).unwrap();
        assert_eq!(used, [0, 0, 1, 0, 0, 0, 0, 0, 8, 0, 0, 0]);
        assert_eq!(marked_pages(ram), [USED / PAGE_SIZE, REPLY / PAGE_SIZE]);
    }
}
