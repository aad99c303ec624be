//! Demand paging: the guest reads exactly the page source's bytes, whatever the
//! backend, vCPU count and number of userfaultfds; a failing source stops the VM with an error
//! naming the guest address; the background fetcher makes the region resident.

mod common;

use guestmem_sys::to_usize;
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::FromRawFd;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use guestmem_memory::{digest_bytes, Backend, DIGEST_SEED, PAGE_SIZE};
use guestmem_paging::{
    Error, FileSource, PageSource, Pager, PagerConfig, RemoteSource, ZeroSource,
};
use guestmem_vm::{layout, VcpuWork, Vm, VmConfig, Workload};

const SIZE: u64 = 32 << 20;
const STALL: Duration = Duration::from_secs(20);

/// Source bytes: pseudo-random, so a misplaced or missing page changes the digest.
fn pattern(size: u64) -> Vec<u8> {
    common::pattern(to_usize(size), 0x5eed)
}

/// A file (a memfd, so nothing is left behind) holding `bytes`.
fn file_with(bytes: &[u8]) -> File {
    // SAFETY: a valid NUL-terminated name; the fd is checked and then owned by the File.
    let fd = unsafe { libc::memfd_create(c"paging-test-source".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", io::Error::last_os_error());
    // SAFETY: `fd` is a fresh fd owned by nobody else.
    let mut file = unsafe { File::from_raw_fd(fd) };
    file.write_all(bytes).unwrap();
    file
}

fn config(backend: Backend, uffds: usize) -> PagerConfig {
    PagerConfig {
        uffds,
        handlers: 2,
        fault_around: (256 << 10).max(backend.page_size()),
        background: false,
        ..PagerConfig::default()
    }
}

/// Starts a VM over `backend`, pages its RAM in from a file source as the guest reads it with
/// `verify`, and checks every vCPU's digest against the source's bytes.
fn guest_reads_source(backend: Backend, vcpus: usize, uffds: usize) {
    let _pool = common::HugePages::for_backend(backend, SIZE);
    let bytes = pattern(SIZE);
    // Both ways in: copying straight from the file's mapping, and fetching into a bounce
    // buffer (a remote peer, here without delay).
    let file: Arc<dyn PageSource> = Arc::new(FileSource::new(file_with(&bytes)).unwrap());
    let source: Arc<dyn PageSource> = if uffds == 1 {
        file
    } else {
        Arc::new(RemoteSource::spawn(file, Duration::ZERO, 2).unwrap())
    };
    let mut vm = Vm::new(&VmConfig::simple(vcpus, SIZE, backend)).unwrap();
    let config = PagerConfig {
        abort: Some(vm.abort_handle()),
        ..config(backend, uffds)
    };
    let pager = Pager::start(vm.memory().region("ram").unwrap(), source, &config).unwrap();
    let work = VcpuWork::split(Workload::Verify, layout::RAM_GPA, SIZE, vcpus, 0);
    let report = vm.run(&work, STALL).unwrap();
    for (w, r) in work.iter().zip(&report.vcpus) {
        let off = to_usize(w.gpa - layout::RAM_GPA);
        let expected = digest_bytes(DIGEST_SEED, &bytes[off..off + to_usize(w.size)]);
        assert_eq!(
            r.digest, expected,
            "{backend}, {vcpus} vCPUs, {uffds} uffds: vCPU {} read other bytes than the source's",
            r.vcpu
        );
    }
    // A pager thread counts a chunk just after the copy that wakes the vCPU: the last
    // count may come a moment after the vCPUs are done.
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    let mut stats = pager.stats();
    while stats.resident_bytes < SIZE && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
        stats = pager.stats();
    }
    assert_eq!(stats.resident_bytes, SIZE, "{stats:?}");
    assert_eq!(
        stats.fault_chunks + stats.readahead_chunks,
        SIZE / config.fault_around,
        "without background fetch, faults and their readahead install every chunk: {stats:?}"
    );
    assert_eq!(stats.background_chunks, 0, "{stats:?}");
    assert!(stats.faults >= stats.fault_chunks, "{stats:?}");
}

fn all_shapes(backend: Backend) {
    for (vcpus, uffds) in [(1, 1), (1, 4), (8, 1), (8, 8)] {
        guest_reads_source(backend, vcpus, uffds);
    }
}

#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "needs a usable /dev/kvm and /dev/userfaultfd"
)]
fn anon_guest_reads_source_bytes() {
    all_shapes(Backend::Anon);
}

#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "needs a usable /dev/kvm and /dev/userfaultfd"
)]
fn memfd_guest_reads_source_bytes() {
    all_shapes(Backend::Memfd);
}

