//! The destination side of a live migration (see [`crate::migrate`] for the protocol).
//!
//! Its modules: `gate` (the admission of connections, one migration at a time), this one
//! (the setup: the VM built and checked, the rounds received, the switch-over's State taken),
//! `pages` (pre-copy's pages landing), `postcopy` (the pagers and the post-copy link) and
//! `resume` (after the switch-over).

mod gate;
mod pages;
mod postcopy;
mod resume;

pub(crate) use gate::{Claim, Gate};
use pages::{apply_pages, ReaderDigests};
use postcopy::{arm_postcopy, PostcopyLink};

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use guestmem_memory::{Backend, GuestMemory, PAGE_SIZE};
use guestmem_paging::affinity::CpuSet;
use guestmem_paging::{Pager, UserfaultPager};
use guestmem_vm::Vm;
use serde::{Deserialize, Serialize};

use crate::chunk_digests::{self, memory_digest, ChunkDigests, RegionDigest};
use crate::component::Components;
use crate::landing::Landing;
use crate::protocol::{
    link_error, read_frame, read_json, unexpected_frame, write_frame, Links, Mode, Setup,
    Switchover, BLOCK, FORMAT, HEARTBEAT_INTERVAL,
};
use crate::stream::{Frame, ZstdStreamDecoder};
use crate::transport::{Cutter, Listener};
use crate::{error_chain, Error, MigrationError, Peer, Result};
use guestmem_contract::{MachineBuilder, TargetMachine, VmBuilder};

/// Post-copy, after the link broke: how long the destination's vCPUs wait for the source to
/// reconnect (it tries every second by itself, and `guestmem migrate resume` can point it
/// elsewhere) before the VM stops with an error. Longer than the source takes to give up on an
/// unresponsive destination (twice [`crate::protocol::DEAD_PEER_TIMEOUT`]), so that the side
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
    /// background fetch; [`PagerConfig::cpus`](guestmem_paging::PagerConfig::cpus)). See [`SendOptions::fault_cpus`] for the
    /// source's side. `None`: wherever the scheduler puts them.
    ///
    /// [`SendOptions::fault_cpus`]: crate::protocol::SendOptions::fault_cpus
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
    /// guest_memfd regions, paged through KVM Userfault.
    userfault_pagers: Vec<UserfaultPager>,
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
            // Found by trying a userfault memslot on a VM of its own (see UserfaultPager).
            let missing = match guestmem_sys::probe::kvm_userfault_on_a_new_vm() {
                Ok(u) if u.present => None,
                Ok(u) => Some(u.detail),
                Err(e) => Some(e),
            };
            if let Some(why) = missing {
                return Err(refuse(
                    &mut links,
                    unsupported(format!(
                        "{} of guest_memfd region '{}' needs KVM Userfault (KVM_MEM_USERFAULT, \
                         KVM_CAP_USERFAULT), which this kernel lacks ({why}): migrate it with \
                         pre-copy",
                        setup.mode, r.name
                    )),
                ));
            }
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
    // Post-copy demand pages every region: one the kernel cannot serve (guest_memfd without
    // userfaultfd on its mapping) is refused here, found by trying, before any page moves.
    if setup.mode.has_postcopy() {
        for region in memory.regions() {
            if let Err(e) = guestmem_paging::check_demand_paging(region) {
                return Err(refuse(
                    &mut links,
                    unsupported(format!(
                        "{} cannot demand page its memory here: {}: migrate it with pre-copy",
                        setup.mode,
                        error_chain(&e, ": ")
                    )),
                ));
            }
        }
    }
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
            Ok((link, pagers, userfault_pagers)) => Some(Postcopy {
                link,
                pagers,
                userfault_pagers,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_regions_whose_digests_differ_are_named_when_both_sides_know_them() {
        let region = |gpa, digest| RegionDigest {
            gpa,
            size: 0x1000,
            digest,
        };
        let ours = [region(0x1000, 1), region(0x4000, 2), region(0x9000, 3)];
        let theirs = [region(0x1000, 1), region(0x4000, 5), region(0x9000, 6)];
        assert_eq!(
            differing_regions(Some(&ours), Some(&theirs)),
            " (guest memory differs in 0x4000..0x5000, 0x9000..0xa000)"
        );
        assert_eq!(differing_regions(Some(&ours), Some(&ours)), "");
        assert_eq!(differing_regions(Some(&ours), None), "");
    }
}
