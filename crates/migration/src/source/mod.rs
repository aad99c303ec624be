//! The source side of a live migration (see [`crate::migrate`] for the protocol): the
//! driver ([`send_machine`]) with its rounds and switch-over; its options and reports
//! ([`options`]), the threads that write the rounds ([`writers`]) and the post-copy servers
//! ([`postcopy`]).

mod options;
mod order;
mod postcopy;
mod progress;
mod writers;

use guestmem_sys::to_usize;
pub use options::*;
use postcopy::PostcopyServers;
use writers::{DeltaUse, Job, Joined, Writers};

use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use guestmem_memory::{GuestMemory, Region, PAGE_SIZE};
use guestmem_paging::affinity::CpuSet;
use guestmem_tracking::{full_bitmaps, merge, DirtyBitmap, Tracker};
use guestmem_vm::{layout, RunningVm, VmConfig};

use crate::chunk_digests::{self, ChunkDigests, DIGEST_CHUNK};
use crate::component::{Components, Machine};
use crate::compress::{CompressionReport, Compressor};
use crate::delta::{DeltaCache, DeltaReport};
use crate::protocol::{
    block_connection, link_error, read_frame, unexpected_frame, write_frame, Links, Mode, Setup,
    StaleChunks, Switchover, BLOCK, POSTCOPY_CHUNK,
};
use crate::stream::{Frame, ZstdStream};
use crate::transport::Connection;
use crate::{Error, MigrationError, Peer, Result};
use guestmem_contract::PayloadVm;
use guestmem_events::{Operation, Reporter, Status};

/// Pre-copy goes on below the downtime target while rounds keep halving the dirty set, until
/// the estimate is this fraction of the target (50 ms: about 1.6 ms).
const SETTLE_FRACTION: f64 = 32.0;

/// Migrates the running VM over `links` (see [`Links::connect`]): guestmem's own VM and
/// payload, with no other components ([`send_machine`] with a [`PayloadVm`]).
pub fn send<'a>(
    running: RunningVm<'a>,
    links: Links,
    opts: &SendOptions,
) -> std::result::Result<Report, Box<Failure<'a>>> {
    let mut machine = PayloadVm::running(running);
    send_machine(&mut machine, &mut Components::none(), links, opts).map_err(|e| {
        Box::new(Failure {
            error: e.error,
            vm: machine.into_running(),
        })
    })
}

/// A migration of a [`Machine`] that failed: `kept` when the source kept the guest (any
/// failure before Go: the machine and its components were resumed), else the destination owns
/// it (the source's machine and components stay paused).
#[derive(Debug)]
pub struct MachineFailure {
    /// Why it failed.
    pub error: Error,
    /// Whether the source still runs the guest.
    pub kept: bool,
}

/// Migrates a running `machine` and its `components` over `links`: the driver of a live
/// migration (pre-copy, post-copy or hybrid, as `opts.mode` says). The components' writes to
/// guest memory are tracked as the guest's ([`Component::dirty_log`] is merged before each
/// harvest); at switch-over they are paused with the vCPUs, before the last harvest, and their
/// states travel in the State frame with the machine's. Any failure before Go resumes both.
///
/// [`Component::dirty_log`]: crate::component::Component::dirty_log
pub fn send_machine(
    machine: &mut dyn Machine,
    components: &mut Components<'_>,
    links: Links,
    opts: &SendOptions,
) -> std::result::Result<Report, MachineFailure> {
    let reporter = Reporter::maybe(opts.events.as_ref(), Operation::MigrateSend);
    let result = send_reported(machine, components, links, opts, reporter.clone());
    progress::finish(reporter.as_deref(), &result);
    result
}

/// [`send_machine`], its progress told to `reporter`.
fn send_reported(
    machine: &mut dyn Machine,
    components: &mut Components<'_>,
    mut links: Links,
    opts: &SendOptions,
    reporter: Option<Arc<Reporter>>,
) -> std::result::Result<Report, MachineFailure> {
    let started = Instant::now();
    let kept = |error| MachineFailure { error, kept: true };
    // Nothing the destination did not accept in the Hellos goes out (see crate::negotiate).
    let fitted = opts.fitted_to(&links.negotiated).map_err(kept)?;
    let opts = &fitted;
    let memory = machine.memory().clone();
    let mut source = Source::new(&memory, opts, &links, started);
    source.reporter = reporter;
    source.emit(Status::Setup);
    opts.check(links.pages.len()).map_err(kept)?;
    let fault_cpus = fault_cpus(opts).map_err(kept)?;
    let mut tracker = None;
    let pending = match source.run_precopy(machine, components, &mut tracker, &mut links) {
        Ok(p) => p,
        Err(error) => {
            let _ = machine.set_throttle(0);
            stop_tracking(tracker);
            return Err(kept(error));
        }
    };
    let servers = match source.spawn_servers(&mut links, fault_cpus) {
        Ok(servers) => servers,
        Err(error) => {
            stop_tracking(tracker);
            return Err(kept(error));
        }
    };
    source.switch_over_or_resume(machine, components, &mut tracker, pending, &mut links)?;

    // After Go: the destination runs the guest; serve post-copy, then the Complete. Dirty
    // logging is switched off only then: it takes milliseconds (a memslot update per region)
    // that the destination's first faults would otherwise wait for.
    let done = if let Some(servers) = servers {
        source.serve_postcopy(links, servers)
    } else {
        match read_frame(&mut links.pages[0]) {
            Ok(Frame::Complete { report_json }) => Ok(report_json),
            Ok(other) => Err(unexpected(&other, "Complete")),
            Err(e) => Err(e),
        }
    };
    stop_tracking(tracker);
    match done {
        Ok(report_json) => Ok(source.finish_with(&report_json)),
        Err(error) => Err(MachineFailure { error, kept: false }),
    }
}

