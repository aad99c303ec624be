//! Dirty-page tracking over all of a VM's memslots, at a cost that follows the dirty pages rather
//! than the memory size (the goal of O(1) write-protect-all dirty tracking, reached with today's
//! kernel interfaces).
//!
//! Three modes ([`Mode::best`] prefers manual, then ring, then bitmap; see its note):
//! - [`Mode::Ring`]: per-vCPU dirty rings, collected while the vCPUs run, then
//!   `KVM_RESET_DIRTY_RINGS`. The VM must be created with `VmConfig::dirty_ring_bytes`.
//! - [`Mode::Manual`]: `KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2` with `KVM_DIRTY_LOG_INITIALLY_SET`:
//!   enabling write-protects nothing (O(1)); every page starts dirty, so the first harvest reports
//!   all of memory (the pre-copy's first pass). Pages are write-protected again only by
//!   `KVM_CLEAR_DIRTY_LOG`, issued by [`Tracker::clear`] per chunk just before the caller consumes
//!   it, so a page the guest keeps rewriting is not re-protected again and again.
//! - [`Mode::Bitmap`]: classic `KVM_GET_DIRTY_LOG`, which re-protects everything it reports.
//!
//! Every harvest also takes the VMM's own writes (`Region::vmm_dirty`) and merges them in. A page
//! is reported once per write: in manual mode a reported page is not reported again until its
//! chunk has been cleared.
//!
//! The protocol, in every mode: `harvest`, then for each chunk of each [`DirtyBitmap`]: `clear`
//! the chunk, then consume (read and send) its pages.

use guestmem_sys::to_usize;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use guestmem_memory::{GuestMemory, Region, PAGE_SIZE};
use guestmem_sys::uapi::{
    kvm_clear_dirty_log, kvm_dirty_log, KVM_CAP_DIRTY_LOG_RING, KVM_CAP_DIRTY_LOG_RING_ACQ_REL,
    KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2, KVM_CLEAR_DIRTY_LOG, KVM_DIRTY_LOG_INITIALLY_SET,
    KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE, KVM_GET_DIRTY_LOG, KVM_MEM_LOG_DIRTY_PAGES,
    KVM_RESET_DIRTY_RINGS,
};
use guestmem_vm::{DirtyRing, Vm};
use kvm_ioctls::{Kvm, VmFd};
use serde::Serialize;
use vmm_sys_util::ioctl::{ioctl, ioctl_with_ref};

/// What tracking returns.
pub type Result<T> = std::result::Result<T, Error>;

/// Why dirty tracking failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The kernel or the VM cannot do this mode.
    #[error("dirty tracking mode '{mode}' is not available: {reason}")]
    Unavailable {
        /// The mode asked for.
        mode: Mode,
        /// What is missing.
        reason: String,
    },
    /// A mode name that is not one.
    #[error("unknown dirty tracking mode {0:?} (expected ring, manual or bitmap)")]
    UnknownMode(String),
    #[error(
        "memslot {slot}: chunk of {pages} pages at page {first_page} cannot be cleared: it must \
         start at a multiple of 64 pages, be non-empty and lie inside the slot's {slot_pages} pages"
    )]
    /// A chunk given to [`Tracker::clear`] that KVM cannot clear.
    BadChunk {
        /// The memslot.
        slot: u32,
        /// The chunk's first page, within the slot.
        first_page: u64,
        /// Its pages.
        pages: u64,
        /// The slot's pages.
        slot_pages: u64,
    },
    /// A dirty ring entry names a memslot the VM does not have.
    #[error("dirty ring of vCPU {vcpu} holds an entry for memslot {slot}, which does not exist")]
    BadRingEntry {
        /// The vCPU whose ring holds it.
        vcpu: usize,
        /// The memslot it names.
        slot: u32,
    },
    /// A VM ioctl failed.
    #[error("{op} failed")]
    Vm {
        /// The ioctl.
        op: &'static str,
        /// The kernel's error.
        source: io::Error,
    },
    /// A memslot's ioctl failed.
    #[error("memslot {slot}: {op} failed")]
    Ioctl {
        /// The memslot.
        slot: u32,
        /// The ioctl.
        op: &'static str,
        /// The kernel's error.
        source: io::Error,
    },
    /// /dev/kvm cannot be opened.
    #[error("cannot open /dev/kvm")]
    Kvm(#[source] kvm_ioctls::Error),
    /// A memslot update failed.
    #[error(transparent)]
    Memory(#[from] guestmem_memory::Error),
}

/// How the kernel reports the guest's writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// Per-vCPU dirty rings.
    Ring,
    /// The dirty log with manual protection (`KVM_CLEAR_DIRTY_LOG`), every page dirty at first.
    Manual,
    /// The classic dirty log (`KVM_GET_DIRTY_LOG`).
    Bitmap,
}

