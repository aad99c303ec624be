//! `guestmem migrate` and `guestmem demo` as a user runs them: two guestmem processes, the
//! destination's JSON and the source's, and what each prints when things go wrong.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::guestmem_bin;
use serde_json::Value;

/// A directory of this test process, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!(
            "guestmem-cli-migrate-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn path(&self, name: &str) -> String {
        self.0.join(name).to_str().unwrap().to_string()
    }

    /// A fresh migration CA and both sides' certificates in `name`.
    fn keys(&self, name: &str) -> String {
        let dir = self.path(name);
        let o = Command::new(guestmem_bin())
            .args(["migrate", "keys", "--out", &dir])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        dir
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Output a child wrote so far, and whether it has closed the stream.
#[derive(Default)]
struct Captured {
    text: Mutex<(String, bool)>,
    grew: Condvar,
}

impl Captured {
    fn drain(stream: impl Read + Send + 'static) -> (Arc<Captured>, JoinHandle<()>) {
        let captured = Arc::new(Captured::default());
        let c = captured.clone();
        let thread = std::thread::spawn(move || {
            let mut reader = BufReader::new(stream);
            loop {
                let mut line = String::new();
                let n = reader.read_line(&mut line).unwrap_or(0);
                let mut text = c.text.lock().unwrap();
                text.0 += &line;
                text.1 = n == 0;
                c.grew.notify_all();
                if n == 0 {
                    return;
                }
            }
        });
        (captured, thread)
    }

    /// Waits until the text contains `what`; returns the text.
    fn wait_for(&self, what: &str, timeout: Duration, who: &str) -> String {
        let deadline = Instant::now() + timeout;
        let mut text = self.text.lock().unwrap();
        loop {
            if text.0.contains(what) {
                return text.0.clone();
            }
            let now = Instant::now();
            assert!(
                !text.1 && now < deadline,
                "{who} did not print {what:?} (within {timeout:?}); it printed:\n{}",
                text.0
            );
            text = self.grew.wait_timeout(text, deadline - now).unwrap().0;
        }
    }

    fn text(&self) -> String {
        self.text.lock().unwrap().0.clone()
    }
}

/// A running guestmem process, killed on drop if it still runs.
struct Proc {
    name: String,
    child: Child,
    stdout: Arc<Captured>,
    stderr: Arc<Captured>,
    readers: Vec<JoinHandle<()>>,
}

/// How a process ended.
struct Ended {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

impl Ended {
    fn json(&self, who: &str) -> Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| {
            panic!(
                "{who} printed no JSON ({e}):\n{}\nstderr:\n{}",
                self.stdout, self.stderr
            )
        })
    }

    /// Asserts success; returns the JSON it printed.
    fn ok_json(&self, who: &str) -> Value {
        assert!(
            self.status.success(),
            "{who} failed ({}):\n{}",
            self.status,
            self.stderr
        );
        self.json(who)
    }
}