/// The fault CPUs asked for, checked.
fn fault_cpus(opts: &SendOptions) -> Result<Option<CpuSet>> {
    opts.fault_cpus
        .as_deref()
        .map(CpuSet::new)
        .transpose()
        .map_err(|e| {
            MigrationError::BadOption {
                option: "fault_cpus",
                reason: format!("fault CPUs: {e}"),
            }
            .into()
        })
}

/// The paused `machine`'s state as protocol `protocol` carries it: protocol 1 (guestmem 0.1.0)
/// takes it bare, out of its versioned envelope, and knows only guestmem's own VM (a Linux
/// guest's state is refused naming its kind).
fn machine_state(machine: &mut dyn Machine, protocol: u32) -> Result<Vec<u8>> {
    let state = machine.save()?;
    if protocol <= 1 {
        let payload = guestmem_contract::PAYLOAD_STATE.name;
        match guestmem_contract::envelope::kind_of(&state) {
            Some(kind) if kind != payload => {
                return Err(guestmem_contract::Error::StateKind {
                    found: kind,
                    expected: payload,
                }
                .into())
            }
            _ => {}
        }
        return Ok(guestmem_contract::envelope::bare_v1(&state)?);
    }
    Ok(state)
}

/// Stops dirty logging, if it was started (its failure changes nothing then).
fn stop_tracking(tracker: Option<Tracker>) {
    if let Some(t) = tracker {
        let _ = t.stop();
    }
}

fn unexpected(frame: &Frame, wanted: &'static str) -> Error {
    unexpected_frame(Peer::Destination, frame, wanted)
}

struct Source<'o> {
    memory: Arc<GuestMemory>,
    opts: &'o SendOptions,
    started: Instant,
    tracking: String,
    committed: bool,
    /// Guest addresses of the regions handed over (never sent).
    shared: Vec<u64>,
    report: Report,
    /// Bytes queued to the writers (for the bandwidth limit).
    queued: u64,
    send_started: Instant,
    compressor: Arc<Compressor>,
    /// `verify`: the digest of each chunk of the regions that travel, taken by the writers
    /// after each block they send, and marked stale by every harvest of the dirty log.
    chunks: Option<Arc<ChunkDigests>>,
    /// Time the busiest writer spent hashing chunks in the last round sent.
    round_digest: Duration,
    /// Pre-copy with delta encoding: the last versions sent.
    delta: Option<Arc<DeltaCache>>,
    /// Each pages connection's zstd stream during pre-copy (see
    /// [`SendOptions::zstd_window_bytes`]); empty without (and once the rounds are over).
    zstd_streams: Vec<Option<ZstdStream>>,
    /// The streams' window (log2 of bytes), announced in the setup.
    zstd_window_log: Option<u32>,
    /// Where the progress records go, if anywhere ([`SendOptions::events`]).
    reporter: Option<Arc<Reporter>>,
    /// What the records carry between rounds.
    seen: progress::Seen,
}

/// Pages dirtied and not sent yet when the guest stopped.
type Pending = Vec<DirtyBitmap>;

/// A round being queued to the writers, and what it counted so far.
struct RoundQueue {
    writers: Writers,
    round: u32,
    /// Pages in the round.
    total: u64,
    /// The delta cache's size in pages (0: none).
    cache_pages: u64,
    /// Pages queued, of them zero pages, and bytes of pages queued.
    pages: u64,
    zero_pages: u64,
    bytes: u64,
}

impl RoundQueue {
    /// What the next run does with the delta cache. Round 1 fills the cache with the last
    /// pages it sends only (the others would be evicted before the round ends); later rounds
    /// look every page up.
    fn delta_use(&self) -> DeltaUse {
        delta_use(self.round, self.cache_pages, self.total, self.pages)
    }
}

/// The blocks of `dirty` with a dirty page, in memory order: (bitmap index, first page,
/// pages), each [`BLOCK`] long but a slot's last.
fn dirty_blocks(dirty: &[DirtyBitmap]) -> Vec<(usize, u64, u64)> {
    let block_pages = BLOCK / PAGE_SIZE;
    let mut blocks = Vec::new();
    for (i, b) in dirty.iter().enumerate() {
        for first in (0..b.pages).step_by(to_usize(block_pages)) {
            let count = block_pages.min(b.pages - first);
            let words = &b.bits[to_usize(first / 64)..to_usize((first + count).div_ceil(64))];
            if words.iter().any(|&w| w != 0) {
                blocks.push((i, first, count));
            }
        }
    }
    blocks
}

/// What a run does with a delta cache of `cache_pages` in round `round` of `total` pages,
/// `queued` of them queued before it (see [`RoundQueue::delta_use`]).
fn delta_use(round: u32, cache_pages: u64, total: u64, queued: u64) -> DeltaUse {
    match (cache_pages, round) {
        (0, _) => DeltaUse::Off,
        (_, 1) if queued + cache_pages < total => DeltaUse::Off,
        (_, 1) => DeltaUse::Admit,
        _ => DeltaUse::Try,
    }
}

