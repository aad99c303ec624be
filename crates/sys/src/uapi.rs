//! Kernel uapi definitions that neither `kvm-bindings` 0.14 nor `libc` carry, under the kernel's
//! own names. Structs come from `kvm-bindings` wherever it has them; this module only adds the
//! constants and ioctl numbers that are missing. Definitions for features that are not upstream
//! (KVM Userfault, guest_memfd `write()`) are *candidates*: their numbers moved between patch
//! versions, so code must confirm them by trying (see `probe`).
#![allow(non_upper_case_globals)]

use vmm_sys_util::{ioctl_io_nr, ioctl_iowr_nr};

pub use kvm_bindings::{
    kvm_clear_dirty_log, kvm_create_guest_memfd, kvm_dirty_gfn, kvm_userspace_memory_region2,
    KVM_CAP_DIRTY_LOG_RING, KVM_CAP_DIRTY_LOG_RING_ACQ_REL, KVM_CAP_GUEST_MEMFD,
    KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2, KVM_CAP_NR_MEMSLOTS, KVM_CAP_PRE_FAULT_MEMORY,
    KVM_CAP_USER_MEMORY2, KVM_DIRTY_LOG_INITIALLY_SET, KVM_DIRTY_LOG_PAGE_OFFSET,
    KVM_EXIT_DIRTY_RING_FULL, KVM_EXIT_MEMORY_FAULT, KVM_MEM_GUEST_MEMFD,
    KVM_MEM_LOG_DIRTY_PAGES, KVM_MEM_READONLY,
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
/// `GUEST_MEMFD_FLAG_WRITE` as proposed by seed 000 (not upstream; confirm by trying).
pub const GUEST_MEMFD_FLAG_WRITE_CANDIDATE: u64 = 1 << 2;

/// `KVM_MEM_USERFAULT` as carried by the KVM Userfault series (seed 001; not upstream).
pub const KVM_MEM_USERFAULT_CANDIDATE: u32 = 1 << 3;
/// `KVM_MEMORY_EXIT_FLAG_USERFAULT` as carried by the KVM Userfault series (seed 001).
pub const KVM_MEMORY_EXIT_FLAG_USERFAULT_CANDIDATE: u64 = 1 << 4;

/// `KVM_DIRTY_GFN_F_DIRTY`: the ring entry holds a dirty gfn for userspace to collect.
pub const KVM_DIRTY_GFN_F_DIRTY: u32 = 1 << 0;
/// `KVM_DIRTY_GFN_F_RESET`: userspace has collected the entry; the kernel may reuse it.
pub const KVM_DIRTY_GFN_F_RESET: u32 = 1 << 1;

ioctl_iowr_nr!(KVM_SET_USER_MEMORY_REGION2, KVMIO, 0x49, kvm_userspace_memory_region2);
ioctl_iowr_nr!(KVM_CLEAR_DIRTY_LOG, KVMIO, 0xc0, kvm_clear_dirty_log);
ioctl_io_nr!(KVM_RESET_DIRTY_RINGS, KVMIO, 0xc7);

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
