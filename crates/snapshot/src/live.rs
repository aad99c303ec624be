//! Live snapshots: guest memory is written while the guest runs; the guest pauses only for
//! long enough to fix which bytes the snapshot holds, and to save its vCPU and component state.
//! The snapshot is the guest's memory at that pause, whatever the guest writes before or after.
//! Two strategies ([`Strategy`]); [`Strategy::Auto`] takes copy-before-write wherever the
//! kernel allows it.
//!
//! **Copy-before-write** ([`crate::copy_before_write`]; QEMU's background snapshot works this
//! way): userfaultfd write-protect (`guestmem_paging::write_protect`) over the guest's memory,
//! each chunk stored once from memory while protected, and a chunk the guest writes before it is
//! stored copied aside first (then stored ahead of the others). The pause fixes the bytes by
//! protecting memory, so it does not grow with what the guest writes: protecting all of it takes
//! time in proportion to memory (every page-table entry, and KVM's own mappings dropped by the
//! MMU notifier), so that is done *before* the pause, while the guest runs; what the guest
//! writes meanwhile is let go page by page and protected again, in rounds, and the pause
//! protects only the last few pages written. How a guest write reaches the handler: the
//! protection drops KVM's mapping, the guest's next write faults into KVM, whose
//! `get_user_pages(FOLL_WRITE)` raises the userfaultfd fault in the vCPU thread (checked by
//! the tests: every snapshot's bytes are compared with a digest taken during its pause).
//! Every chunk is stored exactly once, so a live snapshot stores what a paused one does.
//! Copies held aside are bounded ([`LiveOptions::held_bytes`]): past it a write waits for the
//! store, so a store slower than the guest slows the guest rather than spending host memory.
//! guest_memfd regions cannot be registered with userfaultfd, nor dirty-logged by KVM, and
//! this kernel has no other write tracking for them (no KVM Userfault): they are copied whole
//! during the pause, which therefore grows with their size (see docs/benchmarks.md).
//!
//! **Rounds** (pre-copy's design, aimed at a file instead of a peer): dirty tracking starts
//! ([`Mode::best`], or the caller's tracker for a diff), every chunk is stored while the guest
//! runs, then rounds store again the chunks the guest dirtied meanwhile, until what a round
//! leaves is small ([`LiveOptions::final_bytes`], as [`LiveSink::cost`] counts it), stops
//! shrinking, or the rounds run out; the pause copies the last harvest's chunks (and the
//! guest_memfd regions) into host memory, stored after the guest resumes. Every page's last
//! store follows its last write before the pause, so the snapshot is the memory at the pause.
//! But when the guest dirties memory faster than the store writes it, the rounds never shrink
//! and the pause copies nearly all memory: the pause grows with the dirty rate, up to longer
//! than a paused snapshot's (issue 44).
//!
//! Why copy-before-write by default, measured side by side (docs/benchmarks.md, "Live
//! snapshots"): at a low dirty rate both pause briefly; at high rates only copy-before-write
//! keeps the pause short, and it stores each chunk once where rounds store the re-dirtied ones
//! again. What it costs the guest: the protection drops KVM's mappings (on this shadow-paging
//! host each page then faults into KVM once, as under dirty logging), each first write to a
//! chunk not stored yet waits for a userfaultfd round trip and a chunk copy, and while memory
//! is protected before the pause every write waits for a round trip per page. A throttle
//! (migration's auto-converge) would bound the rounds' pause only by slowing the guest to the
//! store's rate for the whole snapshot; copy-before-write slows it only where it writes a
//! chunk not stored yet, and only as much as [`LiveOptions::held_bytes`] requires. Rounds
//! remain for kernels without userfaultfd write-protect, and for memory another userfaultfd
//! holds (a lazy restore's pager that has not retired yet): [`Strategy::Auto`] says so in
//! [`LiveReport::mode_reason`].
//!
//! After the pause copy-before-write stores memory in batches of [`LiveSink::batch_chunks`]
//! (the held copies first in each). A batch as large as what the sink writes in parallel
//! (the chunk store: a pack per writer thread) keeps the whole write as fast, beside the running
//! guest, as the sink's paused write allows; a batch of one pack left all but one of the store's
//! threads idle (docs/benchmarks.md, "Live snapshots", has both). The guest gets less CPU
//! meanwhile: its rate during the write is reported beside the total.
//!
//! A [`LiveSink`] is where the chunks go: the flat snapshot directory here
//! ([`write_machine_live`]), or a chunk store (crate guestmem_store).

use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use guestmem_memory::{digest_bytes, GuestMemory, PageBuf, DIGEST_SEED, PAGE_SIZE};
use guestmem_sys::to_usize;
use guestmem_tracking::{tracked, DirtyBitmap, Mode, Tracker};
use serde::Serialize;

use super::manifest::{
    BaseRef, Chunk, Manifest, RegionFile, RegionImage, CHUNK_BYTES, FORMAT, VERSION,
};
use super::sparse::is_zero;
use super::write::{
    check_replaceable, commit, staging_dir, sync_dir, write_manifest, write_state, WriteReport,
};
use super::Snapshot;
use crate::copy_before_write::Armed;
pub use crate::sink::{ChunkSource, LiveSink};
use crate::{Error, Result};
use guestmem_contract::component::{ComponentState, Components, Machine};

