//! `guestmem bench dirty-log`: the kernel's dirty_log_perf_test, for each tracking mode in one
//! run (O(1) write-protect-all dirty tracking): populate, enable logging, per-iteration dirty time
//! and get/clear time, disable; then the guest's dirty rate in a migration-like loop (a fresh
//! pre-copy: enable, first pass over all memory, then rounds; harvest every 100 ms, send at a set
//! bandwidth, clear each chunk just before sending it), with no tracking and under each mode; and
//! the idle harvest of a large, sparse VM.
//!
//! Each mode's VM is populated once; then everything after it (enable, the dirty-log iterations,
//! disable, the loop) runs `--runs` times on it, and each of those figures carries its runs,
//! median, min and max (`*_figure`) beside its plain field, which is the median (the iterations'
//! lists hold every iteration of every run). The idle harvest is the median of 21.

use guestmem_sys::to_usize;
use std::collections::VecDeque;
use std::rc::Rc;
use std::time::{Duration, Instant};

use guestmem_memory::{Backend, GuestMemory, PAGE_SIZE};
use guestmem_tracking::{ring_bytes, DirtyBitmap, Mode, Tracker, DEFAULT_RING_ENTRIES};
use guestmem_vm::{layout, RunningVm, VcpuWork, Vm, VmConfig, Workload};
use serde::Serialize;

use crate::envelope::Figure;
use crate::units::parse_size;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// vCPUs.
    #[arg(short = 'v', long, default_value_t = 1)]
    vcpus: usize,
    /// Guest memory per vCPU, e.g. 1G.
    #[arg(short = 'b', long, default_value = "1G", value_parser = parse_size)]
    bytes_per_vcpu: u64,
    /// Dirty-log iterations (each: one guest pass, then get and clear).
    #[arg(short = 'i', long, default_value_t = 2)]
    iterations: u64,
    /// Runs per mode of everything after populating (enable, iterations, disable, the loop).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    runs: u32,
    /// Tracking mode: ring, manual, bitmap or all.
    #[arg(short = 'm', long, default_value = "all")]
    mode: String,
    /// Percentage of pages the guest writes (the others it reads), 0-100.
    #[arg(short = 'w', long, default_value_t = 100)]
    write_percent: u64,
    /// Length of the migration-like loop (harvest every 100 ms, send at --send-mib-per-s), in
    /// seconds.
    #[arg(long, default_value_t = 2.0)]
    loop_seconds: f64,
    /// Send bandwidth of the migration-like loop, MiB/s (1024: about a 10 Gbit/s link).
    #[arg(long, default_value_t = 1024)]
    send_mib_per_s: u64,
    /// Dirty ring entries per vCPU (ring mode).
    #[arg(long, default_value_t = DEFAULT_RING_ENTRIES)]
    ring_entries: u32,
    /// Size of the sparse VM whose idle harvest is timed (0: skip).
    #[arg(long, default_value = "64G", value_parser = parse_size)]
    sparse: u64,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

const HARVEST_PERIOD: Duration = Duration::from_millis(100);
/// Pages cleared (manual mode) and then consumed at a time.
const CHUNK_PAGES: u64 = 4096;

#[derive(Serialize)]
struct ModeResult {
    mode: String,
    /// Once per mode.
    populate_ms: f64,
    /// The median run's figures (enable and disable 0 without tracking), every iteration of
    /// every run.
    #[serde(flatten)]
    phases: Phases,
    /// The median rates' ratio.
    ratio_vs_bitmap: Option<f64>,
    ring_full_exits: u64,
    /// The runs behind the figures above (no enable, get, clear or disable without tracking).
    enable_ms_figure: Option<Figure>,
    dirty_ms_figure: Figure,
    get_ms_figure: Option<Figure>,
    clear_ms_figure: Option<Figure>,
    disable_ms_figure: Option<Figure>,
    rate_pages_per_s_figure: Figure,
    loop_harvested_pages_figure: Figure,
}

/// What one run of a mode on its populated VM measures.
#[derive(Serialize)]
struct Phases {
    enable_ms: f64,
    /// Per iteration: guest time to dirty its memory once.
    dirty_ms: Vec<f64>,
    /// Per iteration: harvest (get) time and clear time of all pages dirtied.
    get_ms: Vec<f64>,
    clear_ms: Vec<f64>,
    disable_ms: f64,
    /// The guest's dirty rate in the migration-like loop.
    rate_pages_per_s: f64,
    /// Pages harvested and consumed in that loop.
    loop_harvested_pages: u64,
}