impl Proc {
    /// `guestmem ARGS`, or `PREFIX... guestmem ARGS` (e.g. `ip netns exec NS`).
    fn spawn(name: &str, prefix: &[&str], args: &[&str]) -> Proc {
        let mut cmd = match prefix.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(guestmem_bin());
                c
            }
            None => Command::new(guestmem_bin()),
        };
        let mut child = cmd
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        let (stdout, t1) = Captured::drain(child.stdout.take().unwrap());
        let (stderr, t2) = Captured::drain(child.stderr.take().unwrap());
        Proc {
            name: name.to_string(),
            child,
            stdout,
            stderr,
            readers: vec![t1, t2],
        }
    }

    /// `guestmem migrate receive --listen unix:SOCKET --keys KEYS --json EXTRA...`, once the
    /// socket is there.
    fn receive_on(name: &str, socket: &str, keys: &str, extra: &[&str]) -> Proc {
        let to = format!("unix:{socket}");
        let mut args = vec![
            "migrate", "receive", "--listen", &to, "--keys", keys, "--json",
        ];
        args.extend_from_slice(extra);
        let mut receive = Proc::spawn(name, &[], &args);
        receive.listening_on(socket);
        receive
    }

    /// Waits for a Unix socket to appear while the process runs.
    fn listening_on(&mut self, socket: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !Path::new(socket).exists() {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("{} ended ({status}): {}", self.name, self.stderr.text());
            }
            assert!(Instant::now() < deadline, "{} does not listen", self.name);
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// `migrate receive` on TCP prints this on stderr once it listens (with --json too):
    /// returns the port.
    fn listening(&self) -> u16 {
        let err = self
            .stderr
            .wait_for("listening on", Duration::from_secs(30), &self.name);
        let line = err.lines().find(|l| l.contains("listening on")).unwrap();
        line.split("(port ")
            .nth(1)
            .and_then(|p| p.trim_end_matches(')').parse().ok())
            .unwrap_or_else(|| panic!("no port in {line:?}"))
    }

    /// Waits for the process to end (killing it after `timeout`, which fails the test).
    fn wait(mut self, timeout: Duration) -> Ended {
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!(
                    "{} still ran after {timeout:?}; stdout:\n{}\nstderr:\n{}",
                    self.name,
                    self.stdout.text(),
                    self.stderr.text()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        for t in self.readers.drain(..) {
            t.join().unwrap();
        }
        Ended {
            status,
            stdout: self.stdout.text(),
            stderr: self.stderr.text(),
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

const LONG: Duration = Duration::from_secs(120);

/// Each vCPU's pages count went on growing on the destination.
fn assert_guest_continued(received: &Value) {
    assert_eq!(received["guest_continued"], true, "{received}");
    let at = received["pages_at_switchover_per_vcpu"].as_array().unwrap();
    let after = received["pages_after_run_per_vcpu"].as_array().unwrap();
    assert!(!at.is_empty() && at.len() == after.len(), "{received}");
    for (a, b) in after.iter().zip(at) {
        assert!(a.as_u64().unwrap() > b.as_u64().unwrap(), "{received}");
    }
}

/// Source report digest == destination report digest (both present).
/// A failed `migrate send`: it said its VM keeps running, and showed it writing pages.
fn assert_source_kept_running(sent: &Ended) {
    assert!(!sent.status.success(), "{}", sent.stderr);
    assert!(
        sent.stderr.contains("the source VM keeps running"),
        "{}",
        sent.stderr
    );
    let wrote: u64 = sent
        .stderr
        .split("the source guest wrote ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no pages count in {}", sent.stderr));
    assert!(wrote > 0, "{}", sent.stderr);
    assert!(
        sent.stderr.contains("in the last 200 ms"),
        "{}",
        sent.stderr
    );
}

fn assert_digests_equal(sent: &Value, received: &Value) {
    let s = sent["digest"].as_u64();
    let d = received["report"]["digest"].as_u64();
    assert!(s.is_some(), "the source reports a digest: {sent}");
    assert_eq!(s, d, "source {sent}\ndestination {received}");
}

/// Two network namespaces joined by a veth pair, as two hosts would be; removed on drop.
struct TwoHosts {
    ns: [String; 2],
    veth: [String; 2],
    addr: [String; 2],
}

fn ip(args: &[&str]) -> Result<(), String> {
    let o = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if o.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&o.stderr).trim()
        ))
    }
}

