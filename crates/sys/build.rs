//! Records the commit this build is of (`GUESTMEM_COMMIT`, read by `guestmem_sys::release`):
//! `$GUESTMEM_COMMIT` when set (a build from a tarball, or a packager's), else
//! `git rev-parse --short=12 HEAD` of the checkout, else "unknown" (no `.git`, no git).

use std::path::Path;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
        .filter(|s| !s.is_empty())
}

fn main() {
    println!("cargo::rerun-if-env-changed=GUESTMEM_COMMIT");
    if let Ok(commit) = std::env::var("GUESTMEM_COMMIT") {
        println!("cargo::rustc-env=GUESTMEM_COMMIT={commit}");
        return;
    }
    let commit = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".into());
    // Built again when HEAD moves (a commit, a checkout): HEAD and its log are in the
    // checkout's own git directory (a worktree's too), the branch's ref in the common one.
    let dir = git(&["rev-parse", "--absolute-git-dir"]);
    let common = git(&["rev-parse", "--path-format=absolute", "--git-common-dir"]);
    let branch = git(&["rev-parse", "--symbolic-full-name", "HEAD"]);
    let mut watch = Vec::new();
    if let Some(dir) = &dir {
        watch.push(Path::new(dir).join("HEAD"));
        watch.push(Path::new(dir).join("logs/HEAD"));
    }
    if let (Some(common), Some(branch)) = (&common, &branch) {
        watch.push(Path::new(common).join(branch));
        watch.push(Path::new(common).join("packed-refs"));
    }
    for p in watch.iter().filter(|p| p.exists()) {
        println!("cargo::rerun-if-changed={}", p.display());
    }
    println!("cargo::rustc-env=GUESTMEM_COMMIT={commit}");
}
