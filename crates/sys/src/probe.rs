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

use std::ffi::CStr;
use std::fs;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use kvm_ioctls::{Kvm, VmFd};
use libc::{c_int, c_ulong, c_void};
use serde::Serialize;
use vmm_sys_util::ioctl::{ioctl_with_mut_ref, ioctl_with_ref, ioctl_with_val};

use crate::uapi::{self, kvm_create_guest_memfd, kvm_userspace_memory_region2};

/// Everything [`probe()`] found. Each field is one item; fields name their units.
#[derive(Debug, Clone, Serialize)]
pub struct Probe {
    /// Kernel release, page size, online CPUs.
    pub host: Host,
    /// KVM capabilities, asked on a throw-away VM fd. `Err` if `/dev/kvm` did not open.
    pub kvm: Result<KvmCaps, String>,
    /// guest_memfd `write()` (seed 000, not upstream), found by trying `pwrite`.
    pub guest_memfd_write: Result<GuestMemfdWrite, String>,
    /// KVM Userfault (seed 001, not upstream), found by trying a `KVM_MEM_USERFAULT` memslot.
    pub kvm_userfault: Result<KvmUserfault, String>,
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
    pub raw: u64,
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

    fn joined(&self) -> String {
        if self.names.is_empty() {
            "none".to_string()
        } else {
            self.names.join("|")
        }
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
    pub cap: u32,
    pub answer: i64,
}

/// Whether guest_memfd supports `write()`/`pwrite()` (seed 000).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GuestMemfdWrite {
    pub present: bool,
    /// The `kvm_create_guest_memfd.flags` bit that enabled writing, if one was needed.
    pub flag: Option<u64>,
    pub detail: String,
}

/// Whether KVM accepts userfault memslots (seed 001).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KvmUserfault {
    pub present: bool,
    pub detail: String,
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
    pub size_kib: u64,
    pub nr_hugepages: Result<u64, String>,
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
    pub id: u32,
    pub mem_total_kib: u64,
    pub mem_free_kib: u64,
}

/// Whether a syscall answered, with what it returned or why not.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SyscallCheck {
    pub available: bool,
    pub detail: String,
}

/// Asks the kernel everything [`Probe`] holds. Never panics.
pub fn probe() -> Probe {
    let host = host();
    let (kvm, guest_memfd_write, kvm_userfault) = match throwaway_vm() {
        Ok((kvm, vm)) => {
            let caps = kvm_caps(&kvm, &vm);
            let gmem_flags = caps.guest_memfd_flags.as_ref().map(|f| f.raw).unwrap_or(0);
            let write = guest_memfd_write(&vm, gmem_flags);
            let userfault = kvm_userfault(&vm);
            (Ok(caps), write, userfault)
        }
        Err(e) => {
            let skipped = format!("skipped: {e}");
            (Err(e), Err(skipped.clone()), Err(skipped))
        }
    };
    Probe {
        host,
        kvm,
        guest_memfd_write,
        kvm_userfault,
        userfaultfd: userfaultfd(),
        thp: thp(),
        hugetlb: hugetlb(),
        numa: numa(),
    }
}

impl Probe {
    /// Whether guest_memfd can be created with `GUEST_MEMFD_FLAG_MMAP`.
    pub fn has_guest_memfd_mmap(&self) -> bool {
        matches!(&self.kvm, Ok(k) if matches!(&k.guest_memfd_flags, Ok(f) if f.has("MMAP")))
    }

    /// A human-readable table: one `name  value  (detail)` line per item.
    pub fn table(&self) -> String {
        let mut rows: Vec<Row> = Vec::new();
        self.host_rows(&mut rows);
        self.kvm_rows(&mut rows);
        self.userfaultfd_rows(&mut rows);
        self.memory_rows(&mut rows);
        format_rows(&rows)
    }

    fn host_rows(&self, rows: &mut Vec<Row>) {
        let h = &self.host;
        rows.push(row_res("host.kernel_release", &h.kernel_release, |v| {
            (v.clone(), String::new())
        }));
        rows.push(row_res("host.page_size_bytes", &h.page_size_bytes, |v| {
            (v.to_string(), String::new())
        }));
        rows.push(row_res("host.online_cpus", &h.online_cpus, |v| {
            (v.to_string(), String::new())
        }));
    }

