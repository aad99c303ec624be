//! A guest memory region: a host mapping of one backend, placed at a guest physical address.

use guestmem_sys::to_usize;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

use guestmem_sys::probe::{guest_memfd_write, GuestMemfdWrite};
use guestmem_sys::uapi::{
    kvm_create_guest_memfd, GUEST_MEMFD_FLAG_INIT_SHARED, GUEST_MEMFD_FLAG_MMAP,
    KVM_CAP_GUEST_MEMFD, KVM_CAP_GUEST_MEMFD_FLAGS,
};
use kvm_ioctls::VmFd;
use serde::{Deserialize, Serialize};

use crate::{DirtyMarks, Error, NumaPolicy, Result, PAGE_SIZE};

/// Size of a huge page on the hugetlb backends (x86-64 PMD).
pub const HUGE_PAGE_SIZE: u64 = 2 << 20;

/// What host memory backs a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Backend {
    /// Anonymous private memory (`MAP_PRIVATE | MAP_ANONYMOUS`).
    Anon,
    /// A memfd mapped shared: the memory can be handed to another process by fd.
    Memfd,
    /// A memfd backed by 2 MiB huge pages (`MFD_HUGETLB | MFD_HUGE_2MB`).
    MemfdHugetlb,
    /// A file on a hugetlbfs mount (2 MiB pages), unlinked once open.
    Hugetlbfs,
    /// A KVM guest_memfd created with `MMAP | INIT_SHARED` and bound with
    /// `KVM_SET_USER_MEMORY_REGION2` + `KVM_MEM_GUEST_MEMFD`.
    GuestMemfd,
}

impl Backend {
    /// Every backend.
    pub const ALL: [Backend; 5] = [
        Backend::Anon,
        Backend::Memfd,
        Backend::MemfdHugetlb,
        Backend::Hugetlbfs,
        Backend::GuestMemfd,
    ];

    /// The granule the region's size and guest address must be multiples of.
    pub fn page_size(self) -> u64 {
        match self {
            Backend::MemfdHugetlb | Backend::Hugetlbfs => HUGE_PAGE_SIZE,
            Backend::Anon | Backend::Memfd | Backend::GuestMemfd => PAGE_SIZE,
        }
    }

    /// The name used on the command line and in messages.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Anon => "anon",
            Backend::Memfd => "memfd",
            Backend::MemfdHugetlb => "memfd-hugetlb",
            Backend::Hugetlbfs => "hugetlb",
            Backend::GuestMemfd => "gmem",
        }
    }

    /// Whether the host mapping is shared with a file (page cache), so that the memory can be
    /// passed by fd and uffd MINOR faults apply.
    pub fn is_shared(self) -> bool {
        !matches!(self, Backend::Anon)
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Backend {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Backend::ALL
            .into_iter()
            .find(|b| b.name() == s)
            .ok_or_else(|| {
                let names: Vec<_> = Backend::ALL.iter().map(|b| b.name()).collect();
                format!(
                    "unknown backend '{s}' (expected one of: {})",
                    names.join(", ")
                )
            })
    }
}

/// What a region should be: its name (used in every message about it), place, size and backend.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionSpec {
    /// The region's name: unique in a VM, used in every message about it.
    pub name: String,
    /// Its guest physical address.
    pub gpa: u64,
    /// Its bytes.
    pub size: u64,
    /// What memory backs it.
    pub backend: Backend,
    /// Where on the host its pages go (applied before the first page is allocated).
    #[serde(default)]
    pub numa: NumaPolicy,
}

impl RegionSpec {
    /// A region of `size` bytes at `gpa` on `backend`, with the default NUMA policy.
    pub fn new(name: impl Into<String>, gpa: u64, size: u64, backend: Backend) -> Self {
        RegionSpec {
            name: name.into(),
            gpa,
            size,
            backend,
            numa: NumaPolicy::default(),
        }
    }

