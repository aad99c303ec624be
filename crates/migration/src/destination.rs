//! The destination side of a live migration (see [`crate::migrate`] for the protocol).

use std::io::{self, Write};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use guestmem_memory::{Backend, GuestMemory, PAGE_SIZE};
use guestmem_paging::affinity::CpuSet;
use guestmem_paging::{PageSource, Pager, PagerConfig};
use guestmem_vm::{layout, Vm};
use serde::{Deserialize, Serialize};

use crate::chunk_digests::{self, ChunkDigests, RegionDigest};
use crate::component::{Components, MachineBuilder, TargetMachine, VmBuilder};
use crate::landing::Landing;
use crate::migrate::{
    block_connection, frame_name, link_error, percentile, read_frame, read_hello, read_json,
    unexpected_frame, write_frame, ChannelRole, Hello, Links, Mode, Setup, StaleChunks, Switchover,
    BLOCK, FORMAT, HEARTBEAT_INTERVAL, POSTCOPY_CHUNK, POSTCOPY_FAULT_BYTES,
};
use crate::source::memory_digest;
use crate::stream::{Frame, FrameRef, Lend, ZstdStreamDecoder, MAX_REQUEST};
use crate::transport::{Accepted, Connection, Cutter, Listener, Role, Timeouts};
use crate::{error_chain, Error, MigrationError, Peer, Result};

/// Post-copy, after the link broke: how long the destination's vCPUs wait for the source to
/// reconnect (it tries every second by itself, and `guestmem migrate resume` can point it
/// elsewhere) before the VM stops with an error. Longer than the source takes to give up on an
/// unresponsive destination (twice [`crate::migrate::DEAD_PEER_TIMEOUT`]), so that the side
/// that holds the missing pages gives up first.
pub const RESUME_TIMEOUT: Duration = Duration::from_secs(45);

/// How to receive.
#[derive(Debug, Clone)]
pub struct ReceiveOptions {
    /// How long a post-copy waits for the source to come back after the link broke, before
    /// the VM stops with an error naming the guest address it needed ([`RESUME_TIMEOUT`]).
    pub resume_timeout: Duration,
    /// Post-copy: fault handler threads per region.
    pub handlers: usize,
    /// Post-copy and hybrid: host CPUs for the pagers' threads (fault handlers, readahead,
    /// background fetch; [`PagerConfig::cpus`]). See [`SendOptions::fault_cpus`] for the
    /// source's side. `None`: wherever the scheduler puts them.
    ///
    /// [`SendOptions::fault_cpus`]: crate::migrate::SendOptions::fault_cpus
    pub fault_cpus: Option<Vec<usize>>,
    /// Test hook, never set outside tests: each pre-copy Pages frame that lands on this guest
    /// address has the word there flipped, as a receive path that misplaces bytes would (the
    /// digest check must then refuse the migration).
    #[doc(hidden)]
    pub corrupt_landing_at: Option<u64>,
}

impl Default for ReceiveOptions {
    fn default() -> Self {
        ReceiveOptions {
            resume_timeout: RESUME_TIMEOUT,
            handlers: 2,
            fault_cpus: None,
            corrupt_landing_at: None,
        }
    }
}

/// What the destination saw (sent back to the source in the Complete).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct DestinationReport {
    /// The migration's mode.
    pub mode: Option<Mode>,
    /// Rounds received (the last one's number).
    pub rounds: u32,
    /// Pages received in the rounds.
    pub pages_received: u64,
    /// Of them, zero pages.
    pub zero_pages_received: u64,
    /// The memory digest check at switch-over: the time it added after the last round's pages
    /// (re-hashing the chunks that round wrote, on the busiest pages connection, then any
    /// chunk still stale, and the comparison), and the digest (equal to the source's, or the
    /// migration would have been refused).
    pub verify_ms: f64,
    /// The destination's memory digest.
    pub digest: Option<u64>,
    /// Post-copy: fault events the pagers read, fetches on behalf of faults (and their
    /// readahead) with their latency (request sent → pages in hand), background fetches.
    pub faults: u64,
    /// Fetches on behalf of faults.
    pub fault_fetches: u64,
    /// Their latency's median.
    pub fault_latency_p50_us: f64,
    /// Their latency's 99th percentile.
    pub fault_latency_p99_us: f64,
    /// Their latency's maximum.
    pub fault_latency_max_us: f64,
    /// Fetches of the background transfer.
    pub background_fetches: u64,
    /// Bytes fetched in post-copy.
    pub postcopy_bytes: u64,
    /// Running → every page resident.
    pub resident_ms: f64,
    /// Post-copy links that broke and were resumed.
    pub link_breaks: u32,
    /// What the pages connections' zstd stream decoders held at the end of the rounds (their
    /// windows; 0 without zstd streams).
    #[serde(default)]
    pub zstd_stream_bytes: u64,
}

/// A VM received up to the switch-over: its memory (or, in post-copy, its pagers) and vCPU
/// state are in place. Resume it with [`Transfer::resume`], then [`Transfer::finish`]. `M` is
/// the VM the destination's [`MachineBuilder`] built (guestmem's own `Vm` by default).
pub struct Incoming<M = Vm> {
    /// The VM, not running yet.
    pub vm: M,
    /// The rest of the migration.
    pub transfer: Transfer,
}

/// The rest of a migration, after the switch-over. Keep it until [`Transfer::finish`]: in
/// post-copy its pagers serve the guest's missing pages.
pub struct Transfer {
    mode: Mode,
    links: Option<Links>,
    postcopy: Option<Postcopy>,
    report: DestinationReport,
    /// When the vCPUs ran (post-copy's residency is timed from there).
    running_at: Option<Instant>,
    /// The pre-copy rounds' zstd stream decoders: freed once the guest runs, on a thread of
    /// their own (freeing a 128 MiB window takes tens of milliseconds, and its unmapping
    /// contends with the switch-over's own work).
    streams: Vec<ZstdStreamDecoder>,
    /// The destination is this migration's until the transfer is dropped: other sources are
    /// told it is busy.
    _claim: Claim,
    // Dropped last: the pagers' regions stay mapped while they live.
    _memory: Arc<GuestMemory>,
}

struct Postcopy {
    link: Arc<PostcopyLink>,
    pagers: Vec<Pager>,
    listener: Arc<Listener>,
    migration: u64,
}

/// Accepts one migration on `listener` and receives it up to the switch-over. Any refusal is
/// told to the source (which keeps its VM running) and returned. Connections that fail their
/// handshake or Hello are refused on their own (logged) while it waits, which is unbounded:
/// waiting for a migration is its job. One migration at a time: until the [`Transfer`] is
/// dropped (or this fails), other sources are told that the destination is busy.
///
/// The source's components' states must be none: [`receive_components`] receives a VM with
/// components.
pub fn receive(listener: Arc<Listener>, opts: &ReceiveOptions) -> Result<Incoming> {
    receive_components(listener, opts, &mut Components::none())
}

/// [`receive`] for a VM with `components`: each is handed the state its namesake had on the
/// source before the destination says Ready, so that a state refused (or missing, or of an
/// unknown component) refuses the migration and the source keeps the guest.
pub fn receive_components(
    listener: Arc<Listener>,
    opts: &ReceiveOptions,
    components: &mut Components<'_>,
) -> Result<Incoming> {
    receive_into(listener, opts, &mut VmBuilder, components)
}

