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
/// The guest's command line in these tests: the default, quiet, init from the initramfs.
const CMDLINE: &str = "console=ttyS0 reboot=k panic=1 pci=off nomodule i8042.noaux i8042.nomux \
                       i8042.dumbkbd rdinit=/init quiet";

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
