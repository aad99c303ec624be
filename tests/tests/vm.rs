//! The foundation: a real KVM VM running the guest payload over every memory backend.

mod common;

use guestmem_sys::to_usize;
use std::time::Duration;

use common::{pattern, HugePages};
use guestmem_memory::{digest_bytes, Backend, RegionSpec, DIGEST_SEED, PAGE_SIZE};
use guestmem_vm::payload::page_value;
use guestmem_vm::{layout, Error, VcpuWork, Vm, VmConfig, Workload};

const STALL: Duration = Duration::from_secs(30);
const MIB: u64 = 1 << 20;

/// Host writes a pattern; the guest's `verify` digest of each vCPU's range equals the digest of
/// the bytes the host wrote (computed from the host's own buffer).
fn guest_reads_host_bytes(backend: Backend, vcpus: usize, size: u64) {
    let _pool = HugePages::for_backend(backend, size);
    let mut vm = Vm::new(&VmConfig::simple(vcpus, size, backend)).unwrap();
    let data = pattern(to_usize(size), 42);
    vm.memory().write(layout::RAM_GPA, &data).unwrap();
    let work = VcpuWork::split(Workload::Verify, layout::RAM_GPA, size, vcpus, 0);
    let report = vm.run(&work, STALL).unwrap();
    for (w, v) in work.iter().zip(&report.vcpus) {
        let off = to_usize(w.gpa - layout::RAM_GPA);
        let expected = digest_bytes(DIGEST_SEED, &data[off..off + to_usize(w.size)]);
        assert_eq!(v.digest, expected, "{backend}: vCPU {} digest", v.vcpu);
        assert_eq!(v.pages, w.pages(), "{backend}: vCPU {} pages read", v.vcpu);
    }
}