/// [`receive_components`] into the VM `builder` builds (a VMM's own VM) from the configuration
/// the source sends: a configuration it refuses, or a machine state its
/// [`TargetMachine::restore`] refuses, refuses the migration (the source keeps the guest). The
/// received pages land in the VM's guest memory (in post-copy its pagers bring them in on
/// demand: its vCPUs must access guest memory through its mappings, as KVM's do).
pub fn receive_into<B: MachineBuilder>(
    listener: Arc<Listener>,
    opts: &ReceiveOptions,
    builder: &mut B,
    components: &mut Components<'_>,
) -> Result<Incoming<B::Machine>> {
    if let Some(cpus) = &opts.fault_cpus {
        CpuSet::new(cpus).map_err(|e| MigrationError::BadOption {
            option: "fault_cpus",
            reason: format!("fault CPUs: {e}"),
        })?;
    }
    let gate = Gate::of(&listener);
    let (mut links, claim) = gate
        .collect(None, listener.timeouts(), &|| false)?
        .expect("a receive is never stopped");
    let claim = claim.expect("a new migration claims the destination");
    let setup: Setup = read_json(&mut links.pages[0], "VM setup")?;
    // Refusals are told to the source (which keeps the guest), causes included.
    let refuse = |links: &mut Links, e: MigrationError| {
        let reason = error_chain(&e, ": ");
        let _ = write_frame(&mut links.pages[0], &Frame::Abort { reason });
        Error::Migration(e)
    };
    let unsupported = |reason: String| MigrationError::Unsupported { reason };
    if setup.format != FORMAT {
        return Err(refuse(
            &mut links,
            MigrationError::Format {
                found: setup.format,
                supported: FORMAT,
            },
        ));
    }
    if let Some(Err(why)) = setup.zstd_window_log.map(crate::stream::check_window_log) {
        return Err(refuse(&mut links, unsupported(why)));
    }

    if setup.mode.has_postcopy() {
        if let Some(r) = setup
            .config
            .regions
            .iter()
            .find(|r| r.backend == Backend::GuestMemfd)
        {
            return Err(refuse(
                &mut links,
                unsupported(format!(
                    "{} of guest_memfd region '{}' needs KVM Userfault (KVM_MEM_USERFAULT, \
                     KVM_CAP_USERFAULT), which this kernel lacks: migrate it with pre-copy",
                    setup.mode, r.name
                )),
            ));
        }
    }
    let mut shared = std::collections::HashMap::new();
    if !setup.shared.is_empty() {
        write_frame(&mut links.pages[0], &Frame::Ready)?;
        let fds = links.pages[0]
            .recv_fds(setup.shared.len())
            .map_err(|e| link_error("receiving the source's memory files", e))?;
        shared.extend(setup.shared.iter().cloned().zip(fds));
    }
    let mut vm = match builder.build(&setup.config, shared) {
        Ok(vm) => vm,
        Err(e) => {
            return Err(refuse(
                &mut links,
                unsupported(format!(
                    "it cannot be built here: {}",
                    error_chain(&e, ": ")
                )),
            ))
        }
    };
    let memory = vm.memory().clone();
    // The rounds fill anonymous RAM in bulk: huge pages save 511 of every 512 faults.
    for region in memory.regions() {
        if let Err(e) = region.advise_huge_pages() {
            return Err(refuse(
                &mut links,
                unsupported(format!(
                    "its memory cannot be prepared here: {}",
                    error_chain(&e, ": ")
                )),
            ));
        }
    }
    let hello_back = serde_json::json!({ "guestmem_version": env!("CARGO_PKG_VERSION") });
    write_frame(
        &mut links.pages[0],
        &Frame::Hello {
            config_json: hello_back.to_string().into_bytes(),
        },
    )?;
    let mut report = DestinationReport {
        mode: Some(setup.mode),
        ..Default::default()
    };
    // Chunk digests of the regions that travel, kept by the readers as pages land.
    let chunks = match (setup.verify, setup.verify_chunk) {
        (true, Some(chunk)) if chunk_digests::valid_chunk(chunk, BLOCK) => {
            Some(Arc::new(ChunkDigests::new(
                memory
                    .regions()
                    .iter()
                    .filter(|r| !setup.shared.iter().any(|n| n == r.name()))
                    .map(|r| (r.gpa(), r.size())),
                chunk,
            )))
        }
        (true, Some(chunk)) => {
            return Err(refuse(
                &mut links,
                unsupported(format!(
                    "digest chunks of {chunk} bytes: a power of two from {PAGE_SIZE} to {BLOCK} \
                     is needed"
                )),
            ))
        }
        _ => None,
    };

    // Pre-copy's rounds land in fresh memory with UFFDIO_COPY where the kernel lets us (a
    // refusal only costs speed: the pages are then written in place).
    let landing = if setup.mode == Mode::Postcopy {
        None
    } else {
        match Landing::arm(&memory, &setup.shared) {
            Ok(l) => l.map(Arc::new),
            Err(e) => {
                tracing::warn!("pages land by plain writes: {}", error_chain(&e, ": "));
                None
            }
        }
    };

    // The rounds: each pages connection is applied by its own thread, up to its last
    // EndOfRound.
    // A reader that fails ends the others' reads at once (their connections may be cut
    // silently): the migration fails now, not after an idle timeout.
    // The reader that failed first: its error is the migration's (the others' follow from it).
    let cutters = Arc::new(links.cutters()?);
    let first_failed = Arc::new(AtomicUsize::new(usize::MAX));
    let connections = links.pages.len();
    let readers: Vec<_> = std::mem::take(&mut links.pages)
        .into_iter()
        .enumerate()
        .map(|(i, conn)| {
            let memory = memory.clone();
            let (cutters, first_failed) = (cutters.clone(), first_failed.clone());
            let digests = chunks.clone().map(|chunks| ReaderDigests {
                chunks,
                reader: i,
                connections,
            });
            let corrupt = opts.corrupt_landing_at;
            let zstd_window_log = setup.zstd_window_log;
            let landing = landing.clone();
            std::thread::Builder::new()
                .name(format!("migrate-rx{i}"))
                .spawn(move || {
                    let (conn, result) = apply_pages(
                        conn,
                        &memory,
                        landing.as_deref(),
                        digests.as_ref(),
                        corrupt,
                        zstd_window_log,
                    );
                    if result.is_err() {
                        let _ = first_failed.compare_exchange(
                            usize::MAX,
                            i,
                            Ordering::SeqCst,
                            Ordering::SeqCst,
                        );
                        cutters.iter().for_each(Cutter::cut_reads);
                    }
                    (conn, result)
                })
                .expect("spawning a reader thread")
        })
        .collect();
    let mut failures = Vec::new();
    let mut streams = Vec::new();
    let mut last_rounds = Vec::new();
    let mut last_round_hashing = Duration::ZERO;
    for (i, r) in readers.into_iter().enumerate() {
        let (conn, result) = r.join().expect("a reader thread panicked");
        links.pages.push(conn);
        match result {
            Ok(mut stats) => {
                streams.extend(stats.zstream.take());
                report.pages_received += stats.pages;
                report.zero_pages_received += stats.zero_pages;
                last_rounds.push(stats.last_round);
                last_round_hashing = last_round_hashing.max(stats.last_round_hashing);
                report.zstd_stream_bytes += stats.zstd_stream_bytes;
            }
            Err(e) => failures.push((i, e)),
        }
    }
    let first = first_failed.load(Ordering::SeqCst);
    let failure = match failures.iter().position(|(i, _)| *i == first) {
        Some(at) => Some(failures.swap_remove(at).1),
        None => failures.into_iter().next().map(|(_, e)| e),
    };
    if let Some(e) = failure {
        return Err(refuse(
            &mut links,
            MigrationError::Receiving {
                source: Box::new(e),
            },
        ));
    }
    // Every reader is done with it: the memory goes back to behaving as unregistered.
    if let Some(landing) = landing.and_then(Arc::into_inner) {
        let t = Instant::now();
        match landing.disarm() {
            Ok(stats) => tracing::debug!(
                ?stats,
                disarm_ms = t.elapsed().as_secs_f64() * 1e3,
                "pages landed"
            ),
            Err(e) => {
                return Err(refuse(
                    &mut links,
                    MigrationError::Receiving {
                        source: Box::new(e),
                    },
                ))
            }
        }
    }
    // The memory is complete. With chunk digests, the readers hashed what they wrote; any
    // chunk still stale (written on a connection that does not carry its block) is hashed
    // now. Without (a source that predates them), all of memory is digested now, while the
    // source digests its own.
    let started = Instant::now();
    let verified = match &chunks {
        Some(chunks) => {
            chunks.refresh_where(&memory, |_, _| true)?;
            let regions = chunks.summary().ok_or(MigrationError::StaleDigests)?;
            let took = last_round_hashing + started.elapsed();
            Some((chunk_digests::combine(&regions), Some(regions), took))
        }
        None if setup.verify => Some((memory_digest(&memory)?, None, started.elapsed())),
        None => None,
    };

    let switchover: Switchover = match read_frame(&mut links.pages[0])? {
        Frame::State { state_json } => match serde_json::from_slice(&state_json) {
            Ok(s) => s,
            Err(source) => {
                return Err(refuse(
                    &mut links,
                    MigrationError::BadMessage {
                        peer: Peer::Source,
                        what: "State",
                        source,
                    },
                ))
            }
        },
        other => return Err(refused_by_source(&other, "State")),
    };
    if let Some(r) = last_rounds.iter().find(|&&r| r != switchover.last_round) {
        return Err(refuse(
            &mut links,
            unsupported(format!(
                "a pages connection ended at round {r}, the State says {}",
                switchover.last_round
            )),
        ));
    }
    report.rounds = switchover.last_round;
    if let Err(e) = vm.restore(&switchover.state) {
        return Err(refuse(
            &mut links,
            unsupported(format!(
                "the vCPU state does not load: {}",
                error_chain(&e, ": ")
            )),
        ));
    }
    if let Some(expected) = switchover.digest {
        let (digest, regions, took) = match verified {
            Some(v) => v,
            // A source that did not say so in its setup.
            None => {
                let started = Instant::now();
                (memory_digest(&memory)?, None, started.elapsed())
            }
        };
        report.verify_ms = took.as_secs_f64() * 1e3;
        report.digest = Some(digest);
        if digest != expected {
            let which = differing_regions(regions.as_deref(), switchover.region_digests.as_deref());
            return Err(refuse(
                &mut links,
                MigrationError::DigestMismatch {
                    found: digest,
                    expected,
                    regions: which,
                },
            ));
        }
    }
    // Well within the idle timeout (the source's is taken to be the same as ours).
    let heartbeat = HEARTBEAT_INTERVAL.min(listener.timeouts().idle / 4);
    let postcopy = match &switchover.postcopy {
        Some(stale) => match arm_postcopy(&vm, &setup.shared, stale, &links, opts, heartbeat) {
            Ok((link, pagers)) => Some(Postcopy {
                link,
                pagers,
                listener,
                migration: links.migration,
            }),
            Err(e) => {
                return Err(refuse(
                    &mut links,
                    unsupported(format!(
                        "post-copy cannot be armed: {}",
                        error_chain(&e, ": ")
                    )),
                ))
            }
        },
        None => None,
    };

    if let Err(e) = components.restore(&switchover.components) {
        return Err(refuse(
            &mut links,
            unsupported(format!("the components' states: {}", error_chain(&e, ": "))),
        ));
    }
    write_frame(&mut links.pages[0], &Frame::Ready)?;
    match read_frame(&mut links.pages[0]) {
        Ok(Frame::Go) => {}
        Ok(other) => return Err(refused_by_source(&other, "Go")),
        Err(e) => {
            return Err(MigrationError::BrokeBeforeGo {
                source: Box::new(e),
            }
            .into())
        }
    }
    Ok(Incoming {
        vm,
        transfer: Transfer {
            mode: setup.mode,
            links: Some(links),
            postcopy,
            report,
            running_at: None,
            streams,
            _claim: claim,
            _memory: memory,
        },
    })
}

