//! An example VMM booting a real Linux guest on guestmem, through the component traits: boot,
//! run (its serial console on stdout), snapshot, restore lazily, and the guest going on.
//!
//! ```text
//! cargo run --release --example linux_vmm -- BZIMAGE INITRD [CMDLINE]
//! ```
//!
//! The guest is a Linux kernel with the busybox initramfs of scripts/linux-guest-initramfs.sh
//! (its init prints `counter N UPTIME` every 100 ms). It needs ordinary KVM: on a PVM host
//! (kvm_pvm) it is refused before anything is built; run it in the kernel lab
//! (scripts/kernel-lab.sh --suite linux) or on a host with kvm_intel/kvm_amd. The recipe is
//! `examples/src/linux.rs`.

use std::path::PathBuf;

use guestmem_examples::linux::{self, Guest};
use guestmem_vm::linux::DEFAULT_CMDLINE;

fn main() {
    let mut args = std::env::args().skip(1);
    let (Some(kernel), Some(initrd)) = (args.next(), args.next()) else {
        eprintln!("usage: linux_vmm BZIMAGE INITRD [CMDLINE]");
        std::process::exit(2);
    };
    let cmdline = args.next().unwrap_or_else(|| DEFAULT_CMDLINE.to_string());
    let (kernel, initrd) = (PathBuf::from(kernel), PathBuf::from(initrd));
    let guest = Guest {
        kernel: &kernel,
        initrd: Some(&initrd),
        cmdline: &cmdline,
    };
    let scratch = std::env::temp_dir().join(format!("guestmem-linux-vmm-{}", std::process::id()));
    let outcome = std::fs::create_dir_all(&scratch)
        .map_err(Into::into)
        .and_then(|()| linux::run(&guest, &scratch));
    let _ = std::fs::remove_dir_all(&scratch);
    match outcome {
        Ok(o) => {
            println!(
                "linux_vmm: first counter line {:.2} s after the boot began; the counter was {} \
                 at the pause; restored lazily in {:.1} ms, the guest went on from {} to {}",
                o.boot_secs, o.at_pause, o.restore_ms, o.restored.0, o.restored.1
            );
        }
        Err(e) => {
            eprintln!("linux_vmm: {}", guestmem_migration::error_chain(&*e, ": "));
            std::process::exit(1);
        }
    }
}
