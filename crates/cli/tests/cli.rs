//! The `guestmem` command as a user runs it.

mod common;

use std::process::{Command, Output};

fn guestmem(args: &[&str]) -> Output {
    Command::new(common::guestmem_bin())
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

/// `guestmem bench` hands over to the bench crate, whose `--json` carries the commit the binary
/// was built from and each figure's runs, median, min and max.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn bench_json_names_its_commit_and_carries_every_run() {
    let o = guestmem(&[
        "bench",
        "memslots",
        "--slots",
        "2",
        "--seconds",
        "0.01",
        "--access-slots",
        "1",
        "--accesses",
        "100",
        "--runs",
        "2",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let head = Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| stdout(&o).trim().to_string());
    let commit = v["run"]["commit"].as_str().unwrap();
    assert_eq!(commit, head.as_deref().unwrap_or("unknown"));
    assert!(v["run"]["tree_dirty"].is_boolean(), "{}", v["run"]);
    let test = &v["perf"][0]["tests"][0];
    let figure = &test["s_per_iteration_figure"];
    assert_eq!(figure["runs"].as_array().unwrap().len(), 2, "{test}");
    assert!(figure["min"].as_f64().unwrap() <= figure["median"].as_f64().unwrap());
    assert!(figure["median"].as_f64().unwrap() <= figure["max"].as_f64().unwrap());
    let access = &v["access"][0];
    assert_eq!(
        access["cached_read_ns"], access["cached_read_ns_figure"]["min"],
        "{access}"
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
    // `--clones` runs a Linux guest's clones through a restore service: refused for the
    // payload's snapshot, naming what does run its clones.
    let o = guestmem(&["restore", d, "--mode", "lazy", "--clones", "2"]);
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    assert!(
        stderr(&o).contains("snapshot of guestmem's payload VM")
            && stderr(&o).contains("guestmem bench fanout"),
        "{}",
        stderr(&o)
    );
    // A manifest edited by hand (a data chunk marked zero): refused before the guest runs.
    let manifest = dir.join("manifest.json");
    let text = std::fs::read_to_string(&manifest).unwrap();
    let edited = text.replacen("\"zero\":false", "\"zero\":true", 1);
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

/// An error's cause is printed once, on a line of its own: a missing snapshot names the file
/// and the operation, and the operating system's error follows as its cause.
#[test]
fn a_missing_snapshot_prints_its_os_error_once_as_the_cause() {
    let dir = std::env::temp_dir().join(format!("guestmem-cli-missing-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let os = std::fs::read(dir.join("manifest.json"))
        .expect_err("no such file")
        .to_string();
    let o = guestmem(&["restore", dir.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let e = stderr(&o);
    assert_eq!(e.matches(&os).count(), 1, "'{os}' once in: {e}");
    let first = e.lines().next().unwrap_or_default();
    assert!(
        first.starts_with("guestmem: error: ") && first.ends_with("manifest.json: read failed"),
        "{e}"
    );
    assert!(e.contains(&format!("\n  caused by: {os}")), "{e}");
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

/// A `guestmem page-server` child process on `socket`, serving one connection; its stderr is
/// piped (RUST_LOG unset: warnings and errors only).
/// A child process that is killed if the test ends (or fails) before it does: a server left
/// behind would hold the test run's output pipe open.
struct Reaped(std::process::Child);

impl std::ops::Deref for Reaped {
    type Target = std::process::Child;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for Reaped {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl Drop for Reaped {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

fn page_server(socket: &std::path::Path, memory: &[&str]) -> Reaped {
    let _ = std::fs::remove_file(socket);
    let child = Command::new(common::guestmem_bin())
        .args(["page-server", "--firecracker", socket.to_str().unwrap()])
        .args(memory)
        .args(["--connections", "1"])
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run guestmem page-server");
    let child = Reaped(child);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !socket.exists() {
        assert!(std::time::Instant::now() < deadline, "no socket");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    child
}

/// `restore --mode lazy --uffd-socket` against `page-server --snapshot`: the guest goes on and
/// the VMM side says the server checks the bytes; then with one byte of a RAM chunk flipped,
/// the server refuses that chunk, naming it (one error line), and kills the VMM before its
/// guest runs on it.
#[test]
#[cfg_attr(not(all(kvm, uffd)), ignore = "no usable /dev/kvm or /dev/userfaultfd")]
fn page_server_snapshot_serves_checked_bytes_and_refuses_a_corrupt_chunk() {
    use std::io::Read;
    use std::os::unix::fs::FileExt;
    use std::os::unix::process::ExitStatusExt;
    let dir = std::env::temp_dir().join(format!("guestmem-cli-fc-{}", std::process::id()));
    let d = dir.to_str().unwrap();
    let o = guestmem(&[
        "snapshot",
        "--out",
        d,
        "--memory",
        "64M",
        "--backend",
        "anon",
        "--after",
        "0.3",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let socket = dir.join("uffd.sock");

    let mut server = page_server(&socket, &["--snapshot", d]);
    let s = socket.to_str().unwrap();
    let o = guestmem(&[
        "restore",
        d,
        "--mode",
        "lazy",
        "--uffd-socket",
        s,
        "--run-for",
        "0.2",
    ]);
    server.wait().unwrap();
    let mut err = String::new();
    server
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(
        o.status.success(),
        "{:?}: {}{}\nthe server: {err}",
        o.status,
        stdout(&o),
        stderr(&o)
    );
    assert!(
        stdout(&o).contains("this process cannot check those bytes, the server must"),
        "{}",
        stdout(&o)
    );
    assert!(
        err.contains("each chunk checked against its CRC-32"),
        "{err}"
    );
    assert!(!err.contains("error"), "{err}");

    // Flip one byte of the RAM's chunk at 0x600000.
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap();
    let ram = manifest["regions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["spec"]["name"] == "ram")
        .unwrap();
    let at = ram["file_offset"].as_u64().unwrap() + 0x600000 + 77;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.join("memory"))
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ 1], at).unwrap();

    // The guest, or else the background fetch, reaches the chunk within the run.
    let mut server = page_server(&socket, &["--snapshot", d]);
    let o = guestmem(&[
        "restore",
        d,
        "--mode",
        "lazy",
        "--uffd-socket",
        s,
        "--run-for",
        "5",
    ]);
    assert_eq!(o.status.signal(), Some(9), "{:?}: {}", o.status, stdout(&o));
    assert!(
        !stdout(&o).contains("guest pages written"),
        "{}",
        stdout(&o)
    );
    server.wait().unwrap();
    let mut err = String::new();
    server
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    let errors: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with("guestmem page-server: error:"))
        .collect();
    assert_eq!(errors.len(), 1, "{err}");
    assert!(
        errors[0].contains(&format!("snapshot {d} region 'ram'")),
        "{err}"
    );
    assert!(
        errors[0].contains("region 'ram' chunk 3 (offset 0x600000)"),
        "{err}"
    );
    assert_eq!(
        errors[0].matches("page-server protocol:").count(),
        1,
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `/dev/null` sent in place of the userfaultfd: one error line saying so, and nothing else
/// (no pager spinning on it, warning each time).
#[test]
fn page_server_refuses_a_fd_that_is_not_a_userfaultfd_once() {
    use std::io::Read;
    use std::os::fd::AsRawFd;
    use vmm_sys_util::sock_ctrl_msg::ScmSocket;
    let dir = std::env::temp_dir().join(format!("guestmem-cli-null-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mem = dir.join("memory");
    std::fs::File::create(&mem)
        .unwrap()
        .set_len(4 << 20)
        .unwrap();
    let socket = dir.join("uffd.sock");
    let mut server = page_server(
        &socket,
        &[
            "--mem-file",
            mem.to_str().unwrap(),
            "--keep-peer-on-failure",
        ],
    );
    let stream = std::os::unix::net::UnixStream::connect(&socket).unwrap();
    let null = std::fs::File::open("/dev/null").unwrap();
    let message =
        br#"[{"base_host_virt_addr":1073741824,"size":4194304,"offset":0,"page_size_kib":4096}]"#;
    stream.send_with_fd(&message[..], null.as_raw_fd()).unwrap();
    server.wait().unwrap();
    drop(stream);
    let mut err = String::new();
    server
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(
        lines,
        [
            &*format!(
                "guestmem page-server: serving memory file {} (not checked: it carries no \
                 checksums) on {}",
                mem.display(),
                socket.display()
            ),
            "guestmem page-server: error: page-server protocol: the file descriptor attached \
             to the handshake message is /dev/null, not a userfaultfd",
        ],
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

// guest_memfd paths, as the kernel lab runs them (scripts/kernel-lab.sh, suite
// scripts/lab-suites/gmem): each works where the running kernel offers what it needs, and is
// refused naming what is missing where it does not, as `guestmem probe` finds by trying.

/// `guestmem probe --json`.
fn probe_json() -> serde_json::Value {
    let o = guestmem(&["probe", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    serde_json::from_str(&stdout(&o)).unwrap()
}

/// Whether the kernel creates host-mapped guest_memfd (`MMAP|INIT_SHARED`), as the probe says.
fn gmem_mappable(probe: &serde_json::Value) -> bool {
    let names = &probe["kvm"]["Ok"]["guest_memfd_flags"]["Ok"]["names"];
    ["MMAP", "INIT_SHARED"]
        .iter()
        .all(|f| names.as_array().is_some_and(|n| n.iter().any(|x| x == f)))
}

/// A gmem command refused because the kernel has no (host-mapped) guest_memfd: it failed,
/// naming the backend and what the kernel lacks.
fn assert_refused_for_lack_of_gmem(o: &Output) {
    assert!(!o.status.success(), "{}", stdout(o));
    let err = stderr(o);
    assert!(
        err.contains("the gmem backend is not available")
            && (err.contains("KVM_CAP_GUEST_MEMFD") || err.contains("MMAP|INIT_SHARED")),
        "{err}"
    );
}

/// Demand paging a gmem region needs KVM Userfault (userfaultfd never sees a vCPU's accesses
/// to guest_memfd): where the kernel lacks it, the refusal names it.
fn assert_gmem_demand_paging_refusal(err: &str, probe: &serde_json::Value) {
    assert!(err.contains("KVM_MEM_USERFAULT"), "{err}");
    if probe["kvm_userfault"]["Ok"]["present"] == false {
        assert!(err.contains("absent") || err.contains("lacks"), "{err}");
    }
}

/// `probe` names every bit the kernel returns: no capability is left as `unknown(0x..)`.
#[test]
fn gmem_probe_names_every_capability_bit() {
    let o = guestmem(&["probe", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(!out.contains("unknown("), "{out}");
    let text = guestmem(&["probe"]);
    assert!(text.status.success(), "{}", stderr(&text));
    assert!(!stdout(&text).contains("unknown("), "{}", stdout(&text));
}

/// A gmem VM snapshot into a flat directory and into a local chunk store, each restored in
/// full: memory digests equal to the snapshot's, and the guest goes on.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn gmem_snapshot_flat_and_store_full_restore_continue() {
    let probe = probe_json();
    let root = std::env::temp_dir().join(format!("guestmem-cli-gmem-snap-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    let flat = root.join("flat");
    let store = format!("store:{}/store/gmem", root.display());
    for out in [flat.to_str().unwrap(), &store] {
        let o = guestmem(&[
            "snapshot",
            "--out",
            out,
            "--memory",
            "32M",
            "--vcpus",
            "2",
            "--backend",
            "gmem",
            "--after",
            "0.3",
        ]);
        if !gmem_mappable(&probe) {
            assert_refused_for_lack_of_gmem(&o);
            continue;
        }
        assert!(o.status.success(), "{out}: {}", stderr(&o));
        let o = guestmem(&[
            "restore",
            out,
            "--mode",
            "full",
            "--run-for",
            "0.2",
            "--json",
        ]);
        assert!(o.status.success(), "{out}: {}", stderr(&o));
        let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
        assert_eq!(v["memory_digests_match"], true, "{out}: {v}");
        assert_eq!(v["guest_continued"], true, "{out}: {v}");
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// A lazy restore of a gmem snapshot, flat and from a local chunk store: served through KVM
/// Userfault where the kernel has it (the guest goes on, all memory resident, the working set
/// recorded), else refused before the guest runs, naming KVM Userfault.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn gmem_lazy_restore_is_served_or_refused_naming_what_is_missing() {
    let probe = probe_json();
    let dir = std::env::temp_dir().join(format!("guestmem-cli-gmem-lazy-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let flat = dir.join("flat");
    let store = format!("store:{}/store/gmem", dir.display());
    for out in [flat.to_str().unwrap(), &store] {
        let o = guestmem(&[
            "snapshot",
            "--out",
            out,
            "--memory",
            "32M",
            "--backend",
            "gmem",
            "--after",
            "0.2",
        ]);
        if !gmem_mappable(&probe) {
            assert_refused_for_lack_of_gmem(&o);
            continue;
        }
        assert!(o.status.success(), "{out}: {}", stderr(&o));
        let o = guestmem(&[
            "restore",
            out,
            "--mode",
            "lazy",
            "--run-for",
            "0.2",
            "--json",
        ]);
        if o.status.success() {
            let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
            assert_eq!(v["guest_continued"], true, "{out}: {v}");
            assert!(v["resident_ms"].is_number(), "{out}: {v}");
            assert_eq!(v["working_set"]["action"], "recorded", "{out}: {v}");
        } else {
            assert_gmem_demand_paging_refusal(&stderr(&o), &probe);
            assert!(
                !stdout(&o).contains("guest pages written"),
                "{out}: {}",
                stdout(&o)
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
