//! `guestmem bench fanout`: many clones of one snapshot on one host, with and without sharing
//! their memory (a fleet of clones). A guest started from a real memory image runs
//! `rewrite` for `--run-s` seconds and is snapshotted into a fresh local chunk store; one lazy
//! restore records its working set. Then, per `--clones N`:
//!
//! - N lazy restores of the snapshot at once, each in its own thread, without sharing and then
//!   sharing one image (`--share-dir`, emptied first): each clone prefetches the working set
//!   and runs `rewrite` for `--run-s`. Per mode: `ready_p50_ms`/`ready_p95_ms` (restore start to
//!   vCPUs ready), `first_progress_p50_ms`/`first_progress_p95_ms` (to the guest's first
//!   completed page), `working_set_p50_ms`/`working_set_p95_ms` (to its working set
//!   prefetched); the memory the clones added while all are alive: `host_mem_growth_mib` from
//!   /proc/meminfo (AnonPages + Shmem: the whole host's, noisy beside other work) and
//!   `process_mem_growth_mib` (the bench's anonymous pages plus the shared image's pages);
//!   beside the unique pages touched (the image's published pages) plus the pages the clones
//!   wrote: `growth_to_touched_plus_written`, and for sharing `growth_to_unshared`.
//! - a restore storm (`--storm` restores, sharing): one after another, then `--storm-parallel`
//!   at a time; each restores, runs to its first progress and goes. `restores_per_s`,
//!   `ready_p99_ms`, the VMs built and recycled, and the process's descriptors and anonymous
//!   memory before and after.
//!
//! How a clone is restored (`--via`): by default as a restore service runs
//! ([`RestoreService`]: the snapshot opened once, its sys region, working set and state read
//! once, a pool of VMs built with the sys region in place before the clocks start; a restore
//! arms the pagers and puts the vCPU state in), with each restore's phases and the CPU time
//! of the thread that restores. The others measure what that leaves out: `warm` (the snapshot
//! opened once, a VM built before the restore's clock), `prepared` (also opening the snapshot
//! on the clock) and `fresh` (also building the VM). In the storm each finished clone's VM
//! goes back into the service's pool (`--recycle`, the default), or (`--recycle false`) is
//! torn down while threads of their own refill the pool with new VMs; a restore that finds it
//! empty builds its VM on its clock. The store and the shared image are removed afterwards.
//! Self-contained: the only hook is the `Fanout` variant of `guestmem bench`.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use guestmem_contract::VmBuilder;
use guestmem_memory::Backend as MemBackend;
use guestmem_paging::{PagerConfig, Share};
use guestmem_snapshot::service::RestoreService;
use guestmem_snapshot::PreparedVm;
use guestmem_snapshot::RestoreMode;
use guestmem_store::local::LocalObjectStore;
use guestmem_store::restore::StoreSnapshot;
use guestmem_store::write::write;
use guestmem_store::ObjectStore;
use guestmem_vm::{layout, VcpuWork, Vm, VmConfig, Workload};
use serde::Serialize;

use crate::units::parse_size;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The memory image the guest starts from (raw or zstd, e.g. linux-2G-load.raw.zst).
    #[arg(long)]
    image: PathBuf,
    /// Guest memory size (at least the image's).
    #[arg(long, default_value = "2G", value_parser = parse_size)]
    memory: u64,
    /// vCPUs per clone.
    #[arg(long, default_value_t = 1)]
    vcpus: usize,
    /// Clones restored at once, one row each.
    #[arg(long, value_delimiter = ',', default_value = "1,8,16")]
    clones: Vec<usize>,
    /// How long the guest runs before its snapshot, and each clone after its restore, in s.
    #[arg(long, default_value_t = 2.0)]
    run_s: f64,
    /// The guest's rewrite rate over all vCPUs, MiB/s.
    #[arg(long, default_value_t = 16)]
    dirty_mib_per_s: u64,
    /// The largest N also restored without sharing: beyond it the unshared memory is
    /// estimated as N times the per-clone growth of the largest unshared fleet measured
    /// (`unshared_estimated`), as unshared clones of a large image may not fit in the host.
    #[arg(long, default_value_t = 4)]
    unshared_max: usize,
    /// Restores of the storm (0: no storm).
    #[arg(long, default_value_t = 100)]
    storm: usize,
    /// Restores at a time in the storm's second half.
    #[arg(long, default_value_t = 16)]
    storm_parallel: usize,
    /// In the storm (`--via service`), take each finished clone's VM back into the service's
    /// pool (`RestoreService::recycle`) instead of tearing it down and building new VMs to
    /// refill the pool; `--recycle false` measures the latter.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    recycle: bool,
    /// How each clone is restored: `service` (a restore service holding the snapshot open
    /// with a pool of armed VMs), `warm` (the snapshot opened once, a VM built before the
    /// restore's clock), `prepared` (a VM built before the clock, the snapshot opened on it),
    /// `fresh` (the snapshot opened and the VM built on the clock).
    #[arg(long, value_enum, default_value_t = Via::Service)]
    via: Via,
    /// Where the shared image goes (tmpfs).
    #[arg(long, default_value = Share::DEFAULT_DIR)]
    share_dir: PathBuf,
    #[arg(long)]
    json: bool,
}

/// How a clone is restored (`--via`).
#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
enum Via {
    Service,
    Warm,
    Prepared,
    Fresh,
}