/// Dirty ring entries per vCPU used unless the caller picks another size (1 MiB of ring: the
/// measured guest never filled it between 100 ms harvests).
pub const DEFAULT_RING_ENTRIES: u32 = 65536;

/// Bytes of a dirty ring with `entries` entries (the unit of `VmConfig::dirty_ring_bytes`).
#[allow(clippy::cast_possible_truncation)] // `kvm_dirty_gfn` is 16 bytes.
pub fn ring_bytes(entries: u32) -> u32 {
    entries * std::mem::size_of::<guestmem_sys::uapi::kvm_dirty_gfn>() as u32
}

impl Mode {
    /// Every mode.
    pub const ALL: [Mode; 3] = [Mode::Ring, Mode::Manual, Mode::Bitmap];

    /// The mode's name (as parsed).
    pub fn name(self) -> &'static str {
        match self {
            Mode::Ring => "ring",
            Mode::Manual => "manual",
            Mode::Bitmap => "bitmap",
        }
    }

    /// Why the running kernel cannot do this mode, or `None` when it can.
    pub fn unavailable(self, kvm: &Kvm) -> Option<String> {
        match self {
            Mode::Ring => {
                let bytes = kvm
                    .check_extension_raw(KVM_CAP_DIRTY_LOG_RING_ACQ_REL.into())
                    .max(kvm.check_extension_raw(KVM_CAP_DIRTY_LOG_RING.into()));
                (bytes <= 0).then(|| "the kernel has no KVM_CAP_DIRTY_LOG_RING".into())
            }
            Mode::Manual => {
                let want = KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE | KVM_DIRTY_LOG_INITIALLY_SET;
                let flags = kvm.check_extension_raw(KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2.into());
                (flags < 0 || flags as u32 & want != want).then(|| {
                    format!(
                        "KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2 offers flags {flags}, not \
                         MANUAL_PROTECT_ENABLE|INITIALLY_SET ({want})"
                    )
                })
            }
            Mode::Bitmap => None,
        }
    }

    /// The best mode the kernel offers: manual, then ring, then bitmap. Manual comes first
    /// because it is the only mode whose enabling write-protects nothing (the dirty ring cannot
    /// be combined with `INITIALLY_SET`), and with lazy clearing the guest keeps most of its dirty
    /// rate during a pre-copy's first pass (measured 11-12x the bitmap mode's, ring 0.9-1.2x, see
    /// docs/benchmarks.md); ring's harvest, free of any per-slot bitmap, matters only for very
    /// large, mostly idle VMs.
    pub fn best() -> Result<Mode> {
        let kvm = Kvm::new().map_err(Error::Kvm)?;
        Ok([Mode::Manual, Mode::Ring, Mode::Bitmap]
            .into_iter()
            .find(|m| m.unavailable(&kvm).is_none())
            .unwrap_or(Mode::Bitmap))
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Mode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Mode> {
        Mode::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| Error::UnknownMode(s.into()))
    }
}