impl TwoHosts {
    fn new() -> Result<TwoHosts, String> {
        let pid = std::process::id();
        let hosts = TwoHosts {
            ns: [format!("gm-src-{pid}"), format!("gm-dst-{pid}")],
            veth: [format!("gms{pid}"), format!("gmd{pid}")],
            addr: [
                format!("10.{}.{}.1", 100 + (pid >> 16) % 100, (pid >> 8) % 256),
                format!("10.{}.{}.2", 100 + (pid >> 16) % 100, (pid >> 8) % 256),
            ],
        };
        // From here, drop removes whatever was made.
        for ns in &hosts.ns {
            ip(&["netns", "add", ns])?;
        }
        ip(&[
            "link",
            "add",
            &hosts.veth[0],
            "type",
            "veth",
            "peer",
            "name",
            &hosts.veth[1],
        ])?;
        for i in 0..2 {
            let (ns, veth) = (&hosts.ns[i], &hosts.veth[i]);
            ip(&["link", "set", veth, "netns", ns])?;
            let cidr = format!("{}/24", hosts.addr[i]);
            ip(&["-n", ns, "addr", "add", &cidr, "dev", veth])?;
            ip(&["-n", ns, "link", "set", veth, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(hosts)
    }

    fn exec(&self, i: usize) -> [&str; 4] {
        ["ip", "netns", "exec", &self.ns[i]]
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        // Deleting a namespace deletes the veth end in it (and its peer); the link is deleted
        // by name too in case it was made but not moved.
        let _ = ip(&["link", "del", &self.veth[0]]);
        for ns in &self.ns {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}

/// Pre-copy between two "hosts" (network namespaces joined by veth) over TCP: the guest goes on
/// at the destination with the source's memory.
#[test]
#[cfg_attr(
    not(all(kvm, netns)),
    ignore = "needs a usable /dev/kvm, root and iproute2 (ip netns)"
)]
fn precopy_between_two_network_namespaces_over_tcp() {
    let hosts = TwoHosts::new().unwrap_or_else(|e| {
        panic!("cannot make two network namespaces joined by veth (the build found `ip netns` and root): {e}")
    });
    let dir = TempDir::new("netns");
    let keys = dir.keys("keys");
    let listen = format!("tcp:{}:7207", hosts.addr[1]);
    let receive = Proc::spawn(
        "migrate receive (destination namespace)",
        &hosts.exec(1),
        &[
            "migrate",
            "receive",
            "--listen",
            &listen,
            "--keys",
            &keys,
            "--run-for",
            "1",
            "--json",
        ],
    );
    assert_eq!(receive.listening(), 7207);
    let send = Proc::spawn(
        "migrate send (source namespace)",
        &hosts.exec(0),
        &[
            "migrate", "send", "--to", &listen, "--keys", &keys, "--memory", "64M", "--vcpus", "2",
            "--verify", "--after", "0.5", "--json",
        ],
    )
    .wait(LONG);
    let received = receive.wait(LONG);
    let sent = send.ok_json("migrate send");
    let received = received.ok_json("migrate receive");
    assert_guest_continued(&received);
    assert_digests_equal(&sent, &received);
    assert!(sent["downtime_ms"].as_f64().unwrap() > 0.0, "{sent}");
    assert!(sent["pages_sent"].as_u64().unwrap() > 0, "{sent}");
    drop(hosts);
}

/// Each mode over a Unix socket: the guest goes on at the destination; pre-copy's digests are
/// equal, post-copy's pages were served on request.
#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn every_mode_over_a_unix_socket() {
    let dir = TempDir::new("modes");
    let keys = dir.keys("keys");
    // Pre-copy plain and with zstd streams (a 16 MiB window per pages connection); hybrid
    // with zstd: its pre-copy round on the streams, then post-copy on the same connections.
    let zstd: &[&str] = &["--compress", "zstd", "--zstd-window-mib", "16"];
    for (i, (mode, compress)) in [
        ("precopy", &[][..]),
        ("precopy", zstd),
        ("postcopy", &[]),
        (
            "hybrid",
            &["--compress", "zstd", "--zstd-window-mib", "128"],
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let sock = dir.path(&format!("{mode}-{i}.sock"));
        let to = format!("unix:{sock}");
        // Hybrid's fault path runs on one CPU on both sides (post-copy's where it falls).
        let pinned: &[&str] = if mode == "hybrid" {
            &["--fault-cpus", "0"]
        } else {
            &[]
        };
        let receive = Proc::receive_on(
            &format!("migrate receive ({mode})"),
            &sock,
            &keys,
            &[&["--run-for", "0.5"], pinned].concat(),
        );
        let mut args = vec![
            "migrate", "send", "--to", &to, "--keys", &keys, "--mode", mode, "--memory", "64M",
            "--vcpus", "2", "--after", "0.3", "--json",
        ];
        args.extend_from_slice(pinned);
        args.extend_from_slice(compress);
        if mode == "precopy" {
            args.push("--verify");
        }
        let send = Proc::spawn(&format!("migrate send ({mode})"), &[], &args).wait(LONG);
        let received = receive.wait(LONG).ok_json("migrate receive");
        let sent = send.ok_json("migrate send");
        assert_eq!(sent["mode"], mode, "{sent}");
        assert_eq!(received["report"]["mode"], mode, "{received}");
        assert_guest_continued(&received);
        if !compress.is_empty() {
            // The rounds went on zstd streams, on both sides: 16 MiB asked for, or 128 MiB cut
            // to what a connection carries of a 64 MiB guest.
            let window = sent["zstd_window_bytes"].as_u64().unwrap();
            match mode {
                "precopy" => assert_eq!(window, 16 << 20, "{sent}"),
                _ => assert!(window > 0 && window <= 64 << 20, "{sent}"),
            }
            assert!(
                sent["compression"]["zstd_frames"].as_u64().unwrap() > 0,
                "{sent}"
            );
            assert!(sent["zstd_stream_bytes"].as_u64().unwrap() > 0, "{sent}");
            let held = received["report"]["zstd_stream_bytes"].as_u64().unwrap();
            assert!(held > 0, "{received}");
        } else {
            assert_eq!(sent["zstd_window_bytes"], 0, "{sent}");
        }
        match mode {
            "precopy" => {
                assert_digests_equal(&sent, &received);
                assert_eq!(sent["postcopy_requests"], 0, "{sent}");
            }
            _ => {
                assert!(sent["postcopy_requests"].as_u64().unwrap() > 0, "{sent}");
                // From Running to every page resident: 64 MiB take more than a millisecond,
                // and less than the guest ran there.
                let resident = received["report"]["resident_ms"].as_f64().unwrap();
                assert!(
                    resident > 1.0 && resident < received["run_ms"].as_f64().unwrap(),
                    "{received}"
                );
                assert_eq!(sent["postcopy_ms"], received["report"]["resident_ms"]);
            }
        }
        if mode == "hybrid" {
            // One pre-copy round, and the switch-over's.
            assert_eq!(sent["rounds"].as_array().unwrap().len(), 2, "{sent}");
        }
    }
}

/// A destination killed mid-transfer: the source says its VM keeps running, and shows it.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn a_killed_destination_leaves_the_source_running() {
    let dir = TempDir::new("kill");
    let keys = dir.keys("keys");
    let sock = dir.path("sock");
    let to = format!("unix:{sock}");
    let mut receive = Proc::receive_on("migrate receive", &sock, &keys, &[]);
    // 256 MiB at 20 MiB/s: the first round takes about 13 s.
    let send = Proc::spawn(
        "migrate send",
        &[],
        &[
            "migrate",
            "send",
            "--to",
            &to,
            "--keys",
            &keys,
            "--memory",
            "256M",
            "--max-bandwidth-mib-per-s",
            "20",
            "--after",
            "0.5",
        ],
    );
    std::thread::sleep(Duration::from_millis(2500));
    receive.child.kill().unwrap();
    let killed = Instant::now();
    let received = receive.wait(LONG);
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        received.status.signal(),
        Some(9),
        "the destination was killed mid-transfer, not done: {}",
        received.stderr
    );
    let sent = send.wait(LONG);
    assert!(
        killed.elapsed() < Duration::from_secs(8),
        "the source noticed in {:?}",
        killed.elapsed()
    );
    assert_source_kept_running(&sent);
    // It names what failed on the link (not only which connection).
    assert!(
        sent.stderr.contains("I/O on the migration stream"),
        "{}",
        sent.stderr
    );
}

/// A TCP relay to `to` that cuts every connection (both ways) once `cut_after` bytes went from
/// the source to the destination, and accepts nothing after.
struct Proxy {
    port: u16,
    cut: Arc<AtomicBool>,
    forwarded: Arc<AtomicU64>,
}

impl Proxy {
    fn start(to: u16, cut_after: u64) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let cut = Arc::new(AtomicBool::new(false));
        let forwarded = Arc::new(AtomicU64::new(0));
        let sockets: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let (c, f) = (cut.clone(), forwarded.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                if c.load(Ordering::SeqCst) {
                    return;
                }
                let server = TcpStream::connect(("127.0.0.1", to)).unwrap();
                {
                    let mut s = sockets.lock().unwrap();
                    s.push(client.try_clone().unwrap());
                    s.push(server.try_clone().unwrap());
                }
                let cut_all = {
                    let (sockets, c) = (sockets.clone(), c.clone());
                    Arc::new(move || {
                        c.store(true, Ordering::SeqCst);
                        for s in sockets.lock().unwrap().iter() {
                            let _ = s.shutdown(Shutdown::Both);
                        }
                    })
                };
                for (from, dst, count) in [
                    (
                        client.try_clone().unwrap(),
                        server.try_clone().unwrap(),
                        true,
                    ),
                    (server, client, false),
                ] {
                    let (f, c, cut_all) = (f.clone(), c.clone(), cut_all.clone());
                    std::thread::spawn(move || {
                        let (mut from, mut to) = (from, dst);
                        let mut buf = vec![0u8; 64 << 10];
                        loop {
                            let n = match from.read(&mut buf) {
                                Ok(0) | Err(_) => break,
                                Ok(n) => n,
                            };
                            if c.load(Ordering::SeqCst) || to.write_all(&buf[..n]).is_err() {
                                break;
                            }
                            if count
                                && f.fetch_add(n as u64, Ordering::SeqCst) + n as u64 > cut_after
                            {
                                cut_all();
                                break;
                            }
                        }
                        let _ = to.shutdown(Shutdown::Write);
                    });
                }
            }
        });
        Proxy {
            port,
            cut,
            forwarded,
        }
    }
}