/// How a live snapshot decides when to pause.
#[derive(Debug, Clone)]
pub struct LiveOptions {
    /// The dirty-tracking mode of a full snapshot (`None`: [`Mode::best`]); a diff uses the
    /// tracker it is given.
    pub mode: Option<Mode>,
    /// Pause once a round leaves at most this much to store (as [`LiveSink::cost`] counts
    /// it), or once a round leaves no less than the one before (more rounds would not shrink
    /// the pause).
    pub final_bytes: u64,
    /// Rounds while the guest runs, at most (the first, which stores everything, included);
    /// then the guest pauses whatever is left.
    pub max_rounds: usize,
    /// Hand the tracker back (in [`Captured::tracker`], [`LiveWrite::tracker`]) still
    /// running, reporting what the guest writes after the pause: the tracker of a diff over
    /// this snapshot.
    pub keep_tracking: bool,
    /// How the memory is captured (see the module docs).
    pub strategy: Strategy,
    /// Copy-before-write: at most this many bytes of chunks copied before their write wait
    /// to be stored; past it, writes wait for the store (the guest is slowed, host memory
    /// is not spent).
    pub held_bytes: u64,
    /// Where the write tells its progress: at the reporter's interval, a record of its status
    /// (`precopy` unless it says otherwise) with the bytes stored so far
    /// ([`crate::progress::SnapshotProgress::reporter`]); `None`: no records.
    pub progress: Option<Arc<guestmem_events::Reporter>>,
}

impl Default for LiveOptions {
    fn default() -> Self {
        LiveOptions {
            mode: None,
            final_bytes: 2 << 20,
            max_rounds: 16,
            keep_tracking: false,
            strategy: Strategy::Auto,
            held_bytes: 256 << 20,
            progress: None,
        }
    }
}

/// How a live snapshot captures memory (see the module docs for the measurements behind the
/// default).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Strategy {
    /// Copy-before-write where the kernel's userfaultfd write-protect can take every
    /// dirty-loggable region, else dirty rounds (the report says why).
    #[default]
    Auto,
    /// Pre-copy rounds under dirty tracking, then a pause that copies what the last round
    /// left: the pause grows with the guest's dirty rate.
    Rounds,
    /// Write-protect at the pause, every chunk copied before its first write: the pause is
    /// the protection's setup, whatever the guest writes. Refused, naming why, where the
    /// kernel cannot.
    CopyBeforeWrite,
}

impl Strategy {
    /// The name in reports and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Auto => "auto",
            Strategy::Rounds => "rounds",
            Strategy::CopyBeforeWrite => "copy-before-write",
        }
    }
}

impl std::str::FromStr for Strategy {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        [Strategy::Auto, Strategy::Rounds, Strategy::CopyBeforeWrite]
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| {
                format!("unknown live snapshot mode '{s}' (auto, rounds or copy-before-write)")
            })
    }
}

/// One round of a live snapshot.
#[derive(Debug, Clone, Serialize)]
pub struct LiveRound {
    /// Chunks stored.
    pub chunks: u64,
    /// Bytes the sink wrote (see [`LiveSink::store`]).
    pub bytes: u64,
    /// How long the round took, in ms.
    pub ms: f64,
    /// Whether the guest was paused (the last round).
    pub paused: bool,
}

/// What a live snapshot did.
#[derive(Debug, Clone, Serialize)]
pub struct LiveReport {
    /// How long the guest was paused, in ms (pause, last round, states saved, resume).
    pub pause_ms: f64,
    /// From the start to the snapshot in place, in ms.
    pub total_ms: f64,
    /// The tracking mode.
    pub tracking: &'static str,
    /// The rounds, the paused one last.
    pub rounds: Vec<LiveRound>,
    /// Bytes of guest_memfd regions (not dirty-loggable) stored whole while paused.
    pub paused_untracked_bytes: u64,
    /// The strategy used: `rounds` or `copy-before-write`.
    pub mode: &'static str,
    /// Why that one (the automatic choice's reason, or the caller's).
    pub mode_reason: String,
    /// Of the pause: how long stopping the vCPUs took, in ms.
    pub stop_ms: f64,
    /// Of the pause: how long resuming the machine and its components took, in ms.
    pub resume_ms: f64,
    /// Copy-before-write: how long write-protecting all memory took, before the pause (the
    /// guest running), in ms.
    pub pre_arm_ms: f64,
    /// Copy-before-write: rounds of protecting again, before the pause, the pages the guest
    /// wrote meanwhile.
    pub rearm_rounds: u64,
    /// Copy-before-write: bytes of such pages protected again within the pause.
    pub paused_rearm_bytes: u64,
    /// Copy-before-write: how long that took, within the pause, in ms.
    pub arm_ms: f64,
    /// Copy-before-write: guest (or host) writes that found their page protected.
    pub write_faults: u64,
    /// Copy-before-write: pages copied aside before their first write (whole chunks).
    pub copied_before_write_pages: u64,
    /// Copy-before-write: the most bytes of such copies held at once.
    pub held_peak_bytes: u64,
}

/// The chunks the pause copied, stored after the guest resumed.
struct Frozen(std::collections::HashMap<(usize, usize), Vec<u8>>);