/// The dirty pages of one memslot: bit `i` of `bits[i / 64]` is page `i` of the slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirtyBitmap {
    /// The memslot.
    pub slot: u32,
    /// Guest address of the slot's first page.
    pub gpa: u64,
    /// Pages in the slot.
    pub pages: u64,
    /// One bit per page of the slot.
    pub bits: Vec<u64>,
}

impl DirtyBitmap {
    fn new(slot: u32, gpa: u64, pages: u64) -> DirtyBitmap {
        DirtyBitmap {
            slot,
            gpa,
            pages,
            bits: vec![0; to_usize(pages.div_ceil(64))],
        }
    }

    /// Number of dirty pages.
    pub fn count(&self) -> u64 {
        self.bits.iter().map(|w| u64::from(w.count_ones())).sum()
    }

    /// Whether the page at guest address `gpa` is dirty.
    pub fn contains(&self, gpa: u64) -> bool {
        let page = gpa.wrapping_sub(self.gpa) / PAGE_SIZE;
        gpa >= self.gpa
            && page < self.pages
            && self.bits[(page / 64) as usize] >> (page % 64) & 1 != 0
    }

    /// The dirty pages as guest ranges `(gpa, bytes)` of consecutive pages, in address order.
    pub fn ranges(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        let mut page = 0;
        std::iter::from_fn(move || {
            page = self.next_dirty(page)?;
            let first = page;
            while page < self.pages && self.bits[(page / 64) as usize] >> (page % 64) & 1 != 0 {
                page += 1;
            }
            Some((self.gpa + first * PAGE_SIZE, (page - first) * PAGE_SIZE))
        })
    }

    fn next_dirty(&self, from: u64) -> Option<u64> {
        let mut w = (from / 64) as usize;
        let mut word = *self.bits.get(w)? & (u64::MAX << (from % 64));
        while word == 0 {
            w += 1;
            word = *self.bits.get(w)?;
        }
        let page = w as u64 * 64 + u64::from(word.trailing_zeros());
        (page < self.pages).then_some(page)
    }
}

/// Every page of every region that `pick` selects.
pub fn full_bitmaps(memory: &GuestMemory, pick: impl Fn(&Region) -> bool) -> Vec<DirtyBitmap> {
    memory
        .regions()
        .iter()
        .enumerate()
        .filter(|(_, r)| pick(r))
        .map(|(slot, r)| {
            let pages = r.size() / PAGE_SIZE;
            let mut bits = vec![u64::MAX; pages.div_ceil(64) as usize];
            if !pages.is_multiple_of(64) {
                *bits.last_mut().expect("a region has pages") = (1 << (pages % 64)) - 1;
            }
            DirtyBitmap {
                slot: u32::try_from(slot).expect("memslot ids are u32"),
                gpa: r.gpa(),
                pages,
                bits,
            }
        })
        .collect()
}

/// Whether one of the `dirty` bitmaps reports a page of the `len` bytes at `gpa` (a diff
/// stores such a chunk; it leaves the others to its base).
pub fn any_dirty(dirty: &[DirtyBitmap], gpa: u64, len: u64) -> bool {
    dirty.iter().any(|d| {
        (gpa..gpa + len)
            .step_by(to_usize(PAGE_SIZE))
            .any(|p| d.contains(p))
    })
}

/// The union of two harvests.
pub fn merge(mut a: Vec<DirtyBitmap>, b: Vec<DirtyBitmap>) -> Vec<DirtyBitmap> {
    for other in b {
        match a.iter_mut().find(|x| x.slot == other.slot) {
            Some(x) => x
                .bits
                .iter_mut()
                .zip(&other.bits)
                .for_each(|(x, y)| *x |= y),
            None => a.push(other),
        }
    }
    a.sort_by_key(|b| b.gpa);
    a
}