    /// Its end guest address (exclusive).
    pub fn end(&self) -> u64 {
        self.gpa + self.size
    }

    /// Checks what can be checked without the kernel: a non-zero size and an address and size
    /// that are multiples of the backend's page size.
    pub fn validate(&self) -> Result<()> {
        let page = self.backend.page_size();
        if self.size == 0 {
            return Err(Error::ZeroSize {
                region: self.name.clone(),
            });
        }
        if !self.size.is_multiple_of(page) {
            return Err(Error::Misaligned {
                region: self.name.clone(),
                what: "size",
                value: self.size,
                backend: self.backend,
                page_size: page,
            });
        }
        if !self.gpa.is_multiple_of(page) {
            return Err(Error::Misaligned {
                region: self.name.clone(),
                what: "guest address",
                value: self.gpa,
                backend: self.backend,
                page_size: page,
            });
        }
        if self.gpa.checked_add(self.size).is_none() {
            return Err(Error::OutOfRange {
                region: self.name.clone(),
                gpa: self.gpa,
                size: self.size,
            });
        }
        Ok(())
    }
}

/// A region's host mapping. Unmapped (and its fd closed) on drop.
#[derive(Debug)]
pub struct Region {
    spec: RegionSpec,
    host: NonNull<u8>,
    fd: Option<OwnedFd>,
    vmm_dirty: DirtyMarks,
}

// SAFETY: `Region` owns its mapping and fd; the raw pointer is only an address of memory that
// stays mapped until drop. All access through it goes through volatile/copy operations whose
// callers uphold their own synchronisation, as for any shared guest memory.
unsafe impl Send for Region {}
// SAFETY: as above; `&Region` hands out only the address, never references into the mapping.
unsafe impl Sync for Region {}

impl Region {
    /// Creates the backing memory and maps it. `vm` is needed for guest_memfd only.
    pub fn create(spec: RegionSpec, vm: Option<&VmFd>) -> Result<Region> {
        Region::create_on(spec, vm, None)
    }

    /// Like [`Region::create`], but over `shared`, the backing file of the same region in
    /// another process (local migration hands memfds over instead of copying them): its
    /// contents are the region's. Only file-backed host memory can be shared this way
    /// (memfd, memfd-hugetlb, hugetlbfs); a guest_memfd belongs to the VM that created it.
    pub fn create_on(
        spec: RegionSpec,
        vm: Option<&VmFd>,
        shared: Option<OwnedFd>,
    ) -> Result<Region> {
        spec.validate()?;
        spec.numa.check(&spec.name)?;
        if let Some(fd) = shared {
            if !matches!(
                spec.backend,
                Backend::Memfd | Backend::MemfdHugetlb | Backend::Hugetlbfs
            ) {
                return Err(Error::Shared {
                    region: spec.name.clone(),
                    reason: format!(
                        "it is {}: only memfd, memfd-hugetlb and hugetlb files can be shared \
                         (a guest_memfd is bound to the VM that created it)",
                        spec.backend
                    ),
                });
            }
            let len = std::fs::File::from(fd.try_clone().map_err(|e| Error::os(&spec, "dup", e))?)
                .metadata()
                .map_err(|e| Error::os(&spec, "fstat", e))?
                .len();
            if len < spec.size {
                return Err(Error::Shared {
                    region: spec.name.clone(),
                    reason: format!(
                        "the shared file holds {len:#x} bytes, less than the region's {:#x}",
                        spec.size
                    ),
                });
            }
            return Region::map(spec, Some(fd));
        }
        let fd = match spec.backend {
            Backend::Anon => None,
            Backend::Memfd => Some(memfd(&spec, 0)?),
            Backend::MemfdHugetlb => Some(memfd(&spec, libc::MFD_HUGETLB | libc::MFD_HUGE_2MB)?),
            Backend::Hugetlbfs => Some(hugetlbfs_file(&spec)?),
            Backend::GuestMemfd => Some(guest_memfd(&spec, vm)?),
        };
        if let Some(fd) = &fd {
            if spec.backend.page_size() == HUGE_PAGE_SIZE {
                check_free_huge_pages(&spec)?;
            }
            if spec.backend != Backend::GuestMemfd {
                // SAFETY: `fd` is a valid, owned file descriptor; ftruncate only sets its size.
                let ret = unsafe { libc::ftruncate(fd.as_raw_fd(), spec.size as libc::off_t) };
                if ret != 0 {
                    return Err(Error::os(&spec, "ftruncate", io::Error::last_os_error()));
                }
            }
        }
        Region::map(spec, fd)
    }

