//! Dirty-page tracking on the real /dev/kvm: every page the guest or the VMM writes is reported,
//! in every mode, with 1 and 2 vCPUs, and a tiny dirty ring still yields the complete set.

use guestmem_sys::to_usize;
use std::collections::HashSet;
use std::time::Duration;

use guestmem_memory::{Backend, PAGE_SIZE};
use guestmem_tracking::{ring_bytes, DirtyBitmap, Error, Mode, Tracker};
use guestmem_vm::payload::random_writes;
use guestmem_vm::*;

const RAM: u64 = 64 << 20;
/// The guest writes into the first 48 MiB; each vCPU logs its writes in its own 4 MiB after it.
const WRITE_SPAN: u64 = 48 << 20;
const WRITES: u64 = 30_000;
const CHUNK_PAGES: u64 = 4096;
/// Harvest periods: often (harvests overlap the guest's writes), and seldom enough that a tiny
/// ring fills between harvests even on a loaded machine.
const FAST: Duration = Duration::from_millis(2);
const SLOW: Duration = Duration::from_millis(100);

fn vm(mode: Mode, vcpus: usize, ring_entries: u32) -> Vm {
    let mut config = VmConfig::simple(vcpus, RAM, Backend::Anon);
    if mode == Mode::Ring {
        config.dirty_ring_bytes = Some(ring_bytes(ring_entries));
    }
    Vm::new(&config).unwrap()
}

/// Clears each chunk, then "consumes" it: records its dirty pages in `reported`.
fn consume(tracker: &mut Tracker, dirty: Vec<DirtyBitmap>, reported: &mut HashSet<u64>) {
    for b in dirty {
        for first in (0..b.pages).step_by(to_usize(CHUNK_PAGES)) {
            tracker
                .clear(&b, first, CHUNK_PAGES.min(b.pages - first))
                .unwrap();
        }
        for (gpa, len) in b.ranges() {
            reported.extend((gpa..gpa + len).step_by(to_usize(PAGE_SIZE)));
        }
    }
}

