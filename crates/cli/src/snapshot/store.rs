//! `guestmem snapshot --out s3://…|store:…`, `guestmem restore s3://…|store:…` and the store's
//! own operations (`guestmem snapshot merge|gc|delete`): snapshots in the chunk store of
//! crates/store, beside the flat snapshot directories of the parent module.

use std::path::Path;
use std::time::{Duration, Instant};

use guestmem_snapshot::SnapshotImage;
use guestmem_store::cache::ChunkCache;
use guestmem_store::location::{is_store_url, Location, StoreUrl};
use guestmem_store::pages::FetchStats;
use guestmem_store::restore::StoreSnapshot;
use guestmem_store::write::StoreWriteReport;
use guestmem_tracking::{Mode as TrackingMode, Tracker};
use guestmem_vm::Vm;
use serde::Serialize;

use crate::report;

use super::{Mode, RestoreArgs};

/// Whether a `--out`, `--diff` or restore argument names a store snapshot.
pub(crate) fn is_store(path: &Path) -> bool {
    path.to_str().is_some_and(is_store_url)
}

/// The store operations.
#[derive(clap::Subcommand)]
pub enum StoreOp {
    /// Merge a diff snapshot and its base chain into one snapshot of the same store that
    /// stands alone (a manifest operation: no chunk is read or written).
    Merge {
        /// The diff snapshot (s3://BUCKET/PREFIX/NAME or store:DIR/NAME).
        snapshot: String,
        /// The merged snapshot, in the same store.
        #[arg(long)]
        out: String,
    },
    /// Remove the chunks no snapshot of the store references (never while a snapshot is
    /// being written; chunks younger than --grace-s are kept).
    Gc {
        /// The store (s3://BUCKET/PREFIX or store:DIR).
        store: String,
        /// Keep unreferenced chunks younger than this, in seconds.
        #[arg(long, default_value_t = 3600)]
        grace_s: u64,
        #[arg(long)]
        json: bool,
    },
    /// Delete a snapshot from its store (its chunks go at the next gc).
    Delete { snapshot: String },
    /// Show a snapshot's format and version and the guestmem that wrote it, and whether this
    /// guestmem restores it.
    Info {
        /// The snapshot: a directory, s3://BUCKET/PREFIX/NAME or store:DIR/NAME.
        snapshot: String,
        #[arg(long)]
        json: bool,
    },
}

pub fn run_op(op: StoreOp) -> crate::Result<()> {
    match op {
        StoreOp::Merge { snapshot, out } => {
            let from = Location::parse(&snapshot)?;
            let to = Location::parse(&out)?;
            if from.store != to.store {
                return Err(format!(
                    "--out {out} is in another store than {snapshot}: a merge reuses the chunks \
                     of its store"
                )
                .into());
            }
            let objects = from.store.open_with(crate::store_options())?;
            let merged = guestmem_store::merge::merge(&*objects, &from.name, &to.name)?;
            println!(
                "merged {snapshot} into {out}: {} chunks, {} MiB stored, no base",
                merged.regions.iter().map(|r| r.chunks.len()).sum::<usize>(),
                guestmem_store::write::stored_bytes(&merged) >> 20
            );
        }
        StoreOp::Gc {
            store,
            grace_s,
            json,
        } => {
            let objects = StoreUrl::parse(&store)?.open_with(crate::store_options())?;
            let r = guestmem_store::gc::gc(&*objects, Duration::from_secs(grace_s))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                println!(
                    "gc of {store}: {} snapshots reference {} of {} chunks; removed {} chunks \
                     ({} MiB), kept {} younger than {grace_s} s",
                    r.manifests,
                    r.referenced_chunks,
                    r.chunks,
                    r.removed_chunks,
                    r.removed_bytes >> 20,
                    r.young_chunks
                );
            }
        }
        StoreOp::Delete { snapshot } => {
            let at = Location::parse(&snapshot)?;
            guestmem_store::gc::delete(&*at.store.open_with(crate::store_options())?, &at.name)?;
            println!("deleted {snapshot} (its chunks go at the next gc)");
        }
        StoreOp::Info { snapshot, json } => super::info::info(&snapshot, json)?,
    }
    Ok(())
}