#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "needs a usable /dev/kvm and /dev/userfaultfd"
)]
fn hugetlb_guest_reads_source_bytes() {
    all_shapes(Backend::MemfdHugetlb);
}

/// A source that fails, for every attempt, on the chunk at `bad_offset`; and on the first
/// `flaky` attempts of any fetch.
struct FailingSource {
    inner: FileSource,
    bad_offset: Option<u64>,
    flaky: AtomicU32,
}

impl PageSource for FailingSource {
    fn fetch(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        if self
            .bad_offset
            .is_some_and(|bad| (offset..offset + buf.len() as u64).contains(&bad))
        {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionReset,
                "peer went away",
            ));
        }
        if self
            .flaky
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "transient"));
        }
        self.inner.fetch(offset, buf)
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
}

#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "needs a usable /dev/kvm and /dev/userfaultfd"
)]
fn failing_source_stops_the_vm_naming_the_guest_address() {
    let bad = 5 << 20;
    for backend in [Backend::Anon, Backend::Memfd] {
        let source = Arc::new(FailingSource {
            inner: FileSource::new(file_with(&pattern(SIZE))).unwrap(),
            bad_offset: Some(bad),
            flaky: AtomicU32::new(0),
        });
        let mut vm = Vm::new(&VmConfig::simple(2, SIZE, backend)).unwrap();
        let config = PagerConfig {
            abort: Some(vm.abort_handle()),
            ..config(backend, 2)
        };
        let pager = Pager::start(vm.memory().region("ram").unwrap(), source, &config).unwrap();
        let work = VcpuWork::split(Workload::Verify, layout::RAM_GPA, SIZE, 2, 0);
        // The stall watchdog (20 s) would end the run too, but with `Stalled`: `Aborted`
        // proves the pager stopped it.
        let err = vm.run(&work, STALL).unwrap_err();
        let gpa = format!("{:#x}", layout::RAM_GPA + bad);
        match &err {
            guestmem_vm::Error::Aborted(reason) => assert!(
                reason.contains(&gpa)
                    && reason.contains("'ram'")
                    && reason.contains("peer went away"),
                "{backend}: {reason}"
            ),
            other => panic!("{backend}: expected the pager to abort the run, got {other}"),
        }
        assert!(pager.failure().unwrap().contains(&gpa));
    }
}

/// A source that panics on every fetch (a bug in a VMM's own source).
struct PanickingSource(u64);

impl PageSource for PanickingSource {
    fn fetch(&self, offset: u64, _buf: &mut [u8]) -> io::Result<()> {
        panic!("source bug at {offset:#x}");
    }
    fn size(&self) -> u64 {
        self.0
    }
}

/// A pager thread that panics stops the VM with the reason instead of leaving its vCPUs
/// waiting forever on faults nobody serves.
#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "needs a usable /dev/kvm and /dev/userfaultfd"
)]
fn a_panicking_source_stops_the_vm_instead_of_hanging_it() {
    let mut vm = Vm::new(&VmConfig::simple(1, SIZE, Backend::Anon)).unwrap();
    let config = PagerConfig {
        abort: Some(vm.abort_handle()),
        ..config(Backend::Anon, 1)
    };
    let source = Arc::new(PanickingSource(SIZE));
    let pager = Pager::start(vm.memory().region("ram").unwrap(), source, &config).unwrap();
    let work = VcpuWork::split(Workload::Verify, layout::RAM_GPA, SIZE, 1, 0);
    let t = std::time::Instant::now();
    let err = vm.run(&work, STALL).unwrap_err();
    match &err {
        guestmem_vm::Error::Aborted(reason) => assert!(
            reason.contains("'ram'") && reason.contains("panicked: source bug at"),
            "{reason}"
        ),
        other => panic!("expected the pager to abort the run, got {other}"),
    }
    assert!(
        t.elapsed() < STALL,
        "stopped by the pager, not the watchdog"
    );
    assert!(pager.failure().unwrap().contains("panicked"));
}

#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "needs a usable /dev/kvm and /dev/userfaultfd"
)]
fn transient_source_errors_are_retried() {
    let bytes = pattern(SIZE);
    let source = Arc::new(FailingSource {
        inner: FileSource::new(file_with(&bytes)).unwrap(),
        bad_offset: None,
        flaky: AtomicU32::new(2), // fewer than the 3 attempts a fetch gets
    });
    let mut vm = Vm::new(&VmConfig::simple(1, SIZE, Backend::Anon)).unwrap();
    let config = PagerConfig {
        abort: Some(vm.abort_handle()),
        retry_delay: Duration::from_millis(1),
        ..config(Backend::Anon, 1)
    };
    let _pager = Pager::start(vm.memory().region("ram").unwrap(), source, &config).unwrap();
    let work = VcpuWork::split(Workload::Verify, layout::RAM_GPA, SIZE, 1, 0);
    let report = vm.run(&work, STALL).unwrap();
    assert_eq!(report.vcpus[0].digest, digest_bytes(DIGEST_SEED, &bytes));
}

