//! The destination side of a live migration (see [`crate::migrate`] for the protocol).
//!
//! Its modules: `gate` (the admission of connections, one migration at a time), this one
//! (the setup: the VM built and checked, the rounds received, the switch-over's State taken),
//! `pages` (pre-copy's pages landing), `postcopy` (the pagers and the post-copy link) and
//! `resume` (after the switch-over).

mod gate;
mod pages;
mod postcopy;
mod progress;
mod resume;

pub(crate) use gate::{Claim, Gate};
use postcopy::{arm_postcopy, PostcopyLink};

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
    Switchover, BLOCK, HEARTBEAT_INTERVAL,
};
use crate::stream::{Frame, ZstdStreamDecoder};
use crate::transport::Listener;
use crate::{error_chain, Error, MigrationError, Peer, Result};
use guestmem_contract::{MachineBuilder, SharedFiles, TargetMachine, VmBuilder};

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
    /// Where the receive's progress records go ([`guestmem_events::Event`], operation
    /// `migrate-receive`): setup, precopy (bytes placed, round) and stopped while the rounds
    /// come; then completed, or postcopy (resident bytes, faults, fault latency; postcopy-paused
    /// while the link is broken) until [`Transfer::finish`] says completed; or failed with the
    /// error. `None`: none are made.
    pub events: Option<guestmem_events::Sink>,
}

impl Default for ReceiveOptions {
    fn default() -> Self {
        ReceiveOptions {
            resume_timeout: RESUME_TIMEOUT,
            handlers: 2,
            fault_cpus: None,
            corrupt_landing_at: None,
            events: None,
        }
    }
}

/// What the destination saw (sent back to the source in the Complete, as JSON). Format: a
/// change bumps [`crate::migrate::PROTOCOL`]; fields may only be added, with
/// `#[serde(default)]`: guestmem 0.1.0 and 0.2.0 read it and pass over fields they do not
/// know, and their reports lack the newer ones.
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
    /// Their latencies as a histogram: `(bound, count)` per power-of-two bucket of µs, the
    /// fetches that took more than half `bound` and at most `bound`, buckets in order, empty
    /// ones left out (absent from the reports of guestmem 0.2.0 and before: empty).
    #[serde(default)]
    pub fault_latency_buckets_us: Vec<(u64, u64)>,
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
    /// Connections whose TLS records the kernel encrypted and decrypted (kernel TLS), of all
    /// the migration's connections.
    #[serde(default)]
    pub kernel_tls_connections: usize,
    /// What the Hellos agreed on: protocol, features, the source's guestmem (absent from
    /// guestmem 0.1.0's report).
    #[serde(default)]
    pub negotiated: Option<crate::negotiate::Negotiated>,
}

/// A VM received up to the switch-over: its memory (or, in post-copy, its pagers) and vCPU
/// state are in place. Resume it with [`Transfer::resume`], then [`Transfer::finish`]. `M` is
/// the VM the destination's [`MachineBuilder`] built (guestmem's own `Vm` by default).
#[derive(Debug)]
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
    /// The progress records, if asked for, and post-copy's ticker.
    progress: Option<progress::RxProgress>,
    ticker: Option<guestmem_events::Ticker>,
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

impl std::fmt::Debug for Transfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transfer")
            .field("mode", &self.mode)
            .field("postcopy", &self.postcopy.is_some())
            .field("running_at", &self.running_at)
            .field("report", &self.report)
            .finish_non_exhaustive()
    }
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
    let reporter = guestmem_events::Reporter::maybe(
        opts.events.as_ref(),
        guestmem_events::Operation::MigrateReceive,
    );
    let mut progress = reporter.map(|reporter| progress::RxProgress {
        reporter,
        total: 0,
        received: 0,
    });
    let received = receive_reported(listener, opts, builder, components, &mut progress);
    let Some(mut p) = progress else {
        return received;
    };
    match received {
        Err(e) => {
            p.failed(&e);
            Err(e)
        }
        Ok(mut incoming) => {
            p.received = incoming.transfer.report.pages_received * PAGE_SIZE;
            p.emit(guestmem_events::Status::Stopped);
            incoming.transfer.progress = Some(p);
            Ok(incoming)
        }
    }
}