/// Post-copy through a relay that is cut mid-way: the source waits, `migrate resume` reconnects
/// it straight to the destination, and both finish with the guest going on.
#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn a_cut_postcopy_link_is_resumed_from_the_cli() {
    let dir = TempDir::new("cut");
    let keys = dir.keys("keys");
    let receive = Proc::spawn(
        "migrate receive",
        &[],
        &[
            "migrate",
            "receive",
            "--listen",
            "tcp:127.0.0.1:0",
            "--keys",
            &keys,
            "--run-for",
            "3",
            "--json",
        ],
    );
    let dest_port = receive.listening();
    // The sys region (7 MiB, a few hundred KiB of non-zero lines) goes at switch-over; RAM
    // (256 MiB, one u64 per page written before the migration starts: ~5 MiB of lines and
    // masks) comes in post-copy: the cut falls in the middle of it.
    let proxy = Proxy::start(dest_port, 1 << 20);
    let control = dir.path("control.sock");
    let send = Proc::spawn(
        "migrate send",
        &[],
        &[
            "migrate",
            "send",
            "--to",
            &format!("tcp:127.0.0.1:{}", proxy.port),
            "--keys",
            &keys,
            "--mode",
            "postcopy",
            "--memory",
            "256M",
            "--vcpus",
            "2",
            "--control",
            &control,
            "--json",
        ],
    );
    send.stderr
        .wait_for("the post-copy link broke", LONG, "migrate send");
    assert!(proxy.cut.load(Ordering::SeqCst));
    assert!(Path::new(&control).exists());
    let resume = Proc::spawn(
        "migrate resume",
        &[],
        &[
            "migrate",
            "resume",
            "--control",
            &control,
            "--to",
            &format!("tcp:127.0.0.1:{dest_port}"),
        ],
    )
    .wait(LONG);
    assert!(resume.status.success(), "{}", resume.stderr);
    assert!(
        resume.stdout.contains("post-copy goes on"),
        "{}",
        resume.stdout
    );
    let sent = send.wait(LONG).ok_json("migrate send");
    let received = receive.wait(LONG).ok_json("migrate receive");
    assert_guest_continued(&received);
    assert_eq!(sent["link_breaks"], 1, "{sent}");
    assert_eq!(received["report"]["link_breaks"], 1, "{received}");
    assert!(
        proxy.forwarded.load(Ordering::SeqCst) < sent["wire_bytes"].as_u64().unwrap(),
        "pages went after the cut: {sent}"
    );
    assert!(!Path::new(&control).exists(), "the control socket is gone");
}

