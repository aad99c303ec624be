//! `guestmem snapshot` and `guestmem restore`: a running VM to a snapshot directory and back.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use guestmem_contract::VmBuilder;
use guestmem_paging::{Pager, PagerConfig, Share, UserfaultPager};
use guestmem_snapshot::{self as snapshot, RestoreMode, Snapshot};
use guestmem_tracking::{Mode as TrackingMode, Tracker};
use guestmem_vm::{layout, VcpuWork, Vm, Workload};
use serde::Serialize;

use crate::progress::{Progress, ProgressArgs};
use crate::vm_args::VmArgs;
use guestmem_events::Status;
use guestmem_snapshot::progress::{RestoreProgress, SnapshotProgress};
use guestmem_snapshot::SnapshotImage;

mod info;
mod live;
mod store;
pub(crate) use store::open_store_snapshot;

pub(crate) use store::is_store;

#[derive(clap::Args)]
pub struct SnapshotArgs {
    /// Directory to write the snapshot into (created; an existing snapshot there is replaced),
    /// or a snapshot in a chunk store: `s3://BUCKET[/PREFIX]/NAME` (endpoint and credentials
    /// from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION) or
    /// `store:DIR/NAME` (a local store); the store is the URL without its last element, and its
    /// snapshots share their chunks.
    #[arg(long, required = true)]
    out: Option<PathBuf>,
    /// Store operations: merge a diff chain, collect unreferenced chunks, delete a snapshot;
    /// and any snapshot's `info`.
    #[command(subcommand)]
    op: Option<store::StoreOp>,
    #[command(flatten)]
    vm: VmArgs,
    #[command(flatten)]
    linux: crate::linux::LinuxArgs,
    /// How long the guest runs its `dirty` workload before the snapshot, in seconds (a Linux
    /// guest: from its first console line).
    #[arg(long, default_value_t = 1.0)]
    after: f64,
    /// Run the `rewrite` workload instead of `dirty` (2-33 lines of each page rewritten with
    /// bytes from another page: with `--image`, memory stays as dense as a real guest's).
    #[arg(long)]
    rewrite: bool,
    /// Limit the workload to this many pages per second (all vCPUs together; default: as
    /// fast as it goes).
    #[arg(long)]
    pages_per_s: Option<u64>,
    /// Then also write a diff snapshot into this directory: the guest goes on for
    /// `--diff-after` seconds, watched by dirty tracking, and only the chunks it wrote since
    /// the snapshot in `--out` (the diff's base) are stored.
    #[arg(long, value_name = "DIR")]
    diff: Option<PathBuf>,
    /// With `--diff`: how long the guest runs between the base and the diff, in seconds.
    #[arg(long, default_value_t = 0.2, requires = "diff")]
    diff_after: f64,
    /// Write the snapshot (and the diff) while the guest runs (see `--live-mode`); reports the
    /// mode, the pause, the rounds, the pages copied before their write and the guest's rate
    /// during the write against before it (measured over the second half of `--after`).
    #[arg(long)]
    live: bool,
    /// With `--live`: then also write the same guest paused (deleted again) and compare its
    /// time and stored bytes with the live snapshot's.
    #[arg(long, requires = "live")]
    compare_paused: bool,
    /// With `--live`: how memory is captured. auto: copy-before-write where the kernel's
    /// userfaultfd write-protect takes the memory, else rounds; copy-before-write: the pause
    /// write-protects memory and each page is copied before the guest's first write to it
    /// (the pause does not grow with the guest's writes); rounds: dirty-tracked rounds, then a
    /// pause that copies what the last round left (it grows with the dirty rate).
    #[arg(long, default_value = "auto", requires = "live", value_name = "MODE")]
    live_mode: guestmem_snapshot::live::Strategy,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    progress: ProgressArgs,
}

