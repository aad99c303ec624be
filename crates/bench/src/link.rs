//! The link `bench migrate --link` runs a migration over: loopback (one network stack, as
//! before), or two network namespaces joined by a veth pair whose two ends are shaped by `tc`,
//! so that the source and the destination (guestmem's and QEMU's) meet a link of a real speed.
//!
//! Each end's egress gets a token bucket (`tbf`) at the link's rate: `tbf` keeps the rate with
//! veth's large (GSO) packets as long as its bucket holds a whole one, which the burst chosen
//! here does. Where the kernel has `netem`, each end also delays its packets by
//! [`DELAY_MS`] (netem as the child of tbf); where it has not (`CONFIG_NET_SCH_NETEM` unset),
//! the link has no added delay and [`Link::delay_ms_each_way`] says 0.
//!
//! The namespaces are named `gmlink-PID-N-src` and `gmlink-PID-N-dst`; they (and with them the
//! veth pair) are deleted when the [`Link`] is dropped, on errors and panics too. Namespaces of
//! an earlier run whose process is gone (killed before it could clean up) are deleted by
//! [`Link::create`].

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;

/// Prefix of the namespaces this module creates.
const PREFIX: &str = "gmlink-";
/// The delay each end adds to its packets where the kernel has `netem`.
pub const DELAY_MS: f64 = 0.25;
/// The source's and the destination's addresses on the veth pair.
pub const SOURCE_IP: &str = "10.213.0.1";
/// The destination's address on the veth pair.
pub const DESTINATION_IP: &str = "10.213.0.2";

static LINK_ID: AtomicUsize = AtomicUsize::new(0);

/// `--link`: the link a migration runs over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
pub enum Speed {
    /// One network stack, 127.0.0.1: no shaping.
    #[value(name = "loopback")]
    #[serde(rename = "loopback")]
    Loopback,
    /// Two namespaces joined by a veth pair shaped to 10 Gbit/s each way.
    #[value(name = "10gbit")]
    #[serde(rename = "10gbit")]
    TenGbit,
    /// Two namespaces joined by a veth pair shaped to 1 Gbit/s each way.
    #[value(name = "1gbit")]
    #[serde(rename = "1gbit")]
    OneGbit,
}

impl Speed {
    /// Its name as `--link` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Speed::Loopback => "loopback",
            Speed::TenGbit => "10gbit",
            Speed::OneGbit => "1gbit",
        }
    }

    /// The shaped rate, bits per second (None: loopback, unshaped).
    pub fn bits_per_s(self) -> Option<u64> {
        match self {
            Speed::Loopback => None,
            Speed::TenGbit => Some(10_000_000_000),
            Speed::OneGbit => Some(1_000_000_000),
        }
    }
}

/// Which end of the link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The source's namespace.
    Source,
    /// The destination's namespace.
    Destination,
}

/// Two namespaces and the shaped veth pair between them; deleted when dropped.
#[derive(Debug)]
pub struct Link {
    source_ns: String,
    destination_ns: String,
    delay_ms: f64,
}