#[derive(Serialize)]
struct Output {
    image: PathBuf,
    memory_bytes: u64,
    vcpus_per_clone: usize,
    run_s: f64,
    via: Via,
    working_set_mib: f64,
    /// One restore alone into the service's pool, before the fleets (`--via service`): its
    /// phases, wall and CPU time, each the median of `alone_restores` restores.
    alone: Option<Alone>,
    rows: Vec<Row>,
    storms: Vec<Storm>,
}

#[derive(Serialize)]
struct Row {
    clones: usize,
    shared: bool,
    ready_p50_ms: f64,
    ready_p95_ms: f64,
    first_progress_p50_ms: f64,
    first_progress_p95_ms: f64,
    working_set_p50_ms: f64,
    working_set_p95_ms: f64,
    /// CPU time of the thread that restored (not the pagers' threads), per clone.
    restore_cpu_p50_ms: f64,
    restore_cpu_p95_ms: f64,
    /// Time that thread waited for a CPU (runnable, not running) during the restore; the
    /// rest of ready beyond CPU and this is time it slept (locks, I/O).
    restore_runqueue_p50_ms: f64,
    restore_runqueue_p95_ms: f64,
    /// Per restore phase (`--via service`), p50 and p95 of its wall time, ms.
    phases_ms: Vec<PhaseRow>,
    /// /proc/loadavg when the fleet was done.
    load_average: Option<String>,
    /// /proc/meminfo AnonPages + Shmem, while all clones live, minus before (noisy: the
    /// whole host's).
    host_mem_growth_mib: f64,
    /// The bench's RssAnon plus the shared image's pages, minus before.
    process_mem_growth_mib: f64,
    /// The shared image's published bytes (the sharing row of the same N).
    unique_touched_mib: f64,
    /// Pages the clones' guests completed (each a page written), all clones.
    written_mib: f64,
    /// `process_mem_growth_mib / (unique_touched_mib + written_mib)`.
    growth_to_touched_plus_written: f64,
    /// `process_mem_growth_mib` / the same without sharing (sharing rows).
    growth_to_unshared: Option<f64>,
    /// The unshared growth it compares with was estimated, not measured (see
    /// `--unshared-max`).
    unshared_estimated: bool,
}