impl<'o> Source<'o> {
    fn new(
        memory: &Arc<GuestMemory>,
        opts: &'o SendOptions,
        links: &Links,
        started: Instant,
    ) -> Self {
        let guest_bytes: u64 = memory.regions().iter().map(|r| r.size()).sum();
        // By default the cache and the writers' page buffers share the percentage.
        let delta_bytes = opts.delta_cache_bytes.unwrap_or(
            (guest_bytes / 100 * DEFAULT_DELTA_CACHE_PERCENT)
                .saturating_sub(links.pages.len() as u64 * BLOCK),
        );
        let delta = (opts.mode == Mode::Precopy && !opts.whole_pages && delta_bytes > 0)
            .then(|| DeltaCache::new(delta_bytes, links.pages.len(), BLOCK))
            .filter(|c| c.pages() > 0)
            .map(Arc::new);
        Source {
            memory: memory.clone(),
            opts,
            started,
            tracking: "none".into(),
            committed: false,
            shared: Vec::new(),
            queued: 0,
            send_started: Instant::now(),
            compressor: Arc::new(Compressor::new(opts.compress)),
            chunks: None,
            round_digest: Duration::ZERO,
            delta,
            zstd_streams: Vec::new(),
            zstd_window_log: opts.zstd_window_log(links.pages.len(), guest_bytes),
            reporter: None,
            seen: progress::Seen {
                remaining: guest_bytes,
                ..Default::default()
            },
            report: Report {
                mode: opts.mode,
                guest_bytes,
                connections: links.pages.len(),
                tracking: String::new(),
                total_ms: 0.0,
                downtime_ms: 0.0,
                downtime_target_ms: opts.downtime.as_secs_f64() * 1e3,
                verify_ms: 0.0,
                digest: None,
                converged: false,
                max_throttle_percent: 0,
                bytes: 0,
                wire_bytes: 0,
                pages_sent: 0,
                zero_pages_skipped: 0,
                shared_bytes: 0,
                rounds: Vec::new(),
                postcopy_requests: 0,
                postcopy_bytes: 0,
                postcopy_ms: 0.0,
                link_breaks: 0,
                source_extra_bytes: 0,
                zstd_window_bytes: 0,
                zstd_stream_bytes: 0,
                destination: None,
                compression: CompressionReport::default(),
                delta: DeltaReport::default(),
                negotiated: links.negotiated.clone(),
            },
        }
    }

    /// Writer threads for round `round` (`last`: the one with the guest stopped), on the pages
    /// connections of `links` (taken out until they are joined).
    fn writers(&mut self, links: &mut Links, round: u32, last: bool) -> Writers {
        Writers::spawn(
            std::mem::take(&mut links.pages),
            std::mem::take(&mut self.zstd_streams),
            &self.memory,
            self.opts.whole_pages,
            self.compressor.clone(),
            self.chunks.clone(),
            self.delta.clone(),
            (round, last),
        )
    }

    fn ms(&self) -> f64 {
        self.started.elapsed().as_secs_f64() * 1e3
    }

    fn handshake(&mut self, links: &mut Links, config: &VmConfig) -> Result<()> {
        if self.opts.mode != links.mode {
            return Err(MigrationError::BadOption {
                option: "mode",
                reason: format!(
                    "the links were opened for {}, the migration is {}: connect with \
                     Links::connect(.., Mode::{:?}, ..)",
                    links.mode, self.opts.mode, self.opts.mode
                ),
            }
            .into());
        }
        let shared: Vec<&Region> = if self.opts.share_memory {
            if !links.pages[0].is_local() {
                return Err(MigrationError::BadOption {
                    option: "share_memory",
                    reason: "sharing memory needs the destination on this host: a unix: endpoint"
                        .into(),
                }
                .into());
            }
            self.memory
                .regions()
                .iter()
                .filter(|r| shareable(r))
                .map(|r| &**r)
                .collect()
        } else {
            Vec::new()
        };
        self.shared = shared.iter().map(|r| r.gpa()).collect();
        self.report.shared_bytes = shared.iter().map(|r| r.size()).sum();
        // Shared regions are the destination's memory too: there is nothing to compare.
        self.chunks = self.verifies().then(|| {
            Arc::new(ChunkDigests::new(
                self.memory
                    .regions()
                    .iter()
                    .filter(|r| !self.shared.contains(&r.gpa()))
                    .map(|r| (r.gpa(), r.size())),
                DIGEST_CHUNK,
            ))
        });
        let setup = Setup {
            config: config.clone(),
            mode: self.opts.mode,
            format: links.negotiated.state_format(),
            shared: shared.iter().map(|r| r.name().to_string()).collect(),
            verify: self.verifies(),
            verify_chunk: self.chunks.as_ref().map(|c| c.chunk()),
            zstd_window_log: self.zstd_window_log,
        };
        if let Some(log) = self.zstd_window_log {
            self.zstd_streams = (0..links.pages.len())
                .map(|_| ZstdStream::new(crate::compress::ZSTD_LEVEL, log).map(Some))
                .collect::<std::result::Result<_, _>>()
                .map_err(Error::Stream)?;
            self.report.zstd_window_bytes = 1 << log;
        }
        let json = serde_json::to_vec(&setup).expect("a setup serializes");
        write_frame(&mut links.pages[0], &Frame::Hello { config_json: json })?;
        if !shared.is_empty() {
            match read_frame(&mut links.pages[0])? {
                Frame::Ready => {}
                other => return Err(unexpected(&other, "Ready for the memory files")),
            }
            let fds: Vec<_> = shared
                .iter()
                .map(|r| r.fd().expect("shareable regions have a file").as_raw_fd())
                .collect();
            links.pages[0]
                .send_fds(&fds)
                .map_err(|e| link_error("handing over the memory files", e))?;
        }
        match read_frame(&mut links.pages[0])? {
            Frame::Hello { .. } => Ok(()),
            other => Err(unexpected(&other, "Hello")),
        }
    }

