//! What the running kernel offers for guest memory, found by asking it, never assumed.
//!
//! [`probe()`] asks `/dev/kvm` (through a throw-away VM), `userfaultfd`, sysfs and procfs, and
//! returns a [`Probe`]. Nothing in here panics: a part that cannot be asked is reported as an
//! `Err(String)` in its own field (serialized by serde as `{"Err": "..."}`, an answer as
//! `{"Ok": ...}`), and the rest is still probed.
//!
//! Features that are not upstream (guest_memfd `write()`, KVM Userfault) are detected by *trying*
//! them, because their flag numbers moved between patch versions; see [`guest_memfd_write`] and
//! [`kvm_userfault`].

mod gmem_uffd;
mod gmem_write;
mod host;
mod hugepages;
mod kvm;
mod kvm_userfault;
mod numa;
mod userfaultfd;
mod util;

use serde::Serialize;

pub use gmem_uffd::guest_memfd_uffd;
pub use gmem_write::guest_memfd_write;
pub use host::{host, kernel_tls};
pub use hugepages::{hugetlb, thp};
pub use kvm::kvm_caps;
use kvm::throwaway_vm;
pub use kvm_userfault::kvm_userfault;
pub use numa::numa;
pub use userfaultfd::userfaultfd;

/// Everything [`probe()`] found. Each field is one item; fields name their units.
#[derive(Debug, Clone, Serialize)]
pub struct Probe {
    /// Kernel release, page size, online CPUs.
    pub host: Host,
    /// KVM capabilities, asked on a throw-away VM fd. `Err` if `/dev/kvm` did not open.
    pub kvm: Result<KvmCaps, String>,
    /// guest_memfd `write()` (not upstream), found by trying `pwrite`.
    pub guest_memfd_write: Result<GuestMemfdWrite, String>,
    /// KVM Userfault (not upstream), found by trying a `KVM_MEM_USERFAULT` memslot.
    pub kvm_userfault: Result<KvmUserfault, String>,
    /// userfaultfd on a guest_memfd mapping (not upstream), found by trying to register one.
    pub guest_memfd_uffd: Result<GuestMemfdUffd, String>,
    /// userfaultfd API: the features and ioctls the kernel offers.
    pub userfaultfd: Result<Userfaultfd, String>,
    /// Transparent huge page modes.
    pub thp: Thp,
    /// hugetlbfs pages and mounts.
    pub hugetlb: Hugetlb,
    /// NUMA nodes and the memory-policy syscalls.
    pub numa: Numa,
}

/// A bitmask as the kernel returned it, with every bit decoded by its kernel name; bits without
/// a known name are listed as `unknown(0x..)`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BitFlags {
    /// The mask.
    pub raw: u64,
    /// Its bits' names, lowest first.
    pub names: Vec<String>,
}

impl BitFlags {
    fn decode(raw: u64, known: &[(u64, &str)]) -> Self {
        let mut names = Vec::new();
        let mut rest = raw;
        for &(bit, name) in known {
            if raw & bit != 0 {
                names.push(name.to_string());
                rest &= !bit;
            }
        }
        for i in 0..64 {
            if rest & (1u64 << i) != 0 {
                names.push(format!("unknown({:#x})", 1u64 << i));
            }
        }
        BitFlags { raw, names }
    }

    /// Whether the bit with kernel name `name` (without its prefix, e.g. `"MMAP"`) is set.
    pub fn has(&self, name: &str) -> bool {
        self.names.iter().any(|n| n == name)
    }
}

/// The host itself.
#[derive(Debug, Clone, Serialize)]
pub struct Host {
    /// `uname -r`.
    pub kernel_release: Result<String, String>,
    /// `sysconf(_SC_PAGESIZE)`.
    pub page_size_bytes: Result<u64, String>,
    /// `sysconf(_SC_NPROCESSORS_ONLN)`.
    pub online_cpus: Result<u64, String>,
    /// Kernel TLS on TCP sockets ([`kernel_tls`]).
    pub kernel_tls: Result<(), String>,
}

