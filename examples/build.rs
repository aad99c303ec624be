// Decides, on the machine that builds the tests, whether the kernel devices they need are there.
// Tests that need them carry `#[cfg_attr(not(kvm), ignore = "...")]` (likewise `uffd`), so on a
// machine without `/dev/kvm` they are counted as ignored (skipped) by the test runner, never as
// passed, and this script says so loudly.
use std::fs::OpenOptions;

fn usable(path: &str) -> bool {
    OpenOptions::new().read(true).write(true).open(path).is_ok()
}

fn main() {
    println!("cargo::rustc-check-cfg=cfg(kvm)");
    println!("cargo::rustc-check-cfg=cfg(uffd)");
    println!("cargo::rerun-if-changed=/dev/kvm");
    println!("cargo::rerun-if-changed=/dev/userfaultfd");
    if usable("/dev/kvm") {
        println!("cargo::rustc-cfg=kvm");
    } else {
        println!("cargo::warning=/dev/kvm is missing or not usable: every KVM test will be SKIPPED (reported as ignored)");
    }
    if usable("/dev/userfaultfd") {
        println!("cargo::rustc-cfg=uffd");
    } else {
        println!("cargo::warning=/dev/userfaultfd is missing or not usable: every userfaultfd test will be SKIPPED (reported as ignored)");
    }
}
