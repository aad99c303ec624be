//! The final `--json` reports as a script reads them: a real run of each command (migrate send
//! and receive, snapshot paused and live, flat and into a store, restore of each), its report
//! carrying its `schema` field and valid against the JSON Schema file in docs/schemas/ that the
//! field names.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// A directory of this test, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!(
            "guestmem-cli-reports-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn path(&self, name: &str) -> String {
        self.0.join(name).to_str().unwrap().to_string()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn guestmem(args: &[&str]) -> Output {
    Command::new(common::guestmem_bin())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

/// The JSON report of a run that succeeded.
fn report(o: &Output) -> Value {
    assert!(
        o.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).expect("one JSON report on stdout")
}

/// Checks `report` names `schema` and is valid against its file
/// (docs/schemas/NAME-vN.schema.json for "guestmem.NAME/N"); returns it.
fn valid(report: Value, schema: &str) -> Value {
    assert_eq!(report["schema"], schema, "{report}");
    let (name, version) = schema
        .trim_start_matches("guestmem.")
        .split_once('/')
        .unwrap();
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(format!("../../docs/schemas/{name}-v{version}.schema.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    let validator = jsonschema::validator_for(&serde_json::from_str(&text).unwrap()).unwrap();
    let errors: Vec<String> = validator
        .iter_errors(&report)
        .map(|e| format!("{} at {}", e, e.instance_path()))
        .collect();
    assert!(errors.is_empty(), "{schema}: {errors:?}\n{report:#}");
    // The schema is no blank cheque: a report without one of its required fields fails it.
    let mut broken = report.clone();
    broken.as_object_mut().unwrap().remove("schema");
    assert!(
        !validator.is_valid(&broken),
        "{schema} takes a report without `schema`"
    );
    report
}

/// Migrations in `mode`: both sides' reports valid against their schemas.
fn migrate(mode: &str) {
    let dir = TempDir::new(mode);
    let keys = dir.path("keys");
    let o = guestmem(&["migrate", "keys", "--out", &keys]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let socket = dir.path("s.sock");
    let rx = Command::new(common::guestmem_bin())
        .args(["migrate", "receive", "--listen", &format!("unix:{socket}")])
        .args(["--keys", &keys, "--json", "--run-for", "0.3"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !Path::new(&socket).exists() {
        assert!(Instant::now() < deadline, "migrate receive does not listen");
        std::thread::sleep(Duration::from_millis(10));
    }
    let tx = guestmem(&[
        "migrate",
        "send",
        "--to",
        &format!("unix:{socket}"),
        "--keys",
        &keys,
        "--memory",
        "64M",
        "--vcpus",
        "2",
        "--after",
        "0.3",
        "--json",
        "--mode",
        mode,
    ]);
    let rx = rx.wait_with_output().unwrap();
    let sent = valid(report(&tx), "guestmem.migrate-send/1");
    let received = valid(report(&rx), "guestmem.migrate-receive/1");
    assert_eq!(sent["mode"], mode);
    assert_eq!(received["report"]["mode"], mode);
    assert_eq!(received["guest_continued"], true);
    assert!(sent["bytes"].as_u64().unwrap() > 0, "{sent}");
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn precopy_reports_match_their_schemas() {
    migrate("precopy");
}

#[test]
#[cfg_attr(not(all(kvm, uffd)), ignore = "needs /dev/kvm and userfaultfd")]
fn postcopy_reports_match_their_schemas() {
    migrate("postcopy");
}

/// A flat snapshot, paused and live, and its restores in every mode.
#[test]
#[cfg_attr(not(all(kvm, uffd)), ignore = "needs /dev/kvm and userfaultfd")]
fn flat_snapshot_and_restore_reports_match_their_schemas() {
    let dir = TempDir::new("flat");
    let snap = dir.path("snap");
    let vm = [
        "--memory", "64M", "--vcpus", "2", "--after", "0.3", "--json",
    ];
    let o = guestmem(&[&["snapshot", "--out", &snap][..], &vm].concat());
    let s = valid(report(&o), "guestmem.snapshot/1");
    assert!(s["data_bytes"].as_u64().unwrap() > 0, "{s}");
    let live = dir.path("live");
    let o = guestmem(&[&["snapshot", "--live", "--out", &live][..], &vm].concat());
    let l = valid(report(&o), "guestmem.snapshot-live/1");
    assert!(l["live"]["pause_ms"].as_f64().is_some(), "{l}");
    for mode in ["full", "map", "lazy"] {
        let o = guestmem(&[
            "restore",
            &snap,
            "--mode",
            mode,
            "--run-for",
            "0.2",
            "--json",
        ]);
        let r = valid(report(&o), "guestmem.restore/1");
        assert_eq!(r["mode"], mode);
        assert_eq!(r["guest_continued"], true, "{r}");
    }
}

/// Snapshots into a local chunk store, paused and live, and restores from it.
#[test]
#[cfg_attr(not(all(kvm, uffd)), ignore = "needs /dev/kvm and userfaultfd")]
fn store_snapshot_and_restore_reports_match_their_schemas() {
    let dir = TempDir::new("store");
    let store = format!("store:{}", dir.path("store"));
    let base = format!("{store}/base");
    let vm = ["--memory", "64M", "--after", "0.3", "--json"];
    let o = guestmem(&[&["snapshot", "--out", &base][..], &vm].concat());
    let s = valid(report(&o), "guestmem.snapshot-store/1");
    assert!(s["stored_bytes"].as_u64().unwrap() > 0, "{s}");
    let live = format!("{store}/live");
    let o = guestmem(&[&["snapshot", "--live", "--out", &live][..], &vm].concat());
    let l = valid(report(&o), "guestmem.snapshot-live/1");
    assert_eq!(l["report"]["snapshot"], live.as_str(), "{l}");
    for mode in ["full", "lazy"] {
        let o = guestmem(&[
            "restore",
            &base,
            "--mode",
            mode,
            "--run-for",
            "0.2",
            "--json",
        ]);
        let r = valid(report(&o), "guestmem.restore-store/1");
        assert_eq!(r["mode"], mode);
        assert!(r["fetched"]["store_gets"].as_u64().unwrap() > 0, "{r}");
    }
}