/// `migrate receive` on TCP with `--run-for 1 --json`.
fn receive_tcp(name: &str, keys: &str) -> (Proc, String) {
    let receive = Proc::spawn(
        name,
        &[],
        &[
            "migrate",
            "receive",
            "--listen",
            "tcp:127.0.0.1:0",
            "--keys",
            keys,
            "--run-for",
            "1",
            "--json",
        ],
    );
    let to = format!("tcp:127.0.0.1:{}", receive.listening());
    (receive, to)
}

fn send_args<'a>(to: &'a str, keys: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "migrate", "send", "--to", to, "--keys", keys, "--memory", "64M", "--after", "0.2",
    ];
    args.extend_from_slice(extra);
    args
}

/// Keys from another `migrate keys`, a connection that says nothing, random bytes, a line of
/// text: each is refused (the TLS one says TLS on both sides), `migrate receive` goes on
/// waiting, and the genuine migration after them completes with equal digests.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn junk_and_strangers_are_refused_and_the_genuine_migration_goes_through() {
    let dir = TempDir::new("keys");
    let (ours, theirs) = (dir.keys("ours"), dir.keys("theirs"));
    let (receive, to) = receive_tcp("migrate receive", &ours);
    let sent = Proc::spawn("migrate send", &[], &send_args(&to, &theirs, &[])).wait(LONG);
    assert!(!sent.status.success(), "{}", sent.stdout);
    assert!(sent.stderr.contains("TLS"), "{}", sent.stderr);
    assert!(
        sent.stderr.contains("the VM was not migrated"),
        "{}",
        sent.stderr
    );
    receive
        .stderr
        .wait_for("refused a migration connection", LONG, "migrate receive");
    assert!(
        receive.stderr.text().contains("TLS"),
        "{}",
        receive.stderr.text()
    );
    let addr = to.strip_prefix("tcp:").unwrap();
    // Held open, silent, for the whole genuine migration.
    let _silent = TcpStream::connect(addr).unwrap();
    for junk in [
        &b"\x16\x03\x01\xff\xff\x00\x13junk"[..],
        b"GET / HTTP/1.0\r\n\r\n",
    ] {
        let mut c = TcpStream::connect(addr).unwrap();
        c.write_all(junk).unwrap();
    }
    let started = Instant::now();
    let sent = Proc::spawn(
        "migrate send",
        &[],
        &send_args(&to, &ours, &["--verify", "--json"]),
    )
    .wait(LONG)
    .ok_json("migrate send");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "the silent connection held the migration up: {:?}",
        started.elapsed()
    );
    let received = receive.wait(LONG).ok_json("migrate receive");
    assert_guest_continued(&received);
    assert_digests_equal(&sent, &received);
}