#[derive(Serialize)]
struct SparseResult {
    mode: String,
    memory_bytes: u64,
    /// The median of 21 harvests.
    idle_harvest_ms: f64,
    idle_harvest_ms_figure: Figure,
}

#[derive(Serialize)]
struct Output {
    vcpus: usize,
    bytes_per_vcpu: u64,
    iterations: u64,
    runs: u32,
    write_percent: u64,
    modes: Vec<ModeResult>,
    sparse: Vec<SparseResult>,
}

pub fn main(args: Args) -> crate::Result<()> {
    if args.vcpus == 0 || args.iterations == 0 {
        return Err("-v and -i must be at least 1".into());
    }
    if args.write_percent > 100 {
        return Err(format!("-w {} is above 100 percent", args.write_percent).into());
    }
    if args.send_mib_per_s == 0 {
        return Err("--send-mib-per-s must be at least 1".into());
    }
    crate::units::seconds(args.loop_seconds, "--loop-seconds")?;
    if args.bytes_per_vcpu < PAGE_SIZE || !args.bytes_per_vcpu.is_multiple_of(PAGE_SIZE) {
        return Err(format!(
            "-b {} is not a positive multiple of 4 KiB",
            args.bytes_per_vcpu
        )
        .into());
    }
    let modes: Vec<Mode> = match args.mode.as_str() {
        "all" => Mode::ALL.to_vec(),
        m => vec![m.parse()?],
    };
    let progress = indicatif::ProgressBar::new_spinner();
    progress.enable_steady_tick(Duration::from_millis(200));
    let mut results = vec![measure(None, &args, &progress)?];
    for &mode in &modes {
        results.push(measure(Some(mode), &args, &progress)?);
    }
    let bitmap_rate = results
        .iter()
        .find(|r| r.mode == "bitmap")
        .map(|r| r.phases.rate_pages_per_s);
    for r in &mut results {
        r.ratio_vs_bitmap = bitmap_rate.map(|b| r.phases.rate_pages_per_s / b);
    }
    let mut sparse = Vec::new();
    if args.sparse > 0 {
        for &mode in &modes {
            progress.set_message(format!("{mode}: idle harvest of a sparse VM"));
            sparse.push(idle_harvest(mode, &args)?);
        }
    }
    progress.finish_and_clear();
    let out = Output {
        vcpus: args.vcpus,
        bytes_per_vcpu: args.bytes_per_vcpu,
        iterations: args.iterations,
        runs: args.runs,
        write_percent: args.write_percent,
        modes: results,
        sparse,
    };
    if args.json {
        crate::envelope::print(&out)?;
    } else {
        print_table(&out);
    }
    Ok(())
}

fn config(mode: Option<Mode>, vcpus: usize, size: u64, ring_entries: u32) -> VmConfig {
    let mut config = VmConfig::simple(vcpus, size, Backend::Anon);
    if mode == Some(Mode::Ring) {
        config.dirty_ring_bytes = Some(ring_bytes(ring_entries));
    }
    config
}

/// The guest's stall timeout.
const STALL: Duration = Duration::from_secs(60);

/// One VM, tracked in `mode` (or not at all), populated; then `--runs` times the
/// dirty_log_perf_test phases and the loop.
#[allow(clippy::cast_possible_truncation)] // a rounded median of page counts: a float to integer cast saturates.
fn measure(
    mode: Option<Mode>,
    args: &Args,
    progress: &indicatif::ProgressBar,
) -> crate::Result<ModeResult> {
    let name = mode.map_or("none".to_string(), |m| m.to_string());
    progress.set_message(format!("{name}: populating"));
    let size = args.bytes_per_vcpu * args.vcpus as u64;
    let mut vm = Vm::new(&config(mode, args.vcpus, size, args.ring_entries))?;

    let t = Instant::now();
    vm.run(
        &VcpuWork::split(Workload::Touch, layout::RAM_GPA, size, args.vcpus, 1),
        STALL,
    )?;
    let populate_ms = ms(t);

    let mut runs = Vec::new();
    for run in 1..=args.runs {
        let name = format!("{name} (run {run}/{})", args.runs);
        runs.push(measure_run(&mut vm, mode, args, &name, progress)?);
    }
    let figure = |f: fn(&Phases) -> f64| Figure::measured(&runs.iter().map(f).collect::<Vec<_>>());
    let all = |f: fn(&Phases) -> &Vec<f64>| runs.iter().flat_map(f).copied().collect::<Vec<_>>();
    let tracked = |f: Figure| mode.is_some().then_some(f);
    let (dirty_ms, get_ms, clear_ms) = (
        all(|r| &r.dirty_ms),
        all(|r| &r.get_ms),
        all(|r| &r.clear_ms),
    );
    let enable = tracked(figure(|r| r.enable_ms));
    let disable = tracked(figure(|r| r.disable_ms));
    let rate = figure(|r| r.rate_pages_per_s);
    let harvested = figure(|r| r.loop_harvested_pages as f64);
    Ok(ModeResult {
        mode: name,
        populate_ms,
        dirty_ms_figure: Figure::measured(&dirty_ms),
        get_ms_figure: Figure::of(&get_ms),
        clear_ms_figure: Figure::of(&clear_ms),
        phases: Phases {
            enable_ms: enable.as_ref().map_or(0.0, |f| f.median),
            dirty_ms,
            get_ms,
            clear_ms,
            disable_ms: disable.as_ref().map_or(0.0, |f| f.median),
            rate_pages_per_s: rate.median,
            loop_harvested_pages: harvested.median.round() as u64,
        },
        ratio_vs_bitmap: None,
        ring_full_exits: vm.dirty_ring_full_exits(),
        enable_ms_figure: enable,
        disable_ms_figure: disable,
        rate_pages_per_s_figure: rate,
        loop_harvested_pages_figure: harvested,
    })
}

