//! Pausing a running VM, and moving its complete vCPU state into another VM.

mod common;

use guestmem_sys::to_usize;
use std::time::Duration;

use common::{
    assert_pages_consistent, dirty_work, resume_and_check_continuation, wait_for_generation,
};

use guestmem_memory::Backend;
use guestmem_vm::{Vm, VmConfig};

const SIZE: u64 = 4 << 20;

fn copy_memory(from: &Vm, to: &Vm) {
    for region in from.memory().regions() {
        let mut buf = vec![0u8; to_usize(region.size())];
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

/// A VMM's own vCPUs (created with kvm-ioctls, not guestmem's `Vm`): their complete state saved
/// with `VcpuState::save`, carried as JSON and put into a vCPU of another VM; the registers,
/// the special registers, the CPUID and an MSR read back from the new vCPU are the saved ones.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn a_vmm_s_own_vcpu_state_moves_into_another_vm_s_vcpu() {
    use guestmem_vm::VcpuState;
    use kvm_ioctls::Kvm;

    let kvm = Kvm::new().unwrap();
    let cpuid = kvm
        .get_supported_cpuid(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
        .unwrap();
    let vm = kvm.create_vm().unwrap();
    let vcpu = vm.create_vcpu(0).unwrap();
    vcpu.set_cpuid2(&cpuid).unwrap();
    let mut regs = vcpu.get_regs().unwrap();
    regs.rax = 0x1234_5678_9abc_def0;
    regs.r15 = 42;
    regs.rip = 0x1000;
    regs.rflags = 0x2;
    vcpu.set_regs(&regs).unwrap();
    let mut sregs = vcpu.get_sregs().unwrap();
    sregs.cs.base = 0;
    sregs.cs.selector = 0;
    vcpu.set_sregs(&sregs).unwrap();
    // IA32_SYSENTER_CS: an MSR every x86 vCPU has and keeps as written.
    let msr = kvm_bindings::Msrs::from_entries(&[kvm_bindings::kvm_msr_entry {
        index: 0x174,
        data: 0x10,
        ..Default::default()
    }])
    .unwrap();
    assert_eq!(vcpu.set_msrs(&msr).unwrap(), 1);

    let saved = VcpuState::save(&vm, &vcpu).unwrap();
    let saved: VcpuState = serde_json::from_slice(&serde_json::to_vec(&saved).unwrap()).unwrap();

    let other_vm = kvm.create_vm().unwrap();
    let other = other_vm.create_vcpu(0).unwrap();
    assert_ne!(other.get_regs().unwrap().rax, regs.rax);
    saved.restore(&other_vm, &other).unwrap();

    let got = other.get_regs().unwrap();
    assert_eq!((got.rax, got.r15, got.rip), (regs.rax, 42, 0x1000));
    let got_sregs = other.get_sregs().unwrap();
    assert_eq!((got_sregs.cr0, got_sregs.efer), (sregs.cr0, sregs.efer));
    assert_eq!(
        other
            .get_cpuid2(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
            .unwrap()
            .as_slice()
            .len(),
        saved.cpuid.len()
    );
    let mut read = kvm_bindings::Msrs::from_entries(&[kvm_bindings::kvm_msr_entry {
        index: 0x174,
        ..Default::default()
    }])
    .unwrap();
    assert_eq!(other.get_msrs(&mut read).unwrap(), 1);
    assert_eq!(read.as_slice()[0].data, 0x10);
}