#[derive(clap::Args)]
pub struct RestoreArgs {
    /// The snapshot directory, or a store snapshot (`s3://BUCKET[/PREFIX]/NAME`,
    /// `store:DIR/NAME`: restored in full or lazily, chunks from a remote store kept in the
    /// host's chunk cache, $GUESTMEM_CHUNK_CACHE or ~/.cache/guestmem/chunks).
    dir: PathBuf,
    /// full: copy all memory in, then run; map: map the memory file copy-on-write (anon
    /// regions); lazy: run at once, memory paged in on first access and in the background.
    #[arg(long, value_enum, default_value = "full")]
    mode: Mode,
    /// With `--mode lazy`: hand the guest's RAM to the page server listening on this socket
    /// (Firecracker's protocol; the RAM regions back to back from offset 0) instead of serving
    /// it in this process. This process cannot check the bytes the server installs: serve them
    /// with `guestmem page-server --firecracker SOCKET --snapshot DIR`, which checks each chunk
    /// against the snapshot's CRC-32 before the guest can run on it.
    #[arg(long, value_name = "SOCKET")]
    pub(crate) uffd_socket: Option<PathBuf>,
    /// With `--mode lazy`: share the snapshot's clean pages with every other clone of it on
    /// this host, through one image per snapshot in DIR (on tmpfs; default /dev/shm/guestmem),
    /// each clone mapping it copy-on-write and owning only the pages it writes. The image
    /// stays in DIR (host memory) after the clones exit, for the next ones: delete it to free
    /// it. Anonymous RAM only.
    #[arg(long, value_name = "DIR", num_args = 0..=1, default_missing_value = Share::DEFAULT_DIR)]
    share: Option<PathBuf>,
    /// How long to let the restored guest run, in seconds.
    #[arg(long, default_value_t = 1.0)]
    run_for: f64,
    /// A Linux guest's snapshot: write its console to FILE instead of stdout (with `--clones`,
    /// one file per clone: `{n}` in FILE is replaced by the clone's number).
    #[arg(long, value_name = "FILE")]
    pub(crate) console: Option<PathBuf>,
    /// A Linux guest's snapshot, with `--mode lazy`: restore N clones one after another
    /// through a restore service (the snapshot opened and checked once, a VM built and armed
    /// ahead in its pool), each run `--run-for`, then wiped, armed again and pooled for the
    /// next. Before each clone's console, stdout gets `guestmem: clone K of N (into ...)`,
    /// naming the VM it was restored into.
    #[arg(long, value_name = "N")]
    clones: Option<usize>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    progress: ProgressArgs,
}

impl RestoreArgs {
    /// The lazy restore's pager configuration: the defaults, sharing memory with `--share`
    /// (which only an in-process lazy restore takes).
    fn pager_config(&self) -> crate::Result<PagerConfig> {
        if self.share.is_some() && (!matches!(self.mode, Mode::Lazy) || self.uffd_socket.is_some())
        {
            return Err(
                "--share needs --mode lazy (served in this process, not --uffd-socket)".into(),
            );
        }
        Ok(PagerConfig {
            share: self.share.as_ref().map(Share::new),
            ..PagerConfig::default()
        })
    }

    /// `--clones N`: N at least 1, with `--mode lazy`; `None` without it.
    fn clone_count(&self) -> crate::Result<Option<usize>> {
        match self.clones {
            Some(n) if n == 0 || !matches!(self.mode, Mode::Lazy) => {
                Err("--clones N restores N (at least 1) clones lazily: it needs --mode lazy".into())
            }
            n => Ok(n),
        }
    }

    /// `--clones` is refused for a snapshot of guestmem's payload VM.
    pub(crate) fn refuse_clones(&self) -> crate::Result<()> {
        match self.clones {
            Some(_) => Err(format!(
                "--clones restores a Linux guest's snapshot through a restore service; {} is a \
                 snapshot of guestmem's payload VM, whose clones `guestmem bench fanout` runs",
                self.dir.display()
            )
            .into()),
            None => Ok(()),
        }
    }

