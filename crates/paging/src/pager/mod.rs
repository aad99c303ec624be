//! The pager: userfaultfds over a region, handler threads, and the background fetcher.

mod config;
mod install;
mod peer;
mod serve;
mod shared_install;
mod start;

use guestmem_sys::to_usize;
use std::collections::VecDeque;
use std::ops::Range;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use guestmem_memory::{Backend, Region};
use guestmem_vm::AbortHandle;
use userfaultfd::Uffd;

use crate::affinity::CpuSet;
use crate::{Error, PageSource, Result, SharedImage};

pub use config::{PagerConfig, PagerStats};
pub use peer::{register_for_peer, PeerPager, PeerRange};
pub(crate) use shared_install::share_refusal;
use shared_install::shared_image;

/// How faults are resolved, by backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// `MISSING` faults, `UFFDIO_COPY` from a bounce buffer (anon, hugetlb).
    Copy,
    /// The page cache is filled through `alias`, then `UFFDIO_CONTINUE` maps it (memfd).
    Continue,
    /// A clone's copy-on-write mapping of a snapshot's [`SharedImage`]: a published chunk is
    /// mapped with `UFFDIO_CONTINUE`; an unpublished one is fetched, written into the image and
    /// published first (anon regions restored with [`PagerConfig::share`]).
    Shared,
}

/// Who installs a chunk (for the stats; only a fault waits for a chunk someone else holds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum By {
    Fault,
    Readahead,
    Background,
    Prefetch,
}

// Chunk states.
const ABSENT: u8 = 0;
const FETCHING: u8 = 1;
const RESIDENT: u8 = 2;
const FAILED: u8 = 3;

/// Largest bounce buffer of `Mode::Copy` (bigger chunks are copied in pieces), which keeps
/// the pager's own memory small.
const BOUNCE_MAX: u64 = 128 << 10;
/// Largest bounce buffer of the background fetcher, which brings runs of chunks as one range
/// (one thread: its buffer stays small beside the region).
const BACKGROUND_BOUNCE_MAX: u64 = 1 << 20;
/// All threads' bounce buffers together take at most this share of the region (smaller
/// buffers for small regions served by many threads).
const BOUNCE_SHARE: u64 = 200;
/// How long the background sweep waits for the guest's first fault before it starts anyway.
const SWEEP_DELAY: Duration = Duration::from_millis(10);
/// Events read per `read()` from a userfaultfd.
const EVENT_BATCH: usize = 64;

/// Demand paging of one region from a [`PageSource`]. Start it after the region exists and
/// before the guest (or anyone) touches it; dropping it stops its threads and unregisters, after
/// which missing pages fill with zeros: keep it until it has retired or the guest has stopped.
pub struct Pager {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    cpus: Option<CpuSet>,
    /// Holds the background thread until [`Pager::release`] ([`PagerConfig::hold_background`]).
    gate: Arc<Gate>,
}

/// A gate the background thread waits at until it is opened.
#[derive(Default)]
struct Gate {
    open: Mutex<bool>,
    opened: Condvar,
}

impl Gate {
    fn open(&self) {
        *self
            .open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = true;
        self.opened.notify_all();
    }

    fn wait(&self) {
        let mut open = self
            .open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        while !*open {
            open = self
                .opened
                .wait(open)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }
}

impl std::fmt::Debug for Pager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pager")
            .field("region", &self.shared.region)
            .field("threads", &self.threads.len())
            .field("cpus", &self.cpus)
            .finish_non_exhaustive()
    }
}

