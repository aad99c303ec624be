//! `guestmem snapshot --live`: the snapshot written while the guest runs its workload, and
//! what that cost the guest (its rate during the write against before it), beside, with
//! `--compare-paused`, a paused write of the same guest into the same destination kind.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use guestmem_contract::component::{Components, Machine};
use guestmem_contract::PayloadVm;
use guestmem_events::Reporter;
use guestmem_snapshot::live::{write_machine_live, LiveBase, LiveOptions, LiveReport, Strategy};
use guestmem_snapshot::{self as snapshot, WriteReport};
use guestmem_store::location::{Location, StoreUrl};
use guestmem_store::write::StoreWriteReport;
use guestmem_tracking::Tracker;
use serde::Serialize;

use super::store::is_store;

/// Where the snapshots go: a flat directory, or a store snapshot.
enum Target {
    Flat(PathBuf),
    Store(Location),
}

impl Target {
    fn parse(path: &Path) -> crate::Result<Target> {
        Ok(if is_store(path) {
            Target::Store(Location::parse(&path.to_string_lossy())?)
        } else {
            Target::Flat(path.to_path_buf())
        })
    }
}

#[derive(Serialize)]
#[serde(untagged)]
enum Written {
    Flat(WriteReport),
    Store(StoreWriteReport),
}

impl LiveOutput {
    /// The bytes the live snapshot's own memory takes.
    pub(super) fn stored_bytes(&self) -> u64 {
        self.report.stored_bytes()
    }
}

impl Written {
    /// The bytes the snapshot's own memory takes: a flat snapshot's data, a store snapshot's
    /// distinct stored chunks.
    fn stored_bytes(&self) -> u64 {
        match self {
            Written::Flat(r) => r.data_bytes,
            Written::Store(r) => r.stored_bytes,
        }
    }
}

/// `snapshot --live --json`. Format: crate::report::SNAPSHOT_LIVE (a change bumps it).
#[derive(Serialize)]
pub(super) struct LiveOutput {
    snapshot: String,
    report: Written,
    live: LiveReport,
    /// The guest's workload rate (pages/s, all vCPUs) before the snapshot, undisturbed.
    guest_pages_per_s_undisturbed: f64,
    /// Its rate from the start of the live write to its end.
    guest_pages_per_s_during: f64,
    /// During against undisturbed.
    guest_rate_ratio: f64,
    /// With `--compare-paused`: a paused write of the same guest, just after.
    paused: Option<PausedOutput>,
    /// With `--diff`: the live diff over the snapshot.
    diff: Option<Box<LiveOutput>>,
}

#[derive(Serialize)]
struct PausedOutput {
    write_ms: f64,
    stored_bytes: u64,
    /// The live snapshot's stored bytes against the paused one's.
    live_stored_ratio: f64,
    /// The live snapshot's total time against the paused write's.
    live_time_ratio: f64,
    /// Chunks the paused write found stored already (it writes into a fresh store: only
    /// those repeated within the guest's own memory).
    deduplicated_chunks: u64,
    /// A store: the same paused write into the live snapshot's own store, just after (its
    /// chunks mostly there already, so hashed but not compressed or put): not a paused
    /// write's cost, shown to tell the two apart.
    same_store_write_ms: Option<f64>,
}

/// The guest's pages done so far, all vCPUs.
fn pages(machine: &mut PayloadVm<'_>) -> u64 {
    machine
        .as_running()
        .map_or(0, |r| r.progress().iter().map(|(p, _)| p).sum())
}

