//! `guestmem snapshot` to and `guestmem restore` from a chunk store, as a user runs them: a
//! local store and a real MinIO started by the test (credentials in the AWS environment).

mod common;
#[path = "../../../tests/tests/common/minio.rs"]
mod minio;

use std::path::PathBuf;
use std::process::{Command, Output};

use minio::Minio;

fn guestmem(args: &[&str], env: &[(&str, String)]) -> Output {
    let mut c = Command::new(common::guestmem_bin());
    c.args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("run guestmem")
}

fn json(o: &Output) -> serde_json::Value {
    assert!(
        o.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).expect("JSON output")
}

struct Tmp(PathBuf);
impl Tmp {
    fn new(name: &str) -> Tmp {
        let d = std::env::temp_dir().join(format!("guestmem-cli-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Tmp(d)
    }
}
impl Drop for Tmp {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Snapshot and diff into `store`, restore both in full and lazily (twice: the second lazy
/// restore fetches its working set first and, from a remote store, nothing from the store),
/// merge the diff, delete and collect.
fn cli_round_trip(store: &str, env: &[(&str, String)], remote: bool) {
    let base = format!("{store}/base");
    let diff = format!("{store}/diff");
    let o = guestmem(
        &[
            "snapshot", "--memory", "64M", "--after", "0.3", "--out", &base, "--diff", &diff,
            "--json",
        ],
        env,
    );
    let v = json(&o);
    assert!(v["new_chunks"].as_u64().unwrap() > 0, "{v}");
    assert!(v["diff"]["inherited_chunks"].as_u64().unwrap() > 0, "{v}");
    assert!(v["stored_bytes_ratio"].as_f64().unwrap() < 1.0, "{v}");

    for snap in [&base, &diff] {
        let v = json(&guestmem(
            &[
                "restore",
                snap,
                "--mode",
                "full",
                "--run-for",
                "0.2",
                "--json",
            ],
            env,
        ));
        assert_eq!(v["memory_digests_match"], true, "{v}");
        assert_eq!(v["guest_continued"], true, "{v}");
        assert_eq!(v["store"], if remote { "s3" } else { "local" }, "{v}");
    }
    let first = json(&guestmem(
        &[
            "restore",
            &diff,
            "--mode",
            "lazy",
            "--run-for",
            "0.2",
            "--json",
        ],
        env,
    ));
    assert_eq!(first["guest_continued"], true, "{first}");
    assert_eq!(first["working_set"]["action"], "recorded", "{first}");
    let second = json(&guestmem(
        &[
            "restore",
            &diff,
            "--mode",
            "lazy",
            "--run-for",
            "0.2",
            "--json",
        ],
        env,
    ));
    assert_eq!(second["working_set"]["action"], "fetched first", "{second}");
    if remote {
        assert_eq!(
            second["fetched"]["store_gets"], 0,
            "the host's chunk cache: {second}"
        );
        assert!(
            second["fetched"]["cache_hits"].as_u64().unwrap() > 0,
            "{second}"
        );
    }
    let e = guestmem(&["restore", &diff, "--mode", "map"], env);
    assert!(!e.status.success());
    assert!(String::from_utf8_lossy(&e.stderr).contains("--mode full or --mode lazy"));

    let merged = format!("{store}/merged");
    let o = guestmem(&["snapshot", "merge", &diff, "--out", &merged], env);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v = json(&guestmem(
        &[
            "restore",
            &merged,
            "--mode",
            "full",
            "--run-for",
            "0.2",
            "--json",
        ],
        env,
    ));
    assert_eq!(v["memory_digests_match"], true, "{v}");

    for snap in [&diff, &base] {
        let o = guestmem(&["snapshot", "delete", snap], env);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let v = json(&guestmem(
        &["snapshot", "gc", store, "--grace-s", "0", "--json"],
        env,
    ));
    assert_eq!(v["manifests"], 1, "{v}");
    let v = json(&guestmem(
        &[
            "restore",
            &merged,
            "--mode",
            "full",
            "--run-for",
            "0.2",
            "--json",
        ],
        env,
    ));
    assert_eq!(v["memory_digests_match"], true, "after gc: {v}");
    let e = guestmem(&["restore", &base, "--mode", "full"], env);
    assert!(!e.status.success());
    let err = String::from_utf8_lossy(&e.stderr);
    assert!(err.contains("no snapshot 'base'"), "{err}");
}

#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn snapshot_to_and_restore_from_a_local_store() {
    let tmp = Tmp::new("store");
    let store = format!("store:{}", tmp.0.join("store").display());
    cli_round_trip(&store, &[], false);
}

#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn snapshot_to_and_restore_from_minio() {
    let m = Minio::start("vms");
    let tmp = Tmp::new("s3");
    let mut env = m.env();
    env.push((
        "GUESTMEM_CHUNK_CACHE",
        tmp.0.join("cache").display().to_string(),
    ));
    cli_round_trip("s3://vms/fleet", &env, true);

    // Wrong credentials and no credentials are named.
    let mut bad = env.clone();
    bad.retain(|(k, _)| *k != "AWS_SECRET_ACCESS_KEY");
    let e = guestmem(&["restore", "s3://vms/fleet/merged"], &bad);
    let err = String::from_utf8_lossy(&e.stderr);
    assert!(
        !e.status.success() && err.contains("AWS_SECRET_ACCESS_KEY"),
        "{err}"
    );
    bad.push(("AWS_SECRET_ACCESS_KEY", "wrong".into()));
    let mut c = Command::new(common::guestmem_bin());
    c.args(["restore", "s3://vms/fleet/merged"])
        .env_remove("AWS_SECRET_ACCESS_KEY");
    for (k, v) in &bad {
        c.env(k, v);
    }
    let e = c.output().unwrap();
    let err = String::from_utf8_lossy(&e.stderr);
    assert!(
        !e.status.success() && err.contains("refused the credentials"),
        "{err}"
    );
}

/// A snapshot write killed half-way leaves chunks but no manifest: the restore says the
/// snapshot is not there or its write did not finish, and gc (seeing the dead writer's lease is
/// a gone process's) collects its chunks.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn a_killed_snapshot_write_leaves_no_manifest_and_gc_collects_its_chunks() {
    let tmp = Tmp::new("killed");
    let root = tmp.0.join("store");
    let url = format!("store:{}/x", root.display());
    let mut child = Command::new(common::guestmem_bin())
        .args(["snapshot", "--memory", "2G", "--after", "1", "--out", &url])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let chunks = root.join("packs");
    // Files under packs/: the packs of chunks stored, with (`temporaries`) or without the
    // temporary files of puts under way.
    let files = |temporaries: bool| {
        std::fs::read_dir(&chunks).map_or(0, |d| {
            d.flatten()
                .map(|e| {
                    std::fs::read_dir(e.path()).map_or(0, |f| {
                        f.flatten()
                            .filter(|f| {
                                temporaries || !f.file_name().to_string_lossy().contains(".tmp-")
                            })
                            .count()
                    })
                })
                .sum::<usize>()
        })
    };
    let start = std::time::Instant::now();
    while files(false) < 3 {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(60),
            "no pack written"
        );
        assert!(child.try_wait().unwrap().is_none(), "the write ended first");
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(!root.join("snapshots/x/manifest.json").exists());
    let e = guestmem(&["restore", &url], &[]);
    let err = String::from_utf8_lossy(&e.stderr);
    assert!(
        !e.status.success() && err.contains("no snapshot 'x'") && err.contains("did not finish"),
        "{err}"
    );
    let store = format!("store:{}", root.display());
    let v = json(&guestmem(
        &["snapshot", "gc", &store, "--grace-s", "0", "--json"],
        &[],
    ));
    assert!(v["removed_chunks"].as_u64().unwrap() >= 3, "{v}");
    assert_eq!(v["stale_leases"], 1, "{v}");
    // What the killed put was writing is gone too.
    assert_eq!(files(true), 0);
}

/// Two clones of one store snapshot in two processes at once (`guestmem restore --mode lazy
/// --share DIR`): both guests carry on; the shared image on tmpfs holds every page either
/// touched once, published, and exactly the snapshot's bytes (each clone's writes stay its
/// own).
#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn two_clone_processes_share_one_image_of_the_snapshot() {
    use std::os::unix::fs::FileExt;
    use std::sync::Arc;

    use guestmem_paging::{Share, SharedImage};
    use guestmem_store::local::LocalObjectStore;
    use guestmem_store::restore::StoreSnapshot;

    let tmp = Tmp::new("share-two");
    let snap = format!("store:{}/vm", tmp.0.join("store").display());
    json(&guestmem(
        &[
            "snapshot", "--memory", "64M", "--after", "0.3", "--out", &snap, "--json",
        ],
        &[],
    ));
    let share = PathBuf::from(format!(
        "/dev/shm/guestmem-cli-{}-share-two",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&share);
    let share_arg = share.display().to_string();
    let args = [
        "restore",
        &snap,
        "--mode",
        "lazy",
        "--share",
        &share_arg,
        "--run-for",
        "0.5",
        "--json",
    ];
    let clones: Vec<_> = (0..2)
        .map(|_| {
            Command::new(common::guestmem_bin())
                .args(args)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("run guestmem")
        })
        .collect();
    for clone in clones {
        let v = json(&clone.wait_with_output().expect("wait for guestmem"));
        assert_eq!(v["guest_continued"], true, "{v}");
    }

    let objects = Arc::new(LocalObjectStore::new(&tmp.0.join("store")));
    let snapshot = StoreSnapshot::open(objects, "vm", None).unwrap();
    let region = snapshot
        .manifest
        .regions
        .iter()
        .find(|r| r.spec.name == "ram")
        .unwrap()
        .spec
        .clone();
    let full = guestmem_snapshot::restore(
        &snapshot,
        &mut guestmem_contract::VmBuilder,
        guestmem_snapshot::RestoreMode::Full,
    )
    .unwrap()
    .vm;
    let mut ram = vec![0u8; guestmem_sys::to_usize(region.size)];
    full.memory().read(region.gpa, &mut ram).unwrap();
    let image = SharedImage::open(
        &Share::new(&share).of(&snapshot.manifest.checksum),
        "ram",
        region.size,
    )
    .unwrap();
    let published = image.published_bytes();
    let resident = image.resident_bytes();
    let mut file = vec![0u8; guestmem_sys::to_usize(region.size)];
    std::fs::File::open(image.path())
        .unwrap()
        .read_exact_at(&mut file, 0)
        .unwrap();
    let _ = std::fs::remove_dir_all(&share);
    assert!(published > 0);
    assert_eq!(resident, published, "each published page held once");
    assert!(
        file == ram,
        "the image holds the snapshot's bytes, not a clone's writes"
    );
}

/// A MinIO that answers nothing (frozen with SIGSTOP): `--store-timeout 3` fails a restore,
/// a snapshot and a gc within the bound and 5 s, the stall told on stderr on the way, each
/// error naming the store, the object and the wait; the flag and its default are in --help.
#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn a_frozen_store_fails_each_command_within_the_store_timeout() {
    let help = guestmem(&["restore", "--help"], &[]);
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(
        help.contains("--store-timeout <SECONDS>") && help.contains("[default: 30]"),
        "{help}"
    );
    let m = Minio::start("vms");
    let tmp = Tmp::new("s3-frozen");
    let mut env = m.env();
    env.push((
        "GUESTMEM_CHUNK_CACHE",
        tmp.0.join("cache").display().to_string(),
    ));
    let o = guestmem(
        &["snapshot", "--memory", "64M", "--out", "s3://vms/fleet/vm"],
        &env,
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    m.freeze();
    let commands: [&[&str]; 3] = [
        &["restore", "s3://vms/fleet/vm", "--mode", "lazy"],
        &["snapshot", "--memory", "64M", "--out", "s3://vms/fleet/vm2"],
        &["snapshot", "gc", "s3://vms/fleet"],
    ];
    for args in commands {
        let mut args = args.to_vec();
        args.extend(["--store-timeout", "3"]);
        let t = std::time::Instant::now();
        let o = guestmem(&args, &env);
        let waited = t.elapsed();
        let err = String::from_utf8_lossy(&o.stderr);
        eprintln!("{args:?}: {:.2} s: {err}", waited.as_secs_f64());
        assert!(!o.status.success(), "{args:?}: {err}");
        assert!(
            waited >= std::time::Duration::from_secs(3)
                && waited <= std::time::Duration::from_secs(8),
            "{args:?}: {waited:?}: {err}"
        );
        assert!(
            err.contains("s3://vms/fleet: stalled: no answer to ")
                && err.contains("guestmem: error: s3://vms/fleet: no answer to ")
                && err.contains("the store is stalled or unreachable (the store timeout is 3.0 s"),
            "{args:?}: {err}"
        );
    }
    m.thaw();
}

/// A store that stops answering during a snapshot's write, then answers again: the snapshot's
/// progress stream (`--progress json=FILE`) says `stalled` while it waits, then the status it
/// had (`stopped`) once the store answers, and ends `completed`; the snapshot restores.
#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn a_stalled_store_shows_in_the_progress_stream() {
    let m = Minio::start("vms");
    let tmp = Tmp::new("s3-stall-progress");
    let mut env = m.env();
    env.push((
        "GUESTMEM_CHUNK_CACHE",
        tmp.0.join("cache").display().to_string(),
    ));
    let progress = tmp.0.join("snap.jsonl");
    let mut c = Command::new(common::guestmem_bin());
    c.args(["snapshot", "--memory", "64M", "--after", "1", "--json"])
        .args(["--out", "s3://vms/fleet/vm", "--store-timeout", "20"])
        .arg("--progress")
        .arg(format!("json={}", progress.display()))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    for (k, v) in &env {
        c.env(k, v);
    }
    let child = c.spawn().unwrap();
    // Frozen before the write starts (the guest runs 1 s first), thawed well past the 2 s a
    // stall takes to be told.
    std::thread::sleep(std::time::Duration::from_millis(300));
    m.freeze();
    std::thread::sleep(std::time::Duration::from_millis(5500));
    m.thaw();
    let o = child.wait_with_output().unwrap();
    let report = json(&o);
    assert_eq!(report["schema"], "guestmem.snapshot-store/1");
    let text = std::fs::read_to_string(&progress).unwrap();
    let statuses: Vec<String> = text
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["status"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(
        statuses,
        ["setup", "stopped", "stalled", "stopped", "completed"],
        "{text}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let restored = guestmem(
        &["restore", "s3://vms/fleet/vm", "--mode", "full", "--json"],
        &env,
    );
    assert_eq!(json(&restored)["memory_digests_match"], true);
}