/// Whether the guest's writes to `region` can be tracked (see [`Tracker::start`]).
pub fn tracked(region: &Region) -> bool {
    region.backend() != guestmem_memory::Backend::GuestMemfd
}

/// The bitmap of `slot` in a harvest being built, created empty on first use.
fn slot_bitmap<'a>(
    dirty: &'a mut [Option<DirtyBitmap>],
    regions: &[Arc<Region>],
    slot: usize,
) -> &'a mut DirtyBitmap {
    dirty[slot].get_or_insert_with(|| {
        let r = &regions[slot];
        DirtyBitmap::new(
            u32::try_from(slot).expect("memslot ids are u32"),
            r.gpa(),
            r.size() / PAGE_SIZE,
        )
    })
}

/// Dirty-page tracking of every memslot of one VM, from [`Tracker::start`] to [`Tracker::stop`].
#[derive(Debug)]
pub struct Tracker {
    mode: Mode,
    /// Our own handle on the VM (a duplicate of its fd), so the VM can run while we harvest.
    vm: VmFd,
    memory: Arc<GuestMemory>,
    rings: Arc<Vec<DirtyRing>>,
    /// Bitmap and manual modes: `KVM_GET_DIRTY_LOG` output, per slot (kept to avoid faults).
    scratch: Vec<Vec<u64>>,
    /// Manual mode: pages reported but not yet cleared, per slot; not reported again.
    pending: Vec<Vec<u64>>,
}

impl Tracker {
    /// Starts dirty logging on every memslot of `vm` in `mode`. The VMM marks made before are
    /// dropped: the tracker reports writes from now on (plus, in manual mode, every page once).
    ///
    /// guest_memfd memslots are left out ([`tracked`] says which): KVM refuses dirty logging on
    /// them (`KVM_MEM_LOG_DIRTY_PAGES` is not a valid flag beside `KVM_MEM_GUEST_MEMFD`), so
    /// whoever needs their changes copies them with the guest stopped.
    pub fn start(vm: &Vm, mode: Mode) -> Result<Tracker> {
        Tracker::start_on(vm.fd(), vm.memory(), vm.dirty_rings(), mode)
    }

    /// [`Tracker::start`] for any VMM's VM: its KVM VM fd, the guest memory registered in it
    /// (memslot `i` is region `i`), and its vCPUs' dirty rings (vCPU `i` at index `i`; empty
    /// when the VM has none).
    pub fn start_on(
        vm_fd: &VmFd,
        memory: &Arc<GuestMemory>,
        rings: &Arc<Vec<DirtyRing>>,
        mode: Mode,
    ) -> Result<Tracker> {
        let kvm = Kvm::new().map_err(Error::Kvm)?;
        if let Some(reason) = mode.unavailable(&kvm) {
            return Err(Error::Unavailable { mode, reason });
        }
        let has_rings = !rings.is_empty();
        if (mode == Mode::Ring) != has_rings {
            let reason = if has_rings {
                "the VM has dirty rings, and KVM refuses KVM_GET_DIRTY_LOG on such a VM"
            } else {
                "the VM was created without dirty rings (VmConfig::dirty_ring_bytes)"
            };
            return Err(Error::Unavailable {
                mode,
                reason: reason.into(),
            });
        }
        // SAFETY: `dup` of a valid open fd; the result is checked and then owned by the VmFd.
        let fd = unsafe { libc::dup(vm_fd.as_raw_fd()) };
        if fd < 0 {
            return Err(Error::Vm {
                op: "dup of the VM fd",
                source: io::Error::last_os_error(),
            });
        }
        // SAFETY: `fd` is a fresh duplicate of a KVM VM fd that nothing else owns.
        let vm_fd = unsafe { kvm.create_vmfd_from_rawfd(fd) }.map_err(Error::Kvm)?;
        let memory = memory.clone();
        if mode == Mode::Manual {
            let mut cap = kvm_bindings::kvm_enable_cap {
                cap: KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2,
                ..Default::default()
            };
            cap.args[0] =
                (KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE | KVM_DIRTY_LOG_INITIALLY_SET).into();
            vm_fd.enable_cap(&cap).map_err(|e| Error::Vm {
                op: "KVM_ENABLE_CAP(MANUAL_DIRTY_LOG_PROTECT2)",
                source: io::Error::from_raw_os_error(e.errno()),
            })?;
        }
        for region in memory.regions() {
            region.vmm_dirty().take_each(|_, _| {});
        }
        for (slot, region) in memory.regions().iter().enumerate() {
            if tracked(region) {
                memory.set_slot_flags(&vm_fd, slot, KVM_MEM_LOG_DIRTY_PAGES)?;
            }
        }
        let slots = memory.regions().len();
        Ok(Tracker {
            mode,
            rings: rings.clone(),
            scratch: vec![Vec::new(); slots],
            pending: vec![Vec::new(); slots],
            vm: vm_fd,
            memory,
        })
    }