#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "needs a usable /dev/kvm and /dev/userfaultfd"
)]
fn background_fetch_makes_the_region_resident_and_retires() {
    let bytes = pattern(SIZE);
    for backend in [Backend::Anon, Backend::Memfd] {
        let source = Arc::new(FileSource::new(file_with(&bytes)).unwrap());
        let mut vm = Vm::new(&VmConfig::simple(2, SIZE, backend)).unwrap();
        let config = PagerConfig {
            background: true,
            ..config(backend, 2)
        };
        let pager = Pager::start(vm.memory().region("ram").unwrap(), source, &config).unwrap();
        assert!(
            pager.wait_resident(Duration::from_secs(30)).unwrap(),
            "{backend}: not resident"
        );
        let stats = pager.stats();
        assert!(stats.retired, "{stats:?}");
        assert_eq!(stats.resident_bytes, SIZE, "{stats:?}");
        assert_eq!(stats.faults, 0, "nobody touched the region: {stats:?}");
        assert_eq!(
            stats.background_chunks,
            SIZE / config.fault_around,
            "{stats:?}"
        );
        // Host and guest both see the source's bytes, with the pager out of the way.
        assert_eq!(
            vm.memory().digest(layout::RAM_GPA, SIZE).unwrap(),
            digest_bytes(DIGEST_SEED, &bytes)
        );
        let work = VcpuWork::split(Workload::Verify, layout::RAM_GPA, SIZE, 1, 0);
        let work = [
            work[0].clone(),
            VcpuWork {
                size: 0,
                ..work[0].clone()
            },
        ];
        let report = vm.run(&work, STALL).unwrap();
        assert_eq!(report.vcpus[0].digest, digest_bytes(DIGEST_SEED, &bytes));
    }
}

#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "needs a usable /dev/kvm and /dev/userfaultfd"
)]
fn remote_source_with_latency_serves_the_guest() {
    let bytes = pattern(SIZE);
    let file = Arc::new(FileSource::new(file_with(&bytes)).unwrap());
    let source = Arc::new(RemoteSource::spawn(file, Duration::from_micros(30), 2).unwrap());
    let mut vm = Vm::new(&VmConfig::simple(2, SIZE, Backend::Memfd)).unwrap();
    let config = PagerConfig {
        abort: Some(vm.abort_handle()),
        background: true,
        ..config(Backend::Memfd, 2)
    };
    let pager = Pager::start(vm.memory().region("ram").unwrap(), source, &config).unwrap();
    let work = VcpuWork::split(Workload::Verify, layout::RAM_GPA, SIZE, 2, 0);
    let report = vm.run(&work, STALL).unwrap();
    for (w, r) in work.iter().zip(&report.vcpus) {
        let off = to_usize(w.gpa - layout::RAM_GPA);
        assert_eq!(
            r.digest,
            digest_bytes(DIGEST_SEED, &bytes[off..off + to_usize(w.size)])
        );
    }
    assert!(pager.wait_resident(Duration::from_secs(30)).unwrap());
}

#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "needs a usable /dev/kvm and /dev/userfaultfd"
)]
fn discarded_pages_read_as_zero_and_are_not_fetched() {
    let bytes = pattern(SIZE);
    let source = Arc::new(FileSource::new(file_with(&bytes)).unwrap());
    let mut vm = Vm::new(&VmConfig::simple(1, SIZE, Backend::Anon)).unwrap();
    let config = PagerConfig {
        abort: Some(vm.abort_handle()),
        ..config(Backend::Anon, 1)
    };
    let chunk = config.fault_around;
    let pager = Pager::start(vm.memory().region("ram").unwrap(), source, &config).unwrap();
    let host = vm.memory().region("ram").unwrap().host_addr();
    let discard = |off: u64, len: u64| {
        // SAFETY: the range lies inside the region's mapping; its contents are given up.
        let r = unsafe {
            libc::madvise(
                host.add(to_usize(off)).cast(),
                to_usize(len),
                libc::MADV_DONTNEED,
            )
        };
        assert_eq!(r, 0, "madvise: {}", io::Error::last_os_error());
    };
    // Before anything is fetched: a whole chunk (never fetched afterwards).
    discard(4 * chunk, chunk);
    let work = VcpuWork::split(Workload::Verify, layout::RAM_GPA, SIZE, 1, 0);
    vm.run(&work, STALL).unwrap();
    // After everything is resident: three pages straddling a chunk boundary.
    discard(8 * chunk - PAGE_SIZE, 3 * PAGE_SIZE);
    let report = vm.run(&work, STALL).unwrap();
    let mut expected = bytes.clone();
    expected[to_usize(4 * chunk)..to_usize(5 * chunk)].fill(0);
    expected[to_usize(8 * chunk - PAGE_SIZE)..to_usize(8 * chunk + 2 * PAGE_SIZE)].fill(0);
    assert_eq!(report.vcpus[0].digest, digest_bytes(DIGEST_SEED, &expected));
    let stats = pager.stats();
    assert_eq!(stats.discarded_chunks, 1, "{stats:?}");
    assert_eq!(
        stats.fault_chunks + stats.readahead_chunks,
        SIZE / chunk - 1,
        "{stats:?}"
    );
}

