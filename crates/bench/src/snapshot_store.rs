//! `guestmem bench snapshot`: issue 15's chunk store on a guest started from a captured real
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
//!   `resident_ms` (all memory in place), with what the store and the cache served.
//!
//! The bench deletes its snapshots afterwards; in a given store their chunks go at its next
//! `guestmem snapshot gc`. Self-contained: the only hook is the `Snapshot` variant of `guestmem bench`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use guestmem_memory::Backend as MemBackend;
use guestmem_paging::PagerConfig;
use guestmem_store::cache::ChunkCache;
use guestmem_store::chunk::{CHUNK_BYTES, ZSTD_LEVEL};
use guestmem_store::location::StoreUrl;
use guestmem_store::restore::StoreSnapshot;
use guestmem_store::source::FetchStats;
use guestmem_store::write::{write, StoreWriteReport};
use guestmem_store::Backend;
use guestmem_vm::{layout, VcpuWork, Vm, VmConfig, Workload};
use serde::Serialize;

use crate::units::parse_size;

#[derive(clap::Args)]
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
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Output {
    image: PathBuf,
    memory_bytes: u64,
    store: String,
    chunk_bytes: u64,
    zstd_level: i32,
    snapshot: StoreWriteReport,
    stored_bytes_ratio: f64,
    write_guest_bytes_per_s: f64,
    clones: usize,
    clones_total_stored_bytes: Option<u64>,
    clones_total_vs_one_ratio: Option<f64>,
    restores: Vec<RestoreRow>,
}

#[derive(Serialize)]
struct RestoreRow {
    store: &'static str,
    mode: &'static str,
    /// `cold`: an empty chunk cache; `warm`: the one the previous restore filled.
    cache: Option<&'static str>,
    ready_ms: f64,
    first_progress_ms: f64,
    resident_ms: f64,
    fetched: FetchStats,
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

pub fn main(args: Args) -> crate::Result<()> {
    let run = crate::units::seconds(args.run_s, "--run-s")?;
    let temp = std::env::temp_dir().join(format!("guestmem-bench-store-{}", std::process::id()));
    let url = match &args.store {
        Some(s) => StoreUrl::parse(s)?,
        None => StoreUrl::Local(temp.join("store")),
    };
    let backend: Arc<dyn Backend> = url.open()?;
    let result = bench(&args, run, &url, backend, &temp);
    let _ = std::fs::remove_dir_all(&temp);
    let out = result?;
    if args.json {
        return super::envelope::print(&out);
    }
    println!(
        "snapshot of {} MiB from {} into {}: {:.3}x of guest memory stored, written at {:.2} \
         GiB/s of guest memory ({:.0} ms, {} threads)",
        out.memory_bytes >> 20,
        out.image.display(),
        out.store,
        out.stored_bytes_ratio,
        out.write_guest_bytes_per_s / (1u64 << 30) as f64,
        out.snapshot.write_ms,
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
            "restore {} {}{}: ready {:.1} ms, first progress {:.1} ms, resident {:.1} ms \
             ({} chunks from the store, {} from the cache)",
            r.store,
            r.mode,
            r.cache.map(|c| format!(" ({c} cache)")).unwrap_or_default(),
            r.ready_ms,
            r.first_progress_ms,
            r.resident_ms,
            r.fetched.store_gets,
            r.fetched.cache_hits
        );
    }
    Ok(())
}

fn bench(
    args: &Args,
    run: Duration,
    url: &StoreUrl,
    backend: Arc<dyn Backend>,
    temp: &std::path::Path,
) -> crate::Result<Output> {
    let name = format!("bench-{}", std::process::id());
    let vm = guest(args, run)?;
    let report = write(&*backend, &name, &vm, None)?;
    drop(vm);
    let mut names = vec![name.clone()];
    let one = report.stored_bytes.max(1);
    let mut total = report.stored_bytes;
    for i in 0..args.clones {
        let vm = guest(args, run)?;
        let n = format!("{name}-clone{i}");
        total += write(&*backend, &n, &vm, None)?.new_stored_bytes;
        names.push(n);
    }
    let remote = backend.remote();
    let store_kind = if remote { "s3" } else { "local" };
    let mut restores = Vec::new();
    let cache_dir = temp.join("cache");
    for mode in &args.restore {
        let runs: &[Option<&'static str>] = match (mode.as_str(), remote) {
            ("lazy", true) => &[Some("cold"), Some("warm")],
            ("lazy", false) => &[None, None],
            ("full", true) => &[Some("cold")],
            ("full", false) => &[None],
            (other, _) => return Err(format!("--restore {other}: full or lazy").into()),
        };
        for cache in runs {
            if *cache == Some("cold") {
                let _ = std::fs::remove_dir_all(&cache_dir);
            }
            let t = Instant::now();
            let chunk_cache = match cache {
                Some(_) => Some(ChunkCache::open(&cache_dir, 64 << 30)?),
                None => None,
            };
            let snap = StoreSnapshot::open(backend.clone(), &name, chunk_cache)?;
            let (mut vm, pagers) = if mode == "full" {
                (snap.restore_full()?, Vec::new())
            } else {
                let lazy = snap.restore_lazy(&PagerConfig::default())?;
                (lazy.vm, lazy.pagers)
            };
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
            for p in &pagers {
                if !p.wait_resident(Duration::from_secs(600))? {
                    return Err("lazily restored memory not resident in 600 s".into());
                }
                resident = t.elapsed();
            }
            running.stop();
            running.wait(Duration::from_secs(30))?;
            if mode == "lazy" && snap.working_set()?.is_none() {
                snap.record_working_set(&vm, &pagers)?;
            }
            drop(pagers);
            restores.push(RestoreRow {
                store: store_kind,
                mode: if mode == "full" { "full" } else { "lazy" },
                cache: *cache,
                ready_ms: ready.as_secs_f64() * 1e3,
                first_progress_ms: first_progress.as_secs_f64() * 1e3,
                resident_ms: resident.as_secs_f64() * 1e3,
                fetched: snap.fetcher.stats(),
            });
        }
    }
    // The bench's snapshots go; their chunks at the store's next `guestmem snapshot gc`.
    for n in &names {
        guestmem_store::gc::delete(&*backend, n)?;
    }
    Ok(Output {
        image: args.image.clone(),
        memory_bytes: report.memory_bytes,
        store: url.to_string(),
        chunk_bytes: CHUNK_BYTES,
        zstd_level: ZSTD_LEVEL,
        stored_bytes_ratio: report.stored_bytes as f64 / report.memory_bytes as f64,
        write_guest_bytes_per_s: report.memory_bytes as f64 / (report.write_ms / 1e3),
        snapshot: report,
        clones: args.clones,
        clones_total_stored_bytes: (args.clones > 0).then_some(total),
        clones_total_vs_one_ratio: (args.clones > 0).then(|| total as f64 / one as f64),
        restores,
    })
}