    /// The tracking mode.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// The pages written (by the guest or through `GuestMemory`) since the last harvest, one
    /// bitmap per memslot that has any.
    pub fn harvest(&mut self) -> Result<Vec<DirtyBitmap>> {
        let regions = self.memory.regions();
        let mut dirty: Vec<Option<DirtyBitmap>> = vec![None; regions.len()];
        match self.mode {
            Mode::Ring => {
                let mut collected = 0u64;
                for (vcpu, ring) in self.rings.iter().enumerate() {
                    let mut bad_slot = None;
                    collected += u64::from(ring.collect(|slot, offset| {
                        let slot_id = (slot & 0xffff) as usize;
                        if slot_id >= regions.len() {
                            bad_slot = Some(slot);
                            return;
                        }
                        let b = slot_bitmap(&mut dirty, regions, slot_id);
                        if offset < b.pages {
                            b.bits[(offset / 64) as usize] |= 1 << (offset % 64);
                        }
                    }));
                    if let Some(slot) = bad_slot {
                        return Err(Error::BadRingEntry { vcpu, slot });
                    }
                }
                if collected > 0 {
                    // SAFETY: KVM_RESET_DIRTY_RINGS takes no argument and touches only the rings.
                    if unsafe { ioctl(&self.vm, KVM_RESET_DIRTY_RINGS()) } < 0 {
                        return Err(Error::Vm {
                            op: "KVM_RESET_DIRTY_RINGS",
                            source: io::Error::last_os_error(),
                        });
                    }
                }
            }
            Mode::Manual | Mode::Bitmap => {
                for (slot, region) in regions.iter().enumerate() {
                    if !tracked(region) {
                        continue;
                    }
                    let pages = region.size() / PAGE_SIZE;
                    let scratch = &mut self.scratch[slot];
                    scratch.resize(pages.div_ceil(64) as usize, 0);
                    let mut log = kvm_dirty_log {
                        slot: u32::try_from(slot).expect("memslot ids are u32"),
                        ..Default::default()
                    };
                    log.__bindgen_anon_1.dirty_bitmap = scratch.as_mut_ptr().cast();
                    // SAFETY: `scratch` holds one bit per page of the slot, rounded up to 64
                    // bits, which is what the kernel writes.
                    if unsafe { ioctl_with_ref(&self.vm, KVM_GET_DIRTY_LOG(), &log) } < 0 {
                        return Err(Error::Ioctl {
                            slot: u32::try_from(slot).expect("memslot ids are u32"),
                            op: "KVM_GET_DIRTY_LOG",
                            source: io::Error::last_os_error(),
                        });
                    }
                    let pending = &mut self.pending[slot];
                    if self.mode == Mode::Manual {
                        pending.resize(scratch.len(), 0);
                    }
                    for (w, &bits) in scratch.iter().enumerate() {
                        let new = bits & !pending.get(w).copied().unwrap_or(0);
                        if new != 0 {
                            slot_bitmap(&mut dirty, regions, slot).bits[w] |= new;
                        }
                    }
                }
            }
        }
        for (slot, region) in regions.iter().enumerate() {
            region.vmm_dirty().take_each(|w, bits| {
                let new = bits & !self.pending[slot].get(w).copied().unwrap_or(0);
                if new != 0 {
                    slot_bitmap(&mut dirty, regions, slot).bits[w] |= new;
                }
            });
        }
        let dirty: Vec<DirtyBitmap> = dirty.into_iter().flatten().collect();
        if self.mode == Mode::Manual {
            for b in &dirty {
                for (p, bits) in self.pending[b.slot as usize].iter_mut().zip(&b.bits) {
                    *p |= bits;
                }
            }
        }
        Ok(dirty)
    }

