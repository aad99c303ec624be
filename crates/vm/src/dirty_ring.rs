//! A vCPU's dirty ring (`KVM_CAP_DIRTY_LOG_RING`), mapped from its vCPU fd so that a harvester
//! thread can collect it while the vCPU runs.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;

use guestmem_sys::uapi::{
    kvm_dirty_gfn, KVM_DIRTY_GFN_F_DIRTY, KVM_DIRTY_GFN_F_RESET, KVM_DIRTY_LOG_PAGE_OFFSET,
};
use kvm_ioctls::VcpuFd;
use std::os::fd::AsRawFd;

use crate::{Error, Result};

/// One vCPU's ring of `kvm_dirty_gfn` entries, shared with the kernel.
#[derive(Debug)]
pub struct DirtyRing {
    gfns: NonNull<kvm_dirty_gfn>,
    entries: u32,
    /// The next entry to collect (the kernel's reset index follows it).
    next: Mutex<u32>,
}

// SAFETY: the mapping is plain shared memory owned by this struct until drop; entries are only
// accessed through volatile reads and the atomic `flags` word, as the kernel's protocol requires,
// by one collector at a time (`next` is locked).
unsafe impl Send for DirtyRing {}
// SAFETY: as above; concurrent readers see the same kernel-shared memory.
unsafe impl Sync for DirtyRing {}

impl DirtyRing {
    /// Maps the `bytes`-byte ring of `vcpu` (the VM has the dirty ring enabled).
    #[allow(clippy::cast_possible_truncation)] // `kvm_dirty_gfn` is 16 bytes.
    pub(crate) fn map(vcpu: &VcpuFd, id: usize, bytes: u32) -> Result<DirtyRing> {
        let offset = i64::from(KVM_DIRTY_LOG_PAGE_OFFSET) * 4096;
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
            next: Mutex::new(0),
        })
    }

    /// Number of entries (a power of two).
    pub fn entries(&self) -> u32 {
        self.entries
    }

    /// Collects every entry the kernel has published since the last call, in order: calls
    /// `f(slot, page offset in the slot)` for each and marks it `KVM_DIRTY_GFN_F_RESET`. Returns
    /// how many it collected; the caller then issues `KVM_RESET_DIRTY_RINGS` so the kernel can
    /// reuse them. One collector at a time (the position is kept here, across trackers).
    pub fn collect(&self, mut f: impl FnMut(u32, u64)) -> u32 {
        let mut next = self
            .next
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let start = *next;
        loop {
            let e = self.entry(*next);
            // SAFETY: `flags` is the first, 4-byte aligned u32 of a live entry of the mapping,
            // which lives as long as `self`; the kernel also accesses it atomically.
            let flags = unsafe { AtomicU32::from_ptr(std::ptr::addr_of_mut!((*e).flags)) };
            if flags.load(Ordering::Acquire) & KVM_DIRTY_GFN_F_DIRTY == 0 {
                return next.wrapping_sub(start);
            }
            // SAFETY: `e` points into the live mapping; the fields are aligned; volatile because
            // the kernel writes them (before publishing the flags, which we read with Acquire).
            let (slot, offset) = unsafe {
                (
                    std::ptr::read_volatile(std::ptr::addr_of!((*e).slot)),
                    std::ptr::read_volatile(std::ptr::addr_of!((*e).offset)),
                )
            };
            f(slot, offset);
            flags.store(KVM_DIRTY_GFN_F_RESET, Ordering::Release);
            *next = next.wrapping_add(1);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A ring of 8 entries in a private mapping laid out as KVM's (the reader's side of the
    /// protocol: the kernel's side is exercised by the VM tests that harvest real rings).
    fn ring() -> DirtyRing {
        let bytes = 8 * std::mem::size_of::<kvm_dirty_gfn>();
        // SAFETY: a fresh private anonymous mapping, owned by the ring (unmapped on drop).
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(addr, libc::MAP_FAILED);
        DirtyRing {
            gfns: NonNull::new(addr.cast()).unwrap(),
            entries: 8,
            next: Mutex::new(0),
        }
    }

    /// Publishes entry `i` as the kernel does: slot and offset, then the dirty flag.
    fn publish(r: &DirtyRing, i: u32, slot: u32, offset: u64) {
        let e = r.entry(i);
        // SAFETY: `e` is an entry of the live mapping.
        unsafe {
            std::ptr::write_volatile(std::ptr::addr_of_mut!((*e).slot), slot);
            std::ptr::write_volatile(std::ptr::addr_of_mut!((*e).offset), offset);
            AtomicU32::from_ptr(std::ptr::addr_of_mut!((*e).flags))
                .store(KVM_DIRTY_GFN_F_DIRTY, Ordering::Release);
        }
    }

    fn flags(r: &DirtyRing, i: u32) -> u32 {
        // SAFETY: as in `publish`.
        unsafe {
            AtomicU32::from_ptr(std::ptr::addr_of_mut!((*r.entry(i)).flags)).load(Ordering::Acquire)
        }
    }

    /// Collection takes the published entries in order, marks each for reset, stops at the
    /// first unpublished one, and goes on from there next time, around the end of the ring.
    #[test]
    fn collection_resumes_where_it_stopped_around_the_ring() {
        let r = ring();
        assert_eq!(r.entries(), 8);
        for i in 0..6 {
            publish(&r, i, 1, u64::from(i) * 10);
        }
        let mut got = Vec::new();
        assert_eq!(r.collect(|s, o| got.push((s, o))), 6);
        assert_eq!(got, (0..6).map(|i| (1, i * 10)).collect::<Vec<_>>());
        assert!((0..6).all(|i| flags(&r, i) == KVM_DIRTY_GFN_F_RESET));
        assert_eq!(r.collect(|_, _| panic!("nothing published")), 0);
        // The kernel reuses the reset entries: 6, 7, then 8 and 9 (entries 0 and 1).
        for i in 6..10 {
            publish(&r, i, 2, u64::from(i));
        }
        got.clear();
        assert_eq!(r.collect(|s, o| got.push((s, o))), 4);
        assert_eq!(got, [(2, 6), (2, 7), (2, 8), (2, 9)]);
        assert_eq!(
            flags(&r, 2),
            KVM_DIRTY_GFN_F_RESET,
            "entry 2 not published again"
        );
    }
}
