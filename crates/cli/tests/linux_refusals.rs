//! Bad input for a Linux guest is refused before a vCPU runs, each refusal naming what is
//! wrong, and nothing is left behind (no console file, no snapshot directory): a file that is
//! no kernel, a truncated bzImage, an initramfs larger than memory, a command line over the
//! boot protocol's limit, and `--kernel` on a PVM host (naming the kernel lab). The files are
//! checked before the host is, so every refusal but the last is the same on a PVM host and on
//! ordinary KVM (the kernel lab); the last is checked where the host is PVM.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

/// A scratch directory of its own for each test.
fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "guestmem-linux-refusals-{name}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A bzImage header (boot protocol 2.15, 64-bit entry, loaded high, command lines up to 2047
/// bytes, 4 MiB init size) over `payload` bytes of (zero) protected-mode kernel: what
/// guestmem checks of a kernel before it boots one. Offsets are the boot protocol's
/// (Documentation/arch/x86/boot.rst).
fn fake_bzimage(payload: usize) -> Vec<u8> {
    let setup_sects = 1u8;
    let mut image = vec![0u8; (usize::from(setup_sects) + 1) * 512 + payload];
    let mut put = |at: usize, bytes: &[u8]| image[at..at + bytes.len()].copy_from_slice(bytes);
    put(0x1f1, &[setup_sects]);
    put(0x1f4, &u32::try_from(payload / 16).unwrap().to_le_bytes()); // syssize
    put(0x1fe, &0xaa55u16.to_le_bytes()); // boot_flag
    put(0x202, b"HdrS");
    put(0x206, &0x020fu16.to_le_bytes()); // version 2.15
    put(0x211, &[1]); // loadflags: LOADED_HIGH
    put(0x214, &0x10_0000u32.to_le_bytes()); // code32_start
    put(0x22c, &0x7fff_ffffu32.to_le_bytes()); // initrd_addr_max
    put(0x236, &1u16.to_le_bytes()); // xloadflags: XLF_KERNEL_64
    put(0x238, &2047u32.to_le_bytes()); // cmdline_size
    put(0x260, &(4u32 << 20).to_le_bytes()); // init_size
    image
}

fn file(dir: &Path, name: &str, bytes: &[u8]) -> String {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p.to_string_lossy().into_owned()
}

/// Runs `guestmem args`, which must fail; its stderr.
fn refused(args: &[&str]) -> String {
    let out = Command::new(common::guestmem_bin())
        .args(args)
        .output()
        .expect("guestmem runs");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "guestmem {args:?} succeeded: {stderr}"
    );
    assert!(
        out.stdout.is_empty(),
        "nothing ran, so nothing was printed: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    stderr
}

/// Whether this host's KVM is PVM (as guestmem tells it: the kvm_pvm module is loaded).
fn host_is_pvm() -> bool {
    Path::new("/sys/module/kvm_pvm").exists()
}

