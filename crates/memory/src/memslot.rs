//! The memslot manager: the one place where a VM's KVM memslots change.
//!
//! A memslot maps a window `[region_offset, region_offset + size)` of one [`Region`]'s host
//! mapping at guest physical address `gpa`. The manager allocates slot ids (lowest free id first,
//! up to `KVM_CAP_NR_MEMSLOTS`), refuses overlaps, and adds, removes, moves and resizes slots or
//! changes their flags (dirty logging, read-only; guest_memfd follows from the region's backend).
//! Every change, and every discard of guest pages, goes through [`MemslotManager::commit`], which
//! bumps the generation that [`CachedMapping`] handles check on each access.
//!
//! The manager is also the VMM's fresh GPA -> host lookup ([`MemslotManager::read`] /
//! [`MemslotManager::write`]: the slot table's read lock plus a search by gpa); device code that
//! touches the same guest range again and again uses a [`CachedMapping`] from
//! [`MemslotManager::map`] instead (see `mapping_cache` for the concurrency design).

use guestmem_sys::to_usize;
use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, Weak};

use guestmem_sys::uapi::{
    kvm_userspace_memory_region, kvm_userspace_memory_region2, KVM_CAP_NR_MEMSLOTS,
    KVM_CAP_USER_MEMORY2, KVM_MEM_GUEST_MEMFD, KVM_MEM_LOG_DIRTY_PAGES, KVM_MEM_READONLY,
    KVM_MEM_USERFAULT_CANDIDATE, KVM_SET_USER_MEMORY_REGION, KVM_SET_USER_MEMORY_REGION2,
    MEMBARRIER_CMD_PRIVATE_EXPEDITED, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED,
};
use kvm_ioctls::VmFd;
use vmm_sys_util::ioctl::ioctl_with_ref;

use crate::mapping_cache::{CachedMapping, HandleState};
use crate::{Backend, Error, Region, Result, UserfaultBitmap, PAGE_SIZE};

/// The flags of a memslot that the VMM chooses (`KVM_MEM_GUEST_MEMFD` follows from the region).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SlotFlags {
    /// `KVM_MEM_LOG_DIRTY_PAGES`: KVM records the guest's writes in the slot's dirty log.
    pub log_dirty_pages: bool,
    /// `KVM_MEM_READONLY`: guest writes exit to the VMM as MMIO.
    pub read_only: bool,
}

/// One KVM memslot: a window of a region's host mapping placed at a guest physical address.
#[derive(Debug, Clone)]
pub struct Memslot {
    /// The KVM slot number.
    pub id: u32,
    /// Its guest physical address.
    pub gpa: u64,
    /// Its bytes.
    pub size: u64,
    /// The region whose mapping it shows.
    pub region: Arc<Region>,
    /// Where in the region the window starts.
    pub region_offset: u64,
    /// Its KVM flags.
    pub flags: SlotFlags,
    /// KVM Userfault: the slot's userfault bitmap (`KVM_MEM_USERFAULT`), kept alive as long
    /// as the slot, since KVM reads it on every fault.
    pub userfault: Option<Arc<UserfaultBitmap>>,
}

impl Memslot {
    /// Its end guest address (exclusive).
    pub fn end(&self) -> u64 {
        self.gpa + self.size
    }

    /// Whether the slot is bound to a guest_memfd (`KVM_MEM_GUEST_MEMFD`).
    pub fn guest_memfd(&self) -> bool {
        self.region.backend() == Backend::GuestMemfd
    }

    /// Host address and region offset of `len` bytes at `gpa`, if they lie wholly in the slot.
    pub(crate) fn host_range(&self, gpa: u64, len: u64) -> Option<(*mut u8, u64)> {
        let off = gpa.checked_sub(self.gpa)?;
        (off.checked_add(len)? <= self.size).then(|| {
            let region_offset = self.region_offset + off;
            // SAFETY: region_offset + len <= region_offset + size <= the region's size, checked
            // when the slot was made, so the address stays inside the region's mapping.
            (
                unsafe { self.region.host_addr().add(to_usize(region_offset)) },
                region_offset,
            )
        })
    }

