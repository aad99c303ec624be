//! `guestmem`: the command-line face of the guestmem engine.

mod demo;
mod demo_linux;
mod linux;
mod linux_clones;
mod linux_migrate;
mod linux_snapshot;
mod migrate;
mod numa;
mod page_server;
mod populate;
mod probe;
mod progress;
mod report;
mod run;
mod snapshot;
mod vm_args;
mod working_set;
mod write_payload;

use guestmem_bench::units;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "guestmem", version = guestmem_sys::release::LONG_VERSION, about = "Guest memory engine for KVM VMMs")]
struct Cli {
    /// How long an object store (s3://…) may answer nothing before the operation fails, in
    /// seconds; every command that reads or writes a store (restore, snapshot, page-server,
    /// merge, gc, delete) keeps to it. A request the store has not answered for 2 s is
    /// reported on stderr as a stall (naming the store and the object); a stall shorter than
    /// this is ridden out with nothing lost; one this long fails the command naming the store,
    /// the object and how long it waited (a lazily restored guest is stopped, never run
    /// without its memory, and the chunks never fetched are named). A server error (5xx) is
    /// retried at most twice within the bound; a refusal (4xx) is not retried.
    #[arg(long, global = true, value_name = "SECONDS", default_value_t = 30.0)]
    store_timeout: f64,
    #[command(subcommand)]
    command: Command,
}

/// The store timeout policy of this run (`--store-timeout`).
static STORE_OPTIONS: std::sync::OnceLock<guestmem_store::StoreOptions> =
    std::sync::OnceLock::new();

/// The options every store this run opens is under.
pub(crate) fn store_options() -> guestmem_store::StoreOptions {
    STORE_OPTIONS.get().cloned().unwrap_or_default()
}

/// `--store-timeout SECONDS` as the store's options.
fn parse_store_options(seconds: f64) -> Result<guestmem_store::StoreOptions> {
    let mut options =
        guestmem_store::StoreOptions::with_timeout(units::seconds(seconds, "--store-timeout")?);
    options.on_stall = Some(std::sync::Arc::new(progress::store_stall));
    options
        .check()
        .map_err(|e| format!("--store-timeout: {e}"))?;
    Ok(options)
}

#[derive(Subcommand)]
enum Command {
    /// Migrate a running 1 GiB VM live to a second guestmem process, and show it went on (with
    /// --kernel: snapshot a Linux guest, restore it lazily, and show it went on).
    Demo(demo::Args),
    /// Live migration between two guestmem processes or hosts.
    #[command(subcommand)]
    Migrate(migrate::Migrate),
    /// Show what the running kernel offers for guest memory (asked, never assumed).
    Probe(probe::Args),
    /// Run a VM executing a guest workload and print what the guest did.
    Run(run::Args),
    /// Run a VM's `dirty` workload, pause it, and write a snapshot of it (to a directory or a
    /// chunk store); or merge, collect or delete store snapshots.
    #[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
    Snapshot(snapshot::SnapshotArgs),
    /// Restore a snapshot and let the guest carry on.
    Restore(snapshot::RestoreArgs),
    /// Serve lazily restored VMs' memory over Firecracker's userfaultfd socket protocol.
    PageServer(page_server::Args),
    /// Write the guest payload out (a PVH ELF) so that other VMMs run the same workload.
    Payload(write_payload::Args),
    /// Fill a fresh region from an image file by the fastest method, and say which one.
    Populate(populate::Args),
    /// Place a region's pages by NUMA policy and show where they are, per host node.
    Numa(numa::Args),
    /// Benchmarks: each engine path measured against its baseline and floor.
    #[command(subcommand)]
    Bench(guestmem_bench::Bench),
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match parse_store_options(cli.store_timeout) {
        Ok(options) => {
            let _ = STORE_OPTIONS.set(options);
        }
        Err(e) => {
            eprintln!("guestmem: error: {}", error_text(&*e));
            std::process::exit(2);
        }
    }
    let result = match cli.command {
        Command::Demo(args) => demo::main(args),
        Command::Migrate(cmd) => migrate::main(cmd),
        Command::Probe(args) => probe::main(args),
        Command::Run(args) => run::main(args),
        Command::Snapshot(args) => snapshot::snapshot(args),
        Command::Restore(args) => snapshot::restore(args),
        Command::PageServer(args) => page_server::main(args),
        Command::Payload(args) => write_payload::main(args),
        Command::Populate(args) => populate::main(args),
        Command::Numa(args) => numa::main(args),
        Command::Bench(bench) => guestmem_bench::main(bench),
    };
    if let Err(e) = result {
        eprintln!("guestmem: error: {}", error_text(&*e));
        std::process::exit(1);
    }
}

/// An error and its chain of causes, each cause printed once, on a line of its own (guestmem's
/// errors keep a cause out of their message; a cause whose text the message or an earlier cause
/// already carries, as some other crates' errors print their source, is left out).
pub fn error_text(e: &(dyn std::error::Error + 'static)) -> String {
    guestmem_migration::error_chain(e, "\n  caused by: ")
}

/// Errors of any command: each names what went wrong.
pub type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

#[cfg(test)]
mod tests {
    use super::error_text;
    use clap::Parser;

    /// The command line `args` (after `guestmem`), parsed, or clap's message.
    pub(crate) fn parse_for_test(args: &[&str]) -> std::result::Result<super::Command, String> {
        super::Cli::try_parse_from(std::iter::once("guestmem").chain(args.iter().copied()))
            .map(|c| c.command)
            .map_err(|e| e.to_string())
    }

    #[derive(Debug, thiserror::Error)]
    #[error("outer: {inner}")]
    struct InMessageAndSource {
        #[source]
        inner: std::io::Error,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct InSourceOnly {
        #[source]
        inner: std::io::Error,
    }

    /// `--store-timeout` defaults to 30 s, is taken after any subcommand, and a bound that is
    /// none is refused naming the flag.
    #[test]
    fn the_store_timeout_defaults_to_30_s_and_is_a_global_flag() {
        use clap::Parser;
        let cli = super::Cli::try_parse_from(["guestmem", "snapshot", "gc", "store:/s"]).unwrap();
        let o = super::parse_store_options(cli.store_timeout).unwrap();
        assert_eq!(o.timeout, std::time::Duration::from_secs(30));
        assert_eq!(o.timeout, guestmem_store::DEFAULT_STORE_TIMEOUT);
        let cli = super::Cli::try_parse_from([
            "guestmem",
            "restore",
            "s3://b/p/vm",
            "--store-timeout",
            "4.5",
        ])
        .unwrap();
        let o = super::parse_store_options(cli.store_timeout).unwrap();
        assert_eq!(o.timeout, std::time::Duration::from_millis(4500));
        for bad in [0.0, -1.0, 0.01] {
            let e = super::parse_store_options(bad).unwrap_err().to_string();
            assert!(e.contains("--store-timeout"), "{e}");
        }
    }

    #[test]
    fn each_cause_is_printed_once() {
        let e = InMessageAndSource {
            inner: std::io::Error::other("the disk is on fire"),
        };
        let text = error_text(&e);
        assert_eq!(text, "outer: the disk is on fire");
        assert_eq!(text.matches("the disk is on fire").count(), 1);

        let e = InSourceOnly {
            inner: std::io::Error::other("the disk is on fire"),
        };
        assert_eq!(error_text(&e), "outer\n  caused by: the disk is on fire");
    }
}