    /// Rounds while the guest runs, until the estimated downtime fits (or the round limit, or
    /// one round for hybrid). Returns the pages dirtied since the last round.
    fn precopy(
        &mut self,
        machine: &mut dyn Machine,
        components: &mut Components<'_>,
        tracker: &mut Tracker,
        links: &mut Links,
    ) -> Result<Pending> {
        // Manual mode reports every page at its first harvest; the others only what was
        // written since the start, so the first round adds every page itself.
        // guest_memfd regions cannot be tracked: they go whole at switch-over.
        components.mark_dirty(&self.memory)?;
        let mut dirty = merge(
            tracker.harvest()?,
            full_bitmaps(&self.memory, guestmem_tracking::tracked),
        );
        dirty.retain(|b| tracked_gpa(&self.memory, b.gpa) && !self.shared.contains(&b.gpa));
        let mut round = 1;
        let mut strikes = 0;
        loop {
            let writers = self.writers(links, round, false);
            let sent = self.send_round(&mut Some(&mut *tracker), &dirty, round, writers, false);
            let (conns, stats) = sent?;
            links.pages = conns;
            components.mark_dirty(&self.memory)?;
            dirty = tracker.harvest()?;
            // A page the log reports may have been written after its chunk was hashed: the
            // chunk is hashed again once its block is sent next (see chunk_digests).
            if let Some(chunks) = &self.chunks {
                chunks.mark_dirty(&dirty);
            }
            dirty.retain(|b| tracked_gpa(&self.memory, b.gpa) && !self.shared.contains(&b.gpa));
            let n: u64 = dirty
                .iter()
                .map(guestmem_tracking::DirtyBitmap::count)
                .sum();
            let mut stats = stats;
            stats.dirty_pages_after = n;
            stats.throttle_percent = machine.throttle();
            // Time per page of this round, pages to go: the downtime if we stopped now.
            let est = n as f64 * stats.ms / stats.pages.max(1) as f64;
            self.round_ends(n, stats.ms, est, machine.throttle());
            tracing::info!(
                round,
                pages = stats.pages,
                dirty_after = n,
                est_ms = est,
                "pre-copy round"
            );
            let forced = round >= self.opts.max_rounds;
            let target_ms = self.opts.downtime.as_secs_f64() * 1e3;
            let fits = est <= target_ms;
            let shrinking = n * 2 <= stats.pages;
            if shrinking {
                strikes = 0;
            } else {
                strikes += 1;
            }
            // Once it fits, one more round is still worth it while each round halves what is
            // left: the round takes about the time it saves, but with the guest running, and
            // the downtime comes down to the fixed hand-over (pausing, state, Ready and Go).
            let settled = fits && (!shrinking || est <= target_ms / SETTLE_FRACTION);
            self.report.rounds.push(stats);
            if self.opts.mode == Mode::Hybrid || settled || forced {
                self.report.converged = fits;
                return Ok(dirty);
            }
            if self.opts.auto_converge && strikes >= 2 {
                let t = machine.throttle();
                let next = if t == 0 { 20 } else { (t + 10).min(99) };
                machine.set_throttle(next)?;
                self.report.max_throttle_percent = self.report.max_throttle_percent.max(next);
                strikes = 0;
                tracing::info!(throttle = next, "auto-converge: throttling the vCPUs");
            }
            round += 1;
        }
    }

    /// Sends every page of `dirty` as round `round` on the pages connections (each 2 MiB block
    /// on its own connection), clearing each block's dirty bits just before reading it. Zero
    /// pages travel as Zero frames, or not at all in round 1 outside the sys region (the
    /// destination's memory starts zero).
    fn send_round(
        &mut self,
        tracker: &mut Option<&mut Tracker>,
        dirty: &[DirtyBitmap],
        round: u32,
        writers: Writers,
        last: bool,
    ) -> Result<(Vec<Connection>, Round)> {
        let start = Instant::now();
        let start_ms = self.ms();
        let mut q = RoundQueue {
            writers,
            round,
            total: dirty
                .iter()
                .map(guestmem_tracking::DirtyBitmap::count)
                .sum(),
            cache_pages: self.delta.as_ref().map_or(0, |c| c.pages()),
            pages: 0,
            zero_pages: 0,
            bytes: 0,
        };
        self.round_starts(round, q.total, last);
        let queued = self.queue_round(tracker, dirty, last, &mut q);
        let RoundQueue {
            writers,
            pages,
            zero_pages,
            bytes,
            ..
        } = q;
        let Joined {
            mut conns,
            streams,
            wire_bytes,
            hashing: digest_time,
        } = match (queued, writers.join()) {
            (Ok(()), Ok(joined)) => joined,
            // A writer's own error says why its queue closed ("pages connection N failed" does
            // not): it goes first.
            (_, Err(e)) | (Err(e), Ok(_)) => return Err(e),
        };
        // A round ends when the destination has applied it: what the sockets still buffer
        // (little on the wire can be much to write: zero lines do not travel) is not sent yet.
        if !last {
            for conn in &mut conns {
                match read_frame(conn)? {
                    Frame::EndOfRound { round: r, .. } if r == round => {}
                    other => return Err(unexpected(&other, "the round's EndOfRound back")),
                }
            }
        }
        let ms = start.elapsed().as_secs_f64() * 1e3;
        self.keep_streams(streams, round, digest_time);
        self.report.bytes += bytes;
        self.report.wire_bytes += wire_bytes;
        self.report.pages_sent += pages - zero_pages;
        if round == 1 {
            self.report.zero_pages_skipped += zero_pages;
        }
        Ok((
            conns,
            Round {
                round,
                start_ms,
                ms,
                pages,
                zero_pages,
                bytes,
                wire_bytes,
                dirty_pages_after: 0,
                bandwidth_mib_per_s: bytes as f64 / f64::from(1 << 20) / (ms / 1e3).max(1e-6),
                throttle_percent: 0,
            },
        ))
    }