    fn kvm_rows(&self, rows: &mut Vec<Row>) {
        let k = match &self.kvm {
            Ok(k) => k,
            Err(e) => {
                rows.push(row("kvm", "unavailable", e));
                rows.push(row("kvm.guest_memfd_write", "unknown", "needs /dev/kvm"));
                rows.push(row("kvm.userfault", "unknown", "needs /dev/kvm"));
                return;
            }
        };
        rows.push(row(
            "kvm",
            "open",
            "/dev/kvm and a throw-away VM; caps asked on the VM fd",
        ));
        rows.push(row(
            "kvm.api_version",
            &k.api_version.to_string(),
            "KVM_GET_API_VERSION",
        ));
        rows.push(row_res("kvm.nr_memslots", &k.nr_memslots, |v| {
            (v.to_string(), "KVM_CAP_NR_MEMSLOTS".into())
        }));
        rows.push(row_res("kvm.user_memory2", &k.user_memory2, |v| {
            (yes_no(*v), format!("KVM_CAP_USER_MEMORY2 = {v}"))
        }));
        rows.push(row_res("kvm.guest_memfd", &k.guest_memfd, |v| {
            (yes_no(*v), format!("KVM_CAP_GUEST_MEMFD = {v}"))
        }));
        rows.push(row_res(
            "kvm.guest_memfd_flags",
            &k.guest_memfd_flags,
            |f| (format!("{:#x}", f.raw), f.joined()),
        ));
        rows.push(row_res(
            "kvm.manual_dirty_log_protect2",
            &k.manual_dirty_log_protect2,
            |f| (format!("{:#x}", f.raw), f.joined()),
        ));
        let entry = std::mem::size_of::<uapi::kvm_dirty_gfn>() as u64;
        rows.push(row_res(
            "kvm.dirty_log_ring_max_bytes",
            &k.dirty_log_ring_max_bytes,
            |v| {
                (
                    v.to_string(),
                    format!("{} entries of {entry} bytes per vCPU", v / entry),
                )
            },
        ));
        rows.push(row_res(
            "kvm.dirty_log_ring_acq_rel_max_bytes",
            &k.dirty_log_ring_acq_rel_max_bytes,
            |v| (v.to_string(), "KVM_CAP_DIRTY_LOG_RING_ACQ_REL".into()),
        ));
        rows.push(row_res("kvm.pre_fault_memory", &k.pre_fault_memory, |v| {
            (yes_no(*v), format!("KVM_CAP_PRE_FAULT_MEMORY = {v}"))
        }));
        let unknown = if k.unknown_caps_answering.is_empty() {
            "none".to_string()
        } else {
            k.unknown_caps_answering
                .iter()
                .map(|c| format!("{}={}", c.cap, c.answer))
                .collect::<Vec<_>>()
                .join(" ")
        };
        rows.push(row(
            "kvm.unknown_caps_answering",
            &unknown,
            "caps 245..=260, information only",
        ));
        rows.push(row_res(
            "kvm.guest_memfd_write",
            &self.guest_memfd_write,
            |w| {
                let value = match (w.present, w.flag) {
                    (true, Some(f)) => format!("present (flag {f:#x})"),
                    (true, None) => "present".to_string(),
                    (false, _) => "absent".to_string(),
                };
                (value, w.detail.clone())
            },
        ));
        rows.push(row_res("kvm.userfault", &self.kvm_userfault, |u| {
            (present_absent(u.present), u.detail.clone())
        }));
    }

    fn userfaultfd_rows(&self, rows: &mut Vec<Row>) {
        match &self.userfaultfd {
            Ok(u) => {
                let via = match &u.dev_userfaultfd_error {
                    Some(e) => format!("/dev/userfaultfd failed: {e}"),
                    None => "UFFDIO_API with features = 0".to_string(),
                };
                rows.push(row("uffd.opened_via", &u.opened_via, &via));
                rows.push(row(
                    "uffd.features",
                    &format!("{:#x}", u.features.raw),
                    &u.features.joined(),
                ));
                rows.push(row(
                    "uffd.ioctls",
                    &format!("{:#x}", u.ioctls.raw),
                    &u.ioctls.joined(),
                ));
            }
            Err(e) => rows.push(row("uffd", "unavailable", e)),
        }
    }