/// Two sources at once: the first migration completes, the second is refused, told that the
/// destination is busy with another migration, and its VM was not migrated.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn a_second_sender_is_told_the_destination_is_busy() {
    let dir = TempDir::new("busy");
    let keys = dir.keys("keys");
    let (receive, to) = receive_tcp("migrate receive", &keys);
    // 64 MiB, filled, at 24 MiB/s (and little dirtied meanwhile): the first migration takes
    // a few seconds.
    let first = Proc::spawn(
        "first migrate send",
        &[],
        &send_args(
            &to,
            &keys,
            &[
                "--max-bandwidth-mib-per-s",
                "24",
                "--dirty-mib-per-s",
                "2",
                "--verify",
                "--json",
            ],
        ),
    );
    std::thread::sleep(Duration::from_millis(1000));
    let second = Proc::spawn("second migrate send", &[], &send_args(&to, &keys, &[])).wait(LONG);
    assert!(!second.status.success(), "{}", second.stdout);
    assert!(
        second
            .stderr
            .contains("the destination is busy with another migration"),
        "{}",
        second.stderr
    );
    assert!(
        second.stderr.contains("the VM was not migrated"),
        "{}",
        second.stderr
    );
    assert_source_kept_running(&second);
    let sent = first.wait(LONG).ok_json("first migrate send");
    let received = receive.wait(LONG).ok_json("migrate receive");
    assert_guest_continued(&received);
    assert_digests_equal(&sent, &received);
}

/// A bandwidth limit that never finishes: refused at once, naming the option. A source holding
/// the destination's certificate: refused by the destination, both sides naming the role.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn options_and_certificates_that_cannot_work_are_refused_naming_them() {
    let dir = TempDir::new("refused");
    let keys = dir.keys("keys");
    for (bw, connections) in [("0", "2"), ("1", "2")] {
        let sent = Proc::spawn(
            "migrate send",
            &[],
            &send_args(
                "unix:/nonexistent",
                &keys,
                &[
                    "--max-bandwidth-mib-per-s",
                    bw,
                    "--connections",
                    connections,
                ],
            ),
        )
        .wait(LONG);
        assert!(!sent.status.success());
        assert!(
            sent.stderr
                .contains(&format!("--max-bandwidth-mib-per-s {bw} is refused")),
            "{}",
            sent.stderr
        );
    }
    let swapped = dir.path("swapped");
    std::fs::create_dir_all(&swapped).unwrap();
    std::fs::copy(format!("{keys}/ca.pem"), format!("{swapped}/ca.pem")).unwrap();
    for ext in ["pem", "key"] {
        std::fs::copy(
            format!("{keys}/guestmem-destination.{ext}"),
            format!("{swapped}/guestmem-source.{ext}"),
        )
        .unwrap();
    }
    let (receive, to) = receive_tcp("migrate receive", &keys);
    let sent = Proc::spawn("migrate send", &[], &send_args(&to, &swapped, &[])).wait(LONG);
    assert!(!sent.status.success());
    let role = "it is a destination certificate (guestmem-destination), where a source one \
                (guestmem-source) is required";
    assert!(
        sent.stderr.contains("refused the migration") && sent.stderr.contains(role),
        "{}",
        sent.stderr
    );
    receive
        .stderr
        .wait_for(role, LONG, "migrate receive (which goes on waiting)");
}