    /// Queues every dirty block of `dirty` to the writers, then each connection's EndOfRound.
    fn queue_round(
        &mut self,
        tracker: &mut Option<&mut Tracker>,
        dirty: &[DirtyBitmap],
        last: bool,
        q: &mut RoundQueue,
    ) -> Result<()> {
        let blocks = dirty_blocks(dirty);
        let n = q.writers.queues.len();
        let conns: Vec<usize> = blocks
            .iter()
            .map(|&(b, first, _)| block_connection(dirty[b].gpa, first * PAGE_SIZE, n))
            .collect();
        for i in order::send_order(&conns, n) {
            let (b, first, count) = blocks[i];
            let b = &dirty[b];
            if let Some(t) = tracker
                .as_mut()
                .filter(|_| tracked_gpa(&self.memory, b.gpa))
            {
                t.clear(b, first, count)?;
            }
            self.queue_block(q, b, first, count)?;
            self.tick_in_round(q);
        }
        let round = q.round;
        for i in 0..q.writers.queues.len() {
            q.writers
                .queue(i, Job::Frame(Frame::EndOfRound { round, last }))?;
        }
        Ok(())
    }

    /// Queues the dirty pages `first..first + count` of `b` (one block, its dirty bits
    /// cleared) to the writer of its connection, as runs of zero and non-zero pages.
    fn queue_block(
        &mut self,
        q: &mut RoundQueue,
        b: &DirtyBitmap,
        first: u64,
        count: u64,
    ) -> Result<()> {
        let n = q.writers.queues.len();
        let conn = block_connection(b.gpa, first * PAGE_SIZE, n);
        let skip_zero = q.round == 1 && b.gpa != layout::SYS_GPA;
        let mut run: Option<(u64, u64, bool)> = None; // (first page, pages, zero)
        for p in first..first + count {
            if b.bits[(p / 64) as usize] >> (p % 64) & 1 == 0 {
                if let Some(r) = run.take() {
                    let d = q.delta_use();
                    self.queue_run(&mut q.writers, conn, b.gpa, r, skip_zero, d, &mut q.bytes)?;
                }
                continue;
            }
            let zero = self.page_is_zero(b.gpa + p * PAGE_SIZE)?;
            q.pages += 1;
            q.zero_pages += u64::from(zero);
            if let Some((_, len, z)) = &mut run {
                if *z == zero {
                    *len += 1;
                    continue;
                }
            }
            if let Some(r) = run.take() {
                let d = q.delta_use();
                self.queue_run(&mut q.writers, conn, b.gpa, r, skip_zero, d, &mut q.bytes)?;
            }
            run = Some((p, 1, zero));
        }
        if let Some(r) = run.take() {
            let d = q.delta_use();
            self.queue_run(&mut q.writers, conn, b.gpa, r, skip_zero, d, &mut q.bytes)?;
        }
        // The block's dirty pages are cleared: its stale chunks can be hashed, by the writer
        // that sends it, once it has.
        if self.chunks.is_some() {
            let (gpa, len) = (b.gpa + first * PAGE_SIZE, count * PAGE_SIZE);
            q.writers.queue(conn, Job::Digest { gpa, len })?;
        }
        Ok(())
    }

    /// Keeps the writers' zstd streams after a round, their memory counted at its most (their
    /// windows fill as the first round goes; after the last round nothing uses them, but they
    /// are freed only once the guest runs at the destination, see `switch_over`), and the
    /// busiest writer's hashing time.
    fn keep_streams(&mut self, streams: Vec<Option<ZstdStream>>, round: u32, digest: Duration) {
        let held: usize = streams.iter().flatten().map(ZstdStream::memory_bytes).sum();
        self.report.zstd_stream_bytes = self.report.zstd_stream_bytes.max(held as u64);
        self.zstd_streams = streams;
        self.round_digest = digest;
        if self.chunks.is_some() {
            tracing::debug!(
                round,
                busiest_writer_ms = digest.as_secs_f64() * 1e3,
                "chunk digests hashed"
            );
        }
    }

    /// Reads the page with volatile loads (the guest may be writing it); stops at the first
    /// non-zero word.
    fn page_is_zero(&self, gpa: u64) -> Result<bool> {
        let (_, p) = self.memory.find(gpa, PAGE_SIZE)?;
        let words = p as *const u64;
        for i in 0..(PAGE_SIZE / 8) as usize {
            // SAFETY: `find` checked that the page lies in a live mapping; aligned u64 reads.
            if unsafe { std::ptr::read_volatile(words.add(i)) } != 0 {
                return Ok(false);
            }
        }
        Ok(true)
    }