    /// How `--mode` and `--uffd-socket` say to bring the memory back (`--uffd-socket` only
    /// with `--mode lazy`).
    pub(crate) fn restore_mode(&self) -> crate::Result<RestoreMode> {
        let pager_config = self.pager_config()?;
        Ok(match (self.mode, &self.uffd_socket) {
            (Mode::Lazy, Some(socket)) => RestoreMode::PageServer(socket.clone()),
            (_, Some(_)) => return Err("--uffd-socket needs --mode lazy".into()),
            (Mode::Full, None) => RestoreMode::Full,
            (Mode::Map, None) => RestoreMode::Map,
            (Mode::Lazy, None) => RestoreMode::Lazy(pager_config),
        })
    }
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Mode {
    Full,
    Map,
    Lazy,
}

/// `snapshot --json` (flat, paused). Format: crate::report::SNAPSHOT (a change bumps it).
#[derive(Serialize)]
struct SnapshotOutput {
    dir: PathBuf,
    #[serde(flatten)]
    report: snapshot::WriteReport,
    write_ms: f64,
    pages_done_per_vcpu: Vec<u64>,
    /// With `--diff`: the diff snapshot over `dir`.
    diff: Option<DiffOutput>,
}

#[derive(Serialize)]
struct DiffOutput {
    dir: PathBuf,
    #[serde(flatten)]
    report: snapshot::WriteReport,
    write_ms: f64,
    /// Chunks the diff stores (the others it inherits from the base).
    stored_chunks: u64,
    pages_done_per_vcpu: Vec<u64>,
}

/// `restore --json` (flat). Format: crate::report::RESTORE (a change bumps it).
#[derive(Serialize)]
struct RestoreOutput {
    mode: &'static str,
    /// From opening the snapshot to the vCPUs being ready to run.
    restore_ms: f64,
    /// `lazy`: from opening the snapshot until all memory was resident.
    resident_ms: Option<f64>,
    /// Full and map: whether every region's digest equals the snapshot's before the guest ran.
    memory_digests_match: Option<bool>,
    /// In-process lazy restores: the working set fetched first, or recorded for next time.
    working_set: Option<crate::working_set::WorkingSetOutput>,
    pages_at_snapshot_per_vcpu: Vec<u64>,
    pages_after_run_per_vcpu: Vec<u64>,
    guest_continued: bool,
}

use crate::units::seconds;

/// Resumes a restored VM, lets it run `run_for`, stops it, and waits (lazy restores) until its
/// memory is resident: the guest's page counters before and after, and the time from `t` to
/// resident.
/// How long past the store timeout a lazily restored guest waits on a page before the VM's
/// no-progress check ends its run (the pager fails it first, with the store's error).
const STORE_SLACK: Duration = Duration::from_secs(10);

pub(crate) fn run_restored(
    vm: &mut Vm,
    pagers: &[Pager],
    userfault_pagers: &[UserfaultPager],
    (run_for, progress): (Duration, Option<&mut RestoreProgress>),
    t: Instant,
) -> crate::Result<(Vec<u64>, Vec<u64>, Option<f64>)> {
    let ran = run_and_page_in(vm, pagers, userfault_pagers, run_for, t);
    match (progress, &ran) {
        (Some(p), Ok(_)) => p.finish(),
        (Some(p), Err(e)) => p.failed(&**e),
        _ => {}
    }
    ran
}

/// [`run_restored`], before its last progress record.
fn run_and_page_in(
    vm: &mut Vm,
    pagers: &[Pager],
    userfault_pagers: &[UserfaultPager],
    run_for: Duration,
    t: Instant,
) -> crate::Result<(Vec<u64>, Vec<u64>, Option<f64>)> {
    let before = vm.pages_done();
    let running = vm.resume()?;
    std::thread::sleep(run_for);
    running.stop();
    // A vCPU waiting on a page from a stalled store is stopped by its pager when the store
    // timeout (and its probes) run out, with the store's error: the VM's own no-progress
    // check waits past that.
    let no_progress = Duration::from_secs(30).max(crate::store_options().timeout + STORE_SLACK);
    let report = running.wait(no_progress)?;
    let after: Vec<u64> = report.vcpus.iter().map(|v| v.pages).collect();
    let mut resident_ms = None;
    for pager in pagers {
        if !pager.wait_resident(Duration::from_secs(300))? {
            return Err("the lazily restored memory did not become resident in 300 s".into());
        }
        resident_ms = Some(t.elapsed().as_secs_f64() * 1e3);
    }
    for pager in userfault_pagers {
        if !pager.wait_resident(Duration::from_secs(300))? {
            return Err("the lazily restored memory did not become resident in 300 s".into());
        }
        resident_ms = Some(t.elapsed().as_secs_f64() * 1e3);
    }
    Ok((before, after, resident_ms))
}

pub fn snapshot(mut args: SnapshotArgs) -> crate::Result<()> {
    if let Some(op) = args.op.take() {
        return store::run_op(op);
    }
    let out = args.out.take().ok_or("--out is required")?;
    let after = seconds(args.after, "--after")?;
    let diff_after = seconds(args.diff_after, "--diff-after")?;
    if args.diff.as_deref() == Some(out.as_path()) {
        return Err("--diff must name another directory than --out (the diff's base)".into());
    }
    if let Some(plan) = args.linux.plan(&args.vm)? {
        if args.diff.is_some() || args.compare_paused {
            return Err("--kernel snapshots are whole (no --diff or --compare-paused)".into());
        }
        let lines = Progress::new(&args.progress, false)?;
        let progress = lines
            .sink
            .as_ref()
            .map(|s| snapshot_progress(s, args.vm.memory));
        let how = crate::linux_snapshot::Written {
            out: &out,
            live: args.live.then_some(args.live_mode),
            progress: progress.as_ref(),
        };
        return crate::linux_snapshot::snapshot(&args.vm, &args.linux, (plan, after), how);
    }
    let mut vm = Vm::new(&args.vm.config()?)?;
    args.vm.load_image(&vm)?;
    let dirty = vcpu_workload(args.pages_per_s, args.vm.vcpus, args.rewrite);
    let work = VcpuWork::split(dirty, layout::RAM_GPA, args.vm.memory, args.vm.vcpus, 1);
    let lines = Progress::new(&args.progress, false)?;
    let total = vm.memory().regions().iter().map(|r| r.size()).sum();
    let progress = lines.sink.as_ref().map(|s| snapshot_progress(s, total));
    let running = vm.start(&work)?;
    if args.live {
        let written = live_snapshot(running, after, &out, &args, diff_after, progress.as_ref());
        return reported(progress.as_ref(), written);
    }
    std::thread::sleep(after);
    running.pause()?;
    if let Some(p) = &progress {
        p.emit(Status::Stopped, 0);
    }
    if store::is_store(&out) {
        let written = store::snapshot(&mut vm, &out, args.diff.as_deref(), diff_after, args.json);
        return reported(progress.as_ref(), written.map(|bytes| ((), bytes)));
    }
    let t = Instant::now();
    let report = reported(
        progress.as_ref(),
        snapshot::write(&vm, &out).map(|r| {
            let bytes = r.data_bytes;
            (r, bytes)
        }),
    )?;
    let write_ms = t.elapsed().as_secs_f64() * 1e3;
    let pages_done_per_vcpu = vm.pages_done();
    let diff = match &args.diff {
        None => None,
        Some(dir) => Some(write_diff_after(&mut vm, dir, &out, diff_after)?),
    };
    let out = SnapshotOutput {
        dir: out,
        report,
        write_ms,
        pages_done_per_vcpu,
        diff,
    };
    if args.json {
        crate::linux::end_console_line();
        println!(
            "{}",
            crate::report::json(crate::report::SNAPSHOT, &out, true)?
        );
    } else {
        println!(
            "snapshot of a {} MiB {} VM written to {} in {:.1} ms: {} MiB of data, {} of {} chunks zero",
            args.vm.memory >> 20,
            args.vm.backend,
            out.dir.display(),
            out.write_ms,
            out.report.data_bytes >> 20,
            out.report.zero_chunks,
            out.report.chunks
        );
        println!(
            "guest pages written per vCPU at the snapshot: {:?}",
            out.pages_done_per_vcpu
        );
        if let Some(d) = &out.diff {
            println!(
                "diff snapshot over it written to {} in {:.1} ms: {} of {} chunks stored \
                 ({} MiB of data), the others inherited; guest pages per vCPU then: {:?}",
                d.dir.display(),
                d.write_ms,
                d.stored_chunks,
                d.report.chunks,
                d.report.data_bytes >> 20,
                d.pages_done_per_vcpu
            );
        }
    }
    Ok(())
}

/// Each vCPU's workload: the guest's writes at `pages_per_s` over all `vcpus` (unthrottled
/// without), rewriting its pages (`rewrite`) or dirtying them.
fn vcpu_workload(pages_per_s: Option<u64>, vcpus: usize, rewrite: bool) -> Workload {
    // Each vCPU's share of the rate.
    let rate = pages_per_s.map(|r| (r / vcpus as u64).max(1));
    if rewrite {
        Workload::Rewrite {
            pages_per_s: rate,
            passes: None,
        }
    } else {
        Workload::Dirty {
            pages_per_s: rate,
            passes: None,
            fill_first: false,
        }
    }
}

/// Lets the paused `vm` run `diff_after` more, then writes a diff snapshot of it into `dir`
/// over the snapshot in `base`.
fn write_diff_after(
    vm: &mut Vm,
    dir: &std::path::Path,
    base: &std::path::Path,
    diff_after: Duration,
) -> crate::Result<DiffOutput> {
    // Bitmap mode: it reports only what is written from now on (manual mode starts with
    // every page dirty).
    let mut tracker = Tracker::start(vm, TrackingMode::Bitmap)?;
    let running = vm.resume()?;
    std::thread::sleep(diff_after);
    running.pause()?;
    let dirty = tracker.harvest()?;
    tracker.stop()?;
    let t = Instant::now();
    let report = snapshot::write_diff(vm, dir, base, &dirty)?;
    let write_ms = t.elapsed().as_secs_f64() * 1e3;
    let inherited = Snapshot::open(dir)?
        .manifest()
        .regions
        .iter()
        .flat_map(|r| &r.chunks)
        .filter(|c| c.inherited)
        .count() as u64;
    Ok(DiffOutput {
        dir: dir.to_path_buf(),
        stored_chunks: report.chunks - inherited,
        report,
        write_ms,
        pages_done_per_vcpu: vm.pages_done(),
    })
}

/// A snapshot's progress records begun (`setup`), its chunk store's stalls told into them.
fn snapshot_progress(sink: &guestmem_events::Sink, total: u64) -> SnapshotProgress {
    let p = SnapshotProgress::start(sink, total);
    crate::progress::report_stalls_to(p.reporter());
    p
}

/// `written` (and the bytes it stored) as the snapshot's last progress record says it:
/// `completed` with the bytes, or `failed` with the error.
fn reported<T, E>(
    progress: Option<&SnapshotProgress>,
    written: Result<(T, u64), E>,
) -> crate::Result<T>
where
    E: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let written = written.map_err(Into::into);
    match (progress, &written) {
        (Some(p), Ok((_, bytes))) => p.emit(Status::Completed, *bytes),
        (Some(p), Err(e)) => p.failed(&**e),
        _ => {}
    }
    Ok(written?.0)
}