impl Link {
    /// Creates the namespaces `gmlink-PID-N-{src,dst}`, the veth pair between them
    /// ([`SOURCE_IP`] and [`DESTINATION_IP`], /24), and shapes both ends to `speed` (which
    /// must not be loopback). Needs root and `ip` and `tc` (iproute2); errors say which is
    /// missing, or what `ip`/`tc` said.
    #[allow(clippy::cast_possible_truncation)] // a delay of a few milliseconds.
    pub fn create(speed: Speed) -> crate::Result<Link> {
        let rate = speed
            .bits_per_s()
            .ok_or("loopback needs no namespaces: it is the host's own stack")?;
        if !is_root() {
            return Err(format!(
                "--link {}: creating network namespaces and shaping a veth pair needs root",
                speed.name()
            )
            .into());
        }
        clean_stale();
        let n = LINK_ID.fetch_add(1, Ordering::Relaxed);
        let base = format!("{PREFIX}{}-{n}", std::process::id());
        let mut link = Link {
            source_ns: format!("{base}-src"),
            destination_ns: format!("{base}-dst"),
            delay_ms: 0.0,
        };
        // From here on, dropping `link` deletes whatever was created.
        run("ip", &["netns", "add", &link.source_ns])?;
        run("ip", &["netns", "add", &link.destination_ns])?;
        run(
            "ip",
            &[
                "link",
                "add",
                "veth0",
                "netns",
                &link.source_ns,
                "type",
                "veth",
                "peer",
                "name",
                "veth1",
                "netns",
                &link.destination_ns,
            ],
        )?;
        // A burst of 1 ms at the rate, at least 256 KiB: whole GSO packets fit the bucket.
        let burst = (rate / 8 / 1000).max(256 << 10);
        let mut netem = true;
        for (ns, dev, ip) in [
            (&link.source_ns, "veth0", SOURCE_IP),
            (&link.destination_ns, "veth1", DESTINATION_IP),
        ] {
            run(
                "ip",
                &["-n", ns, "addr", "add", &format!("{ip}/24"), "dev", dev],
            )?;
            run("ip", &["-n", ns, "link", "set", dev, "up"])?;
            run("ip", &["-n", ns, "link", "set", "lo", "up"])?;
            run(
                "tc",
                &[
                    "-n",
                    ns,
                    "qdisc",
                    "add",
                    "dev",
                    dev,
                    "root",
                    "handle",
                    "1:",
                    "tbf",
                    "rate",
                    &format!("{rate}bit"),
                    "burst",
                    &burst.to_string(),
                    "latency",
                    "10ms",
                ],
            )?;
            if netem {
                let delay = format!("{}us", (DELAY_MS * 1000.0) as u64);
                let added = run(
                    "tc",
                    &[
                        "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:",
                        "netem", "delay", &delay, "limit", "100000",
                    ],
                );
                if let Err(e) = added {
                    tracing::warn!(
                        "no delay on the shaped link (the kernel has no netem qdisc?): {e}"
                    );
                    netem = false;
                }
            }
        }
        link.delay_ms = if netem { DELAY_MS } else { 0.0 };
        Ok(link)
    }

    /// The delay each end adds (0 where the kernel has no netem).
    pub fn delay_ms_each_way(&self) -> f64 {
        self.delay_ms
    }

    /// The namespace of `side`.
    pub fn namespace(&self, side: Side) -> &str {
        match side {
            Side::Source => &self.source_ns,
            Side::Destination => &self.destination_ns,
        }
    }

    /// The address of `side` on the veth pair.
    pub fn ip(side: Side) -> &'static str {
        match side {
            Side::Source => SOURCE_IP,
            Side::Destination => DESTINATION_IP,
        }
    }

    /// A command that runs `program` in `side`'s namespace (`ip netns exec`, which execs it:
    /// the child's pid is the program's).
    pub fn command(&self, side: Side, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", self.namespace(side), program]);
        c
    }

    /// Runs `f` on a thread that has entered `side`'s network namespace: the sockets it
    /// creates (a listener, connections) belong to that namespace for their whole life, so
    /// the threads that later use them may be anywhere.
    pub fn run_in<T: Send>(
        &self,
        side: Side,
        f: impl FnOnce() -> crate::Result<T> + Send,
    ) -> crate::Result<T> {
        let path = format!("/run/netns/{}", self.namespace(side));
        let ns = std::fs::File::open(&path).map_err(|e| format!("{path}: cannot open: {e}"))?;
        std::thread::scope(|s| {
            std::thread::Builder::new()
                .name("link-setns".into())
                .spawn_scoped(s, move || {
                    // A network namespace is per thread: entering it here leaves the rest of
                    // the process where it was.
                    nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                        .map_err(|e| format!("cannot enter the namespace {path}: {e}"))?;
                    f()
                })?
                .join()
                .map_err(|_| -> Box<dyn std::error::Error + Send + Sync> {
                    "a thread in a link namespace panicked".into()
                })?
        })
    }

    /// Moves bytes from the source's namespace to the destination's over one TCP connection
    /// for `duration` and returns what the receiver got, bytes per second.
    pub fn measure(&self, duration: Duration) -> crate::Result<f64> {
        let listener = self.run_in(Side::Destination, || {
            Ok(TcpListener::bind((DESTINATION_IP, 0))
                .map_err(|e| format!("cannot listen on {DESTINATION_IP}: {e}"))?)
        })?;
        let port = listener.local_addr()?.port();
        let receiver = std::thread::spawn(move || -> std::io::Result<(u64, Duration)> {
            let (mut c, _) = listener.accept()?;
            let mut buf = vec![0u8; 1 << 20];
            let mut n = 0u64;
            let mut first = None;
            loop {
                let got = c.read(&mut buf)?;
                if got == 0 {
                    break;
                }
                first.get_or_insert_with(Instant::now);
                n += got as u64;
            }
            Ok((n, first.map_or(Duration::ZERO, |t| t.elapsed())))
        });
        let mut c = self.run_in(Side::Source, || {
            Ok(TcpStream::connect((DESTINATION_IP, port))
                .map_err(|e| format!("cannot connect to {DESTINATION_IP}:{port}: {e}"))?)
        })?;
        let buf = vec![0x5au8; 1 << 20];
        let end = Instant::now() + duration;
        while Instant::now() < end {
            c.write_all(&buf)?;
        }
        drop(c);
        let (n, secs) = receiver
            .join()
            .map_err(|_| "the receiving thread panicked")??;
        Ok(n as f64 / secs.as_secs_f64().max(1e-9))
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        // Deleting a namespace deletes the veth end inside it (and so the pair).
        for ns in [&self.source_ns, &self.destination_ns] {
            let _ = Command::new("ip")
                .args(["netns", "del", ns])
                .stderr(std::process::Stdio::null())
                .status();
        }
    }
}