    fn kvm_flags(&self) -> u32 {
        let mut flags = 0;
        if self.flags.log_dirty_pages {
            flags |= KVM_MEM_LOG_DIRTY_PAGES;
        }
        if self.flags.read_only {
            flags |= KVM_MEM_READONLY;
        }
        if self.guest_memfd() {
            flags |= KVM_MEM_GUEST_MEMFD;
        }
        if self.userfault.is_some() {
            flags |= KVM_MEM_USERFAULT_CANDIDATE;
        }
        flags
    }
}

/// The slots by id and by guest address. Slots never overlap.
#[derive(Debug, Default)]
pub(crate) struct SlotTable {
    slots: Vec<Option<Memslot>>,
    by_gpa: BTreeMap<u64, u32>,
    free_ids: BTreeSet<u32>,
}

impl SlotTable {
    /// The slot holding all of `[gpa, gpa + len)`.
    pub(crate) fn lookup(&self, gpa: u64, len: u64) -> Option<&Memslot> {
        let (_, &id) = self.by_gpa.range(..=gpa).next_back()?;
        let slot = self.slots[id as usize].as_ref()?;
        slot.host_range(gpa, len).map(|_| slot)
    }

    fn get(&self, id: u32) -> Result<&Memslot> {
        self.slots
            .get(id as usize)
            .and_then(Option::as_ref)
            .ok_or(Error::UnknownSlot { slot: id })
    }

    /// The slot (other than `except`) overlapping `[gpa, end)`, if any.
    fn overlapping(&self, gpa: u64, end: u64, except: Option<u32>) -> Option<&Memslot> {
        self.by_gpa
            .range(..end)
            .rev()
            .map(|(_, &id)| self.slots[id as usize].as_ref().expect("indexed slot"))
            .find(|s| Some(s.id) != except)
            .filter(|s| s.end() > gpa)
    }

    fn insert(&mut self, slot: Memslot) {
        self.by_gpa.insert(slot.gpa, slot.id);
        let id = slot.id as usize;
        self.slots[id] = Some(slot);
    }

    fn remove(&mut self, id: u32) {
        if let Some(old) = self.slots[id as usize].take() {
            self.by_gpa.remove(&old.gpa);
            self.free_ids.insert(id);
        }
    }
}

/// The memslots of one VM. Share it as `Arc<MemslotManager>`: [`CachedMapping`] handles keep it.
pub struct MemslotManager {
    /// A duplicate of the VM fd, so the manager can live as long as any handle.
    vm: OwnedFd,
    has_region2: bool,
    max_slots: u32,
    table: RwLock<SlotTable>,
    /// Bumped by every change, under the table's write lock.
    pub(crate) generation: AtomicU64,
    /// Every handle made by [`MemslotManager::map`], to wait out their accesses on a change.
    handles: Mutex<Vec<Weak<HandleState>>>,
}

impl std::fmt::Debug for MemslotManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemslotManager")
            .field("max_slots", &self.max_slots)
            .field("slots", &self.len())
            .field("generation", &self.generation())
            .finish()
    }
}

/// What [`MemslotManager::commit`] does to the slot table.
enum Change {
    /// Put `new` in place of slot `new.id` (which may not exist yet).
    Set(Memslot),
    /// Delete a slot.
    Remove(u32),
    /// Drop the contents of guest pages (the slot stays): the pages read as zero afterwards.
    Discard { gpa: u64, len: u64 },
}