    /// Maps `fd` (or anonymous memory) for `spec` and applies its NUMA policy.
    fn map(spec: RegionSpec, fd: Option<OwnedFd>) -> Result<Region> {
        let (flags, raw_fd) = match &fd {
            None => (
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
            ),
            Some(fd) => (libc::MAP_SHARED, fd.as_raw_fd()),
        };
        // SAFETY: a fresh mapping (addr NULL) of `size` bytes: it cannot alias existing memory.
        // `raw_fd` is either -1 with MAP_ANONYMOUS or an fd we own that is at least `size` long.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                to_usize(spec.size),
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                raw_fd,
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(Error::os(&spec, "mmap", io::Error::last_os_error()));
        }
        let host = NonNull::new(addr.cast::<u8>()).expect("mmap returned a non-null mapping");
        if let Err(e) = crate::numa::apply(&spec, host.as_ptr(), fd.as_ref()) {
            // SAFETY: the mapping made just above, which nothing else refers to yet.
            unsafe { libc::munmap(addr, to_usize(spec.size)) };
            return Err(e);
        }
        tracing::debug!(region = %spec.name, backend = %spec.backend, gpa = spec.gpa, size = spec.size, "region mapped");
        let vmm_dirty = DirtyMarks::new(spec.size);
        Ok(Region {
            spec,
            host,
            fd,
            vmm_dirty,
        })
    }

    /// What it was made from.
    pub fn spec(&self) -> &RegionSpec {
        &self.spec
    }
    /// Its name.
    pub fn name(&self) -> &str {
        &self.spec.name
    }
    /// Its guest physical address.
    pub fn gpa(&self) -> u64 {
        self.spec.gpa
    }
    /// Its bytes.
    pub fn size(&self) -> u64 {
        self.spec.size
    }
    /// Its backend.
    pub fn backend(&self) -> Backend {
        self.spec.backend
    }
    /// The host address of the region's first byte.
    pub fn host_addr(&self) -> *mut u8 {
        self.host.as_ptr()
    }
    /// The backing fd (memfd, hugetlbfs file or guest_memfd); `None` for anonymous memory.
    pub fn fd(&self) -> Option<&OwnedFd> {
        self.fd.as_ref()
    }
    /// Pages the VMM wrote into this region (see [`DirtyMarks`]).
    pub fn vmm_dirty(&self) -> &DirtyMarks {
        &self.vmm_dirty
    }
    /// Whether guest address `gpa` is inside it.
    pub fn contains(&self, gpa: u64) -> bool {
        gpa >= self.spec.gpa && gpa < self.spec.end()
    }

    /// Asks for transparent huge pages behind an anonymous region (`MADV_HUGEPAGE`; the host's
    /// THP mode is `madvise` here), as QEMU and Cloud Hypervisor do for guest RAM: memory
    /// that is filled in bulk, such as a migration's destination, then takes one fault and one
    /// page-table entry per 2 MiB instead of 512. Other backends are left as they are (their
    /// page size comes from the backend).
    pub fn advise_huge_pages(&self) -> Result<()> {
        if self.spec.backend != Backend::Anon {
            return Ok(());
        }
        // SAFETY: the range is exactly this region's own anonymous mapping; MADV_HUGEPAGE only
        // changes how later faults allocate, never the contents.
        let ret = unsafe {
            libc::madvise(
                self.host.as_ptr().cast(),
                to_usize(self.spec.size),
                libc::MADV_HUGEPAGE,
            )
        };
        if ret != 0 {
            return Err(Error::os(
                &self.spec,
                "madvise(MADV_HUGEPAGE)",
                io::Error::last_os_error(),
            ));
        }
        Ok(())
    }

    /// Host address of `len` bytes at `gpa`, if they lie wholly inside this region.
    pub fn host_range(&self, gpa: u64, len: u64) -> Option<*mut u8> {
        let off = gpa.checked_sub(self.spec.gpa)?;
        (off.checked_add(len)? <= self.spec.size).then(|| {
            // SAFETY: off + len <= size, so the result stays inside the mapping.
            unsafe { self.host.as_ptr().add(to_usize(off)) }
        })
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: `host`/`size` are exactly the mapping created in `create`, unmapped once here.
        unsafe {
            libc::munmap(
                self.host.as_ptr().cast::<libc::c_void>(),
                to_usize(self.spec.size),
            )
        };
    }
}

