//! `guestmem bench snapshot`: the chunk store on a guest started from a captured real
//! memory image. The guest runs the `rewrite` workload over the image for `--run-s` seconds (at
//! `--dirty-mib-per-s`) and
//! is snapshotted into a store (a fresh local store, or `--store s3://…|store:…`):
//!
//! - `stored_bytes_ratio`: stored bytes of the snapshot's chunks / guest memory;
//! - `write_guest_bytes_per_s`: guest memory / the write's time (read, zero check, BLAKE3,
//!   zstd, put, manifest);
//! - with `--clones N`: N more guests from the same image, each run `--run-s`, snapshotted into
//!   the same store: `clones_total_vs_one_ratio` (all N+1 snapshots' stored bytes / one's);
//! - restore rows per `--restore` mode (`store`: local or s3; `full`, `lazy` with a cold chunk
//!   cache, `lazy` again with the cache the first filled and the working set it recorded):
//!   `ready_ms` (the vCPUs ready), `first_progress_ms` (the guest's first completed page) and
//!   `resident_ms` (all memory in place), medians of `--restore-runs`, with what the store
//!   and the cache served. With
//!   `lazy`, the same guest's flat snapshot (`guestmem snapshot --out DIR`, one local file) is
//!   restored lazily first, as the row `store: file`, and each store row's
//!   `resident_vs_file_ratio` compares with it;
//! - `--rtt-ms` puts a delay proxy ([`crate::delay_proxy`]) between the bench and an s3
//!   store's endpoint, half the round trip each way: this kernel has no `netem`.
//!
//! The bench deletes its snapshots afterwards; in a given store their chunks go at its next
//! `guestmem snapshot gc`. Self-contained: the only hook is the `Snapshot` variant of `guestmem
//! bench`.

use std::net::ToSocketAddrs;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use guestmem_contract::VmBuilder;
use guestmem_memory::Backend as MemBackend;
use guestmem_paging::{Pager, PagerConfig};
use guestmem_snapshot::{self as snapshot, RestoreMode, Restored, Snapshot};
use guestmem_store::cache::ChunkCache;
use guestmem_store::chunk::{CHUNK_BYTES, ZSTD_LEVEL};
use guestmem_store::location::StoreUrl;
use guestmem_store::manifest::working_set_key;
use guestmem_store::pages::FetchStats;
use guestmem_store::restore::StoreSnapshot;
use guestmem_store::s3::{S3Config, S3ObjectStore};
use guestmem_store::write::{write, StoreWriteReport};
use guestmem_store::ObjectStore;
use guestmem_vm::{layout, VcpuWork, Vm, VmConfig, Workload};
use serde::Serialize;

use crate::delay_proxy::DelayProxy;
use crate::envelope::Figure;
use crate::units::parse_size;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The memory image the guests start from (raw or zstd, e.g. linux-2G-load.raw.zst).
    #[arg(long)]
    image: PathBuf,
    /// Guest memory size (at least the image's).
    #[arg(long, default_value = "2G", value_parser = parse_size)]
    memory: u64,
    #[arg(long, default_value_t = 2)]
    vcpus: usize,
    /// The store to write into (default: a fresh local store in a temporary directory,
    /// removed afterwards).
    #[arg(long)]
    store: Option<String>,
    /// How long each guest runs `rewrite` before its snapshot, in seconds.
    #[arg(long, default_value_t = 3.0)]
    run_s: f64,
    /// The guests' rewrite rate over all vCPUs, MiB/s (0: as fast as they can, rewriting all
    /// of memory every second, which no real guest does).
    #[arg(long, default_value_t = 64)]
    dirty_mib_per_s: u64,
    /// More guests from the same image, snapshotted into the same store.
    #[arg(long, default_value_t = 0)]
    clones: usize,
    /// Restore modes to time from the store: full, lazy.
    #[arg(long, value_delimiter = ',', default_value = "full,lazy")]
    restore: Vec<String>,
    /// Restores per row; every restore figure is the median.
    #[arg(long, default_value_t = 3)]
    restore_runs: usize,
    /// Round-trip time added between the bench and an s3 store, in ms (a delay proxy in
    /// front of `AWS_ENDPOINT_URL`, half each way).
    #[arg(long, default_value_t = 0.0)]
    rtt_ms: f64,
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Output {
    image: PathBuf,
    memory_bytes: u64,
    store: String,
    /// The round trip the delay proxy added to every request to an s3 store.
    added_rtt_ms: f64,
    chunk_bytes: u64,
    zstd_level: i32,
    snapshot: StoreWriteReport,
    stored_bytes_ratio: f64,
    write_guest_bytes_per_s: f64,
    /// CPU time (user and system, every thread of the bench) the write took: what bounds its
    /// speed on a host with few cores, and less noisy than the wall time on a busy one.
    write_cpu_s: f64,
    clones: usize,
    clones_total_stored_bytes: Option<u64>,
    clones_total_vs_one_ratio: Option<f64>,
    restores: Vec<RestoreRow>,
}