impl Frozen {
    /// Copies `chunks` of `memory` (paused).
    fn copy(memory: &GuestMemory, chunk: u64, chunks: &[(usize, usize)]) -> Result<Frozen> {
        let mut map = std::collections::HashMap::with_capacity(chunks.len());
        for &(ri, ci) in chunks {
            let region = &memory.regions()[ri];
            let offset = ci as u64 * chunk;
            let mut bytes = vec![0u8; to_usize(chunk.min(region.size() - offset))];
            GuestMemory::read(memory, region.gpa() + offset, &mut bytes)?;
            map.insert((ri, ci), bytes);
        }
        Ok(Frozen(map))
    }
}

impl ChunkSource for Frozen {
    fn read(&self, region: usize, index: usize, _gpa: u64, buf: &mut [u8]) -> Result<()> {
        let bytes = self.0.get(&(region, index)).ok_or_else(|| {
            Error::Write(format!(
                "region {region} chunk {index} was not copied during the pause"
            ))
        })?;
        buf.copy_from_slice(bytes);
        Ok(())
    }
}

/// The states a live snapshot saved during its pause.
#[derive(Debug)]
pub struct Captured {
    /// What [`Machine::save`] gave.
    pub machine: Vec<u8>,
    /// The components' states.
    pub components: Vec<ComponentState>,
    /// The rounds and the pause.
    pub report: LiveReport,
    /// With [`LiveOptions::keep_tracking`], the tracker, reporting writes since the pause.
    pub tracker: Option<Tracker>,
}

/// Runs a live snapshot's rounds into `sink` (see the module docs): `machine` and its
/// `components` run on entry and run again on return, error or not (unless resuming them
/// fails). `diff`: the tracker started when the diff's base was taken (its first harvest is
/// what the diff stores); `None`: a full snapshot under a tracker of `opts.mode`.
pub fn capture<M: Machine + ?Sized, S: LiveSink>(
    machine: &mut M,
    components: &mut Components<'_>,
    sink: &mut S,
    diff: Option<Tracker>,
    opts: &LiveOptions,
) -> Result<Captured> {
    let t = Instant::now();
    let full = diff.is_none();
    let mut sink = crate::sink::Reporting::new(sink, opts.progress.as_deref());
    let sink = &mut sink;
    let (armed, reason) = choose(machine.memory(), sink.chunk_bytes(), opts)?;
    let mut tracker = match diff {
        Some(tracker) => Some(tracker),
        None if armed.is_none() || opts.keep_tracking => {
            Some(machine.start_tracking(match opts.mode {
                Some(mode) => mode,
                None => Mode::best()?,
            })?)
        }
        None => None,
    };
    let tracking = tracker.as_ref().map_or("none", |t| t.mode().name());
    let captured = match (armed, tracker.as_mut()) {
        (Some(armed), tracker) => {
            copy_before_write(machine, components, sink, tracker, full, armed, t)
        }
        (None, Some(tracker)) => rounds(machine, components, sink, tracker, full, opts, t),
        (None, None) => unreachable!("rounds always have a tracker"),
    };
    let kept = match (captured.is_ok() && opts.keep_tracking, tracker) {
        (true, tracker) => tracker,
        (false, Some(tracker)) => {
            let stopped = tracker.stop();
            if captured.is_ok() {
                stopped?;
            }
            None
        }
        (false, None) => None,
    };
    let (machine_state, states, mut report) = captured?;
    report.tracking = tracking;
    report.mode_reason = reason;
    Ok(Captured {
        machine: machine_state,
        components: states,
        report,
        tracker: kept,
    })
}

/// The strategy `opts` asks for, resolved: copy-before-write's registration (made now, before
/// the pause) or `None` for rounds, and why.
fn choose(
    memory: &Arc<GuestMemory>,
    chunk: u64,
    opts: &LiveOptions,
) -> Result<(Option<Armed>, String)> {
    let register = || Armed::register(memory, chunk, opts.held_bytes, tracked);
    Ok(match opts.strategy {
        Strategy::Rounds => (None, "asked for".into()),
        Strategy::CopyBeforeWrite => (Some(register()?), "asked for".into()),
        Strategy::Auto => match register() {
            Ok(armed) => (
                Some(armed),
                "automatic: userfaultfd write-protect takes every dirty-loggable region, so \
                 the pause does not grow with the guest's writes"
                    .into(),
            ),
            Err(e) => (
                None,
                format!(
                    "automatic: copy-before-write is not available ({}); dirty rounds instead, \
                     whose pause grows with the guest's dirty rate",
                    guestmem_sys::error_chain(&e, ": ")
                ),
            ),
        },
    })
}

/// Copy-before-write: the pages written while memory was being protected are protected again
/// before the pause, in rounds, until at most this many bytes of them are left for the pause
/// (protecting takes time in proportion to the bytes: this keeps the pause's share small, see
/// docs/benchmarks.md).
const REARM_BYTES: u64 = 8 << 20;
/// ... or until this many rounds were made (a guest that writes faster than protection goes).
const REARM_ROUNDS: u64 = 8;

/// What a copy-before-write pause took: the states, the chunks protected, the untracked
/// regions' chunks and their copies, and how long the protection took.
struct CbwPaused {
    machine: Vec<u8>,
    components: Vec<ComponentState>,
    todo: Vec<(usize, usize)>,
    untracked: Vec<(usize, usize)>,
    frozen: Frozen,
    rearm_bytes: u64,
    arm_ms: f64,
}