#[derive(Serialize)]
struct Storm {
    restores: usize,
    at_a_time: usize,
    restores_per_s: f64,
    ready_p50_ms: f64,
    ready_p99_ms: f64,
    restore_cpu_p50_ms: f64,
    restore_cpu_p99_ms: f64,
    restore_runqueue_p99_ms: f64,
    /// Whether finished clones went back into the service's pool (`--recycle`).
    recycle: bool,
    /// Restores that found the service's pool empty and built their VM on their clock.
    pool_empty: usize,
    /// VMs built during the storm: on a restore's clock (pool empty) and by the refill threads.
    built: usize,
    /// Finished clones taken back into the pool (`--recycle`), and the time each took, p50
    /// and p99, ms (off every restore's clock).
    recycled: usize,
    recycle_p50_ms: f64,
    recycle_p99_ms: f64,
    /// Building one armed VM in the refill threads during the storm, p50 and p99, ms.
    refill_p50_ms: f64,
    refill_p99_ms: f64,
    /// The builds on a restore's clock (pool empty), step by step: p99 of each step, ms.
    pool_empty_build_p99_ms: Vec<(&'static str, f64)>,
    load_average: Option<String>,
    fds_before: usize,
    fds_after: usize,
    rss_anon_before_mib: f64,
    rss_anon_after_mib: f64,
}

#[derive(Serialize)]
struct PhaseRow {
    phase: &'static str,
    p50_ms: f64,
    p95_ms: f64,
}

#[derive(Serialize)]
struct Alone {
    restores: usize,
    ready_p50_ms: f64,
    restore_cpu_p50_ms: f64,
    restore_runqueue_p50_ms: f64,
    phases_ms: Vec<PhaseRow>,
    /// Building one armed VM for the pool (before the clock), median wall and CPU time.
    prepare_p50_ms: f64,
    prepare_cpu_p50_ms: f64,
    /// Its VM's build phases, medians.
    prepare_phases_ms: Vec<PhaseRow>,
}

/// What one clone measured.
#[derive(Clone, Default)]
struct CloneTimes {
    ready_ms: f64,
    restore_cpu_ms: f64,
    restore_runqueue_ms: f64,
    phases: Vec<(&'static str, f64)>,
    first_progress_ms: f64,
    working_set_ms: f64,
    pages_written: u64,
}

pub fn main(args: Args) -> crate::Result<()> {
    let run = crate::units::seconds(args.run_s, "--run-s")?;
    if args.clones.contains(&0) || args.vcpus == 0 {
        return Err("--clones and --vcpus: 1 or more".into());
    }
    if !args.image.exists() {
        return Err(format!("--image {}: no such file", args.image.display()).into());
    }
    let temp = std::env::temp_dir().join(format!("guestmem-bench-fanout-{}", std::process::id()));
    let out = bench(&args, run, &temp);
    let _ = std::fs::remove_dir_all(&temp);
    let out = out?;
    if args.json {
        crate::envelope::print(&out)?;
    } else {
        print_text(&out);
    }
    Ok(())
}

fn print_text(out: &Output) {
    let phases = |p: &[PhaseRow]| {
        p.iter()
            .map(|p| format!("{} {:.2}/{:.2}", p.phase, p.p50_ms, p.p95_ms))
            .collect::<Vec<_>>()
            .join(", ")
    };
    if let Some(a) = &out.alone {
        println!(
            "one restore alone ({} restores, medians): ready {:.2} ms, CPU {:.2} ms, runqueue \
             {:.2} ms; phases p50/p95 ms: {}; building an armed VM for the pool {:.2} ms, CPU \
             {:.2} ms; its phases p50/p95 ms: {}",
            a.restores,
            a.ready_p50_ms,
            a.restore_cpu_p50_ms,
            a.restore_runqueue_p50_ms,
            phases(&a.phases_ms),
            a.prepare_p50_ms,
            a.prepare_cpu_p50_ms,
            phases(&a.prepare_phases_ms)
        );
    }
    for r in &out.rows {
        println!(
            "{:>3} clones {:>9}: ready p50 {:.1} p95 {:.1} ms (CPU p50 {:.2} p95 {:.2} ms, \
             runqueue p50 {:.2} p95 {:.2} ms), first \
             progress p50 {:.1} p95 {:.1} ms, working set p95 {:.1} ms, memory +{:.0} MiB (host \
             +{:.0}), {:.2}x touched+written{}; load {}",
            r.clones,
            if r.shared { "shared" } else { "unshared" },
            r.ready_p50_ms,
            r.ready_p95_ms,
            r.restore_cpu_p50_ms,
            r.restore_cpu_p95_ms,
            r.restore_runqueue_p50_ms,
            r.restore_runqueue_p95_ms,
            r.first_progress_p50_ms,
            r.first_progress_p95_ms,
            r.working_set_p95_ms,
            r.process_mem_growth_mib,
            r.host_mem_growth_mib,
            r.growth_to_touched_plus_written,
            r.growth_to_unshared
                .map(|g| format!(
                    ", {g:.2}x unshared{}",
                    if r.unshared_estimated {
                        " (estimated)"
                    } else {
                        ""
                    }
                ))
                .unwrap_or_default(),
            r.load_average.as_deref().unwrap_or("?")
        );
        if !r.phases_ms.is_empty() {
            println!("    phases p50/p95 ms: {}", phases(&r.phases_ms));
        }
    }
    for s in &out.storms {
        println!(
            "storm of {} restores, {} at a time{}: {:.1}/s, ready p50 {:.1} p99 {:.1} ms (CPU \
             p50 {:.2} p99 {:.2} ms, runqueue p99 {:.2} ms), pool empty {} (refill p50 {:.1} \
             p99 {:.1} ms), built {}, recycled {} (p50 {:.1} p99 {:.1} ms); fds {} -> {}, anon \
             {:.1} -> {:.1} MiB; load {}",
            s.restores,
            s.at_a_time,
            if s.recycle { " recycling" } else { "" },
            s.restores_per_s,
            s.ready_p50_ms,
            s.ready_p99_ms,
            s.restore_cpu_p50_ms,
            s.restore_cpu_p99_ms,
            s.restore_runqueue_p99_ms,
            s.pool_empty,
            s.refill_p50_ms,
            s.refill_p99_ms,
            s.built,
            s.recycled,
            s.recycle_p50_ms,
            s.recycle_p99_ms,
            s.fds_before,
            s.fds_after,
            s.rss_anon_before_mib,
            s.rss_anon_after_mib,
            s.load_average.as_deref().unwrap_or("?")
        );
        if !s.pool_empty_build_p99_ms.is_empty() {
            let steps: Vec<String> = s
                .pool_empty_build_p99_ms
                .iter()
                .map(|(n, ms)| format!("{n} {ms:.1}"))
                .collect();
            println!(
                "    builds on the clock (pool empty), p99 ms: {}",
                steps.join(", ")
            );
        }
    }
}

/// The snapshot the clones restore: a store and its name.
struct Source {
    objects: Arc<dyn ObjectStore>,
    name: String,
    config: VmConfig,
    /// The snapshot opened once (`--via warm`).
    opened: Option<StoreSnapshot>,
    /// The restore services (`--via service`), without sharing and sharing.
    services: Option<[RestoreService<StoreSnapshot>; 2]>,
}

impl Source {
    fn service(&self, share: Option<&Share>) -> Option<&RestoreService<StoreSnapshot>> {
        self.services
            .as_ref()
            .map(|s| &s[usize::from(share.is_some())])
    }
}

fn bench(args: &Args, run: Duration, temp: &Path) -> crate::Result<Output> {
    let objects: Arc<dyn ObjectStore> = Arc::new(LocalObjectStore::new(&temp.join("store")));
    let name = "fanout".to_string();
    let vm = guest(args, run)?;
    write(&*objects, &name, &vm, None)?;
    let config = vm.config().clone();
    drop(vm);
    let mut source = Source {
        objects,
        name,
        config,
        opened: None,
        services: None,
    };
    // One restore runs `run` and records its working set for the clones to prefetch.
    let snap = StoreSnapshot::open(source.objects.clone(), &source.name, None)?;
    let mut lazy =
        guestmem_snapshot::restore(&snap, &mut VmBuilder, RestoreMode::Lazy(quiet(None)))?;
    let running = lazy.vm.resume()?;
    std::thread::sleep(run);
    running.stop();
    running.wait(Duration::from_secs(30))?;
    let chunks = lazy.record_working_set(&snap)?;
    let working_set_mib = (chunks as u64 * snap.manifest.chunk_bytes) as f64 / MIB;
    drop(lazy);
    let share = Share::new(
        args.share_dir
            .join(format!("fanout-{}", std::process::id())),
    );
    // Opened after the working set is recorded, which they read.
    match args.via {
        Via::Warm => {
            source.opened = Some(StoreSnapshot::open(
                source.objects.clone(),
                &source.name,
                None,
            )?);
        }
        Via::Service => {
            let open = |share: Option<&Share>| -> crate::Result<RestoreService<StoreSnapshot>> {
                let snap = StoreSnapshot::open(source.objects.clone(), &source.name, None)?;
                Ok(RestoreService::new(snap, quiet(share))?)
            };
            source.services = Some([open(None)?, open(Some(&share))?]);
        }
        Via::Prepared | Via::Fresh => {}
    }
    let alone = match source.service(Some(&share)) {
        Some(service) => Some(alone(&source, service, &share)?),
        None => None,
    };
    let result = rows_and_storms(args, run, &source, &share);
    let _ = std::fs::remove_dir_all(&share.dir);
    let (rows, storms) = result?;
    Ok(Output {
        image: args.image.clone(),
        memory_bytes: args.memory,
        vcpus_per_clone: args.vcpus,
        run_s: args.run_s,
        via: args.via,
        working_set_mib,
        alone,
        rows,
        storms,
    })
}

/// Restores one at a time into the service's pool (filled before each), each dropped before it
/// runs: the medians of its ready time, its thread's CPU time and its phases.
fn alone(
    source: &Source,
    service: &RestoreService<StoreSnapshot>,
    share: &Share,
) -> crate::Result<Alone> {
    const RESTORES: usize = 21;
    let mut times = Vec::with_capacity(RESTORES);
    let mut prepares = Vec::with_capacity(RESTORES);
    for _ in 0..RESTORES {
        let (t, cpu) = (Instant::now(), thread_cpu());
        service.fill(1)?;
        let (wall, cpu) = (t.elapsed(), thread_cpu() - cpu);
        prepares.push(CloneTimes {
            ready_ms: wall.as_secs_f64() * 1e3,
            restore_cpu_ms: cpu.as_secs_f64() * 1e3,
            phases: service
                .pooled_build_phases()
                .into_iter()
                .map(|(n, d)| (n, d.as_secs_f64() * 1e3))
                .collect(),
            ..CloneTimes::default()
        });
        let r = restore(source, Some(share), Via::Service, None)?;
        times.push(r.times());
        drop(r.lazy);
    }
    let of = |f: fn(&CloneTimes) -> f64| times.iter().map(f).collect::<Vec<_>>();
    Ok(Alone {
        restores: RESTORES,
        ready_p50_ms: percentile(&of(|t| t.ready_ms), 50.0),
        restore_cpu_p50_ms: percentile(&of(|t| t.restore_cpu_ms), 50.0),
        restore_runqueue_p50_ms: percentile(&of(|t| t.restore_runqueue_ms), 50.0),
        phases_ms: phase_rows(&times),
        prepare_p50_ms: percentile(
            &prepares.iter().map(|t| t.ready_ms).collect::<Vec<_>>(),
            50.0,
        ),
        prepare_cpu_p50_ms: percentile(
            &prepares
                .iter()
                .map(|t| t.restore_cpu_ms)
                .collect::<Vec<_>>(),
            50.0,
        ),
        prepare_phases_ms: phase_rows(&prepares),
    })
}

fn rows_and_storms(
    args: &Args,
    run: Duration,
    source: &Source,
    share: &Share,
) -> crate::Result<(Vec<Row>, Vec<Storm>)> {
    let mut rows = Vec::new();
    // The per-clone unshared growth of the largest unshared fleet so far, MiB.
    let mut per_clone = None;
    for &n in &args.clones {
        let unshared = if n <= args.unshared_max {
            Some(fleet(args, run, source, n, None)?)
        } else {
            None
        };
        let _ = std::fs::remove_dir_all(&share.dir);
        let shared = fleet(args, run, source, n, Some(share))?;
        let touched = shared.touched_bytes as f64 / MIB;
        let (unshared_growth, estimated) = match unshared {
            Some(u) => {
                let row = u.row(n, false, touched, None, false);
                let growth = row.process_mem_growth_mib;
                per_clone = Some(growth / n as f64);
                rows.push(row);
                (Some(growth), false)
            }
            None => (per_clone.map(|g| g * n as f64), true),
        };
        rows.push(shared.row(n, true, touched, unshared_growth, estimated));
    }
    let mut storms = Vec::new();
    if args.storm > 0 {
        for at_a_time in [1, args.storm_parallel.max(1)] {
            storms.push(storm(args, source, share, at_a_time)?);
        }
    }
    Ok((rows, storms))
}

const MIB: f64 = (1 << 20) as f64;

/// A guest from the image, run `run` seconds, paused.
fn guest(args: &Args, run: Duration) -> crate::Result<Vm> {
    let mut vm = Vm::new(&VmConfig::simple(args.vcpus, args.memory, MemBackend::Anon))?;
    let ram = vm.memory().region("ram").ok_or("no region 'ram'")?;
    guestmem_memory::load_image(ram, &args.image)?;
    let work = VcpuWork::split(
        Workload::Rewrite {
            pages_per_s: Some(
                (args.dirty_mib_per_s.saturating_mul(256) / args.vcpus as u64).max(1),
            ),
            passes: None,
        },
        layout::RAM_GPA,
        args.memory,
        args.vcpus,
        1,
    );
    let running = vm.start(&work)?;
    std::thread::sleep(run);
    running.pause()?;
    Ok(vm)
}

/// Demand paging with the working set first and no background sweep (memory is what the
/// clones touch), sharing through `share` if given.
fn quiet(share: Option<&Share>) -> PagerConfig {
    PagerConfig {
        background: false,
        share: share.cloned(),
        ..PagerConfig::default()
    }
}

/// The VM a restore of `via` builds before its clock starts (`warm`, `prepared`).
fn ahead(source: &Source, via: Via) -> crate::Result<Option<PreparedVm>> {
    Ok(match via {
        Via::Warm | Via::Prepared => Some(PreparedVm::new(&source.config)?),
        Via::Service | Via::Fresh => None,
    })
}

/// A timed restore.
struct Restored {
    lazy: guestmem_snapshot::Restored,
    /// When its clock started.
    t: Instant,
    ready: Duration,
    cpu: Duration,
    runqueue: Duration,
    phases: Vec<(&'static str, Duration)>,
    /// The service's build on the restore's clock, if its pool was empty, step by step.
    built: Vec<(&'static str, Duration)>,
}

impl Restored {
    fn times(&self) -> CloneTimes {
        CloneTimes {
            ready_ms: self.ready.as_secs_f64() * 1e3,
            restore_cpu_ms: self.cpu.as_secs_f64() * 1e3,
            restore_runqueue_ms: self.runqueue.as_secs_f64() * 1e3,
            phases: self
                .phases
                .iter()
                .map(|(n, d)| (*n, d.as_secs_f64() * 1e3))
                .collect(),
            ..CloneTimes::default()
        }
    }
}

/// CPU time of the calling thread.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec, ours.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &raw mut ts) };
    // A timespec's fields are never negative, and tv_nsec is under a second.
    Duration::new(
        u64::try_from(ts.tv_sec).unwrap_or(0),
        u32::try_from(ts.tv_nsec).unwrap_or(0),
    )
}

/// The time the calling thread has waited for a CPU while runnable
/// (`/proc/thread-self/schedstat`'s second field; zero where it is not kept).
fn runqueue_wait() -> Duration {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(Duration::ZERO, Duration::from_nanos)
}

/// One lazy restore of `source` by `via` (sharing through `share` if given), into `pre` if
/// built ahead (see [`ahead`]); timed from before it opens the snapshot or takes a VM from the
/// service's pool.
fn restore(
    source: &Source,
    share: Option<&Share>,
    via: Via,
    pre: Option<PreparedVm>,
) -> crate::Result<Restored> {
    let waited = runqueue_wait();
    let t = Instant::now();
    let cpu = thread_cpu();
    if let Some(service) = source.service(share).filter(|_| via == Via::Service) {
        let r = service.restore()?;
        return Ok(Restored {
            ready: t.elapsed(),
            cpu: thread_cpu() - cpu,
            runqueue: runqueue_wait().saturating_sub(waited),
            phases: r.phases,
            built: r.built,
            lazy: r.lazy,
            t,
        });
    }
    let fresh;
    let snap = match &source.opened {
        Some(s) => s,
        None => {
            fresh = StoreSnapshot::open(source.objects.clone(), &source.name, None)?;
            &fresh
        }
    };
    let lazy = match pre {
        Some(p) => guestmem_snapshot::restore(snap, p, RestoreMode::Lazy(quiet(share)))?,
        None => guestmem_snapshot::restore(snap, &mut VmBuilder, RestoreMode::Lazy(quiet(share)))?,
    };
    Ok(Restored {
        ready: t.elapsed(),
        cpu: thread_cpu() - cpu,
        runqueue: runqueue_wait().saturating_sub(waited),
        phases: Vec::new(),
        built: Vec::new(),
        lazy,
        t,
    })
}

/// A clone: restored, run `run` (its first progress and working set timed), stopped; held
/// until `hold` lets it go (the memory is measured while every clone lives). What `--via`
/// builds ahead is built before `start`.
fn clone_run(
    args: &Args,
    source: &Source,
    share: Option<&Share>,
    run: Duration,
    start: &Barrier,
    done: &Barrier,
    hold: &Barrier,
) -> crate::Result<CloneTimes> {
    let pre = ahead(source, args.via);
    start.wait();
    let measured = (|| {
        let r = restore(source, share, args.via, pre?)?;
        let mut times = r.times();
        let (mut lazy, t, ready) = (r.lazy, r.t, r.ready);
        let before = lazy.vm.pages_done();
        let pagers = &lazy.pagers;
        let running = lazy.vm.resume()?;
        let (mut first, mut ws) = (None, None);
        while t.elapsed() < ready + run || first.is_none() || ws.is_none() {
            if first.is_none()
                && running
                    .progress()
                    .iter()
                    .zip(&before)
                    .any(|((p, _), b)| p > b)
            {
                first = Some(t.elapsed());
            }
            if ws.is_none() && pagers.iter().all(|p| p.stats().prefetch_done) {
                ws = Some(t.elapsed());
            }
            if t.elapsed() > ready + Duration::from_secs(120) {
                return Err(
                    "a clone made no progress or never had its working set in 120 s".into(),
                );
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        running.stop();
        let report = running.wait(Duration::from_secs(30))?;
        times.pages_written = report
            .vcpus
            .iter()
            .zip(&before)
            .map(|(v, b)| v.pages.saturating_sub(*b))
            .sum();
        let ms = |d: Option<Duration>| d.unwrap_or_default().as_secs_f64() * 1e3;
        times.first_progress_ms = ms(first);
        times.working_set_ms = ms(ws);
        crate::Result::Ok((times, lazy))
    })();
    done.wait();
    hold.wait();
    measured.map(|(times, lazy)| {
        drop(lazy);
        times
    })
}

/// What one fleet of N clones measured.
struct Fleet {
    times: Vec<CloneTimes>,
    host_growth: f64,
    process_growth: f64,
    touched_bytes: u64,
    load_average: Option<String>,
}

/// N clones restored at once, in threads of their own; the memory measured once all ran.
fn fleet(
    args: &Args,
    run: Duration,
    source: &Source,
    n: usize,
    share: Option<&Share>,
) -> crate::Result<Fleet> {
    let image_path = share.map(|s| s.dir.clone());
    let before = Counters::now(image_path.as_deref());
    // The service's pool holds a VM for each clone before the clocks start.
    if let Some(service) = source.service(share) {
        service.fill(n)?;
    }
    let (start, done, hold) = (Barrier::new(n), Barrier::new(n + 1), Barrier::new(n + 1));
    let results = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|_| {
                s.spawn(|| {
                    clone_run(args, source, share, run, &start, &done, &hold)
                        .map_err(|e| e.to_string())
                })
            })
            .collect();
        done.wait();
        let after = Counters::now(image_path.as_deref());
        hold.wait();
        let times: Vec<_> = handles
            .into_iter()
            .map(|h| h.join().expect("a clone thread panicked"))
            .collect();
        (after, times)
    });
    let (after, times) = results;
    let times = times.into_iter().collect::<Result<Vec<_>, String>>()?;
    Ok(Fleet {
        times,
        host_growth: after.host - before.host,
        process_growth: (after.anon + after.image) - (before.anon + before.image),
        touched_bytes: after.published,
        load_average: crate::envelope::load_average(),
    })
}

/// Per phase (in the order the restores went through them), p50 and p95 of its wall time.
fn phase_rows(times: &[CloneTimes]) -> Vec<PhaseRow> {
    let mut names: Vec<&'static str> = Vec::new();
    for t in times {
        for (n, _) in &t.phases {
            if !names.contains(n) {
                names.push(n);
            }
        }
    }
    names
        .into_iter()
        .map(|phase| {
            let v: Vec<f64> = times
                .iter()
                .flat_map(|t| t.phases.iter().filter(|(n, _)| *n == phase).map(|p| p.1))
                .collect();
            PhaseRow {
                phase,
                p50_ms: percentile(&v, 50.0),
                p95_ms: percentile(&v, 95.0),
            }
        })
        .collect()
}

impl Fleet {
    fn row(
        &self,
        n: usize,
        shared: bool,
        touched_mib: f64,
        unshared: Option<f64>,
        unshared_estimated: bool,
    ) -> Row {
        let of = |f: fn(&CloneTimes) -> f64| self.times.iter().map(f).collect::<Vec<_>>();
        let ready = of(|t| t.ready_ms);
        let first = of(|t| t.first_progress_ms);
        let ws = of(|t| t.working_set_ms);
        let cpu = of(|t| t.restore_cpu_ms);
        let runqueue = of(|t| t.restore_runqueue_ms);
        let written = self.times.iter().map(|t| t.pages_written).sum::<u64>() as f64 * 4096.0 / MIB;
        let growth = self.process_growth / MIB;
        Row {
            clones: n,
            shared,
            ready_p50_ms: percentile(&ready, 50.0),
            ready_p95_ms: percentile(&ready, 95.0),
            first_progress_p50_ms: percentile(&first, 50.0),
            first_progress_p95_ms: percentile(&first, 95.0),
            working_set_p50_ms: percentile(&ws, 50.0),
            working_set_p95_ms: percentile(&ws, 95.0),
            restore_cpu_p50_ms: percentile(&cpu, 50.0),
            restore_cpu_p95_ms: percentile(&cpu, 95.0),
            restore_runqueue_p50_ms: percentile(&runqueue, 50.0),
            restore_runqueue_p95_ms: percentile(&runqueue, 95.0),
            phases_ms: phase_rows(&self.times),
            load_average: self.load_average.clone(),
            host_mem_growth_mib: self.host_growth / MIB,
            process_mem_growth_mib: growth,
            unique_touched_mib: touched_mib,
            written_mib: written,
            growth_to_touched_plus_written: growth / (touched_mib + written).max(1e-9),
            growth_to_unshared: unshared.filter(|_| shared).map(|u| growth / u.max(1e-9)),
            unshared_estimated,
        }
    }
}

/// What the storm's restores counted, shared by its threads.
#[derive(Default)]
struct Tally {
    /// Restores that found the pool empty, and the steps of their builds.
    pool_empty: AtomicUsize,
    builds: Mutex<Vec<Vec<(&'static str, Duration)>>>,
    /// Finished clones taken back into the pool, and how long each took, ms.
    recycled: AtomicUsize,
    recycle_ms: Mutex<Vec<f64>>,
}

/// One clone of the storm: restores, runs to its first progress, and goes: back into the
/// service's pool with `--recycle` (`--via service`), else torn down.
fn storm_clone(
    args: &Args,
    source: &Source,
    share: &Share,
    tally: &Tally,
) -> crate::Result<CloneTimes> {
    let pre = ahead(source, args.via)?;
    let r = restore(source, Some(share), args.via, pre)?;
    if r.phases.first().is_some_and(|p| p.0.starts_with("prepare")) {
        tally.pool_empty.fetch_add(1, Ordering::Relaxed);
        tally
            .builds
            .lock()
            .expect("not poisoned")
            .push(r.built.clone());
    }
    let times = r.times();
    let (mut lazy, t) = (r.lazy, r.t);
    let before = lazy.vm.pages_done();
    let running = lazy.vm.resume()?;
    while !running
        .progress()
        .iter()
        .zip(&before)
        .any(|((p, _), b)| p > b)
    {
        if t.elapsed() > Duration::from_secs(60) {
            return Err("a restored guest made no progress in 60 s".into());
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    running.stop();
    running.wait(Duration::from_secs(30))?;
    if let Some(service) = source.service(Some(share)).filter(|_| args.recycle) {
        let t = Instant::now();
        service.recycle(lazy)?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        tally.recycled.fetch_add(1, Ordering::Relaxed);
        tally.recycle_ms.lock().expect("not poisoned").push(ms);
    }
    Ok(times)
}

/// `restores` restores of `source` (sharing), `at_a_time` at once (see [`storm_clone`]). One
/// restore before the counters warms the image. With `--via service`, the pool holds
/// `at_a_time` armed VMs when the storm starts; with `--recycle` every finished clone goes
/// back into it, else threads of their own ([`REFILL_THREADS`]) keep it at `at_a_time` with
/// new VMs while the restores go on.
fn storm(args: &Args, source: &Source, share: &Share, at_a_time: usize) -> crate::Result<Storm> {
    let service = source.service(Some(share));
    if let Some(service) = service {
        service.fill(at_a_time)?;
    }
    storm_clone(args, source, share, &Tally::default())?;
    // The pool is empty when the counters are taken, before and after.
    if let Some(service) = service {
        service.clear();
    }
    let (fds_before, anon_before) = (fds(), Counters::now(None).anon);
    if let Some(service) = service {
        service.fill(at_a_time)?;
    }
    let next = AtomicUsize::new(0);
    let finished = std::sync::atomic::AtomicBool::new(false);
    let (tally, times) = (Tally::default(), Mutex::new(Vec::with_capacity(args.storm)));
    let (failure, refills) = (Mutex::new(None), Mutex::new(Vec::new()));
    let t = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..REFILL_THREADS {
            let Some(service) = service.filter(|_| !args.recycle) else {
                break;
            };
            s.spawn(|| {
                if let Err(e) = refill(service, at_a_time, &finished, &refills) {
                    *failure.lock().expect("not poisoned") = Some(e.to_string());
                }
            });
        }
        std::thread::scope(|w| {
            for _ in 0..at_a_time {
                w.spawn(|| {
                    while next.fetch_add(1, Ordering::Relaxed) < args.storm {
                        match storm_clone(args, source, share, &tally) {
                            Ok(r) => times.lock().expect("not poisoned").push(r),
                            Err(e) => *failure.lock().expect("not poisoned") = Some(e.to_string()),
                        }
                    }
                });
            }
        });
        finished.store(true, Ordering::Release);
    });
    let wall = t.elapsed().as_secs_f64();
    if let Some(e) = failure.into_inner().expect("not poisoned") {
        return Err(e.into());
    }
    if let Some(service) = service {
        service.clear();
    }
    let times = times.into_inner().expect("not poisoned");
    let mut out = storm_row(args, at_a_time, wall, &times, tally);
    out.refill_p50_ms = percentile(&refills.lock().expect("not poisoned"), 50.0);
    out.refill_p99_ms = percentile(&refills.lock().expect("not poisoned"), 99.0);
    out.built += refills.into_inner().expect("not poisoned").len();
    (out.fds_before, out.fds_after) = (fds_before, fds());
    out.rss_anon_before_mib = anon_before / MIB;
    out.rss_anon_after_mib = Counters::now(None).anon / MIB;
    Ok(out)
}

/// The storm's row from its restores' `times`, its `wall` seconds and what they counted (the
/// refills and the process's counters are the caller's to fill in).
fn storm_row(
    args: &Args,
    at_a_time: usize,
    wall: f64,
    times: &[CloneTimes],
    tally: Tally,
) -> Storm {
    let builds = tally.builds.into_inner().expect("not poisoned");
    let recycle_ms = tally.recycle_ms.into_inner().expect("not poisoned");
    let readies: Vec<f64> = times.iter().map(|t| t.ready_ms).collect();
    let cpu: Vec<f64> = times.iter().map(|t| t.restore_cpu_ms).collect();
    let runqueue: Vec<f64> = times.iter().map(|t| t.restore_runqueue_ms).collect();
    let pool_empty = tally.pool_empty.into_inner();
    Storm {
        restores: args.storm,
        at_a_time,
        recycle: args.recycle && args.via == Via::Service,
        restores_per_s: args.storm as f64 / wall,
        ready_p50_ms: percentile(&readies, 50.0),
        ready_p99_ms: percentile(&readies, 99.0),
        restore_cpu_p50_ms: percentile(&cpu, 50.0),
        restore_cpu_p99_ms: percentile(&cpu, 99.0),
        restore_runqueue_p99_ms: percentile(&runqueue, 99.0),
        pool_empty,
        built: pool_empty,
        recycled: tally.recycled.into_inner(),
        recycle_p50_ms: percentile(&recycle_ms, 50.0),
        recycle_p99_ms: percentile(&recycle_ms, 99.0),
        refill_p50_ms: f64::NAN,
        refill_p99_ms: f64::NAN,
        pool_empty_build_p99_ms: build_steps_p99(&builds),
        load_average: crate::envelope::load_average(),
        fds_before: 0,
        fds_after: 0,
        rss_anon_before_mib: 0.0,
        rss_anon_after_mib: 0.0,
    }
}

/// Keeps `service`'s pool at `at_a_time` armed VMs until `finished`, each build's time (ms)
/// added to `refills`.
fn refill(
    service: &RestoreService<StoreSnapshot>,
    at_a_time: usize,
    finished: &std::sync::atomic::AtomicBool,
    refills: &Mutex<Vec<f64>>,
) -> guestmem_snapshot::Result<()> {
    while !finished.load(Ordering::Acquire) {
        if service.pooled() < at_a_time {
            let t = Instant::now();
            service.fill(service.pooled() + 1)?;
            let ms = t.elapsed().as_secs_f64() * 1e3;
            refills.lock().expect("not poisoned").push(ms);
        } else {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    Ok(())
}

/// Per step of the builds done with the pool empty (each the steps of one build, in order):
/// the step's name and its p99, ms.
fn build_steps_p99(builds: &[Vec<(&'static str, Duration)>]) -> Vec<(&'static str, f64)> {
    let Some(first) = builds.first() else {
        return Vec::new();
    };
    first
        .iter()
        .enumerate()
        .map(|(i, (name, _))| {
            let ms: Vec<f64> = builds
                .iter()
                .filter_map(|b| b.get(i))
                .map(|(_, d)| d.as_secs_f64() * 1e3)
                .collect();
            (*name, percentile(&ms, 99.0))
        })
        .collect()
}

/// Threads refilling the service's pool in the storm: building a VM mostly waits (registering
/// its memslots), so two overlap those waits.
const REFILL_THREADS: usize = 2;

/// The `p`th percentile (nearest rank) of `v`.
#[allow(clippy::cast_possible_truncation)] // a percentile index: a float to integer cast saturates.
fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * s.len() as f64).ceil().max(1.0) as usize;
    s[rank.min(s.len()) - 1]
}

/// The process's open descriptors.
fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, std::iter::Iterator::count)
}

/// Memory counters, in bytes.
struct Counters {
    /// /proc/meminfo AnonPages + Shmem.
    host: f64,
    /// This process's RssAnon.
    anon: f64,
    /// The shared images' pages (files in the share directory, not sidecars).
    image: f64,
    /// Their published bytes.
    published: u64,
}

impl Counters {
    fn now(share_dir: Option<&Path>) -> Counters {
        // Memory the allocator holds after a free is not the clones': hand it back first.
        // SAFETY: malloc_trim only returns free heap memory to the kernel.
        unsafe { libc::malloc_trim(0) };
        let kb = |text: &str, key: &str| -> f64 {
            text.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0)
                * 1024.0
        };
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let (mut image, mut published) = (0.0, 0);
        for entry in share_dir
            .and_then(|d| std::fs::read_dir(d).ok())
            .into_iter()
            .flatten()
            .flatten()
        {
            let path = entry.path();
            if path.extension().is_some() {
                continue;
            }
            image += entry
                .metadata()
                .map_or(0, |m| std::os::unix::fs::MetadataExt::blocks(&m) * 512)
                as f64;
            published += published_bytes(&path);
        }
        Counters {
            host: kb(&meminfo, "AnonPages:") + kb(&meminfo, "Shmem:"),
            anon: kb(&status, "RssAnon:"),
            image,
            published,
        }
    }
}

/// The published bytes of the shared image at `path` (its sidecar's bits set).
fn published_bytes(path: &Path) -> u64 {
    let bits = path.with_file_name(format!(
        "{}.bits",
        path.file_name().unwrap_or_default().to_string_lossy()
    ));
    // The sidecar: a 4 KiB header, then one bit per page.
    std::fs::read(bits).map_or(0, |b| {
        b.get(4096..)
            .unwrap_or_default()
            .iter()
            .map(|x| u64::from(x.count_ones()) * 4096)
            .sum()
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(super::percentile(&v, 50.0), 50.0);
        assert_eq!(super::percentile(&v, 95.0), 95.0);
        assert_eq!(super::percentile(&v, 99.0), 99.0);
        assert_eq!(super::percentile(&[3.0], 99.0), 3.0);
    }

    #[test]
    fn build_steps_keep_their_order_and_take_the_p99_of_each() {
        use std::time::Duration;
        let ms = Duration::from_millis;
        let builds: Vec<Vec<(&'static str, Duration)>> = (1..=100)
            .map(|i| vec![("create VM", ms(i)), ("arm the pagers", ms(1000 + i))])
            .collect();
        assert_eq!(
            super::build_steps_p99(&builds),
            vec![("create VM", 99.0), ("arm the pagers", 1099.0)]
        );
        assert!(super::build_steps_p99(&[]).is_empty());
    }

    #[test]
    fn bad_arguments_are_refused_before_any_work() {
        let e = crate::refusal(&["--image", "/nonexistent"], super::main);
        assert!(e.contains("/nonexistent"), "{e}");
        let e = crate::refusal(&["--image", "/x", "--clones", "0"], super::main);
        assert!(e.contains("--clones"), "{e}");
    }
}