/// The destination killed during post-copy: the source finds nothing listening where it was,
/// says within a bound that the destination is dead and what it keeps (in a snapshot), and
/// exits with an error.
#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn a_destination_killed_during_postcopy_is_reported_dead() {
    let dir = TempDir::new("dead");
    let keys = dir.keys("keys");
    let mut receive = Proc::spawn(
        "migrate receive",
        &[],
        &[
            "migrate",
            "receive",
            "--listen",
            "tcp:127.0.0.1:0",
            "--keys",
            &keys,
            "--run-for",
            "60",
            "--json",
        ],
    );
    let to = format!("tcp:127.0.0.1:{}", receive.listening());
    let control = dir.path("control.sock");
    let send = Proc::spawn(
        "migrate send",
        &[],
        &[
            "migrate",
            "send",
            "--to",
            &to,
            "--keys",
            &keys,
            "--mode",
            "postcopy",
            "--memory",
            "256M",
            "--after",
            "0.2",
            "--control",
            &control,
            "--dead-after",
            "2",
            "--json",
        ],
    );
    receive
        .stderr
        .wait_for("the guest runs here now", LONG, "migrate receive");
    receive.child.kill().unwrap();
    let killed = Instant::now();
    let _ = receive.wait(LONG);
    let sent = send.wait(LONG);
    assert!(
        killed.elapsed() < Duration::from_secs(15),
        "the source took {:?} to give up",
        killed.elapsed()
    );
    assert!(!sent.status.success(), "{}", sent.stdout);
    for said in [
        "the destination is dead: nothing has listened at",
        "this source, which holds every page the destination had not fetched and the VM state \
         at the switch-over",
        "they are kept in the snapshot ",
    ] {
        assert!(
            sent.stderr.contains(said),
            "{said:?} not in:\n{}",
            sent.stderr
        );
    }
    let kept = sent
        .stderr
        .split("they are kept in the snapshot ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .unwrap()
        .to_string();
    let exists = Path::new(&kept).join("manifest.json").exists();
    let _ = std::fs::remove_dir_all(&kept);
    assert!(exists, "no snapshot in {kept}");
}

/// A CPU the host lacks as `--fault-cpus`: each side refuses it, naming it; the source's VM
/// keeps running.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn a_fault_cpu_the_host_lacks_is_refused_by_both_sides() {
    let dir = TempDir::new("fault-cpus");
    let keys = dir.keys("keys");
    let bad = format!("unix:{}", dir.path("bad.sock"));
    let received = Proc::spawn(
        "migrate receive",
        &[],
        &[
            "migrate",
            "receive",
            "--listen",
            &bad,
            "--keys",
            &keys,
            "--fault-cpus",
            "4096",
        ],
    )
    .wait(LONG);
    assert!(!received.status.success(), "{}", received.stdout);
    assert!(
        received
            .stderr
            .contains("fault CPUs: CPU 4096 does not exist or is not one this process may run on"),
        "{}",
        received.stderr
    );

    let sock = dir.path("sock");
    let to = format!("unix:{sock}");
    let receive = Proc::receive_on("migrate receive", &sock, &keys, &[]);
    let sent = Proc::spawn(
        "migrate send",
        &[],
        &[
            "migrate",
            "send",
            "--to",
            &to,
            "--keys",
            &keys,
            "--mode",
            "postcopy",
            "--memory",
            "64M",
            "--after",
            "0.1",
            "--fault-cpus",
            "4096",
        ],
    )
    .wait(LONG);
    assert_source_kept_running(&sent);
    assert!(
        sent.stderr.contains("fault CPUs: CPU 4096 does not exist"),
        "{}",
        sent.stderr
    );
    // The destination got no VM.
    assert!(!receive.wait(LONG).status.success());
}

/// The README's demo: a 1 GiB guest migrates to a second process, digests equal.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn demo_migrates_and_the_digests_match() {
    let o = Proc::spawn("demo", &[], &["demo"]).wait(LONG);
    assert!(o.status.success(), "{}\n{}", o.stdout, o.stderr);
    assert!(o.stdout.contains("migration complete"), "{}", o.stdout);
    let line = o
        .stdout
        .lines()
        .find(|l| l.starts_with("memory digest at switch-over"))
        .unwrap_or_else(|| panic!("no digest line:\n{}", o.stdout));
    let digests: Vec<&str> = line
        .split_whitespace()
        .filter(|w| w.starts_with("0x"))
        .collect();
    assert_eq!(digests.len(), 2, "{line}");
    assert_eq!(digests[0], digests[1], "{line}");
}