/// A live snapshot by copy-before-write (see [`crate::copy_before_write`]): the pause protects
/// the chunks to store (all, or a diff's dirty ones) and copies the untracked regions; then
/// the chunks are stored while the guest runs, each before its first write.
fn copy_before_write<M: Machine + ?Sized, S: LiveSink>(
    machine: &mut M,
    components: &mut Components<'_>,
    sink: &mut S,
    mut tracker: Option<&mut Tracker>,
    full: bool,
    armed: Armed,
    t: Instant,
) -> Result<Rounds> {
    let memory = machine.memory().clone();
    let chunk = sink.chunk_bytes();
    let arm = armed.pre_arm(REARM_BYTES, REARM_ROUNDS)?;
    // The tracker's harvest (a diff's chunks) and clear, the bulk of it before the pause;
    // the pause harvests what was written since.
    let dirty = match tracker.as_deref_mut() {
        Some(tracker) => {
            components.mark_dirty(&memory)?;
            harvest_and_clear(tracker)?
        }
        None => Vec::new(),
    };
    let p = Instant::now();
    machine.pause()?;
    let stop_ms = p.elapsed().as_secs_f64() * 1e3;
    let paused = components
        .pause()
        .map_err(Error::from)
        .and_then(|()| cbw_pause(machine, components, tracker, dirty, full, &armed, chunk));
    let r = Instant::now();
    let resumed = components.resume().and_then(|()| machine.resume());
    let (pause_ms, resume_ms) = (
        p.elapsed().as_secs_f64() * 1e3,
        r.elapsed().as_secs_f64() * 1e3,
    );
    let paused = paused?;
    resumed?;
    let r = Instant::now();
    let batch = sink.batch_chunks();
    let stats = armed.store(sink, &paused.todo, batch)?;
    let bytes = stats.bytes + sink.store(&memory, &paused.frozen, &paused.untracked, None)?;
    let report = LiveReport {
        pause_ms,
        total_ms: t.elapsed().as_secs_f64() * 1e3,
        tracking: "",
        rounds: vec![LiveRound {
            chunks: stats.chunks + paused.untracked.len() as u64,
            bytes,
            ms: r.elapsed().as_secs_f64() * 1e3,
            paused: true,
        }],
        paused_untracked_bytes: paused
            .untracked
            .iter()
            .map(|&(ri, ci)| chunk.min(memory.regions()[ri].size() - ci as u64 * chunk))
            .sum(),
        mode: Strategy::CopyBeforeWrite.name(),
        mode_reason: String::new(),
        stop_ms,
        resume_ms,
        pre_arm_ms: arm.pre_arm_ms,
        rearm_rounds: arm.rearm_rounds,
        paused_rearm_bytes: paused.rearm_bytes,
        arm_ms: paused.arm_ms,
        write_faults: stats.write_faults,
        copied_before_write_pages: stats.copied_pages,
        held_peak_bytes: stats.held_peak_bytes,
    };
    Ok((paused.machine, paused.components, report))
}

/// Copy-before-write's pause: the diff's last dirty pages harvested, the chunks to store
/// protected, the untracked regions copied, the states saved.
fn cbw_pause<M: Machine + ?Sized>(
    machine: &mut M,
    components: &mut Components<'_>,
    tracker: Option<&mut Tracker>,
    dirty: Vec<DirtyBitmap>,
    full: bool,
    armed: &Armed,
    chunk: u64,
) -> Result<CbwPaused> {
    let memory = machine.memory().clone();
    let dirty = match tracker {
        Some(tracker) => {
            components.mark_dirty(&memory)?;
            guestmem_tracking::merge(dirty, harvest_and_clear(tracker)?)
        }
        None => dirty,
    };
    let todo = match full {
        true => chunks_of(&memory, chunk, tracked),
        false => dirty_chunks(&memory, chunk, &dirty),
    };
    let a = Instant::now();
    let rearm_bytes = armed.protect(&todo)?;
    let arm_ms = a.elapsed().as_secs_f64() * 1e3;
    let untracked = chunks_of(&memory, chunk, |r| !tracked(r));
    let frozen = Frozen::copy(&memory, chunk, &untracked)?;
    let components_state = components.save()?;
    let machine_state = machine.save()?;
    Ok(CbwPaused {
        machine: machine_state,
        components: components_state,
        todo,
        untracked,
        frozen,
        rearm_bytes,
        arm_ms,
    })
}

type Rounds = (Vec<u8>, Vec<ComponentState>, LiveReport);

