//! The example VMM's Linux guest: booted, snapshotted and restored lazily through the
//! component traits, its counter going on past the pause. That needs ordinary KVM and a
//! guest kernel and initramfs (`GUESTMEM_LINUX_KERNEL`, `GUESTMEM_LINUX_INITRD`): the kernel
//! lab's linux suite (`scripts/kernel-lab.sh --suite linux`) has them, elsewhere it is
//! ignored. Its refusals (a file that is no kernel; a PVM host, naming the lab) are checked
//! on any host.

use std::path::Path;

use guestmem_examples::linux::{self, BootStalled, Guest, LINES};

/// The lab's guest command line (as the CLI's linux tests give it): the default, init from
/// the initramfs, and `noxsave` (KVM nested in the lab's TCG mishandles the guest's XSAVE size;
/// see crates/cli/tests/linux.rs).
const CMDLINE: &str = "console=ttyS0 reboot=k panic=1 pci=off nomodule i8042.noaux i8042.nomux \
                       i8042.dumbkbd no_timer_check rdinit=/init noxsave";

/// How many times the lab test boots its guest: under nested TCG a Linux boot now and then
/// stalls before its init counts; a boot with no counter in [`BOOT_LIMIT`] is tried again,
/// and said so. What the test checks (the snapshot and restore of a guest that counted) is
/// never retried.
const BOOTS: usize = 3;
/// How long a boot may take to its first counter line in the lab.
const BOOT_LIMIT: std::time::Duration = std::time::Duration::from_secs(120);

fn scratch(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("guestmem-linux-vmm-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A bzImage header (boot protocol 2.15, 64-bit entry, loaded high) over 64 KiB of zeros:
/// what the checks read of a kernel (offsets of Documentation/arch/x86/boot.rst).
fn fake_bzimage() -> Vec<u8> {
    let mut image = vec![0u8; 1024 + (64 << 10)];
    let mut put = |at: usize, bytes: &[u8]| image[at..at + bytes.len()].copy_from_slice(bytes);
    put(0x1f1, &[1]); // setup_sects
    put(0x1f4, &4096u32.to_le_bytes()); // syssize, 16-byte units
    put(0x202, b"HdrS");
    put(0x206, &0x020fu16.to_le_bytes());
    put(0x211, &[1]); // loadflags: LOADED_HIGH
    put(0x214, &0x10_0000u32.to_le_bytes()); // code32_start
    put(0x22c, &0x7fff_ffffu32.to_le_bytes()); // initrd_addr_max
    put(0x236, &1u16.to_le_bytes()); // xloadflags: XLF_KERNEL_64
    put(0x238, &2047u32.to_le_bytes()); // cmdline_size
    put(0x260, &(4u32 << 20).to_le_bytes()); // init_size
    image
}

fn error_of(guest: &Guest<'_>, dir: &Path) -> String {
    let e = linux::run(guest, dir).expect_err("refused");
    guestmem_migration::error_chain(&*e, ": ")
}

/// A file that is no kernel is refused naming it, on any host, before anything is built.
#[test]
fn the_linux_vmm_refuses_a_file_that_is_no_kernel() {
    let dir = scratch("nokernel");
    let text = dir.join("notes.txt");
    std::fs::write(&text, [b'x'; 8192]).unwrap();
    let e = error_of(
        &Guest {
            kernel: &text,
            initrd: None,
            cmdline: CMDLINE,
        },
        &dir,
    );
    assert!(e.contains("notes.txt is not a Linux kernel"), "{e}");
    assert!(!dir.join("linux-snapshot").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// On a PVM host a kernel that would boot elsewhere is refused naming PVM and the kernel lab,
/// before anything is built (no snapshot directory). Elsewhere it would run: nothing to check.
#[test]
fn the_linux_vmm_on_a_pvm_host_is_refused_naming_the_kernel_lab() {
    if !Path::new("/sys/module/kvm_pvm").exists() {
        eprintln!("this host's KVM is not PVM: the Linux guest is not refused here");
        return;
    }
    let dir = scratch("pvm");
    let kernel = dir.join("bzImage");
    std::fs::write(&kernel, fake_bzimage()).unwrap();
    let e = error_of(
        &Guest {
            kernel: &kernel,
            initrd: None,
            cmdline: CMDLINE,
        },
        &dir,
    );
    assert!(e.contains("this host's KVM is PVM (kvm_pvm)"), "{e}");
    assert!(e.contains("scripts/kernel-lab.sh --suite linux"), "{e}");
    assert!(!dir.join("linux-snapshot").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The example's recipe on the lab's guest: it boots and counts, is snapshotted, and restored
/// lazily it goes on past its counter at the pause (no restart, no hang).
#[test]
#[ignore = "needs ordinary KVM and a guest kernel: the kernel lab's linux suite runs it"]
fn linux_vmm_boots_snapshots_and_restores_lazily_and_the_guest_goes_on() {
    let var = |name: &str| {
        std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set: run in the kernel lab"))
    };
    let (kernel, initrd) = (var("GUESTMEM_LINUX_KERNEL"), var("GUESTMEM_LINUX_INITRD"));
    let guest = Guest {
        kernel: Path::new(&kernel),
        initrd: Some(Path::new(&initrd)),
        cmdline: CMDLINE,
    };
    let mut outcome = None;
    for boot in 1..=BOOTS {
        let dir = scratch("lab");
        let o = linux::run_with(&guest, &dir, BOOT_LIMIT);
        std::fs::remove_dir_all(&dir).unwrap();
        match o {
            Err(e) if e.is::<BootStalled>() => println!(
                "boot {boot} of {BOOTS}: {e} (a stalled boot under nested TCG){}",
                if boot < BOOTS { ", booting again" } else { "" }
            ),
            o => {
                outcome = Some(o);
                break;
            }
        }
    }
    let o = outcome
        .expect("the guest did not boot to its counter in 3 tries")
        .unwrap_or_else(|e| panic!("{}", guestmem_migration::error_chain(&*e, ": ")));
    println!(
        "TCG time: first counter line {:.2} s after the boot began; lazy restore {:.1} ms",
        o.boot_secs, o.restore_ms
    );
    assert!(o.at_pause >= LINES, "{o:?}");
    assert!(
        o.restored.0 > o.at_pause,
        "the counter goes on past the pause: {o:?}"
    );
    assert!(o.restored.1 >= o.restored.0 + LINES, "{o:?}");
}