#[derive(Serialize)]
struct RestoreRow {
    /// `file`: the flat snapshot's one local file; `local`, `s3`: the chunk store.
    store: &'static str,
    mode: &'static str,
    /// `cold`: an empty chunk cache; `warm`: the one the previous restore filled.
    cache: Option<&'static str>,
    /// Medians of `--restore-runs`; each figure's runs beside it.
    ready_ms: f64,
    first_progress_ms: f64,
    resident_ms: f64,
    ready_ms_figure: Option<Figure>,
    first_progress_ms_figure: Option<Figure>,
    resident_ms_figure: Option<Figure>,
    /// Lazy from a store: `resident_ms` / the `file` row's.
    resident_vs_file_ratio: Option<f64>,
    /// The last run's.
    fetched: Option<FetchStats>,
    /// A lazy restore's: who brought the chunks in, summed over the pagers (the last run's).
    installed: Option<Installed>,
}

/// Chunks a lazy restore's pagers installed, by who asked for them.
#[derive(Serialize, Clone, Copy, Default)]
struct Installed {
    faults: u64,
    fault_chunks: u64,
    readahead_chunks: u64,
    prefetch_chunks: u64,
    background_chunks: u64,
}

impl Installed {
    fn of(pagers: &[guestmem_paging::Pager]) -> Option<Installed> {
        if pagers.is_empty() {
            return None;
        }
        let mut i = Installed::default();
        for p in pagers {
            let s = p.stats();
            i.faults += s.faults;
            i.fault_chunks += s.fault_chunks;
            i.readahead_chunks += s.readahead_chunks;
            i.prefetch_chunks += s.prefetch_chunks;
            i.background_chunks += s.background_chunks;
        }
        Some(i)
    }
}

impl RestoreRow {
    /// The row of `timings` (per run: ready, first progress, resident, in ms).
    fn of(
        store: &'static str,
        mode: &'static str,
        cache: Option<&'static str>,
        timings: &[[f64; 3]],
        fetched: Option<FetchStats>,
        installed: Option<Installed>,
        file_resident_ms: Option<f64>,
    ) -> RestoreRow {
        let figure = |i: usize| Figure::of(&timings.iter().map(|t| t[i]).collect::<Vec<_>>());
        let median = |f: &Option<Figure>| f.as_ref().map_or(f64::NAN, |f| f.median);
        let (ready, first, resident) = (figure(0), figure(1), figure(2));
        RestoreRow {
            store,
            mode,
            cache,
            ready_ms: median(&ready),
            first_progress_ms: median(&first),
            resident_ms: median(&resident),
            resident_vs_file_ratio: file_resident_ms.map(|f| median(&resident) / f),
            ready_ms_figure: ready,
            first_progress_ms_figure: first,
            resident_ms_figure: resident,
            fetched,
            installed,
        }
    }
}

