//! Taking a finished clone's VM back to "built, never run" for a restore service's pool (see
//! [`crate::service::RestoreService::recycle`]): what makes a VM unfit to be reused, and
//! wiping its memory back to what a fresh build holds, so that no byte one clone wrote can
//! reach the next.
//!
//! What the reuse relies on, and where it is set again: the guest RAM and the sys region (here:
//! every region replaced by fresh memory); the vCPU registers, MSRs, pending events, CPUID,
//! TSC rate and the kvmclock ([`guestmem_vm::Vm::restore_state`] at the next restore, after
//! [`guestmem_vm::Vm::complete_pending_exits`] here); for a Linux guest also the PIC, IOAPIC,
//! PIT, each LAPIC and the TSC deadline ([`guestmem_vm::linux::LinuxVm::restore_state`]), the
//! UART's registers (the clone's "serial" component) and its console writer (set for each
//! clone by the restore's caller); the memslots (checked here to be as the
//! build made them: one per region, no dirty logging, not read-only, no KVM Userfault). What
//! could not be reset is refused: a failed pager or an aborted run, guest_memfd regions (KVM
//! Userfault state), dirty rings (entries of the old clone), a page server's handoff, a NUMA
//! policy (fresh anonymous memory would not carry it).

use std::os::fd::AsFd;

use guestmem_memory::{Backend, GuestMemory, NumaPolicy, SlotFlags};
use guestmem_pageserver::PeerHandoff;
use guestmem_paging::{Pager, UserfaultPager};
use guestmem_sys::to_usize;
use guestmem_vm::VmConfig;

use crate::pooled::PoolMachine;

/// Why the VM of a finished clone (its pagers, VM and page-server handoff as the restore gave
/// them) cannot be reused for a restore of a snapshot of `config`; `Ok` if it can.
pub(crate) fn unfit<M: PoolMachine>(
    pagers: &[Pager],
    userfault_pagers: &[UserfaultPager],
    vm: &M,
    peer: Option<&PeerHandoff>,
    config: &VmConfig,
) -> std::result::Result<(), String> {
    if let Some(reason) = pagers.iter().find_map(Pager::failure) {
        return Err(format!("a pager failed: {reason}"));
    }
    if let Some(reason) = vm.abort_handle().and_then(|h| h.reason()) {
        return Err(format!("its run was aborted: {reason}"));
    }
    if !userfault_pagers.is_empty() {
        return Err(
            "it has guest_memfd regions, paged through KVM Userfault, whose state a reuse \
             would have to reset"
                .into(),
        );
    }
    if peer.is_some() {
        return Err("its memory was handed to a page server".into());
    }
    if vm.config() != config {
        return Err(format!(
            "it was built for {:?}, not the snapshot's configuration {config:?}",
            vm.config()
        ));
    }
    if vm.has_dirty_rings() {
        return Err("it has dirty rings, which hold the old clone's entries".into());
    }
    let memory = vm.memory();
    for region in memory.regions() {
        match region.backend() {
            Backend::GuestMemfd => {
                return Err(format!(
                    "region '{}' is guest_memfd, whose KVM Userfault state a reuse would have \
                     to reset",
                    region.name()
                ))
            }
            Backend::Anon if region.spec().numa != NumaPolicy::default() => {
                return Err(format!(
                    "region '{}' has the NUMA policy {}, which fresh memory would not carry",
                    region.name(),
                    region.spec().numa
                ))
            }
            _ => {}
        }
    }
    memslots_as_built(memory)
}

/// `Ok` if `memory`'s memslots are as the VM's build registered them: slot `i` shows all of
/// region `i` at its address, without dirty logging, read-only or KVM Userfault.
fn memslots_as_built(memory: &GuestMemory) -> std::result::Result<(), String> {
    let Some(manager) = memory.memslots() else {
        return Err("its memory is not registered as memslots".into());
    };
    let slots = manager.slots();
    let regions = memory.regions();
    if slots.len() != regions.len() {
        return Err(format!(
            "it has {} memslots, not one per region ({})",
            slots.len(),
            regions.len()
        ));
    }
    for slot in &slots {
        let as_built = regions.get(to_usize(u64::from(slot.id))).is_some_and(|r| {
            std::sync::Arc::ptr_eq(r, &slot.region)
                && slot.gpa == r.gpa()
                && slot.size == r.size()
                && slot.region_offset == 0
        });
        if !as_built || slot.flags != SlotFlags::default() || slot.userfault.is_some() {
            return Err(format!(
                "memslot {} was changed since the VM was built (now {:#x}+{:#x}, {:?}, KVM \
                 Userfault {})",
                slot.id,
                slot.gpa,
                slot.size,
                slot.flags,
                slot.userfault.is_some()
            ));
        }
    }
    Ok(())
}

/// Replaces every region's memory with fresh memory, as a new VM's: anonymous regions get a
/// new anonymous mapping at the same address (whatever was mapped there: the clone's own pages,
/// a shared image's copy-on-write mapping), a file-backed region's file is emptied (its pages
/// punched out). No vCPU may run and no pager may be registered on it meanwhile. The memslots
/// keep their host addresses; KVM drops its mappings of the old pages as they go.
pub(crate) fn wipe(memory: &GuestMemory) -> std::result::Result<(), String> {
    for region in memory.regions() {
        let (addr, len) = (region.host_addr(), to_usize(region.size()));
        let failed = |op: &str| {
            format!(
                "{op} over region '{}': {}",
                region.name(),
                std::io::Error::last_os_error()
            )
        };
        match region.backend() {
            Backend::Anon => {
                // SAFETY: the range is exactly the region's own mapping (the region unmaps it
                // on drop); nothing runs on it (no vCPU, no pager); MAP_FIXED replaces it with
                // a fresh anonymous mapping of the same length and protection, as
                // `Region::create` made it.
                let new = unsafe {
                    libc::mmap(
                        addr.cast(),
                        len,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_PRIVATE
                            | libc::MAP_ANONYMOUS
                            | libc::MAP_NORESERVE
                            | libc::MAP_FIXED,
                        -1,
                        0,
                    )
                };
                if new == libc::MAP_FAILED {
                    return Err(failed("mmap (fresh anonymous memory)"));
                }
            }
            Backend::Memfd | Backend::MemfdHugetlb | Backend::Hugetlbfs => {
                let fd = region
                    .fd()
                    .ok_or_else(|| format!("region '{}' has no file", region.name()))?;
                // Punching out its pages only drops them (the shared mapping then reads zeros).
                if guestmem_sys::punch_hole(fd.as_fd(), 0, region.size()).is_err() {
                    return Err(failed("fallocate (punching out its pages)"));
                }
            }
            Backend::GuestMemfd => {
                return Err(format!(
                    "region '{}' is guest_memfd, which a reuse does not reset",
                    region.name()
                ))
            }
        }
    }
    Ok(())
}