/// `--live`: the guest's undisturbed rate over the second half of `after`, then the live
/// snapshot (and diff) while it runs; the guest is stopped at the end.
fn live_snapshot(
    running: guestmem_vm::RunningVm<'_>,
    after: Duration,
    out: &std::path::Path,
    args: &SnapshotArgs,
    diff_after: Duration,
    progress: Option<&SnapshotProgress>,
) -> crate::Result<((), u64)> {
    let pages = |r: &guestmem_vm::RunningVm<'_>| -> u64 { r.progress().iter().map(|p| p.0).sum() };
    std::thread::sleep(after / 2);
    let (p0, t0) = (pages(&running), Instant::now());
    std::thread::sleep(after - after / 2);
    let undisturbed = (pages(&running) - p0) as f64 / t0.elapsed().as_secs_f64();
    let mut machine = guestmem_contract::PayloadVm::running(running);
    if let Some(p) = progress {
        p.emit(Status::Precopy, 0);
    }
    let written = live::snapshot(
        &mut machine,
        undisturbed,
        out,
        args.diff.as_deref(),
        diff_after,
        args.compare_paused,
        (args.live_mode, progress.map(SnapshotProgress::reporter)),
    );
    if let Some(running) = machine.into_running() {
        running.stop();
        running.wait(Duration::from_secs(30))?;
    }
    let written = written?;
    if args.json {
        crate::linux::end_console_line();
        println!(
            "{}",
            crate::report::json(crate::report::SNAPSHOT_LIVE, &written, true)?
        );
    } else {
        written.print();
    }
    Ok(((), written.stored_bytes()))
}

