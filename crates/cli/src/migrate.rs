//! `guestmem migrate send|receive|resume|keys`: live migration between two guestmem processes,
//! and the report it ends with.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use guestmem_migration::compress::Compress;
use guestmem_migration::migrate::{self, Links, Mode, ReceiveOptions, Report, SendOptions};
use guestmem_migration::transport::{generate_credentials, Credentials, Endpoint, Listener, Role};
use guestmem_migration::MigrationError;
use guestmem_vm::{layout, VcpuWork, Vm, Workload};
use serde::Serialize;

use crate::progress::{with_metrics, MetricsArgs, Progress, ProgressArgs};
use crate::vm_args::VmArgs;

#[derive(clap::Subcommand)]
pub enum Migrate {
    /// Run a VM's `dirty` workload and migrate it live to a `migrate receive`.
    Send(Box<SendArgs>),
    /// Wait for a migration, then run the VM it brings.
    Receive(ReceiveArgs),
    /// Re-establish a broken post-copy link: asks the waiting `migrate send` to reconnect.
    Resume(ResumeArgs),
    /// Write a migration CA and a certificate and key for each side into a directory.
    Keys(KeysArgs),
}

#[derive(clap::Args)]
pub struct SendArgs {
    /// Where the destination listens: tcp:HOST:PORT or unix:PATH.
    #[arg(long)]
    pub to: Endpoint,
    /// Directory with the migration CA and this side's certificate (see `migrate keys`).
    #[arg(long)]
    pub keys: PathBuf,
    #[command(flatten)]
    pub how: HowArgs,
    #[command(flatten)]
    pub vm: VmArgs,
    #[command(flatten)]
    pub linux: crate::linux::LinuxArgs,
    /// The guest's dirty rate in MiB/s over all vCPUs, after it has filled its memory once
    /// (0: as fast as it goes).
    #[arg(long, default_value_t = 64)]
    pub dirty_mib_per_s: u64,
    /// How long the guest runs before the migration starts, in seconds.
    #[arg(long, default_value_t = 1.0)]
    pub after: f64,
    /// Run the `rewrite` workload instead of `dirty`: 2-33 lines of each page rewritten with
    /// bytes from another page (with `--image`: memory as dense as a real guest's).
    #[arg(long)]
    pub rewrite: bool,
    /// Unix socket on which a broken post-copy waits for `guestmem migrate resume`
    /// (default: /tmp/guestmem-migrate-PID.sock).
    #[arg(long)]
    pub control: Option<PathBuf>,
    /// Print the report as one JSON object.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub progress: ProgressArgs,
    /// Draw dirty pages and bandwidth per round over time into this SVG file.
    #[arg(long, value_name = "FILE")]
    pub plot: Option<PathBuf>,
}

/// How to migrate (shared by `migrate send` and `demo`).
#[derive(clap::Args)]
pub struct HowArgs {
    /// precopy: rounds while the guest runs; postcopy: switch at once, pages on demand;
    /// hybrid: one pre-copy round, then post-copy.
    #[arg(long, default_value = "precopy")]
    pub mode: Mode,
    /// Pre-copy stops the guest once the rest fits in this many milliseconds.
    #[arg(long, default_value_t = 50)]
    pub downtime_ms: u64,
    /// Connections sharing the page transfer.
    #[arg(long, default_value_t = migrate::DEFAULT_CONNECTIONS)]
    pub connections: usize,
    /// Cap on the transfer's bandwidth, in MiB/s.
    #[arg(long)]
    pub max_bandwidth_mib_per_s: Option<u64>,
    /// Never throttle the guest's vCPUs to make pre-copy converge.
    #[arg(long)]
    pub no_auto_converge: bool,
    /// Check at switch-over that both sides' memory digests are equal (each side keeps a digest
    /// per chunk of memory as the rounds go: the downtime grows by the re-hashing of the chunks
    /// the last round writes).
    #[arg(long)]
    pub verify: bool,
    /// Local migration (unix: endpoint): hand the memfd / hugetlbfs memory files to the
    /// destination instead of copying their pages.
    #[arg(long)]
    pub share_memory: bool,
    /// Send pages whole, zero lines included (as QEMU does), instead of only their non-zero
    /// 64-byte lines: for comparisons.
    #[arg(long)]
    pub whole_pages: bool,
    /// Compression of the pages sent: none, lz4, zstd, or auto (whichever moves pages fastest
    /// as measured while migrating: compressing pays on a slow link, not on a fast one; the
    /// default).
    #[arg(long, default_value = "auto")]
    pub compress: Compress,
    /// Pre-copy: MiB of the cache of pages' last versions sent, against which re-dirtied pages
    /// travel as deltas (default 0: no deltas; it pays when the guest re-dirties the same pages
    /// between rounds, and 4 % of guest memory is the size `bench migrate` calls `auto`).
    #[arg(long)]
    pub delta_cache_mib: Option<u64>,
    /// With zstd (`--compress zstd`, or `auto` when it picks zstd), pre-copy: the window in MiB
    /// of the zstd stream each pages connection compresses its frames with (a power of two; it
    /// reaches back over the pages sent before on the connection, and costs about its size in
    /// memory per connection on each side); `off` or 0: each frame compressed on its own.
    #[arg(
        long = "zstd-window-mib",
        value_name = "MIB",
        default_value = "off",
        value_parser = guestmem_migration::compress::parse_zstd_window_mib
    )]
    pub zstd_window_bytes: u64,
    /// Post-copy and hybrid: host CPUs for the threads answering the destination's faults,
    /// e.g. 0. On one host, give the destination's `--fault-cpus` the same CPU.
    #[arg(long, value_delimiter = ',')]
    pub fault_cpus: Option<Vec<usize>>,
    /// Post-copy and hybrid, after the link broke: seconds during which nothing may listen at
    /// the destination's endpoint before the destination is taken for dead (twice this, when it
    /// listens but no reconnection succeeds); the source then keeps what it holds in a snapshot
    /// and exits with an error.
    #[arg(long, default_value_t = migrate::DEAD_PEER_TIMEOUT.as_secs_f64())]
    pub dead_after: f64,
}

