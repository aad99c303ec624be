//! Kernel uapi definitions that neither `kvm-bindings` 0.14 nor `libc` carry, under the kernel's
//! own names. Structs come from `kvm-bindings` wherever it has them; this module only adds the
//! constants and ioctl numbers that are missing. Definitions for features that are not upstream
//! (KVM Userfault, guest_memfd `write()`) are *candidates*: their numbers moved between patch
//! versions, so code must confirm them by trying (see `probe`).
#![allow(non_upper_case_globals)]
// Kernel names, each group introduced by a comment naming its header: the kernel's own
// documentation is theirs (and the ioctl number macros cannot carry docs).
#![allow(missing_docs)]

use vmm_sys_util::{ioctl_io_nr, ioctl_iow_nr, ioctl_iowr_nr};

pub use kvm_bindings::{
    kvm_clear_dirty_log, kvm_create_guest_memfd, kvm_dirty_gfn, kvm_dirty_log,
    kvm_userspace_memory_region, kvm_userspace_memory_region2, KVM_CAP_DIRTY_LOG_RING,
    KVM_CAP_DIRTY_LOG_RING_ACQ_REL, KVM_CAP_GUEST_MEMFD, KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2,
    KVM_CAP_NR_MEMSLOTS, KVM_CAP_PRE_FAULT_MEMORY, KVM_CAP_USER_MEMORY2,
    KVM_DIRTY_LOG_INITIALLY_SET, KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE, KVM_DIRTY_LOG_PAGE_OFFSET,
    KVM_EXIT_DIRTY_RING_FULL, KVM_EXIT_MEMORY_FAULT, KVM_MEM_GUEST_MEMFD, KVM_MEM_LOG_DIRTY_PAGES,
    KVM_MEM_READONLY,
};

/// `KVMIO`, the ioctl type byte of every KVM ioctl.
pub const KVMIO: u32 = 0xAE;

/// `KVM_CAP_GUEST_MEMFD_MMAP` (Linux 6.18): guest_memfd can be mmap()ed.
pub const KVM_CAP_GUEST_MEMFD_MMAP: u32 = 243;
/// `KVM_CAP_GUEST_MEMFD_FLAGS` (Linux 6.18): returns the valid `kvm_create_guest_memfd.flags`.
pub const KVM_CAP_GUEST_MEMFD_FLAGS: u32 = 244;
/// `GUEST_MEMFD_FLAG_MMAP`: the fd may be mmap()ed by the host.
pub const GUEST_MEMFD_FLAG_MMAP: u64 = 1 << 0;
/// `GUEST_MEMFD_FLAG_INIT_SHARED`: the fd's memory starts shared (host-accessible).
pub const GUEST_MEMFD_FLAG_INIT_SHARED: u64 = 1 << 1;
/// `GUEST_MEMFD_FLAG_WRITE` of the guest_memfd `write()` series (not upstream; confirm by
/// trying): bit 3 in Firecracker's 6.18 kernel and in the seeds kernel (`kernel/seeds`), bit 2
/// being the direct map removal series' `GUEST_MEMFD_FLAG_NO_DIRECT_MAP`.
pub const GUEST_MEMFD_FLAG_WRITE_CANDIDATE: u64 = 1 << 3;

/// `KVM_MEM_USERFAULT` as carried by the KVM Userfault series (not upstream; confirm by trying).
pub const KVM_MEM_USERFAULT_CANDIDATE: u32 = 1 << 3;
/// `KVM_MEMORY_EXIT_FLAG_USERFAULT` as carried by the KVM Userfault series: set in
/// `kvm_run.memory_fault.flags` of a `KVM_EXIT_MEMORY_FAULT` whose page is marked in the
/// memslot's userfault bitmap.
pub const KVM_MEMORY_EXIT_FLAG_USERFAULT_CANDIDATE: u64 = 1 << 4;
/// `KVM_CAP_USERFAULT` in the seeds kernel (245 in Firecracker's 6.18 kernel, where 7.3 has
/// `KVM_CAP_ARM_SEA_TO_USER`): informative only; the probe tries the memslot flag instead.
pub const KVM_CAP_USERFAULT_SEEDS: u32 = 252;

/// `KVM_DIRTY_GFN_F_DIRTY`: the ring entry holds a dirty gfn for userspace to collect.
pub const KVM_DIRTY_GFN_F_DIRTY: u32 = 1 << 0;
/// `KVM_DIRTY_GFN_F_RESET`: userspace has collected the entry; the kernel may reuse it.
pub const KVM_DIRTY_GFN_F_RESET: u32 = 1 << 1;