struct Shared {
    region: String,
    gpa: u64,
    host: usize,
    size: u64,
    page: u64,
    chunk: u64,
    bounce: u64,
    mode: Mode,
    /// A second shared mapping of the memfd (`Mode::Continue`), not registered with uffd.
    alias: usize,
    /// The memfd itself (`Mode::Continue`; -1 otherwise): a mapped source is written into its
    /// page cache with `pwrite`, which fills whole pages without zeroing them first.
    memfd: RawFd,
    /// The shared image this clone maps (`Mode::Shared`).
    image: Option<Arc<SharedImage>>,
    uffds: Vec<Uffd>,
    /// The chunks each userfaultfd covers.
    shards: Vec<Range<usize>>,
    states: Vec<AtomicU8>,
    source: Arc<dyn PageSource>,
    fetch_attempts: u32,
    retry_delay: Duration,
    abort: Option<AbortHandle>,
    /// The fault handlers run under `SCHED_FIFO` ([`PagerConfig::realtime_handlers`]).
    realtime: bool,
    /// Also told when a fetch fails for good (a page server kills its peer VMM with it).
    on_failure: Option<OnFailure>,
    /// [`PeerPager`] ranges: asked whether the peer let go of a range that a copy found
    /// unregistered or without an address space (see [`PeerReleased`]).
    peer_released: Option<PeerReleased>,
    /// The peer let go of the range: serving it has ended, without a failure.
    released: AtomicBool,
    /// Readable once the threads must stop.
    stop: OwnedFd,
    faults: AtomicU64,
    /// Handler threads busy with a batch of events right now (the background fetcher waits,
    /// see [`Shared::wait_for_idle_handlers`]).
    busy_handlers: AtomicU64,
    fault_chunks: AtomicU64,
    readahead_chunks: AtomicU64,
    background_chunks: AtomicU64,
    prefetch_chunks: AtomicU64,
    discarded_chunks: AtomicU64,
    resident_chunks: AtomicU64,
    /// The background fetches' throughput, bytes per second (f64 bits; 0: none measured yet),
    /// which sizes their runs of chunks (see `background_run`).
    background_rate: AtomicU64,
    /// Chunks to fetch first, and whether that is done.
    prefetch: Vec<usize>,
    prefetch_done: AtomicBool,
    /// The chunks the guest asked for (faults, and readahead after them), in that order.
    fault_order: Mutex<Vec<u32>>,
    retired: AtomicBool,
    /// When it retired.
    retired_at: Mutex<Option<Instant>>,
    failure: Mutex<Option<String>>,
    changed: Condvar,
    handlers: usize,
    readahead: usize,
    readahead_threads: usize,
    /// Chunks (and their shard) queued for the readahead threads, newest last.
    readahead_queue: Mutex<VecDeque<(usize, usize)>>,
    readahead_queued: Condvar,
    background: bool,
}

// SAFETY: `host` and `alias` are addresses of mappings that outlive the pager's threads (the
// region's, which the caller keeps alive, and the alias, unmapped in `Drop` after the threads
// are joined); everything else is Sync already.
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

/// Why the userfaultfd [`Pager`] never serves a guest_memfd region: userfaultfd sees accesses
/// through the host's mapping only, and KVM maps guest_memfd pages for the guest without it, so
/// a vCPU would run on pages never fetched (zeros) even where the kernel lets userfaultfd
/// register the mapping. Such a region is demand paged through KVM Userfault
/// ([`crate::UserfaultPager`]); the reason says whether this kernel has it, as a fresh VM
/// answers.
fn guest_memfd_refusal() -> (bool, String) {
    const WHY: &str = "userfaultfd sees only the host mapping's accesses, never a vCPU's to \
                       guest_memfd: its demand paging needs KVM Userfault (KVM_MEM_USERFAULT, \
                       KVM_CAP_USERFAULT)";
    match guestmem_sys::probe::kvm_userfault_on_a_new_vm() {
        Ok(u) if u.present => (true, format!("{WHY}, which this kernel has ({})", u.detail)),
        Ok(u) => (false, format!("{WHY}, which is absent here ({})", u.detail)),
        Err(e) => (false, format!("{WHY}, which could not be asked for: {e}")),
    }
}