/// One run on `vm`, populated and tracked in `mode` (or not at all): enable, the dirty-log
/// iterations, disable, then the migration-like loop (`name` for the progress line).
fn measure_run(
    vm: &mut Vm,
    mode: Option<Mode>,
    args: &Args,
    name: &str,
    progress: &indicatif::ProgressBar,
) -> crate::Result<Phases> {
    let size = args.bytes_per_vcpu * args.vcpus as u64;
    let stall = STALL;
    let work = |workload| VcpuWork::split(workload, layout::RAM_GPA, size, args.vcpus, 1);

    let t = Instant::now();
    let mut tracker = mode.map(|m| Tracker::start(vm, m)).transpose()?;
    let enable_ms = ms(t);
    let memory = vm.memory().clone();
    let mut buf = vec![0u8; to_usize(CHUNK_PAGES * PAGE_SIZE)];
    if let Some(tracker) = tracker.as_mut() {
        // Manual mode starts with every page dirty: the first full pass of a pre-copy.
        let all = tracker.harvest()?;
        consume(tracker, &memory, all, &mut buf)?;
    }

    progress.set_message(format!(
        "{name}: {} dirty-log iteration(s)",
        args.iterations
    ));
    let mixed = Workload::Mixed {
        write_percent: args.write_percent,
        passes: None,
    };
    let (dirty_ms, get_ms, clear_ms) = iterations(vm, &mut tracker, &work(mixed), args)?;

    let t = Instant::now();
    if let Some(tracker) = tracker.take() {
        tracker.stop()?;
    }
    let disable_ms = ms(t);

    // The migration-like loop, a fresh pre-copy: logging is enabled just as the guest starts
    // dirtying at full speed; the first pass sends all of memory, later rounds what was dirtied.
    // Every 100 ms the host harvests and queues the dirty chunks, then sends chunks from the
    // queue at --send-mib-per-s, clearing each just before sending it.
    progress.set_message(format!("{name}: migration-like loop"));
    let mut loop_harvested_pages = 0;
    let pages_per_period = (args.send_mib_per_s << 20) / PAGE_SIZE / 10;
    let mut tracker = mode.map(|m| Tracker::start(vm, m)).transpose()?;
    let mut queue = if mode.is_some_and(|m| m != Mode::Manual) {
        // Manual mode's first harvest reports all of memory by itself (INITIALLY_SET).
        all_of(&memory)
    } else {
        VecDeque::new()
    };
    let report = {
        let running = vm.start(&work(mixed))?;
        let end = Instant::now() + Duration::from_secs_f64(args.loop_seconds);
        while Instant::now() < end {
            std::thread::sleep(HARVEST_PERIOD);
            let Some(tracker) = tracker.as_mut() else {
                continue;
            };
            loop_harvested_pages +=
                harvest_and_send(tracker, &memory, &mut queue, pages_per_period, &mut buf)?;
        }
        running.stop();
        running.wait(stall)?
    };
    if let Some(tracker) = tracker {
        tracker.stop()?;
    }
    Ok(Phases {
        enable_ms,
        dirty_ms,
        get_ms,
        clear_ms,
        disable_ms,
        rate_pages_per_s: report.total_pages_per_s * args.write_percent as f64 / 100.0,
        loop_harvested_pages,
    })
}