// `_IOW`, not `_IOWR`: the kernel only reads the struct (a wrong direction gives ENOTTY).
ioctl_iow_nr!(
    KVM_SET_USER_MEMORY_REGION,
    KVMIO,
    0x46,
    kvm_userspace_memory_region
);
ioctl_iow_nr!(
    KVM_SET_USER_MEMORY_REGION2,
    KVMIO,
    0x49,
    kvm_userspace_memory_region2
);
ioctl_iow_nr!(KVM_GET_DIRTY_LOG, KVMIO, 0x42, kvm_dirty_log);
ioctl_iowr_nr!(KVM_CLEAR_DIRTY_LOG, KVMIO, 0xc0, kvm_clear_dirty_log);
ioctl_io_nr!(KVM_RESET_DIRTY_RINGS, KVMIO, 0xc7);

/// `MEMBARRIER_CMD_PRIVATE_EXPEDITED` (`include/uapi/linux/membarrier.h`): run a full memory
/// barrier on every running thread of the process.
pub const MEMBARRIER_CMD_PRIVATE_EXPEDITED: i32 = 1 << 3;
/// `MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED`: required once before the command above.
pub const MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED: i32 = 1 << 4;

/// `MPOL_*` memory policy modes (`include/uapi/linux/mempolicy.h`).
pub const MPOL_DEFAULT: i32 = 0;
pub const MPOL_PREFERRED: i32 = 1;
pub const MPOL_BIND: i32 = 2;
pub const MPOL_INTERLEAVE: i32 = 3;
/// `MPOL_MF_STRICT` / `MPOL_MF_MOVE` flags of `mbind`.
pub const MPOL_MF_STRICT: u32 = 1 << 0;
pub const MPOL_MF_MOVE: u32 = 1 << 1;
/// `MPOL_F_ADDR` flag of `get_mempolicy`: report the policy of the mapping at `addr`.
pub const MPOL_F_ADDR: u64 = 1 << 1;

/// `UFFDIO`, the ioctl type byte of every userfaultfd ioctl (`include/uapi/linux/userfaultfd.h`).
pub const UFFDIO: u32 = 0xAA;
/// `UFFD_API`: the only userfaultfd API version; `uffdio_api.api` must hold it.
pub const UFFD_API: u64 = 0xAA;
/// `UFFD_USER_MODE_ONLY`: a userfaultfd flag (with `O_CLOEXEC`/`O_NONBLOCK`) to handle user faults only.
pub const UFFD_USER_MODE_ONLY: i32 = 1;

/// `struct uffdio_api` (`include/uapi/linux/userfaultfd.h`): the argument of `UFFDIO_API`.
/// libc and the `userfaultfd` crate's public API do not carry it.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct uffdio_api {
    /// In: `UFFD_API`.
    pub api: u64,
    /// In: the features userspace asks for; out: every feature the kernel offers.
    pub features: u64,
    /// Out: a bitmask of `1 << _UFFDIO_*` for the ioctls the fd accepts.
    pub ioctls: u64,
}

ioctl_iowr_nr!(UFFDIO_API, UFFDIO, 0x3F, uffdio_api);
// `USERFAULTFD_IOC_NEW` is `_IO(0xAA, 0x00)` on `/dev/userfaultfd` (Linux 6.1+).
ioctl_io_nr!(USERFAULTFD_IOC_NEW, UFFDIO, 0x00);