#[derive(clap::Args)]
pub struct ReceiveArgs {
    /// Where to listen: tcp:HOST:PORT or unix:PATH.
    #[arg(long)]
    pub listen: Endpoint,
    /// Directory with the migration CA and this side's certificate (see `migrate keys`).
    #[arg(long)]
    pub keys: PathBuf,
    /// How long to let the migrated guest run before stopping it, in seconds.
    #[arg(long, default_value_t = 2.0)]
    pub run_for: f64,
    /// Post-copy and hybrid: host CPUs for the fault handlers and the other pager threads,
    /// e.g. 0 (on one host, the source's `--fault-cpus` too).
    #[arg(long, value_delimiter = ',')]
    pub fault_cpus: Option<Vec<usize>>,
    /// Print the outcome as one JSON object (with --linux: the last line on stdout, after the
    /// guest's console).
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub progress: ProgressArgs,
    #[command(flatten)]
    pub metrics: MetricsArgs,
    /// Receive a Linux guest (from `migrate send --kernel ...`); its console streams to
    /// stdout once it runs here.
    #[arg(long)]
    pub linux: bool,
    /// With --linux: write the guest's console to FILE instead of stdout.
    #[arg(long, value_name = "FILE", requires = "linux")]
    pub console: Option<PathBuf>,
}

#[derive(clap::Args)]
pub struct ResumeArgs {
    /// The control socket the waiting `migrate send` named.
    #[arg(long)]
    pub control: PathBuf,
    /// Reconnect to this endpoint instead of the original one.
    #[arg(long)]
    pub to: Option<Endpoint>,
}

#[derive(clap::Args)]
pub struct KeysArgs {
    /// Directory to write ca.pem and each side's certificate and key into.
    #[arg(long)]
    pub out: PathBuf,
}

pub fn main(cmd: Migrate) -> crate::Result<()> {
    match cmd {
        Migrate::Send(args) => send_main(*args),
        Migrate::Receive(args) => receive_main(args),
        Migrate::Resume(args) => resume_main(args),
        Migrate::Keys(args) => {
            generate_credentials(&args.out)?;
            println!(
                "{}: migration CA and both sides' certificates written; give both sides this \
                 directory (--keys)",
                args.out.display()
            );
            Ok(())
        }
    }
}

/// `s` seconds given to `flag`: zero, or what [`crate::units::seconds`] accepts (a value a
/// clock cannot hold is refused, naming the flag).
fn seconds(s: f64, flag: &str) -> crate::Result<Duration> {
    if s == 0.0 {
        return Ok(Duration::ZERO);
    }
    Ok(crate::units::seconds(s, flag)?)
}

/// The `dirty` workload at `mib_per_s` over all vCPUs, memory filled first.
pub fn dirty_work(vm: &VmArgs, mib_per_s: u64) -> Vec<VcpuWork> {
    let pages_per_s =
        (mib_per_s > 0).then(|| (mib_per_s.saturating_mul(256) / (vm.vcpus as u64).max(1)).max(1));
    let dirty = Workload::Dirty {
        pages_per_s,
        passes: None,
        fill_first: true,
    };
    VcpuWork::split(dirty, layout::RAM_GPA, vm.memory, vm.vcpus, 1)
}

impl HowArgs {
    pub fn options(&self) -> crate::Result<SendOptions> {
        if self.connections == 0 || self.connections > 64 {
            return Err(format!("--connections must be 1 to 64, not {}", self.connections).into());
        }
        let max_bandwidth = match self.max_bandwidth_mib_per_s {
            None => None,
            Some(m) if m < self.connections as u64 => {
                return Err(format!(
                    "--max-bandwidth-mib-per-s {m} is refused: at least 1 MiB/s per connection \
                     ({} with --connections {}) is needed, or the migration never finishes",
                    self.connections, self.connections
                )
                .into())
            }
            Some(m) => Some(m.checked_mul(1 << 20).ok_or_else(|| {
                format!("--max-bandwidth-mib-per-s {m} is refused: more bytes/s than 64 bits hold")
            })?),
        };
        Ok(SendOptions {
            mode: self.mode,
            downtime: Duration::from_millis(self.downtime_ms),
            auto_converge: !self.no_auto_converge,
            max_bandwidth,
            verify: self.verify,
            share_memory: self.share_memory,
            whole_pages: self.whole_pages,
            compress: self.compress,
            delta_cache_bytes: match self.delta_cache_mib {
                None => Some(0),
                Some(m) => Some(m.checked_mul(1 << 20).ok_or_else(|| {
                    format!("--delta-cache-mib {m} is refused: more bytes than 64 bits hold")
                })?),
            },
            zstd_window_bytes: self.zstd_window_bytes,
            fault_cpus: self.fault_cpus.clone(),
            ..Default::default()
        })
    }
}