/// Whether guestmem can demand page `region` on the running kernel, without starting a pager:
/// `Ok` for every backend but guest_memfd, which needs KVM Userfault (found by trying it, see
/// [`crate::UserfaultPager`]); the refusal names what is missing. For callers that must refuse
/// before anything moves.
pub fn check_demand_paging(region: &Region) -> Result<()> {
    if region.backend() != Backend::GuestMemfd {
        return Ok(());
    }
    match guest_memfd_refusal() {
        (true, _) => Ok(()),
        (false, reason) => Err(Error::Unsupported {
            region: region.name().to_string(),
            backend: region.backend(),
            reason,
        }),
    }
}

impl Pager {
    /// Registers `region` with userfaultfd and starts serving its faults from `source`.
    ///
    /// `region` must stay mapped while the pager lives; the pager must be dropped before it.
    pub fn start(
        region: &Region,
        source: Arc<dyn PageSource>,
        config: &PagerConfig,
    ) -> Result<Pager> {
        Pager::start_partial(region, source, config, &|_| false)
    }

    /// Like [`Pager::start`] over a region whose contents are already right, except in the
    /// chunks (of `config.fault_around` bytes) for which `resident(offset)` is false: those
    /// must have been discarded by the caller (so that they fault) and are fetched from
    /// `source` (post-copy after a pre-copy round: only the pages dirtied since are fetched).
    pub fn start_partial(
        region: &Region,
        source: Arc<dyn PageSource>,
        config: &PagerConfig,
        resident: &dyn Fn(u64) -> bool,
    ) -> Result<Pager> {
        let name = region.name().to_string();
        let backend = region.backend();
        let image = shared_image(region, config)?;
        let mode = start::mode(&name, backend, image.is_some())?;
        let page = backend.page_size();
        let size = region.size();
        let chunk = config.fault_around;
        start::check_config(&name, backend, size, config, source.as_ref())?;
        let cpus = pager_cpus(config).map_err(|reason| Error::Config {
            region: name.clone(),
            reason,
        })?;
        let host = region.host_addr() as usize;
        let (uffds, shards) = start::register(&name, backend, mode, host, size, config)?;
        let memfd = match mode {
            Mode::Copy => -1,
            Mode::Shared => image.as_ref().expect("shared mode has an image").fd(),
            Mode::Continue => region.fd().expect("memfd regions have an fd").as_raw_fd(),
        };
        let alias = match mode {
            Mode::Copy | Mode::Shared => 0,
            Mode::Continue => start::alias(&name, memfd, size)?,
        };
        let stop = start::eventfd(&name)?;
        let mut shared = Shared::new(
            Layout {
                region: name,
                gpa: region.gpa(),
                host,
                size,
                page,
                chunk,
                mode,
                alias,
                memfd,
            },
            uffds,
            shards,
            source,
            config,
            stop,
            None,
        );
        shared.image = image;
        let shared = Arc::new(shared);
        for (c, state) in shared.states.iter().enumerate() {
            if resident(c as u64 * chunk) {
                state.store(RESIDENT, Ordering::Release);
                shared.count_resident();
            }
        }
        let gate = Arc::new(Gate::default());
        if !config.hold_background {
            gate.open();
        }
        let mut pager = Pager {
            shared,
            threads: Vec::new(),
            cpus,
            gate,
        };
        pager.spawn_workers(config)?;
        tracing::debug!(region = %pager.shared.region, ?mode, uffds = pager.shared.uffds.len(), handlers = config.handlers, chunk, "pager started");
        Ok(pager)
    }

    /// Starts the fault handlers (spread over the userfaultfds), the readahead threads and,
    /// when asked for, the background fetcher.
    fn spawn_workers(&mut self, config: &PagerConfig) -> Result<()> {
        let shared = self.shared.clone();
        let n_uffds = shared.uffds.len();
        for t in 0..config.handlers {
            // Thread t serves uffd t % n when there are more threads than uffds, else every
            // handlers-th uffd starting at t.
            let served: Vec<usize> = if config.handlers >= n_uffds {
                vec![t % n_uffds]
            } else {
                (t..n_uffds).step_by(config.handlers).collect()
            };
            let shared = shared.clone();
            self.spawn(format!("uffd-handler{t}"), move || {
                shared.serve_faults(&served);
            })?;
        }
        for t in 0..config.readahead_threads {
            let shared = shared.clone();
            self.spawn(format!("uffd-readahead{t}"), move || {
                shared.serve_readahead();
            })?;
        }
        if config.background || !config.prefetch.is_empty() {
            let nice = config.background_nice;
            let gate = self.gate.clone();
            self.spawn("uffd-background".into(), move || {
                if let Some(nice) = nice {
                    crate::priority::set_nice(nice);
                }
                gate.wait();
                shared.fetch_everything();
            })?;
        }
        Ok(())
    }