/// A guest from the image, run `run` seconds, paused.
fn guest(args: &Args, run: Duration) -> crate::Result<Vm> {
    let mut vm = Vm::new(&VmConfig::simple(args.vcpus, args.memory, MemBackend::Anon))?;
    let ram = vm.memory().region("ram").ok_or("no region 'ram'")?;
    guestmem_memory::load_image(ram, &args.image)?;
    let work = VcpuWork::split(
        Workload::Rewrite {
            pages_per_s: (args.dirty_mib_per_s > 0).then(|| {
                (args.dirty_mib_per_s.saturating_mul(256) / args.vcpus.max(1) as u64).max(1)
            }),
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

/// The store's back end: for an s3 store with `--rtt-ms`, through a delay proxy (returned,
/// to be held while the store is used).
fn open(args: &Args, url: &StoreUrl) -> crate::Result<(Arc<dyn ObjectStore>, Option<DelayProxy>)> {
    if !(args.rtt_ms >= 0.0 && args.rtt_ms.is_finite()) {
        return Err(format!("--rtt-ms {}: a round trip in ms, 0 or more", args.rtt_ms).into());
    }
    if args.rtt_ms == 0.0 {
        return Ok((url.open()?, None));
    }
    let StoreUrl::S3 { bucket, prefix } = url else {
        return Err(format!(
            "--rtt-ms delays the requests to an s3 store; {url} is a local directory"
        )
        .into());
    };
    let mut config = S3Config::from_env(&url.to_string())?;
    let endpoint = config
        .endpoint
        .clone()
        .ok_or("--rtt-ms needs AWS_ENDPOINT_URL (an S3 server on this host, e.g. MinIO)")?;
    let hostport = endpoint
        .strip_prefix("http://")
        .ok_or_else(|| format!("--rtt-ms: AWS_ENDPOINT_URL {endpoint} is not http://HOST:PORT"))?
        .trim_end_matches('/');
    let target = hostport
        .to_socket_addrs()
        .map_err(|e| format!("--rtt-ms: AWS_ENDPOINT_URL {endpoint}: {e}"))?
        .next()
        .ok_or_else(|| format!("--rtt-ms: AWS_ENDPOINT_URL {endpoint} has no address"))?;
    let proxy = DelayProxy::start(target, Duration::from_secs_f64(args.rtt_ms / 2e3))?;
    config.endpoint = Some(format!("http://{}", proxy.addr()));
    let objects: Arc<dyn ObjectStore> = Arc::new(S3ObjectStore::new(bucket, prefix, &config)?);
    Ok((objects, Some(proxy)))
}

pub fn main(args: Args) -> crate::Result<()> {
    let run = crate::units::seconds(args.run_s, "--run-s")?;
    let temp = std::env::temp_dir().join(format!("guestmem-bench-store-{}", std::process::id()));
    let url = match &args.store {
        Some(s) => StoreUrl::parse(s)?,
        None => StoreUrl::Local(temp.join("store")),
    };
    let (objects, proxy) = open(&args, &url)?;
    let result = bench(&args, run, &url, objects, &temp);
    drop(proxy);
    let _ = std::fs::remove_dir_all(&temp);
    let out = result?;
    if args.json {
        return super::envelope::print(&out);
    }
    println!(
        "snapshot of {} MiB from {} into {}: {:.3}x of guest memory stored, written at {:.2} \
         GiB/s of guest memory ({:.0} ms, {:.2} s of CPU, {} threads)",
        out.memory_bytes >> 20,
        out.image.display(),
        out.store,
        out.stored_bytes_ratio,
        out.write_guest_bytes_per_s / (1u64 << 30) as f64,
        out.snapshot.write_ms,
        out.write_cpu_s,
        out.snapshot.threads
    );
    if let Some(r) = out.clones_total_vs_one_ratio {
        println!(
            "{} more guests from the same image: all {} snapshots take {:.2}x of one",
            out.clones,
            out.clones + 1,
            r
        );
    }
    for r in &out.restores {
        println!(
            "restore {} {}{}: ready {:.1} ms, first progress {:.1} ms, resident {:.1} ms{}{}",
            r.store,
            r.mode,
            r.cache.map(|c| format!(" ({c} cache)")).unwrap_or_default(),
            r.ready_ms,
            r.first_progress_ms,
            r.resident_ms,
            r.resident_vs_file_ratio
                .map(|x| format!(" ({x:.2}x the file's)"))
                .unwrap_or_default(),
            r.fetched
                .as_ref()
                .map(|f| format!(
                    " ({} chunks from the store, {} from the cache)",
                    f.store_gets, f.cache_hits
                ))
                .unwrap_or_default()
        );
    }
    Ok(())
}

fn bench(
    args: &Args,
    run: Duration,
    url: &StoreUrl,
    objects: Arc<dyn ObjectStore>,
    temp: &std::path::Path,
) -> crate::Result<Output> {
    let name = format!("bench-{}", std::process::id());
    let vm = guest(args, run)?;
    let cpu = process_cpu_s();
    let report = write(&*objects, &name, &vm, None)?;
    let write_cpu_s = process_cpu_s() - cpu;
    // The same guest as one local file, the baseline of the store's lazy restores.
    let flat = temp.join("flat");
    let lazy = args.restore.iter().any(|m| m == "lazy");
    if lazy {
        snapshot::write(&vm, &flat)?;
    }
    drop(vm);
    let mut names = vec![name.clone()];
    let one = report.stored_bytes.max(1);
    let mut total = report.stored_bytes;
    for i in 0..args.clones {
        let vm = guest(args, run)?;
        let n = format!("{name}-clone{i}");
        total += write(&*objects, &n, &vm, None)?.new_stored_bytes;
        names.push(n);
    }
    let remote = objects.remote();
    let store_kind = if remote { "s3" } else { "local" };
    let mut restores = Vec::new();
    let runs = args.restore_runs.max(1);
    let mut file_resident_ms = None;
    if lazy {
        let row = file_lazy_restores(&flat, runs)?;
        file_resident_ms = Some(row.resident_ms);
        restores.push(row);
    }
    let cache_dir = temp.join("cache");
    for mode in &args.restore {
        let kinds: &[Option<&'static str>] = match (mode.as_str(), remote) {
            ("lazy", true) => &[Some("cold"), Some("warm")],
            ("lazy", false) => &[None, None],
            ("full", true) => &[Some("cold")],
            ("full", false) => &[None],
            (other, _) => return Err(format!("--restore {other}: full or lazy").into()),
        };
        // Each run restores once per kind, in order (a warm restore follows the cold one
        // whose chunks and recorded working set it uses).
        let mut timings = vec![Vec::new(); kinds.len()];
        let mut fetched = vec![FetchStats::default(); kinds.len()];
        let mut installed = vec![None; kinds.len()];
        for _ in 0..runs {
            if mode == "lazy" {
                // The first restore of each run records the working set anew.
                objects.delete(&working_set_key(&name))?;
            }
            for (k, cache) in kinds.iter().enumerate() {
                let (timing, stats, pagers_installed) =
                    restore_once(&objects, &name, mode, *cache, &cache_dir)?;
                installed[k] = pagers_installed;
                timings[k].push(timing);
                fetched[k] = stats;
            }
        }
        for (k, cache) in kinds.iter().enumerate() {
            let mode = if mode == "full" { "full" } else { "lazy" };
            restores.push(RestoreRow::of(
                store_kind,
                mode,
                *cache,
                &timings[k],
                Some(fetched[k]),
                installed[k],
                file_resident_ms.filter(|_| mode == "lazy"),
            ));
        }
    }
    // The bench's snapshots go; their chunks at the store's next `guestmem snapshot gc`.
    for n in &names {
        guestmem_store::gc::delete(&*objects, n)?;
    }
    Ok(Output {
        image: args.image.clone(),
        memory_bytes: report.memory_bytes,
        store: url.to_string(),
        added_rtt_ms: args.rtt_ms,
        chunk_bytes: CHUNK_BYTES,
        zstd_level: ZSTD_LEVEL,
        stored_bytes_ratio: report.stored_bytes as f64 / report.memory_bytes as f64,
        write_guest_bytes_per_s: report.memory_bytes as f64 / (report.write_ms / 1e3),
        write_cpu_s,
        snapshot: report,
        clones: args.clones,
        clones_total_stored_bytes: (args.clones > 0).then_some(total),
        clones_total_vs_one_ratio: (args.clones > 0).then(|| total as f64 / one as f64),
        restores,
    })
}

/// `runs` lazy restores of the guest's local snapshot file `flat` (the baseline of the store's
/// lazy restores), which then goes.
fn file_lazy_restores(flat: &std::path::Path, runs: usize) -> crate::Result<RestoreRow> {
    let mut timings = Vec::new();
    for _ in 0..runs {
        let t = Instant::now();
        let snap = Snapshot::open(flat)?;
        let lazy = RestoreMode::Lazy(PagerConfig::default());
        let Restored { mut vm, pagers, .. } = snapshot::restore(&snap, &mut VmBuilder, lazy)?;
        let ready = t.elapsed();
        let (first_progress, resident) = run_until_resident(&mut vm, &pagers, t)?;
        timings.push([ready, first_progress, resident].map(|d| d.as_secs_f64() * 1e3));
    }
    let _ = std::fs::remove_dir_all(flat);
    Ok(RestoreRow::of(
        "file", "lazy", None, &timings, None, None, None,
    ))
}

/// One restore of the store's snapshot `name` in `mode`, with a cold or warm chunk cache in
/// `cache_dir` (or none): its timings (ready, first progress, resident, ms), what it fetched,
/// and what its pagers installed.
fn restore_once(
    objects: &Arc<dyn ObjectStore>,
    name: &str,
    mode: &str,
    cache: Option<&str>,
    cache_dir: &std::path::Path,
) -> crate::Result<([f64; 3], FetchStats, Option<Installed>)> {
    if cache == Some("cold") {
        let _ = std::fs::remove_dir_all(cache_dir);
    }
    let t = Instant::now();
    let chunk_cache = match cache {
        Some(_) => Some(ChunkCache::open(cache_dir, 64 << 30)?),
        None => None,
    };
    let snap = StoreSnapshot::open(objects.clone(), name, chunk_cache)?;
    let how = if mode == "full" {
        RestoreMode::Full
    } else {
        RestoreMode::Lazy(PagerConfig::default())
    };
    let Restored { mut vm, pagers, .. } = snapshot::restore(&snap, &mut VmBuilder, how)?;
    let ready = t.elapsed();
    let (first_progress, resident) = run_until_resident(&mut vm, &pagers, t)?;
    if mode == "lazy" && snap.working_set()?.is_none() {
        snapshot::record_working_set(&snap, vm.memory(), &pagers, &[])?;
    }
    let installed = Installed::of(&pagers);
    drop(pagers);
    let timing = [ready, first_progress, resident].map(|d| d.as_secs_f64() * 1e3);
    Ok((timing, snap.fetcher.stats(), installed))
}

/// The CPU time (user and system) this process's threads have used so far, in seconds.
fn process_cpu_s() -> f64 {
    let mut u = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes one rusage into the zeroed buffer it is given.
    let u = unsafe {
        libc::getrusage(libc::RUSAGE_SELF, u.as_mut_ptr());
        u.assume_init()
    };
    let s = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    s(u.ru_utime) + s(u.ru_stime)
}

/// Runs a restored guest until its first completed page (`first progress`) and until all of
/// its lazily restored memory is resident; both measured from `t`. The guest is stopped
/// afterwards.
fn run_until_resident(
    vm: &mut Vm,
    pagers: &[Pager],
    t: Instant,
) -> crate::Result<(Duration, Duration)> {
    let ready = t.elapsed();
    let before = vm.pages_done();
    let running = vm.resume()?;
    let first_progress = loop {
        if running
            .progress()
            .iter()
            .zip(&before)
            .any(|((pages, _), b)| pages > b)
        {
            break t.elapsed();
        }
        if t.elapsed() > Duration::from_secs(60) {
            return Err("the restored guest made no progress in 60 s".into());
        }
        std::thread::sleep(Duration::from_micros(50));
    };
    let mut resident = ready;
    for p in pagers {
        if !p.wait_resident(Duration::from_secs(600))? {
            return Err("lazily restored memory not resident in 600 s".into());
        }
        resident = t.elapsed();
    }
    running.stop();
    running.wait(Duration::from_secs(30))?;
    Ok((first_progress, resident))
}

#[cfg(test)]
mod tests {
    fn error_of(argv: &[&str]) -> String {
        crate::refusal(argv, super::main)
    }

    /// A round trip is added only in front of an s3 store, and must be a number of ms; both
    /// refused before any guest is built.
    #[test]
    fn a_delay_is_refused_but_for_an_s3_store() {
        let e = error_of(&["--image", "/nonexistent", "--rtt-ms", "1"]);
        assert!(
            e.contains("--rtt-ms") && e.contains("local directory"),
            "{e}"
        );
        let e = error_of(&["--image", "/nonexistent", "--rtt-ms=-1"]);
        assert!(e.contains("--rtt-ms -1: a round trip in ms"), "{e}");
        let e = error_of(&["--image", "/nonexistent", "--rtt-ms", "inf"]);
        assert!(e.contains("--rtt-ms inf"), "{e}");
    }
}