/// The guest writes every page (`touch`); the host reads the predicted value at each page's
/// start and zeros elsewhere.
fn host_reads_guest_bytes(backend: Backend, vcpus: usize, size: u64) {
    let _pool = HugePages::for_backend(backend, size);
    let mut vm = Vm::new(&VmConfig::simple(vcpus, size, backend)).unwrap();
    let work = VcpuWork::split(Workload::Touch, layout::RAM_GPA, size, vcpus, 1000);
    let report = vm.run(&work, STALL).unwrap();
    for (w, v) in work.iter().zip(&report.vcpus) {
        assert_eq!(v.pages, w.pages());
        assert_eq!(v.generation, 1);
        let mut page = vec![0u8; to_usize(PAGE_SIZE)];
        for p in 0..w.pages() {
            let gpa = w.gpa + p * PAGE_SIZE;
            vm.memory().read(gpa, &mut page).unwrap();
            let first = u64::from_le_bytes(page[..8].try_into().unwrap());
            assert_eq!(
                first,
                page_value(w.seed, gpa, 0),
                "{backend}: page {gpa:#x}"
            );
            assert!(
                page[8..].iter().all(|&b| b == 0),
                "{backend}: page {gpa:#x} tail"
            );
        }
    }
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn every_backend_guest_reads_what_the_host_wrote() {
    for backend in Backend::ALL {
        guest_reads_host_bytes(backend, 2, 8 * MIB);
    }
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn every_backend_host_reads_what_the_guest_wrote() {
    for backend in Backend::ALL {
        host_reads_guest_bytes(backend, 2, 8 * MIB);
    }
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn one_two_and_eight_vcpus() {
    for vcpus in [1, 2, 8] {
        for backend in [Backend::Anon, Backend::GuestMemfd] {
            guest_reads_host_bytes(backend, vcpus, 16 * MIB);
            host_reads_guest_bytes(backend, vcpus, 16 * MIB);
        }
    }
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn two_regions_with_a_hole() {
    let lo = RegionSpec::new("lo", layout::RAM_GPA, 4 * MIB, Backend::Memfd);
    let hi = RegionSpec::new(
        "hi",
        layout::RAM_GPA + 64 * MIB,
        4 * MIB,
        Backend::GuestMemfd,
    );
    let mut vm = Vm::new(&VmConfig {
        vcpus: 2,
        regions: vec![lo.clone(), hi.clone()],
        dirty_ring_bytes: None,
    })
    .unwrap();
    let touch = [
        VcpuWork {
            workload: Workload::Touch,
            gpa: lo.gpa,
            size: lo.size,
            seed: 1,
        },
        VcpuWork {
            workload: Workload::Touch,
            gpa: hi.gpa,
            size: hi.size,
            seed: 2,
        },
    ];
    vm.run(&touch, STALL).unwrap();
    for w in &touch {
        for p in [0, w.pages() / 2, w.pages() - 1] {
            let gpa = w.gpa + p * PAGE_SIZE;
            assert_eq!(
                vm.memory().read_u64(gpa).unwrap(),
                page_value(w.seed, gpa, 0)
            );
        }
    }
    // The hole is not memory.
    assert!(vm.memory().read_u64(lo.end()).is_err());
    let verify: Vec<_> = touch
        .iter()
        .map(|w| VcpuWork {
            workload: Workload::Verify,
            ..w.clone()
        })
        .collect();
    let report = vm.run(&verify, STALL).unwrap();
    for (w, v) in verify.iter().zip(&report.vcpus) {
        assert_eq!(v.digest, vm.memory().digest(w.gpa, w.size).unwrap());
    }
}

/// A `dirty` run stopped mid-pass: pages before the guest's cursor hold the current pass's value,
/// pages after it the previous pass's, exactly as the guest's counters say.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn dirty_rewrites_pages_pass_after_pass_until_stopped() {
    let size = 4 * MIB;
    let mut vm = Vm::new(&VmConfig::simple(2, size, Backend::Anon)).unwrap();
    let work = VcpuWork::split(
        Workload::Dirty {
            pages_per_s: None,
            passes: None,
            fill_first: false,
        },
        layout::RAM_GPA,
        size,
        2,
        77,
    );
    let running = vm.start(&work).unwrap();
    while running
        .progress()
        .iter()
        .any(|&(_, generation)| generation < 3)
    {
        std::thread::sleep(Duration::from_millis(5));
    }
    running.stop();
    let report = running.wait(STALL).unwrap();
    for (w, v) in work.iter().zip(&report.vcpus) {
        let n = w.pages();
        assert!(v.generation >= 3);
        assert_eq!(
            v.pages / n,
            v.generation,
            "passes completed agree with pages written"
        );
        let cursor = v.pages % n;
        for p in 0..n {
            let gpa = w.gpa + p * PAGE_SIZE;
            let pass = if p < cursor {
                v.generation
            } else {
                v.generation - 1
            };
            assert_eq!(
                vm.memory().read_u64(gpa).unwrap(),
                page_value(w.seed, gpa, pass),
                "page {p}"
            );
        }
    }
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn a_throttled_dirty_run_keeps_its_rate() {
    let size = 64 * MIB;
    let mut vm = Vm::new(&VmConfig::simple(1, size, Backend::Anon)).unwrap();
    let work = VcpuWork::split(
        Workload::Dirty {
            pages_per_s: Some(2000),
            passes: None,
            fill_first: false,
        },
        layout::RAM_GPA,
        size,
        1,
        5,
    );
    let running = vm.start(&work).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    running.stop();
    let report = running.wait(STALL).unwrap();
    // The throttle is an upper bound: at 2000 pages/s the guest can have written at most ~1000
    // pages (plus the first one) in 0.5 s of wall time, far fewer than the 16384 in its range.
    let pages = report.vcpus[0].pages;
    assert!(
        (1..=1100).contains(&pages),
        "{pages} pages written at 2000 pages/s in 0.5 s"
    );
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn bad_regions_are_refused_naming_the_region() {
    let config = |regions: Vec<RegionSpec>| VmConfig {
        vcpus: 1,
        regions,
        dirty_ring_bytes: None,
    };
    let err = |regions| Vm::new(&config(regions)).expect_err("refused").to_string();
    let g = layout::RAM_GPA;

    let e = err(vec![RegionSpec::new("ram", g, 0, Backend::Anon)]);
    assert_eq!(e, "region 'ram': size is zero");
    let e = err(vec![RegionSpec::new("ram", g, 4097, Backend::Memfd)]);
    assert!(
        e.contains("region 'ram': size 0x1001") && e.contains("memfd"),
        "{e}"
    );
    let e = err(vec![RegionSpec::new("big", g, 3 * MIB, Backend::Hugetlbfs)]);
    assert!(
        e.contains("region 'big': size 0x300000") && e.contains("0x200000"),
        "{e}"
    );
    let e = err(vec![RegionSpec::new(
        "odd",
        g + 0x800,
        MIB,
        Backend::GuestMemfd,
    )]);
    assert!(e.contains("region 'odd': guest address"), "{e}");
    let e = err(vec![
        RegionSpec::new("a", g, 4 * MIB, Backend::Anon),
        RegionSpec::new("b", g + 2 * MIB, 4 * MIB, Backend::Memfd),
    ]);
    assert!(
        e.contains("region 'b'") && e.contains("overlaps region 'a'"),
        "{e}"
    );
    let e = err(vec![RegionSpec::new("low", 0, 4 * MIB, Backend::Anon)]);
    assert!(
        e.contains("region 'low'") && e.contains("overlaps region 'sys'"),
        "{e}"
    );
    let e = err(vec![
        RegionSpec::new("a", g, MIB, Backend::Anon),
        RegionSpec::new("a", g + MIB, MIB, Backend::Anon),
    ]);
    assert!(e.contains("'a' is used twice"), "{e}");
    // More huge pages than the pool has: refused up front, not a SIGBUS later.
    let e = err(vec![RegionSpec::new(
        "huge",
        g,
        64 << 30,
        Backend::MemfdHugetlb,
    )]);
    assert!(
        e.contains("region 'huge'") && e.contains("not available") && e.contains("huge pages"),
        "{e}"
    );
    let e = err(vec![RegionSpec::new("far", 600 << 30, MIB, Backend::Anon)]);
    assert!(e.contains("region 'far'"), "{e}");
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn bad_vm_requests_are_refused() {
    let e = Vm::new(&VmConfig::simple(0, MIB, Backend::Anon))
        .err()
        .unwrap();
    assert!(e.to_string().contains("0 vCPUs requested"), "{e}");
    let e = Vm::new(&VmConfig::simple(layout::MAX_VCPUS + 1, MIB, Backend::Anon))
        .err()
        .unwrap();
    assert!(matches!(e, Error::Config(_)), "{e}");

    let mut vm = Vm::new(&VmConfig::simple(1, MIB, Backend::Anon)).unwrap();
    let outside = VcpuWork {
        workload: Workload::Touch,
        gpa: layout::RAM_GPA + MIB,
        size: MIB,
        seed: 0,
    };
    let e = vm.run(&[outside], STALL).unwrap_err().to_string();
    assert!(
        e.contains("vCPU 0") && e.contains("not inside one guest RAM region"),
        "{e}"
    );
    let unaligned = VcpuWork {
        workload: Workload::Touch,
        gpa: layout::RAM_GPA + 8,
        size: PAGE_SIZE,
        seed: 0,
    };
    let e = vm.run(&[unaligned], STALL).unwrap_err().to_string();
    assert!(e.contains("not page-aligned"), "{e}");
    let e = vm.run(&[], STALL).unwrap_err().to_string();
    assert!(e.contains("0 workloads for 1 vCPUs"), "{e}");
    // The VM is still usable after refused requests.
    let ok = VcpuWork {
        workload: Workload::Touch,
        gpa: layout::RAM_GPA,
        size: MIB,
        seed: 0,
    };
    assert_eq!(vm.run(&[ok], STALL).unwrap().total_pages, MIB / PAGE_SIZE);
}

/// A guest that faults (here: its page tables are wiped) ends the run with an error naming the
/// vCPU, the exit and the RIP, instead of hanging.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn an_unexpected_exit_names_the_vcpu_exit_and_rip() {
    let mut vm = Vm::new(&VmConfig::simple(1, MIB, Backend::Anon)).unwrap();
    vm.memory().write_u64(layout::PML4_GPA, 0).unwrap();
    let work = VcpuWork::split(Workload::Touch, layout::RAM_GPA, MIB, 1, 0);
    match vm.run(&work, STALL) {
        Err(Error::UnexpectedExit { vcpu, exit, rip }) => {
            assert_eq!(vcpu, 0);
            assert_eq!(exit, "Shutdown");
            assert_eq!(rip, layout::PAYLOAD_GPA);
        }
        other => panic!("expected an unexpected-exit error, got {other:?}"),
    }
}

/// A vCPU that stops making progress is detected by the watchdog, kicked out of KVM_RUN, and
/// reported with its RIP.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn a_stalled_vcpu_is_reported_not_waited_for() {
    let mut vm = Vm::new(&VmConfig::simple(2, 2 * MIB, Backend::Anon)).unwrap();
    let mut work = VcpuWork::split(Workload::Touch, layout::RAM_GPA, 2 * MIB, 2, 0);
    // vCPU 1 may write one page a second: it stalls (for the watchdog) after its first page.
    work[1].workload = Workload::Dirty {
        pages_per_s: Some(1),
        passes: None,
        fill_first: false,
    };
    let t = std::time::Instant::now();
    match vm.run(&work, Duration::from_millis(500)) {
        Err(Error::Stalled {
            vcpu, rip, pages, ..
        }) => {
            assert_eq!(vcpu, 1);
            assert_eq!(pages, 1);
            let payload = layout::PAYLOAD_GPA..layout::PAYLOAD_GPA + layout::PAYLOAD_MAX;
            assert!(payload.contains(&rip), "RIP {rip:#x} is in the payload");
        }
        other => panic!("expected a stall error, got {other:?}"),
    }
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "the watchdog ended the run"
    );
}
