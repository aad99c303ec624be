//! guestmem's benchmarks, behind `guestmem bench …`: each measures one engine path against its baseline
//! and floor (one module per bench) and, with `--json`, prints one JSON object whose figures carry their unit
//! in their name, inside the result envelope every bench shares (`envelope`: the commit, the
//! host, the steal time, and per figure its runs, median, min and max).
//!
//! The `guestmem` CLI parses [`Bench`] as its `bench` subcommand and hands it to [`main`].

use clap::Subcommand;

mod cpu;
mod delay_proxy;
mod demand_paging;
mod dirty_log;
pub(crate) mod envelope;
mod fanout;
mod floor;
pub mod link;
mod memslots;
mod migrate;
mod observe;
mod populate;
mod qemu_migrate;
pub mod qemu_peer;
mod restore;
mod snapshot_store;
mod transport;
pub mod units;

/// Errors of any bench: each names what went wrong.
pub type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// The benches, as `guestmem bench`'s subcommands.
#[derive(Debug, Subcommand)]
pub enum Bench {
    /// Populating a region from an image, method by method, against mmap+memcpy.
    Populate(populate::Args),
    /// Demand paging rate with guestmem's pager vs the pre-populated baseline (KVM Userfault).
    DemandPaging(demand_paging::Args),
    /// memslot_perf_test over the memslot manager, and cached vs fresh device accesses.
    Memslots(memslots::Args),
    /// O(1) write-protect-all dirty tracking: dirty-page tracking per mode, like the kernel's
    /// dirty_log_perf_test.
    DirtyLog(dirty_log::Args),
    /// The CPU floor of a migration's ends on a real image (decompression and one
    /// copy into fresh memory; compression).
    Floor(floor::Args),
    /// Live migration per size, dirty rate and mode, beside QEMU's pre-copy.
    Migrate(migrate::Args),
    /// What a migration connection's TLS costs each end per GiB, with rustls and with the
    /// kernel's TLS where the kernel has it.
    Transport(transport::Args),
    /// The QEMU peer of `bench migrate`: the same workload live-migrated by QEMU's pre-copy.
    #[command(hide = true)]
    QemuMigrate(qemu_migrate::Args),
    /// Snapshot restore latency and time to a resident working set, per mode (Firecracker's
    /// restore-latency test).
    Restore(restore::Args),
    /// A snapshot of a guest from a real memory image in the chunk store (stored size, write
    /// rate, clones, restores from the store).
    Snapshot(snapshot_store::Args),
    /// Many clones of one snapshot restored at once, sharing one copy of its memory
    /// or not (readiness, memory growth), and a restore storm.
    Fanout(fanout::Args),
}

/// Runs one bench (the envelope's run starts here).
pub fn main(bench: Bench) -> Result<()> {
    envelope::start();
    match bench {
        Bench::Populate(args) => populate::main(args),
        Bench::DemandPaging(args) => demand_paging::main(args),
        Bench::Memslots(args) => memslots::main(args),
        Bench::DirtyLog(args) => dirty_log::main(args),
        Bench::Floor(args) => floor::main(args),
        Bench::Migrate(args) => migrate::main(args),
        Bench::Transport(args) => transport::main(args),
        Bench::QemuMigrate(args) => qemu_migrate::main(args),
        Bench::Restore(args) => restore::main(args),
        Bench::Snapshot(args) => snapshot_store::main(args),
        Bench::Fanout(args) => fanout::main(args),
    }
}

/// The host's steal time over an interval: the share of its CPUs' time that the hypervisor
/// under this machine gave to others while we wanted to run (`/proc/stat`, all CPUs). On a
/// virtual host, a latency tail measured while this is high is the hypervisor's.
pub(crate) struct Steal {
    at: std::time::Instant,
    ticks: Option<u64>,
}

impl Steal {
    pub(crate) fn start() -> Steal {
        Steal {
            at: std::time::Instant::now(),
            ticks: steal_ticks(),
        }
    }

    /// Percent of all CPUs' time since [`Steal::start`] (None where `/proc/stat` says nothing).
    pub(crate) fn percent(&self) -> Option<f64> {
        let ticks = steal_ticks()?.checked_sub(self.ticks?)?;
        // /proc/stat counts in USER_HZ, which Linux fixes at 100 for user space.
        let hz = 100.0;
        let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZero::get) as f64;
        let secs = self.at.elapsed().as_secs_f64();
        (secs > 0.0).then(|| ticks as f64 * 100.0 / (hz * cpus * secs))
    }
}

/// The `steal` column of `/proc/stat`'s `cpu` line, in clock ticks.
fn steal_ticks() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let cpu = stat.lines().find(|l| l.starts_with("cpu "))?;
    cpu.split_whitespace().nth(8)?.parse().ok()
}

/// For the benches' tests: `argv` parsed as bench `A`'s arguments.
#[cfg(test)]
pub(crate) fn parse<A: clap::Args>(argv: &[&str]) -> std::result::Result<A, clap::Error> {
    #[derive(clap::Parser)]
    struct Cli<A: clap::Args> {
        #[command(flatten)]
        args: A,
    }
    <Cli<A> as clap::Parser>::try_parse_from(std::iter::once("bench").chain(argv.iter().copied()))
        .map(|cli| cli.args)
}

/// For the benches' tests: what bench `main` says of the arguments `argv`, which it must refuse
/// before doing any work.
#[cfg(test)]
pub(crate) fn refusal<A: clap::Args>(argv: &[&str], main: fn(A) -> Result<()>) -> String {
    main(parse(argv).expect("the arguments parse"))
        .expect_err("refused")
        .to_string()
}
