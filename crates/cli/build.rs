//! The CLI's own tests run the `guestmem` binary on the real /dev/kvm: the same gate as the
//! end-to-end test crate, plus `netns` for the test that migrates between two network
//! namespaces (it needs root and iproute2's `ip netns`).
mod devices {
    include!("../../tests/build.rs");
    pub(super) fn gate() {
        main();
    }
}

fn main() {
    devices::gate();
    println!("cargo::rustc-check-cfg=cfg(netns)");
    let root = std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .find(|l| l.starts_with("Uid:"))
            .and_then(|l| l.split_whitespace().nth(2))
            == Some("0")
    });
    let ip = std::process::Command::new("ip")
        .args(["netns", "list"])
        .output()
        .is_ok_and(|o| o.status.success());
    if root && ip {
        println!("cargo::rustc-cfg=netns");
    } else {
        println!(
            "cargo::warning=not root or no iproute2 (`ip netns`): the CLI migration test between \
             two network namespaces will be SKIPPED (reported as ignored)"
        );
    }
}