    fn spawn(&mut self, name: String, f: impl FnOnce() + Send + 'static) -> Result<()> {
        let shared = self.shared.clone();
        let on_panic = move |reason: String| {
            let region = shared.region.clone();
            shared.fail(Error::Stopped { region, reason });
        };
        let handle = spawn_pager_thread(&self.shared.region, name, self.cpus, f, on_panic)?;
        self.threads.push(handle);
        Ok(())
    }

    /// Lets the background thread of a pager started with [`PagerConfig::hold_background`]
    /// go (nothing for any other).
    pub fn release(&self) {
        self.gate.open();
    }

    /// What the pager did so far.
    pub fn stats(&self) -> PagerStats {
        self.shared.stats()
    }

    /// A handle on its counters for a progress sampler on another thread.
    pub fn probe(&self) -> crate::StatsProbe {
        let shared = self.shared.clone();
        crate::StatsProbe::new(move || shared.stats())
    }

    /// When the whole region became resident and the pager retired (`None` until then).
    pub fn retired_at(&self) -> Option<Instant> {
        *self
            .shared
            .retired_at
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Bytes of the region it serves.
    pub fn size(&self) -> u64 {
        self.shared.size
    }

    /// The pager's own memory: chunk states, bounce buffers, event buffers and the readahead
    /// queue (thread stacks are 256 KiB of address space each, touched only a few pages deep).
    pub fn memory_bytes(&self) -> u64 {
        let s = &self.shared;
        let threads = (s.handlers + s.readahead_threads + usize::from(s.background)) as u64;
        let bounce =
            if (s.mode == Mode::Copy && s.source.mapped().is_none()) || s.mode == Mode::Shared {
                s.bounce
            } else {
                0
            };
        let event_buffers = s.handlers as u64 * EVENT_BATCH as u64 * 32;
        let queue = s
            .readahead_queue
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .capacity() as u64
            * std::mem::size_of::<(usize, usize)>() as u64;
        s.states.len() as u64 + threads * bounce + event_buffers + queue
    }

    /// Waits until the whole region is resident and the pager retired (`Ok(true)`), or
    /// `timeout` passes (`Ok(false)`); a failed fetch is returned as its error. Only a pager
    /// with background fetch retires.
    pub fn wait_resident(&self, timeout: Duration) -> Result<bool> {
        let s = &self.shared;
        let deadline = Instant::now() + timeout;
        let mut failure = s
            .failure
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        loop {
            if let Some(reason) = failure.as_ref() {
                return Err(Error::Stopped {
                    region: s.region.clone(),
                    reason: reason.clone(),
                });
            }
            if s.retired.load(Ordering::Acquire) {
                return Ok(true);
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(false);
            }
            failure = s
                .changed
                .wait_timeout(failure, deadline - now)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }

    /// Region offsets of the chunks the guest asked for, in the order it did (each once):
    /// chunks installed for a fault, and the readahead that followed a sequential one. Chunks
    /// the background sweep brought in before anyone touched them are not in it.
    pub fn fault_order(&self) -> Vec<u64> {
        let s = &self.shared;
        s.fault_order
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .map(|&c| u64::from(c) * s.chunk)
            .collect()
    }

    /// The chunk size (fault-around) this pager works in.
    pub fn chunk_bytes(&self) -> u64 {
        self.shared.chunk
    }

    /// Whether every chunk overlapping `[offset, offset + len)` of the region is resident.
    pub fn is_resident(&self, offset: u64, len: u64) -> bool {
        let s = &self.shared;
        if s.retired.load(Ordering::Acquire) {
            return true;
        }
        let end = (offset + len).min(s.size);
        if end <= offset {
            return true;
        }
        let chunks = to_usize(offset / s.chunk)..=to_usize((end - 1) / s.chunk);
        chunks
            .into_iter()
            .all(|c| s.states[c].load(Ordering::Acquire) == RESIDENT)
    }

    /// The error that stopped the pager, if a fetch failed for good.
    pub fn failure(&self) -> Option<String> {
        self.shared
            .failure
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

impl Drop for Pager {
    fn drop(&mut self) {
        self.shared.signal_stop();
        // A held background thread finds the pager stopped once let through.
        self.gate.open();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        self.shared.unregister();
        if self.shared.alias != 0 {
            // SAFETY: the alias mapping made in `start`, of `size` bytes; no thread uses it
            // any more (all joined).
            unsafe {
                libc::munmap(
                    self.shared.alias as *mut libc::c_void,
                    to_usize(self.shared.size),
                )
            };
        }
    }
}

/// Where a [`Shared`] serves: the region's name, addresses and fault-resolution mode.
struct Layout {
    region: String,
    gpa: u64,
    host: usize,
    size: u64,
    page: u64,
    chunk: u64,
    mode: Mode,
    alias: usize,
    memfd: RawFd,
}

/// Called with the reason when a fetch fails for good (after the `abort` handle, if any).
pub type OnFailure = Arc<dyn Fn(&str) + Send + Sync>;

/// Asked by a [`PeerPager`] when `UFFDIO_COPY` into the peer's `[host_addr, host_addr + len)`
/// fails with `ENOENT` (nothing registered there any more) or `ESRCH` (the peer's address
/// space is gone): whether the peer let go of that memory (unmapped it, or its process is
/// exiting; a VMM unmaps its RAM as it shuts down). If so, serving that range ends quietly:
/// no fault can wait there any more. If not (the memory is still mapped but not registered on
/// the fd the peer sent), the failure stands: the peer's faults would reach a fd nobody reads.
pub type PeerReleased = Arc<dyn Fn(u64, u64) -> bool + Send + Sync>;

/// [`PagerConfig::cpus`], checked against the CPUs this process may run on.
fn pager_cpus(config: &PagerConfig) -> std::result::Result<Option<CpuSet>, String> {
    config
        .cpus
        .as_deref()
        .map(|cpus| CpuSet::new(cpus).map_err(|e| format!("pager CPUs {cpus:?}: {e}")))
        .transpose()
}

/// Starts one of a pager's threads (small stacks: they only shuffle pages), pinned to `cpus`
/// from its start ([`PagerConfig::cpus`]), naming the region in the error if the thread cannot
/// be created. Should `f` panic (a bug, or a page source that panics), `on_panic` gets the
/// reason and fails the pager, which stops its VM (or peer): the guest's faults are then
/// answered by an error instead of waiting forever on a thread that is gone.
fn spawn_pager_thread(
    region: &str,
    name: String,
    cpus: Option<CpuSet>,
    f: impl FnOnce() + Send + 'static,
    on_panic: impl FnOnce(String) + Send + 'static,
) -> Result<std::thread::JoinHandle<()>> {
    let region_name = region.to_string();
    let thread = name.clone();
    let f = move || {
        if let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
            let message = panic
                .downcast_ref::<&str>()
                .map(std::string::ToString::to_string)
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "no message".into());
            on_panic(format!("pager thread '{thread}' panicked: {message}"));
        }
    };
    std::thread::Builder::new()
        .name(name)
        .stack_size(256 << 10)
        .spawn(move || {
            // Whatever priority the thread that started the pager ran at (a restore may run
            // under `SCHED_FIFO`), each pager thread starts from the normal one and takes its
            // own.
            crate::priority::reset();
            if let Some(cpus) = cpus {
                // The CPUs were checked at the pager's start; this fails only if the process
                // lost them since (its cpuset changed): the thread then runs where it may.
                if let Err(e) = cpus.pin_current_thread() {
                    tracing::warn!(region = %region_name, "pinning a pager thread to {cpus:?}: {e}");
                }
            }
            f();
        })
        .map_err(|source| Error::Os {
            region: region.into(),
            op: "spawning a pager thread",
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::FileSource;
    use guestmem_memory::RegionSpec;

    const MIB: u64 = 1 << 20;

    #[allow(clippy::cast_possible_truncation)] // `% 251` fits a byte.
    fn pattern(len: u64) -> Vec<u8> {
        (0..len).map(|i| (i % 251) as u8).collect()
    }

    /// A host thread's first access to each chunk faults, and the pager answers with the
    /// source's bytes: exactly the chunks touched are resident, in the order they were
    /// touched, until the rest is fetched; anonymous memory by copy, a memfd through its page
    /// cache.
    #[test]
    fn host_faults_are_served_with_the_sources_bytes() {
        let bytes = pattern(8 * MIB);
        let path = std::env::temp_dir().join(format!("guestmem-pager-{}", std::process::id()));
        std::fs::write(&path, &bytes).unwrap();
        for backend in [Backend::Anon, Backend::Memfd] {
            let region = Region::create(RegionSpec::new("ram", 0, 8 * MIB, backend), None).unwrap();
            let config = PagerConfig {
                background: false,
                readahead_chunks: 0,
                ..Default::default()
            };
            let source: Arc<dyn PageSource> = Arc::new(FileSource::open(&path).unwrap());
            let pager = Pager::start(&region, source, &config).unwrap();
            assert_eq!((pager.size(), pager.chunk_bytes()), (8 * MIB, 2 * MIB));
            let read = |offset: u64, len: usize| {
                let mut buf = vec![0u8; len];
                // SAFETY: `offset + len` lies inside the region's live mapping; the pager
                // fills the pages on the faults this copy takes.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        region.host_addr().add(guestmem_sys::to_usize(offset)),
                        buf.as_mut_ptr(),
                        len,
                    );
                }
                buf
            };
            assert!(
                read(5 * MIB + 3, 4096) == bytes[guestmem_sys::to_usize(5 * MIB + 3)..][..4096]
            );
            assert!(read(100, 64) == bytes[100..164]);
            // The kernel wakes the faulting thread as the chunk's pages land; the handler
            // records the chunk just after: wait (boundedly) for the record.
            let settled = Instant::now();
            while pager.stats().fault_chunks < 2 && settled.elapsed() < Duration::from_secs(1) {
                std::thread::sleep(Duration::from_millis(1));
            }
            assert_eq!(pager.fault_order(), [4 * MIB, 0], "{backend}");
            let stats = pager.stats();
            assert_eq!(stats.fault_chunks, 2, "{backend}: {stats:?}");
            assert!(stats.faults >= 2 && !stats.retired, "{backend}: {stats:?}");
            assert!(pager.is_resident(4 * MIB, 2 * MIB) && pager.is_resident(0, 2 * MIB));
            assert!(!pager.is_resident(2 * MIB, 1) && !pager.is_resident(6 * MIB, 2 * MIB));
            assert!(!pager.wait_resident(Duration::from_millis(10)).unwrap());
            assert_eq!(pager.failure(), None);
        }
        let _ = std::fs::remove_file(&path);
    }

    /// Pager CPUs are checked against the CPUs this process may use, naming the list.
    #[test]
    fn pager_cpus_are_checked() {
        assert!(pager_cpus(&PagerConfig::default()).unwrap().is_none());
        let e = pager_cpus(&PagerConfig {
            cpus: Some(vec![]),
            ..Default::default()
        })
        .unwrap_err();
        assert_eq!(
            e,
            "pager CPUs []: an empty CPU list; at least one CPU is needed"
        );
        let set = pager_cpus(&PagerConfig {
            cpus: Some(vec![0]),
            ..Default::default()
        })
        .unwrap()
        .unwrap();
        assert_eq!(set.cpus(), [0]);
    }
}