    #[allow(clippy::too_many_arguments)]
    fn queue_run(
        &mut self,
        writers: &mut Writers,
        conn: usize,
        slot_gpa: u64,
        (first, count, zero): (u64, u64, bool),
        skip_zero: bool,
        delta: DeltaUse,
        bytes: &mut u64,
    ) -> Result<()> {
        let gpa = slot_gpa + first * PAGE_SIZE;
        if zero {
            if !skip_zero {
                writers.queue(conn, Job::Frame(Frame::Zero { gpa, count }))?;
            }
            return Ok(());
        }
        let len = count * PAGE_SIZE;
        // Where zero pages may be skipped, the destination's pages still hold zeros: fresh.
        writers.queue(
            conn,
            Job::Pages {
                gpa,
                len,
                fresh: skip_zero,
                delta,
            },
        )?;
        *bytes += len;
        self.queued += len;
        if let Some(bw) = self.opts.max_bandwidth {
            let due = Duration::from_secs_f64(self.queued as f64 / bw.max(1) as f64);
            let elapsed = self.send_started.elapsed();
            if due > elapsed {
                std::thread::sleep(due - elapsed);
            }
        }
        Ok(())
    }

    /// With the guest stopped: the last pages, the state, and the hand-over (Ready, Go,
    /// Running). Before Go any error leaves the guest ours (`committed` false).
    fn switch_over(
        &mut self,
        machine: &mut dyn Machine,
        components: &mut Components<'_>,
        tracker: Option<&mut Tracker>,
        pending: Option<Pending>,
        links: &mut Links,
        paused: Instant,
    ) -> Result<()> {
        let mut tracker = tracker;
        components.mark_dirty(&self.memory)?;
        let mut dirty = match (&mut tracker, pending) {
            (Some(t), Some(p)) => merge(
                merge(p, t.harvest()?),
                full_bitmaps(&self.memory, |r| !guestmem_tracking::tracked(r)),
            ),
            _ => Vec::new(),
        };
        dirty.retain(|b| !self.shared.contains(&b.gpa));
        if let Some(chunks) = &self.chunks {
            chunks.mark_dirty(&dirty);
        }
        let round = u32::try_from(self.report.rounds.len()).expect("rounds are counted in u32") + 1;
        let postcopy = if self.opts.mode.has_postcopy() {
            // Only the sys region goes now; the RAM regions' dirty chunks are fetched later.
            let stale: Vec<StaleChunks> = self
                .memory
                .regions()
                .iter()
                .filter(|r| r.gpa() != layout::SYS_GPA && !self.shared.contains(&r.gpa()))
                .map(|r| StaleChunks {
                    gpa: r.gpa(),
                    bits: (self.opts.mode == Mode::Hybrid)
                        .then(|| stale_chunks(&dirty, r.gpa(), r.size())),
                })
                .collect();
            dirty.retain(|b| b.gpa == layout::SYS_GPA);
            if self.opts.mode == Mode::Postcopy {
                dirty = full_bitmaps(&self.memory, |r| r.gpa() == layout::SYS_GPA);
            }
            self.postcopy_starts(&stale);
            Some(stale)
        } else {
            None
        };
        let writers = self.writers(links, round, true);
        let (conns, mut stats) = self.send_round(&mut tracker, &dirty, round, writers, true)?;
        links.pages = conns;
        stats.throttle_percent = 0;
        self.report.rounds.push(stats);

        let state = machine_state(machine, links.negotiated.protocol)?;
        let saved_components = components.save()?;
        let region_digests = match &self.chunks {
            Some(chunks) => {
                // The writers hashed the last round's chunks; anything still stale (nothing,
                // unless a chunk was marked and its block not sent) is hashed here.
                let started = Instant::now();
                chunks.refresh_where(&self.memory, |_, _| true)?;
                let summary = chunks.summary().ok_or(MigrationError::StaleDigests)?;
                self.report.verify_ms = (self.round_digest + started.elapsed()).as_secs_f64() * 1e3;
                Some(summary)
            }
            None => None,
        };
        let digest = region_digests.as_deref().map(chunk_digests::combine);
        self.report.digest = digest;
        let switchover = Switchover {
            state,
            components: saved_components,
            last_round: round,
            digest,
            region_digests,
            postcopy,
        };
        let json = serde_json::to_vec(&switchover).expect("the switch-over state serializes");
        let main = &mut links.pages[0];
        write_frame(main, &Frame::State { state_json: json })?;
        match read_frame(main)? {
            Frame::Ready => {}
            other => return Err(unexpected(&other, "Ready")),
        }
        self.committed = true;
        write_frame(main, &Frame::Go)?;
        match read_frame(main)? {
            Frame::Running => {}
            other => return Err(unexpected(&other, "Running")),
        }
        self.report.downtime_ms = paused.elapsed().as_secs_f64() * 1e3;
        self.report.source_extra_bytes = self.extra_bytes(links.pages.len());
        // Nothing sends on the zstd streams any more. Freeing their windows takes tens of
        // milliseconds and contends with the process's other work (unmapping), so it waits
        // until the downtime is over, and is done on a thread of its own.
        if !self.zstd_streams.is_empty() {
            crate::stream::free_aside(std::mem::take(&mut self.zstd_streams));
        }
        Ok(())
    }

    /// While the guest runs: the handshake, then pre-copy's rounds (one for hybrid, none for
    /// post-copy), the guest's writes tracked by the tracker put in `tracker`. Returns the
    /// pages dirtied since the last round (`None` in post-copy).
    fn run_precopy(
        &mut self,
        machine: &mut dyn Machine,
        components: &mut Components<'_>,
        tracker: &mut Option<Tracker>,
        links: &mut Links,
    ) -> Result<Option<Pending>> {
        self.handshake(links, machine.config())?;
        if self.opts.mode == Mode::Postcopy {
            return Ok(None);
        }
        let mode = match self.opts.tracking {
            Some(m) => m,
            None => guestmem_tracking::Mode::best()?,
        };
        self.tracking = mode.name().to_string();
        let t = tracker.insert(machine.start_tracking(mode)?);
        self.precopy(machine, components, t, links).map(Some)
    }

