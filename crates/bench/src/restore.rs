//! `guestmem bench restore`: Firecracker's snapshot restore-latency test on guestmem. For every
//! memory size and vCPU count it runs the `dirty` workload over a working set (all of memory, or
//! the first `--working-set` bytes of it: the rest stays zero, a hole in the sparse memory
//! file), pauses the VM and snapshots it into a temporary directory, then restores it in each
//! mode and lets the guest go on:
//!
//! - `latency_ms`: from `Snapshot::open` to the first change of any vCPU's pages-done counter
//!   in its control block, polled by the host: the restored guest has executed instructions and
//!   finished writing a page (for lazy modes, after the pager served its first fault);
//! - `ready_ms`: from `Snapshot::open` until the restore call returned (memory in place or
//!   paged, every vCPU's state set): the vCPU threads enter `KVM_RUN` right after;
//! - `resident_ms`: from `Snapshot::open` until the whole working set is resident (full: the
//!   population, i.e. `ready_ms`; lazy: every chunk of the working set installed by the pager
//!   while the guest runs; map: not measured, pages come from the page cache on first touch);
//! - `retired_ms` (lazy): until all of memory was resident and the pagers retired.
//!
//! `lazy` runs without a recorded working set and records one (`working-set.json`); `lazy+ws`
//! then restores with it, its chunks fetched first. With `--prepared`, every mode also runs into
//! a VM built ahead of time for the snapshot's configuration (a warm pool: VM, memslots and
//! vCPUs created before the clock starts; rows with `prepared: true`): its `ready_ms` leaves
//! out creating the VM and registering the memslots (target: at most 2 ms at 1 GiB and 8 GiB).
//! Every figure is the median of `--runs`.
//! The temporary snapshots are deleted afterwards.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use guestmem_contract::VmBuilder;
use guestmem_memory::{Backend, PAGE_SIZE};
use guestmem_paging::{PagerConfig, PagerStats};
use guestmem_snapshot::progress::RestoreProgress;
use guestmem_snapshot::{self as snapshot, PreparedVm, RestoreMode, Restored, Snapshot};
use guestmem_vm::{layout, RunningVm, VcpuWork, Vm, VmConfig, Workload};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::envelope::Figure;
use crate::units::parse_size;

#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
enum Mode {
    Full,
    Map,
    Lazy,
    #[value(name = "lazy+ws")]
    #[serde(rename = "lazy+ws")]
    LazyWs,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Full => "full",
            Mode::Map => "map",
            Mode::Lazy => "lazy",
            Mode::LazyWs => "lazy+ws",
        }
    }
}

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Guest memory sizes, e.g. 128M,1G,8G.
    #[arg(long, default_value = "128M,1G", value_delimiter = ',', value_parser = parse_size)]
    sizes: Vec<u64>,
    /// vCPU counts, e.g. 1,2,8.
    #[arg(long, default_value = "1,2", value_delimiter = ',')]
    vcpus: Vec<usize>,
    /// Bytes the guest dirties before the snapshot (at most the memory size): the working set.
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    working_set: u64,
    /// Restore modes, in this order (lazy+ws needs lazy before it: lazy records the working set).
    #[arg(
        long,
        default_value = "full,map,lazy,lazy+ws",
        value_delimiter = ',',
        value_enum
    )]
    modes: Vec<Mode>,
    /// Also restore in every mode into a VM built ahead of time (a warm pool): rows with
    /// `prepared: true`.
    #[arg(long)]
    prepared: bool,
    /// Restores per mode; every figure is the median.
    #[arg(long, default_value_t = 1)]
    runs: usize,
    /// Make each restore's progress records and metrics, as `restore --progress json=FILE`
    /// and a `--metrics` registry do (encoded, then dropped): what they cost, for
    /// `scripts/bench-ab`.
    #[arg(long)]
    progress: bool,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize, Clone)]
struct Phase {
    phase: String,
    ms: f64,
}