impl MemslotManager {
    /// A manager for `vm`'s memslots, which must all be made through it from now on.
    pub fn new(vm: &VmFd) -> Result<MemslotManager> {
        // SAFETY: F_DUPFD_CLOEXEC on a valid fd returns a new fd (checked below) owned by us.
        let fd = unsafe { libc::fcntl(vm.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
        if fd < 0 {
            return Err(Error::Os {
                region: "(the VM fd)".into(),
                op: "fcntl(F_DUPFD_CLOEXEC)",
                source: io::Error::last_os_error(),
            });
        }
        // SAFETY: `fd` was just returned by fcntl and nobody else owns it.
        let vm_dup = unsafe { OwnedFd::from_raw_fd(fd) };
        // Handles' accesses use only a compiler fence; changes make it a full one with
        // membarrier (see `mapping_cache`). Registering twice is harmless.
        membarrier(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED)?;
        Ok(MemslotManager {
            vm: vm_dup,
            has_region2: vm.check_extension_raw(KVM_CAP_USER_MEMORY2.into()) > 0,
            // KVM reports the per-address-space slot count; 32 is the kernel's oldest minimum.
            max_slots: vm.check_extension_raw(KVM_CAP_NR_MEMSLOTS.into()).max(32) as u32,
            table: RwLock::new(SlotTable::default()),
            generation: AtomicU64::new(0),
            handles: Mutex::new(Vec::new()),
        })
    }

    /// `KVM_CAP_NR_MEMSLOTS`: the number of slot ids (0 to `max_slots - 1`).
    pub fn max_slots(&self) -> u32 {
        self.max_slots
    }

    /// Bumped by every add, remove, move, resize, flag change and discard.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// How many slots exist.
    pub fn len(&self) -> usize {
        self.table().by_gpa.len()
    }

    /// Whether there is no memslot.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A copy of slot `id`.
    pub fn slot(&self, id: u32) -> Result<Memslot> {
        self.table().get(id).cloned()
    }

    /// Copies of every slot, in guest address order.
    pub fn slots(&self) -> Vec<Memslot> {
        let table = self.table();
        table
            .by_gpa
            .values()
            .map(|&id| table.slots[id as usize].clone().expect("indexed slot"))
            .collect()
    }

    /// Adds a slot mapping `[region_offset, region_offset + size)` of `region` at `gpa`, with
    /// the lowest free slot id, which it returns.
    pub fn add(
        &self,
        region: &Arc<Region>,
        region_offset: u64,
        size: u64,
        gpa: u64,
        flags: SlotFlags,
    ) -> Result<u32> {
        let mut table = self.table.write().expect("memslot table lock");
        let next = u32::try_from(table.slots.len()).unwrap_or(u32::MAX);
        let id = match table.free_ids.first() {
            Some(&id) => id,
            None if next < self.max_slots => next,
            None => {
                return Err(Error::SlotLimit {
                    region: region.name().into(),
                    max: self.max_slots,
                })
            }
        };
        let slot = Memslot {
            id,
            gpa,
            size,
            region: region.clone(),
            region_offset,
            flags,
            userfault: None,
        };
        self.commit(&mut table, Change::Set(slot))?;
        Ok(id)
    }

    /// Deletes slot `id`; its guest range is unmapped for the guest and for every handle.
    pub fn remove(&self, id: u32) -> Result<()> {
        let mut table = self.table.write().expect("memslot table lock");
        table.get(id)?;
        self.commit(&mut table, Change::Remove(id))
    }

    /// Moves slot `id` to guest address `gpa` (same host memory, same size).
    pub fn move_to(&self, id: u32, gpa: u64) -> Result<()> {
        self.update(id, |s| s.gpa = gpa)
    }

    /// Changes the size of slot `id`, keeping its guest address and host start.
    ///
    /// KVM cannot resize a slot, nor move or change the read-only flag of a guest_memfd slot:
    /// those changes delete the slot and create it anew under the same id. Should KVM refuse
    /// the new slot, the old one is gone and the error names the slot.
    pub fn resize(&self, id: u32, size: u64) -> Result<()> {
        self.update(id, |s| s.size = size)
    }

    /// Sets the flags of slot `id` (e.g. turns dirty logging on or off).
    pub fn set_flags(&self, id: u32, flags: SlotFlags) -> Result<()> {
        self.update(id, |s| s.flags = flags)
    }

    /// Gives slot `id` a KVM Userfault bitmap (`KVM_MEM_USERFAULT`), or takes it away (`None`).
    /// A guest_memfd slot is deleted and created anew with it (KVM does not change a guest_memfd
    /// slot's flags in place), so call it before the vCPUs run. The bitmap must cover the slot.
    pub fn set_userfault(&self, id: u32, bitmap: Option<Arc<UserfaultBitmap>>) -> Result<()> {
        let mut table = self.table.write().expect("memslot table lock");
        let mut slot = table.get(id)?.clone();
        if let Some(b) = &bitmap {
            if b.pages() < slot.size.div_ceil(PAGE_SIZE) {
                return Err(Error::Userfault {
                    region: slot.region.name().into(),
                    reason: format!(
                        "the userfault bitmap covers {} pages, the slot {}",
                        b.pages(),
                        slot.size.div_ceil(PAGE_SIZE)
                    ),
                });
            }
        }
        slot.userfault = bitmap;
        self.commit(&mut table, Change::Set(slot))
    }

    fn update(&self, id: u32, edit: impl FnOnce(&mut Memslot)) -> Result<()> {
        let mut table = self.table.write().expect("memslot table lock");
        let mut slot = table.get(id)?.clone();
        edit(&mut slot);
        self.commit(&mut table, Change::Set(slot))
    }

    /// Discards the guest pages `[gpa, gpa + len)`, which must lie in one slot and be aligned
    /// to the backend's page size: `MADV_DONTNEED` on anonymous memory, a hole punched in the
    /// file otherwise (memfd, hugetlbfs, guest_memfd). The range reads as zero afterwards, for
    /// the guest and through every handle (which revalidate).
    pub fn discard(&self, gpa: u64, len: u64) -> Result<()> {
        let mut table = self.table.write().expect("memslot table lock");
        self.commit(&mut table, Change::Discard { gpa, len })
    }

    /// The one place every change goes through, under the table's write lock: check it, bump
    /// the generation, wait out handle accesses to the range that goes away, tell KVM (or the
    /// kernel's memory manager, for a discard), then update the table.
    fn commit(&self, table: &mut SlotTable, change: Change) -> Result<()> {
        match change {
            Change::Set(new) => self.commit_set(table, new),
            Change::Remove(id) => self.commit_remove(table, id),
            Change::Discard { gpa, len } => self.commit_discard(table, gpa, len),
        }
    }

    /// Puts `new` in place of slot `new.id` (which may not exist yet), once no handle in
    /// flight reads through the mapping it replaces.
    fn commit_set(&self, table: &mut SlotTable, new: Memslot) -> Result<()> {
        check_window(&new)?;
        if let Some(other) = table.overlapping(new.gpa, new.end(), Some(new.id)) {
            return Err(Error::SlotOverlap {
                region: new.region.name().into(),
                gpa: new.gpa,
                end: new.end(),
                other_slot: other.id,
                other: other.region.name().into(),
                other_gpa: other.gpa,
                other_end: other.end(),
            });
        }
        let old = table.slots.get(new.id as usize).cloned().flatten();
        // A change of flags alone maps the same guest range to the same host memory:
        // handles in flight stay valid, so they are not waited for (this keeps turning
        // dirty logging on cheap while device threads use handles).
        let same_mapping = old.as_ref().is_some_and(|old| {
            old.gpa == new.gpa
                && old.size == new.size
                && old.region_offset == new.region_offset
                && Arc::ptr_eq(&old.region, &new.region)
        });
        self.generation.fetch_add(1, Ordering::SeqCst);
        if let (Some(old), false) = (&old, same_mapping) {
            self.wait_for_handles(old.gpa, old.size);
        }
        // KVM changes a slot in place only for a move or a dirty-logging change of the
        // same host memory; anything else (resize, read-only, guest_memfd) is a delete
        // and a create.
        let in_place = old.as_ref().is_some_and(|old| {
            old.size == new.size
                && old.region_offset == new.region_offset
                && Arc::ptr_eq(&old.region, &new.region)
                && old.flags.read_only == new.flags.read_only
                && !new.guest_memfd()
        });
        if let (Some(old), false) = (&old, in_place) {
            self.set_user_memory_region(old, true)?;
            table.remove(old.id);
        }
        self.set_user_memory_region(&new, false)?;
        if old.is_some() && in_place {
            table.remove(new.id);
        }
        table.free_ids.remove(&new.id);
        if table.slots.len() <= new.id as usize {
            table.slots.resize(new.id as usize + 1, None);
        }
        table.insert(new);
        Ok(())
    }

    /// Deletes slot `id`, once no handle in flight reads through it.
    fn commit_remove(&self, table: &mut SlotTable, id: u32) -> Result<()> {
        let old = table.get(id)?.clone();
        self.generation.fetch_add(1, Ordering::SeqCst);
        self.wait_for_handles(old.gpa, old.size);
        self.set_user_memory_region(&old, true)?;
        table.remove(id);
        Ok(())
    }

    /// Drops the pages of `[gpa, gpa + len)` (they read as zero afterwards), once no handle in
    /// flight reads them.
    fn commit_discard(&self, table: &SlotTable, gpa: u64, len: u64) -> Result<()> {
        let slot = table
            .lookup(gpa, len)
            .ok_or(Error::NoMemslot { gpa, len })?;
        let region = &slot.region;
        let page = region.backend().page_size();
        if !gpa.is_multiple_of(page) || !len.is_multiple_of(page) || len == 0 {
            return Err(Error::Misaligned {
                region: region.name().into(),
                what: "discard range",
                value: if gpa.is_multiple_of(page) { len } else { gpa },
                backend: region.backend(),
                page_size: page,
            });
        }
        let (host, offset) = slot.host_range(gpa, len).expect("looked up");
        self.generation.fetch_add(1, Ordering::SeqCst);
        self.wait_for_handles(gpa, len);
        let dropped = match region.fd() {
            None => {
                // SAFETY: `host`/`len` lie inside the region's private anonymous mapping;
                // MADV_DONTNEED only drops its pages (they read as zero afterwards).
                let ret = unsafe {
                    libc::madvise(
                        host.cast::<libc::c_void>(),
                        to_usize(len),
                        libc::MADV_DONTNEED,
                    )
                };
                if ret == 0 {
                    Ok(())
                } else {
                    Err(("madvise(MADV_DONTNEED)", io::Error::last_os_error()))
                }
            }
            Some(fd) => guestmem_sys::punch_hole(fd.as_fd(), offset, len)
                .map_err(|e| ("fallocate(PUNCH_HOLE)", e)),
        };
        if let Err((op, source)) = dropped {
            return Err(Error::Kvm {
                slot: slot.id,
                region: region.name().into(),
                op,
                source,
            });
        }
        Ok(())
    }

    /// Waits until no handle overlapping `[gpa, gpa + len)` is inside an access. Called after
    /// the generation was bumped: any access that starts later sees the new generation and
    /// revalidates (blocking on the table lock that the caller holds).
    fn wait_for_handles(&self, gpa: u64, len: u64) {
        let handles = self.handles.lock().expect("handle list lock");
        let overlapping: Vec<_> = handles
            .iter()
            .filter_map(Weak::upgrade)
            .filter(|h| h.overlaps(gpa, len))
            .collect();
        if overlapping.is_empty() {
            return;
        }
        // Every thread now sees the new generation, or its `inflight` store is visible to us.
        membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED).expect("membarrier was registered in new()");
        for h in overlapping {
            h.wait_idle();
        }
    }

    /// `KVM_SET_USER_MEMORY_REGION2` for `slot` (with size 0 when `delete`), or the original
    /// ioctl on kernels without it.
    fn set_user_memory_region(&self, slot: &Memslot, delete: bool) -> Result<()> {
        let (host, _) = slot.host_range(slot.gpa, 0).expect("slot start");
        let mut mr = kvm_userspace_memory_region2 {
            slot: slot.id,
            flags: slot.kvm_flags(),
            guest_phys_addr: slot.gpa,
            memory_size: if delete { 0 } else { slot.size },
            userspace_addr: host as u64,
            guest_memfd_offset: if slot.guest_memfd() {
                slot.region_offset
            } else {
                0
            },
            guest_memfd: slot
                .region
                .fd()
                .filter(|_| slot.guest_memfd())
                .map_or(0, |fd| fd.as_raw_fd() as u32),
            ..Default::default()
        };
        // The KVM Userfault series puts `__u64 userfault_bitmap` where `pad2[0]` is.
        if let Some(bitmap) = &slot.userfault {
            mr.pad2[0] = bitmap.addr();
        }
        let ret = if self.has_region2 {
            // SAFETY: `mr` is a fully initialised kvm_userspace_memory_region2 describing memory
            // that the slot's `Arc<Region>` keeps mapped for as long as the slot exists.
            unsafe { ioctl_with_ref(&self.vm, KVM_SET_USER_MEMORY_REGION2(), &mr) }
        } else if slot.guest_memfd() {
            return Err(Error::BackendUnavailable {
                region: slot.region.name().into(),
                backend: Backend::GuestMemfd,
                reason: "the kernel lacks KVM_CAP_USER_MEMORY2".into(),
            });
        } else {
            let legacy = kvm_userspace_memory_region {
                slot: mr.slot,
                flags: mr.flags,
                guest_phys_addr: mr.guest_phys_addr,
                memory_size: mr.memory_size,
                userspace_addr: mr.userspace_addr,
            };
            // SAFETY: as above, for the original ioctl.
            unsafe { ioctl_with_ref(&self.vm, KVM_SET_USER_MEMORY_REGION(), &legacy) }
        };
        if ret != 0 {
            return Err(Error::Kvm {
                slot: slot.id,
                region: slot.region.name().into(),
                op: if delete {
                    "KVM_SET_USER_MEMORY_REGION2 (delete)"
                } else {
                    "KVM_SET_USER_MEMORY_REGION2"
                },
                source: io::Error::last_os_error(),
            });
        }
        Ok(())
    }

    /// A handle for `[gpa, gpa + len)`, which must lie in one slot now: device code keeps it
    /// and accesses the range through it again and again (see [`CachedMapping`]).
    pub fn map(self: &Arc<Self>, gpa: u64, len: u64) -> Result<CachedMapping> {
        let handle = CachedMapping::new(self.clone(), gpa, len)?;
        let mut handles = self.handles.lock().expect("handle list lock");
        handles.retain(|weak| weak.strong_count() > 0);
        handles.push(Arc::downgrade(handle.state()));
        Ok(handle)
    }

    /// Copies guest memory at `gpa` into `buf` (a fresh lookup, under the table's read lock).
    pub fn read(&self, gpa: u64, buf: &mut [u8]) -> Result<()> {
        let table = self.table();
        let len = buf.len() as u64;
        let slot = table
            .lookup(gpa, len)
            .ok_or(Error::NoMemslot { gpa, len })?;
        let (src, _) = slot.host_range(gpa, len).expect("looked up");
        // SAFETY: the range lies inside the slot's live mapping, which cannot go away while we
        // hold the table's read lock; `buf` is a distinct host buffer.
        unsafe { std::ptr::copy_nonoverlapping(src, buf.as_mut_ptr(), buf.len()) };
        Ok(())
    }

    /// Copies `data` into guest memory at `gpa`, marking the pages VMM-dirty (a fresh lookup).
    pub fn write(&self, gpa: u64, data: &[u8]) -> Result<()> {
        let table = self.table();
        let len = data.len() as u64;
        let slot = table
            .lookup(gpa, len)
            .ok_or(Error::NoMemslot { gpa, len })?;
        let (dst, offset) = slot.host_range(gpa, len).expect("looked up");
        slot.region.vmm_dirty().mark(offset, len);
        // SAFETY: as in `read`, with the roles swapped.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) };
        Ok(())
    }

    pub(crate) fn table(&self) -> RwLockReadGuard<'_, SlotTable> {
        self.table.read().expect("memslot table lock")
    }
}