/// `snapshot --json` into a store. Format: crate::report::SNAPSHOT_STORE (a change bumps it).
#[derive(Serialize)]
struct StoreSnapshotOutput {
    #[serde(flatten)]
    report: StoreWriteReport,
    /// Stored bytes of the snapshot's own chunks per byte of guest memory.
    stored_bytes_ratio: f64,
    write_guest_bytes_per_s: f64,
    pages_done_per_vcpu: Vec<u64>,
    diff: Option<StoreDiffOutput>,
}

#[derive(Serialize)]
struct StoreDiffOutput {
    #[serde(flatten)]
    report: StoreWriteReport,
    pages_done_per_vcpu: Vec<u64>,
}

/// Writes the paused `vm` to the store snapshot `out`, and with `diff` lets the guest go on
/// for `diff_after` under dirty tracking and writes a diff over it. Returns the bytes the
/// snapshot's chunks take in the store.
pub(super) fn snapshot(
    vm: &mut Vm,
    out: &Path,
    diff: Option<&Path>,
    diff_after: Duration,
    json: bool,
) -> crate::Result<u64> {
    let at = Location::parse(&out.to_string_lossy())?;
    let diff_at = match diff {
        None => None,
        Some(d) if is_store(d) => {
            let d = Location::parse(&d.to_string_lossy())?;
            if d.store != at.store {
                return Err(format!(
                    "--diff {d} is in another store than --out {at}: a diff reuses its base's \
                     chunks"
                )
                .into());
            }
            Some(d)
        }
        Some(d) => {
            return Err(format!(
                "--diff {}: a diff over a store snapshot goes into the same store \
                 (s3://… or store:…)",
                d.display()
            )
            .into())
        }
    };
    let objects = at.store.open_with(crate::store_options())?;
    let report = guestmem_store::write::write(&*objects, &at.name, vm, None)?;
    let stored = report.stored_bytes;
    let pages_done_per_vcpu = vm.pages_done();
    let diff = match diff_at {
        None => None,
        Some(d) => {
            let mut tracker = Tracker::start(vm, TrackingMode::Bitmap)?;
            let running = vm.resume()?;
            std::thread::sleep(diff_after);
            running.pause()?;
            let dirty = tracker.harvest()?;
            tracker.stop()?;
            let report =
                guestmem_store::write::write(&*objects, &d.name, vm, Some((&at.name, &dirty)))?;
            Some(StoreDiffOutput {
                report,
                pages_done_per_vcpu: vm.pages_done(),
            })
        }
    };
    let out = StoreSnapshotOutput {
        stored_bytes_ratio: report.stored_bytes as f64 / report.memory_bytes as f64,
        write_guest_bytes_per_s: report.memory_bytes as f64 / (report.write_ms / 1e3),
        report,
        pages_done_per_vcpu,
        diff,
    };
    if json {
        println!("{}", report::json(report::SNAPSHOT_STORE, &out, true)?);
        return Ok(stored);
    }
    let r = &out.report;
    println!(
        "snapshot of {} MiB written to {} in {:.1} ms ({:.2} GiB/s of guest memory, {} threads): \
         {} chunks, {} zero, {} new ({} MiB stored), {} already in the store; the snapshot's \
         chunks take {} MiB ({:.3}x of guest memory)",
        r.memory_bytes >> 20,
        r.snapshot,
        r.write_ms,
        out.write_guest_bytes_per_s / (1u64 << 30) as f64,
        r.threads,
        r.chunks,
        r.zero_chunks,
        r.new_chunks,
        r.new_stored_bytes >> 20,
        r.deduplicated_chunks,
        r.stored_bytes >> 20,
        out.stored_bytes_ratio
    );
    println!(
        "guest pages written per vCPU at the snapshot: {:?}",
        out.pages_done_per_vcpu
    );
    if let Some(d) = &out.diff {
        println!(
            "diff snapshot over it written to {} in {:.1} ms: {} chunks inherited, {} new ({} \
             MiB stored); guest pages per vCPU then: {:?}",
            d.report.snapshot,
            d.report.write_ms,
            d.report.inherited_chunks,
            d.report.new_chunks,
            d.report.new_stored_bytes >> 20,
            d.pages_done_per_vcpu
        );
    }
    Ok(stored)
}