/// A file that is no kernel (`run`, `snapshot`, `migrate send`, `demo` alike) and a
/// truncated bzImage are refused naming the file and the problem; no console file or
/// snapshot directory is made.
#[test]
fn a_file_that_is_no_kernel_and_a_truncated_bzimage_are_refused() {
    let dir = scratch("kernel");
    let text = file(&dir, "notes.txt", &[b'x'; 8192]);
    let console = dir.join("console.txt");
    let console_arg = console.to_string_lossy().into_owned();
    let e = refused(&["run", "--kernel", &text, "--console", &console_arg]);
    assert!(e.contains("notes.txt is not a Linux kernel"), "{e}");
    assert!(!console.exists(), "no console file is left behind");

    let out = dir.join("snap");
    let out_arg = out.to_string_lossy().into_owned();
    let e = refused(&["snapshot", "--kernel", &text, "--out", &out_arg]);
    assert!(e.contains("notes.txt is not a Linux kernel"), "{e}");
    let e = refused(&[
        "migrate",
        "send",
        "--kernel",
        &text,
        "--to",
        "unix:/nonexistent/guestmem.sock",
        "--keys",
        "/nonexistent",
    ]);
    assert!(e.contains("notes.txt is not a Linux kernel"), "{e}");
    let e = refused(&["demo", "--kernel", &text, "--initrd", &text]);
    assert!(e.contains("notes.txt is not a Linux kernel"), "{e}");

    let mut cut = fake_bzimage(64 << 10);
    cut.truncate(cut.len() - 100);
    let cut = file(&dir, "bzImage-cut", &cut);
    let e = refused(&["snapshot", "--kernel", &cut, "--out", &out_arg]);
    assert!(
        e.contains(
            "bzImage-cut is a truncated bzImage: its header says 66560 bytes, the file has 66460"
        ),
        "{e}"
    );
    assert!(!out.exists(), "no snapshot directory is left behind");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// An initramfs larger than the guest's memory and a command line over the boot protocol's
/// limit (the kernel's header says 2047 bytes) are refused naming sizes and limits.
#[test]
fn an_initramfs_larger_than_memory_and_a_long_command_line_are_refused() {
    let dir = scratch("sizes");
    let kernel = file(&dir, "bzImage", &fake_bzimage(64 << 10));
    let big = file(&dir, "big.cpio", &vec![1u8; 70 << 20]);
    let console = dir.join("console.txt");
    let console_arg = console.to_string_lossy().into_owned();
    let e = refused(&[
        "run",
        "--kernel",
        &kernel,
        "--initrd",
        &big,
        "--memory",
        "64M",
        "--console",
        &console_arg,
    ]);
    assert!(
        e.contains("big.cpio (70.0 MiB) does not fit in guest memory (64.0 MiB)"),
        "{e}"
    );
    assert!(!console.exists(), "no console file is left behind");

    let long = "a".repeat(2048);
    let e = refused(&[
        "run",
        "--kernel",
        &kernel,
        "--cmdline",
        &long,
        "--console",
        &console_arg,
    ]);
    assert!(
        e.contains("the kernel command line is 2048 bytes; this kernel takes at most 2047"),
        "{e}"
    );
    let out = dir.join("snap");
    let out_arg = out.to_string_lossy().into_owned();
    let e = refused(&[
        "snapshot",
        "--kernel",
        &kernel,
        "--cmdline",
        &long,
        "--out",
        &out_arg,
    ]);
    assert!(e.contains("command line is 2048 bytes"), "{e}");
    assert!(!console.exists() && !out.exists(), "nothing is left behind");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// On a PVM host, a kernel that would boot elsewhere is refused by every command that starts
/// a Linux guest (and `migrate receive --linux`, before it listens), naming PVM and the kernel
/// lab, before any console file, snapshot directory or socket exists. (On ordinary KVM this
/// kernel would run: nothing to check there.)
#[test]
fn a_linux_guest_on_a_pvm_host_is_refused_naming_the_kernel_lab() {
    if !host_is_pvm() {
        eprintln!("this host's KVM is not PVM: a Linux guest is not refused here");
        return;
    }
    let dir = scratch("pvm");
    let kernel = file(&dir, "bzImage", &fake_bzimage(64 << 10));
    let initrd = file(&dir, "init.cpio", &[7u8; 4096]);
    let console = dir.join("console.txt");
    let console_arg = console.to_string_lossy().into_owned();
    let out = dir.join("snap");
    let out_arg = out.to_string_lossy().into_owned();
    let lab = "scripts/kernel-lab.sh --suite linux";
    let sock = dir.join("receive.sock");
    let listen = format!("unix:{}", sock.display());
    let commands: [Vec<&str>; 5] = [
        vec![
            "run",
            "--kernel",
            &kernel,
            "--initrd",
            &initrd,
            "--console",
            &console_arg,
        ],
        vec![
            "snapshot",
            "--kernel",
            &kernel,
            "--console",
            &console_arg,
            "--out",
            &out_arg,
        ],
        vec![
            "migrate",
            "send",
            "--kernel",
            &kernel,
            "--to",
            "unix:/nonexistent/g.sock",
            "--keys",
            "/nonexistent",
        ],
        vec!["demo", "--kernel", &kernel, "--initrd", &initrd],
        vec![
            "migrate",
            "receive",
            "--linux",
            "--listen",
            &listen,
            "--keys",
            "/nonexistent",
            "--console",
            &console_arg,
        ],
    ];
    for args in commands {
        let e = refused(&args);
        assert!(
            e.contains("this host's KVM is PVM (kvm_pvm)"),
            "{args:?}: {e}"
        );
        assert!(e.contains(lab), "{args:?}: {e}");
        assert!(
            !console.exists() && !out.exists() && !sock.exists(),
            "{args:?} left something behind"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