/// `membarrier(cmd, 0, 0)`.
fn membarrier(cmd: i32) -> Result<()> {
    // SAFETY: membarrier takes no pointers; it only orders memory accesses of our threads.
    let ret = unsafe { libc::syscall(libc::SYS_membarrier, cmd, 0, 0) };
    if ret != 0 {
        return Err(Error::Os {
            region: "(memslot manager)".into(),
            op: "membarrier",
            source: io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// A slot's window must be non-empty, aligned to the backend's page size, and inside the region.
fn check_window(slot: &Memslot) -> Result<()> {
    let region = &slot.region;
    let page = region.backend().page_size();
    let fits = slot
        .region_offset
        .checked_add(slot.size)
        .is_some_and(|end| end <= region.size());
    if slot.size == 0
        || !fits
        || !slot.size.is_multiple_of(page)
        || !slot.region_offset.is_multiple_of(page)
    {
        return Err(Error::SlotWindow {
            region: region.name().into(),
            offset: slot.region_offset,
            size: slot.size,
            region_size: region.size(),
        });
    }
    if slot.gpa.checked_add(slot.size).is_none() {
        return Err(Error::OutOfRange {
            region: region.name().into(),
            gpa: slot.gpa,
            size: slot.size,
        });
    }
    if !slot.gpa.is_multiple_of(page) {
        return Err(Error::Misaligned {
            region: region.name().into(),
            what: "memslot guest address",
            value: slot.gpa,
            backend: region.backend(),
            page_size: page,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RegionSpec;

    const GPA: u64 = 0x1_0000_0000;

    fn vm() -> VmFd {
        kvm_ioctls::Kvm::new()
            .expect("/dev/kvm")
            .create_vm()
            .expect("a VM")
    }

    fn region(name: &str, size: u64, backend: Backend) -> Arc<Region> {
        Arc::new(Region::create(RegionSpec::new(name, GPA, size, backend), None).expect("region"))
    }

    fn slot(id: u32, gpa: u64, size: u64, region: &Arc<Region>, offset: u64) -> Memslot {
        Memslot {
            id,
            gpa,
            size,
            region: region.clone(),
            region_offset: offset,
            flags: SlotFlags::default(),
            userfault: None,
        }
    }

    /// The table finds a range only inside one slot: not across two adjacent slots, not in the
    /// gap between them, not below the first; slots that merely touch do not overlap, and a
    /// slot never overlaps itself when it is the one changing.
    #[test]
    fn the_table_finds_ranges_inside_one_slot_only() {
        let r = region("t", 16 * PAGE_SIZE, Backend::Anon);
        let mut table = SlotTable {
            slots: vec![None; 3],
            ..Default::default()
        };
        table.insert(slot(0, GPA, 4 * PAGE_SIZE, &r, 0));
        table.insert(slot(
            2,
            GPA + 4 * PAGE_SIZE,
            2 * PAGE_SIZE,
            &r,
            8 * PAGE_SIZE,
        ));
        let found = |gpa, len| table.lookup(gpa, len).map(|s| s.id);
        assert_eq!(found(GPA, 4 * PAGE_SIZE), Some(0));
        assert_eq!(found(GPA + 4 * PAGE_SIZE - 8, 8), Some(0));
        assert_eq!(
            found(GPA + 4 * PAGE_SIZE - 8, 16),
            None,
            "straddles two slots"
        );
        assert_eq!(found(GPA + 4 * PAGE_SIZE, 2 * PAGE_SIZE), Some(2));
        assert_eq!(found(GPA + 6 * PAGE_SIZE, 1), None, "past the last slot");
        assert_eq!(found(GPA - 1, 1), None, "below the first slot");
        assert_eq!(found(GPA, u64::MAX), None, "a length that overflows");

        let over = |gpa, end, except| table.overlapping(gpa, end, except).map(|s| s.id);
        assert_eq!(over(GPA - PAGE_SIZE, GPA, None), None, "touches slot 0");
        assert_eq!(over(GPA + 6 * PAGE_SIZE, GPA + 7 * PAGE_SIZE, None), None);
        assert_eq!(over(GPA - PAGE_SIZE, GPA + 1, None), Some(0));
        assert_eq!(
            over(GPA + 5 * PAGE_SIZE, GPA + 9 * PAGE_SIZE, None),
            Some(2)
        );
        assert_eq!(over(GPA, GPA + 5 * PAGE_SIZE, Some(2)), Some(0));
        assert_eq!(
            over(GPA + 4 * PAGE_SIZE, GPA + 5 * PAGE_SIZE, Some(2)),
            None
        );

        // The host address of a range is the region's, at the window's offset.
        let (host, offset) = table.slots[2]
            .as_ref()
            .unwrap()
            .host_range(GPA + 5 * PAGE_SIZE + 16, 8)
            .unwrap();
        assert_eq!(offset, 9 * PAGE_SIZE + 16);
        assert_eq!(host as usize - r.host_addr() as usize, to_usize(offset));

        table.remove(0);
        assert!(table.lookup(GPA, 8).is_none());
        assert_eq!(table.free_ids.iter().copied().collect::<Vec<_>>(), vec![0]);
    }

    /// The flags KVM is given follow the slot's own flags, a userfault bitmap and the region's
    /// backend, each bit independently.
    #[test]
    fn kvm_flags_follow_the_slot() {
        let r = region("f", 4 * PAGE_SIZE, Backend::Memfd);
        let mut s = slot(0, GPA, 4 * PAGE_SIZE, &r, 0);
        assert_eq!(s.kvm_flags(), 0);
        s.flags.log_dirty_pages = true;
        assert_eq!(s.kvm_flags(), KVM_MEM_LOG_DIRTY_PAGES);
        s.flags.read_only = true;
        assert_eq!(s.kvm_flags(), KVM_MEM_LOG_DIRTY_PAGES | KVM_MEM_READONLY);
        s.flags = SlotFlags::default();
        s.userfault = Some(Arc::new(UserfaultBitmap::all_set(4 * PAGE_SIZE)));
        assert_eq!(s.kvm_flags(), KVM_MEM_USERFAULT_CANDIDATE);
        assert!(!s.guest_memfd());
    }

    /// A discard names the value that is misaligned: the address if it is, else the length; a
    /// userfault bitmap shorter than the slot is refused naming both sizes; neither changes
    /// the generation.
    #[test]
    fn refused_discards_and_bitmaps_name_the_problem() {
        let vm = vm();
        let slots = MemslotManager::new(&vm).unwrap();
        let r = region("d", 8 * PAGE_SIZE, Backend::Memfd);
        let id = slots
            .add(&r, 0, 8 * PAGE_SIZE, GPA, SlotFlags::default())
            .unwrap();
        let generation = slots.generation();
        for (gpa, len, value) in [
            (GPA + 8, PAGE_SIZE, GPA + 8),
            (GPA, 100, 100),
            (GPA + PAGE_SIZE, 0, 0),
        ] {
            match slots.discard(gpa, len) {
                Err(Error::Misaligned {
                    what: "discard range",
                    value: v,
                    page_size: PAGE_SIZE,
                    ..
                }) => assert_eq!(v, value, "{gpa:#x}+{len:#x}"),
                other => panic!("{gpa:#x}+{len:#x}: {other:?}"),
            }
        }
        let short = Arc::new(UserfaultBitmap::all_set(7 * PAGE_SIZE));
        let e = slots.set_userfault(id, Some(short)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "region 'd': KVM Userfault: the userfault bitmap covers 7 pages, the slot 8"
        );
        assert_eq!(slots.generation(), generation);
        assert!(slots.slot(id).unwrap().userfault.is_none());
    }

    /// A discard zeroes exactly its pages, on a file backend and an anonymous one.
    #[test]
    fn a_discard_zeroes_exactly_its_pages() {
        let vm = vm();
        let slots = MemslotManager::new(&vm).unwrap();
        for (i, backend) in [Backend::Memfd, Backend::Anon].into_iter().enumerate() {
            let gpa = GPA + i as u64 * 0x10_0000;
            let r = region(&format!("z{i}"), 4 * PAGE_SIZE, backend);
            slots
                .add(&r, 0, 4 * PAGE_SIZE, gpa, SlotFlags::default())
                .unwrap();
            slots
                .write(gpa, &vec![0xa5; to_usize(4 * PAGE_SIZE)])
                .unwrap();
            let generation = slots.generation();
            slots.discard(gpa + PAGE_SIZE, 2 * PAGE_SIZE).unwrap();
            assert_eq!(slots.generation(), generation + 1);
            let mut got = vec![0u8; to_usize(4 * PAGE_SIZE)];
            slots.read(gpa, &mut got).unwrap();
            let page = to_usize(PAGE_SIZE);
            assert!(got[..page].iter().all(|&b| b == 0xa5), "{backend}");
            assert!(got[page..3 * page].iter().all(|&b| b == 0), "{backend}");
            assert!(got[3 * page..].iter().all(|&b| b == 0xa5), "{backend}");
        }
    }
}