fn send_main(args: SendArgs) -> crate::Result<()> {
    args.vm.config()?;
    let plan = args.linux.plan(&args.vm)?;
    let creds = Credentials::load(&args.keys, Role::Source)?;
    if let Some(plan) = plan {
        let after = seconds(args.after, "--after")?;
        let opts = args.how.options()?;
        let report = crate::linux_migrate::send(
            &args.vm,
            &args.linux,
            plan,
            after,
            &args.to,
            creds,
            &opts,
            args.how.connections,
        )?;
        return print_report(&report, args.json, args.plot.as_deref());
    }
    let control = args.control.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("guestmem-migrate-{}.sock", std::process::id()))
    });
    let mut work = dirty_work(&args.vm, args.dirty_mib_per_s);
    if args.rewrite {
        for w in &mut work {
            if let Workload::Dirty {
                pages_per_s,
                passes,
                ..
            } = w.workload
            {
                w.workload = Workload::Rewrite {
                    pages_per_s,
                    passes,
                };
            }
        }
    }
    let report = run_source(
        &args.vm,
        &work,
        seconds(args.after, "--after")?,
        &args.to,
        creds,
        &args.how,
        Some(control),
        &Progress::new(&args.progress, !args.json)?,
    )?;
    print_report(&report, args.json, args.plot.as_deref())
}

/// Builds the VM, runs `work` for `after`, migrates it to `to` and returns the report. On
/// failure the source VM keeps running while the error is reported, then stops.
#[allow(clippy::too_many_arguments)]
pub fn run_source(
    vm_args: &VmArgs,
    work: &[VcpuWork],
    after: Duration,
    to: &Endpoint,
    creds: Credentials,
    how: &HowArgs,
    control: Option<PathBuf>,
    progress: &Progress,
) -> crate::Result<Report> {
    let mut opts = how.options()?;
    opts.events = progress.sink.clone();
    let mut vm = Vm::new(&vm_args.config()?)?;
    vm_args.load_image(&vm)?;
    let running = vm.start(work)?;
    std::thread::sleep(after);
    let creds = Arc::new(creds);
    let dead_after = seconds(how.dead_after, "--dead-after")?;
    if let Some(control) = control {
        let (creds, to) = (creds.clone(), to.clone());
        opts.reconnect = Some(Arc::new(move |resume: &migrate::Resume| {
            wait_for_resume(&control, resume, &to, &creds, dead_after)
        }));
    }
    let links = match Links::connect(to, &creds, opts.mode, how.connections) {
        Ok(l) => l,
        Err(e) => {
            let e = guestmem_migration::error_chain(&e, ": ");
            eprintln!("guestmem: migration failed: {e}; the source VM keeps running");
            report_source_runs(&running);
            running.stop();
            let _ = running.wait(Duration::from_secs(10));
            return Err(format!(
                "the migration to {to} did not start ({e}); the VM was not migrated"
            )
            .into());
        }
    };
    // The outcome, once nothing borrows the source VM any more: a report, or the error and
    // whether the destination was taken for dead.
    let outcome = {
        let result = migrate::send(running, links, &opts);
        progress.finish();
        result.map_err(|failure| send_failure(*failure))
    };
    match outcome {
        Ok(report) => Ok(report),
        Err((error, false)) => Err(error.into()),
        Err((error, true)) => Err(keep_after_dead_destination(&vm, &error).into()),
    }
}

/// A failed send: its error, and whether the destination was taken for dead. A source VM
/// still running is shown to run on, then stopped.
fn send_failure(failure: migrate::Failure<'_>) -> (String, bool) {
    match failure.vm {
        Some(running) => {
            let error = guestmem_migration::error_chain(&failure.error, ": ");
            eprintln!("guestmem: migration failed: {error}; the source VM keeps running");
            report_source_runs(&running);
            running.stop();
            let _ = running.wait(Duration::from_secs(10));
            (error, false)
        }
        None => {
            let error = guestmem_migration::error_chain(&failure.error, ": ");
            if error.contains(DEAD) || error.contains(UNRESPONSIVE) {
                (error, true)
            } else {
                (
                    format!(
                        "{error} (the destination had taken the VM over; the source is stopped)"
                    ),
                    false,
                )
            }
        }
    }
}

/// The error of a migration whose destination was taken for dead, after keeping the source
/// VM in a snapshot: paused at the switch-over, it holds the pages the dead destination had not
/// fetched and the vCPU state of that moment.
fn keep_after_dead_destination(vm: &Vm, error: &str) -> String {
    let kept = std::env::temp_dir().join(format!("guestmem-migrate-{}-kept", std::process::id()));
    let keeping = match guestmem_snapshot::write(vm, &kept) {
        Ok(_) => format!(
            "they are kept in the snapshot {} (the source's memory and vCPU state at the \
             switch-over; `guestmem restore` can start it)",
            kept.display()
        ),
        Err(e) => format!(
            "keeping them in a snapshot failed ({})",
            guestmem_migration::error_chain(&e, ": ")
        ),
    };
    format!("{error}; {keeping}")
}

/// Shows that the source VM runs on after a failed migration: the pages its guest wrote in
/// the last 200 ms.
fn report_source_runs(running: &guestmem_vm::RunningVm<'_>) {
    let before: u64 = running.progress().iter().map(|p| p.0).sum();
    std::thread::sleep(Duration::from_millis(200));
    let now: u64 = running.progress().iter().map(|p| p.0).sum();
    eprintln!(
        "guestmem: the source guest wrote {} pages in the last 200 ms",
        now - before
    );
}

/// What the error of a destination taken for dead says.
const DEAD: &str = "the destination is dead";
/// What the error of a destination given up as unresponsive says.
const UNRESPONSIVE: &str = "the destination does not answer";