/// [`receive_into`], its progress told to `progress` (which learns the guest's size).
fn receive_reported<B: MachineBuilder>(
    listener: Arc<Listener>,
    opts: &ReceiveOptions,
    builder: &mut B,
    components: &mut Components<'_>,
    progress: &mut Option<progress::RxProgress>,
) -> Result<Incoming<B::Machine>> {
    check_fault_cpus(opts)?;
    let (mut rx, claim) = Receiving::admit(&listener)?;
    let mut vm = rx.build(builder)?;
    let memory = vm.memory().clone();
    if let Some(p) = progress {
        p.total = memory.regions().iter().map(|r| r.size()).sum();
        p.emit(guestmem_events::Status::Setup);
    }
    rx.say_hello()?;
    let mut report = DestinationReport {
        mode: Some(rx.setup.mode),
        kernel_tls_connections: rx.links.kernel_tls_connections(),
        negotiated: Some(rx.links.negotiated.clone()),
        ..Default::default()
    };
    let chunks = chunk_digests_of(&rx.setup, &memory);
    let chunks = rx.or_refuse(chunks)?;
    let landing = arm_landing(&rx.setup, &memory);
    let rounds = rx.receive_rounds(
        &memory,
        chunks.as_ref(),
        landing,
        (opts, progress.as_ref()),
        &mut report,
    )?;
    let verified = verify(
        &rx.setup,
        &memory,
        chunks.as_deref(),
        rounds.last_round_hashing,
    )?;

    let switchover = rx.read_switchover()?;
    if let Some(r) = rounds
        .last_rounds
        .iter()
        .find(|&&r| r != switchover.last_round)
    {
        return Err(rx.refuse(unsupported(format!(
            "a pages connection ended at round {r}, the State says {}",
            switchover.last_round
        ))));
    }
    report.rounds = switchover.last_round;
    if let Err(e) = vm.restore(&switchover.state) {
        return Err(rx.refuse(unsupported(format!(
            "the vCPU state does not load: {}",
            error_chain(&e, ": ")
        ))));
    }
    rx.check_digest(&switchover, verified, &memory, &mut report)?;
    let postcopy = rx.arm_postcopy(&vm, &switchover, opts, listener)?;
    rx.await_go(components, &switchover)?;
    Ok(Incoming {
        vm,
        transfer: Transfer {
            mode: rx.setup.mode,
            links: Some(rx.links),
            postcopy,
            report,
            running_at: None,
            progress: None,
            ticker: None,
            streams: rounds.streams,
            _claim: claim,
            _memory: memory,
        },
    })
}

/// The fault CPUs asked for, checked before any connection is taken.
fn check_fault_cpus(opts: &ReceiveOptions) -> Result<()> {
    if let Some(cpus) = &opts.fault_cpus {
        CpuSet::new(cpus).map_err(|e| MigrationError::BadOption {
            option: "fault_cpus",
            reason: format!("fault CPUs: {e}"),
        })?;
    }
    Ok(())
}

/// A migration being received, up to the switch-over: its connections and the source's setup.
struct Receiving {
    links: Links,
    setup: Setup,
}

impl Receiving {
    /// Admits one migration on `listener` (see [`Gate::collect`]) and reads its setup, which
    /// is refused here if this destination cannot take it.
    fn admit(listener: &Arc<Listener>) -> Result<(Receiving, Claim)> {
        let gate = Gate::of(listener);
        let (mut links, claim) = gate
            .collect(None, listener.timeouts(), &|| false)?
            .expect("a receive is never stopped");
        let claim = claim.expect("a new migration claims the destination");
        let setup: Setup = read_json(&mut links.pages[0], "VM setup")?;
        let mut rx = Receiving { links, setup };
        if let Err(e) = check_setup(&rx.setup, rx.links.negotiated.state_format()) {
            return Err(rx.refuse(e));
        }
        Ok((rx, claim))
    }

    /// `e`, told to the source (which keeps the guest), causes included.
    fn refuse(&mut self, e: MigrationError) -> Error {
        let reason = error_chain(&e, ": ");
        let _ = write_frame(&mut self.links.pages[0], &Frame::Abort { reason });
        Error::Migration(e)
    }

    /// `r`, its error refused (see [`Receiving::refuse`]).
    fn or_refuse<T>(&mut self, r: std::result::Result<T, MigrationError>) -> Result<T> {
        r.map_err(|e| self.refuse(e))
    }

    /// The VM `builder` builds from the setup's configuration (with the source's memory files,
    /// if it shares any), its memory checked and prepared for the rounds.
    fn build<B: MachineBuilder>(&mut self, builder: &mut B) -> Result<B::Machine> {
        let mut shared = SharedFiles::new();
        if !self.setup.shared.is_empty() {
            write_frame(&mut self.links.pages[0], &Frame::Ready)?;
            let fds = self.links.pages[0]
                .recv_fds(self.setup.shared.len())
                .map_err(|e| link_error("receiving the source's memory files", e))?;
            shared.extend(self.setup.shared.iter().cloned().zip(fds));
        }
        let vm = match builder.build(&self.setup.config, shared) {
            Ok(vm) => vm,
            Err(e) => {
                return Err(self.refuse(unsupported(format!(
                    "it cannot be built here: {}",
                    error_chain(&e, ": ")
                ))))
            }
        };
        if let Err(e) = prepare_memory(vm.memory(), self.setup.mode) {
            return Err(self.refuse(e));
        }
        Ok(vm)
    }