    fn memory_rows(&self, rows: &mut Vec<Row>) {
        let t = &self.thp;
        rows.push(row_res("thp.enabled", &t.enabled, |v| {
            (v.clone(), "anonymous memory".into())
        }));
        rows.push(row_res("thp.shmem_enabled", &t.shmem_enabled, |v| {
            (v.clone(), "shmem/memfd".into())
        }));
        let h = &self.hugetlb;
        rows.push(row_res(
            "hugetlb.default_size_kib",
            &h.default_size_kib,
            |v| (v.to_string(), "Hugepagesize".into()),
        ));
        rows.push(row_res("hugetlb.nr_hugepages", &h.nr_hugepages, |v| {
            (v.to_string(), "/proc/sys/vm/nr_hugepages".into())
        }));
        rows.push(row_res("hugetlb.free_hugepages", &h.free_hugepages, |v| {
            (v.to_string(), "HugePages_Free".into())
        }));
        rows.push(row_res(
            "hugetlb.hugetlbfs_mounts",
            &h.hugetlbfs_mounts,
            |m| {
                if m.is_empty() {
                    ("none".into(), "no hugetlbfs in /proc/mounts".into())
                } else {
                    (m.join(" "), String::new())
                }
            },
        ));
        match &h.sizes {
            Ok(sizes) => {
                for s in sizes {
                    let value = format!(
                        "nr {} free {}",
                        res_str(&s.nr_hugepages),
                        res_str(&s.free_hugepages)
                    );
                    rows.push(row(
                        &format!("hugetlb.size_{}_kib", s.size_kib),
                        &value,
                        "/sys/kernel/mm/hugepages",
                    ));
                }
            }
            Err(e) => rows.push(row("hugetlb.sizes", "unknown", e)),
        }
        match &self.numa.nodes {
            Ok(nodes) => {
                for n in nodes {
                    let value =
                        format!("total {} KiB, free {} KiB", n.mem_total_kib, n.mem_free_kib);
                    rows.push(row(
                        &format!("numa.node{}", n.id),
                        &value,
                        "MemTotal, MemFree",
                    ));
                }
            }
            Err(e) => rows.push(row("numa.nodes", "unknown", e)),
        }
        for (name, c) in [
            ("numa.get_mempolicy", &self.numa.get_mempolicy),
            ("numa.mbind", &self.numa.mbind),
        ] {
            let value = if c.available {
                "available"
            } else {
                "unavailable"
            };
            rows.push(row(name, value, &c.detail));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Item 7: the host.

/// Kernel release, page size and online CPUs.
pub fn host() -> Host {
    Host {
        kernel_release: kernel_release(),
        page_size_bytes: sysconf(libc::_SC_PAGESIZE, "_SC_PAGESIZE"),
        online_cpus: sysconf(libc::_SC_NPROCESSORS_ONLN, "_SC_NPROCESSORS_ONLN"),
    }
}

fn kernel_release() -> Result<String, String> {
    // SAFETY: `utsname` is plain old data (arrays of c_char); all-zero is a valid value.
    let mut uts: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: `uts` is a valid, writable `utsname` that lives across the call.
    if unsafe { libc::uname(&mut uts) } != 0 {
        return Err(format!("uname: {}", errno_name(last_errno())));
    }
    // SAFETY: on success the kernel filled `release` with a NUL-terminated string that fits in
    // the array (and the array was zeroed, so a NUL is there in any case).
    let release = unsafe { CStr::from_ptr(uts.release.as_ptr()) };
    Ok(release.to_string_lossy().into_owned())
}

fn sysconf(name: c_int, what: &str) -> Result<u64, String> {
    // SAFETY: sysconf only reads its integer argument.
    let v = unsafe { libc::sysconf(name) };
    if v <= 0 {
        Err(format!("sysconf({what}) = {v}"))
    } else {
        Ok(v as u64)
    }
}

// ---------------------------------------------------------------------------------------------
// Item 1: KVM capabilities.

/// Opens `/dev/kvm` and creates a throw-away VM to ask VM-scoped capabilities on.
fn throwaway_vm() -> Result<(Kvm, VmFd), String> {
    let kvm =
        Kvm::new().map_err(|e| format!("/dev/kvm does not open: {}", errno_name(e.errno())))?;
    let vm = kvm
        .create_vm()
        .map_err(|e| format!("KVM_CREATE_VM failed: {}", errno_name(e.errno())))?;
    Ok((kvm, vm))
}

const GUEST_MEMFD_FLAG_NAMES: &[(u64, &str)] = &[
    (uapi::GUEST_MEMFD_FLAG_MMAP, "MMAP"),
    (uapi::GUEST_MEMFD_FLAG_INIT_SHARED, "INIT_SHARED"),
];

const MANUAL_DIRTY_LOG_NAMES: &[(u64, &str)] = &[
    (
        uapi::KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE as u64,
        "MANUAL_PROTECT_ENABLE",
    ),
    (uapi::KVM_DIRTY_LOG_INITIALLY_SET as u64, "INITIALLY_SET"),
];

/// Asks every KVM capability [`KvmCaps`] holds, on the VM fd `vm`.
pub fn kvm_caps(kvm: &Kvm, vm: &VmFd) -> KvmCaps {
    let unknown_caps_answering = (245u32..=260)
        .filter_map(|nr| {
            let answer = i64::from(vm.check_extension_raw(c_ulong::from(nr)));
            (answer != 0).then_some(CapAnswer { cap: nr, answer })
        })
        .collect();
    KvmCaps {
        api_version: kvm.get_api_version(),
        nr_memslots: cap(vm, uapi::KVM_CAP_NR_MEMSLOTS),
        user_memory2: cap(vm, uapi::KVM_CAP_USER_MEMORY2),
        guest_memfd: cap(vm, uapi::KVM_CAP_GUEST_MEMFD),
        guest_memfd_flags: cap(vm, uapi::KVM_CAP_GUEST_MEMFD_FLAGS)
            .map(|v| BitFlags::decode(v, GUEST_MEMFD_FLAG_NAMES)),
        manual_dirty_log_protect2: cap(vm, uapi::KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2)
            .map(|v| BitFlags::decode(v, MANUAL_DIRTY_LOG_NAMES)),
        dirty_log_ring_max_bytes: cap(vm, uapi::KVM_CAP_DIRTY_LOG_RING),
        dirty_log_ring_acq_rel_max_bytes: cap(vm, uapi::KVM_CAP_DIRTY_LOG_RING_ACQ_REL),
        pre_fault_memory: cap(vm, uapi::KVM_CAP_PRE_FAULT_MEMORY),
        unknown_caps_answering,
    }
}

/// `KVM_CHECK_EXTENSION(nr)` on the VM fd; `Err` only if the ioctl itself failed.
fn cap(vm: &VmFd, nr: u32) -> Result<u64, String> {
    let answer = vm.check_extension_raw(c_ulong::from(nr));
    if answer < 0 {
        Err(format!(
            "KVM_CHECK_EXTENSION({nr}) failed: {}",
            errno_name(last_errno())
        ))
    } else {
        Ok(answer as u64)
    }
}

// ---------------------------------------------------------------------------------------------
// Item 2: guest_memfd write().

const GMEM_SIZE_BYTES: u64 = 2 << 20;
const PAGE_4K: usize = 4096;

/// Tries `pwrite` of one 4 KiB page at offset 0 of a 2 MiB guest_memfd created on `vm` with the
/// `MMAP`/`INIT_SHARED` bits of `valid_flags` (the answer of `KVM_CAP_GUEST_MEMFD_FLAGS`).
/// `ENODEV` means write() exists but needs a flag: each further bit of `valid_flags` is tried.
pub fn guest_memfd_write(vm: &VmFd, valid_flags: u64) -> Result<GuestMemfdWrite, String> {
    let known = uapi::GUEST_MEMFD_FLAG_MMAP | uapi::GUEST_MEMFD_FLAG_INIT_SHARED;
    let base = valid_flags & known;
    let first = try_gmem_pwrite(vm, base)?;
    let errno = match first {
        Ok(()) => {
            return Ok(GuestMemfdWrite {
                present: true,
                flag: None,
                detail: format!("pwrite of 4 KiB succeeded with flags {base:#x}"),
            })
        }
        Err(errno) => errno,
    };
    if errno != libc::ENODEV {
        return Ok(GuestMemfdWrite {
            present: false,
            flag: None,
            detail: format!("pwrite gave {} (flags {base:#x})", errno_name(errno)),
        });
    }
    let mut tried = Vec::new();
    for bit in (0..64)
        .map(|i| 1u64 << i)
        .filter(|b| valid_flags & !known & b != 0)
    {
        match try_gmem_pwrite(vm, base | bit) {
            Ok(Ok(())) => {
                return Ok(GuestMemfdWrite {
                    present: true,
                    flag: Some(bit),
                    detail: format!(
                        "pwrite gave ENODEV without a flag, succeeded with flag {bit:#x}"
                    ),
                })
            }
            Ok(Err(e)) => tried.push(format!("{bit:#x}: pwrite {}", errno_name(e))),
            Err(e) => tried.push(format!("{bit:#x}: {e}")),
        }
    }
    Ok(GuestMemfdWrite {
        present: false,
        flag: None,
        detail: format!(
            "pwrite gave ENODEV (write exists, needs a flag) but no reported flag enabled it; tried: [{}]",
            tried.join(", ")
        ),
    })
}

/// Creates a guest_memfd with `flags` and pwrites one page at offset 0. The outer `Err` is a
/// failed creation; the inner one is the errno of `pwrite`.
fn try_gmem_pwrite(vm: &VmFd, flags: u64) -> Result<Result<(), i32>, String> {
    let gmem = kvm_create_guest_memfd {
        size: GMEM_SIZE_BYTES,
        flags,
        ..Default::default()
    };
    let raw = vm.create_guest_memfd(gmem).map_err(|e| {
        format!(
            "KVM_CREATE_GUEST_MEMFD(flags {flags:#x}) failed: {}",
            errno_name(e.errno())
        )
    })?;
    // SAFETY: `raw` is a fresh fd returned by KVM_CREATE_GUEST_MEMFD that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let page = [0x5au8; PAGE_4K];
    // SAFETY: `page` is a live buffer of exactly `page.len()` readable bytes; `fd` is open.
    let n = unsafe {
        libc::pwrite(
            fd.as_raw_fd(),
            page.as_ptr().cast::<c_void>(),
            page.len(),
            0,
        )
    };
    if n < 0 {
        Ok(Err(last_errno()))
    } else {
        Ok(Ok(()))
    }
}

// ---------------------------------------------------------------------------------------------
// Item 3: KVM Userfault.

const SLOT_SIZE_BYTES: usize = 2 << 20;

/// Tries a memslot with `KVM_MEM_USERFAULT` (candidate bit 3) and a userfault bitmap on `vm`,
/// after checking that the same memslot with flags 0 is accepted.
pub fn kvm_userfault(vm: &VmFd) -> Result<KvmUserfault, String> {
    let map = AnonMap::new(SLOT_SIZE_BYTES)
        .map_err(|e| format!("mmap of {SLOT_SIZE_BYTES} bytes failed: {}", errno_name(e)))?;
    // One bit per 4 KiB page of the slot, all clear (no page is a userfault yet).
    let bitmap = vec![0u64; SLOT_SIZE_BYTES / PAGE_4K / 64];
    let result = try_userfault_slots(vm, &map, &bitmap);
    match &result {
        // Every slot added was deleted again: the memory may go.
        Ok(_) => drop((bitmap, map)),
        // A slot may still point at the memory: leak it (2 MiB, never in practice) rather than
        // leave KVM a stale address.
        Err(_) => std::mem::forget((bitmap, map)),
    }
    result
}

fn try_userfault_slots(vm: &VmFd, map: &AnonMap, bitmap: &[u64]) -> Result<KvmUserfault, String> {
    let flag = uapi::KVM_MEM_USERFAULT_CANDIDATE;
    let mut region = kvm_userspace_memory_region2 {
        slot: 0,
        flags: 0,
        guest_phys_addr: 0,
        memory_size: SLOT_SIZE_BYTES as u64,
        userspace_addr: map.addr as u64,
        ..Default::default()
    };
    set_region2(vm, &region).map_err(|e| {
        format!(
            "KVM_SET_USER_MEMORY_REGION2 with flags 0 failed: {}",
            errno_name(e)
        )
    })?;
    delete_slot(vm, &mut region)?;

    // Layout of `struct kvm_userspace_memory_region2` (160 bytes): slot u32 @0, flags u32 @4,
    // guest_phys_addr @8, memory_size @16, userspace_addr @24, guest_memfd_offset @32,
    // guest_memfd u32 @40, pad1 u32 @44, pad2 [u64; 14] @48. The KVM Userfault series adds
    // `__u64 userfault_bitmap` right after guest_memfd + pad1, i.e. at offset 48 = `pad2[0]`
    // (`pad1` is only a u32 here, so it cannot hold the pointer).
    const _: () = assert!(std::mem::offset_of!(kvm_userspace_memory_region2, pad2) == 48);
    region.flags = flag;
    region.memory_size = SLOT_SIZE_BYTES as u64;
    region.pad2[0] = bitmap.as_ptr() as u64;
    let errno = match set_region2(vm, &region) {
        Ok(()) => {
            delete_slot(vm, &mut region)?;
            return Ok(KvmUserfault {
                present: true,
                detail: format!("memslot with flags {flag:#x} and a userfault bitmap accepted"),
            });
        }
        Err(errno) => errno,
    };
    // Was it the flag or the pointer in the padding? Try the pointer alone.
    region.flags = 0;
    region.memory_size = SLOT_SIZE_BYTES as u64;
    let padding = match set_region2(vm, &region) {
        Ok(()) => {
            delete_slot(vm, &mut region)?;
            "a bitmap pointer alone is accepted".to_string()
        }
        Err(e) => format!("a bitmap pointer alone gives {}", errno_name(e)),
    };
    let why = if errno == libc::EINVAL {
        ""
    } else {
        "unexpected; "
    };
    Ok(KvmUserfault {
        present: false,
        detail: format!(
            "memslot flags {flag:#x} refused with {} ({why}flags 0 accepted, {padding})",
            errno_name(errno)
        ),
    })
}

fn delete_slot(vm: &VmFd, region: &mut kvm_userspace_memory_region2) -> Result<(), String> {
    region.memory_size = 0;
    set_region2(vm, region)
        .map_err(|e| format!("deleting memslot {} failed: {}", region.slot, errno_name(e)))
}

fn set_region2(vm: &VmFd, region: &kvm_userspace_memory_region2) -> Result<(), i32> {
    // SAFETY: `region` is a valid `kvm_userspace_memory_region2` the kernel only reads. The
    // memory it names (`userspace_addr`, and a bitmap pointer in `pad2[0]` if any) is owned by
    // the caller and outlives the memslot, which the caller deletes before freeing it; no vCPU
    // ever runs in this VM, so the guest never touches that memory.
    let ret = unsafe { ioctl_with_ref(vm, uapi::KVM_SET_USER_MEMORY_REGION2(), region) };
    if ret < 0 {
        Err(last_errno())
    } else {
        Ok(())
    }
}

/// An anonymous private mapping, unmapped on drop.
struct AnonMap {
    addr: *mut c_void,
    len: usize,
}

impl AnonMap {
    fn new(len: usize) -> Result<Self, i32> {
        // SAFETY: a fresh anonymous mapping at an address the kernel chooses; it aliases
        // nothing in this process.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            Err(last_errno())
        } else {
            Ok(AnonMap { addr, len })
        }
    }
}

impl Drop for AnonMap {
    fn drop(&mut self) {
        // SAFETY: `addr`/`len` are exactly the mapping made in `new`, and no reference into it
        // escapes this type.
        unsafe { libc::munmap(self.addr, self.len) };
    }
}

// ---------------------------------------------------------------------------------------------
// Item 4: userfaultfd.

const UFFD_FEATURE_NAMES: &[(u64, &str)] = &[
    (uapi::UFFD_FEATURE_PAGEFAULT_FLAG_WP, "PAGEFAULT_FLAG_WP"),
    (uapi::UFFD_FEATURE_EVENT_FORK, "EVENT_FORK"),
    (uapi::UFFD_FEATURE_EVENT_REMAP, "EVENT_REMAP"),
    (uapi::UFFD_FEATURE_EVENT_REMOVE, "EVENT_REMOVE"),
    (uapi::UFFD_FEATURE_MISSING_HUGETLBFS, "MISSING_HUGETLBFS"),
    (uapi::UFFD_FEATURE_MISSING_SHMEM, "MISSING_SHMEM"),
    (uapi::UFFD_FEATURE_EVENT_UNMAP, "EVENT_UNMAP"),
    (uapi::UFFD_FEATURE_SIGBUS, "SIGBUS"),
    (uapi::UFFD_FEATURE_THREAD_ID, "THREAD_ID"),
    (uapi::UFFD_FEATURE_MINOR_HUGETLBFS, "MINOR_HUGETLBFS"),
    (uapi::UFFD_FEATURE_MINOR_SHMEM, "MINOR_SHMEM"),
    (uapi::UFFD_FEATURE_EXACT_ADDRESS, "EXACT_ADDRESS"),
    (uapi::UFFD_FEATURE_WP_HUGETLBFS_SHMEM, "WP_HUGETLBFS_SHMEM"),
    (uapi::UFFD_FEATURE_WP_UNPOPULATED, "WP_UNPOPULATED"),
    (uapi::UFFD_FEATURE_POISON, "POISON"),
    (uapi::UFFD_FEATURE_WP_ASYNC, "WP_ASYNC"),
    (uapi::UFFD_FEATURE_MOVE, "MOVE"),
];

const UFFD_IOCTL_NAMES: &[(u64, &str)] = &[
    (1 << uapi::_UFFDIO_REGISTER, "REGISTER"),
    (1 << uapi::_UFFDIO_UNREGISTER, "UNREGISTER"),
    (1 << uapi::_UFFDIO_WAKE, "WAKE"),
    (1 << uapi::_UFFDIO_COPY, "COPY"),
    (1 << uapi::_UFFDIO_ZEROPAGE, "ZEROPAGE"),
    (1 << uapi::_UFFDIO_MOVE, "MOVE"),
    (1 << uapi::_UFFDIO_WRITEPROTECT, "WRITEPROTECT"),
    (1 << uapi::_UFFDIO_CONTINUE, "CONTINUE"),
    (1 << uapi::_UFFDIO_POISON, "POISON"),
    (1 << uapi::_UFFDIO_API, "API"),
];

/// Opens a userfaultfd (`/dev/userfaultfd`, else the syscall) and does `UFFDIO_API` with
/// `features = 0`, which returns every feature the kernel offers.
pub fn userfaultfd() -> Result<Userfaultfd, String> {
    let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
    let (fd, opened_via, dev_userfaultfd_error) = match open_dev_userfaultfd(flags) {
        Ok(fd) => (fd, "/dev/userfaultfd", None),
        Err(dev_err) => {
            // SAFETY: the userfaultfd syscall takes only an int of flags.
            let raw = unsafe { libc::syscall(libc::SYS_userfaultfd, flags) };
            if raw < 0 {
                return Err(format!(
                    "/dev/userfaultfd: {dev_err}; userfaultfd(2): {}",
                    errno_name(last_errno())
                ));
            }
            // SAFETY: `raw` is a fresh fd returned by userfaultfd(2) that nothing else owns.
            let fd = unsafe { OwnedFd::from_raw_fd(raw as c_int) };
            (fd, "userfaultfd(2)", Some(dev_err))
        }
    };
    let mut api = uapi::uffdio_api {
        api: uapi::UFFD_API,
        features: 0,
        ioctls: 0,
    };
    // SAFETY: `fd` is a userfaultfd; `api` is a valid `uffdio_api` the kernel reads and writes
    // back, and it lives across the call.
    let ret = unsafe { ioctl_with_mut_ref(&fd, uapi::UFFDIO_API(), &mut api) };
    if ret < 0 {
        return Err(format!("UFFDIO_API failed: {}", errno_name(last_errno())));
    }
    Ok(Userfaultfd {
        opened_via: opened_via.to_string(),
        dev_userfaultfd_error,
        features: BitFlags::decode(api.features, UFFD_FEATURE_NAMES),
        ioctls: BitFlags::decode(api.ioctls, UFFD_IOCTL_NAMES),
    })
}

fn open_dev_userfaultfd(flags: c_int) -> Result<OwnedFd, String> {
    let dev = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/userfaultfd")
        .map_err(|e| format!("open: {}", io_error_name(&e)))?;
    // SAFETY: `dev` is /dev/userfaultfd; USERFAULTFD_IOC_NEW takes its flags by value and
    // returns a new fd.
    let raw = unsafe { ioctl_with_val(&dev, uapi::USERFAULTFD_IOC_NEW(), flags as c_ulong) };
    if raw < 0 {
        return Err(format!("USERFAULTFD_IOC_NEW: {}", errno_name(last_errno())));
    }
    // SAFETY: `raw` is a fresh fd returned by USERFAULTFD_IOC_NEW that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

// ---------------------------------------------------------------------------------------------
// Item 5: THP and hugetlbfs.

const THP_DIR: &str = "/sys/kernel/mm/transparent_hugepage";

/// The selected THP modes for anonymous memory and shmem.
pub fn thp() -> Thp {
    Thp {
        enabled: selected_mode(&format!("{THP_DIR}/enabled")),
        shmem_enabled: selected_mode(&format!("{THP_DIR}/shmem_enabled")),
    }
}

/// The word in `[brackets]` of a sysfs mode file such as `always [madvise] never`.
fn selected_mode(path: &str) -> Result<String, String> {
    let text = read(path)?;
    text.split_whitespace()
        .find_map(|w| w.strip_prefix('[').and_then(|w| w.strip_suffix(']')))
        .map(str::to_string)
        .ok_or_else(|| format!("{path}: no [selected] mode in {text:?}"))
}

const HUGEPAGES_DIR: &str = "/sys/kernel/mm/hugepages";

/// hugetlbfs: default size, pool, free pages, mounts and per-size pools.
pub fn hugetlb() -> Hugetlb {
    let meminfo = read("/proc/meminfo");
    let field = |name: &str| {
        meminfo
            .clone()
            .and_then(|m| meminfo_value(&m, name, "/proc/meminfo"))
    };
    Hugetlb {
        default_size_kib: field("Hugepagesize:"),
        nr_hugepages: read_u64("/proc/sys/vm/nr_hugepages"),
        free_hugepages: field("HugePages_Free:"),
        hugetlbfs_mounts: hugetlbfs_mounts(),
        sizes: huge_page_sizes(),
    }
}

fn hugetlbfs_mounts() -> Result<Vec<String>, String> {
    let mounts = read("/proc/mounts")?;
    Ok(mounts
        .lines()
        .filter_map(|line| {
            let mut f = line.split_whitespace();
            let (_src, target, fstype) = (f.next()?, f.next()?, f.next()?);
            (fstype == "hugetlbfs").then(|| target.to_string())
        })
        .collect())
}

fn huge_page_sizes() -> Result<Vec<HugePageSize>, String> {
    let dir = fs::read_dir(HUGEPAGES_DIR)
        .map_err(|e| format!("{HUGEPAGES_DIR}: {}", io_error_name(&e)))?;
    let mut sizes: Vec<HugePageSize> = dir
        .filter_map(|entry| {
            let name = entry.ok()?.file_name().into_string().ok()?;
            let size_kib = name
                .strip_prefix("hugepages-")?
                .strip_suffix("kB")?
                .parse()
                .ok()?;
            Some(HugePageSize {
                size_kib,
                nr_hugepages: read_u64(&format!("{HUGEPAGES_DIR}/{name}/nr_hugepages")),
                free_hugepages: read_u64(&format!("{HUGEPAGES_DIR}/{name}/free_hugepages")),
            })
        })
        .collect();
    sizes.sort_by_key(|s| s.size_kib);
    Ok(sizes)
}

// ---------------------------------------------------------------------------------------------
// Item 6: NUMA.

const NODE_DIR: &str = "/sys/devices/system/node";

/// NUMA nodes with their memory, and whether the memory-policy syscalls answer.
pub fn numa() -> Numa {
    Numa {
        nodes: numa_nodes(),
        get_mempolicy: get_mempolicy(),
        mbind: mbind(),
    }
}

fn numa_nodes() -> Result<Vec<NumaNode>, String> {
    let dir = fs::read_dir(NODE_DIR).map_err(|e| format!("{NODE_DIR}: {}", io_error_name(&e)))?;
    let mut nodes = Vec::new();
    for entry in dir.flatten() {
        let Ok(name) = entry.file_name().into_string() else {
            continue;
        };
        let Some(id) = name
            .strip_prefix("node")
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let path = format!("{NODE_DIR}/{name}/meminfo");
        let text = read(&path)?;
        nodes.push(NumaNode {
            id,
            mem_total_kib: meminfo_value(&text, "MemTotal:", &path)?,
            mem_free_kib: meminfo_value(&text, "MemFree:", &path)?,
        });
    }
    if nodes.is_empty() {
        return Err(format!("{NODE_DIR}: no node* directories"));
    }
    nodes.sort_by_key(|n| n.id);
    Ok(nodes)
}

fn get_mempolicy() -> SyscallCheck {
    let null = std::ptr::null_mut::<c_void>();
    // SAFETY: with null policy/nodemask pointers, maxnode 0, addr 0 and flags 0 the kernel
    // writes nothing and only looks up the calling task's policy.
    let ret = unsafe { libc::syscall(libc::SYS_get_mempolicy, null, null, 0usize, null, 0usize) };
    syscall_check("get_mempolicy(NULL, NULL, 0, NULL, 0)", ret)
}

fn mbind() -> SyscallCheck {
    let null = std::ptr::null_mut::<c_void>();
    // SAFETY: an empty range (addr 0, len 0) with MPOL_DEFAULT and no nodemask: the kernel
    // validates the arguments and returns without touching any mapping.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_mbind,
            null,
            0usize,
            uapi::MPOL_DEFAULT,
            null,
            0usize,
            0u32,
        )
    };
    syscall_check("mbind(NULL, 0, MPOL_DEFAULT, NULL, 0, 0)", ret)
}

fn syscall_check(call: &str, ret: libc::c_long) -> SyscallCheck {
    if ret == 0 {
        SyscallCheck {
            available: true,
            detail: format!("{call} = 0"),
        }
    } else {
        SyscallCheck {
            available: false,
            detail: format!("{call}: {}", errno_name(last_errno())),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Helpers.

fn read(path: &str) -> Result<String, String> {
    fs::read_to_string(path).map_err(|e| format!("{path}: {}", io_error_name(&e)))
}

fn read_u64(path: &str) -> Result<u64, String> {
    let text = read(path)?;
    text.trim()
        .parse()
        .map_err(|e| format!("{path}: {text:?}: {e}"))
}

/// The number after `key` in a meminfo-style text (`Key:   123 kB`, or `Node 0 Key: 123 kB`).
fn meminfo_value(text: &str, key: &str, path: &str) -> Result<u64, String> {
    text.lines()
        .find_map(|line| {
            let mut words = line.split_whitespace();
            words.by_ref().find(|w| *w == key)?;
            words.next()?.parse().ok()
        })
        .ok_or_else(|| format!("{path}: no {key} line"))
}

fn last_errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn io_error_name(e: &std::io::Error) -> String {
    match e.raw_os_error() {
        Some(errno) => errno_name(errno),
        None => e.to_string(),
    }
}

/// The kernel's name of an errno value (`EINVAL`), or `errno N` for one not listed here.
fn errno_name(errno: i32) -> String {
    let name = match errno {
        libc::EPERM => "EPERM",
        libc::ENOENT => "ENOENT",
        libc::ESRCH => "ESRCH",
        libc::EINTR => "EINTR",
        libc::EIO => "EIO",
        libc::ENXIO => "ENXIO",
        libc::E2BIG => "E2BIG",
        libc::EBADF => "EBADF",
        libc::EAGAIN => "EAGAIN",
        libc::ENOMEM => "ENOMEM",
        libc::EACCES => "EACCES",
        libc::EFAULT => "EFAULT",
        libc::EBUSY => "EBUSY",
        libc::EEXIST => "EEXIST",
        libc::ENODEV => "ENODEV",
        libc::ENOTDIR => "ENOTDIR",
        libc::EISDIR => "EISDIR",
        libc::EINVAL => "EINVAL",
        libc::ENFILE => "ENFILE",
        libc::EMFILE => "EMFILE",
        libc::ENOTTY => "ENOTTY",
        libc::EFBIG => "EFBIG",
        libc::ENOSPC => "ENOSPC",
        libc::ESPIPE => "ESPIPE",
        libc::EROFS => "EROFS",
        libc::ERANGE => "ERANGE",
        libc::ENOSYS => "ENOSYS",
        libc::EOPNOTSUPP => "EOPNOTSUPP",
        libc::EHWPOISON => "EHWPOISON",
        _ => return format!("errno {errno}"),
    };
    name.to_string()
}

fn yes_no(v: u64) -> String {
    if v != 0 { "yes" } else { "no" }.to_string()
}

fn present_absent(present: bool) -> String {
    if present { "present" } else { "absent" }.to_string()
}

fn res_str<T: ToString>(r: &Result<T, String>) -> String {
    match r {
        Ok(v) => v.to_string(),
        Err(_) => "?".to_string(),
    }
}

/// One table line: name, value, detail.
type Row = (String, String, String);

fn row(name: &str, value: &str, detail: &str) -> Row {
    (name.to_string(), value.to_string(), detail.to_string())
}

fn row_res<T>(name: &str, r: &Result<T, String>, show: impl FnOnce(&T) -> (String, String)) -> Row {
    match r {
        Ok(v) => {
            let (value, detail) = show(v);
            (name.to_string(), value, detail)
        }
        Err(e) => row(name, "error", e),
    }
}

fn format_rows(rows: &[Row]) -> String {
    let name_w = rows.iter().map(|r| r.0.len()).max().unwrap_or(0);
    // Long values (the kernel release) would push every detail far right: cap the column.
    let value_w = rows
        .iter()
        .map(|r| r.1.len())
        .filter(|&w| w <= 24)
        .max()
        .unwrap_or(0);
    let mut out = String::new();
    for (name, value, detail) in rows {
        let line = if detail.is_empty() {
            format!("{name:<name_w$}  {value}")
        } else {
            format!("{name:<name_w$}  {value:<value_w$}  ({detail})")
        };
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}
