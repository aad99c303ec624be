//! `--progress json` as a control plane reads it: the progress streams of real migrations
//! (pre-copy, post-copy, hybrid) on both sides, each line valid against
//! docs/schemas/progress-v1.schema.json, the bytes moved never going back, the remaining bytes
//! reaching zero and the last line `completed`; or `failed`, with the error, when the
//! destination is killed mid-way.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// A directory of this test, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!(
            "guestmem-cli-progress-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let keys = dir.join("keys");
        let o = Command::new(common::guestmem_bin())
            .args(["migrate", "keys", "--out", keys.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
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

/// A child killed on drop if it still runs.
struct Killed(Option<Child>);

impl Killed {
    fn child(&mut self) -> &mut Child {
        self.0
            .as_mut()
            .expect("the child is there until waited for")
    }

    /// Its output once it ended (failing the test if it runs for two minutes).
    fn wait(mut self) -> Output {
        let deadline = Instant::now() + Duration::from_secs(120);
        while self.child().try_wait().unwrap().is_none() {
            assert!(Instant::now() < deadline, "a guestmem process hangs");
            std::thread::sleep(Duration::from_millis(20));
        }
        self.0.take().unwrap().wait_with_output().unwrap()
    }
}

impl Drop for Killed {
    fn drop(&mut self) {
        if let Some(c) = &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The progress schema, compiled.
fn schema() -> jsonschema::Validator {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/schemas/progress-v1.schema.json");
    let text = std::fs::read_to_string(&path).unwrap();
    jsonschema::validator_for(&serde_json::from_str(&text).unwrap()).unwrap()
}

/// The records of a progress file, each checked against the schema and the stream's rules:
/// numbered from 0, one operation, bytes moved never decreasing, nothing after a final record.
fn records(path: &str, operation: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let validator = schema();
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{path}: {e}: {l}")))
        .collect();
    assert!(lines.len() >= 2, "{path}:\n{text}");
    let mut bytes = 0;
    for (i, v) in lines.iter().enumerate() {
        let errors: Vec<String> = validator.iter_errors(v).map(|e| e.to_string()).collect();
        assert!(errors.is_empty(), "{path} line {i}: {errors:?}: {v}");
        guestmem_events::check_schema(v, guestmem_events::PROGRESS_SCHEMA).unwrap();
        assert_eq!(v["operation"], operation, "{v}");
        assert_eq!(v["seq"], i as u64, "{v}");
        let b = v["bytes_transferred"].as_u64().unwrap();
        assert!(b >= bytes, "bytes went back from {bytes} at line {i}: {v}");
        bytes = b;
        let status = v["status"].as_str().unwrap();
        let known = [
            "setup",
            "precopy",
            "stopped",
            "postcopy",
            "postcopy-paused",
            "completed",
            "failed",
        ];
        assert!(known.contains(&status), "{v}");
        if i + 1 < lines.len() {
            assert!(status != "completed" && status != "failed", "{path}: {v}");
        }
    }
    lines
}

fn statuses(lines: &[Value]) -> Vec<&str> {
    let mut s: Vec<&str> = lines
        .iter()
        .map(|v| v["status"].as_str().unwrap())
        .collect();
    s.dedup();
    s
}

/// The run ended well: its last record completed, nothing left to move.
fn assert_completed(lines: &[Value]) {
    let last = lines.last().unwrap();
    assert_eq!(last["status"], "completed", "{last}");
    assert_eq!(last["bytes_remaining"], 0, "{last}");
    assert_eq!(lines[0]["status"], "setup", "{}", lines[0]);
}

fn receive(dir: &TempDir, extra: &[&str]) -> Killed {
    let socket = dir.path("s.sock");
    let child = Command::new(common::guestmem_bin())
        .args(["migrate", "receive", "--listen", &format!("unix:{socket}")])
        .args(["--keys", &dir.path("keys"), "--json", "--run-for", "0.5"])
        .args(["--progress", &format!("json={}", dir.path("rx.jsonl"))])
        .args(["--progress-interval-ms", "50"])
        .args(extra)
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
    Killed(Some(child))
}

fn send_command(dir: &TempDir, mode: &str, extra: &[&str]) -> Command {
    let mut c = Command::new(common::guestmem_bin());
    c.args([
        "migrate",
        "send",
        "--to",
        &format!("unix:{}", dir.path("s.sock")),
    ])
    .args([
        "--keys",
        &dir.path("keys"),
        "--memory",
        "128M",
        "--vcpus",
        "2",
    ])
    .args(["--after", "0.3", "--json", "--mode", mode])
    .args(["--progress", &format!("json={}", dir.path("tx.jsonl"))])
    .args(["--progress-interval-ms", "20"])
    .args(extra)
    .stdin(Stdio::null());
    c
}

/// One migration in `mode`, both sides' progress streams checked; returns them.
fn migrate(mode: &str) -> (Vec<Value>, Vec<Value>) {
    let dir = TempDir::new(mode);
    let rx = receive(&dir, &[]);
    let sent = send_command(&dir, mode, &[]).output().unwrap();
    assert!(
        sent.status.success(),
        "{}",
        String::from_utf8_lossy(&sent.stderr)
    );
    let received = rx.wait();
    assert!(
        received.status.success(),
        "{}",
        String::from_utf8_lossy(&received.stderr)
    );
    let report: Value = serde_json::from_slice(&sent.stdout).unwrap();
    let tx = records(&dir.path("tx.jsonl"), "migrate-send");
    let rx = records(&dir.path("rx.jsonl"), "migrate-receive");
    assert_completed(&tx);
    assert_completed(&rx);
    let last = tx.last().unwrap();
    // The stream's totals are the report's.
    assert_eq!(
        last["bytes_transferred"], report["bytes"],
        "{last}\n{report}"
    );
    assert_eq!(last["bytes_total"], report["guest_bytes"], "{last}");
    assert!(statuses(&tx).contains(&"stopped"), "{:?}", statuses(&tx));
    (tx, rx)
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn precopy_streams_rounds_on_both_sides() {
    let (tx, rx) = migrate("precopy");
    assert_eq!(
        statuses(&tx),
        ["setup", "precopy", "stopped", "completed"],
        "{tx:?}"
    );
    // Every round ended with a record carrying its dirty rate and downtime estimate.
    let rounds = tx
        .iter()
        .filter(|v| v["status"] == "precopy" && v.get("expected_downtime_ms").is_some())
        .count();
    assert!(rounds >= 1, "{tx:?}");
    assert!(statuses(&rx).contains(&"precopy"), "{rx:?}");
    // The destination placed what the source sent.
    assert_eq!(
        rx.last().unwrap()["bytes_transferred"],
        tx.last().unwrap()["bytes_transferred"]
    );
}

#[test]
#[cfg_attr(not(all(kvm, uffd)), ignore = "needs /dev/kvm and userfaultfd")]
fn postcopy_streams_faults_and_residency() {
    let (tx, rx) = migrate("postcopy");
    assert_eq!(
        statuses(&tx),
        ["setup", "stopped", "postcopy", "completed"],
        "{tx:?}"
    );
    assert!(statuses(&rx).contains(&"postcopy"), "{rx:?}");
    let last = rx.last().unwrap();
    assert_eq!(last["resident_bytes"], last["bytes_total"], "{last}");
    assert!(last["faults"].as_u64().is_some(), "{last}");
    assert!(last["fault_latency_p99_us"].as_f64().is_some(), "{last}");
    // The source served what the destination fetched.
    assert!(tx.last().unwrap()["postcopy_requests"].as_u64().is_some());
}

#[test]
#[cfg_attr(not(all(kvm, uffd)), ignore = "needs /dev/kvm and userfaultfd")]
fn hybrid_streams_one_round_then_postcopy() {
    let (tx, rx) = migrate("hybrid");
    assert_eq!(
        statuses(&tx),
        ["setup", "precopy", "stopped", "postcopy", "completed"],
        "{tx:?}"
    );
    assert!(statuses(&rx).contains(&"postcopy"), "{rx:?}");
}

/// The destination killed during pre-copy: the source's stream ends `failed`, naming the error
/// and that the source keeps its guest.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn a_killed_destination_ends_the_stream_failed() {
    let dir = TempDir::new("killed");
    let mut rx = receive(&dir, &[]);
    let tx = send_command(
        &dir,
        "precopy",
        &["--max-bandwidth-mib-per-s", "8", "--connections", "1"],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let tx = Killed(Some(tx));
    // Kill the destination once pages are moving.
    let path = dir.path("tx.jsonl");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        let moving = text.lines().any(|l| {
            serde_json::from_str::<Value>(l)
                .is_ok_and(|v| v["bytes_transferred"].as_u64().unwrap_or(0) > 0)
        });
        if moving {
            break;
        }
        assert!(Instant::now() < deadline, "no pages moved:\n{text}");
        std::thread::sleep(Duration::from_millis(20));
    }
    rx.child().kill().unwrap();
    let sent = tx.wait();
    assert!(!sent.status.success());
    let lines = records(&path, "migrate-send");
    let last = lines.last().unwrap();
    assert_eq!(last["status"], "failed", "{last}");
    let error = last["error"].as_str().unwrap();
    assert!(error.contains("the source keeps the guest"), "{error}");
    assert!(last["bytes_transferred"].as_u64().unwrap() > 0, "{last}");
}

/// A paused snapshot, then a lazy restore of it: the snapshot's stream says setup, stopped,
/// completed with the bytes it stored; the restore's says setup, then postcopy while the
/// pagers bring the memory in (resident bytes growing, chunks fetched), then completed with
/// every byte resident.
#[test]
#[cfg_attr(not(all(kvm, uffd)), ignore = "needs /dev/kvm and userfaultfd")]
fn a_snapshot_and_its_lazy_restore_stream_their_progress() {
    let dir = TempDir::new("restore");
    let snap = dir.path("snap");
    let o = Command::new(common::guestmem_bin())
        .args([
            "snapshot", "--out", &snap, "--memory", "128M", "--vcpus", "2",
        ])
        .args(["--after", "0.3", "--json"])
        .args(["--progress", &format!("json={}", dir.path("snap.jsonl"))])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let report: Value = serde_json::from_slice(&o.stdout).unwrap();
    let s = records(&dir.path("snap.jsonl"), "snapshot");
    assert_eq!(statuses(&s), ["setup", "stopped", "completed"], "{s:?}");
    assert_completed(&s);
    assert_eq!(
        s.last().unwrap()["bytes_transferred"],
        report["data_bytes"],
        "{report}"
    );

    let o = Command::new(common::guestmem_bin())
        .args([
            "restore",
            &snap,
            "--mode",
            "lazy",
            "--run-for",
            "0.3",
            "--json",
        ])
        .args(["--progress", &format!("json={}", dir.path("restore.jsonl"))])
        .args(["--progress-interval-ms", "10"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r = records(&dir.path("restore.jsonl"), "restore");
    assert_eq!(statuses(&r), ["setup", "postcopy", "completed"], "{r:?}");
    assert_completed(&r);
    let last = r.last().unwrap();
    assert_eq!(last["resident_bytes"], last["bytes_total"], "{last}");
    assert!(last["chunks_fetched"].as_u64().unwrap() > 0, "{last}");
    // Residency grew while the guest ran.
    let resident: Vec<u64> = r
        .iter()
        .filter_map(|v| v["resident_bytes"].as_u64())
        .collect();
    assert!(resident.windows(2).all(|w| w[0] <= w[1]), "{resident:?}");
}

/// A live snapshot's records: `precopy` while it writes, with the bytes stored so far at the
/// interval (more than one such record, their bytes growing), then `completed` with the bytes
/// the report says it stored.
#[test]
fn a_live_snapshot_streams_the_bytes_it_stores() {
    let dir = TempDir::new("live");
    let snap = dir.path("snap");
    let o = Command::new(common::guestmem_bin())
        .args(["snapshot", "--live", "--out", &snap, "--memory", "512M"])
        .args(["--vcpus", "2", "--after", "0.3", "--json"])
        .args(["--progress", &format!("json={}", dir.path("live.jsonl"))])
        .args(["--progress-interval-ms", "10"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let s = records(&dir.path("live.jsonl"), "snapshot");
    assert_eq!(statuses(&s), ["setup", "precopy", "completed"], "{s:?}");
    assert_completed(&s);
    let stored: Vec<u64> = s
        .iter()
        .filter(|v| v["status"] == "precopy")
        .map(|v| v["bytes_transferred"].as_u64().unwrap())
        .collect();
    assert!(
        stored.len() >= 2 && stored.last() > stored.first(),
        "records while it writes: {stored:?}"
    );
}

/// GET /metrics over loopback TCP: the exposition's body.
fn scrape(port: u16) -> String {
    use std::io::{Read, Write};
    let mut c = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(c, "GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n").unwrap();
    let mut text = String::new();
    c.read_to_string(&mut text).unwrap();
    assert!(text.starts_with("HTTP/1.1 200 OK"), "{text}");
    text.split("\r\n\r\n").nth(1).unwrap().to_string()
}

/// The value of `series` (name and labels) in an exposition.
fn value(text: &str, series: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {series} in:\n{text}"))
}

/// A page server with `--metrics` and `--progress` serving three lazy restores: its counters
/// equal the sums of its sessions' final records, and every session's stream is valid and ends
/// completed with its memory resident.
#[test]
#[cfg_attr(not(all(kvm, uffd)), ignore = "needs /dev/kvm and userfaultfd")]
fn page_server_metrics_count_what_its_sessions_report() {
    use std::io::{BufRead, BufReader};
    let dir = TempDir::new("pageserver");
    let snap = dir.path("snap");
    let o = Command::new(common::guestmem_bin())
        .args([
            "snapshot", "--out", &snap, "--memory", "64M", "--vcpus", "2",
        ])
        .args(["--after", "0.3", "--json"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let socket = dir.path("ps.sock");
    let mut server = Killed(Some(
        Command::new(common::guestmem_bin())
            .args(["page-server", "--firecracker", &socket, "--snapshot", &snap])
            .args(["--metrics", "127.0.0.1:0"])
            .args(["--progress", &format!("json={}", dir.path("ps.jsonl"))])
            .args(["--progress-interval-ms", "20"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    ));
    let stderr = server.child().stderr.take().unwrap();
    let mut lines = BufReader::new(stderr).lines();
    let port: u16 = loop {
        let line = lines
            .next()
            .expect("page-server said no metrics port")
            .unwrap();
        if let Some(p) = line.split("port ").nth(1) {
            break p.split(' ').next().unwrap().parse().unwrap();
        }
    };
    // Nothing served yet: no runs counted.
    assert!(!scrape(port).contains("guestmem_operations_total{"));
    for _ in 0..3 {
        let o = Command::new(common::guestmem_bin())
            .args(["restore", &snap, "--mode", "lazy", "--uffd-socket", &socket])
            .args(["--run-for", "0.2", "--json"])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    // Each session ends once its peer has exited (looked at every 100 ms).
    let path = dir.path("ps.jsonl");
    let deadline = Instant::now() + Duration::from_secs(30);
    let finals = loop {
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        let finals: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .filter(|v| v["status"] == "completed" || v["status"] == "failed")
            .collect();
        if finals.len() == 3 {
            break finals;
        }
        assert!(Instant::now() < deadline, "sessions did not end:\n{text}");
        std::thread::sleep(Duration::from_millis(50));
    };
    let text = scrape(port);
    let op = "{operation=\"page-server\"}";
    let sum = |field: &str| -> f64 {
        finals
            .iter()
            .map(|v| v[field].as_u64().unwrap() as f64)
            .sum()
    };
    assert_eq!(
        value(
            &text,
            "guestmem_operations_total{operation=\"page-server\",status=\"completed\"}"
        ),
        3.0
    );
    assert_eq!(
        value(&text, &format!("guestmem_page_faults_total{op}")),
        sum("faults")
    );
    assert!(sum("faults") > 0.0, "{finals:?}");
    assert_eq!(
        value(&text, &format!("guestmem_chunks_fetched_total{op}")),
        sum("chunks_fetched")
    );
    assert_eq!(
        value(&text, &format!("guestmem_data_processed_bytes_total{op}")),
        sum("bytes_transferred")
    );
    assert_eq!(
        value(
            &text,
            &format!("guestmem_operation_duration_seconds_count{op}")
        ),
        3.0
    );
    // Every record is valid and names its session; each session's stream, told apart by
    // it, is numbered from 0 and ends completed.
    let validator = schema();
    let all = std::fs::read_to_string(&path).unwrap();
    let mut sessions: std::collections::BTreeMap<u64, Vec<Value>> = Default::default();
    for l in all.lines() {
        let v: Value = serde_json::from_str(l).unwrap();
        assert!(validator.is_valid(&v), "{v}");
        let session = v["session"]
            .as_u64()
            .unwrap_or_else(|| panic!("no session: {v}"));
        sessions.entry(session).or_default().push(v);
    }
    assert_eq!(sessions.keys().copied().collect::<Vec<_>>(), [1, 2, 3]);
    for records in sessions.values() {
        let seqs: Vec<u64> = records.iter().map(|v| v["seq"].as_u64().unwrap()).collect();
        assert_eq!(seqs, (0..records.len() as u64).collect::<Vec<_>>());
        assert_eq!(records[0]["status"], "setup", "{records:?}");
        let last = records.last().unwrap();
        assert_eq!(last["status"], "completed", "{last}");
    }
    for f in &finals {
        assert_eq!(f["status"], "completed", "{f}");
        assert_eq!(f["resident_bytes"], f["bytes_total"], "{f}");
    }
    server.child().kill().unwrap();
}