    /// The destination's Hello, once its VM is built: the source may send the rounds.
    fn say_hello(&mut self) -> Result<()> {
        let hello_back = serde_json::json!({ "guestmem_version": env!("CARGO_PKG_VERSION") });
        write_frame(
            &mut self.links.pages[0],
            &Frame::Hello {
                config_json: hello_back.to_string().into_bytes(),
            },
        )
    }

    /// The switch-over's State, read after the rounds.
    fn read_switchover(&mut self) -> Result<Switchover> {
        match read_frame(&mut self.links.pages[0])? {
            Frame::State { state_json } => match serde_json::from_slice(&state_json) {
                Ok(s) => Ok(s),
                Err(source) => Err(self.refuse(MigrationError::BadMessage {
                    peer: Peer::Source,
                    what: "State",
                    source,
                })),
            },
            other => Err(refused_by_source(&other, "State")),
        }
    }

    /// The memory digest compared with the source's, when the State carries one (computed now
    /// if the setup did not announce it); a difference refuses the migration.
    fn check_digest(
        &mut self,
        switchover: &Switchover,
        verified: Option<Verified>,
        memory: &GuestMemory,
        report: &mut DestinationReport,
    ) -> Result<()> {
        let Some(expected) = switchover.digest else {
            return Ok(());
        };
        let Verified {
            digest,
            regions,
            took,
        } = match verified {
            Some(v) => v,
            // A source that did not say so in its setup.
            None => {
                let started = Instant::now();
                Verified {
                    digest: memory_digest(memory)?,
                    regions: None,
                    took: started.elapsed(),
                }
            }
        };
        report.verify_ms = took.as_secs_f64() * 1e3;
        report.digest = Some(digest);
        if digest != expected {
            let which = differing_regions(regions.as_deref(), switchover.region_digests.as_deref());
            return Err(self.refuse(MigrationError::DigestMismatch {
                found: digest,
                expected,
                regions: which,
            }));
        }
        Ok(())
    }

    /// Post-copy's pagers and link, when the State asks for post-copy.
    fn arm_postcopy(
        &mut self,
        vm: &impl TargetMachine,
        switchover: &Switchover,
        opts: &ReceiveOptions,
        listener: Arc<Listener>,
    ) -> Result<Option<Postcopy>> {
        let Some(stale) = &switchover.postcopy else {
            return Ok(None);
        };
        // Well within the idle timeout (the source's is taken to be the same as ours).
        let heartbeat = HEARTBEAT_INTERVAL.min(listener.timeouts().idle / 4);
        match arm_postcopy(vm, &self.setup.shared, stale, &self.links, opts, heartbeat) {
            Ok((link, pagers, userfault_pagers)) => Ok(Some(Postcopy {
                link,
                pagers,
                userfault_pagers,
                listener,
                migration: self.links.migration,
            })),
            Err(e) => Err(self.refuse(unsupported(format!(
                "post-copy cannot be armed: {}",
                error_chain(&e, ": ")
            )))),
        }
    }

    /// The components' states handed over, Ready said, and the source's Go awaited.
    fn await_go(&mut self, components: &mut Components<'_>, switchover: &Switchover) -> Result<()> {
        if let Err(e) = components.restore(&switchover.components) {
            return Err(self.refuse(unsupported(format!(
                "the components' states: {}",
                error_chain(&e, ": ")
            ))));
        }
        write_frame(&mut self.links.pages[0], &Frame::Ready)?;
        match read_frame(&mut self.links.pages[0]) {
            Ok(Frame::Go) => Ok(()),
            Ok(other) => Err(refused_by_source(&other, "Go")),
            Err(e) => Err(MigrationError::BrokeBeforeGo {
                source: Box::new(e),
            }
            .into()),
        }
    }
}

fn unsupported(reason: String) -> MigrationError {
    MigrationError::Unsupported { reason }
}