/// Runs the live snapshot (and diff) of `machine`, which runs its workload; `undisturbed` is
/// its rate before; `progress`: where the writes tell the bytes stored so far.
pub(super) fn snapshot(
    machine: &mut PayloadVm<'_>,
    undisturbed: f64,
    out: &Path,
    diff: Option<&Path>,
    diff_after: Duration,
    compare_paused: bool,
    (strategy, progress): (Strategy, Option<Arc<Reporter>>),
) -> crate::Result<LiveOutput> {
    let target = Target::parse(out)?;
    let diff_target = diff.map(Target::parse).transpose()?;
    if let (Target::Store(a), Some(Target::Store(d))) = (&target, &diff_target) {
        if a.store != d.store {
            return Err(
                "--diff must be in the same store as --out (a diff reuses its base's chunks)"
                    .into(),
            );
        }
    }
    if matches!(
        (&target, &diff_target),
        (Target::Flat(_), Some(Target::Store(_))) | (Target::Store(_), Some(Target::Flat(_)))
    ) {
        return Err("--diff and --out must both be directories or both store snapshots".into());
    }
    let (mut out, tracker) = one(
        machine,
        undisturbed,
        &target,
        None,
        (diff.is_some(), strategy, progress.clone()),
        compare_paused,
    )?;
    if let (Some(d), Some(tracker)) = (&diff_target, tracker) {
        std::thread::sleep(diff_after);
        let (d_out, _) = one(
            machine,
            undisturbed,
            d,
            Some((&target, tracker)),
            (false, strategy, progress),
            false,
        )?;
        out.diff = Some(Box::new(d_out));
    }
    Ok(out)
}

impl LiveOutput {
    /// The text report: one line per snapshot.
    pub(super) fn print(&self) {
        let rounds: Vec<String> = self
            .live
            .rounds
            .iter()
            .map(|r| format!("{} MiB", r.bytes >> 20))
            .collect();
        println!(
            "live snapshot {} ({}): paused {:.1} ms, {:.1} ms in all, {} rounds ({}; the last \
             paused), {} tracking, {} pages copied before their write; guest at {:.0} pages/s \
             during the write, {:.2}x of {:.0} undisturbed",
            self.snapshot,
            self.live.mode,
            self.live.pause_ms,
            self.live.total_ms,
            self.live.rounds.len(),
            rounds.join(", "),
            self.live.tracking,
            self.live.copied_before_write_pages,
            self.guest_pages_per_s_during,
            self.guest_rate_ratio,
            self.guest_pages_per_s_undisturbed
        );
        if let Some(p) = &self.paused {
            println!(
                "  a paused write of the same guest: {:.1} ms, {} MiB stored; live stores {:.3}x \
                 of that and takes {:.2}x its time",
                p.write_ms,
                p.stored_bytes >> 20,
                p.live_stored_ratio,
                p.live_time_ratio
            );
        }
        if let Some(d) = &self.diff {
            d.print();
        }
    }
}

/// One live write into `target`; `base`: a diff over that snapshot, with its tracker.
fn one(
    machine: &mut PayloadVm<'_>,
    undisturbed: f64,
    target: &Target,
    base: Option<(&Target, Tracker)>,
    (keep_tracking, strategy, progress): (bool, Strategy, Option<Arc<Reporter>>),
    compare_paused: bool,
) -> crate::Result<(LiveOutput, Option<Tracker>)> {
    let opts = LiveOptions {
        keep_tracking,
        strategy,
        progress,
        ..LiveOptions::default()
    };
    let mut none = Components::none();
    let before = pages(machine);
    let t = Instant::now();
    let (name, report, live, tracker) = match target {
        Target::Flat(dir) => {
            let base = base.map(|(b, tracker)| match b {
                Target::Flat(d) => LiveBase { dir: d, tracker },
                Target::Store(_) => unreachable!("checked: both flat"),
            });
            let w = write_machine_live(machine, &mut none, dir, base, &opts)?;
            (
                dir.display().to_string(),
                Written::Flat(w.report),
                w.live,
                w.tracker,
            )
        }
        Target::Store(at) => {
            let objects = at.store.open_with(crate::store_options())?;
            let base = base.map(|(b, tracker)| match b {
                Target::Store(l) => (l.name.as_str(), tracker),
                Target::Flat(_) => unreachable!("checked: both in a store"),
            });
            let w = guestmem_store::live::write_machine_live(
                &*objects, &at.name, machine, &mut none, base, &opts,
            )?;
            (at.to_string(), Written::Store(w.report), w.live, w.tracker)
        }
    };
    let during = (pages(machine) - before) as f64 / t.elapsed().as_secs_f64();
    let paused = if compare_paused {
        Some(paused_reference(machine, target, &report, &live)?)
    } else {
        None
    };
    Ok((
        LiveOutput {
            snapshot: name,
            report,
            live,
            guest_pages_per_s_undisturbed: undisturbed,
            guest_pages_per_s_during: during,
            guest_rate_ratio: during / undisturbed,
            paused,
            diff: None,
        },
        tracker,
    ))
}