/// Milliseconds since `t`.
fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn rounds<M: Machine + ?Sized, S: LiveSink>(
    machine: &mut M,
    components: &mut Components<'_>,
    sink: &mut S,
    tracker: &mut Tracker,
    full: bool,
    opts: &LiveOptions,
    t: Instant,
) -> Result<Rounds> {
    let memory = machine.memory().clone();
    let chunk = sink.chunk_bytes();
    let mut report = LiveReport {
        pause_ms: 0.0,
        total_ms: 0.0,
        tracking: "",
        rounds: Vec::new(),
        paused_untracked_bytes: 0,
        mode: Strategy::Rounds.name(),
        mode_reason: String::new(),
        stop_ms: 0.0,
        resume_ms: 0.0,
        pre_arm_ms: 0.0,
        rearm_rounds: 0,
        paused_rearm_bytes: 0,
        arm_ms: 0.0,
        write_faults: 0,
        copied_before_write_pages: 0,
        held_peak_bytes: 0,
    };
    components.mark_dirty(&memory)?;
    let mut dirty = harvest_and_clear(tracker)?;
    // The first round: every tracked chunk (full), or what was written since the base (diff).
    let mut todo = if full {
        chunks_of(&memory, chunk, tracked)
    } else {
        dirty_chunks(&memory, chunk, &dirty)
    };
    let mut first = true;
    let mut last_left = u64::MAX;
    loop {
        let r = Instant::now();
        let bytes = sink.store(&memory, &*memory, &todo, (!first).then_some(&dirty[..]))?;
        report.rounds.push(LiveRound {
            chunks: todo.len() as u64,
            bytes,
            ms: r.elapsed().as_secs_f64() * 1e3,
            paused: false,
        });
        first = false;
        components.mark_dirty(&memory)?;
        dirty = harvest_and_clear(tracker)?;
        todo = dirty_chunks(&memory, chunk, &dirty);
        let dirty_bytes = dirty.iter().map(|d| d.count() * PAGE_SIZE).sum();
        let left = sink.cost(todo.len() as u64, dirty_bytes);
        let shrinking = left < last_left || report.rounds.len() < 2;
        if left <= opts.final_bytes || !shrinking || report.rounds.len() >= opts.max_rounds.max(1) {
            break;
        }
        last_left = left;
    }
    // The pause: the last dirty set and guest_memfd regions whole copied, the states saved;
    // the copies are stored once the guest runs again.
    let p = Instant::now();
    machine.pause()?;
    let stop_ms = p.elapsed().as_secs_f64() * 1e3;
    let paused = components
        .pause()
        .map_err(Error::from)
        .and_then(|()| paused_round(machine, components, tracker, dirty, todo, chunk));
    let r = Instant::now();
    let resumed = components.resume().and_then(|()| machine.resume());
    let (pause_ms, resume_ms) = (ms(p), ms(r));
    let Paused {
        machine: machine_state,
        components: states,
        frozen,
        dirty,
        todo,
        untracked,
    } = paused?;
    resumed?;
    let r = Instant::now();
    let mut bytes = sink.store(&memory, &frozen, &todo, Some(&dirty))?;
    bytes += sink.store(&memory, &frozen, &untracked, None)?;
    report.rounds.push(LiveRound {
        chunks: frozen.0.len() as u64,
        bytes,
        ms: r.elapsed().as_secs_f64() * 1e3,
        paused: true,
    });
    (report.pause_ms, report.stop_ms, report.resume_ms) = (pause_ms, stop_ms, resume_ms);
    report.paused_untracked_bytes = untracked
        .iter()
        .map(|&(ri, ci)| chunk.min(memory.regions()[ri].size() - ci as u64 * chunk))
        .sum();
    report.total_ms = t.elapsed().as_secs_f64() * 1e3;
    Ok((machine_state, states, report))
}

/// What the pause took: the states, the copies of the chunks left to store, the last dirty
/// set and which chunks it and the untracked regions have.
struct Paused {
    machine: Vec<u8>,
    components: Vec<ComponentState>,
    frozen: Frozen,
    dirty: Vec<DirtyBitmap>,
    todo: Vec<(usize, usize)>,
    untracked: Vec<(usize, usize)>,
}

/// The paused round: the pages dirtied since the last harvest (merged into `dirty`, whose
/// chunks `todo` are) and every chunk of the untracked regions copied, then the states saved.
fn paused_round<M: Machine + ?Sized>(
    machine: &mut M,
    components: &mut Components<'_>,
    tracker: &mut Tracker,
    dirty: Vec<DirtyBitmap>,
    todo: Vec<(usize, usize)>,
    chunk: u64,
) -> Result<Paused> {
    let memory = machine.memory().clone();
    components.mark_dirty(&memory)?;
    let dirty = guestmem_tracking::merge(dirty, harvest_and_clear(tracker)?);
    let mut todo = todo;
    todo.extend(dirty_chunks(&memory, chunk, &dirty));
    todo.sort_unstable();
    todo.dedup();
    let untracked = chunks_of(&memory, chunk, |r| !tracked(r));
    let all: Vec<(usize, usize)> = todo.iter().chain(&untracked).copied().collect();
    let frozen = Frozen::copy(&memory, chunk, &all)?;
    let components_state = components.save()?;
    let machine_state = machine.save()?;
    Ok(Paused {
        machine: machine_state,
        components: components_state,
        frozen,
        dirty,
        todo,
        untracked,
    })
}

/// A harvest, its pages cleared at once (manual mode: logged again from now on), so that the
/// stores that follow read the pages after their clear. Only the runs of 64-page words that
/// hold dirty pages are cleared.
fn harvest_and_clear(tracker: &mut Tracker) -> Result<Vec<DirtyBitmap>> {
    let dirty = tracker.harvest()?;
    for d in &dirty {
        let mut w = 0;
        while w < d.bits.len() {
            if d.bits[w] == 0 {
                w += 1;
                continue;
            }
            let start = w;
            while w < d.bits.len() && d.bits[w] != 0 {
                w += 1;
            }
            let first = start as u64 * 64;
            tracker.clear(d, first, (w as u64 * 64).min(d.pages) - first)?;
        }
    }
    Ok(dirty)
}

/// Every chunk of the regions `pick` selects.
fn chunks_of(
    memory: &GuestMemory,
    chunk: u64,
    pick: impl Fn(&guestmem_memory::Region) -> bool,
) -> Vec<(usize, usize)> {
    let mut all = Vec::new();
    for (ri, region) in memory.regions().iter().enumerate() {
        if pick(region) {
            all.extend((0..to_usize(region.size().div_ceil(chunk))).map(|i| (ri, i)));
        }
    }
    all
}