/// The guest writes pages on a pseudo-random schedule (logging each in guest memory) while the
/// VMM writes pages too and the host harvests and consumes every `period`; after the final harvest
/// every written page must have been reported.
fn no_page_missed(mode: Mode, vcpus: usize, ring_entries: u32, period: Duration) -> u64 {
    let mut vm = vm(mode, vcpus, ring_entries);
    let mut tracker = Tracker::start(&vm, mode).unwrap();
    assert_eq!(tracker.mode(), mode);
    let mut reported = HashSet::new();
    // Manual mode starts with every page dirty: consume that first pass, it proves nothing.
    let first = tracker.harvest().unwrap();
    consume(&mut tracker, first, &mut reported);
    reported.clear();

    let work: Vec<VcpuWork> =
        VcpuWork::split(Workload::Touch, layout::RAM_GPA, WRITE_SPAN, vcpus, 11)
            .into_iter()
            .enumerate()
            .map(|(i, w)| VcpuWork {
                workload: Workload::Random {
                    writes: WRITES,
                    log_gpa: layout::RAM_GPA + WRITE_SPAN + i as u64 * (4 << 20),
                },
                ..w
            })
            .collect();
    let memory = vm.memory().clone();
    let mut vmm_pages = Vec::new();
    let running = vm.start(&work).unwrap();
    loop {
        // A VMM write (e.g. device emulation) next to the u64 the guest writes in a page.
        let page = layout::RAM_GPA
            + (vmm_pages.len() as u64 * 7919 % (WRITE_SPAN / PAGE_SIZE)) * PAGE_SIZE;
        memory.write(page + 100, b"vmm").unwrap();
        vmm_pages.push(page);
        let dirty = tracker.harvest().unwrap();
        consume(&mut tracker, dirty, &mut reported);
        if running.progress().iter().all(|&(done, _)| done >= WRITES) {
            break;
        }
        std::thread::sleep(period);
    }
    running.wait(Duration::from_secs(10)).unwrap();
    let dirty = tracker.harvest().unwrap();
    consume(&mut tracker, dirty, &mut reported);

    let mut guest_pages = 0;
    for w in &work {
        let Workload::Random { writes, log_gpa } = w.workload else {
            unreachable!()
        };
        let schedule = random_writes(w.seed, w.gpa, w.pages(), writes);
        let mut last = std::collections::HashMap::new();
        for (n, &(gpa, value)) in schedule.iter().enumerate() {
            let logged = memory.read_u64(log_gpa + 8 * n as u64).unwrap();
            assert_eq!(logged, gpa, "write {n} of the schedule went elsewhere");
            assert!(
                reported.contains(&gpa),
                "{mode}: page {gpa:#x} written by the guest was never reported"
            );
            last.insert(gpa, value);
        }
        for (&gpa, &value) in &last {
            assert_eq!(
                memory.read_u64(gpa).unwrap(),
                value,
                "page {gpa:#x} holds the wrong value"
            );
        }
        guest_pages += last.len() as u64;
        for log_page in (log_gpa..log_gpa + writes * 8).step_by(to_usize(PAGE_SIZE)) {
            assert!(
                reported.contains(&log_page),
                "{mode}: log page {log_page:#x} never reported"
            );
        }
    }
    for page in vmm_pages {
        assert!(
            reported.contains(&page),
            "{mode}: page {page:#x} written by the VMM was never reported"
        );
    }
    assert!(
        guest_pages > 1000,
        "the schedule should touch many pages, touched {guest_pages}"
    );
    tracker.stop().unwrap();
    vm.dirty_ring_full_exits()
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn ring_reports_every_page_1_vcpu() {
    no_page_missed(Mode::Ring, 1, guestmem_tracking::DEFAULT_RING_ENTRIES, FAST);
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn ring_reports_every_page_2_vcpus() {
    no_page_missed(Mode::Ring, 2, guestmem_tracking::DEFAULT_RING_ENTRIES, FAST);
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn manual_reports_every_page_1_vcpu() {
    no_page_missed(Mode::Manual, 1, 0, FAST);
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn manual_reports_every_page_2_vcpus() {
    no_page_missed(Mode::Manual, 2, 0, FAST);
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn bitmap_reports_every_page_1_vcpu() {
    no_page_missed(Mode::Bitmap, 1, 0, FAST);
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn bitmap_reports_every_page_2_vcpus() {
    no_page_missed(Mode::Bitmap, 2, 0, FAST);
}

/// A ring far smaller than the dirty set fills again and again; the vCPUs wait and the set is
/// still complete.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn tiny_ring_fills_and_loses_nothing() {
    let full_exits = no_page_missed(Mode::Ring, 2, TINY_RING_ENTRIES, SLOW);
    assert!(
        full_exits > 0,
        "the tiny ring never filled, so the test proved nothing"
    );
}

/// The smallest ring KVM accepts here (4 KiB is below its reserve of entries).
const TINY_RING_ENTRIES: u32 = 1024;

/// With the guest idle, each VMM write is reported exactly once, and nothing else.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn each_write_reported_once() {
    for mode in Mode::ALL {
        let vm = vm(mode, 1, 4096);
        let mut tracker = Tracker::start(&vm, mode).unwrap();
        let mut reported = HashSet::new();
        let first = tracker.harvest().unwrap();
        consume(&mut tracker, first, &mut reported);
        let pages = [0, 1, 77, 4095, 16383].map(|p| layout::RAM_GPA + p * PAGE_SIZE);
        for gpa in pages {
            vm.memory().write_u64(gpa, 1).unwrap();
        }
        let dirty = tracker.harvest().unwrap();
        let mut got = HashSet::new();
        consume(&mut tracker, dirty, &mut got);
        assert_eq!(got, HashSet::from(pages), "{mode}");
        assert!(
            tracker.harvest().unwrap().is_empty(),
            "{mode}: reported twice"
        );
        tracker.stop().unwrap();
    }
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn bad_inputs_are_named() {
    let plain = vm(Mode::Bitmap, 1, 0);
    let e = Tracker::start(&plain, Mode::Ring).err().unwrap();
    assert!(
        e.to_string().contains("'ring'") && e.to_string().contains("without dirty rings"),
        "{e}"
    );
    let ringed = vm(Mode::Ring, 1, 4096);
    let e = Tracker::start(&ringed, Mode::Manual).err().unwrap();
    assert!(
        e.to_string().contains("'manual'") && e.to_string().contains("KVM_GET_DIRTY_LOG"),
        "{e}"
    );

    let mut tracker = Tracker::start(&plain, Mode::Bitmap).unwrap();
    plain.memory().write_u64(layout::RAM_GPA, 1).unwrap();
    let dirty = tracker.harvest().unwrap();
    let ram = dirty.iter().find(|b| b.gpa == layout::RAM_GPA).unwrap();
    let e = tracker.clear(ram, 10, 64).unwrap_err();
    assert!(matches!(e, Error::BadChunk { first_page: 10, .. }), "{e}");
    assert!(e.to_string().contains("memslot 1"), "{e}");
    let e = tracker.clear(ram, 0, ram.pages + 1).unwrap_err();
    assert!(e.to_string().contains("16384 pages"), "{e}");

    let e = "dirtyring".parse::<Mode>().unwrap_err();
    assert!(e.to_string().contains("\"dirtyring\""), "{e}");

    let e = plain.memory().set_slot_flags(plain.fd(), 9, 0).unwrap_err();
    assert!(e.to_string().contains("memslot 9"), "{e}");

    let mut config = VmConfig::simple(1, RAM, Backend::Anon);
    config.dirty_ring_bytes = Some(1000);
    let e = Vm::new(&config).err().unwrap();
    assert!(e.to_string().contains("1000 bytes"), "{e}");
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn bad_workloads_are_named() {
    let mut vm = vm(Mode::Bitmap, 1, 0);
    let overlap = VcpuWork {
        workload: Workload::Random {
            writes: 10,
            log_gpa: layout::RAM_GPA,
        },
        gpa: layout::RAM_GPA,
        size: 1 << 20,
        seed: 1,
    };
    let e = vm.start(&[overlap]).err().unwrap();
    assert!(e.to_string().contains("vCPU 0: random workload log"), "{e}");
    let mixed = VcpuWork {
        workload: Workload::Mixed {
            write_percent: 101,
            passes: Some(1),
        },
        gpa: layout::RAM_GPA,
        size: 1 << 20,
        seed: 1,
    };
    let e = vm.start(&[mixed]).err().unwrap();
    assert!(e.to_string().contains("write percentage 101"), "{e}");
}

/// The `mixed` workload writes exactly the pages payload.S's draw picks, and reads the others.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn mixed_writes_its_share_of_pages() {
    let mut vm = vm(Mode::Bitmap, 1, 0);
    let work = VcpuWork::split(
        Workload::Mixed {
            write_percent: 30,
            passes: Some(1),
        },
        layout::RAM_GPA,
        RAM,
        1,
        5,
    );
    vm.run(&work, Duration::from_secs(10)).unwrap();
    let mut written = 0;
    for page in 0..RAM / PAGE_SIZE {
        let gpa = layout::RAM_GPA + page * PAGE_SIZE;
        let draw = (((gpa >> 12).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32) * 100) >> 32;
        let expect = if draw < 70 {
            0
        } else {
            payload::page_value(5, gpa, 0)
        };
        assert_eq!(vm.memory().read_u64(gpa).unwrap(), expect, "page {gpa:#x}");
        written += u64::from(draw >= 70);
    }
    let share = written as f64 / (RAM / PAGE_SIZE) as f64;
    assert!((0.25..0.35).contains(&share), "{share}");
}

/// The automatic choice is a mode this kernel can actually run.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn best_mode_starts() {
    let mode = Mode::best().unwrap();
    let vm = vm(mode, 1, 4096);
    let mut tracker = Tracker::start(&vm, mode).unwrap();
    vm.memory().write_u64(layout::RAM_GPA, 1).unwrap();
    let dirty = tracker.harvest().unwrap();
    assert!(dirty.iter().any(|b| b.contains(layout::RAM_GPA)), "{mode}");
    tracker.stop().unwrap();
}

/// A second tracker on the same VM (after `stop`) picks up where the rings are now, in every mode.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn tracker_restarts_on_the_same_vm() {
    for mode in Mode::ALL {
        let mut vm = vm(mode, 1, 4096);
        for round in 0..3 {
            let mut tracker = Tracker::start(&vm, mode).unwrap();
            let mut reported = HashSet::new();
            let first = tracker.harvest().unwrap();
            consume(&mut tracker, first, &mut reported);
            reported.clear();
            let gpa = layout::RAM_GPA + round * (1 << 20);
            let work = VcpuWork::split(Workload::Touch, gpa, 1 << 20, 1, round);
            vm.run(&work, Duration::from_secs(10)).unwrap();
            let dirty = tracker.harvest().unwrap();
            consume(&mut tracker, dirty, &mut reported);
            for page in (gpa..gpa + (1 << 20)).step_by(to_usize(PAGE_SIZE)) {
                assert!(
                    reported.contains(&page),
                    "{mode}, round {round}: {page:#x} missed"
                );
            }
            tracker.stop().unwrap();
        }
    }
}