/// Whether this process runs as root (the owner of `/proc/self` is its effective user).
fn is_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// The namespaces (of this module's naming) that exist now.
pub fn namespaces() -> Vec<String> {
    let out = Command::new("ip").args(["netns", "list"]).output();
    let Ok(out) = out else {
        return Vec::new();
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(PREFIX))
        .map(str::to_string)
        .collect()
}

/// Deletes namespaces left by runs whose process no longer exists.
fn clean_stale() {
    for ns in namespaces() {
        let pid = ns
            .strip_prefix(PREFIX)
            .and_then(|r| r.split('-').next())
            .and_then(|p| p.parse::<u32>().ok());
        let alive = pid.is_some_and(|p| std::path::Path::new(&format!("/proc/{p}")).exists());
        if !alive {
            tracing::info!(namespace = %ns, "deleting a namespace left by an earlier run");
            let _ = Command::new("ip").args(["netns", "del", &ns]).status();
        }
    }
}

/// Runs `program args`; its failure is an error naming the command and what it said.
fn run(program: &str, args: &[&str]) -> crate::Result<()> {
    let out = Command::new(program).args(args).output().map_err(
        |e| -> Box<dyn std::error::Error + Send + Sync> {
            if e.kind() == std::io::ErrorKind::NotFound {
                format!("{program} not found: install iproute2 (scripts/setup.sh does)").into()
            } else {
                format!("cannot run {program}: {e}").into()
            }
        },
    )?;
    if !out.status.success() {
        return Err(format!(
            "{program} {} failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )
        .into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 1 Gbit/s link really limits throughput, and its namespaces are gone after it.
    #[test]
    fn shaped_link_limits_throughput_and_is_cleaned_up() {
        if !is_root() {
            eprintln!("skipped: needs root for network namespaces");
            return;
        }
        let link = Link::create(Speed::OneGbit).expect("a 1 Gbit/s link");
        let names = [
            link.namespace(Side::Source).to_string(),
            link.namespace(Side::Destination).to_string(),
        ];
        assert!(names.iter().all(|n| namespaces().contains(n)));
        let started = Instant::now();
        let rate = link.measure(Duration::from_secs(2)).expect("a transfer");
        // 1 Gbit/s is 125e6 bytes/s on the wire, headers included: what moves is below it.
        assert!(rate <= 125e6, "{rate} bytes/s through a 1 Gbit/s link");
        assert!(
            rate >= 60e6,
            "{rate} bytes/s: the link is far slower than asked"
        );
        assert!(started.elapsed() < Duration::from_secs(10));
        drop(link);
        let left = namespaces();
        assert!(
            names.iter().all(|n| !left.contains(n)),
            "namespaces left behind: {left:?}"
        );
    }

    #[test]
    fn loopback_makes_no_namespaces() {
        let e = Link::create(Speed::Loopback).unwrap_err().to_string();
        assert!(e.contains("loopback"), "{e}");
    }
}
