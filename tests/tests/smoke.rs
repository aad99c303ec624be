use guestmem_memory::Backend;
use guestmem_vm::*;
use std::time::Duration;

#[test]
fn smoke() {
    let mut vm = Vm::new(&VmConfig::simple(2, 64 << 20, Backend::Anon)).unwrap();
    let work = VcpuWork::split(Workload::Touch, layout::RAM_GPA, 64 << 20, 2, 7);
    let r = vm.run(&work, Duration::from_secs(5)).unwrap();
    println!("{r:#?}");
    let work = VcpuWork::split(Workload::Verify, layout::RAM_GPA, 64 << 20, 2, 7);
    let r = vm.run(&work, Duration::from_secs(5)).unwrap();
    println!("{r:#?}");
    for (i, w) in work.iter().enumerate() {
        assert_eq!(
            r.vcpus[i].digest,
            vm.memory().digest(w.gpa, w.size).unwrap()
        );
    }
}