    /// Call just before consuming pages `[first_page, first_page + pages)` of `dirty` (page
    /// numbers within its slot; `first_page` a multiple of 64). In manual mode this issues
    /// `KVM_CLEAR_DIRTY_LOG` for the chunk's dirty pages, so the guest's next write to them is
    /// logged again; the other modes re-protected at harvest time and need nothing.
    #[allow(clippy::cast_possible_truncation)] // at most one bitmap word's 64 pages.
    pub fn clear(&mut self, dirty: &DirtyBitmap, first_page: u64, pages: u64) -> Result<()> {
        if !first_page.is_multiple_of(64)
            || pages == 0
            || first_page.saturating_add(pages) > dirty.pages
        {
            return Err(Error::BadChunk {
                slot: dirty.slot,
                first_page,
                pages,
                slot_pages: dirty.pages,
            });
        }
        if self.mode != Mode::Manual {
            return Ok(());
        }
        let words = (first_page / 64) as usize..to_usize((first_page + pages).div_ceil(64));
        let mut bits = dirty.bits[words.clone()].to_vec();
        if !pages.is_multiple_of(64) && first_page + pages < dirty.pages {
            // KVM wants whole 64-page words except at the slot's end: clear the chunk's pages only.
            *bits.last_mut().expect("non-empty chunk") &= (1u64 << (pages % 64)) - 1;
        }
        if bits.iter().all(|&w| w == 0) {
            return Ok(());
        }
        let mut clear = kvm_clear_dirty_log {
            slot: dirty.slot,
            first_page,
            num_pages: (bits.len() as u64 * 64).min(dirty.pages - first_page) as u32,
            ..Default::default()
        };
        clear.__bindgen_anon_1.dirty_bitmap = bits.as_mut_ptr().cast();
        // SAFETY: `bits` covers `num_pages` bits starting at `first_page`, inside the slot.
        if unsafe { ioctl_with_ref(&self.vm, KVM_CLEAR_DIRTY_LOG(), &clear) } < 0 {
            return Err(Error::Ioctl {
                slot: dirty.slot,
                op: "KVM_CLEAR_DIRTY_LOG",
                source: io::Error::last_os_error(),
            });
        }
        if let Some(pending) = self.pending.get_mut(dirty.slot as usize) {
            for (p, b) in pending[words].iter_mut().zip(&bits) {
                *p &= !b;
            }
        }
        Ok(())
    }