pub fn restore(args: RestoreArgs) -> crate::Result<()> {
    if store::is_store(&args.dir) {
        return store::restore(&args);
    }
    let run_for = seconds(args.run_for, "--run-for")?;
    let t = Instant::now();
    let snap = Snapshot::open(&args.dir)?;
    if guestmem_contract::is_linux_state(snap.machine_state()) {
        return restore_linux(snap, &args, run_for);
    }
    args.refuse_clones()?;
    let (restored, mut progress) = restore_reported(&args, &snap)?;
    for (phase, d) in &restored.phases {
        tracing::info!("restore: {phase}: {:.3} ms", d.as_secs_f64() * 1e3);
    }
    if let (Some(socket), true) = (&args.uffd_socket, args.json) {
        // The text report says it too; JSON readers get it on stderr.
        eprintln!(
            "guestmem restore: the page server on {} must check the RAM's bytes (this \
             process cannot): `guestmem page-server --snapshot {}` does",
            socket.display(),
            args.dir.display()
        );
    }
    // The KVM Userfault pagers (guest_memfd regions) serve the vCPUs' userfault exits, and a
    // page server's connection and our copy of the userfaultfd are held, while the guest runs.
    let snapshot::Restored {
        pagers,
        userfault_pagers,
        mut vm,
        peer,
        prefetched,
        ..
    } = restored;
    let restore_ms = t.elapsed().as_secs_f64() * 1e3;
    let memory_digests_match = check_digests(&args, &vm, &snap)?;
    let (before, after, resident_ms) = run_restored(
        &mut vm,
        &pagers,
        &userfault_pagers,
        (run_for, progress.as_mut()),
        t,
    )?;
    let working_set = crate::working_set::output(
        &crate::working_set::pager_stats(&pagers, &userfault_pagers),
        prefetched,
        || {
            Ok(snapshot::record_working_set(
                &snap,
                vm.memory(),
                &pagers,
                &userfault_pagers,
            )?)
        },
    )?;
    drop(pagers);
    drop(userfault_pagers);
    drop(peer);
    let out = RestoreOutput {
        mode: match args.mode {
            Mode::Full => "full",
            Mode::Map => "map",
            Mode::Lazy => "lazy",
        },
        restore_ms,
        resident_ms,
        memory_digests_match,
        working_set,
        guest_continued: before.iter().zip(&after).all(|(b, a)| a > b),
        pages_at_snapshot_per_vcpu: before,
        pages_after_run_per_vcpu: after,
    };
    print_restore(&args, &out)?;
    if !out.guest_continued {
        return Err("the restored guest did not go on running".into());
    }
    Ok(())
}