fn memfd(spec: &RegionSpec, extra_flags: libc::c_uint) -> Result<OwnedFd> {
    let name = std::ffi::CString::new(format!("guestmem:{}", spec.name))
        .map_err(|_| Error::BadName(spec.name.clone()))?;
    // SAFETY: `name` is a valid NUL-terminated string; the returned fd is checked below.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | extra_flags) };
    if fd < 0 {
        let err = io::Error::last_os_error();
        if extra_flags & libc::MFD_HUGETLB != 0 {
            return Err(Error::BackendUnavailable {
                region: spec.name.clone(),
                backend: spec.backend,
                reason: format!("memfd_create(MFD_HUGETLB) failed: {err}"),
            });
        }
        return Err(Error::os(spec, "memfd_create", err));
    }
    // SAFETY: `fd` was just returned by memfd_create and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The first hugetlbfs mount whose page size is 2 MiB, from /proc/mounts.
pub fn hugetlbfs_mount() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/mounts").ok()?;
    mounts.lines().find_map(|line| {
        let mut f = line.split_whitespace();
        let (_dev, dir, fstype, opts) = (f.next()?, f.next()?, f.next()?, f.next()?);
        let two_mib = !opts.contains("pagesize=") || opts.contains("pagesize=2M");
        (fstype == "hugetlbfs" && two_mib).then(|| PathBuf::from(dir))
    })
}

fn hugetlbfs_file(spec: &RegionSpec) -> Result<OwnedFd> {
    let dir = hugetlbfs_mount().ok_or_else(|| Error::BackendUnavailable {
        region: spec.name.clone(),
        backend: spec.backend,
        reason: "no hugetlbfs mount with 2 MiB pages in /proc/mounts \
                 (mount one: mount -t hugetlbfs -o pagesize=2M none /dev/hugepages)"
            .into(),
    })?;
    let path = unique_path(&dir, &spec.name);
    let file = File::options()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)
        .map_err(|e| Error::os(spec, "open on hugetlbfs", e))?;
    // The file lives on only through its fd and mapping.
    let _ = std::fs::remove_file(&path);
    Ok(OwnedFd::from(file))
}

fn unique_path(dir: &Path, name: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let clean: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    dir.join(format!("guestmem-{}-{}-{clean}", std::process::id(), n))
}

/// Refuses a hugetlb region up front when the pool cannot hold it, so that the guest never
/// meets a SIGBUS later.
fn check_free_huge_pages(spec: &RegionSpec) -> Result<()> {
    let path = "/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages";
    let free: u64 = std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0);
    let need = spec.size / HUGE_PAGE_SIZE;
    if free < need {
        return Err(Error::BackendUnavailable {
            region: spec.name.clone(),
            backend: spec.backend,
            reason: format!(
                "needs {need} free 2 MiB huge pages, the pool has {free} \
                 (reserve more: echo N > /proc/sys/vm/nr_hugepages)"
            ),
        });
    }
    Ok(())
}

