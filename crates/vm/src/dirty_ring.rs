//! A vCPU's dirty ring (`KVM_CAP_DIRTY_LOG_RING`), mapped from its vCPU fd so that a harvester
//! thread can collect it while the vCPU runs.

use std::ptr::NonNull;
use std::sync::atomic::AtomicU32;

use guestmem_sys::uapi::{kvm_dirty_gfn, KVM_DIRTY_LOG_PAGE_OFFSET};
use kvm_ioctls::VcpuFd;
use std::os::fd::AsRawFd;

use crate::{Error, Result};

/// One vCPU's ring of `kvm_dirty_gfn` entries, shared with the kernel.
pub struct DirtyRing {
    gfns: NonNull<kvm_dirty_gfn>,
    entries: u32,
}

// SAFETY: the mapping is plain shared memory owned by this struct until drop; entries are only
// accessed through volatile reads and the atomic `flags` word, as the kernel's protocol requires.
unsafe impl Send for DirtyRing {}
// SAFETY: as above; concurrent readers see the same kernel-shared memory.
unsafe impl Sync for DirtyRing {}

impl DirtyRing {
    /// Maps the `bytes`-byte ring of `vcpu` (the VM has the dirty ring enabled).
    pub(crate) fn map(vcpu: &VcpuFd, id: usize, bytes: u32) -> Result<DirtyRing> {
        let offset = KVM_DIRTY_LOG_PAGE_OFFSET as i64 * 4096;
        // SAFETY: a fresh shared mapping of the vCPU fd at the kernel's dirty-ring offset; the
        // kernel checks the length against the ring size; no existing memory is affected.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                vcpu.as_raw_fd(),
                offset,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(Error::Thread {
                vcpu: id,
                reason: format!(
                    "cannot map the vCPU's {bytes}-byte dirty ring: {}",
                    std::io::Error::last_os_error()
                ),
            });
        }
        Ok(DirtyRing {
            gfns: NonNull::new(addr.cast()).expect("mmap never returns NULL on success"),
            entries: bytes / std::mem::size_of::<kvm_dirty_gfn>() as u32,
        })
    }

    /// Number of entries (a power of two).
    pub fn entries(&self) -> u32 {
        self.entries
    }

    /// The flags word of entry `i % entries` (`KVM_DIRTY_GFN_F_DIRTY` set by the kernel,
    /// `KVM_DIRTY_GFN_F_RESET` set by the harvester).
    pub fn flags(&self, i: u32) -> &AtomicU32 {
        let e = self.entry(i);
        // SAFETY: `flags` is the first, 4-byte aligned u32 of a live entry of the mapping, which
        // lives as long as `self`; the kernel also accesses it atomically.
        unsafe { AtomicU32::from_ptr(std::ptr::addr_of_mut!((*e).flags)) }
    }

    /// The (slot, page offset in the slot) of entry `i % entries`; read it only after seeing
    /// `KVM_DIRTY_GFN_F_DIRTY` in its flags (with acquire ordering).
    pub fn gfn(&self, i: u32) -> (u32, u64) {
        let e = self.entry(i);
        // SAFETY: `e` points into the live mapping; the fields are aligned; volatile because the
        // kernel writes them.
        unsafe {
            (
                std::ptr::read_volatile(std::ptr::addr_of!((*e).slot)),
                std::ptr::read_volatile(std::ptr::addr_of!((*e).offset)),
            )
        }
    }

    fn entry(&self, i: u32) -> *mut kvm_dirty_gfn {
        // SAFETY: the index is reduced modulo the entry count, so the pointer stays inside the
        // mapping.
        unsafe { self.gfns.as_ptr().add((i % self.entries) as usize) }
    }
}

impl Drop for DirtyRing {
    fn drop(&mut self) {
        let bytes = self.entries as usize * std::mem::size_of::<kvm_dirty_gfn>();
        // SAFETY: unmaps exactly the mapping created in `map`; nothing refers to it any more.
        unsafe { libc::munmap(self.gfns.as_ptr().cast(), bytes) };
    }
}