/// `UFFD_FEATURE_*` bits of `uffdio_api.features`.
pub const UFFD_FEATURE_PAGEFAULT_FLAG_WP: u64 = 1 << 0;
pub const UFFD_FEATURE_EVENT_FORK: u64 = 1 << 1;
pub const UFFD_FEATURE_EVENT_REMAP: u64 = 1 << 2;
pub const UFFD_FEATURE_EVENT_REMOVE: u64 = 1 << 3;
pub const UFFD_FEATURE_MISSING_HUGETLBFS: u64 = 1 << 4;
pub const UFFD_FEATURE_MISSING_SHMEM: u64 = 1 << 5;
pub const UFFD_FEATURE_EVENT_UNMAP: u64 = 1 << 6;
pub const UFFD_FEATURE_SIGBUS: u64 = 1 << 7;
pub const UFFD_FEATURE_THREAD_ID: u64 = 1 << 8;
pub const UFFD_FEATURE_MINOR_HUGETLBFS: u64 = 1 << 9;
pub const UFFD_FEATURE_MINOR_SHMEM: u64 = 1 << 10;
pub const UFFD_FEATURE_EXACT_ADDRESS: u64 = 1 << 11;
pub const UFFD_FEATURE_WP_HUGETLBFS_SHMEM: u64 = 1 << 12;
pub const UFFD_FEATURE_WP_UNPOPULATED: u64 = 1 << 13;
pub const UFFD_FEATURE_POISON: u64 = 1 << 14;
pub const UFFD_FEATURE_WP_ASYNC: u64 = 1 << 15;
pub const UFFD_FEATURE_MOVE: u64 = 1 << 16;
/// Read-write protection tracking (`UFFDIO_REGISTER_MODE_RWP`), newer than the system headers.
pub const UFFD_FEATURE_RWP: u64 = 1 << 17;
/// Asynchronous read-write protection faults, newer than the system headers.
pub const UFFD_FEATURE_RWP_ASYNC: u64 = 1 << 18;

/// `_UFFDIO_*` ioctl numbers; `uffdio_api.ioctls` / `uffdio_register.ioctls` set `1 << _UFFDIO_X`.
pub const _UFFDIO_REGISTER: u32 = 0x00;
pub const _UFFDIO_UNREGISTER: u32 = 0x01;
pub const _UFFDIO_WAKE: u32 = 0x02;
pub const _UFFDIO_COPY: u32 = 0x03;
pub const _UFFDIO_ZEROPAGE: u32 = 0x04;
pub const _UFFDIO_MOVE: u32 = 0x05;
pub const _UFFDIO_WRITEPROTECT: u32 = 0x06;
pub const _UFFDIO_CONTINUE: u32 = 0x07;
pub const _UFFDIO_POISON: u32 = 0x08;
/// `UFFDIO_RWPROTECT`: sets or clears read-write protection on a range (newer than the system headers).
pub const _UFFDIO_RWPROTECT: u32 = 0x09;
/// `UFFDIO_SET_MODE`: changes a userfaultfd's mode after `UFFDIO_API` (newer than the system headers).
pub const _UFFDIO_SET_MODE: u32 = 0x0A;
pub const _UFFDIO_API: u32 = 0x3F;

#[cfg(test)]
mod tests {
    use super::*;

    /// The ioctl numbers are the kernel's (direction, size, type and number as the kernel
    /// headers encode them): a wrong struct size here would make every call fail with ENOTTY.
    #[test]
    fn ioctl_numbers_are_the_kernels() {
        assert_eq!(std::mem::size_of::<kvm_userspace_memory_region2>(), 160);
        assert_eq!(KVM_SET_USER_MEMORY_REGION(), 0x4020_ae46);
        assert_eq!(KVM_SET_USER_MEMORY_REGION2(), 0x40a0_ae49);
        assert_eq!(KVM_GET_DIRTY_LOG(), 0x4010_ae42);
        assert_eq!(KVM_CLEAR_DIRTY_LOG(), 0xc018_aec0);
        assert_eq!(KVM_RESET_DIRTY_RINGS(), 0xaec7);
        assert_eq!(UFFDIO_API(), 0xc018_aa3f);
        assert_eq!(USERFAULTFD_IOC_NEW(), 0xaa00);
        assert_eq!(std::mem::size_of::<kvm_dirty_gfn>(), 16);
    }

    /// `UFFDIO_API` as declared here is answered by the kernel with the API version and the
    /// ioctls the fd then accepts.
    #[test]
    fn uffdio_api_is_answered() {
        // SAFETY: the userfaultfd syscall takes only an int of flags.
        let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC) };
        assert!(fd >= 0, "userfaultfd: {}", std::io::Error::last_os_error());
        let fd = i32::try_from(fd).unwrap();
        let mut api = uffdio_api {
            api: UFFD_API,
            ..Default::default()
        };
        // SAFETY: UFFDIO_API reads and writes one uffdio_api, live and writable.
        let r = unsafe { libc::ioctl(fd, UFFDIO_API(), &raw mut api) };
        assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
        assert_eq!(api.api, UFFD_API);
        assert_ne!(api.ioctls & (1 << _UFFDIO_REGISTER), 0);
        // SAFETY: closes the fd opened above, used by nothing else.
        unsafe { libc::close(fd) };
    }
}