/// Connections in their handshake at once, at most: more are dropped as they come (a flood of
/// junk connections costs a thread each for at most the handshake timeout).
const MAX_HANDSHAKES: usize = 64;

/// The destination's admission of connections on a listener. Each accepted socket's TLS
/// handshake and Hello run in a thread of their own, bounded by the handshake timeout, so a
/// silent or junk connection holds nobody up and ends nothing but itself (it is refused, and
/// the refusal logged). The first pages connection of a new migration claims the destination;
/// connections of any other migration are answered Abort (the destination is busy) until the
/// claim ends with the migration.
pub(crate) struct Gate {
    state: Mutex<GateState>,
    changed: Condvar,
    handshakes: AtomicUsize,
}

#[derive(Default)]
struct GateState {
    /// The migration this destination serves.
    current: Option<u64>,
    /// Connections of it, taken in (their Hello answered), not collected yet.
    arrived: Vec<Arrival>,
}

struct Arrival {
    conn: Connection,
    hello: Hello,
    at: Instant,
}

/// A migration's hold on the destination, released when dropped.
pub(crate) struct Claim {
    gate: Arc<Gate>,
    migration: u64,
}

impl Drop for Claim {
    fn drop(&mut self) {
        let mut st = self.gate.lock();
        if st.current == Some(self.migration) {
            st.current = None;
        }
        st.arrived.retain(|a| a.hello.migration != self.migration);
    }
}

