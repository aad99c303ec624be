//! A real Linux guest under `guestmem`: booted, its console read, the counter its init prints
//! every 100 ms seen going on. These tests need ordinary KVM and a guest kernel and initramfs
//! (`GUESTMEM_LINUX_KERNEL`, `GUESTMEM_LINUX_INITRD`): the kernel lab's linux suite
//! (`scripts/kernel-lab.sh --suite linux`) has them; elsewhere they are ignored. Times they
//! print are the lab's (TCG).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const GUESTMEM: &str = env!("CARGO_BIN_EXE_guestmem");
/// The guest's command line in these tests: the default, quiet, init from the initramfs, and
/// `noxsave`: in the lab (KVM nested in QEMU 7.2's TCG), KVM's CPUID 0xD.0 EBX stays at the
/// XSAVE size of x87|SSE after the guest enables AVX in XCR0 (the guest's XSETBV apparently
/// never reaches KVM), and Linux 7.3's XSAVE self-check then fails into a NULL dereference in
/// `fpstate_reset` (6.1 falls back to FXSAVE by itself). The guest runs on FXSAVE here.
const CMDLINE: &str = "console=ttyS0 reboot=k panic=1 pci=off nomodule i8042.noaux i8042.nomux \
                       i8042.dumbkbd rdinit=/init quiet noxsave";

fn guest_files() -> (String, String) {
    let var = |name: &str| {
        std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set: run in the kernel lab"))
    };
    (var("GUESTMEM_LINUX_KERNEL"), var("GUESTMEM_LINUX_INITRD"))
}

/// A guestmem process whose stdout (the guest's console) is read line by line, each line
/// with the time it came.
struct Guest {
    child: Child,
    lines: mpsc::Receiver<(Instant, String)>,
    started: Instant,
}

impl Guest {
    fn spawn(args: &[&str]) -> Guest {
        let mut child = Command::new(GUESTMEM)
            .args(args)
            .stdout(Stdio::piped())
            .spawn()
            .expect("guestmem starts");
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                println!("console: {line}");
                if tx.send((Instant::now(), line)).is_err() {
                    break;
                }
            }
        });
        Guest {
            child,
            lines,
            started: Instant::now(),
        }
    }

    /// The next counter value the guest prints, and when; panics after `limit`.
    fn next_counter(&self, limit: Duration) -> (u64, Instant) {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let (at, line) = self
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("no counter line within {limit:?}"));
            if let Some(n) = line
                .strip_prefix("counter ")
                .and_then(|r| r.split_whitespace().next())
                .and_then(|n| n.parse().ok())
            {
                return (n, at);
            }
        }
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `guestmem run --kernel --initrd` boots the lab's Debian cloud kernel with the busybox
/// initramfs; its init's counter reaches stdout and goes on by one each line.
#[test]
#[ignore = "needs ordinary KVM and a guest kernel: the kernel lab's linux suite runs it"]
fn linux_guest_boots_and_its_counter_goes_on() {
    let (kernel, initrd) = guest_files();
    let guest = Guest::spawn(&[
        "run",
        "--kernel",
        &kernel,
        "--initrd",
        &initrd,
        "--cmdline",
        CMDLINE,
        "--memory",
        "256M",
        "--vcpus",
        "1",
        "--run-for",
        "500",
    ]);
    let (first, at) = guest.next_counter(Duration::from_secs(400));
    println!(
        "TCG time: boot to the first counter line {:.2} s",
        (at - guest.started).as_secs_f64()
    );
    let mut last = first;
    for _ in 0..20 {
        let (n, _) = guest.next_counter(Duration::from_secs(60));
        assert_eq!(n, last + 1, "the counter goes on by one");
        last = n;
    }
}

