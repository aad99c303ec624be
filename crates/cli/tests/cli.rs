//! The `guestmem` command as a user runs it.

use std::process::{Command, Output};

fn guestmem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_guestmem"))
        .args(args)
        .output()
        .expect("run guestmem")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}
fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn run_gmem_touch_prints_rates() {
    let o = guestmem(&[
        "run",
        "--memory",
        "1G",
        "--vcpus",
        "2",
        "--backend",
        "gmem",
        "--workload",
        "touch",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("1024 MiB on gmem, 2 vCPUs, workload touch"),
        "{out}"
    );
    assert!(
        out.contains("pages/s") && out.contains("wall time"),
        "{out}"
    );
    let total = out
        .lines()
        .find(|l| l.starts_with("total"))
        .expect("total line");
    assert_eq!(total.split_whitespace().nth(1), Some("262144"), "{out}");
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn run_verify_json_reports_matching_digests() {
    let o = guestmem(&[
        "run",
        "--memory",
        "64M",
        "--vcpus",
        "2",
        "--backend",
        "memfd",
        "--workload",
        "verify",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["digests_match_host"], true);
    assert_eq!(v["total_pages"], 16384);
    assert!(v["total_pages_per_s"].as_f64().unwrap() > 0.0);
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn probe_json_reports_this_kernels_guest_memory_features() {
    let o = guestmem(&["probe", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let kvm = &v["kvm"]["Ok"];
    assert_eq!(
        kvm["guest_memfd_flags"]["Ok"]["names"],
        serde_json::json!(["MMAP", "INIT_SHARED"])
    );
    assert_eq!(v["guest_memfd_write"]["Ok"]["present"], false);
    assert_eq!(v["kvm_userfault"]["Ok"]["present"], false);
    assert!(kvm["dirty_log_ring_max_bytes"]["Ok"].as_u64().unwrap() > 0);
    assert!(
        kvm["manual_dirty_log_protect2"]["Ok"]["raw"]
            .as_u64()
            .unwrap()
            & 3
            == 3
    );
}

#[test]
fn bad_arguments_are_named() {
    let o = guestmem(&["run", "--backend", "floppy"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("unknown backend 'floppy'"),
        "{}",
        stderr(&o)
    );
    let o = guestmem(&["run", "--memory", "12X"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("'12X' is not a size"), "{}", stderr(&o));
    // Durations too long for a clock are refused, not a panic.
    for (flag, value) in [
        ("--duration", "1e300"),
        ("--stall-timeout", "inf"),
        ("--duration", "0"),
    ] {
        let o = guestmem(&["run", "--memory", "64M", flag, value]);
        assert_eq!(o.status.code(), Some(1), "{flag} {value}: {}", stderr(&o));
        assert!(
            stderr(&o).contains(&format!("{flag} must be a positive number of seconds")),
            "{}",
            stderr(&o)
        );
        assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
    }
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn bad_vm_sizes_are_named() {
    let o = guestmem(&["run", "--memory", "0"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("region 'ram': size is zero"),
        "{}",
        stderr(&o)
    );
    let o = guestmem(&["run", "--memory", "3M", "--backend", "hugetlb"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("not a multiple of the hugetlb backend's page size"),
        "{}",
        stderr(&o)
    );
    let o = guestmem(&["run", "--vcpus", "0"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("--vcpus must be at least 1"),
        "{}",
        stderr(&o)
    );
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn snapshot_then_restore_continues_the_guest() {
    let dir = std::env::temp_dir().join(format!("guestmem-cli-snap-{}", std::process::id()));
    let d = dir.to_str().unwrap();
    let o = guestmem(&[
        "snapshot",
        "--out",
        d,
        "--memory",
        "64M",
        "--backend",
        "memfd",
        "--after",
        "0.3",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("snapshot of a 64 MiB memfd VM"),
        "{}",
        stdout(&o)
    );
    for mode in ["full", "map", "lazy"] {
        let o = guestmem(&["restore", d, "--mode", mode, "--run-for", "0.2", "--json"]);
        assert!(o.status.success(), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
        if mode == "lazy" {
            // Checked chunk by chunk as paged in; all of it arrived.
            assert!(v["resident_ms"].as_f64().unwrap() > 0.0, "{v}");
        } else {
            assert_eq!(v["memory_digests_match"], true);
        }
        assert_eq!(v["guest_continued"], true);
    }
    // A manifest edited by hand (a data chunk marked zero): refused before the guest runs.
    let manifest = dir.join("manifest.json");
    let text = std::fs::read_to_string(&manifest).unwrap();
    let edited = text.replacen("\"zero\": false", "\"zero\": true", 1);
    assert_ne!(edited, text);
    std::fs::write(&manifest, edited).unwrap();
    for mode in ["full", "map", "lazy"] {
        let o = guestmem(&["restore", d, "--mode", mode]);
        assert_eq!(o.status.code(), Some(1), "{mode}: {}", stdout(&o));
        assert!(
            stderr(&o).contains("manifest.json") && stderr(&o).contains("checksum"),
            "{}",
            stderr(&o)
        );
        assert!(
            !stdout(&o).contains("guest pages written"),
            "{}",
            stdout(&o)
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    let o = guestmem(&["restore", d]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("manifest.json: read failed"),
        "{}",
        stderr(&o)
    );
}

/// `snapshot --diff` writes a base and a diff of the same running VM; the diff restores in full
/// (memory digests as saved) and lazily (pages from the diff, else the base). A lazy restore
/// records the working set; the next one fetches it first.
#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn diff_snapshot_restores_in_full_and_lazily_and_the_working_set_is_reused() {
    let root = std::env::temp_dir().join(format!("guestmem-cli-diff-{}", std::process::id()));
    let (base, diff) = (root.join("base"), root.join("diff"));
    let (b, d) = (base.to_str().unwrap(), diff.to_str().unwrap());
    let o = guestmem(&[
        "snapshot",
        "--out",
        b,
        "--diff",
        d,
        "--memory",
        "64M",
        "--after",
        "0.3",
        "--diff-after",
        "0.05",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let stored = v["diff"]["stored_chunks"].as_u64().unwrap();
    assert!(
        stored > 0 && stored < v["diff"]["chunks"].as_u64().unwrap(),
        "{v}"
    );
    let o = guestmem(&["restore", d, "--mode", "full", "--run-for", "0.2", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["memory_digests_match"], true, "{v}");
    assert_eq!(v["guest_continued"], true, "{v}");
    for action in ["recorded", "fetched first"] {
        let o = guestmem(&["restore", d, "--mode", "lazy", "--run-for", "0.2", "--json"]);
        assert!(o.status.success(), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
        assert_eq!(v["guest_continued"], true, "{v}");
        assert_eq!(v["working_set"]["action"], action, "{v}");
    }
    assert!(diff.join("working-set.json").exists());
    let o = guestmem(&["snapshot", "--out", b, "--diff", b]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--diff must name another directory"));
    let _ = std::fs::remove_dir_all(&root);
}