impl Gate {
    /// The listener's gate, started (with its accepting thread) on first use.
    pub(crate) fn of(listener: &Arc<Listener>) -> Arc<Gate> {
        listener
            .gate
            .get_or_init(|| {
                let gate = Arc::new(Gate {
                    state: Mutex::new(GateState::default()),
                    changed: Condvar::new(),
                    handshakes: AtomicUsize::new(0),
                });
                let (g, l) = (gate.clone(), listener.clone());
                std::thread::Builder::new()
                    .name("migrate-accept".into())
                    .spawn(move || g.accept_loop(&l))
                    .expect("spawning the accepting thread");
                gate
            })
            .clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn accept_loop(self: &Arc<Self>, listener: &Listener) {
        loop {
            let accepted = match listener.accept_socket() {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(
                        "accepting a migration connection: {}",
                        error_chain(&e, ": ")
                    );
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            };
            if self.handshakes.fetch_add(1, Ordering::SeqCst) >= MAX_HANDSHAKES {
                self.handshakes.fetch_sub(1, Ordering::SeqCst);
                tracing::warn!(
                    "refused a connection from {}: {MAX_HANDSHAKES} connections are in their \
                     handshake already",
                    accepted.peer()
                );
                continue;
            }
            let gate = self.clone();
            let spawned = std::thread::Builder::new()
                .name("migrate-admit".into())
                .spawn(move || {
                    gate.admit(accepted);
                    gate.handshakes.fetch_sub(1, Ordering::SeqCst);
                });
            if let Err(e) = spawned {
                self.handshakes.fetch_sub(1, Ordering::SeqCst);
                tracing::warn!("refused a migration connection: no thread for it: {e}");
            }
        }
    }

    /// One connection: its handshake, its certificate's role, its Hello, and whether this
    /// destination takes it.
    fn admit(&self, accepted: Accepted) {
        let handshake = accepted.timeouts();
        let mut conn = match accepted.handshake() {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("refused a migration connection: {}", error_chain(&e, ": "));
                return;
            }
        };
        if let Err(why) = conn.check_peer_role(Role::Source) {
            return refuse(&mut conn, why);
        }
        // The Hello is part of the connection's establishment: bounded as the handshake.
        let _ = conn.set_idle_timeout(Some(handshake.handshake));
        let hello = match read_hello(&mut conn) {
            Ok(h) => h,
            Err(e) => {
                let why = format!(
                    "{} sent no valid Hello: {}",
                    conn.peer(),
                    error_chain(&e, ": ")
                );
                return refuse(&mut conn, why);
            }
        };
        let _ = conn.set_idle_timeout(Some(handshake.idle));
        let verdict = {
            let mut st = self.lock();
            match st.current {
                Some(id) if id == hello.migration => Ok(()),
                Some(id) => Err(format!(
                    "the destination is busy with another migration ({id:#x}); migration {:#x} \
                     is refused (try again once that one is over)",
                    hello.migration
                )),
                None if hello.resume => Err(format!(
                    "the source resumes migration {:#x}, which this destination is not running",
                    hello.migration
                )),
                None if hello.channel != ChannelRole::Pages(0) => Err(format!(
                    "connection {:?} of migration {:#x} came before its first pages connection",
                    hello.channel, hello.migration
                )),
                None => {
                    st.current = Some(hello.migration);
                    Ok(())
                }
            }
        };
        if let Err(why) = verdict {
            return refuse(&mut conn, why);
        }
        // Before the answer: the source opens its next connection only once it has it.
        let at = Instant::now();
        let answer = serde_json::json!({ "guestmem_version": env!("CARGO_PKG_VERSION") });
        if let Err(e) = write_frame(
            &mut conn,
            &Frame::Hello {
                config_json: answer.to_string().into_bytes(),
            },
        ) {
            tracing::warn!(
                "a migration connection broke as it was taken in: {}",
                error_chain(&e, ": ")
            );
        }
        self.lock().arrived.push(Arrival { conn, hello, at });
        self.changed.notify_all();
    }

    /// Waits for the first pages connection of a new migration (`resume_of` `None`: the one
    /// that claimed the destination) or of the resumption of `resume_of`, then for its other
    /// connections, which must all come within the handshake timeout of the first. `None` when
    /// `stop` says so first.
    pub(crate) fn collect(
        self: &Arc<Self>,
        resume_of: Option<u64>,
        timeouts: Timeouts,
        stop: &dyn Fn() -> bool,
    ) -> Result<Option<(Links, Option<Claim>)>> {
        let resume = resume_of.is_some();
        let mut st = self.lock();
        let first = loop {
            if stop() {
                return Ok(None);
            }
            let want = resume_of.or(st.current);
            if let Some(id) = want {
                if let Some(i) = st.arrived.iter().rposition(|a| {
                    a.hello.migration == id
                        && a.hello.channel == ChannelRole::Pages(0)
                        && a.hello.resume == resume
                }) {
                    break st.arrived.remove(i);
                }
            }
            st = self
                .changed
                .wait_timeout(st, Duration::from_millis(200))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        };
        let id = first.hello.migration;
        // Older arrivals of a resumption belong to an attempt that was given up.
        if resume {
            st.arrived
                .retain(|a| a.hello.migration != id || a.at >= first.at);
        }
        drop(st);
        // A resumption goes on under the claim of the migration it resumes.
        let claim = (!resume).then(|| Claim {
            gate: self.clone(),
            migration: id,
        });
        let (pages, urgent) = (first.hello.pages, first.hello.urgent);
        let mut main = first.conn;
        let fail = |main: &mut Connection, reason: String| {
            let _ = write_frame(
                main,
                &Frame::Abort {
                    reason: reason.clone(),
                },
            );
            Error::Migration(MigrationError::Connections { reason })
        };
        if pages == 0 || pages > 64 || urgent > 64 {
            return Err(fail(
                &mut main,
                format!("{pages} pages and {urgent} urgent connections announced"),
            ));
        }
        let mut slots: Vec<Option<Connection>> = (0..pages + urgent).map(|_| None).collect();
        slots[0] = Some(main);
        let deadline = Instant::now() + timeouts.handshake;
        let mut st = self.lock();
        while slots.iter().any(Option::is_none) {
            let next = st.arrived.iter().position(|a| a.hello.migration == id);
            let Some(i) = next else {
                let now = Instant::now();
                if now >= deadline {
                    drop(st);
                    let missing: Vec<String> = slots
                        .iter()
                        .enumerate()
                        .filter(|(_, s)| s.is_none())
                        .map(|(i, _)| {
                            if i < pages {
                                format!("pages connection {i}")
                            } else {
                                format!("urgent connection {}", i - pages)
                            }
                        })
                        .collect();
                    let main = slots[0].as_mut().expect("the first connection");
                    let why = format!(
                        "{} of migration {id:#x} did not come within {} s of its first \
                         connection (the handshake timeout; from {})",
                        missing.join(", "),
                        timeouts.handshake.as_secs_f64(),
                        main.peer()
                    );
                    return Err(fail(main, why));
                }
                st = self
                    .changed
                    .wait_timeout(st, deadline - now)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
                continue;
            };
            let Arrival { conn, hello: h, .. } = st.arrived.remove(i);
            let slot = match h.channel {
                ChannelRole::Pages(i) if i < pages => Some(i),
                ChannelRole::Urgent(i) if i < urgent => Some(pages + i),
                _ => None,
            };
            let why = match slot {
                None => Some(format!(
                    "connection {:?} is outside the {pages} + {urgent} announced",
                    h.channel
                )),
                Some(s) if slots[s].is_some() || h.resume != resume => Some(format!(
                    "connection {:?} of migration {id:#x} came twice",
                    h.channel
                )),
                Some(_) => None,
            };
            if let Some(why) = why {
                drop(st);
                let main = slots[0].as_mut().expect("the first connection");
                return Err(fail(main, why));
            }
            slots[slot.expect("checked")] = Some(conn);
        }
        drop(st);
        let mut all = slots.into_iter().map(|s| s.expect("every slot filled"));
        let links = Links {
            pages: all.by_ref().take(pages).collect(),
            urgent: all.collect(),
            migration: id,
            mode: Mode::Precopy,
        };
        Ok(Some((links, claim)))
    }
}

/// Tells a refused connection why (an Abort), and lets it read that before the socket closes
/// (closing with its data unread would reset the connection, and the Abort could be lost).
fn refuse(conn: &mut Connection, why: String) {
    tracing::warn!("refused a migration connection: {why}");
    if write_frame(conn, &Frame::Abort { reason: why }).is_ok() {
        let _ = conn.set_idle_timeout(Some(Duration::from_secs(2)));
        let mut sink = [0u8; 4096];
        while matches!(io::Read::read(conn, &mut sink), Ok(n) if n > 0) {}
    }
}

