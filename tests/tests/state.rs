//! Pausing a running VM, and moving its complete vCPU state into another VM.

use std::time::Duration;

use guestmem_memory::{Backend, PAGE_SIZE};
use guestmem_vm::payload::{page_value, CTL_PAGES_DONE};
use guestmem_vm::{layout, RunningVm, VcpuWork, Vm, VmConfig, Workload};

const STALL: Duration = Duration::from_secs(30);
const SIZE: u64 = 4 << 20;

fn dirty_work(vcpus: usize) -> Vec<VcpuWork> {
    VcpuWork::split(
        Workload::Dirty {
            pages_per_s: None,
            passes: None,
        },
        layout::RAM_GPA,
        SIZE,
        vcpus,
        9,
    )
}

fn wait_for_generation(running: &RunningVm<'_>, generation: u64) {
    while running.progress().iter().any(|&(_, g)| g < generation) {
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Every page holds the value of the pass the guest's own counters say it is in. The page at the
/// cursor may hold either value: the guest counts a page just after writing it, and a pause can
/// fall between the two.
fn assert_pages_consistent(vm: &Vm, work: &[VcpuWork], pages_done: &[u64]) {
    for (w, &done) in work.iter().zip(pages_done) {
        let n = w.pages();
        let (generation, cursor) = (done / n, done % n);
        for p in 0..n {
            let gpa = w.gpa + p * PAGE_SIZE;
            let value = vm.memory().read_u64(gpa).unwrap();
            let new = page_value(w.seed, gpa, generation);
            let old = page_value(w.seed, gpa, generation - 1);
            match p.cmp(&cursor) {
                std::cmp::Ordering::Less => assert_eq!(value, new, "page {gpa:#x}"),
                std::cmp::Ordering::Equal => assert!(value == new || value == old, "page {gpa:#x}"),
                std::cmp::Ordering::Greater => assert_eq!(value, old, "page {gpa:#x}"),
            }
        }
    }
}

fn copy_memory(from: &Vm, to: &Vm) {
    for region in from.memory().regions() {
        let mut buf = vec![0u8; region.size() as usize];
        from.memory().read(region.gpa(), &mut buf).unwrap();
        to.memory().write(region.gpa(), &buf).unwrap();
    }
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn a_paused_vm_resumes_where_it_stopped() {
    let mut vm = Vm::new(&VmConfig::simple(2, SIZE, Backend::Memfd)).unwrap();
    let work = dirty_work(2);
    let running = vm.start(&work).unwrap();
    wait_for_generation(&running, 2);
    running.pause().unwrap();

    // Paused: the guest does not move.
    let paused: Vec<u64> = (0..2)
        .map(|i| {
            vm.memory()
                .read_u64(layout::control_gpa(i) + CTL_PAGES_DONE)
                .unwrap()
        })
        .collect();
    std::thread::sleep(Duration::from_millis(50));
    let still: Vec<u64> = (0..2)
        .map(|i| {
            vm.memory()
                .read_u64(layout::control_gpa(i) + CTL_PAGES_DONE)
                .unwrap()
        })
        .collect();
    assert_eq!(paused, still);
    assert_pages_consistent(&vm, &work, &paused);

    let running = vm.resume().unwrap();
    let target = paused
        .iter()
        .map(|p| p / work[0].pages() + 2)
        .max()
        .unwrap();
    wait_for_generation(&running, target);
    running.stop();
    let report = running.wait(STALL).unwrap();
    let done: Vec<u64> = report.vcpus.iter().map(|v| v.pages).collect();
    for (before, after) in paused.iter().zip(&done) {
        assert!(
            after > before,
            "the guest went on counting: {before} -> {after}"
        );
    }
    assert_pages_consistent(&vm, &work, &done);
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn saved_state_and_memory_continue_in_another_vm() {
    for backend in [Backend::Anon, Backend::GuestMemfd] {
        let config = VmConfig::simple(2, SIZE, backend);
        let mut source = Vm::new(&config).unwrap();
        let work = dirty_work(2);
        let running = source.start(&work).unwrap();
        wait_for_generation(&running, 2);
        running.pause().unwrap();
        let saved = source.save_state().unwrap();
        let saved_pages: Vec<u64> = (0..2)
            .map(|i| {
                source
                    .memory()
                    .read_u64(layout::control_gpa(i) + CTL_PAGES_DONE)
                    .unwrap()
            })
            .collect();

        // The state survives serialisation (it is what a snapshot or migration carries).
        let bytes = serde_json::to_vec(&saved).unwrap();
        let saved: guestmem_vm::VmState = serde_json::from_slice(&bytes).unwrap();

        let mut dest = Vm::new(&config).unwrap();
        copy_memory(&source, &dest);
        dest.restore_state(&saved).unwrap();
        let running = dest.resume().unwrap();
        let target = saved_pages
            .iter()
            .map(|p| p / work[0].pages() + 2)
            .max()
            .unwrap();
        wait_for_generation(&running, target);
        running.stop();
        let report = running.wait(STALL).unwrap();
        for (v, before) in report.vcpus.iter().zip(&saved_pages) {
            assert!(
                v.pages > *before,
                "{backend}: vCPU {} continued counting from {before}",
                v.vcpu
            );
            assert!(v.generation >= target);
        }
        let done: Vec<u64> = report.vcpus.iter().map(|v| v.pages).collect();
        assert_pages_consistent(&dest, &work, &done);
        // The source is untouched by the restore and still resumable.
        assert_pages_consistent(&source, &work, &saved_pages);
        let running = source.resume().unwrap();
        running.stop();
        running.wait(STALL).unwrap();
    }
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn state_of_another_shape_is_refused() {
    let mut two = Vm::new(&VmConfig::simple(2, SIZE, Backend::Anon)).unwrap();
    let running = two.start(&dirty_work(2)).unwrap();
    running.pause().unwrap();
    let saved = two.save_state().unwrap();
    let mut one = Vm::new(&VmConfig::simple(1, SIZE, Backend::Anon)).unwrap();
    let e = one.restore_state(&saved).unwrap_err().to_string();
    assert!(e.contains("2 vCPUs, this VM 1"), "{e}");
    let e = one.resume().err().unwrap().to_string();
    assert!(e.contains("nothing to resume"), "{e}");
}
