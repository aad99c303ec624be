//! `guestmem demo --kernel BZIMAGE --initrd CPIO`: the demo with a Linux guest, for a host
//! whose KVM runs ordinary kernels (the kernel lab, or any host with kvm_intel/kvm_amd). A
//! guestmem process boots the guest and streams its console, pauses it once its init counts
//! and writes a snapshot; a second guestmem process restores the snapshot lazily (the guest
//! runs at once, its memory paged in on first access) and streams the console on, and the
//! demo shows the guest's counter going on past the value it had at the pause. The guest is
//! the busybox initramfs of scripts/linux-guest-initramfs.sh (its init prints `counter N
//! UPTIME` every 100 ms). Every bad input is refused before anything runs, as `run --kernel`
//! refuses it (a PVM host names the kernel lab).

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::linux::LinuxArgs;
use crate::vm_args::VmArgs;

/// What the demo's Linux guest is: its files and command line, its memory.
pub struct Guest<'a> {
    pub kernel: &'a Path,
    pub initrd: Option<&'a Path>,
    pub cmdline: &'a str,
    pub memory: u64,
    /// The console line after which the guest runs `after` seconds before its snapshot.
    pub wait_for: &'a str,
    /// Seconds the guest runs before the pause, and after the restore.
    pub after: f64,
}

/// The counters a guestmem process's console showed.
#[derive(Debug, Default, PartialEq)]
struct Counters {
    first: Option<u64>,
    last: Option<u64>,
    lines: usize,
}

impl Counters {
    /// Takes one console line: `counter N ...` counts.
    fn take(&mut self, line: &str) {
        let n = line
            .trim_start_matches(|c: char| c.is_control())
            .strip_prefix("counter ")
            .and_then(|r| r.split_whitespace().next())
            .and_then(|n| n.parse::<u64>().ok());
        if let Some(n) = n {
            self.first.get_or_insert(n);
            self.last = Some(n);
            self.lines += 1;
        }
    }
}