/// Restores `image` as `args` say, its progress records (`--progress`) begun: `setup`, then
/// `completed` or, lazily, `postcopy` until [`run_restored`] has the memory resident.
/// A Linux guest's snapshot restored in this process (not through a page server).
pub(crate) fn restore_linux<I: SnapshotImage>(
    snap: I,
    args: &RestoreArgs,
    run_for: Duration,
) -> crate::Result<()> {
    if args.uffd_socket.is_some() {
        return Err(
            "a Linux guest's snapshot is restored full, map or lazy in this process \
                    (no --uffd-socket)"
                .into(),
        );
    }
    if let Some(clones) = args.clone_count()? {
        let lines = Progress::new(&args.progress, false)?;
        let how = crate::linux_clones::Clones {
            count: clones,
            run_for,
            console: args.console.as_deref(),
            pagers: args.pager_config()?,
            events: lines.sink.clone(),
        };
        return crate::linux_clones::restore(snap, how);
    }
    let mode = args.restore_mode()?;
    let lines = Progress::new(&args.progress, false)?;
    let total = snap.regions().iter().map(|r| r.size).sum();
    let progress = lines.sink.as_ref().map(|s| {
        let p = RestoreProgress::start(s, total);
        crate::progress::report_stalls_to(p.reporter());
        p
    });
    crate::linux_snapshot::restore(&snap, mode, (args.console.as_deref(), run_for), progress)
}

