//! The commit the bench crate is built from and whether the tree had uncommitted changes, for
//! the benches' JSON envelope (`envelope::Run`): a stored figure names the code that produced it.
//! Sets `GUESTMEM_COMMIT` and `GUESTMEM_TREE_DIRTY`, and runs again whenever either may change.

fn main() {
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