    /// Stops dirty logging on every memslot (and, in manual mode, turns manual protection off
    /// again, so that a later bitmap-mode tracker gets the classic behaviour). Dropping a tracker
    /// without `stop` leaves logging on.
    pub fn stop(self) -> Result<()> {
        for (slot, region) in self.memory.regions().iter().enumerate() {
            if tracked(region) {
                self.memory.set_slot_flags(&self.vm, slot, 0)?;
            }
        }
        if self.mode == Mode::Manual {
            self.vm
                .enable_cap(&kvm_bindings::kvm_enable_cap {
                    cap: KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2,
                    ..Default::default()
                })
                .map_err(|e| Error::Vm {
                    op: "KVM_ENABLE_CAP(MANUAL_DIRTY_LOG_PROTECT2, 0)",
                    source: io::Error::from_raw_os_error(e.errno()),
                })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_is_dirty_when_any_of_its_pages_is() {
        // Slot at 1 MiB, 8 pages, page 5 dirty.
        let mut b = DirtyBitmap::new(0, 1 << 20, 8);
        b.bits[0] = 1 << 5;
        let dirty = [b];
        let page5 = (1 << 20) + 5 * PAGE_SIZE;
        assert!(any_dirty(&dirty, 1 << 20, 8 * PAGE_SIZE));
        assert!(any_dirty(&dirty, page5, PAGE_SIZE));
        assert!(!any_dirty(&dirty, 1 << 20, 5 * PAGE_SIZE));
        assert!(!any_dirty(&dirty, page5 + PAGE_SIZE, 2 * PAGE_SIZE));
        assert!(!any_dirty(&[], 1 << 20, 8 * PAGE_SIZE));
    }

    #[test]
    fn bitmap_ranges_count_and_contains() {
        let mut b = DirtyBitmap::new(3, 0x4000_0000, 200);
        for page in [0, 1, 2, 63, 64, 65, 130, 199] {
            b.bits[page / 64] |= 1 << (page % 64);
        }
        let ranges: Vec<(u64, u64)> = b.ranges().collect();
        let page = |p: u64| 0x4000_0000 + p * PAGE_SIZE;
        assert_eq!(
            ranges,
            [
                (page(0), 3 * PAGE_SIZE),
                (page(63), 3 * PAGE_SIZE),
                (page(130), PAGE_SIZE),
                (page(199), PAGE_SIZE)
            ]
        );
        assert_eq!(b.count(), 8);
        assert!(b.contains(page(65)) && !b.contains(page(66)));
        assert!(!b.contains(page(200)) && !b.contains(0x3fff_f000));
        assert_eq!(DirtyBitmap::new(0, 0, 64).ranges().count(), 0);
    }

    #[test]
    fn full_bitmaps_cover_every_page_and_merge_is_a_union() {
        use guestmem_memory::{Backend, RegionSpec};
        let memory = GuestMemory::new(
            &[
                RegionSpec::new("a", 0, 70 * PAGE_SIZE, Backend::Anon),
                RegionSpec::new("b", 1 << 30, 64 * PAGE_SIZE, Backend::Anon),
            ],
            None,
        )
        .unwrap();
        let full = full_bitmaps(&memory, |_| true);
        assert_eq!(
            full.iter()
                .map(super::DirtyBitmap::count)
                .collect::<Vec<_>>(),
            [70, 64]
        );
        assert_eq!(full[0].bits, [u64::MAX, (1 << 6) - 1]);
        let only_b = full_bitmaps(&memory, |r| r.name() == "b");
        assert_eq!((only_b.len(), only_b[0].slot), (1, 1));

        let mut one = DirtyBitmap::new(0, 0, 70);
        one.bits[1] = 0b100;
        let mut other = DirtyBitmap::new(0, 0, 70);
        other.bits[0] = 0b1;
        let merged = merge(only_b.clone(), vec![one]);
        let merged = merge(merged, vec![other]);
        // Sorted by address, slot 0's pages 0 and 66 beside all of slot 1.
        assert_eq!(merged.len(), 2);
        assert_eq!(
            (merged[0].slot, merged[0].bits.clone()),
            (0, vec![1, 0b100])
        );
        assert_eq!(merged[1], only_b[0]);
    }

    #[test]
    fn modes_parse_by_name() {
        for m in Mode::ALL {
            assert_eq!(m.name().parse::<Mode>().unwrap(), m);
        }
        assert!(matches!("all".parse::<Mode>(), Err(Error::UnknownMode(s)) if s == "all"));
    }
}