    /// Post-copy's servers (in post-copy and hybrid), reading on the urgent connections
    /// already (see PostcopyServers).
    fn spawn_servers(
        &self,
        links: &mut Links,
        fault_cpus: Option<CpuSet>,
    ) -> Result<Option<PostcopyServers>> {
        if !self.opts.mode.has_postcopy() {
            return Ok(None);
        }
        let mut servers = PostcopyServers::spawn(
            links.pages.len(),
            links.urgent.len(),
            &self.memory,
            fault_cpus,
            self.compressor.clone(),
        )?;
        servers.hand(links, true)?;
        Ok(Some(servers))
    }

    /// Switch-over: the guest and its devices stop here ([`Source::switch_over`]). A failure
    /// before Go resumes them (the source keeps the guest, if they resume); after Go, or if
    /// the machine does not pause, the guest is not ours.
    fn switch_over_or_resume(
        &mut self,
        machine: &mut dyn Machine,
        components: &mut Components<'_>,
        tracker: &mut Option<Tracker>,
        pending: Option<Pending>,
        links: &mut Links,
    ) -> std::result::Result<(), MachineFailure> {
        let paused = Instant::now();
        if let Err(error) = machine.pause() {
            return Err(MachineFailure {
                error: error.into(),
                kept: false,
            });
        }
        let switched = components.pause().map_err(Error::from).and_then(|()| {
            self.switch_over(
                machine,
                components,
                tracker.as_mut(),
                pending,
                links,
                paused,
            )
        });
        let Err(error) = switched else {
            return Ok(());
        };
        stop_tracking(tracker.take());
        if self.committed {
            return Err(MachineFailure { error, kept: false });
        }
        let resumed = machine.resume().and_then(|()| components.resume());
        Err(MachineFailure {
            error,
            kept: resumed.is_ok(),
        })
    }

    /// The report, with the destination's from its Complete.
    fn finish_with(mut self, report_json: &[u8]) -> Report {
        self.report.destination = serde_json::from_slice(report_json).ok();
        if let Some(d) = &self.report.destination {
            if self.opts.mode.has_postcopy() {
                // The Complete comes when the destination is done with the transfer, which
                // may be long after the last page went: the destination timed residency.
                self.report.postcopy_ms = d.resident_ms;
            }
        }
        self.finish()
    }

    /// Serves the destination's post-copy requests on every connection until it says Complete
    /// on each, with `servers` (one thread per connection); a broken link waits for
    /// [`SendOptions::reconnect`] and goes on.
    fn serve_postcopy(
        &mut self,
        mut links: Links,
        mut servers: PostcopyServers,
    ) -> Result<Vec<u8>> {
        let started = Instant::now();
        let counters = servers.counters.clone();
        let (requests, bytes, wire) = (&counters.requests, &counters.bytes, &counters.wire);
        loop {
            let ticker = self.postcopy_ticker(&counters);
            counters.first_failed.store(usize::MAX, Ordering::SeqCst);
            let mut results = servers.serve(&mut links)?;
            drop(ticker);
            self.report.postcopy_requests = requests.load(Ordering::Relaxed);
            self.report.postcopy_bytes = bytes.load(Ordering::Relaxed);
            // The error of the connection that broke first, if one did.
            let first = counters.first_failed.load(Ordering::SeqCst);
            if first < results.len() {
                results.swap(0, first);
            }
            let mut results = results.into_iter();
            match results.next().expect("at least one connection") {
                Ok(report) if results.all(|r| r.is_ok()) => {
                    self.report.bytes += self.report.postcopy_bytes;
                    self.report.wire_bytes += wire.load(Ordering::Relaxed);
                    self.report.pages_sent += self.report.postcopy_bytes / PAGE_SIZE;
                    self.report.postcopy_ms = started.elapsed().as_secs_f64() * 1e3;
                    return Ok(report);
                }
                first => {
                    let why = first
                        .err()
                        .map_or("another connection broke".to_string(), |e| {
                            crate::error_chain(&e, ": ")
                        });
                    self.report.link_breaks += 1;
                    self.postcopy_paused(&counters);
                    tracing::warn!("post-copy link broken: {why}");
                    let Some(reconnect) = &self.opts.reconnect else {
                        return Err(MigrationError::PostcopySplit { why }.into());
                    };
                    links = reconnect(&links.resume(why))?;
                    tracing::info!("post-copy link re-established");
                }
            }
        }
    }

    /// Whether the switch-over checks the memory digests (pre-copy only: post-copy's
    /// destination does not have the memory yet).
    fn verifies(&self) -> bool {
        self.opts.verify && self.opts.mode == Mode::Precopy
    }

    fn extra_bytes(&self, connections: usize) -> u64 {
        // Per pages connection: a frame buffer and its queue (jobs carry no pages); the dirty
        // bitmaps (the tracker's scratch and pending, and ours: about four per page bit).
        let pages: u64 = self
            .memory
            .regions()
            .iter()
            .map(|r| r.size() / PAGE_SIZE)
            .sum();
        // With delta encoding: the cache, and a page buffer per connection. With zstd streams:
        // their windows and tables, at their most.
        let delta = self
            .delta
            .as_ref()
            .map_or(0, |c| c.bytes() + connections as u64 * BLOCK);
        connections as u64 * (BLOCK + 4096)
            + 4 * pages / 8
            + self.chunks.as_ref().map_or(0, |c| c.bytes())
            + delta
            + self.report.zstd_stream_bytes
    }