fn refused_by_source(frame: &Frame, wanted: &'static str) -> Error {
    unexpected_frame(Peer::Source, frame, wanted)
}

/// `: ` and the guest ranges of the regions whose digests differ, when both sides' region
/// digests are known.
fn differing_regions(ours: Option<&[RegionDigest]>, theirs: Option<&[RegionDigest]>) -> String {
    let (Some(ours), Some(theirs)) = (ours, theirs) else {
        return String::new();
    };
    let differ: Vec<String> = ours
        .iter()
        .filter(|r| !theirs.contains(r))
        .map(|r| format!("{:#x}..{:#x}", r.gpa, r.gpa + r.size))
        .collect();
    if differ.is_empty() {
        return String::new();
    }
    format!(" (guest memory differs in {})", differ.join(", "))
}

struct ReaderStats {
    pages: u64,
    zero_pages: u64,
    last_round: u32,
    /// Time spent hashing chunks during the last round and after it.
    last_round_hashing: Duration,
    /// What its zstd stream's decoder held at the end (window and buffers).
    zstd_stream_bytes: u64,
    /// The decoder, handed back to be freed once the guest runs (see [`Transfer::resume`]).
    zstream: Option<ZstdStreamDecoder>,
}

/// A reader's part of the chunk digests: the chunks of the blocks its connection carries.
struct ReaderDigests {
    chunks: Arc<ChunkDigests>,
    reader: usize,
    connections: usize,
}

impl ReaderDigests {
    /// Hashes the stale chunks this reader owns.
    fn sweep(&self, memory: &GuestMemory) -> Result<u64> {
        self.chunks.refresh_where(memory, |region, offset| {
            block_connection(region, offset, self.connections) == self.reader
        })
    }
}

/// The error of a frame whose pages fall outside this VM's memory.
pub(crate) fn outside_memory(e: guestmem_memory::Error) -> Error {
    MigrationError::Unsupported {
        reason: format!(
            "the source sent pages outside this VM's memory: {}",
            error_chain(&e, ": ")
        ),
    }
    .into()
}

/// The 2 MiB block (counted from its region's start, as the source sends them) holding `gpa`.
fn block_of(memory: &GuestMemory, gpa: u64) -> Option<(u64, u64)> {
    let r = memory
        .regions()
        .iter()
        .find(|r| gpa >= r.gpa() && gpa - r.gpa() < r.size())?;
    let start = r.gpa() + (gpa - r.gpa()) / BLOCK * BLOCK;
    Some((start, BLOCK.min(r.gpa() + r.size() - start)))
}

/// Applies one pages connection's frames to guest memory up to its last EndOfRound, Pages
/// frames through `landing` where one is armed (see [`crate::landing`]). With
/// `digests`, it marks the chunks each frame writes stale, and hashes them once the source has
/// moved past their block (a block's frames of one round come together on one connection),
/// and after each round every stale chunk of its blocks (in the first round, those no page was
/// sent to). `corrupt`: see [`ReceiveOptions::corrupt_landing_at`].
fn apply_pages(
    mut conn: Connection,
    memory: &GuestMemory,
    landing: Option<&Landing>,
    digests: Option<&ReaderDigests>,
    corrupt: Option<u64>,
    zstd_window_log: Option<u32>,
) -> (Connection, Result<ReaderStats>) {
    // The connection's zstd stream, as the source announced it: every frame of the stream
    // codec on this connection goes through it, in order.
    let mut zstream = match zstd_window_log.map(ZstdStreamDecoder::new).transpose() {
        Ok(z) => z,
        Err(e) => return (conn, Err(Error::Stream(e))),
    };
    let zeros = vec![0u8; BLOCK as usize];
    // Where a landing is armed, Pages frames are read here and landed from here.
    let mut staging = if landing.is_some() {
        vec![0u8; BLOCK as usize]
    } else {
        Vec::new()
    };
    let mut stats = ReaderStats {
        pages: 0,
        zero_pages: 0,
        last_round: 0,
        last_round_hashing: Duration::ZERO,
        zstd_stream_bytes: 0,
        zstream: None,
    };
    // The block the frames are landing in, and the hashing time of the round so far.
    let mut open: Option<(u64, u64)> = None;
    let mut hashing = Duration::ZERO;
    let landed = |gpa: u64, len: u64, open: &mut Option<(u64, u64)>| -> Result<Duration> {
        let Some(d) = digests else {
            return Ok(Duration::ZERO);
        };
        d.chunks.mark(gpa, len);
        let block = block_of(memory, gpa);
        let t = Instant::now();
        if block != *open {
            if let Some((start, len)) = *open {
                d.chunks.refresh(memory, start, len)?;
            }
            *open = block;
        }
        Ok(t.elapsed())
    };
    // Pages are read from the connection straight into guest memory; the other frames into
    // one buffer kept for all of them.
    let mut buf = Vec::new();
    let result = loop {
        let staged = std::cell::Cell::new(false);
        let (slot, staged_ref) = (&mut staging, &staged);
        let place = move |gpa: u64, len: usize, lend: Lend| {
            // Taken out of the closure, which is called once: the slice may outlive the call.
            let slot = slot;
            if let (Some(_), Lend::Pages { fresh }) = (landing, lend) {
                // Pages that overwrite what is there are read into the staging buffer and
                // landed from it (the range checked first: outside memory, they are declined).
                if len <= slot.len() && memory.find(gpa, len as u64).is_ok() {
                    let s = &mut slot[..len];
                    if fresh {
                        s.fill(0);
                    }
                    staged_ref.set(true);
                    return Some(s);
                }
            }
            // SAFETY: the VM does not run before the rounds end, and each 2 MiB block travels
            // on one connection only (a frame never crosses a block), so no other thread
            // touches these bytes while they are read (or patched by a delta); a damaged
            // frame fails the migration, and this memory is thrown away with the VM.
            unsafe { memory.bytes_mut(gpa, len as u64) }.ok()
        };
        let frame = match Frame::read_into_stream(&mut conn, &mut buf, zstream.as_mut(), place) {
            Ok(FrameRef::Placed { gpa, len, .. } | FrameRef::Patched { gpa, len }) => {
                if let (true, Some(landing)) = (staged.get(), landing) {
                    if let Err(e) = landing.land(memory, gpa, &staging[..len]) {
                        break Err(e);
                    }
                }
                stats.pages += len as u64 / PAGE_SIZE;
                if let Some(at) = corrupt.filter(|&at| at >= gpa && at - gpa < len as u64) {
                    let flipped = memory.read_u64(at).map(|w| w ^ 1);
                    if let Err(e) = flipped.and_then(|w| memory.write_u64(at, w)) {
                        break Err(e.into());
                    }
                }
                match landed(gpa, len as u64, &mut open) {
                    Ok(t) => hashing += t,
                    Err(e) => break Err(e),
                }
                continue;
            }
            Ok(FrameRef::Pages { gpa, pages, .. }) => {
                // `place` declined them: they are not inside this VM's memory.
                break Err(MigrationError::Unsupported {
                    reason: format!(
                        "the source sent {} bytes of pages at {gpa:#x}, outside this VM's memory",
                        pages.len()
                    ),
                }
                .into());
            }
            Ok(FrameRef::Frame(f)) => f,
            Err(e) => break Err(Error::Stream(e)),
        };
        let applied = match frame {
            Frame::Zero { gpa, count } => {
                stats.zero_pages += count;
                let mut done = 0;
                let mut r = Ok(());
                while done < count * PAGE_SIZE && r.is_ok() {
                    let n = (count * PAGE_SIZE - done).min(BLOCK);
                    r = match landing {
                        Some(l) => l.zero(memory, gpa + done, n),
                        None => memory
                            .write(gpa + done, &zeros[..n as usize])
                            .map_err(outside_memory),
                    };
                    done += n;
                }
                if r.is_ok() {
                    match landed(gpa, count * PAGE_SIZE, &mut open) {
                        Ok(t) => hashing += t,
                        Err(e) => break Err(e),
                    }
                }
                r
            }
            Frame::EndOfRound { round, last } => {
                stats.last_round = round;
                // Everything before it is in guest memory: say so (unless it is the last), so
                // that the source times its rounds (and pauses the guest) on what is applied,
                // not what is buffered; then hash what is stale, while the next round comes.
                if !last {
                    if let Err(e) = write_frame(&mut conn, &Frame::EndOfRound { round, last }) {
                        break Err(e);
                    }
                }
                if let Some(d) = digests {
                    let t = Instant::now();
                    let swept = open
                        .take()
                        .map_or(Ok(0), |(start, len)| d.chunks.refresh(memory, start, len))
                        .and_then(|a| d.sweep(memory).map(|b| a + b));
                    let took = t.elapsed();
                    hashing += took;
                    match swept {
                        Ok(bytes) => tracing::debug!(
                            round,
                            reader = d.reader,
                            in_round_ms = (hashing - took).as_secs_f64() * 1e3,
                            after_mib = bytes >> 20,
                            after_ms = took.as_secs_f64() * 1e3,
                            "chunk digests hashed"
                        ),
                        Err(e) => break Err(e),
                    }
                }
                if last {
                    stats.last_round_hashing = hashing;
                    stats.zstd_stream_bytes =
                        zstream.as_ref().map_or(0, |z| z.memory_bytes() as u64);
                    stats.zstream = zstream.take();
                    break Ok(());
                }
                hashing = Duration::ZERO;
                Ok(())
            }
            other => break Err(refused_by_source(&other, "pages")),
        };
        if let Err(e) = applied {
            break Err(e);
        }
    };
    (conn, result.map(|()| stats))
}