/// `guestmem probe --json`.
fn probe_json() -> Value {
    let o = Command::new(guestmem_bin())
        .args(["probe", "--json"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// Whether the kernel creates host-mapped guest_memfd (`MMAP|INIT_SHARED`), as the probe says.
fn gmem_mappable(probe: &Value) -> bool {
    let names = &probe["kvm"]["Ok"]["guest_memfd_flags"]["Ok"]["names"];
    ["MMAP", "INIT_SHARED"]
        .iter()
        .all(|f| names.as_array().is_some_and(|n| n.iter().any(|x| x == f)))
}

/// Where the kernel has no host-mapped guest_memfd: `migrate send --backend gmem` (with
/// `extra`) refuses, naming what the kernel lacks.
fn assert_gmem_send_refused(name: &str, keys: &str, extra: &[&str]) {
    let mut args = vec!["--backend", "gmem"];
    args.extend_from_slice(extra);
    let sent = Proc::spawn(name, &[], &send_args("tcp:127.0.0.1:9", keys, &args)).wait(LONG);
    assert!(!sent.status.success(), "{}", sent.stdout);
    assert!(
        sent.stderr.contains("the gmem backend is not available")
            && (sent.stderr.contains("KVM_CAP_GUEST_MEMFD")
                || sent.stderr.contains("MMAP|INIT_SHARED")),
        "{}",
        sent.stderr
    );
}

/// A gmem VM migrated pre-copy between two guestmem processes over loopback TCP: both sides'
/// digests at switch-over equal (`--verify`), and the guest goes on at the destination. Where
/// the kernel has no host-mapped guest_memfd, `migrate send` refuses naming what it lacks.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn gmem_precopy_over_loopback_moves_the_guest_with_memory_verified() {
    let probe = probe_json();
    let dir = TempDir::new("gmem-precopy");
    let keys = dir.keys("keys");
    if !gmem_mappable(&probe) {
        assert_gmem_send_refused("migrate send (gmem)", &keys, &[]);
        return;
    }
    let (receive, to) = receive_tcp("migrate receive (gmem)", &keys);
    let sent = Proc::spawn(
        "migrate send (gmem)",
        &[],
        &send_args(
            &to,
            &keys,
            &["--backend", "gmem", "--vcpus", "2", "--verify", "--json"],
        ),
    )
    .wait(LONG);
    let received = receive.wait(LONG).ok_json("migrate receive");
    let sent = sent.ok_json("migrate send");
    assert_eq!(sent["mode"], "precopy", "{sent}");
    assert_digests_equal(&sent, &received);
    assert_guest_continued(&received);
}

/// Post-copy of a gmem VM: served where userfaultfd registers the destination's gmem mapping,
/// else refused by the destination before any page moves, naming the failed registration and
/// KVM Userfault; the source keeps its guest.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn gmem_postcopy_is_served_or_refused_naming_what_is_missing() {
    let probe = probe_json();
    let dir = TempDir::new("gmem-postcopy");
    let keys = dir.keys("keys");
    if !gmem_mappable(&probe) {
        assert_gmem_send_refused(
            "migrate send (gmem post-copy)",
            &keys,
            &["--mode", "postcopy"],
        );
        return;
    }
    let (receive, to) = receive_tcp("migrate receive (gmem post-copy)", &keys);
    let sent = Proc::spawn(
        "migrate send (gmem post-copy)",
        &[],
        &send_args(
            &to,
            &keys,
            &["--backend", "gmem", "--mode", "postcopy", "--json"],
        ),
    )
    .wait(LONG);
    let received = receive.wait(LONG);
    if sent.status.success() {
        let received = received.ok_json("migrate receive");
        assert_guest_continued(&received);
        return;
    }
    for (who, text) in [("source", &sent.stderr), ("destination", &received.stderr)] {
        assert!(
            text.contains("needs KVM Userfault")
                && text.contains("KVM_MEM_USERFAULT")
                && text.contains("migrate it with pre-copy"),
            "{who}: {text}"
        );
        if probe["kvm_userfault"]["Ok"]["present"] == false {
            assert!(
                text.contains("absent") || text.contains("lacks"),
                "{who}: {text}"
            );
        }
    }
    assert!(!received.status.success());
    assert_source_kept_running(&sent);
}