/// KVM capabilities. Every `KVM_CHECK_EXTENSION` is asked on a VM fd (several caps answer only
/// there); each value is the kernel's raw answer, `Err` if the ioctl itself failed.
#[derive(Debug, Clone, Serialize)]
pub struct KvmCaps {
    /// `KVM_GET_API_VERSION` (12 on every kernel since 2.6.22).
    pub api_version: i32,
    /// `KVM_CAP_NR_MEMSLOTS`: how many memslots a VM may have (per address space).
    pub nr_memslots: Result<u64, String>,
    /// `KVM_CAP_USER_MEMORY2`: non-zero if `KVM_SET_USER_MEMORY_REGION2` exists.
    pub user_memory2: Result<u64, String>,
    /// `KVM_CAP_GUEST_MEMFD`: non-zero if `KVM_CREATE_GUEST_MEMFD` exists.
    pub guest_memfd: Result<u64, String>,
    /// `KVM_CAP_GUEST_MEMFD_FLAGS`: the valid `kvm_create_guest_memfd.flags`
    /// (`MMAP` = bit 0, `INIT_SHARED` = bit 1).
    pub guest_memfd_flags: Result<BitFlags, String>,
    /// `KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2`: the valid enable flags
    /// (`MANUAL_PROTECT_ENABLE` = bit 0, `INITIALLY_SET` = bit 1).
    pub manual_dirty_log_protect2: Result<BitFlags, String>,
    /// `KVM_CAP_DIRTY_LOG_RING`: the largest per-vCPU ring in bytes; 0 = no dirty ring.
    pub dirty_log_ring_max_bytes: Result<u64, String>,
    /// `KVM_CAP_DIRTY_LOG_RING_ACQ_REL`: as above for the acquire/release ring; 0 = absent.
    pub dirty_log_ring_acq_rel_max_bytes: Result<u64, String>,
    /// `KVM_CAP_PRE_FAULT_MEMORY`: non-zero if `KVM_PRE_FAULT_MEMORY` exists.
    pub pre_fault_memory: Result<u64, String>,
    /// Capability numbers 245..=260 (past the newest this crate knows) that answer non-zero;
    /// for information only.
    pub unknown_caps_answering: Vec<CapAnswer>,
}

/// One capability number and the kernel's raw answer to `KVM_CHECK_EXTENSION`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CapAnswer {
    /// The capability number.
    pub cap: u32,
    /// What `KVM_CHECK_EXTENSION` returned.
    pub answer: i64,
}

/// Whether guest_memfd supports `write()`/`pwrite()` (guest_memfd write()).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GuestMemfdWrite {
    /// Whether a write to a guest_memfd succeeded.
    pub present: bool,
    /// The `kvm_create_guest_memfd.flags` bit that enabled writing, if one was needed.
    pub flag: Option<u64>,
    /// What the attempt found.
    pub detail: String,
}

/// Whether KVM accepts userfault memslots (KVM Userfault).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KvmUserfault {
    /// Whether a userfault memslot was accepted.
    pub present: bool,
    /// What the attempt found.
    pub detail: String,
}

/// Whether userfaultfd can register a guest_memfd's host mapping, per mode. Registration
/// alone does not page a guest: KVM maps guest_memfd pages for the guest without going through
/// that mapping, so only KVM Userfault sees a vCPU's first access.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GuestMemfdUffd {
    /// `UFFDIO_REGISTER_MODE_MISSING` accepted.
    pub missing: bool,
    /// `UFFDIO_REGISTER_MODE_MINOR` accepted.
    pub minor: bool,
    /// What the attempts found.
    pub detail: String,
}

impl GuestMemfdUffd {
    /// Whether either mode registered.
    pub fn present(&self) -> bool {
        self.missing || self.minor
    }
}

/// The answer of `UFFDIO_API` with `features = 0`.
#[derive(Debug, Clone, Serialize)]
pub struct Userfaultfd {
    /// `"/dev/userfaultfd"` or `"userfaultfd(2)"`.
    pub opened_via: String,
    /// Why `/dev/userfaultfd` was not used, if the syscall was the fallback.
    pub dev_userfaultfd_error: Option<String>,
    /// Every `UFFD_FEATURE_*` the kernel offers.
    pub features: BitFlags,
    /// `1 << _UFFDIO_*` for the ioctls the fd accepts after `UFFDIO_API`.
    pub ioctls: BitFlags,
}

impl Userfaultfd {
    /// Whether the kernel offers `UFFD_FEATURE_<name>` (e.g. `"MINOR_SHMEM"`).
    pub fn has_feature(&self, name: &str) -> bool {
        self.features.has(name)
    }
}

/// Transparent huge pages: the selected mode (the word in `[brackets]`).
#[derive(Debug, Clone, Serialize)]
pub struct Thp {
    /// `/sys/kernel/mm/transparent_hugepage/enabled` (anonymous memory).
    pub enabled: Result<String, String>,
    /// `/sys/kernel/mm/transparent_hugepage/shmem_enabled` (shmem/memfd).
    pub shmem_enabled: Result<String, String>,
}