/// Discards the stale chunks of each RAM region and starts its pager (nothing fetches until
/// the link opens, after Running).
fn arm_postcopy(
    vm: &impl TargetMachine,
    shared: &[String],
    stale: &[StaleChunks],
    links: &Links,
    opts: &ReceiveOptions,
    heartbeat: Duration,
) -> Result<(Arc<PostcopyLink>, Vec<Pager>)> {
    let link = Arc::new(PostcopyLink::new(
        links.pages.len(),
        links.urgent.len(),
        opts.resume_timeout,
        heartbeat,
    ));
    let mut pagers = Vec::new();
    for region in vm
        .memory()
        .regions()
        .iter()
        .filter(|r| r.gpa() != layout::SYS_GPA && !shared.contains(&r.name().to_string()))
    {
        let bits = stale
            .iter()
            .find(|s| s.gpa == region.gpa())
            .ok_or_else(|| MigrationError::Unsupported {
                reason: format!("the State says nothing of region '{}'", region.name()),
            })?
            .bits
            .as_deref();
        let chunk = POSTCOPY_FAULT_BYTES.max(region.backend().page_size());
        let is_stale = |offset: u64| match bits {
            None => true,
            Some(bits) => {
                (offset / POSTCOPY_CHUNK..(offset + chunk).div_ceil(POSTCOPY_CHUNK)).any(|c| {
                    bits.get((c / 64) as usize)
                        .is_some_and(|w| w >> (c % 64) & 1 != 0)
                })
            }
        };
        if bits.is_some() {
            let slots = vm.memory().memslots().expect("a VM's memory is registered");
            // One discard per run of stale chunks (each discard is a memslot change).
            let mut run: Option<u64> = None;
            let ends = (0..region.size())
                .step_by(chunk as usize)
                .chain([region.size()]);
            for offset in ends {
                let stale = offset < region.size() && is_stale(offset);
                match (run, stale) {
                    (None, true) => run = Some(offset),
                    (Some(start), false) => {
                        slots.discard(region.gpa() + start, offset - start)?;
                        run = None;
                    }
                    _ => {}
                }
            }
        }
        let chunks = region.size().div_ceil(chunk) as usize;
        let config = PagerConfig {
            uffds: vm.vcpu_count().clamp(1, chunks),
            handlers: opts.handlers.max(1),
            fault_around: chunk,
            readahead_chunks: 2,
            background: true,
            fetch_attempts: 1,
            retry_delay: Duration::from_millis(1),
            abort: vm.abort_handle(),
            realtime_handlers: true,
            cpus: opts.fault_cpus.clone(),
            ..Default::default()
        };
        let source = RegionSource {
            link: link.clone(),
            gpa: region.gpa(),
            size: region.size(),
        };
        pagers.push(Pager::start_partial(
            region,
            Arc::new(source),
            &config,
            &|offset| !is_stale(offset),
        )?);
    }
    Ok((link, pagers))
}

impl Transfer {
    /// Runs the received VM's vCPUs ([`TargetMachine::resume`]), tells the source (the
    /// downtime ends), and, in post-copy, opens the link to the pagers.
    pub fn resume<'v, M: TargetMachine>(&mut self, vm: &'v mut M) -> Result<M::Running<'v>> {
        let mut links = self.links.take().ok_or(MigrationError::AlreadyResumed)?;
        let running = vm.resume()?;
        self.running_at = Some(Instant::now());
        write_frame(&mut links.pages[0], &Frame::Running)?;
        if !self.streams.is_empty() {
            crate::stream::free_aside(std::mem::take(&mut self.streams));
        }
        match &self.postcopy {
            None => {
                let json = serde_json::to_vec(&self.report).expect("a report serializes");
                write_frame(&mut links.pages[0], &Frame::Complete { report_json: json })?;
            }
            Some(p) => {
                p.link.open(links)?;
                let link = p.link.clone();
                let listener = p.listener.clone();
                let migration = p.migration;
                std::thread::Builder::new()
                    .name("postcopy-keeper".into())
                    .spawn(move || link.keep(&listener, migration))
                    .map_err(|e| link_error("spawning the link keeper", e))?;
            }
        }
        Ok(running)
    }

    /// The migration's mode.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Post-copy: memory still to arrive, in bytes (0 once everything is resident).
    pub fn missing_bytes(&self) -> u64 {
        self.postcopy.as_ref().map_or(0, |p| {
            p.pagers
                .iter()
                .map(|pager| {
                    let s = pager.stats();
                    if s.retired {
                        0
                    } else {
                        pager.size().saturating_sub(s.resident_bytes)
                    }
                })
                .sum()
        })
    }

    /// Waits until the transfer is over (post-copy: every page resident, the source told), and
    /// returns the destination's figures. A post-copy whose source is gone for good ends with
    /// the error (and the VM, stopped by it, names the guest address it missed).
    pub fn finish(mut self) -> Result<DestinationReport> {
        let Some(p) = self.postcopy.take() else {
            return Ok(self.report);
        };
        let started = Instant::now();
        loop {
            let mut all = true;
            for pager in &p.pagers {
                if !pager.wait_resident(Duration::from_millis(50))? {
                    all = false;
                }
            }
            if all {
                break;
            }
        }
        let mut report = self.report.clone();
        // From Running to the last pager's retirement, however late `finish` is called (not
        // the time `finish` waited: ~0 when the guest ran for longer than post-copy took).
        let retired = p.pagers.iter().filter_map(Pager::retired_at).max();
        report.resident_ms = match (self.running_at, retired) {
            (Some(running), Some(retired)) => retired.saturating_duration_since(running),
            _ => started.elapsed(),
        }
        .as_secs_f64()
            * 1e3;
        report.faults = p.pagers.iter().map(|pg| pg.stats().faults).sum();
        p.link.fill_report(&mut report);
        let json = serde_json::to_vec(&report).expect("a report serializes");
        p.link.close(&json)?;
        Ok(report)
    }
}