/// Refuses a setup this destination cannot take: a State format other than the negotiated
/// protocol's (`format`), a zstd window it does not allow, or post-copy of guest_memfd memory
/// without KVM Userfault.
fn check_setup(setup: &Setup, format: u32) -> std::result::Result<(), MigrationError> {
    if setup.format != format {
        return Err(MigrationError::Format {
            found: setup.format,
            supported: format,
        });
    }
    if let Some(Err(why)) = setup.zstd_window_log.map(crate::stream::check_window_log) {
        return Err(unsupported(why));
    }
    if !setup.mode.has_postcopy() {
        return Ok(());
    }
    let Some(r) = setup
        .config
        .regions
        .iter()
        .find(|r| r.backend == Backend::GuestMemfd)
    else {
        return Ok(());
    };
    // Found by trying a userfault memslot on a VM of its own (see UserfaultPager).
    let missing = match guestmem_sys::probe::kvm_userfault_on_a_new_vm() {
        Ok(u) if u.present => None,
        Ok(u) => Some(u.detail),
        Err(e) => Some(e),
    };
    match missing {
        Some(why) => Err(unsupported(format!(
            "{} of guest_memfd region '{}' needs KVM Userfault (KVM_MEM_USERFAULT, \
             KVM_CAP_USERFAULT), which this kernel lacks ({why}): migrate it with \
             pre-copy",
            setup.mode, r.name
        ))),
        None => Ok(()),
    }
}

/// Checks that `mode` can page `memory` in (post-copy demand pages every region: one the
/// kernel cannot serve, guest_memfd without userfaultfd on its mapping, is refused here, found
/// by trying, before any page moves), and advises huge pages: the rounds fill anonymous RAM in
/// bulk, and huge pages save 511 of every 512 faults.
fn prepare_memory(memory: &GuestMemory, mode: Mode) -> std::result::Result<(), MigrationError> {
    if mode.has_postcopy() {
        for region in memory.regions() {
            if let Err(e) = guestmem_paging::check_demand_paging(region) {
                return Err(unsupported(format!(
                    "{} cannot demand page its memory here: {}: migrate it with pre-copy",
                    mode,
                    error_chain(&e, ": ")
                )));
            }
        }
    }
    for region in memory.regions() {
        if let Err(e) = region.advise_huge_pages() {
            return Err(unsupported(format!(
                "its memory cannot be prepared here: {}",
                error_chain(&e, ": ")
            )));
        }
    }
    Ok(())
}

/// The chunk digests of the regions that travel, kept by the readers as pages land, when the
/// source verifies with chunks; a chunk size out of range is refused.
fn chunk_digests_of(
    setup: &Setup,
    memory: &GuestMemory,
) -> std::result::Result<Option<Arc<ChunkDigests>>, MigrationError> {
    match (setup.verify, setup.verify_chunk) {
        (true, Some(chunk)) if chunk_digests::valid_chunk(chunk, BLOCK) => {
            Ok(Some(Arc::new(ChunkDigests::new(
                memory
                    .regions()
                    .iter()
                    .filter(|r| !setup.shared.iter().any(|n| n == r.name()))
                    .map(|r| (r.gpa(), r.size())),
                chunk,
            ))))
        }
        (true, Some(chunk)) => Err(unsupported(format!(
            "digest chunks of {chunk} bytes: a power of two from {PAGE_SIZE} to {BLOCK} \
             is needed"
        ))),
        _ => Ok(None),
    }
}

/// Pre-copy's rounds land in fresh memory with UFFDIO_COPY where the kernel lets us (a
/// refusal only costs speed: the pages are then written in place).
fn arm_landing(setup: &Setup, memory: &GuestMemory) -> Option<Arc<Landing>> {
    if setup.mode == Mode::Postcopy {
        return None;
    }
    match Landing::arm(memory, &setup.shared) {
        Ok(l) => l.map(Arc::new),
        Err(e) => {
            tracing::warn!("pages land by plain writes: {}", error_chain(&e, ": "));
            None
        }
    }
}

/// The destination's memory digest, its region digests (with chunk digests) and the time it
/// took.
struct Verified {
    digest: u64,
    regions: Option<Vec<RegionDigest>>,
    took: Duration,
}

/// The memory digest once the memory is complete, when the setup asks for it. With chunk
/// digests, the readers hashed what they wrote (in `last_round_hashing` for the last round);
/// any chunk still stale (written on a connection that does not carry its block) is hashed
/// now. Without (a source that predates them), all of memory is digested now, while the
/// source digests its own.
fn verify(
    setup: &Setup,
    memory: &GuestMemory,
    chunks: Option<&ChunkDigests>,
    last_round_hashing: Duration,
) -> Result<Option<Verified>> {
    let started = Instant::now();
    Ok(match chunks {
        Some(chunks) => {
            chunks.refresh_where(memory, |_, _| true)?;
            let regions = chunks.summary().ok_or(MigrationError::StaleDigests)?;
            Some(Verified {
                digest: chunk_digests::combine(&regions),
                regions: Some(regions),
                took: last_round_hashing + started.elapsed(),
            })
        }
        None if setup.verify => Some(Verified {
            digest: memory_digest(memory)?,
            regions: None,
            took: started.elapsed(),
        }),
        None => None,
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