#[derive(Serialize)]
struct Row {
    memory_bytes: u64,
    vcpus: usize,
    mode: Mode,
    /// Restored into a VM built ahead of time for its configuration (`--prepared`).
    prepared: bool,
    ready_ms: f64,
    latency_ms: f64,
    resident_ms: Option<f64>,
    retired_ms: Option<f64>,
    /// The runs behind `ready_ms`, `latency_ms` and `resident_ms`, with median, min and max.
    ready_ms_figure: Figure,
    latency_ms_figure: Figure,
    resident_ms_figure: Option<Figure>,
    /// Lazy modes: page-fault events the pagers saw, and chunks installed by each path.
    faults: Option<u64>,
    fault_chunks: Option<u64>,
    prefetch_chunks: Option<u64>,
    background_chunks: Option<u64>,
    /// `lazy`: chunks recorded as the working set for `lazy+ws`.
    recorded_working_set_chunks: Option<usize>,
    /// Lazy modes: where the restore spent its time (last run).
    phases: Vec<Phase>,
}

#[derive(Serialize)]
struct Ratio {
    memory_bytes: u64,
    vcpus: usize,
    /// Lazy restore's time to a resident working set over full restore's population time
    /// (the target: at most 1.25).
    lazy_to_full_resident_ratio: Option<f64>,
    lazy_ws_to_full_resident_ratio: Option<f64>,
}

#[derive(Serialize)]
struct Output {
    backend: Backend,
    working_set_bytes: u64,
    runs: usize,
    latency: &'static str,
    rows: Vec<Row>,
    ratios: Vec<Ratio>,
    /// With `--progress`: the progress records the restores made.
    progress_records: Option<u64>,
}

const LATENCY_DEFINITION: &str = "latency_ms: Snapshot::open to the first change of a vCPU's \
     pages-done counter (the restored guest ran and wrote a page); ready_ms: Snapshot::open to \
     the restore call returning (vCPU threads enter KVM_RUN next)";

/// The target of a restore into a prepared VM (warm pool): ready within this.
const PREPARED_READY_TARGET_MS: f64 = 2.0;

/// The pause before each restore.
const SETTLE: Duration = Duration::from_millis(300);

/// How long a restored guest may take to show progress or to get its working set resident.
const TIMEOUT: Duration = Duration::from_secs(300);

pub fn main(args: Args) -> crate::Result<()> {
    if args.sizes.is_empty() || args.vcpus.is_empty() || args.modes.is_empty() {
        return Err("--sizes, --vcpus and --modes each need at least one value".into());
    }
    if args.runs == 0 {
        return Err("--runs: at least 1 run is needed".into());
    }
    if let Some(&v) = args
        .vcpus
        .iter()
        .find(|&&v| v == 0 || v > layout::MAX_VCPUS)
    {
        return Err(format!("--vcpus: {v}: 1 to {} are supported", layout::MAX_VCPUS).into());
    }
    if let Some(&s) = args
        .sizes
        .iter()
        .find(|&&s| s == 0 || !s.is_multiple_of(snapshot::CHUNK_BYTES))
    {
        return Err(format!("--sizes: {s} is not a non-zero multiple of 2 MiB").into());
    }
    if args.working_set == 0 || !args.working_set.is_multiple_of(PAGE_SIZE) {
        return Err("--working-set must be a non-zero multiple of 4 KiB".into());
    }
    if let Some(i) = args.modes.iter().position(|&m| m == Mode::LazyWs) {
        if !args.modes[..i].contains(&Mode::Lazy) {
            return Err(
                "--modes: lazy+ws needs lazy before it (lazy records the working set)".into(),
            );
        }
    }
    let groups = args.sizes.len() * args.vcpus.len();
    let kinds = 1 + usize::from(args.prepared);
    let bar = if args.json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new((groups * (1 + kinds * args.modes.len() * args.runs)) as u64)
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}").expect("valid template"),
    );
    let mut rows = Vec::new();
    let mut ratios = Vec::new();
    for &size in &args.sizes {
        for &vcpus in &args.vcpus {
            let group = measure(&args, size, vcpus, &bar)?;
            let resident = |m: Mode| {
                group
                    .iter()
                    .find(|r| r.mode == m && !r.prepared)
                    .and_then(|r| r.resident_ms)
            };
            let full = resident(Mode::Full);
            ratios.push(Ratio {
                memory_bytes: size,
                vcpus,
                lazy_to_full_resident_ratio: resident(Mode::Lazy).zip(full).map(|(l, f)| l / f),
                lazy_ws_to_full_resident_ratio: resident(Mode::LazyWs)
                    .zip(full)
                    .map(|(l, f)| l / f),
            });
            rows.extend(group);
        }
    }
    bar.finish_and_clear();
    let out = Output {
        backend: Backend::Anon,
        working_set_bytes: args.working_set,
        runs: args.runs,
        latency: LATENCY_DEFINITION,
        rows,
        ratios,
        progress_records: crate::observe::records(args.progress),
    };
    if args.json {
        crate::envelope::print(&out)?;
    } else {
        print_table(&out);
    }
    Ok(())
}