/// After a broken post-copy link: reconnects to `to` by itself (every second), or where
/// `guestmem migrate resume` on the control socket says. While nothing listens at `to`
/// (connection refused, no such socket, or a new destination there that knows nothing of this
/// migration) for `dead_after`, the destination is taken for dead and an error says so.
fn wait_for_resume(
    control: &Path,
    resume: &migrate::Resume,
    to: &Endpoint,
    creds: &Credentials,
    dead_after: Duration,
) -> guestmem_migration::Result<Links> {
    let fail = |what: &str, source: std::io::Error| {
        guestmem_migration::Error::from(MigrationError::Link {
            what: format!("{}: {what}", control.display()),
            source,
        })
    };
    let _ = std::fs::remove_file(control);
    let listener = UnixListener::bind(control).map_err(|e| fail("bind", e))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| fail("non-blocking", e))?;
    eprintln!(
        "guestmem: the post-copy link broke ({}). If the destination is alive, it runs the guest \
         and waits for its missing pages: this source reconnects to {to} by itself, or where \
         `guestmem migrate resume --control {} [--to ENDPOINT]` says. If nothing listens at {to} \
         for {} s, the destination is taken for dead.",
        resume.reason,
        control.display(),
        dead_after.as_secs_f64()
    );
    let broke = Instant::now();
    let mut refused_since: Option<Instant> = None;
    let mut last_try: Option<Instant> = None;
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                if let Some(links) = resume_as_asked(&stream, resume, to, creds) {
                    let _ = std::fs::remove_file(control);
                    return Ok(links);
                }
                continue;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(fail("accept", e)),
        }
        if last_try.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
            last_try = Some(Instant::now());
            let attempt = reconnect(resume, to, creds, dead_after, broke, &mut refused_since);
            if let Some(result) = attempt {
                let _ = std::fs::remove_file(control);
                return result;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// What the error of a destination taken for dead says of where the guest's state is.
const SPLIT: &str = "The guest's state is split between the destination, which had its vCPUs \
                     and the pages it had fetched, and this source, which holds every page the \
                     destination had not fetched and the VM state at the switch-over";

/// Serves one `guestmem migrate resume` on the control socket: reconnects where its line says
/// (`to` when empty) and answers how that went. The links, when it worked.
fn resume_as_asked(
    stream: &UnixStream,
    resume: &migrate::Resume,
    to: &Endpoint,
    creds: &Credentials,
) -> Option<Links> {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    let mut line = String::new();
    let mut reader = BufReader::new(stream);
    if reader.read_line(&mut line).is_err() {
        return None;
    }
    let endpoint = match line.trim() {
        "" => Ok(to.clone()),
        other => other.parse::<Endpoint>(),
    };
    let outcome = endpoint
        .map_err(guestmem_migration::Error::from)
        .and_then(|ep| resume.connect(&ep, creds).map(|links| (links, ep)));
    let mut stream = stream;
    match outcome {
        Ok((links, ep)) => {
            let _ = writeln!(stream, "reconnected to {ep}; post-copy goes on");
            Some(links)
        }
        Err(e) => {
            let _ = writeln!(
                stream,
                "error: {}",
                guestmem_migration::error_chain(&e, ": ")
            );
            None
        }
    }
}

/// One attempt to reconnect to `to`: the links, the error of a destination taken for dead
/// (nothing listened at `to` for `dead_after`, tracked in `refused_since`) or given up as
/// unresponsive (no reconnection in twice `dead_after` since the link `broke`), or `None` to
/// try again.
fn reconnect(
    resume: &migrate::Resume,
    to: &Endpoint,
    creds: &Credentials,
    dead_after: Duration,
    broke: Instant,
    refused_since: &mut Option<Instant>,
) -> Option<guestmem_migration::Result<Links>> {
    match resume.connect(to, creds) {
        Ok(links) => {
            eprintln!("guestmem: reconnected to {to}; post-copy goes on");
            Some(Ok(links))
        }
        Err(e)
            if e.is_unreachable()
                || guestmem_migration::error_chain(&e, ": ").contains("is not running") =>
        {
            let e = guestmem_migration::error_chain(&e, ": ");
            let since = *refused_since.get_or_insert_with(Instant::now);
            (since.elapsed() >= dead_after).then(|| {
                Err(MigrationError::Dead {
                    reason: format!(
                        "{DEAD}: nothing has listened at {to} for {:.0} s since the \
                         post-copy link broke {:.0} s ago ({}; last attempt: {e}). \
                         {SPLIT}",
                        since.elapsed().as_secs_f64(),
                        broke.elapsed().as_secs_f64(),
                        resume.reason
                    ),
                }
                .into())
            })
        }
        Err(e) => {
            *refused_since = None;
            let e = guestmem_migration::error_chain(&e, ": ");
            tracing::info!("reconnecting to {to}: {e}");
            (broke.elapsed() >= 2 * dead_after).then(|| {
                Err(MigrationError::Dead {
                    reason: format!(
                        "{UNRESPONSIVE}: no reconnection to {to} succeeded in the {:.0} \
                         s since the post-copy link broke ({}; last attempt: {e}). \
                         {SPLIT}",
                        broke.elapsed().as_secs_f64(),
                        resume.reason
                    ),
                }
                .into())
            })
        }
    }
}

fn resume_main(args: ResumeArgs) -> crate::Result<()> {
    let mut stream = UnixStream::connect(&args.control).map_err(|e| {
        format!(
            "{}: no `migrate send` waits there ({e})",
            args.control.display()
        )
    })?;
    writeln!(
        stream,
        "{}",
        args.to.map(|e| e.to_string()).unwrap_or_default()
    )?;
    let mut answer = String::new();
    BufReader::new(&stream).read_line(&mut answer)?;
    let answer = answer.trim();
    if let Some(e) = answer.strip_prefix("error: ") {
        return Err(format!("the source could not reconnect: {e}").into());
    }
    println!("{answer}");
    Ok(())
}

/// What `migrate receive` prints. Format: crate::report::MIGRATE_RECEIVE (a change bumps it).
#[derive(Serialize, serde::Deserialize)]
pub struct Received {
    pub report: migrate::DestinationReport,
    pub pages_at_switchover_per_vcpu: Vec<u64>,
    pub pages_after_run_per_vcpu: Vec<u64>,
    pub guest_continued: bool,
    /// Whether every page of guest memory agrees with what the guest's counters say it wrote
    /// (checked after the run, with all memory resident; `None` for other workloads than
    /// `dirty`): the post-copy's check of the memory that came, beside pre-copy's digests.
    #[serde(default)]
    pub pages_consistent: Option<bool>,
    pub run_ms: f64,
}

fn receive_main(args: ReceiveArgs) -> crate::Result<()> {
    let run_for = seconds(args.run_for, "--run-for")?;
    // A Linux guest cannot run on a PVM host: refused before anything listens.
    if let Some(why) = args.linux.then(guestmem_vm::linux::pvm_refusal).flatten() {
        return Err(format!("--linux: {why}").into());
    }
    let creds = Credentials::load(&args.keys, Role::Destination)?;
    let listener = Arc::new(Listener::bind(&args.listen, &creds)?);
    let progress = Progress::new(&args.progress, !args.json)?;
    let metrics = args.metrics.start()?;
    if args.linux {
        if let Some(port) = listener.port() {
            eprintln!("guestmem: listening on {} (port {port})", args.listen);
        }
        let opts = ReceiveOptions {
            fault_cpus: args.fault_cpus.clone(),
            events: with_metrics(progress.sink.clone(), metrics.as_ref()),
            ..Default::default()
        };
        let received =
            crate::linux_migrate::receive(listener, &opts, args.console.as_deref(), run_for);
        progress.finish();
        let received = received?;
        if args.json {
            // The last line on stdout, after the guest's console (or alone with --console).
            crate::linux::end_console_line();
            println!(
                "{}",
                crate::report::json(crate::report::MIGRATE_RECEIVE_LINUX, &received, false)?
            );
        } else {
            crate::linux_migrate::print_received(&received);
        }
        return Ok(());
    }
    match listener.port() {
        // On stderr even with --json: with tcp:HOST:0 it is the only place the port is told.
        Some(port) => eprintln!("guestmem: listening on {} (port {port})", args.listen),
        // A Unix socket's path is known (`guestmem demo` waits for it to appear).
        None if !args.json => eprintln!("guestmem: listening on {}", args.listen),
        None => {}
    }
    let migrate::Incoming {
        mut vm,
        mut transfer,
    } = migrate::receive(
        listener,
        &ReceiveOptions {
            fault_cpus: args.fault_cpus.clone(),
            events: with_metrics(progress.sink.clone(), metrics.as_ref()),
            ..Default::default()
        },
    )
    .inspect_err(|_| progress.finish())?;
    let before = vm.pages_done();
    let started = Instant::now();
    let running = transfer.resume(&mut vm)?;
    // On stderr even with --json: when the guest moved (a post-copy goes on after it).
    eprintln!(
        "guestmem: the guest runs here now ({}); it runs for {} s",
        transfer.mode(),
        run_for.as_secs_f64()
    );
    std::thread::sleep(run_for);
    running.stop();
    let run = running.wait(Duration::from_secs(30));
    let report = transfer.finish();
    progress.finish();
    let report = report?;
    run?;
    let after = vm.pages_done();
    let consistent = vm.dirty_pages_disagreeing();
    if let Some(Err(why)) = &consistent {
        eprintln!("guestmem: guest memory disagrees with the guest's counters: {why}");
    }
    let out = Received {
        guest_continued: after.iter().zip(&before).all(|(a, b)| a > b),
        pages_consistent: consistent.map(|c| c.is_ok()),
        report,
        pages_at_switchover_per_vcpu: before,
        pages_after_run_per_vcpu: after,
        run_ms: started.elapsed().as_secs_f64() * 1e3,
    };
    if args.json {
        println!(
            "{}",
            crate::report::json(crate::report::MIGRATE_RECEIVE, &out, false)?
        );
    } else {
        print_received(&out);
    }
    if !out.guest_continued {
        return Err("the migrated guest did not go on counting".into());
    }
    if out.pages_consistent == Some(false) {
        return Err("the migrated guest's memory disagrees with its counters".into());
    }
    Ok(())
}

pub fn print_received(r: &Received) {
    if let Some(n) = &r.report.negotiated {
        println!("destination: {}", negotiated_line(n));
    }
    println!(
        "destination: the guest went on from {:?} to {:?} pages written per vCPU in {:.0} ms",
        r.pages_at_switchover_per_vcpu, r.pages_after_run_per_vcpu, r.run_ms
    );
    if let Some(ok) = r.pages_consistent {
        println!(
            "destination: every page agrees with the guest's counters: {}",
            if ok { "yes" } else { "NO" }
        );
    }
    if let Some(d) = r.report.digest {
        println!(
            "destination: memory digest at switch-over {d:#018x}, equal to the source's ({:.1} ms \
             of digest work after the last round's pages)",
            r.report.verify_ms
        );
    }
}

/// Prints `report` as text (or JSON), and draws its rounds into `plot`.
pub fn print_report(report: &Report, json: bool, plot: Option<&Path>) -> crate::Result<()> {
    if let Some(path) = plot {
        std::fs::write(path, svg(report))
            .map_err(|e| format!("{}: cannot write the plot: {e}", path.display()))?;
    }
    if json {
        crate::linux::end_console_line();
        println!(
            "{}",
            crate::report::json(crate::report::MIGRATE_SEND, report, true)?
        );
        return Ok(());
    }
    print_header(report);
    println!("{}", negotiated_line(&report.negotiated));
    print_traffic(report);
    print_rounds(report);
    print_postcopy(report);
    Ok(())
}

/// What the Hellos agreed on, as one line.
fn negotiated_line(n: &migrate::Negotiated) -> String {
    format!(
        "negotiated with {}: migration protocol {} (State format {}), features {}",
        n.peer,
        n.protocol,
        n.state_format(),
        n.features.join(", ")
    )
}

/// Mebibytes in `b` bytes.
fn mib(b: u64) -> f64 {
    b as f64 / f64::from(1 << 20)
}

/// The report's first lines: the migration's mode, size, total time and downtime.
fn print_header(report: &Report) {
    println!(
        "migration ({}, {} connection{}, dirty tracking {}): {:.0} MiB guest",
        report.mode,
        report.connections,
        if report.connections == 1 { "" } else { "s" },
        report.tracking,
        mib(report.guest_bytes)
    );
    println!(
        "  total {:.1} ms, downtime {:.1} ms (target {:.0} ms{}){}",
        report.total_ms,
        report.downtime_ms,
        report.downtime_target_ms,
        if report.mode == Mode::Postcopy {
            ""
        } else if report.converged {
            ", converged"
        } else {
            ", round limit reached"
        },
        if report.verify_ms > 0.0 {
            format!(
                ", of which {:.1} ms the source's digest work",
                report.verify_ms
            )
        } else {
            String::new()
        }
    );
}

/// What went over the links: compression, zstd streams, the delta cache, bytes and pages.
fn print_traffic(report: &Report) {
    let c = &report.compression;
    if c.lz4_frames + c.zstd_frames > 0 {
        println!(
            "  compression {:?}: {} frames LZ4, {} zstd, {} plain; compressed frames {:.1} -> \
             {:.1} MiB",
            c.mode,
            c.lz4_frames,
            c.zstd_frames,
            c.plain_frames,
            mib(c.compressed_in_bytes),
            mib(c.compressed_out_bytes)
        );
    }
    if report.zstd_window_bytes > 0 {
        println!(
            "  zstd streams: window {:.0} MiB per pages connection, {:.1} MiB held on the source",
            mib(report.zstd_window_bytes),
            mib(report.zstd_stream_bytes)
        );
    }
    let d = &report.delta;
    if d.cache_bytes > 0 {
        println!(
            "  delta cache {:.1} MiB: {} hits, {} misses ({:.0} % hits); {} pages sent as \
             {:.1} MiB of deltas ({:.1} MiB saved)",
            mib(d.cache_bytes),
            d.hits,
            d.misses,
            100.0 * d.hit_rate(),
            d.delta_pages,
            mib(d.delta_bytes),
            mib(d.bytes_saved())
        );
    }
    println!(
        "  sent {:.1} MiB in {} pages ({:.1} MiB on the wire: non-zero lines); {} zero pages \
         not sent{}{}",
        mib(report.bytes),
        report.pages_sent,
        mib(report.wire_bytes),
        report.zero_pages_skipped,
        if report.shared_bytes > 0 {
            format!(
                "; {:.0} MiB handed over as memory files",
                mib(report.shared_bytes)
            )
        } else {
            String::new()
        },
        if report.max_throttle_percent > 0 {
            format!(
                "; auto-converge throttled the guest up to {} %",
                report.max_throttle_percent
            )
        } else {
            String::new()
        }
    );
}

/// One line per round (a table).
fn print_rounds(report: &Report) {
    println!(
        "  round  start ms       ms     pages      zero      MiB  wire MiB  dirty after    MiB/s  throttle"
    );
    for r in &report.rounds {
        println!(
            "  {:>5}  {:>8.1} {:>8.1} {:>9} {:>9} {:>8.1} {:>9.1} {:>12} {:>8.0} {:>8}%",
            r.round,
            r.start_ms,
            r.ms,
            r.pages,
            r.zero_pages,
            mib(r.bytes),
            mib(r.wire_bytes),
            r.dirty_pages_after,
            r.bandwidth_mib_per_s,
            r.throttle_percent
        );
    }
}

/// Post-copy's requests, faults and link breaks, and the source's memory for the migration.
fn print_postcopy(report: &Report) {
    if report.mode != Mode::Precopy {
        print!(
            "  post-copy: {} requests served, {:.1} MiB, all resident after {:.1} ms",
            report.postcopy_requests,
            mib(report.postcopy_bytes),
            report.postcopy_ms
        );
        if let Some(d) = &report.destination {
            print!(
                "; {} faults, fetch latency p50 {:.0} µs, p99 {:.0} µs, max {:.0} µs",
                d.faults, d.fault_latency_p50_us, d.fault_latency_p99_us, d.fault_latency_max_us
            );
        }
        println!();
        if report.link_breaks > 0 {
            println!(
                "  the link broke {} time(s) and was resumed",
                report.link_breaks
            );
        }
    }
    println!(
        "  source memory for the migration: {:.1} MiB ({:.2} % of guest memory)",
        mib(report.source_extra_bytes),
        report.source_extra_bytes as f64 * 100.0 / report.guest_bytes.max(1) as f64
    );
}

/// Dirty pages (bars) and bandwidth (line) per round, over time.
pub fn svg(report: &Report) -> String {
    let (w, h, pad) = (720.0, 360.0, 50.0);
    let end = report
        .rounds
        .iter()
        .map(|r| r.start_ms + r.ms)
        .fold(report.total_ms, f64::max)
        .max(1.0);
    let max_pages = report
        .rounds
        .iter()
        .map(|r| r.pages)
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let max_bw = report
        .rounds
        .iter()
        .map(|r| r.bandwidth_mib_per_s)
        .fold(1.0, f64::max);
    let x = |ms: f64| pad + ms / end * (w - 2.0 * pad);
    let y = |v: f64, max: f64| h - pad - v / max * (h - 2.0 * pad);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{pad}\" y=\"20\">guestmem {} migration: pages per round (bars), MiB/s (line); downtime {:.1} ms</text>\n\
         <line x1=\"{pad}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n\
         <text x=\"{}\" y=\"{}\">{end:.0} ms</text>\n\
         <text x=\"5\" y=\"{}\">{max_pages:.0} pages</text>\n\
         <text x=\"{}\" y=\"{}\">{max_bw:.0} MiB/s</text>\n",
        report.mode,
        report.downtime_ms,
        h - pad,
        w - pad,
        h - pad,
        w - pad - 40.0,
        h - pad + 15.0,
        pad - 5.0,
        w - pad - 60.0,
        pad - 5.0,
    );
    let mut line = Vec::new();
    for r in &report.rounds {
        let (x0, x1) = (x(r.start_ms), x(r.start_ms + r.ms).max(x(r.start_ms) + 2.0));
        let top = y(r.pages as f64, max_pages);
        s += &format!(
            "<rect x=\"{x0:.1}\" y=\"{top:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"steelblue\" opacity=\"0.7\"><title>round {}: {} pages</title></rect>\n",
            x1 - x0,
            h - pad - top,
            r.round,
            r.pages
        );
        line.push(format!(
            "{:.1},{:.1}",
            (x0 + x1) / 2.0,
            y(r.bandwidth_mib_per_s, max_bw)
        ));
    }
    s += &format!(
        "<polyline points=\"{}\" fill=\"none\" stroke=\"darkorange\" stroke-width=\"2\"/>\n</svg>\n",
        line.join(" ")
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    /// `guestmem migrate send` with `extra` flags, parsed.
    fn send(extra: &[&str]) -> Result<SendArgs, String> {
        let args = [
            "guestmem",
            "migrate",
            "send",
            "--to",
            "unix:/tmp/s",
            "--keys",
            "/k",
        ];
        let cli =
            crate::Cli::try_parse_from(args.iter().chain(extra)).map_err(|e| e.to_string())?;
        match cli.command {
            crate::Command::Migrate(Migrate::Send(a)) => Ok(*a),
            _ => unreachable!("migrate send parses as itself"),
        }
    }

    fn refused(extra: &[&str]) -> String {
        let how = send(extra).expect("parses").how;
        how.options().expect_err("refused").to_string()
    }

    /// The defaults make precopy options with their documented values; the flags given come
    /// through in bytes.
    #[test]
    fn flags_become_send_options() {
        let o = send(&[]).unwrap().how.options().unwrap();
        assert_eq!(o.mode, Mode::Precopy);
        assert_eq!(o.downtime, Duration::from_millis(50));
        assert!(o.auto_converge && !o.verify && !o.share_memory && !o.whole_pages);
        assert_eq!(o.compress, Compress::Auto);
        assert_eq!((o.max_bandwidth, o.delta_cache_bytes), (None, Some(0)));
        assert_eq!(o.zstd_window_bytes, 0);
        assert_eq!(o.fault_cpus, None);

        let o = send(&[
            "--mode",
            "hybrid",
            "--downtime-ms",
            "7",
            "--connections",
            "4",
            "--max-bandwidth-mib-per-s",
            "4",
            "--no-auto-converge",
            "--verify",
            "--compress",
            "lz4",
            "--delta-cache-mib",
            "3",
            "--zstd-window-mib",
            "8",
            "--fault-cpus",
            "0,2",
        ])
        .unwrap()
        .how
        .options()
        .unwrap();
        assert_eq!(o.mode, Mode::Hybrid);
        assert_eq!(o.downtime, Duration::from_millis(7));
        assert!(!o.auto_converge && o.verify);
        assert_eq!(o.compress, Compress::Lz4);
        assert_eq!(o.max_bandwidth, Some(4 << 20));
        assert_eq!(o.delta_cache_bytes, Some(3 << 20));
        assert_eq!(o.zstd_window_bytes, 8 << 20);
        assert_eq!(o.fault_cpus, Some(vec![0, 2]));
    }

    /// Each bad value is refused with a message naming the flag and the value.
    #[test]
    fn bad_flags_are_refused_naming_them() {
        assert_eq!(
            refused(&["--connections", "0"]),
            "--connections must be 1 to 64, not 0"
        );
        assert_eq!(
            refused(&["--connections", "65"]),
            "--connections must be 1 to 64, not 65"
        );
        assert_eq!(
            refused(&["--connections", "8", "--max-bandwidth-mib-per-s", "7"]),
            "--max-bandwidth-mib-per-s 7 is refused: at least 1 MiB/s per connection (8 with \
             --connections 8) is needed, or the migration never finishes"
        );
        let huge = (u64::MAX >> 10).to_string();
        assert_eq!(
            refused(&["--max-bandwidth-mib-per-s", &huge]),
            format!("--max-bandwidth-mib-per-s {huge} is refused: more bytes/s than 64 bits hold")
        );
        assert_eq!(
            refused(&["--delta-cache-mib", &huge]),
            format!("--delta-cache-mib {huge} is refused: more bytes than 64 bits hold")
        );
        // Refused while parsing, each naming what it expected.
        for (flags, says) in [
            (
                &["--mode", "warp"][..],
                "unknown migration mode 'warp' (precopy, postcopy or hybrid)",
            ),
            (
                &["--compress", "gzip"],
                "unknown compression 'gzip' (none, lz4, zstd or auto)",
            ),
            (
                &["--zstd-window-mib", "big"],
                "zstd window 'big': a number of MiB, or off",
            ),
            (
                &["--zstd-window-mib", "2048"],
                "zstd window of 2048 MiB: at most 1024",
            ),
            (&["--backend", "tape"], "unknown backend 'tape'"),
            (&["--memory", "lots"], "'lots' is not a size"),
            (&["--fault-cpus", "0,x"], "--fault-cpus"),
        ] {
            let e = send(flags).err().expect("refused");
            assert!(e.contains(says), "{flags:?}: {e}");
        }
        let e = crate::Cli::try_parse_from([
            "guestmem", "migrate", "send", "--to", "host:1", "--keys", "/k",
        ])
        .err()
        .expect("refused")
        .to_string();
        assert!(
            e.contains("'host:1' is not an endpoint (expected tcp:HOST:PORT or unix:PATH)"),
            "{e}"
        );
    }

    /// Zero seconds are allowed; a negative or unbounded number is refused naming the flag.
    #[test]
    fn seconds_accept_zero_and_name_the_flag() {
        assert_eq!(seconds(0.0, "--after").unwrap(), Duration::ZERO);
        assert_eq!(
            seconds(0.25, "--after").unwrap(),
            Duration::from_millis(250)
        );
        for bad in [-1.0, f64::NAN, f64::INFINITY] {
            let e = seconds(bad, "--run-for").unwrap_err().to_string();
            assert!(e.starts_with("--run-for must be"), "{e}");
        }
    }

    /// The dirty rate is shared between the vCPUs in pages per second (at least one each);
    /// 0 is full speed; each vCPU gets its own half of RAM.
    #[test]
    fn the_dirty_rate_is_split_between_vcpus() {
        let vm = send(&["--memory", "64M", "--vcpus", "2"]).unwrap().vm;
        let rate = |w: &VcpuWork| match w.workload {
            Workload::Dirty {
                pages_per_s,
                fill_first: true,
                passes: None,
            } => pages_per_s,
            other => panic!("{other:?}"),
        };
        let work = dirty_work(&vm, 64);
        assert_eq!(work.len(), 2);
        assert_eq!(
            work.iter().map(rate).collect::<Vec<_>>(),
            vec![Some(8192); 2]
        );
        assert_eq!(
            (work[0].gpa, work[1].gpa),
            (layout::RAM_GPA, layout::RAM_GPA + (32 << 20))
        );
        assert_eq!(rate(&dirty_work(&vm, 0)[0]), None);
        let many = send(&["--memory", "64M", "--vcpus", "3000"]).unwrap().vm;
        assert_eq!(rate(&dirty_work(&many, 1)[0]), Some(1));
    }

    /// A failure after the destination took the VM over says the source is stopped, unless
    /// the destination was taken for dead or unresponsive (then the source keeps the guest).
    #[test]
    fn a_failure_without_the_source_vm_says_what_became_of_it() {
        let failure = |reason: &str| migrate::Failure {
            error: MigrationError::Dead {
                reason: reason.into(),
            }
            .into(),
            vm: None,
        };
        let (e, dead) = send_failure(failure(&format!("{DEAD}: nothing listens")));
        assert_eq!(
            (e.as_str(), dead),
            ("the destination is dead: nothing listens", true)
        );
        let (e, dead) = send_failure(failure(&format!("{UNRESPONSIVE}: no reconnection")));
        assert_eq!(
            (e.as_str(), dead),
            ("the destination does not answer: no reconnection", true)
        );
        let (e, dead) = send_failure(failure("the link broke"));
        assert_eq!(
            (e.as_str(), dead),
            (
                "the link broke (the destination had taken the VM over; the source is stopped)",
                false
            )
        );
    }

    /// `migrate resume` sends the endpoint (or an empty line) to the waiting source and
    /// reports its answer: an error answer fails naming the source; no source waiting fails
    /// naming the socket.
    #[test]
    fn resume_talks_to_the_waiting_source() {
        let dir = std::env::temp_dir().join(format!("guestmem-resume-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let control = dir.join("control.sock");
        let e = resume_main(ResumeArgs {
            control: control.clone(),
            to: None,
        })
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with(&format!(
                "{}: no `migrate send` waits there (",
                control.display()
            )),
            "{e}"
        );

        let listener = UnixListener::bind(&control).unwrap();
        let source = std::thread::spawn(move || {
            let mut lines = Vec::new();
            for answer in [
                "reconnected to unix:/tmp/new; post-copy goes on",
                "error: refused",
            ] {
                let (stream, _) = listener.accept().unwrap();
                let mut line = String::new();
                BufReader::new(&stream).read_line(&mut line).unwrap();
                lines.push(line);
                writeln!(&stream, "{answer}").unwrap();
            }
            lines
        });
        resume_main(ResumeArgs {
            control: control.clone(),
            to: Some("unix:/tmp/new".parse().unwrap()),
        })
        .unwrap();
        let e = resume_main(ResumeArgs {
            control: control.clone(),
            to: None,
        })
        .unwrap_err()
        .to_string();
        assert_eq!(e, "the source could not reconnect: refused");
        assert_eq!(source.join().unwrap(), vec!["unix:/tmp/new\n", "\n"]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