/// The destination's end of the post-copy link: lock-step requests on the pages connections
/// (background fetches) and the urgent ones (faults), and their re-establishment after a
/// break.
struct PostcopyLink {
    /// Pages connections, then urgent ones.
    slots: Vec<Mutex<Slot>>,
    pages: usize,
    cutters: Mutex<Vec<Cutter>>,
    state: Mutex<LinkState>,
    changed: Condvar,
    resume_timeout: Duration,
    /// A connection quiet for this long carries a heartbeat.
    heartbeat: Duration,
    next_urgent: AtomicUsize,
    /// Fault fetch latencies, in µs.
    latencies: Mutex<Vec<u32>>,
    background_fetches: AtomicU64,
    bytes: AtomicU64,
}

/// One connection of the post-copy link.
#[derive(Default)]
struct Slot {
    /// `None` while the link is down (or not yet open).
    conn: Option<Connection>,
    /// What the source's answers are read into, kept from one fetch to the next (decoding
    /// each answer afresh cost two 128 KiB allocations, one zeroed, and a copy: the first
    /// fetches of a connection paid for fresh mappings too).
    frame: Vec<u8>,
    /// When the connection last carried a request (a quiet one carries a heartbeat).
    used: Option<Instant>,
}

#[derive(Default)]
struct LinkState {
    generation: u64,
    broken: bool,
    closed: bool,
    breaks: u32,
}

impl PostcopyLink {
    fn new(
        pages: usize,
        urgent: usize,
        resume_timeout: Duration,
        heartbeat: Duration,
    ) -> PostcopyLink {
        PostcopyLink {
            slots: (0..pages + urgent)
                .map(|_| Mutex::new(Slot::default()))
                .collect(),
            pages,
            cutters: Mutex::new(Vec::new()),
            state: Mutex::new(LinkState::default()),
            changed: Condvar::new(),
            resume_timeout,
            heartbeat,
            next_urgent: AtomicUsize::new(0),
            latencies: Mutex::new(Vec::new()),
            background_fetches: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
        }
    }

    /// Puts `links` in service (at the start, and after each re-establishment).
    fn open(&self, links: Links) -> Result<()> {
        let cutters = links.cutters()?;
        if links.pages.len() + links.urgent.len() != self.slots.len() {
            return Err(MigrationError::Reconnection {
                pages: links.pages.len(),
                urgent: links.urgent.len(),
                expected: self.slots.len(),
            }
            .into());
        }
        for (slot, conn) in self
            .slots
            .iter()
            .zip(links.pages.into_iter().chain(links.urgent))
        {
            let mut slot = slot.lock().unwrap_or_else(|e| e.into_inner());
            slot.conn = Some(conn);
            slot.used = Some(Instant::now());
        }
        *self.cutters.lock().unwrap_or_else(|e| e.into_inner()) = cutters;
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.generation += 1;
        st.broken = false;
        self.changed.notify_all();
        Ok(())
    }

    /// Fetches `buf.len()` bytes at `gpa` from the source, waiting out a broken link (up to the
    /// resume timeout).
    fn fetch(&self, gpa: u64, buf: &mut [u8], urgent: bool) -> io::Result<()> {
        let started = Instant::now();
        loop {
            let generation = self.generation();
            let urgent_count = self.slots.len() - self.pages;
            let index = if urgent && urgent_count > 0 {
                self.pages + self.next_urgent.fetch_add(1, Ordering::Relaxed) % urgent_count
            } else {
                (gpa / BLOCK) as usize % self.pages
            };
            {
                let mut guard = self.slots[index].lock().unwrap_or_else(|e| e.into_inner());
                let slot = &mut *guard;
                if let Some(conn) = slot.conn.as_mut() {
                    let asked = Instant::now();
                    let answered = request(conn, &mut slot.frame, gpa, buf);
                    slot.used = Some(Instant::now());
                    match answered {
                        Ok(()) => {
                            self.bytes.fetch_add(buf.len() as u64, Ordering::Relaxed);
                            if urgent {
                                let us = asked.elapsed().as_micros().min(u32::MAX as u128);
                                self.latencies
                                    .lock()
                                    .unwrap_or_else(|e| e.into_inner())
                                    .push(us as u32);
                            } else {
                                self.background_fetches.fetch_add(1, Ordering::Relaxed);
                            }
                            return Ok(());
                        }
                        Err(e) => {
                            slot.conn = None;
                            drop(guard);
                            self.break_link(&e);
                        }
                    }
                }
            }
            self.wait_for_new_link(generation, started)?;
        }
    }

    fn generation(&self) -> u64 {
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .generation
    }