pub(crate) fn restore_reported<I: SnapshotImage>(
    args: &RestoreArgs,
    image: &I,
) -> crate::Result<(snapshot::Restored, Option<RestoreProgress>)> {
    let lines = Progress::new(&args.progress, false)?;
    let total = image.regions().iter().map(|r| r.size).sum();
    let mut progress = lines
        .sink
        .as_ref()
        .map(|s| RestoreProgress::start(s, total));
    if let Some(p) = &progress {
        crate::progress::report_stalls_to(p.reporter());
    }
    let restored = args
        .restore_mode()
        .and_then(|mode| Ok(snapshot::restore(image, &mut VmBuilder, mode)?));
    match (&mut progress, &restored) {
        (Some(p), Ok(r)) => p.ready(&r.pagers, &r.userfault_pagers),
        (Some(p), Err(e)) => p.failed(&**e),
        _ => {}
    }
    Ok((restored?, progress))
}

/// Whether a full or map restore's memory matches the snapshot's digests (`None` for a lazy
/// restore, which checks each chunk's CRC-32 as it pages it in); a mismatch is an error, before
/// the guest is resumed.
fn check_digests(args: &RestoreArgs, vm: &Vm, snap: &Snapshot) -> crate::Result<Option<bool>> {
    // Full and map restores have all memory in place before the guest runs: check it whole.
    // A lazy restore checks each chunk's CRC-32 as it pages it in.
    let memory_digests_match = match args.mode {
        Mode::Lazy => None,
        Mode::Full | Mode::Map => {
            let mut all = true;
            for (region, image) in vm.memory().regions().iter().zip(&snap.manifest().regions) {
                all &= vm.memory().digest(region.gpa(), region.size())? == image.digest;
            }
            Some(all)
        }
    };
    if memory_digests_match == Some(false) {
        return Err(format!(
            "{}: restored memory differs from the snapshot's digests; the guest was not resumed",
            args.dir.display()
        )
        .into());
    }
    Ok(memory_digests_match)
}

