//! The CLI's own tests run the `guestmem` binary on the real /dev/kvm: the same gate as the
//! end-to-end test crate, plus `netns` for the test that migrates between two network
//! namespaces (it needs root and iproute2's `ip netns`).
mod devices {
    include!("../../tests/build.rs");
    pub(super) fn gate() {
        main()
    }
}

fn main() {
    devices::gate();
    provenance();
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

/// The commit the binary is built from and whether the tree had uncommitted changes, for the
/// benches' JSON envelope: a stored figure names the code that produced it.
fn provenance() {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let commit = git(&["rev-parse", "HEAD"]).unwrap_or_else(|| "unknown".into());
    let dirty =
        git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    println!("cargo::rustc-env=GUESTMEM_COMMIT={commit}");
    println!("cargo::rustc-env=GUESTMEM_TREE_DIRTY={dirty}");
    // Run again when the commit or the tracked sources change (a directory is scanned whole).
    let branch = git(&["symbolic-ref", "-q", "HEAD"]);
    for path in ["HEAD", "index", "packed-refs"]
        .into_iter()
        .chain(branch.as_deref())
    {
        if let Some(p) = git(&["rev-parse", "--git-path", path]) {
            println!("cargo::rerun-if-changed={p}");
        }
    }
    for path in [
        "../../crates",
        "../../tests",
        "../../Cargo.toml",
        "../../Cargo.lock",
    ] {
        println!("cargo::rerun-if-changed={path}");
    }
}