/// hugetlbfs pages.
#[derive(Debug, Clone, Serialize)]
pub struct Hugetlb {
    /// `Hugepagesize` from `/proc/meminfo`.
    pub default_size_kib: Result<u64, String>,
    /// `/proc/sys/vm/nr_hugepages`: pages of the default size in the pool.
    pub nr_hugepages: Result<u64, String>,
    /// `HugePages_Free` from `/proc/meminfo`.
    pub free_hugepages: Result<u64, String>,
    /// Mount points of hugetlbfs from `/proc/mounts`; empty = not mounted.
    pub hugetlbfs_mounts: Result<Vec<String>, String>,
    /// One entry per directory under `/sys/kernel/mm/hugepages/`, by size.
    pub sizes: Result<Vec<HugePageSize>, String>,
}

/// The pool of one huge page size.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HugePageSize {
    /// The page size.
    pub size_kib: u64,
    /// Pages in the pool (`nr_hugepages`), or why it could not be read.
    pub nr_hugepages: Result<u64, String>,
    /// Pages free in the pool (`free_hugepages`), or why it could not be read.
    pub free_hugepages: Result<u64, String>,
}

/// NUMA nodes and memory policy.
#[derive(Debug, Clone, Serialize)]
pub struct Numa {
    /// From `/sys/devices/system/node/node*/meminfo`, by node id.
    pub nodes: Result<Vec<NumaNode>, String>,
    /// `get_mempolicy(NULL, NULL, 0, NULL, 0)`.
    pub get_mempolicy: SyscallCheck,
    /// `mbind(NULL, 0, MPOL_DEFAULT, NULL, 0, 0)` (an empty range: changes nothing).
    pub mbind: SyscallCheck,
}

/// One NUMA node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NumaNode {
    /// The node's number.
    pub id: u32,
    /// Its `MemTotal`.
    pub mem_total_kib: u64,
    /// Its `MemFree`.
    pub mem_free_kib: u64,
}

/// Whether a syscall answered, with what it returned or why not.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SyscallCheck {
    /// Whether the call succeeded.
    pub available: bool,
    /// What it returned, or its error.
    pub detail: String,
}

/// Asks the kernel everything [`Probe`] holds. Never panics.
pub fn probe() -> Probe {
    let host = host();
    let (kvm, guest_memfd_write, kvm_userfault, guest_memfd_uffd) = match throwaway_vm() {
        Ok((kvm, vm)) => {
            let caps = kvm_caps(&kvm, &vm);
            let gmem_flags = caps.guest_memfd_flags.as_ref().map_or(0, |f| f.raw);
            let write = guest_memfd_write(&vm, gmem_flags);
            let userfault = kvm_userfault(&vm);
            let uffd = if caps.guest_memfd_flags.as_ref().is_ok_and(|f| f.has("MMAP")) {
                guest_memfd_uffd(&vm)
            } else {
                Err("skipped: guest_memfd cannot be mapped (no GUEST_MEMFD_FLAG_MMAP)".into())
            };
            (Ok(caps), write, userfault, uffd)
        }
        Err(e) => {
            let skipped = format!("skipped: {e}");
            (
                Err(e),
                Err(skipped.clone()),
                Err(skipped.clone()),
                Err(skipped),
            )
        }
    };
    Probe {
        host,
        kvm,
        guest_memfd_write,
        kvm_userfault,
        guest_memfd_uffd,
        userfaultfd: userfaultfd(),
        thp: thp(),
        hugetlb: hugetlb(),
        numa: numa(),
    }
}

/// KVM Userfault asked on a VM of its own: for callers that have no VM fd at hand (a pager
/// deciding whether a guest_memfd region can be demand paged). `Err` if no VM could be made.
pub fn kvm_userfault_on_a_new_vm() -> Result<KvmUserfault, String> {
    let (_kvm, vm) = throwaway_vm()?;
    kvm_userfault(&vm)
}

impl Probe {
    /// Whether guest_memfd can be created with `GUEST_MEMFD_FLAG_MMAP`.
    pub fn has_guest_memfd_mmap(&self) -> bool {
        matches!(&self.kvm, Ok(k) if matches!(&k.guest_memfd_flags, Ok(f) if f.has("MMAP")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Known bits go by their names in the table's order, the others as `unknown(bit)`,
    /// lowest first; `has` matches a whole name only.
    #[test]
    fn bit_flags_name_known_and_unknown_bits() {
        let known = [(1 << 3, "C"), (1, "A"), (1 << 1, "B")];
        let f = BitFlags::decode(0b1001 | (1 << 40) | (1 << 5), &known);
        assert_eq!(f.raw, 0b1001 | (1 << 40) | (1 << 5));
        assert_eq!(
            f.names,
            ["C", "A", "unknown(0x20)", "unknown(0x10000000000)"]
        );
        assert!(f.has("A") && f.has("C") && !f.has("B") && !f.has("unknown"));
        assert!(BitFlags::decode(0, &known).names.is_empty());
        let gmem = GuestMemfdUffd {
            missing: false,
            minor: true,
            detail: String::new(),
        };
        assert!(gmem.present());
    }
}