    fn finish(mut self) -> Report {
        self.report.total_ms = self.ms();
        self.report.compression = self.compressor.report();
        if let Some(d) = &self.delta {
            self.report.delta = d.report();
        }
        self.report.tracking = self.tracking.clone();
        self.report
    }
}

fn thread_failed(what: &str) -> Error {
    MigrationError::Thread { what: what.into() }.into()
}

/// Whether a region's memory can be handed to a local destination as a file.
fn shareable(region: &Region) -> bool {
    region.gpa() != layout::SYS_GPA
        && matches!(
            region.backend(),
            guestmem_memory::Backend::Memfd
                | guestmem_memory::Backend::MemfdHugetlb
                | guestmem_memory::Backend::Hugetlbfs
        )
}

fn tracked_gpa(memory: &GuestMemory, gpa: u64) -> bool {
    memory
        .regions()
        .iter()
        .any(|r| r.gpa() == gpa && guestmem_tracking::tracked(r))
}

/// One bit per [`POSTCOPY_CHUNK`] of the region at `gpa`: set where any page is dirty.
fn stale_chunks(dirty: &[DirtyBitmap], gpa: u64, size: u64) -> Vec<u64> {
    let chunks = size.div_ceil(POSTCOPY_CHUNK);
    let mut bits = vec![0u64; to_usize(chunks.div_ceil(64))];
    if let Some(b) = dirty.iter().find(|b| b.gpa == gpa) {
        for (start, len) in b.ranges() {
            let first = (start - gpa) / POSTCOPY_CHUNK;
            let last = (start - gpa + len - 1) / POSTCOPY_CHUNK;
            for c in first..=last {
                bits[(c / 64) as usize] |= 1 << (c % 64);
            }
        }
    }
    bits
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A paused machine whose saved state is `state` (its memory one small anonymous region).
    struct Saved {
        state: Vec<u8>,
        memory: Arc<GuestMemory>,
        config: guestmem_vm::VmConfig,
    }

    impl Saved {
        fn new(state: Vec<u8>) -> Saved {
            let config = guestmem_vm::VmConfig {
                vcpus: 1,
                regions: vec![guestmem_memory::RegionSpec::new(
                    "ram",
                    0,
                    1 << 20,
                    guestmem_memory::Backend::Anon,
                )],
                dirty_ring_bytes: None,
            };
            let memory = Arc::new(GuestMemory::new(&config.regions, None).unwrap());
            Saved {
                state,
                memory,
                config,
            }
        }
    }

    impl Machine for Saved {
        fn memory(&self) -> &Arc<GuestMemory> {
            &self.memory
        }
        fn config(&self) -> &guestmem_vm::VmConfig {
            &self.config
        }
        fn start_tracking(&self, _: guestmem_tracking::Mode) -> guestmem_contract::Result<Tracker> {
            unreachable!("the state alone is asked for")
        }
        fn pause(&mut self) -> guestmem_contract::Result<()> {
            Ok(())
        }
        fn resume(&mut self) -> guestmem_contract::Result<()> {
            Ok(())
        }
        fn save(&mut self) -> guestmem_contract::Result<Vec<u8>> {
            Ok(self.state.clone())
        }
    }

    /// Protocol 1 (guestmem 0.1.0) knows only guestmem's own VM: a Linux guest's state is
    /// refused naming its kind before anything is sent; protocol 2 carries it sealed as it is.
    #[test]
    fn a_linux_state_is_refused_to_a_protocol_1_peer_by_its_kind() {
        let linux = guestmem_contract::LINUX_STATE.seal(&serde_json::json!({"kind": "linux"}));
        let mut machine = Saved::new(linux.clone());
        let refused = machine_state(&mut machine, 1).unwrap_err().to_string();
        assert!(
            refused.contains(guestmem_contract::LINUX_STATE.name),
            "{refused}"
        );
        assert_eq!(machine_state(&mut machine, 2).unwrap(), linux);
    }

    /// Round 1 admits only the pages the cache can still hold at the round's end; later rounds
    /// try every page; without a cache nothing is.
    #[test]
    fn round_one_admits_its_last_pages_and_later_rounds_try_them_all() {
        assert_eq!(delta_use(1, 0, 100, 99), DeltaUse::Off);
        assert_eq!(delta_use(3, 0, 100, 0), DeltaUse::Off);
        assert_eq!(delta_use(1, 10, 100, 89), DeltaUse::Off);
        assert_eq!(delta_use(1, 10, 100, 90), DeltaUse::Admit);
        assert_eq!(delta_use(2, 10, 100, 0), DeltaUse::Try);
    }

    /// Every block with a dirty page, in memory order, and only those; a slot's last block
    /// may be short.
    #[test]
    fn dirty_blocks_are_those_with_a_dirty_page() {
        let bitmap = |slot, gpa, pages: u64| DirtyBitmap {
            slot,
            gpa,
            pages,
            bits: vec![0; to_usize(pages.div_ceil(64))],
        };
        let block = to_usize(BLOCK / PAGE_SIZE);
        let mut a = bitmap(0, 1 << 30, 3 * block as u64 + 64);
        a.bits[block / 64] = 1; // block 1
        a.bits[3 * block / 64] = 1 << 63; // the short last block
        let mut b = bitmap(1, 2 << 30, block as u64);
        b.bits[7] = 2;
        let blocks = dirty_blocks(&[a, b]);
        let (bp, last) = (block as u64, 3 * block as u64);
        assert_eq!(blocks, [(0, bp, bp), (0, last, 64), (1, 0, bp)]);
    }
}