/// A paused write of the same guest beside the live one (deleted again), for comparison.
fn paused_reference(
    machine: &mut PayloadVm<'_>,
    target: &Target,
    live_report: &Written,
    live: &LiveReport,
) -> crate::Result<PausedOutput> {
    machine.pause()?;
    let vm = machine.as_paused().ok_or("the VM did not pause")?;
    let t = Instant::now();
    let (mut deduplicated, mut same_store_ms) = (0, None);
    let stored = match target {
        Target::Flat(dir) => {
            let mut name = dir.file_name().unwrap_or_default().to_os_string();
            name.push(".paused-reference");
            let reference = dir.with_file_name(name);
            let r = snapshot::write(vm, &reference)?;
            let write_ms = t.elapsed().as_secs_f64() * 1e3;
            std::fs::remove_dir_all(&reference)?;
            (r.data_bytes, write_ms)
        }
        Target::Store(at) => {
            let r = reference_store(&at.store, &at.name, |objects| {
                guestmem_store::write::write(objects, &at.name, vm, None)
            })?;
            deduplicated = r.deduplicated_chunks;
            let objects = at.store.open_with(crate::store_options())?;
            let name = format!("{}.paused-reference", at.name);
            let same = guestmem_store::write::write(&*objects, &name, vm, None)?;
            guestmem_store::gc::delete(&*objects, &name)?;
            same_store_ms = Some(same.write_ms);
            (r.stored_bytes, r.write_ms)
        }
    };
    machine.resume()?;
    Ok(PausedOutput {
        write_ms: stored.1,
        stored_bytes: stored.0,
        live_stored_ratio: live_report.stored_bytes() as f64 / stored.0 as f64,
        live_time_ratio: live.total_ms / stored.1,
        deduplicated_chunks: deduplicated,
        same_store_write_ms: same_store_ms,
    })
}

/// Runs `write` on a fresh, empty store beside `store` (a sibling directory, or a sibling S3
/// prefix), then removes it: a paused write into the live snapshot's own store would find
/// nearly every chunk there already (the live write just put them) and only hash, not
/// compress or put, so its time would not be a paused write's.
fn reference_store<T>(
    store: &StoreUrl,
    name: &str,
    write: impl FnOnce(&dyn guestmem_store::ObjectStore) -> guestmem_store::Result<T>,
) -> crate::Result<T> {
    const SUFFIX: &str = ".paused-reference";
    match store {
        StoreUrl::Local(dir) => {
            let mut name = dir.file_name().unwrap_or_default().to_os_string();
            name.push(SUFFIX);
            let reference = dir.with_file_name(name);
            if reference.exists() {
                std::fs::remove_dir_all(&reference)?;
            }
            let written =
                write(&*StoreUrl::Local(reference.clone()).open_with(crate::store_options())?);
            let removed = std::fs::remove_dir_all(&reference);
            let written = written?;
            removed?;
            Ok(written)
        }
        StoreUrl::S3 { bucket, prefix } => {
            let reference = StoreUrl::S3 {
                bucket: bucket.clone(),
                prefix: format!("{}{SUFFIX}", prefix.trim_end_matches('/')),
            };
            let objects = reference.open_with(crate::store_options())?;
            let written = write(&*objects)?;
            guestmem_store::gc::delete(&*objects, name)?;
            guestmem_store::gc::gc(&*objects, Duration::ZERO)?;
            Ok(written)
        }
    }
}