/// `restore --json` from a store. Format: crate::report::RESTORE_STORE (a change bumps it).
#[derive(Serialize)]
struct StoreRestoreOutput {
    mode: &'static str,
    store: &'static str,
    snapshot: String,
    /// From opening the snapshot to the vCPUs being ready to run.
    restore_ms: f64,
    /// `lazy`: from opening the snapshot until all memory was resident.
    resident_ms: Option<f64>,
    /// Full: every region's digest equals the manifest's before the guest ran.
    memory_digests_match: Option<bool>,
    fetched: FetchStats,
    /// Lazy: the working set fetched first, or recorded for next time.
    working_set: Option<crate::working_set::WorkingSetOutput>,
    pages_at_snapshot_per_vcpu: Vec<u64>,
    pages_after_run_per_vcpu: Vec<u64>,
    guest_continued: bool,
}

/// Opens the store snapshot `at`, through the host's chunk cache when the store is remote.
pub(crate) fn open_store_snapshot(at: &Location) -> crate::Result<StoreSnapshot> {
    let objects = at.store.open_with(crate::store_options())?;
    let cache = if objects.remote() {
        Some(ChunkCache::host_default()?)
    } else {
        None
    };
    Ok(StoreSnapshot::open(objects, &at.name, cache)?)
}

pub(super) fn restore(args: &RestoreArgs) -> crate::Result<()> {
    let run_for = crate::units::seconds(args.run_for, "--run-for")?;
    let text = args.dir.to_string_lossy().into_owned();
    let at = Location::parse(&text)?;
    let t = Instant::now();
    let snap = open_store_snapshot(&at)?;
    if guestmem_contract::is_linux_state(snap.machine_state()) {
        return super::restore_linux(snap, args, run_for);
    }
    args.refuse_clones()?;
    if matches!(args.mode, Mode::Map) {
        return Err(format!(
            "--mode map maps a flat snapshot's memory file; {text} is a store snapshot \
             (compressed chunks): restore it with --mode full or --mode lazy"
        )
        .into());
    }
    // With --uffd-socket the RAM comes from the page server (`guestmem page-server
    // --snapshot` of the same store snapshot checks each chunk's hash); the sys region is
    // checked here.
    let (restored, mut progress) = super::restore_reported(args, &snap)?;
    // The KVM Userfault pagers (guest_memfd regions) serve the vCPUs' userfault exits, and a
    // page server's connection and our copy of the userfaultfd are held, while the guest runs.
    let guestmem_snapshot::Restored {
        pagers,
        userfault_pagers,
        mut vm,
        peer,
        prefetched,
        ..
    } = restored;
    let restore_ms = t.elapsed().as_secs_f64() * 1e3;
    // A full restore compared every chunk's hash already (it refuses otherwise).
    let memory_digests_match = matches!(args.mode, Mode::Full).then_some(true);
    let (before, after, resident_ms) = super::run_restored(
        &mut vm,
        &pagers,
        &userfault_pagers,
        (run_for, progress.as_mut()),
        t,
    )?;
    drop(peer);
    let working_set = crate::working_set::output(
        &crate::working_set::pager_stats(&pagers, &userfault_pagers),
        prefetched,
        || {
            Ok(guestmem_snapshot::record_working_set(
                &snap,
                vm.memory(),
                &pagers,
                &userfault_pagers,
            )?)
        },
    )?;
    drop(pagers);
    drop(userfault_pagers);
    let out = StoreRestoreOutput {
        mode: match args.mode {
            Mode::Full => "full",
            Mode::Map => "map",
            Mode::Lazy => "lazy",
        },
        store: if snap.object_store().remote() {
            "s3"
        } else {
            "local"
        },
        snapshot: text,
        restore_ms,
        resident_ms,
        memory_digests_match,
        fetched: snap.fetcher.stats(),
        working_set,
        guest_continued: before.iter().zip(&after).all(|(b, a)| a > b),
        pages_at_snapshot_per_vcpu: before,
        pages_after_run_per_vcpu: after,
    };
    if args.json {
        println!("{}", report::json(report::RESTORE_STORE, &out, true)?);
    } else {
        print_restore(&out, args.run_for);
    }
    if !out.guest_continued {
        return Err("the restored guest did not go on running".into());
    }
    Ok(())
}