/// A userfaultfd pager on a guest_memfd region is always refused (userfaultfd never sees a
/// vCPU's accesses to guest_memfd, so the guest would run on pages never fetched), naming KVM
/// Userfault; whether guestmem can demand page the region at all follows KVM Userfault, found by
/// trying it.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn gmem_pager_is_refused_and_demand_paging_follows_kvm_userfault() {
    let config = VmConfig::simple(1, 4 << 20, Backend::GuestMemfd);
    let vm = match Vm::new(&config) {
        Ok(vm) => vm,
        Err(e) => {
            // No host-mapped guest_memfd on this kernel: refused naming what it lacks.
            let msg = e.to_string();
            assert!(
                msg.contains("KVM_CAP_GUEST_MEMFD") || msg.contains("MMAP|INIT_SHARED"),
                "{msg}"
            );
            return;
        }
    };
    let region = vm.memory().region("ram").unwrap();
    let err = Pager::start(
        region,
        Arc::new(ZeroSource { size: 4 << 20 }),
        &PagerConfig::default(),
    )
    .expect_err("a userfaultfd pager on guest_memfd must be refused");
    assert!(matches!(err, Error::Unsupported { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("'ram'")
            && msg.contains("never a vCPU's to guest_memfd")
            && msg.contains("KVM_MEM_USERFAULT")
            && msg.contains("KVM_CAP_USERFAULT"),
        "{msg}"
    );
    let checked = guestmem_paging::check_demand_paging(region);
    let userfault = guestmem_sys::probe::kvm_userfault_on_a_new_vm().unwrap();
    if userfault.present {
        assert!(msg.contains("which this kernel has"), "{msg}");
        assert!(checked.is_ok(), "{checked:?}");
    } else {
        assert!(msg.contains("which is absent here"), "{msg}");
        assert_eq!(checked.unwrap_err().to_string(), msg);
    }
}

#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "needs a usable /dev/kvm and /dev/userfaultfd"
)]
fn bad_pager_configs_are_refused_with_the_reason() {
    let vm = Vm::new(&VmConfig::simple(1, 4 << 20, Backend::Anon)).unwrap();
    let region = vm.memory().region("ram").unwrap();
    let zero = Arc::new(ZeroSource { size: 4 << 20 });
    let refuse = |source: Arc<dyn PageSource>, config: PagerConfig, needle: &str| {
        let err = Pager::start(region, source, &config).expect_err(needle);
        assert!(matches!(err, Error::Config { .. }), "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains("region 'ram'") && msg.contains(needle),
            "{msg}"
        );
    };
    let base = PagerConfig::default();
    refuse(
        zero.clone(),
        PagerConfig {
            fault_around: 3 << 12,
            ..base.clone()
        },
        "power of two",
    );
    refuse(
        zero.clone(),
        PagerConfig {
            fault_around: 2048,
            ..base.clone()
        },
        "page size",
    );
    refuse(
        zero.clone(),
        PagerConfig {
            uffds: 0,
            ..base.clone()
        },
        "0 userfaultfds",
    );
    refuse(
        zero.clone(),
        PagerConfig {
            uffds: 3,
            ..base.clone()
        },
        "1 to 2",
    );
    refuse(
        zero.clone(),
        PagerConfig {
            handlers: 0,
            ..base.clone()
        },
        "0 handler threads",
    );
    refuse(
        zero.clone(),
        PagerConfig {
            fetch_attempts: 0,
            ..base.clone()
        },
        "0 fetch attempts",
    );
    refuse(
        Arc::new(ZeroSource { size: 1 << 20 }),
        base,
        "holds 0x100000 bytes",
    );
}