/// The chunks holding a page that `dirty` reports, in order.
pub fn dirty_chunks(
    memory: &GuestMemory,
    chunk: u64,
    dirty: &[DirtyBitmap],
) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    for (ri, region) in memory.regions().iter().enumerate() {
        for d in dirty.iter().filter(|d| d.gpa == region.gpa()) {
            for (gpa, len) in d.ranges() {
                let first = (gpa - region.gpa()) / chunk;
                let last = (gpa - region.gpa() + len - 1) / chunk;
                for i in first..=last {
                    if out.last() != Some(&(ri, to_usize(i))) {
                        out.push((ri, to_usize(i)));
                    }
                }
            }
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// Whether `dirty` reports the page at `gpa`.
pub fn page_dirty(dirty: &[DirtyBitmap], gpa: u64) -> bool {
    dirty.iter().any(|d| d.contains(gpa))
}

/// A flat snapshot directory being written live: its staging directory's files and what each
/// chunk holds so far.
struct FlatSink {
    /// `memory` and `sys`, indexed by `RegionFile as usize`, with their paths.
    files: [(File, PathBuf); 2],
    /// Per region: its file, its offset there, and each chunk's state (`None`: not stored).
    regions: Vec<(RegionFile, u64, Vec<Option<ChunkNow>>)>,
    buf: PageBuf,
}

/// What a stored chunk holds now.
#[derive(Clone, Copy)]
struct ChunkNow {
    crc32: u32,
    zero: bool,
    /// Bytes of its non-zero pages.
    data: u64,
}

impl FlatSink {
    fn create(memory: &GuestMemory, dir: &Path) -> Result<FlatSink> {
        let create = |f: RegionFile| {
            let path = dir.join(f.name());
            // Read too: the region digests are computed from what was written.
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(&path)
                .map(|file| (file, path.clone()))
                .map_err(Error::io(&path, "create"))
        };
        let files = [create(RegionFile::Memory)?, create(RegionFile::Sys)?];
        let mut ends = [0u64; 2];
        let regions = memory
            .regions()
            .iter()
            .map(|region| {
                let which = RegionFile::for_region(region.spec());
                let offset = ends[which as usize];
                ends[which as usize] += region.size();
                let n = to_usize(region.size().div_ceil(CHUNK_BYTES));
                (which, offset, vec![None; n])
            })
            .collect();
        for ((file, path), end) in files.iter().zip(ends) {
            file.set_len(end).map_err(Error::io(path, "set length"))?;
        }
        Ok(FlatSink {
            files,
            regions,
            buf: PageBuf::zeroed(to_usize(CHUNK_BYTES)),
        })
    }

    /// Stores one chunk: all of it the first time, else its pages `dirty` reports (zero pages
    /// as holes punched, the others written). Returns the bytes written.
    fn store_one(
        &mut self,
        memory: &GuestMemory,
        source: &dyn ChunkSource,
        ri: usize,
        ci: usize,
        dirty: Option<&[DirtyBitmap]>,
    ) -> Result<u64> {
        let region = &memory.regions()[ri];
        let offset = ci as u64 * CHUNK_BYTES;
        let len = to_usize(CHUNK_BYTES.min(region.size() - offset));
        let gpa = region.gpa() + offset;
        let bytes = &mut self.buf[..len];
        source.read(ri, ci, gpa, bytes)?;
        let (which, file_offset, chunks) = &mut self.regions[ri];
        let (file, path) = &self.files[*which as usize];
        let fresh = chunks[ci].is_none();
        let page = to_usize(PAGE_SIZE);
        let update =
            |p: usize| fresh || dirty.is_none_or(|d| page_dirty(d, gpa + (p * page) as u64));
        let at = *file_offset + offset;
        let (mut written, mut data) = (0u64, 0u64);
        let pages = len / page;
        let mut p = 0;
        while p < pages {
            let zero = is_zero(&bytes[p * page..(p + 1) * page]);
            data += if zero { 0 } else { page as u64 };
            if !update(p) {
                p += 1;
                continue;
            }
            let start = p;
            p += 1;
            while p < pages && update(p) && is_zero(&bytes[p * page..(p + 1) * page]) == zero {
                data += if zero { 0 } else { page as u64 };
                p += 1;
            }
            let run = start * page..p * page;
            if !zero {
                file.write_all_at(&bytes[run.clone()], at + run.start as u64)
                    .map_err(Error::io(path, "write"))?;
                written += run.len() as u64;
            } else if !fresh {
                punch_hole(file, at + run.start as u64, run.len() as u64)
                    .map_err(Error::io(path, "punch a hole"))?;
            }
        }
        chunks[ci] = Some(ChunkNow {
            crc32: crc32fast::hash(bytes),
            zero: data == 0,
            data,
        });
        Ok(written)
    }
}

impl LiveSink for FlatSink {
    fn chunk_bytes(&self) -> u64 {
        CHUNK_BYTES
    }

    fn store(
        &mut self,
        memory: &GuestMemory,
        source: &dyn ChunkSource,
        chunks: &[(usize, usize)],
        dirty: Option<&[DirtyBitmap]>,
    ) -> Result<u64> {
        let mut written = 0;
        for &(ri, ci) in chunks {
            written += self.store_one(memory, source, ri, ci, dirty)?;
        }
        Ok(written)
    }
}

/// Zeroes `len` bytes of `file` at `at` for good (a hole, as a paused write leaves zero pages).
fn punch_hole(file: &File, at: u64, len: u64) -> std::io::Result<()> {
    guestmem_sys::punch_hole(file.as_fd(), at, len)
}

/// What [`write_machine_live`] did.
#[derive(Debug)]
pub struct LiveWrite {
    /// The snapshot as written (what a paused write reports).
    pub report: WriteReport,
    /// The rounds and the pause.
    pub live: LiveReport,
    /// With [`LiveOptions::keep_tracking`]: the tracker, reporting writes since the pause.
    pub tracker: Option<Tracker>,
}

/// A live diff's base: the flat snapshot it is written over, and the tracker started when that
/// snapshot was taken (bitmap or ring mode: it must report only what was written since).
#[derive(Debug)]
pub struct LiveBase<'a> {
    /// The base snapshot's directory.
    pub dir: &'a Path,
    /// Its tracker.
    pub tracker: Tracker,
}

/// Writes a snapshot of the running `machine` and its `components` into `dir` while they run
/// (see the module docs); they run again on return, error or not. A snapshot already in `dir`
/// is replaced atomically only when the new one is complete, as [`super::write()`] does; a
/// failed write leaves it intact. With `base`, a diff over it that stores only the chunks
/// written since it was taken.
pub fn write_machine_live<M: Machine + ?Sized>(
    machine: &mut M,
    components: &mut Components<'_>,
    dir: &Path,
    base: Option<LiveBase<'_>>,
    opts: &LiveOptions,
) -> Result<LiveWrite> {
    let t = Instant::now();
    let resolved = std::fs::canonicalize(dir).ok();
    let dir = resolved.as_deref().unwrap_or(dir);
    check_replaceable(dir)?;
    let (base_ref, tracker) = match base {
        None => (None, None),
        Some(b) => (
            Some((
                super::write::base_ref(machine.config(), dir, b.dir)?,
                Snapshot::open(b.dir)?,
            )),
            Some(b.tracker),
        ),
    };
    let staging = staging_dir(dir)?;
    std::fs::create_dir(&staging).map_err(Error::io(&staging, "create directory"))?;
    let written = (|| {
        let mut sink = FlatSink::create(machine.memory(), &staging)?;
        let captured = capture(machine, components, &mut sink, tracker, opts)?;
        let written = finish(
            machine,
            &sink,
            &staging,
            captured.machine,
            &captured.components,
            base_ref,
        )
        .and_then(|report| {
            sync_dir(&staging)?;
            commit(&staging, dir)?;
            Ok(report)
        });
        let report = match written {
            Ok(report) => report,
            Err(e) => {
                if let Some(tracker) = captured.tracker {
                    let _ = tracker.stop();
                }
                return Err(e);
            }
        };
        let mut live = captured.report;
        live.total_ms = t.elapsed().as_secs_f64() * 1e3;
        Ok(LiveWrite {
            report,
            live,
            tracker: captured.tracker,
        })
    })();
    if written.is_err() {
        // Nothing of the failed write stays; the previous snapshot (if any) is untouched.
        let _ = std::fs::remove_dir_all(&staging);
    }
    written
}

/// Writes the state and manifest of a live snapshot whose memory `sink` holds, the region
/// digests computed from the files written (the guest's memory at the pause; the guest has
/// moved on since).
fn finish<M: Machine + ?Sized>(
    machine: &M,
    sink: &FlatSink,
    dir: &Path,
    machine_state: Vec<u8>,
    components: &[ComponentState],
    base: Option<(BaseRef, Snapshot)>,
) -> Result<WriteReport> {
    let state_json = write_state(dir, machine_state, components)?;
    let mut report = WriteReport {
        memory_bytes: 0,
        data_bytes: 0,
        zero_chunks: 0,
        chunks: 0,
    };
    let mut regions = Vec::new();
    let mut ends = [0u64; 2];
    for (region, (which, file_offset, chunks)) in
        machine.memory().regions().iter().zip(&sink.regions)
    {
        let (file, path) = &sink.files[*which as usize];
        let chunks: Vec<Chunk> = chunks
            .iter()
            .map(|c| match c {
                None => Chunk {
                    crc32: 0,
                    zero: false,
                    inherited: true,
                },
                Some(c) => {
                    report.data_bytes += c.data;
                    report.zero_chunks += u64::from(c.zero);
                    Chunk {
                        crc32: c.crc32,
                        zero: c.zero,
                        inherited: false,
                    }
                }
            })
            .collect();
        report.chunks += chunks.len() as u64;
        report.memory_bytes += region.size();
        ends[*which as usize] = ends[*which as usize].max(file_offset + region.size());
        regions.push(RegionImage {
            spec: region.spec().clone(),
            file: *which,
            file_offset: *file_offset,
            digest: region_digest(
                file,
                path,
                *file_offset,
                region.size(),
                regions.len(),
                &chunks,
                base.as_ref().map(|(_, b)| b),
            )?,
            chunks,
        });
    }
    for (file, path) in &sink.files {
        file.sync_all().map_err(Error::io(path, "sync"))?;
    }
    let manifest = Manifest {
        format: FORMAT.into(),
        version: VERSION,
        config: machine.config().clone(),
        regions,
        chunk_bytes: CHUNK_BYTES,
        state_bytes: state_json.len() as u64,
        state_blake3: blake3::hash(&state_json).to_hex().to_string(),
        memory_file_bytes: ends[RegionFile::Memory as usize],
        sys_file_bytes: ends[RegionFile::Sys as usize],
        base: base.map(|(r, _)| r),
        writer: Some(guestmem_sys::release::Writer::this()),
        checksum: String::new(),
    };
    write_manifest(dir, manifest)?;
    Ok(report)
}

/// `GuestMemory::digest` of region `ri`, `len` bytes, as the snapshot holds it: its stored
/// chunks from `file` at `at` (the bytes stored: the guest's memory at the pause; the guest has
/// moved on since), its inherited ones from the diff's `base`.
fn region_digest(
    file: &File,
    path: &Path,
    at: u64,
    len: u64,
    ri: usize,
    chunks: &[Chunk],
    base: Option<&Snapshot>,
) -> Result<u64> {
    let mut buf = vec![0u8; to_usize(CHUNK_BYTES)];
    let mut h = DIGEST_SEED;
    for (ci, c) in chunks.iter().enumerate() {
        let offset = ci as u64 * CHUNK_BYTES;
        let n = to_usize(CHUNK_BYTES.min(len - offset));
        let bytes = &mut buf[..n];
        match (c.inherited, base) {
            (false, _) => file
                .read_exact_at(bytes, at + offset)
                .map_err(Error::io(path, "read back"))?,
            (true, Some(base)) => {
                bytes.fill(0);
                base.chunk(ri, ci, bytes)?;
            }
            (true, None) => {
                return Err(Error::Write(format!(
                    "{}: chunk {ci} was never stored",
                    path.display()
                )))
            }
        }
        h = digest_bytes(h, bytes);
    }
    Ok(h)
}

#[cfg(test)]
mod tests {
    use super::*;
    use guestmem_memory::{Backend, RegionSpec};

    const SIZE: u64 = 2 * CHUNK_BYTES;

    fn memory() -> GuestMemory {
        GuestMemory::new(&[RegionSpec::new("ram", 0, SIZE, Backend::Anon)], None).unwrap()
    }

    fn bitmap(pages: &[u64]) -> Vec<DirtyBitmap> {
        let mut bits = vec![0u64; (SIZE / PAGE_SIZE / 64) as usize];
        for p in pages {
            bits[(p / 64) as usize] |= 1 << (p % 64);
        }
        vec![DirtyBitmap {
            slot: 0,
            gpa: 0,
            pages: SIZE / PAGE_SIZE,
            bits,
        }]
    }

    #[test]
    fn dirty_pages_name_their_chunks_once_in_order() {
        let m = memory();
        let per_chunk = CHUNK_BYTES / PAGE_SIZE;
        let dirty = bitmap(&[per_chunk + 3, 0, 1, per_chunk + 4]);
        assert_eq!(dirty_chunks(&m, CHUNK_BYTES, &dirty), vec![(0, 0), (0, 1)]);
        assert!(dirty_chunks(&m, CHUNK_BYTES, &bitmap(&[])).is_empty());
        assert_eq!(
            dirty_chunks(&m, CHUNK_BYTES, &bitmap(&[per_chunk])),
            vec![(0, 1)]
        );
    }

    /// A chunk stored again gets only its dirty pages written: a page zeroed since is a hole
    /// again, a page changed since holds its new bytes, and the checksum is the new chunk's.
    #[test]
    fn a_chunk_stored_again_updates_its_dirty_pages_only() {
        let m = memory();
        let dir = std::env::temp_dir().join(format!("guestmem-live-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut sink = FlatSink::create(&m, &dir).unwrap();
        m.write(0, &[1u8; 2 * to_usize(PAGE_SIZE)]).unwrap();
        m.write(5 * PAGE_SIZE, &[2u8; to_usize(PAGE_SIZE)]).unwrap();
        sink.store(&m, &m, &[(0, 0)], None).unwrap();
        // Page 0 zeroed, page 5 changed, page 1 changed but not reported dirty.
        m.write(0, &[0u8; to_usize(PAGE_SIZE)]).unwrap();
        m.write(5 * PAGE_SIZE, &[3u8; to_usize(PAGE_SIZE)]).unwrap();
        m.write(PAGE_SIZE, &[9u8; to_usize(PAGE_SIZE)]).unwrap();
        let written = sink
            .store(&m, &m, &[(0, 0)], Some(&bitmap(&[0, 5])))
            .unwrap();
        assert_eq!(written, PAGE_SIZE, "only page 5 written, page 0 punched");
        let file = std::fs::read(dir.join("memory")).unwrap();
        let page = |p: usize| &file[p * to_usize(PAGE_SIZE)..(p + 1) * to_usize(PAGE_SIZE)];
        assert!(page(0).iter().all(|&b| b == 0));
        assert!(
            page(1).iter().all(|&b| b == 1),
            "an unreported page is left alone"
        );
        assert!(page(5).iter().all(|&b| b == 3));
        let mut chunk = vec![0u8; to_usize(CHUNK_BYTES)];
        GuestMemory::read(&m, 0, &mut chunk).unwrap();
        let now = sink.regions[0].2[0].unwrap();
        assert_eq!(now.crc32, crc32fast::hash(&chunk));
        assert_eq!(now.data, 2 * PAGE_SIZE);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