/// Checks `guest` (refusing bad input and a PVM host before anything runs), then the demo.
pub fn main(guest: &Guest<'_>) -> crate::Result<()> {
    let vm = VmArgs {
        memory: guest.memory,
        vcpus: 1,
        backend: guestmem_memory::Backend::Anon,
        image: None,
    };
    let linux = LinuxArgs {
        kernel: Some(guest.kernel.to_path_buf()),
        initrd: guest.initrd.map(Path::to_path_buf),
        cmdline: guest.cmdline.to_string(),
        ..LinuxArgs::default()
    };
    linux.plan(&vm)?;
    let dir = std::env::temp_dir().join(format!("guestmem-demo-linux-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let result = run(guest, &dir.join("snapshot"));
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// Runs `guestmem ARGS`, its console (stdout) streamed to this process's stdout, prefixed
/// with `who`; the counters it showed. Fails naming `what` if the process fails.
fn streamed(who: &str, what: &str, args: &[std::ffi::OsString]) -> crate::Result<Counters> {
    let mut child = Command::new(std::env::current_exe()?)
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start the guestmem that {what}: {e}"))?;
    let stdout = child.stdout.take().ok_or("the child's stdout is piped")?;
    let mut seen = Counters::default();
    let mut out = std::io::stdout().lock();
    for line in BufReader::new(stdout).split(b'\n') {
        let line = String::from_utf8_lossy(&line?).trim_end().to_string();
        seen.take(&line);
        writeln!(out, "{who} | {line}")?;
        out.flush()?;
    }
    drop(out);
    let status = child.wait()?;
    if !status.success() {
        return Err(format!("the guestmem that {what} failed ({status})").into());
    }
    Ok(seen)
}

fn run(guest: &Guest<'_>, snap: &Path) -> crate::Result<()> {
    println!(
        "guestmem demo: a Linux guest ({}, {} MiB, 1 vCPU) boots and its console streams below; \
         {} s after it prints '{}' it is paused and snapshotted, then a second guestmem \
         process restores it lazily and it goes on",
        guest.kernel.display(),
        guest.memory >> 20,
        guest.after,
        guest.wait_for
    );
    let mut args: Vec<std::ffi::OsString> = vec!["snapshot".into(), "--kernel".into()];
    args.push(guest.kernel.into());
    if let Some(initrd) = guest.initrd {
        args.extend(["--initrd".into(), PathBuf::from(initrd).into()]);
    }
    for (flag, value) in [
        ("--cmdline", guest.cmdline.to_string()),
        ("--memory", guest.memory.to_string()),
        ("--vcpus", "1".to_string()),
        ("--after", guest.after.to_string()),
        ("--wait-for", guest.wait_for.to_string()),
    ] {
        args.extend([flag.into(), value.into()]);
    }
    args.extend(["--out".into(), snap.as_os_str().to_owned()]);
    let before = streamed("boot   ", "boots and snapshots the guest", &args)?;
    let restore: Vec<std::ffi::OsString> = vec![
        "restore".into(),
        snap.as_os_str().to_owned(),
        "--mode".into(),
        "lazy".into(),
        "--run-for".into(),
        guest.after.to_string().into(),
    ];
    let after = streamed("restore", "restores the guest lazily", &restore)?;
    println!("{}", verdict(&before, &after)?);
    Ok(())
}

/// What the counters say: the guest went on past its value at the pause, or why not.
fn verdict(before: &Counters, after: &Counters) -> crate::Result<String> {
    let Some(paused) = before.last else {
        return Err(
            "the guest printed no 'counter N' line before its snapshot: the demo's guest is \
             the initramfs of scripts/linux-guest-initramfs.sh"
                .into(),
        );
    };
    let (Some(first), Some(last)) = (after.first, after.last) else {
        return Err(format!(
            "the restored guest printed no counter line (at the pause it was at {paused})"
        )
        .into());
    };
    if first <= paused || last <= first {
        return Err(format!(
            "the restored guest did not go on: its counter was {paused} at the pause, then \
             went from {first} to {last}"
        )
        .into());
    }
    Ok(format!(
        "the counter was {paused} at the pause; restored lazily, the guest went on from {first} \
         to {last} ({} lines): no restart, no hang",
        after.lines
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counters(lines: &[&str]) -> Counters {
        let mut c = Counters::default();
        for l in lines {
            c.take(l);
        }
        c
    }

    /// `demo` alone is the payload's demo (the Linux options' defaults need no --kernel);
    /// the Linux options given without --kernel are refused by name.
    #[test]
    fn the_linux_options_of_demo_need_kernel() {
        use crate::tests::parse_for_test as parse;
        assert!(parse(&["demo"]).is_ok());
        assert!(parse(&["demo", "--mode", "postcopy"]).is_ok());
        assert!(parse(&["demo", "--kernel", "bz", "--initrd", "c", "--memory", "512M"]).is_ok());
        for flag in [["--memory", "512M"], ["--after", "2"], ["--initrd", "c"]] {
            let e = parse(&["demo", flag[0], flag[1]]).err().unwrap();
            assert!(e.contains("--kernel"), "{e}");
        }
        let e = parse(&["demo", "--kernel", "bz", "--plot", "p.svg"])
            .err()
            .unwrap();
        assert!(e.contains("cannot be used with"), "{e}");
    }

    /// Counter lines are read from the console (other lines ignored), and the verdict holds
    /// only when the restored guest counts on past the pause.
    #[test]
    fn the_verdict_wants_the_counter_to_go_on_past_the_pause() {
        let before = counters(&["[    0.1] Linux", "counter 1 0.50", "counter 2 0.60", "x"]);
        assert_eq!(
            before,
            Counters {
                first: Some(1),
                last: Some(2),
                lines: 2
            }
        );
        let on = counters(&["counter 3 0.70", "counter 4 0.80"]);
        let ok = verdict(&before, &on).unwrap();
        assert!(ok.contains("was 2 at the pause"), "{ok}");
        let restarted = counters(&["counter 1 0.10", "counter 2 0.20"]);
        let e = verdict(&before, &restarted).unwrap_err().to_string();
        assert!(e.contains("did not go on"), "{e}");
        let hung = counters(&["counter 3 0.70"]);
        assert!(verdict(&before, &hung).is_err());
        let e = verdict(&before, &Counters::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("no counter line"), "{e}");
        let e = verdict(&Counters::default(), &on).unwrap_err().to_string();
        assert!(e.contains("linux-guest-initramfs.sh"), "{e}");
    }
}