    /// Waits until the link is re-established after `generation` (up to the resume timeout
    /// since `started`), or closed.
    fn wait_for_new_link(&self, generation: u64, started: Instant) -> io::Result<()> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        while st.generation == generation && !st.closed {
            let waited = started.elapsed();
            if waited >= self.resume_timeout {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "the post-copy link to the source has been down for {:.0} s (run \
                         `guestmem migrate resume` on the source to re-establish it)",
                        waited.as_secs_f64()
                    ),
                ));
            }
            st = self
                .changed
                .wait_timeout(st, self.resume_timeout - waited)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        if st.closed {
            return Err(io::Error::other("the post-copy link is closed"));
        }
        Ok(())
    }

    fn break_link(&self, e: &Error) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if !st.broken && !st.closed {
            st.broken = true;
            st.breaks += 1;
            tracing::warn!(
                "post-copy link broken ({}); waiting for the source to resume it",
                error_chain(e, ": ")
            );
            for c in self
                .cutters
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
            {
                c.cut();
            }
            self.changed.notify_all();
        }
    }

    /// The keeper: after each break, accepts the source's new connections and opens them.
    fn keep(&self, listener: &Arc<Listener>, migration: u64) {
        loop {
            // While the link is up: heartbeats on its quiet connections.
            loop {
                let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
                if st.closed {
                    return;
                }
                if st.broken {
                    break;
                }
                let st = self
                    .changed
                    .wait_timeout(st, self.heartbeat / 2)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
                let up = !st.broken && !st.closed;
                drop(st);
                if up {
                    self.heartbeat();
                }
            }
            let gate = Gate::of(listener);
            let closed = || self.state.lock().unwrap_or_else(|e| e.into_inner()).closed;
            match gate
                .collect(Some(migration), listener.timeouts(), &closed)
                .and_then(|links| match links {
                    Some((links, _)) => self.open(links),
                    None => Ok(()),
                }) {
                Ok(()) => tracing::info!("post-copy link re-established"),
                Err(e) => tracing::warn!(
                    "a connection while resuming post-copy: {}",
                    error_chain(&e, ": ")
                ),
            }
        }
    }

    /// A one-page request (of the sys region, never fetched otherwise: the source does not
    /// count it) on each connection that carried nothing for the heartbeat interval
    /// ([`HEARTBEAT_INTERVAL`], or a quarter of a shorter idle timeout) and is
    /// not in use, so that the source's idle timeout tells a quiet destination from a dead one.
    fn heartbeat(&self) {
        for slot in &self.slots {
            let mut guard = match slot.try_lock() {
                Ok(g) => g,
                Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
                // A fetch is in flight: not quiet.
                Err(std::sync::TryLockError::WouldBlock) => continue,
            };
            let slot = &mut *guard;
            let Some(conn) = slot.conn.as_mut() else {
                continue;
            };
            if slot.used.is_some_and(|t| t.elapsed() < self.heartbeat) {
                continue;
            }
            let mut page = vec![0u8; PAGE_SIZE as usize];
            let answered = request(conn, &mut slot.frame, layout::SYS_GPA, &mut page);
            slot.used = Some(Instant::now());
            if let Err(e) = answered {
                slot.conn = None;
                drop(guard);
                self.break_link(&e);
                return;
            }
        }
    }

    fn fill_report(&self, report: &mut DestinationReport) {
        let mut lat: Vec<Duration> = self
            .latencies
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|&us| Duration::from_micros(us.into()))
            .collect();
        lat.sort();
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        report.fault_fetches = lat.len() as u64;
        report.fault_latency_p50_us = us(percentile(&lat, 50.0));
        report.fault_latency_p99_us = us(percentile(&lat, 99.0));
        report.fault_latency_max_us = us(lat.last().copied().unwrap_or_default());
        report.background_fetches = self.background_fetches.load(Ordering::Relaxed);
        report.postcopy_bytes = self.bytes.load(Ordering::Relaxed);
        report.link_breaks = self.state.lock().unwrap_or_else(|e| e.into_inner()).breaks;
    }

    /// Says Complete on every connection (waiting out a broken link), then closes the link.
    fn close(&self, report_json: &[u8]) -> Result<()> {
        let started = Instant::now();
        let mut done = Vec::new();
        for slot in &self.slots {
            loop {
                let generation = self.generation();
                {
                    let mut s = slot.lock().unwrap_or_else(|e| e.into_inner());
                    if let Some(conn) = s.conn.as_mut() {
                        let frame = Frame::Complete {
                            report_json: report_json.to_vec(),
                        };
                        match write_frame(conn, &frame) {
                            Ok(()) => {
                                // Out of the slot: no heartbeat follows the Complete.
                                done.extend(s.conn.take());
                                break;
                            }
                            Err(e) => {
                                s.conn = None;
                                drop(s);
                                self.break_link(&e);
                            }
                        }
                    }
                }
                self.wait_for_new_link(generation, started)
                    .map_err(|source| MigrationError::SourceGone { source })?;
            }
        }
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.closed = true;
        self.changed.notify_all();
        drop(st);
        for mut conn in done {
            let _ = conn.flush();
        }
        Ok(())
    }
}

/// One lock-step request: `buf.len()` bytes at `gpa`, in pieces of at most [`MAX_REQUEST`]
/// (each answer read into `frame`).
fn request(
    conn: &mut (impl io::Read + Write),
    frame: &mut Vec<u8>,
    gpa: u64,
    buf: &mut [u8],
) -> Result<()> {
    for (i, piece) in buf.chunks_mut(MAX_REQUEST as usize).enumerate() {
        let at = gpa + (i * MAX_REQUEST as usize) as u64;
        write_frame(
            conn,
            &Frame::Request {
                gpa: at,
                len: piece.len() as u32,
            },
        )?;
        // The answer's pages go straight into `piece` (on an error it is not used).
        let want = piece.len();
        let zero = {
            let slot = &mut *piece;
            let place = move |gpa: u64, len: usize, lend: Lend| {
                (gpa == at && len == want && lend != Lend::Patch).then_some(slot)
            };
            match Frame::read_into(conn, frame, place).map_err(Error::Stream)? {
                // Fresh pages would have left `piece`'s older bytes in their zero lines.
                FrameRef::Placed { fresh: false, .. } => false,
                FrameRef::Frame(Frame::Zero { gpa, count })
                    if gpa == at && count * PAGE_SIZE == want as u64 =>
                {
                    true
                }
                other => {
                    return Err(MigrationError::BadAnswer {
                        gpa: at,
                        len: want as u64,
                        got: match &other {
                            FrameRef::Placed { fresh: true, .. } => "fresh Pages",
                            FrameRef::Pages { .. } | FrameRef::Placed { .. } => "Pages",
                            // An answer is never a delta: the pager's buffer is not the
                            // version one would be made against.
                            FrameRef::Patched { .. } => "PagesD",
                            FrameRef::Frame(f) => frame_name(f),
                        },
                    }
                    .into());
                }
            }
        };
        if zero {
            piece.fill(0);
        }
    }
    Ok(())
}

/// One RAM region's bytes, fetched from the migration source.
struct RegionSource {
    link: Arc<PostcopyLink>,
    gpa: u64,
    size: u64,
}

impl PageSource for RegionSource {
    fn fetch(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.link.fetch(self.gpa + offset, buf, true)
    }
    fn fetch_background(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.link.fetch(self.gpa + offset, buf, false)
    }
    fn size(&self) -> u64 {
        self.size
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A source that has its answers ready: reads come from them, writes (the requests) are
    /// kept.
    struct Answers {
        answers: io::Cursor<Vec<u8>>,
        requests: Vec<u8>,
    }

    impl io::Read for Answers {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.answers.read(buf)
        }
    }

    impl Write for Answers {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.requests.write(buf)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn ask(answer: Frame, buf: &mut [u8]) -> Result<()> {
        let mut conn = Answers {
            answers: io::Cursor::new(answer.encode().unwrap()),
            requests: Vec::new(),
        };
        let r = request(&mut conn, &mut Vec::new(), 0x4000, buf);
        assert_eq!(
            Frame::read_from(&mut &conn.requests[..]).unwrap(),
            Frame::Request {
                gpa: 0x4000,
                len: buf.len() as u32
            }
        );
        r
    }

    /// A post-copy answer lands whole in the pager's buffer, zero lines written over its older
    /// bytes; a fresh answer (which would leave them) is refused, naming it.
    #[test]
    fn postcopy_answers_overwrite_the_buffer_and_fresh_ones_are_refused() {
        let mut pages = vec![0u8; 2 * PAGE_SIZE as usize];
        pages[0] = 7;
        pages[PAGE_SIZE as usize + 100] = 9;
        let mut buf = vec![0xaau8; pages.len()];
        ask(
            Frame::Pages {
                gpa: 0x4000,
                pages: pages.clone(),
                fresh: false,
            },
            &mut buf,
        )
        .unwrap();
        assert_eq!(buf, pages);
        let mut buf = vec![0xaau8; pages.len()];
        let e = ask(
            Frame::Pages {
                gpa: 0x4000,
                pages,
                fresh: true,
            },
            &mut buf,
        )
        .unwrap_err();
        assert!(e.to_string().contains("answered fresh Pages"), "{e}");
    }
}