/// Prints a restore's outcome as text (or JSON).
fn print_restore(args: &RestoreArgs, out: &RestoreOutput) -> crate::Result<()> {
    if args.json {
        crate::linux::end_console_line();
        println!(
            "{}",
            crate::report::json(crate::report::RESTORE, out, true)?
        );
    } else {
        println!("restored ({}) in {:.1} ms", out.mode, out.restore_ms);
        match out.memory_digests_match {
            Some(true) => println!("memory digests match the snapshot's: yes"),
            Some(false) => println!("memory digests match the snapshot's: NO"),
            None if args.uffd_socket.is_some() => println!(
                "memory served by the page server: this process cannot check those bytes, the \
                 server must (`guestmem page-server --snapshot {}` checks each chunk's CRC-32 \
                 before serving it; a server given only a memory file cannot)",
                args.dir.display()
            ),
            None => println!("memory checked chunk by chunk (CRC-32) as it was paged in"),
        }
        if let Some(ms) = out.resident_ms {
            println!("all memory resident {ms:.1} ms after the restore began");
        }
        if let Some(ws) = &out.working_set {
            println!(
                "working set: {} chunks {} ({}); {} page faults served during the run",
                ws.chunks,
                ws.action,
                args.dir.join("working-set.json").display(),
                ws.faults
            );
        }
        println!(
            "guest pages written per vCPU: {:?} at the snapshot, {:?} after running {:.1} s",
            out.pages_at_snapshot_per_vcpu, out.pages_after_run_per_vcpu, args.run_for
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_vcpu_writes_its_share_of_the_rate() {
        let share = |w: Workload| match w {
            Workload::Dirty { pages_per_s, .. } | Workload::Rewrite { pages_per_s, .. } => {
                pages_per_s
            }
            other => panic!("{other:?}"),
        };
        assert_eq!(share(vcpu_workload(Some(1000), 4, false)), Some(250));
        // At least a page a second each.
        assert_eq!(share(vcpu_workload(Some(2), 4, false)), Some(1));
        assert_eq!(share(vcpu_workload(None, 4, false)), None);
        assert!(matches!(
            vcpu_workload(Some(8), 2, true),
            Workload::Rewrite {
                pages_per_s: Some(4),
                passes: None
            }
        ));
    }

    fn restore_args(extra: &[&str]) -> RestoreArgs {
        let mut all = vec!["restore", "/snap"];
        all.extend_from_slice(extra);
        match crate::tests::parse_for_test(&all).unwrap() {
            crate::Command::Restore(a) => a,
            _ => unreachable!("restore parses as itself"),
        }
    }

    fn snapshot_args(extra: &[&str]) -> SnapshotArgs {
        let mut all = vec!["snapshot"];
        all.extend_from_slice(extra);
        match crate::tests::parse_for_test(&all).unwrap() {
            crate::Command::Snapshot(a) => a,
            _ => unreachable!("snapshot parses as itself"),
        }
    }

    /// `--clones N` needs `--mode lazy` and N of at least 1.
    #[test]
    fn clones_need_a_lazy_restore_and_one_clone_at_least() {
        let clones = |extra: &[&str]| restore_args(extra).clone_count().map_err(|e| e.to_string());
        assert_eq!(clones(&[]), Ok(None));
        assert_eq!(clones(&["--mode", "lazy", "--clones", "3"]), Ok(Some(3)));
        let refused = "--clones N restores N (at least 1) clones lazily: it needs --mode lazy";
        assert_eq!(clones(&["--clones", "3"]), Err(refused.to_string()));
        assert_eq!(
            clones(&["--mode", "map", "--clones", "2"]),
            Err(refused.to_string())
        );
        assert_eq!(
            clones(&["--mode", "lazy", "--clones", "0"]),
            Err(refused.to_string())
        );
    }

    /// `--mode` and `--uffd-socket` choose how memory comes back; `--share` goes only with
    /// an in-process lazy restore and `--uffd-socket` only with `--mode lazy`.
    #[test]
    fn restore_modes_follow_the_flags() {
        let mode = |extra: &[&str]| {
            restore_args(extra)
                .restore_mode()
                .map_err(|e| e.to_string())
        };
        assert!(matches!(mode(&[]), Ok(RestoreMode::Full)));
        assert!(matches!(mode(&["--mode", "map"]), Ok(RestoreMode::Map)));
        match mode(&["--mode", "lazy", "--share", "/dev/shm/x"]) {
            Ok(RestoreMode::Lazy(config)) => assert!(config.share.is_some()),
            other => panic!("{:?}", other.err()),
        }
        match mode(&["--mode", "lazy"]) {
            Ok(RestoreMode::Lazy(config)) => assert!(config.share.is_none()),
            other => panic!("{:?}", other.err()),
        }
        assert!(matches!(
            mode(&["--mode", "lazy", "--uffd-socket", "/run/uffd.sock"]),
            Ok(RestoreMode::PageServer(p)) if p == std::path::Path::new("/run/uffd.sock")
        ));
        assert_eq!(
            mode(&["--uffd-socket", "/run/uffd.sock"]).err().unwrap(),
            "--uffd-socket needs --mode lazy"
        );
        let share = "--share needs --mode lazy (served in this process, not --uffd-socket)";
        assert_eq!(mode(&["--share"]).err().unwrap(), share);
        assert_eq!(
            mode(&["--mode", "lazy", "--share", "--uffd-socket", "/s"])
                .err()
                .unwrap(),
            share
        );
        assert!(crate::tests::parse_for_test(&["restore", "/snap", "--mode", "eager"]).is_err());
    }

    /// A snapshot's own refusals, before any VM is made: a diff over itself, a merge across
    /// stores; clap's: --diff-after without --diff.
    #[test]
    fn snapshot_refusals_name_the_flags() {
        let e = snapshot(snapshot_args(&["--out", "/s/a", "--diff", "/s/a"]))
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "--diff must name another directory than --out (the diff's base)"
        );
        let e = snapshot(snapshot_args(&[
            "merge",
            "store:/tmp/one/diff",
            "--out",
            "store:/tmp/two/merged",
        ]))
        .unwrap_err()
        .to_string();
        assert_eq!(
            e,
            "--out store:/tmp/two/merged is in another store than store:/tmp/one/diff: a merge \
             reuses the chunks of its store"
        );
        let e = crate::tests::parse_for_test(&["snapshot", "--out", "/s", "--diff-after", "1"])
            .err()
            .unwrap();
        assert!(e.contains("--diff"), "{e}");
        assert!(crate::tests::parse_for_test(&["snapshot"])
            .err()
            .unwrap()
            .contains("--out"));
    }
}
