//! Pausing a running VM, and moving its complete vCPU state into another VM.

mod common;

use std::time::Duration;

use common::{
    assert_pages_consistent, dirty_work, resume_and_check_continuation, wait_for_generation,
};

use guestmem_memory::Backend;
use guestmem_vm::{Vm, VmConfig};

const SIZE: u64 = 4 << 20;

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
    let work = dirty_work(2, SIZE);
    let running = vm.start(&work).unwrap();
    wait_for_generation(&running, 2);
    running.pause().unwrap();

    // Paused: the guest does not move.
    let paused = vm.pages_done();
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(vm.pages_done(), paused);
    assert_pages_consistent(&vm, &work, &paused);

    resume_and_check_continuation(&mut vm, &work, &paused);
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn saved_state_and_memory_continue_in_another_vm() {
    for backend in [Backend::Anon, Backend::GuestMemfd] {
        let config = VmConfig::simple(2, SIZE, backend);
        let mut source = Vm::new(&config).unwrap();
        let work = dirty_work(2, SIZE);
        let running = source.start(&work).unwrap();
        wait_for_generation(&running, 2);
        running.pause().unwrap();
        let saved = source.save_state().unwrap();
        let saved_pages = source.pages_done();

        // The state survives serialisation (it is what a snapshot or migration carries).
        let bytes = serde_json::to_vec(&saved).unwrap();
        let saved: guestmem_vm::VmState = serde_json::from_slice(&bytes).unwrap();

        let mut dest = Vm::new(&config).unwrap();
        copy_memory(&source, &dest);
        dest.restore_state(&saved).unwrap();
        resume_and_check_continuation(&mut dest, &work, &saved_pages);

        // The source is untouched by the restore and still resumable.
        assert_pages_consistent(&source, &work, &saved_pages);
        resume_and_check_continuation(&mut source, &work, &saved_pages);
    }
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn state_of_another_shape_is_refused() {
    let mut two = Vm::new(&VmConfig::simple(2, SIZE, Backend::Anon)).unwrap();
    let running = two.start(&dirty_work(2, SIZE)).unwrap();
    running.pause().unwrap();
    let saved = two.save_state().unwrap();
    let mut one = Vm::new(&VmConfig::simple(1, SIZE, Backend::Anon)).unwrap();
    let e = one.restore_state(&saved).unwrap_err().to_string();
    assert!(e.contains("2 vCPUs, this VM 1"), "{e}");
    let e = one.resume().err().unwrap().to_string();
    assert!(e.contains("nothing to resume"), "{e}");
}