/// The counter values `guest` prints until it exits, the first with the time it came.
fn counters_until_exit(guest: &mut Guest, limit: Duration) -> (Vec<u64>, Option<Instant>) {
    let deadline = Instant::now() + limit;
    let (mut seen, mut first) = (Vec::new(), None);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match guest.lines.recv_timeout(left) {
            Ok((at, line)) => {
                if let Some(n) = line
                    .strip_prefix("counter ")
                    .and_then(|r| r.split_whitespace().next())
                    .and_then(|n| n.parse().ok())
                {
                    first.get_or_insert(at);
                    seen.push(n);
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => panic!("guestmem still runs after {limit:?}"),
        }
    }
    let status = guest.child.wait().unwrap();
    assert!(status.success(), "guestmem failed: {status}");
    (seen, first)
}

/// Takes a paused snapshot of the booted guest 2 s after its first console line; the counter
/// values it printed before the pause.
fn snapshot_guest(dir: &std::path::Path, backend: &str) -> Vec<u64> {
    let (kernel, initrd) = guest_files();
    let out = dir.to_str().unwrap();
    let mut guest = Guest::spawn(&[
        "snapshot",
        "--kernel",
        &kernel,
        "--initrd",
        &initrd,
        "--cmdline",
        CMDLINE,
        "--memory",
        "256M",
        "--vcpus",
        "1",
        "--backend",
        backend,
        "--after",
        "2",
        "--wait-for",
        "counter 0",
        "--out",
        out,
    ]);
    let (before, first) = counters_until_exit(&mut guest, Duration::from_secs(500));
    println!(
        "TCG time: boot to the first counter line {:.2} s",
        (first.expect("a counter before the snapshot") - guest.started).as_secs_f64()
    );
    assert!(
        before.len() >= 5,
        "the guest ran before the pause: {before:?}"
    );
    before
}

/// Restores the snapshot in `dir` (`mode`) and checks the counter goes on from where it was
/// paused: the first value after the restore follows the last before it, and it keeps going.
fn restore_guest(dir: &std::path::Path, mode: &str, before: &[u64]) {
    let mut guest = Guest::spawn(&[
        "restore",
        dir.to_str().unwrap(),
        "--mode",
        mode,
        "--run-for",
        "20",
    ]);
    let (after, first) = counters_until_exit(&mut guest, Duration::from_secs(300));
    let last = *before.last().unwrap();
    println!(
        "TCG time: {mode} restore to the first counter line {:.2} s",
        (first.expect("a counter after the restore") - guest.started).as_secs_f64()
    );
    assert!(after.len() >= 10, "the restored guest goes on: {after:?}");
    assert!(
        after[0] > last && after[0] <= last + 2,
        "the counter goes on past {last}, not from the start: {after:?}"
    );
    assert!(after.windows(2).all(|w| w[1] == w[0] + 1), "{after:?}");
}

fn scratch(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("guestmem-linux-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// A paused snapshot of the Linux guest, restored in full and then lazily: each time the
/// counter goes on past its value at the pause (no restart, no hang).
#[test]
#[ignore = "needs ordinary KVM and a guest kernel: the kernel lab's linux suite runs it"]
fn linux_snapshot_restores_full_and_lazy_and_the_counter_goes_on() {
    let dir = scratch("snap");
    let before = snapshot_guest(&dir, "anon");
    restore_guest(&dir, "full", &before);
    restore_guest(&dir, "lazy", &before);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The same on memfd memory.
#[test]
#[ignore = "needs ordinary KVM and a guest kernel: the kernel lab's linux suite runs it"]
fn linux_snapshot_on_memfd_restores_and_the_counter_goes_on() {
    let dir = scratch("snap-memfd");
    let before = snapshot_guest(&dir, "memfd");
    restore_guest(&dir, "lazy", &before);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Migrates the Linux guest live (`mode`) between two guestmem processes over a Unix socket:
/// the counter the destination's console shows goes on past the last one the source showed.
fn migrate_guest(mode: &str) {
    let (kernel, initrd) = guest_files();
    let dir = scratch(&format!("migrate-{mode}"));
    std::fs::create_dir_all(&dir).unwrap();
    let keys = dir.join("keys");
    let keys = keys.to_str().unwrap();
    let o = Command::new(GUESTMEM)
        .args(["migrate", "keys", "--out", keys])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let socket = format!("unix:{}", dir.join("m.sock").display());
    let mut destination = Guest::spawn(&[
        "migrate",
        "receive",
        "--linux",
        "--listen",
        &socket,
        "--keys",
        keys,
        "--run-for",
        "20",
    ]);
    let mut source = Guest::spawn(&[
        "migrate",
        "send",
        "--kernel",
        &kernel,
        "--initrd",
        &initrd,
        "--cmdline",
        CMDLINE,
        "--memory",
        "256M",
        "--vcpus",
        "1",
        "--after",
        "2",
        "--wait-for",
        "counter 0",
        "--to",
        &socket,
        "--keys",
        keys,
        "--mode",
        mode,
    ]);
    let (before, _) = counters_until_exit(&mut source, Duration::from_secs(500));
    let (after, _) = counters_until_exit(&mut destination, Duration::from_secs(300));
    let last = *before.last().expect("the source's guest counted");
    assert!(after.len() >= 10, "the migrated guest goes on: {after:?}");
    assert!(
        after[0] > last && after[0] <= last + 2,
        "the counter goes on past {last} after the {mode} migration: {after:?}"
    );
    assert!(after.windows(2).all(|w| w[1] == w[0] + 1), "{after:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Pre-copy migration of the Linux guest: the counter goes on.
#[test]
#[ignore = "needs ordinary KVM and a guest kernel: the kernel lab's linux suite runs it"]
fn linux_precopy_migration_and_the_counter_goes_on() {
    migrate_guest("precopy");
}

/// Post-copy migration of the Linux guest: the counter goes on.
#[test]
#[ignore = "needs ordinary KVM and a guest kernel: the kernel lab's linux suite runs it"]
fn linux_postcopy_migration_and_the_counter_goes_on() {
    migrate_guest("postcopy");
}