/// A directory removed (with what it holds) when dropped.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Snapshots one VM of `size` bytes and `vcpus` vCPUs and restores it in every mode.
fn measure(args: &Args, size: u64, vcpus: usize, bar: &ProgressBar) -> crate::Result<Vec<Row>> {
    let dir = TempDir(std::env::temp_dir().join(format!(
        "guestmem-bench-restore-{}-{}M-{vcpus}",
        std::process::id(),
        size >> 20
    )));
    let ws = args.working_set.min(size);
    let work = VcpuWork::split(
        Workload::Dirty {
            pages_per_s: None,
            passes: None,
            fill_first: false,
        },
        layout::RAM_GPA,
        ws,
        vcpus,
        1,
    );
    bar.set_message(format!(
        "{} MiB, {vcpus} vCPUs: dirtying {} MiB, snapshot",
        size >> 20,
        ws >> 20
    ));
    {
        let mut vm = Vm::new(&VmConfig::simple(vcpus, size, Backend::Anon))?;
        let running = vm.start(&work)?;
        let deadline = Instant::now() + TIMEOUT;
        while running
            .progress()
            .iter()
            .any(|&(_, generation)| generation < 1)
        {
            if Instant::now() > deadline {
                return Err("the guest did not write its working set once in 300 s".into());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        running.pause()?;
        snapshot::write(&vm, &dir.0)?;
    }
    bar.inc(1);
    let mut rows = Vec::new();
    let config = VmConfig::simple(vcpus, size, Backend::Anon);
    for &mode in &args.modes {
        for prepared in [false, true] {
            if prepared && !args.prepared {
                continue;
            }
            bar.set_message(format!(
                "{} MiB, {vcpus} vCPUs: restore {}{}",
                size >> 20,
                mode.name(),
                if prepared { " into a prepared VM" } else { "" }
            ));
            let mut runs = Vec::new();
            for _ in 0..args.runs {
                // The warm pool's VM is built before the clock starts.
                let vm = prepared.then(|| PreparedVm::new(&config)).transpose()?;
                // Let the kernel finish tearing down the previous VM (its memory, its shadow
                // page tables) first: each restore starts on a settled host, as a fresh VMM
                // would.
                std::thread::sleep(SETTLE);
                runs.push(restore_once(&dir.0, (mode, ws), vm, args.progress)?);
                bar.inc(1);
            }
            rows.push(median_row(size, vcpus, mode, prepared, runs));
        }
    }
    Ok(rows)
}

struct Run {
    ready_ms: f64,
    latency_ms: f64,
    resident_ms: Option<f64>,
    retired_ms: Option<f64>,
    stats: Option<PagerStats>,
    recorded: Option<usize>,
    phases: Vec<Phase>,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// One restore of the snapshot in `dir` in `mode` (into `prepared` when given), the guest
/// running until the figures are in.
fn restore_once(
    dir: &Path,
    (mode, ws): (Mode, u64),
    prepared: Option<PreparedVm>,
    progress: bool,
) -> crate::Result<Run> {
    if mode == Mode::Lazy {
        // Plain lazy restores run without a working set (an earlier run may have left one).
        let _ = std::fs::remove_file(dir.join("working-set.json"));
    }
    let t = Instant::now();
    let snap = Snapshot::open(dir)?;
    let opened = t.elapsed();
    if mode == Mode::LazyWs && snap.working_set()?.is_none() {
        return Err("lazy+ws: no working set was recorded by the lazy run".into());
    }
    let total = snap.manifest().regions.iter().map(|r| r.spec.size).sum();
    let mut records =
        crate::observe::sink(progress).map(|sink| RestoreProgress::start(&sink, total));
    match mode {
        Mode::Full | Mode::Map => restore_eager(&snap, mode, prepared, (t, records.as_mut())),
        Mode::Lazy | Mode::LazyWs => {
            restore_lazy(&snap, (mode, ws), prepared, (t, opened, records.as_mut()))
        }
    }
}

/// A full or mapped restore of `snap` (`mode`), timed from `t`.
fn restore_eager(
    snap: &Snapshot,
    mode: Mode,
    prepared: Option<PreparedVm>,
    (t, records): (Instant, Option<&mut RestoreProgress>),
) -> crate::Result<Run> {
    let restore_mode = if mode == Mode::Full {
        RestoreMode::Full
    } else {
        RestoreMode::Map
    };
    let mut vm = match prepared {
        Some(p) => snapshot::restore(snap, p, restore_mode)?.vm,
        None => snapshot::restore(snap, &mut VmBuilder, restore_mode)?.vm,
    };
    if let Some(r) = records {
        r.ready(&[], &[]);
    }
    let ready = t.elapsed();
    let running = vm.resume()?;
    let latency = first_progress(&running, t)?;
    finish(running)?;
    Ok(Run {
        ready_ms: ms(ready),
        latency_ms: ms(latency),
        // Full: all memory is in place when the restore returns.
        resident_ms: (mode == Mode::Full).then(|| ms(ready)),
        retired_ms: None,
        stats: None,
        recorded: None,
        phases: Vec::new(),
    })
}

/// A lazy restore of `snap` (`mode`: with its working set or without, recording one), timed
/// from `t`, the snapshot having been opened in `opened`.
fn restore_lazy(
    snap: &Snapshot,
    (mode, ws): (Mode, u64),
    prepared: Option<PreparedVm>,
    (t, opened, mut records): (Instant, Duration, Option<&mut RestoreProgress>),
) -> crate::Result<Run> {
    let lazy = RestoreMode::Lazy(PagerConfig::default());
    let Restored {
        pagers,
        mut vm,
        mut phases,
        ..
    } = match prepared {
        Some(p) => snapshot::restore(snap, p, lazy)?,
        None => snapshot::restore(snap, &mut VmBuilder, lazy)?,
    };
    phases.insert(0, ("Snapshot::open".to_string(), opened));
    if let Some(r) = records.as_mut() {
        r.ready(&pagers, &[]);
    }
    let ready = t.elapsed();
    let running = vm.resume()?;
    let latency = first_progress(&running, t)?;
    let resident = wait_working_set(&pagers, ws, t)?;
    let mut retired = None;
    for p in &pagers {
        if !p.wait_resident(TIMEOUT)? {
            return Err("the lazily restored memory was not resident after 300 s".into());
        }
        retired = Some(t.elapsed());
    }
    finish(running)?;
    if let Some(r) = records {
        r.finish();
    }
    let stats = chunk_counts(pagers.iter().map(guestmem_paging::Pager::stats));
    let recorded = if mode == Mode::Lazy {
        Some(snapshot::record_working_set(
            snap,
            vm.memory(),
            &pagers,
            &[],
        )?)
    } else {
        None
    };
    // The pagers go before the VM and its memory.
    drop(pagers);
    drop(vm);
    Ok(Run {
        ready_ms: ms(ready),
        latency_ms: ms(latency),
        resident_ms: Some(ms(resident)),
        retired_ms: retired.map(ms),
        stats: Some(stats),
        recorded,
        phases: phases
            .iter()
            .map(|(phase, d)| Phase {
                phase: phase.clone(),
                ms: ms(*d),
            })
            .collect(),
    })
}

/// Waits until the working set is resident: the one pager serves the "ram" region, whose
/// first `ws` bytes are the working set. Returns when it was, from `t`.
fn wait_working_set(
    pagers: &[guestmem_paging::Pager],
    ws: u64,
    t: Instant,
) -> crate::Result<Duration> {
    loop {
        if pagers.iter().all(|p| p.is_resident(0, ws)) {
            return Ok(t.elapsed());
        }
        if let Some(f) = pagers.iter().find_map(guestmem_paging::Pager::failure) {
            return Err(f.into());
        }
        if t.elapsed() > TIMEOUT {
            return Err("the working set was not resident after 300 s".into());
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// The pagers' fault and chunk counts added up (the other fields left at their default).
fn chunk_counts(stats: impl Iterator<Item = PagerStats>) -> PagerStats {
    stats.fold(PagerStats::default(), |mut a, s| {
        a.faults += s.faults;
        a.fault_chunks += s.fault_chunks;
        a.readahead_chunks += s.readahead_chunks;
        a.prefetch_chunks += s.prefetch_chunks;
        a.background_chunks += s.background_chunks;
        a
    })
}

/// Polls the vCPUs' pages-done counters (every ~20-80 µs) until one moves; returns the time
/// since `t`.
fn first_progress(running: &RunningVm<'_>, t: Instant) -> crate::Result<Duration> {
    let start: Vec<u64> = running.progress().iter().map(|p| p.0).collect();
    loop {
        if running
            .progress()
            .iter()
            .zip(&start)
            .any(|(now, &before)| now.0 != before)
        {
            return Ok(t.elapsed());
        }
        if t.elapsed() > TIMEOUT {
            return Err("the restored guest made no progress in 300 s".into());
        }
        // A short sleep, not a spin: on a small host a spinning poller takes a CPU from the
        // vCPUs and the pager it is timing.
        std::thread::sleep(Duration::from_micros(20));
    }
}

/// Stops the guest and checks that it ended cleanly.
fn finish(running: RunningVm<'_>) -> crate::Result<()> {
    running.stop();
    running.wait(Duration::from_secs(60))?;
    Ok(())
}

/// The median as the figures report it (the mean of the middle two for an even count).
fn median(v: Vec<f64>) -> f64 {
    Figure::of(&v).map_or(f64::NAN, |f| f.median)
}

fn median_row(memory_bytes: u64, vcpus: usize, mode: Mode, prepared: bool, runs: Vec<Run>) -> Row {
    let opt = |f: &dyn Fn(&Run) -> Option<f64>| -> Option<f64> {
        let v: Vec<f64> = runs.iter().filter_map(f).collect();
        (!v.is_empty()).then(|| median(v))
    };
    let stat = |f: &dyn Fn(&PagerStats) -> u64| -> Option<u64> {
        let mut v: Vec<u64> = runs
            .iter()
            .filter_map(|r| r.stats.as_ref().map(f))
            .collect();
        v.sort_unstable();
        v.get(v.len() / 2).copied()
    };
    let figure = |v: Vec<f64>| Figure::of(&v);
    let ready = figure(runs.iter().map(|r| r.ready_ms).collect());
    let latency = figure(runs.iter().map(|r| r.latency_ms).collect());
    let ready_ms_figure = ready.expect("--runs is at least 1 and times are not NaN");
    let latency_ms_figure = latency.expect("--runs is at least 1 and times are not NaN");
    Row {
        memory_bytes,
        vcpus,
        mode,
        prepared,
        ready_ms_figure,
        latency_ms_figure,
        resident_ms_figure: figure(runs.iter().filter_map(|r| r.resident_ms).collect()),
        ready_ms: median(runs.iter().map(|r| r.ready_ms).collect()),
        latency_ms: median(runs.iter().map(|r| r.latency_ms).collect()),
        resident_ms: opt(&|r| r.resident_ms),
        retired_ms: opt(&|r| r.retired_ms),
        faults: stat(&|s| s.faults),
        fault_chunks: stat(&|s| s.fault_chunks + s.readahead_chunks),
        prefetch_chunks: stat(&|s| s.prefetch_chunks),
        background_chunks: stat(&|s| s.background_chunks),
        recorded_working_set_chunks: runs.last().and_then(|r| r.recorded),
        phases: runs.last().map(|r| r.phases.clone()).unwrap_or_default(),
    }
}

fn print_table(out: &Output) {
    println!(
        "restore of an anon VM whose guest dirtied min(memory, {} MiB), snapshot in the page \
         cache, median of {} run(s)",
        out.working_set_bytes >> 20,
        out.runs
    );
    println!("{}", out.latency);
    println!(
        "{:>8} {:>5} {:>12} {:>9} {:>10} {:>11} {:>10} {:>7} {:>13} {:>9}",
        "memory",
        "vCPUs",
        "mode",
        "ready ms",
        "latency ms",
        "resident ms",
        "retired ms",
        "faults",
        "fault chunks",
        "prefetch"
    );
    let opt = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1}"));
    let n = |v: Option<u64>| v.map_or("-".to_string(), |v| v.to_string());
    for r in &out.rows {
        println!(
            "{:>8} {:>5} {:>12} {:>9.2} {:>10.2} {:>11} {:>10} {:>7} {:>13} {:>9}",
            format!("{} MiB", r.memory_bytes >> 20),
            r.vcpus,
            mode_label(r),
            r.ready_ms,
            r.latency_ms,
            opt(r.resident_ms),
            opt(r.retired_ms),
            n(r.faults),
            n(r.fault_chunks),
            n(r.prefetch_chunks),
        );
    }
    for q in &out.ratios {
        println!(
            "{} MiB, {} vCPUs: lazy_to_full_resident_ratio {} (target <= 1.25), lazy+ws {}",
            q.memory_bytes >> 20,
            q.vcpus,
            q.lazy_to_full_resident_ratio
                .map_or("-".into(), |r| format!("{r:.2}")),
            q.lazy_ws_to_full_resident_ratio
                .map_or("-".into(), |r| format!("{r:.2}")),
        );
    }
    for r in out.rows.iter().filter(|r| !r.phases.is_empty()) {
        let mut phases = r.phases.clone();
        phases.sort_by(|a, b| b.ms.total_cmp(&a.ms));
        let top: Vec<String> = phases
            .iter()
            .take(4)
            .map(|p| format!("{} {:.2}", p.phase, p.ms))
            .collect();
        println!(
            "{} MiB, {} vCPUs, {}: slowest restore steps (ms): {}",
            r.memory_bytes >> 20,
            r.vcpus,
            mode_label(r),
            top.join(", ")
        );
    }
    // The target is for a restore whose guest runs at once (lazy): a full restore copies
    // every page in first, prepared VM or not.
    for r in out
        .rows
        .iter()
        .filter(|r| r.prepared && matches!(r.mode, Mode::Lazy | Mode::LazyWs))
    {
        let met = if r.ready_ms <= PREPARED_READY_TARGET_MS {
            "met"
        } else {
            "NOT met"
        };
        println!(
            "{} MiB, {} vCPUs, {} into a prepared VM: ready {:.2} ms (target <= \
             {PREPARED_READY_TARGET_MS} ms: {met})",
            r.memory_bytes >> 20,
            r.vcpus,
            r.mode.name(),
            r.ready_ms,
        );
    }
}

/// The mode as the table shows it: `lazy`, or `lazy/prep` for a restore into a prepared VM.
fn mode_label(r: &Row) -> String {
    if r.prepared {
        format!("{}/prep", r.mode.name())
    } else {
        r.mode.name().to_string()
    }
}

#[cfg(test)]
mod tests {
    fn error_of(argv: &[&str]) -> String {
        crate::refusal(argv, super::main)
    }

    #[test]
    fn the_pagers_counts_add_up() {
        let one = super::PagerStats {
            faults: 3,
            fault_chunks: 2,
            readahead_chunks: 5,
            prefetch_chunks: 7,
            background_chunks: 11,
            resident_bytes: 1 << 20,
            ..Default::default()
        };
        let two = super::PagerStats {
            faults: 1,
            background_chunks: 4,
            ..Default::default()
        };
        let sum = super::chunk_counts([one, two].into_iter());
        assert_eq!(
            (sum.faults, sum.fault_chunks, sum.readahead_chunks),
            (4, 2, 5)
        );
        assert_eq!((sum.prefetch_chunks, sum.background_chunks), (7, 15));
        // Only the counts are added.
        assert_eq!(sum.resident_bytes, 0);
    }

    #[test]
    fn bad_arguments_are_refused_before_any_work() {
        assert!(error_of(&["--vcpus", "1,0"]).contains("--vcpus: 0"));
        assert!(error_of(&["--sizes", "3M"]).contains("2 MiB"));
        assert!(error_of(&["--runs", "0"]).contains("--runs"));
        assert!(error_of(&["--modes", "lazy+ws,lazy"]).contains("lazy+ws needs lazy"));
        assert!(crate::parse::<super::Args>(&["--modes", "eager"]).is_err());
    }
}