/// Prints what a restore did, for a reader; `run_for`: the seconds the guest ran after it.
fn print_restore(out: &StoreRestoreOutput, run_for: f64) {
    println!(
        "restored {} ({}) in {:.1} ms",
        out.snapshot, out.mode, out.restore_ms
    );
    match out.memory_digests_match {
        Some(_) => println!("memory digests match the snapshot's: yes"),
        None => println!("memory checked chunk by chunk (BLAKE3) as it was paged in"),
    }
    if let Some(ms) = out.resident_ms {
        println!("all memory resident {ms:.1} ms after the restore began");
    }
    println!(
        "chunks: {} fetched from the store ({} MiB), {} from the host's chunk cache",
        out.fetched.store_gets,
        out.fetched.store_bytes >> 20,
        out.fetched.cache_hits
    );
    if let Some(ws) = &out.working_set {
        println!(
            "working set: {} chunks {}; {} page faults served during the run",
            ws.chunks, ws.action, ws.faults
        );
    }
    println!(
        "guest pages written per vCPU: {:?} at the snapshot, {:?} after running {:.1} s",
        out.pages_at_snapshot_per_vcpu, out.pages_after_run_per_vcpu, run_for
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use guestmem_memory::Backend;
    use guestmem_vm::VmConfig;

    /// Store snapshots are told apart from directories by their URL; a diff of a store
    /// snapshot must be a store snapshot of the same store, refused before anything is
    /// written otherwise.
    #[test]
    fn a_store_diff_goes_into_the_same_store() {
        assert!(is_store(Path::new("store:/s/a")) && is_store(Path::new("s3://b/p/a")));
        assert!(!is_store(Path::new("/s/a")) && !is_store(Path::new("./store:a")));
        let dir = std::env::temp_dir().join(format!("guestmem-cli-store-{}", std::process::id()));
        let out = format!("store:{}/one/base", dir.display());
        let mut vm = Vm::new(&VmConfig::simple(1, 2 << 20, Backend::Anon)).unwrap();
        let e = snapshot(
            &mut vm,
            Path::new(&out),
            Some(Path::new("/flat/dir")),
            Duration::ZERO,
            true,
        )
        .unwrap_err()
        .to_string();
        assert_eq!(
            e,
            "--diff /flat/dir: a diff over a store snapshot goes into the same store (s3://… or \
             store:…)"
        );
        let other = format!("store:{}/two/diff", dir.display());
        let e = snapshot(
            &mut vm,
            Path::new(&out),
            Some(Path::new(&other)),
            Duration::ZERO,
            true,
        )
        .unwrap_err()
        .to_string();
        assert_eq!(
            e,
            format!(
                "--diff {other} is in another store than --out {out}: a diff reuses its base's \
                 chunks"
            )
        );
        assert!(!dir.exists(), "nothing was written");
    }
}