fn guest_memfd(spec: &RegionSpec, vm: Option<&VmFd>) -> Result<OwnedFd> {
    let unavailable = |reason: String| Error::BackendUnavailable {
        region: spec.name.clone(),
        backend: spec.backend,
        reason,
    };
    let vm = vm.ok_or_else(|| unavailable("a guest_memfd needs a VM to belong to".into()))?;
    if vm.check_extension_raw(KVM_CAP_GUEST_MEMFD.into()) <= 0 {
        return Err(unavailable("the kernel lacks KVM_CAP_GUEST_MEMFD".into()));
    }
    let wanted = GUEST_MEMFD_FLAG_MMAP | GUEST_MEMFD_FLAG_INIT_SHARED;
    let offered = vm
        .check_extension_raw(KVM_CAP_GUEST_MEMFD_FLAGS.into())
        .max(0) as u64;
    if offered & wanted != wanted {
        return Err(unavailable(format!(
            "the kernel's guest_memfd flags are {offered:#x}; host-mapped guest_memfd needs \
             MMAP|INIT_SHARED ({wanted:#x})"
        )));
    }
    let mut flags = wanted;
    // guest_memfd write() may need a creation flag whose number is not settled: when
    // the kernel offers flags beyond MMAP|INIT_SHARED, the probe finds (by trying) which one.
    if offered & !wanted != 0 {
        if let Ok(GuestMemfdWrite {
            flag: Some(flag), ..
        }) = guest_memfd_write(vm, offered)
        {
            flags |= flag;
        }
    }
    let gmem = kvm_create_guest_memfd {
        size: spec.size,
        flags,
        ..Default::default()
    };
    let fd = vm.create_guest_memfd(gmem).map_err(|e| {
        Error::os(
            spec,
            "KVM_CREATE_GUEST_MEMFD",
            io::Error::from_raw_os_error(e.errno()),
        )
    })?;
    // SAFETY: KVM_CREATE_GUEST_MEMFD returned a new fd that nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A memory file handed over by another process backs a region only when it is host
    /// memory of a file backend and at least as long as the region; it then holds that
    /// process's bytes. Anything else is refused, naming the region and the reason.
    #[test]
    fn a_shared_memory_file_backs_only_a_file_region_it_covers() {
        let size = 4 << 20;
        let source = Region::create(RegionSpec::new("ram", 0, size, Backend::Memfd), None).unwrap();
        // SAFETY: one byte inside the region's live mapping, which nothing else uses.
        unsafe { source.host_addr().add(4096).write(0x5a) };
        let fd = || source.fd().unwrap().try_clone().unwrap();

        let shared = Region::create_on(
            RegionSpec::new("ram", 0, size, Backend::Memfd),
            None,
            Some(fd()),
        )
        .unwrap();
        // SAFETY: one byte inside the shared region's live mapping.
        assert_eq!(unsafe { shared.host_addr().add(4096).read() }, 0x5a);

        for (backend, why) in [
            (Backend::Anon, "it is anon"),
            (Backend::GuestMemfd, "bound to the VM that created it"),
        ] {
            let spec = RegionSpec::new("ram", 0, size, backend);
            match Region::create_on(spec, None, Some(fd())) {
                Err(e @ Error::Shared { .. }) => {
                    let msg = e.to_string();
                    assert!(msg.contains("ram") && msg.contains(why), "{backend}: {msg}");
                }
                other => panic!("{backend}: expected a refusal, got {:?}", other.map(|_| ())),
            }
        }
        let longer = RegionSpec::new("ram", 0, 2 * size, Backend::Memfd);
        match Region::create_on(longer, None, Some(fd())) {
            Err(e @ Error::Shared { .. }) => {
                assert!(e.to_string().contains("less than the region's"), "{e}");
            }
            other => panic!("expected a refusal, got {:?}", other.map(|_| ())),
        }
    }
}