/// The dirty-log iterations: the guest runs `work` one pass at a time; after each the dirty
/// pages are harvested and cleared chunk by chunk. Milliseconds per pass (dirty), harvest (get)
/// and clear.
fn iterations(
    vm: &mut Vm,
    tracker: &mut Option<Tracker>,
    work: &[VcpuWork],
    args: &Args,
) -> crate::Result<(Vec<f64>, Vec<f64>, Vec<f64>)> {
    let (mut dirty_ms, mut get_ms, mut clear_ms) = (vec![], vec![], vec![]);
    let running = vm.start(work)?;
    for i in 1..=args.iterations {
        let t = Instant::now();
        running.set_generation_limit(i);
        // A pass may dirty more pages than a ring holds: ring mode harvests while it runs.
        let mut get = Duration::ZERO;
        let mut dirty = Vec::new();
        while !pass_done(&running, i, t, STALL)? {
            if let Some(tracker) = tracker.as_mut().filter(|t| t.mode() == Mode::Ring) {
                let h = Instant::now();
                dirty.extend(tracker.harvest()?);
                get += h.elapsed();
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        dirty_ms.push(ms(t));
        if let Some(tracker) = tracker.as_mut() {
            let h = Instant::now();
            dirty.extend(tracker.harvest()?);
            get_ms.push((get + h.elapsed()).as_secs_f64() * 1e3);
            let t = Instant::now();
            for b in &dirty {
                for first in (0..b.pages).step_by(to_usize(CHUNK_PAGES)) {
                    tracker.clear(b, first, CHUNK_PAGES.min(b.pages - first))?;
                }
            }
            clear_ms.push(ms(t));
        }
    }
    running.stop();
    running.wait(STALL)?;
    Ok((dirty_ms, get_ms, clear_ms))
}

/// Every chunk of every region, as a fresh pre-copy's first pass sends them.
fn all_of(memory: &GuestMemory) -> VecDeque<(Rc<DirtyBitmap>, u64)> {
    let mut queue = VecDeque::new();
    for (slot, r) in memory.regions().iter().enumerate() {
        let pages = r.size() / PAGE_SIZE;
        let all = Rc::new(DirtyBitmap {
            slot: u32::try_from(slot).expect("memslot ids are u32"),
            gpa: r.gpa(),
            pages,
            bits: vec![u64::MAX; pages.div_ceil(64) as usize],
        });
        queue.extend(
            (0..pages)
                .step_by(to_usize(CHUNK_PAGES))
                .map(|f| (all.clone(), f)),
        );
    }
    queue
}

/// One period of the migration-like loop: harvests and queues the dirty chunks, then sends up
/// to `pages_per_period` pages from the queue, clearing each chunk just before sending it.
/// Returns the pages harvested.
fn harvest_and_send(
    tracker: &mut Tracker,
    memory: &GuestMemory,
    queue: &mut VecDeque<(Rc<DirtyBitmap>, u64)>,
    pages_per_period: u64,
    buf: &mut [u8],
) -> crate::Result<u64> {
    let mut harvested = 0;
    for b in tracker.harvest()? {
        harvested += b.count();
        let b = Rc::new(b);
        queue.extend(
            (0..b.pages)
                .step_by(to_usize(CHUNK_PAGES))
                .map(|f| (b.clone(), f)),
        );
    }
    let mut budget = pages_per_period;
    while budget > 0 {
        let Some((b, first)) = queue.pop_front() else {
            break;
        };
        let pages = CHUNK_PAGES.min(b.pages - first);
        tracker.clear(&b, first, pages)?;
        budget = budget.saturating_sub(send_chunk(memory, &b, first, pages, buf)?);
    }
    Ok(harvested)
}

/// Clears each chunk of the harvest, then copies its dirty pages out, as a migration sends them.
fn consume(
    tracker: &mut Tracker,
    memory: &GuestMemory,
    dirty: Vec<DirtyBitmap>,
    buf: &mut [u8],
) -> crate::Result<()> {
    for b in &dirty {
        for first in (0..b.pages).step_by(to_usize(CHUNK_PAGES)) {
            let pages = CHUNK_PAGES.min(b.pages - first);
            tracker.clear(b, first, pages)?;
            send_chunk(memory, b, first, pages, buf)?;
        }
    }
    Ok(())
}

/// Copies the dirty pages of chunk `[first, first + pages)` of `b` out ("sends" them); returns
/// how many pages that was.
fn send_chunk(
    memory: &GuestMemory,
    b: &DirtyBitmap,
    first: u64,
    pages: u64,
    buf: &mut [u8],
) -> crate::Result<u64> {
    let chunk_gpa = b.gpa + first * PAGE_SIZE;
    let chunk_end = chunk_gpa + pages * PAGE_SIZE;
    let mut sent = 0;
    for (gpa, len) in b.ranges().skip_while(|&(g, l)| g + l <= chunk_gpa) {
        if gpa >= chunk_end {
            break;
        }
        let (from, to) = (gpa.max(chunk_gpa), (gpa + len).min(chunk_end));
        memory.read(from, &mut buf[..to_usize(to - from)])?;
        sent += (to - from) / PAGE_SIZE;
    }
    Ok(sent)
}

/// Whether every vCPU has finished pass `generation` (started at `since`).
fn pass_done(
    running: &RunningVm<'_>,
    generation: u64,
    since: Instant,
    stall: Duration,
) -> crate::Result<bool> {
    let progress = running.progress();
    if progress.iter().all(|&(_, g)| g >= generation) {
        return Ok(true);
    }
    if since.elapsed() > stall {
        return Err(format!(
            "the guest did not finish pass {generation} within {stall:?} (pages done, passes per \
             vCPU: {progress:?})"
        )
        .into());
    }
    Ok(false)
}

/// A large VM with only 64 MiB touched, tracked in `mode`: the median time of an idle harvest.
fn idle_harvest(mode: Mode, args: &Args) -> crate::Result<SparseResult> {
    let mut vm = Vm::new(&config(Some(mode), 1, args.sparse, args.ring_entries))?;
    let touched = 64 << 20;
    vm.run(
        &VcpuWork::split(Workload::Touch, layout::RAM_GPA, touched, 1, 1),
        Duration::from_secs(60),
    )?;
    let mut tracker = Tracker::start(&vm, mode)?;
    // Clear (without copying) what manual mode's first harvest reports: all of memory.
    for b in tracker.harvest()? {
        for first in (0..b.pages).step_by(to_usize(CHUNK_PAGES)) {
            tracker.clear(&b, first, CHUNK_PAGES.min(b.pages - first))?;
        }
    }
    let times: Vec<f64> = (0..21)
        .map(|_| {
            let t = Instant::now();
            let dirty = tracker.harvest()?;
            let elapsed = ms(t);
            if !dirty.is_empty() {
                return Err(
                    format!("an idle {mode} harvest reported {} pages", dirty.len()).into(),
                );
            }
            Ok(elapsed)
        })
        .collect::<crate::Result<_>>()?;
    tracker.stop()?;
    let figure = Figure::measured(&times);
    Ok(SparseResult {
        mode: mode.to_string(),
        memory_bytes: args.sparse,
        idle_harvest_ms: figure.median,
        idle_harvest_ms_figure: figure,
    })
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn mean(v: &[f64]) -> String {
    if v.is_empty() {
        "-".into()
    } else {
        format!("{:.2}", v.iter().sum::<f64>() / v.len() as f64)
    }
}

fn print_table(out: &Output) {
    println!(
        "dirty-log: {} vCPU(s) x {} MiB, {} iteration(s), {}% writes, {} run(s) (medians)",
        out.vcpus,
        out.bytes_per_vcpu >> 20,
        out.iterations,
        out.write_percent,
        out.runs
    );
    println!(
        "{:>7} {:>11} {:>10} {:>13} {:>11} {:>13} {:>11} {:>16} {:>9} {:>10}",
        "mode",
        "populate ms",
        "enable ms",
        "dirty ms/iter",
        "get ms/iter",
        "clear ms/iter",
        "disable ms",
        "rate pages/s",
        "vs bitmap",
        "ring full"
    );
    for r in &out.modes {
        println!(
            "{:>7} {:>11.1} {:>10.3} {:>13} {:>11} {:>13} {:>11.3} {:>16.0} {:>9} {:>10}",
            r.mode,
            r.populate_ms,
            r.phases.enable_ms,
            mean(&r.phases.dirty_ms),
            mean(&r.phases.get_ms),
            mean(&r.phases.clear_ms),
            r.phases.disable_ms,
            r.phases.rate_pages_per_s,
            r.ratio_vs_bitmap.map_or("-".into(), |x| format!("{x:.2}x")),
            r.ring_full_exits
        );
    }
    for s in &out.sparse {
        println!(
            "sparse {} GiB VM, {} mode: idle harvest {:.3} ms (median of 21)",
            s.memory_bytes >> 30,
            s.mode,
            s.idle_harvest_ms
        );
    }
}
