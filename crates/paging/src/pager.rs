//! The pager: userfaultfds over a region, handler threads, and the background fetcher.

use std::collections::VecDeque;
use std::io;
use std::ops::Range;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use guestmem_memory::{Backend, Region};
use guestmem_sys::uapi::{
    UFFD_FEATURE_EVENT_REMOVE, UFFD_FEATURE_MINOR_SHMEM, UFFD_FEATURE_MISSING_HUGETLBFS,
    UFFD_FEATURE_MISSING_SHMEM,
};
use guestmem_vm::AbortHandle;
use userfaultfd::{Event, EventBuffer, FaultKind, FeatureFlags, RegisterMode, Uffd, UffdBuilder};

use crate::affinity::CpuSet;
use crate::{priority, Error, PageSource, Result};

/// How a [`Pager`] works.
#[derive(Debug, Clone)]
pub struct PagerConfig {
    /// Userfaultfds: the region is split into this many equal ranges (whole chunks), one per
    /// userfaultfd. One per vCPU range removes the contention on one fd's wait queue.
    pub uffds: usize,
    /// Handler threads, spread over the userfaultfds (a thread may serve several).
    pub handlers: usize,
    /// Fault-around: bytes installed around a faulting page (a chunk), a power of two of at
    /// least the backend's page size. Sequential access then faults once per chunk.
    pub fault_around: u64,
    /// Readahead: after a sequential fault (the chunk before it is resident), the handler also
    /// installs up to this many following chunks of the shard, once the vCPU is woken and
    /// while no other event is waiting.
    pub readahead_chunks: usize,
    /// Readahead threads: with 0 the handler that saw the sequential fault installs the
    /// readahead chunks itself, one after the other; with more, it queues them for these
    /// threads and goes back to its events, and they fetch several chunks at once (for a
    /// source with a slow link: each fetch waits for the link, so fetches in flight add up).
    pub readahead_threads: usize,
    /// Fetch the chunks nobody asked for yet in a background thread, and retire the pager
    /// (unregister its userfaultfds) once the whole region is resident.
    pub background: bool,
    /// Attempts per fetch before the pager gives up (at least 1).
    pub fetch_attempts: u32,
    /// Pause between attempts.
    pub retry_delay: Duration,
    /// Told when a fetch fails for good, so that the VM stops with the error (naming the guest
    /// address) instead of leaving a vCPU waiting for the page forever.
    pub abort: Option<AbortHandle>,
    /// Region offsets of chunks to fetch first, in this order, before the background sweep
    /// (e.g. the working set a previous run faulted on, see [`Pager::fault_order`]). Fetched
    /// by the background thread, which runs for them even without `background`.
    pub prefetch: Vec<u64>,
    /// Run the fault handlers under `SCHED_FIFO` ([`priority::make_realtime`]) instead of at
    /// nice -10, so that a fault's answer never waits for a time slice behind the background
    /// fetches and the other vCPUs: post-copy and lazy restore, where a running guest's vCPUs
    /// wait on their faults. (A benchmark that only measures throughput on busy cores gains
    /// nothing from it: the cores are the limit.)
    pub realtime_handlers: bool,
    /// Host CPUs for the pager's threads (fault handlers, readahead, background fetch): each
    /// pins itself to them as it starts, as a VMM keeps its housekeeping threads off the
    /// vCPUs' CPUs. Each must be one the process may run on. `None`: wherever the scheduler
    /// puts them.
    pub cpus: Option<Vec<usize>>,
}

impl Default for PagerConfig {
    fn default() -> Self {
        PagerConfig {
            uffds: 1,
            handlers: 1,
            fault_around: 2 << 20,
            readahead_chunks: 4,
            readahead_threads: 0,
            background: true,
            fetch_attempts: 3,
            retry_delay: Duration::from_millis(10),
            abort: None,
            prefetch: Vec::new(),
            realtime_handlers: false,
            cpus: None,
        }
    }
}

/// What a pager has done so far.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PagerStats {
    /// Page-fault events read from the userfaultfds.
    pub faults: u64,
    /// Chunks installed because a fault asked for them.
    pub fault_chunks: u64,
    /// Chunks installed by readahead after sequential faults.
    pub readahead_chunks: u64,
    /// Chunks installed by the background fetcher.
    pub background_chunks: u64,
    /// Chunks installed from [`PagerConfig::prefetch`] (before the background sweep).
    pub prefetch_chunks: u64,
    /// Whether the prefetch list has been gone through (true when there is none).
    pub prefetch_done: bool,
    /// Chunks the VMM discarded before they were fetched (`UFFD_EVENT_REMOVE`): they read as
    /// zero and are never fetched.
    pub discarded_chunks: u64,
    /// Bytes of the region that are resident.
    pub resident_bytes: u64,
    /// Whether the pager has retired (everything resident, userfaultfds unregistered).
    pub retired: bool,
}

/// How faults are resolved, by backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// `MISSING` faults, `UFFDIO_COPY` from a bounce buffer (anon, hugetlb).
    Copy,
    /// The page cache is filled through `alias`, then `UFFDIO_CONTINUE` maps it (memfd).
    Continue,
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
        let bad = |reason: String| Error::Config {
            region: name.clone(),
            reason,
        };
        let backend = region.backend();
        let mode = match backend {
            Backend::Anon | Backend::MemfdHugetlb | Backend::Hugetlbfs => Mode::Copy,
            Backend::Memfd => Mode::Continue,
            Backend::GuestMemfd => {
                return Err(Error::Unsupported {
                    region: name,
                    backend,
                    reason: "userfaultfd cannot register guest_memfd mappings; post-copy of \
                             guest_memfd needs KVM Userfault (the KVM_MEM_USERFAULT memslot \
                             flag, KVM_CAP_USERFAULT), which guestmem does not drive yet"
                        .into(),
                })
            }
        };
        let page = backend.page_size();
        let size = region.size();
        let chunk = config.fault_around;
        if !chunk.is_power_of_two() || chunk < page {
            return Err(bad(format!(
                "fault-around {chunk:#x} must be a power of two of at least the {backend} \
                 backend's page size ({page:#x})"
            )));
        }
        let chunks = size.div_ceil(chunk) as usize;
        if config.uffds == 0 || config.uffds > chunks {
            return Err(bad(format!(
                "{} userfaultfds requested; 1 to {chunks} (one per {chunk:#x}-byte chunk) are \
                 possible",
                config.uffds
            )));
        }
        if config.handlers == 0 {
            return Err(bad(
                "0 handler threads requested; at least 1 is needed".into()
            ));
        }
        if config.fetch_attempts == 0 {
            return Err(bad(
                "0 fetch attempts requested; at least 1 is needed".into()
            ));
        }
        if source.size() < size {
            return Err(bad(format!(
                "the page source holds {:#x} bytes, less than the region's {size:#x}",
                source.size()
            )));
        }
        let cpus = pager_cpus(config).map_err(bad)?;

        let mut features = UFFD_FEATURE_EVENT_REMOVE;
        features |= match backend {
            Backend::Memfd => UFFD_FEATURE_MISSING_SHMEM | UFFD_FEATURE_MINOR_SHMEM,
            Backend::MemfdHugetlb | Backend::Hugetlbfs => UFFD_FEATURE_MISSING_HUGETLBFS,
            _ => 0,
        };
        let register_mode = match mode {
            Mode::Copy => RegisterMode::MISSING,
            Mode::Continue => RegisterMode::MISSING | RegisterMode::MINOR,
        };
        let uffd_err = |op, source| Error::Uffd {
            region: name.clone(),
            op,
            source,
        };
        let host = region.host_addr() as usize;
        let shards: Vec<Range<usize>> = (0..config.uffds)
            .map(|i| i * chunks / config.uffds..(i + 1) * chunks / config.uffds)
            .collect();
        let mut uffds = Vec::with_capacity(shards.len());
        for shard in &shards {
            let uffd = UffdBuilder::new()
                .close_on_exec(true)
                .non_blocking(true)
                .user_mode_only(false)
                .require_features(FeatureFlags::from_bits_retain(features))
                .create()
                .map_err(|e| uffd_err("userfaultfd / UFFDIO_API", e))?;
            let start = shard.start as u64 * chunk;
            let end = (shard.end as u64 * chunk).min(size);
            uffd.register_with_mode(
                (host + start as usize) as *mut libc::c_void,
                (end - start) as usize,
                register_mode,
            )
            .map_err(|e| uffd_err("UFFDIO_REGISTER", e))?;
            uffds.push(uffd);
        }

        let memfd = match mode {
            Mode::Copy => -1,
            Mode::Continue => region.fd().expect("memfd regions have an fd").as_raw_fd(),
        };
        let alias = match mode {
            Mode::Copy => 0,
            Mode::Continue => {
                let fd = memfd;
                // SAFETY: a fresh shared mapping of the region's own fd and size; it aliases
                // the region's memory only through the page cache, which is what we want.
                let addr = unsafe {
                    libc::mmap(
                        std::ptr::null_mut(),
                        size as usize,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_SHARED,
                        fd,
                        0,
                    )
                };
                if addr == libc::MAP_FAILED {
                    return Err(Error::Os {
                        region: name,
                        op: "mmap of the memfd's second mapping",
                        source: io::Error::last_os_error(),
                    });
                }
                addr as usize
            }
        };
        // SAFETY: eventfd returns a new fd (checked below) that nobody else owns.
        let stop = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if stop < 0 {
            return Err(Error::Os {
                region: name,
                op: "eventfd",
                source: io::Error::last_os_error(),
            });
        }
        let shared = Arc::new(Shared::new(
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
            // SAFETY: `stop` is the fresh eventfd from above.
            unsafe { OwnedFd::from_raw_fd(stop) },
            None,
        ));
        for (c, state) in shared.states.iter().enumerate() {
            if resident(c as u64 * chunk) {
                state.store(RESIDENT, Ordering::Release);
                shared.count_resident();
            }
        }
        let mut pager = Pager {
            shared: shared.clone(),
            threads: Vec::new(),
            cpus,
        };
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
            pager.spawn(format!("uffd-handler{t}"), move || {
                shared.serve_faults(&served)
            })?;
        }
        for t in 0..config.readahead_threads {
            let shared = shared.clone();
            pager.spawn(format!("uffd-readahead{t}"), move || {
                shared.serve_readahead()
            })?;
        }
        if config.background || !config.prefetch.is_empty() {
            let shared = shared.clone();
            pager.spawn("uffd-background".into(), move || shared.fetch_everything())?;
        }
        tracing::debug!(region = %pager.shared.region, ?mode, uffds = n_uffds, handlers = config.handlers, chunk, "pager started");
        Ok(pager)
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

    pub fn stats(&self) -> PagerStats {
        self.shared.stats()
    }

    /// When the whole region became resident and the pager retired (`None` until then).
    pub fn retired_at(&self) -> Option<Instant> {
        *self
            .shared
            .retired_at
            .lock()
            .unwrap_or_else(|e| e.into_inner())
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
        let bounce = if s.mode == Mode::Copy && s.source.mapped().is_none() {
            s.bounce
        } else {
            0
        };
        let event_buffers = s.handlers as u64 * EVENT_BATCH as u64 * 32;
        let queue = s
            .readahead_queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
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
        let mut failure = s.failure.lock().unwrap_or_else(|e| e.into_inner());
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
                .unwrap_or_else(|e| e.into_inner())
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
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|&c| c as u64 * s.chunk)
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
        let chunks = (offset / s.chunk) as usize..=((end - 1) / s.chunk) as usize;
        chunks
            .into_iter()
            .all(|c| s.states[c].load(Ordering::Acquire) == RESIDENT)
    }

    /// The error that stopped the pager, if a fetch failed for good.
    pub fn failure(&self) -> Option<String> {
        self.shared
            .failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

impl Drop for Pager {
    fn drop(&mut self) {
        self.shared.signal_stop();
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
                    self.shared.size as usize,
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

impl Shared {
    #[allow(clippy::too_many_arguments)]
    fn new(
        layout: Layout,
        uffds: Vec<Uffd>,
        shards: Vec<Range<usize>>,
        source: Arc<dyn PageSource>,
        config: &PagerConfig,
        stop: OwnedFd,
        on_failure: Option<OnFailure>,
    ) -> Shared {
        let Layout {
            region,
            gpa,
            host,
            size,
            page,
            chunk,
            mode,
            alias,
            memfd,
        } = layout;
        let chunks = size.div_ceil(chunk) as usize;
        let threads = (config.handlers + config.readahead_threads + usize::from(config.background))
            .max(1) as u64;
        let bounce_share = (size / BOUNCE_SHARE / threads) & !(page - 1);
        Shared {
            region,
            gpa,
            host,
            size,
            page,
            chunk,
            bounce: chunk.min(BOUNCE_MAX).min(bounce_share).max(page),
            mode,
            alias,
            memfd,
            uffds,
            shards,
            states: (0..chunks).map(|_| AtomicU8::new(ABSENT)).collect(),
            source,
            fetch_attempts: config.fetch_attempts,
            realtime: config.realtime_handlers,
            retry_delay: config.retry_delay,
            abort: config.abort.clone(),
            on_failure,
            stop,
            faults: AtomicU64::new(0),
            busy_handlers: AtomicU64::new(0),
            fault_chunks: AtomicU64::new(0),
            readahead_chunks: AtomicU64::new(0),
            background_chunks: AtomicU64::new(0),
            prefetch_chunks: AtomicU64::new(0),
            discarded_chunks: AtomicU64::new(0),
            resident_chunks: AtomicU64::new(0),
            prefetch: config
                .prefetch
                .iter()
                .filter(|&&off| off < size)
                .map(|&off| (off / chunk) as usize)
                .collect(),
            prefetch_done: AtomicBool::new(config.prefetch.is_empty()),
            fault_order: Mutex::new(Vec::new()),
            retired: AtomicBool::new(false),
            retired_at: Mutex::new(None),
            peer_released: None,
            released: AtomicBool::new(false),
            failure: Mutex::new(None),
            changed: Condvar::new(),
            handlers: config.handlers,
            readahead: config.readahead_chunks,
            readahead_threads: config.readahead_threads,
            readahead_queue: Mutex::new(VecDeque::new()),
            readahead_queued: Condvar::new(),
            background: config.background,
        }
    }

    fn stats(&self) -> PagerStats {
        let resident = self.resident_chunks.load(Ordering::Acquire) * self.chunk;
        PagerStats {
            faults: self.faults.load(Ordering::Relaxed),
            fault_chunks: self.fault_chunks.load(Ordering::Relaxed),
            readahead_chunks: self.readahead_chunks.load(Ordering::Relaxed),
            background_chunks: self.background_chunks.load(Ordering::Relaxed),
            prefetch_chunks: self.prefetch_chunks.load(Ordering::Relaxed),
            prefetch_done: self.prefetch_done.load(Ordering::Acquire),
            discarded_chunks: self.discarded_chunks.load(Ordering::Relaxed),
            resident_bytes: resident.min(self.size),
            retired: self.retired.load(Ordering::Acquire),
        }
    }

    fn signal_stop(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer to our eventfd.
        unsafe { libc::write(self.stop.as_raw_fd(), one.as_ptr().cast(), 8) };
        let _queue = self
            .readahead_queue
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        self.readahead_queued.notify_all();
    }

    fn unregister(&self) {
        for (uffd, shard) in self.uffds.iter().zip(&self.shards) {
            let (start, len) = self.byte_range(shard.clone());
            // Unregistering also wakes any thread still waiting on a fault in the range.
            let _ = uffd.unregister(
                (self.host + start as usize) as *mut libc::c_void,
                len as usize,
            );
        }
    }

    /// Host offset and length of a range of chunks.
    fn byte_range(&self, chunks: Range<usize>) -> (u64, u64) {
        let start = chunks.start as u64 * self.chunk;
        let end = (chunks.end as u64 * self.chunk).min(self.size);
        (start, end - start)
    }

    /// A handler thread: reads events in batches from the `served` userfaultfds until stopped.
    fn serve_faults(&self, served: &[usize]) {
        // A vCPU waits while its fault is served: handlers run ahead of the vCPU threads when
        // the host is busy.
        if self.realtime {
            priority::make_realtime();
        } else {
            priority::raise();
        }
        let mut events = EventBuffer::new(EVENT_BATCH);
        let mut bounce = Vec::new();
        let mut fds: Vec<libc::pollfd> = std::iter::once(self.stop.as_raw_fd())
            .chain(served.iter().map(|&i| self.uffds[i].as_raw_fd()))
            .map(|fd| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        loop {
            // SAFETY: `fds` is a live array of `fds.len()` pollfds.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
            if n < 0 {
                continue; // EINTR
            }
            if fds[0].revents != 0 {
                return;
            }
            for (k, &shard) in served.iter().enumerate() {
                if fds[k + 1].revents == 0 {
                    continue;
                }
                let uffd = &self.uffds[shard];
                let batch: Vec<Event> = match uffd.read_events(&mut events) {
                    Ok(iter) => iter.filter_map(|e| e.ok()).collect(),
                    Err(e) => {
                        tracing::warn!(region = %self.region, "reading userfaultfd events: {e}");
                        continue;
                    }
                };
                self.handler_busy();
                let mut sequential = None;
                for event in batch {
                    match event {
                        Event::Pagefault { kind, addr, .. } => {
                            sequential = self
                                .on_fault(shard, addr as usize, kind, &mut bounce)
                                .or(sequential);
                        }
                        Event::Remove { start, end } => {
                            self.on_remove(start as usize, end as usize)
                        }
                        _ => {}
                    }
                }
                if let Some(chunk) = sequential {
                    self.read_ahead(shard, chunk, &mut bounce);
                }
                self.handler_idle();
            }
        }
    }

    /// Resolves one fault; returns its chunk when the access looks sequential (the chunk
    /// before it, in the same shard, is resident).
    fn on_fault(
        &self,
        shard: usize,
        addr: usize,
        kind: FaultKind,
        bounce: &mut Vec<u8>,
    ) -> Option<usize> {
        self.faults.fetch_add(1, Ordering::Relaxed);
        let off = ((addr - self.host) as u64) & !(self.page - 1);
        let chunk = (off / self.chunk) as usize;
        if self.make_resident(chunk, shard, bounce, By::Fault) {
            // The chunk was installed earlier: either this event was queued before that, or
            // the VMM discarded the page since (it then reads as zero, or as the page cache).
            self.refill_page(shard, off, kind, bounce);
        }
        let sequential = chunk > self.shards[shard].start
            && self.states[chunk - 1].load(Ordering::Acquire) == RESIDENT;
        sequential.then_some(chunk)
    }

    /// Installs the chunks after `chunk` in its shard until the readahead window ends, a chunk
    /// is already there, or another event waits on the shard's userfaultfd (faults first); with
    /// readahead threads, queues the absent ones of the window for them instead.
    fn read_ahead(&self, shard: usize, chunk: usize, bounce: &mut Vec<u8>) {
        let end = (chunk + 1 + self.readahead).min(self.shards[shard].end);
        if self.readahead_threads > 0 {
            let mut queue = self
                .readahead_queue
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            for next in chunk + 1..end {
                if self.states[next].load(Ordering::Acquire) == ABSENT
                    && !queue.contains(&(next, shard))
                {
                    queue.push_back((next, shard));
                }
            }
            self.readahead_queued.notify_all();
            return;
        }
        for next in chunk + 1..end {
            if self.states[next].load(Ordering::Acquire) != ABSENT || self.events_waiting(shard) {
                return;
            }
            self.make_resident(next, shard, bounce, By::Readahead);
        }
    }

    /// A readahead thread: installs the queued chunks, oldest first, until stopped.
    fn serve_readahead(&self) {
        // The guest is about to touch these chunks: nearly as urgent as a fault.
        priority::raise();
        let mut bounce = Vec::new();
        loop {
            let next = {
                let mut queue = self
                    .readahead_queue
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                loop {
                    // Checked under the queue's lock, which `signal_stop` takes to notify.
                    if self.stopped() {
                        return;
                    }
                    if let Some(next) = queue.pop_front() {
                        break next;
                    }
                    queue = self
                        .readahead_queued
                        .wait(queue)
                        .unwrap_or_else(|e| e.into_inner());
                }
            };
            let (chunk, shard) = next;
            self.make_resident(chunk, shard, &mut bounce, By::Readahead);
        }
    }

    fn events_waiting(&self, shard: usize) -> bool {
        let mut fd = libc::pollfd {
            fd: self.uffds[shard].as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: polls one live pollfd without waiting.
        unsafe { libc::poll(&mut fd, 1, 0) > 0 }
    }

    /// `UFFD_EVENT_REMOVE`: chunks wholly discarded before anyone fetched them read as zero
    /// from now on, so they are never fetched.
    fn on_remove(&self, start: usize, end: usize) {
        let lo = (start.max(self.host) - self.host) as u64;
        let hi = (end
            .min(self.host + self.size as usize)
            .saturating_sub(self.host)) as u64;
        let first = lo.div_ceil(self.chunk) as usize;
        let last = (hi / self.chunk) as usize;
        for c in first..last.max(first) {
            if self.states[c]
                .compare_exchange(ABSENT, RESIDENT, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                self.discarded_chunks.fetch_add(1, Ordering::Relaxed);
                self.count_resident();
            }
        }
    }

    /// Makes `chunk` resident unless it is already; returns true when it already was. A fault
    /// waits for a chunk another thread is installing; readahead and background skip it.
    fn make_resident(&self, chunk: usize, shard: usize, bounce: &mut Vec<u8>, by: By) -> bool {
        loop {
            match self.states[chunk].compare_exchange(
                ABSENT,
                FETCHING,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => match self.install(chunk, shard, bounce, by) {
                    Ok(true) => {
                        self.set_state(chunk, RESIDENT);
                        let counter = match by {
                            By::Fault => &self.fault_chunks,
                            By::Readahead => &self.readahead_chunks,
                            By::Background => &self.background_chunks,
                            By::Prefetch => &self.prefetch_chunks,
                        };
                        if matches!(by, By::Fault | By::Readahead) {
                            self.fault_order
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .push(chunk as u32);
                        }
                        counter.fetch_add(1, Ordering::Relaxed);
                        self.count_resident();
                        return false;
                    }
                    Ok(false) => {
                        // The mapping was changing (EAGAIN): let the fault come again.
                        self.set_state(chunk, ABSENT);
                        let (start, len) = self.byte_range(chunk..chunk + 1);
                        let _ = self.uffds[shard].wake(
                            (self.host + start as usize) as *mut libc::c_void,
                            len as usize,
                        );
                        return false;
                    }
                    Err(Error::Released { .. }) => {
                        self.set_state(chunk, FAILED);
                        self.release();
                        return false;
                    }
                    Err(e) => {
                        self.set_state(chunk, FAILED);
                        self.fail(e);
                        return false;
                    }
                },
                Err(FETCHING) if by != By::Fault => return false,
                Err(FETCHING) => self.wait_for_change(chunk),
                Err(RESIDENT) => return true,
                Err(_) => return false, // FAILED: the VM is being stopped
            }
        }
    }

    /// A handler starts on a batch of events: the background fetcher holds back.
    fn handler_busy(&self) {
        self.busy_handlers.fetch_add(1, Ordering::AcqRel);
    }

    /// A handler is done with its batch: the last one wakes the background fetcher.
    fn handler_idle(&self) {
        if self.busy_handlers.fetch_sub(1, Ordering::AcqRel) == 1 {
            let _guard = self.failure.lock().unwrap_or_else(|e| e.into_inner());
            self.changed.notify_all();
        }
    }

    /// The background fetcher's step aside: sleeps while a handler serves faults, so that a
    /// fault's fetch has the CPU to itself (a `yield_now` loop here kept one of two cores busy
    /// for the whole fetch, away from the page server and the vCPUs).
    fn wait_for_idle_handlers(&self) {
        let mut guard = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        while self.busy_handlers.load(Ordering::Acquire) > 0 && guard.is_none() {
            // The timeout only bounds a wait that a stop (which does not notify) would prolong.
            guard = self
                .changed
                .wait_timeout(guard, Duration::from_millis(1))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Sleeps until `chunk` leaves FETCHING (another thread is installing it).
    fn wait_for_change(&self, chunk: usize) {
        let guard = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        if self.states[chunk].load(Ordering::Acquire) == FETCHING {
            let _ = self.changed.wait_timeout(guard, Duration::from_millis(1));
        }
    }

    /// Sets `chunk`'s state and wakes the threads waiting for it.
    fn set_state(&self, chunk: usize, state: u8) {
        self.states[chunk].store(state, Ordering::Release);
        let _guard = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        self.changed.notify_all();
    }

    fn count_resident(&self) {
        let n = self.resident_chunks.fetch_add(1, Ordering::AcqRel) + 1;
        if n == self.states.len() as u64 && self.background {
            self.retire();
        }
    }

    /// Everything is resident: unregister, so the guest no longer goes through us at all.
    fn retire(&self) {
        if self.retired.swap(true, Ordering::AcqRel) {
            return;
        }
        *self.retired_at.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
        self.unregister();
        self.signal_stop();
        let _guard = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        self.changed.notify_all();
        tracing::debug!(region = %self.region, "pager retired: region fully resident");
    }

    fn fail(&self, e: Error) {
        let reason = e.to_string();
        // Recorded before anyone is told, so that whoever sees the VM (or peer) stop finds
        // the reason. Only the first failure is reported: the ones that follow (other chunks
        // in flight when the VM or peer went away) are its consequences, told once already.
        {
            let mut failure = self.failure.lock().unwrap_or_else(|e| e.into_inner());
            if failure.is_some() {
                tracing::debug!("after the first failure: {reason}");
                return;
            }
            tracing::error!("{reason}");
            *failure = Some(reason.clone());
            self.changed.notify_all();
        }
        if let Some(abort) = &self.abort {
            abort.abort(reason.clone());
        }
        if let Some(on_failure) = &self.on_failure {
            on_failure(&reason);
        }
    }

    /// Fetches `chunk` from the source and maps it into the region. `Ok(false)`: the mapping
    /// was changing under us (EAGAIN); try again later.
    fn install(&self, chunk: usize, shard: usize, bounce: &mut Vec<u8>, by: By) -> Result<bool> {
        let uffd = &self.uffds[shard];
        let (start, len) = self.byte_range(chunk..chunk + 1);
        if self.mode == Mode::Copy && self.page == 4096 && self.source.is_zero(start, len) {
            // SAFETY: the range is the chunk, inside the registered region.
            let zeroed = unsafe {
                uffd.zeropage(
                    (self.host + start as usize) as *mut libc::c_void,
                    len as usize,
                    true,
                )
            };
            // Partly populated (EEXIST) or changing: the copy below handles those cases.
            if matches!(zeroed, Ok(n) if n as u64 == len) {
                return Ok(true);
            }
        }
        match self.mode {
            Mode::Copy if self.source.mapped().is_some() => {
                let src = self.source.mapped().expect("checked");
                // SAFETY: the pager checked that the source holds at least the region's size.
                let src = unsafe { src.add(start as usize) };
                // Map the chunk's source pages in one call rather than one fault each inside
                // the copy (the source stays lazy: only this chunk is read).
                // SAFETY: advice on the source's own read-only mapping; it changes nothing.
                unsafe {
                    libc::madvise(
                        src as *mut libc::c_void,
                        len as usize,
                        libc::MADV_POPULATE_READ,
                    )
                };
                let copied = self.copy(uffd, src, start, len).map_err(|e| match e {
                    e @ Error::Released { .. } => e,
                    e => Error::SourceFailed {
                        region: self.region.clone(),
                        gpa: self.gpa + start,
                        len,
                        attempts: 1,
                        source: io::Error::other(e.to_string()),
                    },
                })?;
                if copied {
                    uffd.wake(
                        (self.host + start as usize) as *mut libc::c_void,
                        len as usize,
                    )
                    .map_err(|e| self.uffd_error("UFFDIO_WAKE", e))?;
                }
                Ok(copied)
            }
            Mode::Copy => {
                if bounce.len() < self.bounce as usize {
                    bounce.resize(self.bounce as usize, 0);
                }
                // The chunk is fetched as one range and copied in as its pieces arrive.
                let mut copied = Ok(true);
                self.fetch(
                    start,
                    len,
                    &mut bounce[..self.bounce as usize],
                    by,
                    &mut |off, piece| {
                        copied = self.copy(uffd, piece.as_ptr(), off, piece.len() as u64);
                        matches!(copied, Ok(true))
                    },
                )?;
                if !copied? {
                    return Ok(false);
                }
                uffd.wake(
                    (self.host + start as usize) as *mut libc::c_void,
                    len as usize,
                )
                .map_err(|e| self.uffd_error("UFFDIO_WAKE", e))?;
                Ok(true)
            }
            Mode::Continue if self.source.mapped().is_some() => {
                let src = self.source.mapped().expect("checked");
                let mut done = 0u64;
                while done < len {
                    // SAFETY: the pager checked that the source holds at least the region's
                    // size; `pwrite` reads `len - done` bytes of it into the memfd's page cache
                    // at the chunk's offset (whole pages: nothing is zeroed first). No one else
                    // writes the chunk while we hold it in FETCHING.
                    let n = unsafe {
                        libc::pwrite(
                            self.memfd,
                            src.add((start + done) as usize).cast(),
                            (len - done) as usize,
                            (start + done) as libc::off_t,
                        )
                    };
                    if n <= 0 {
                        let e = io::Error::last_os_error();
                        if n < 0 && e.kind() == io::ErrorKind::Interrupted {
                            continue;
                        }
                        return Err(Error::SourceFailed {
                            region: self.region.clone(),
                            gpa: self.gpa + start + done,
                            len: len - done,
                            attempts: 1,
                            source: e,
                        });
                    }
                    done += n as u64;
                }
                self.map_page_cache(uffd, start, len)
            }
            Mode::Continue => {
                // SAFETY: the chunk lies inside the alias mapping, and no one else writes it
                // while we hold it in FETCHING (the guest's mapping of it is not populated yet,
                // so the guest cannot reach these pages).
                let dst = unsafe {
                    std::slice::from_raw_parts_mut(
                        (self.alias + start as usize) as *mut u8,
                        len as usize,
                    )
                };
                // Allocate the chunk's page-cache pages in one call rather than one fault each.
                // SAFETY: advice on our own alias mapping; it changes no contents.
                unsafe {
                    libc::madvise(
                        dst.as_mut_ptr().cast(),
                        dst.len(),
                        libc::MADV_POPULATE_WRITE,
                    )
                };
                self.fetch(start, len, dst, by, &mut |_, _| true)?;
                self.map_page_cache(uffd, start, len)
            }
        }
    }

    /// A page of an installed chunk faulted again (see `on_fault`).
    fn refill_page(&self, shard: usize, off: u64, kind: FaultKind, bounce: &mut Vec<u8>) {
        let uffd = &self.uffds[shard];
        let result = match self.mode {
            Mode::Copy => {
                if bounce.len() < self.page as usize {
                    bounce.resize(self.page as usize, 0);
                }
                bounce[..self.page as usize].fill(0);
                self.copy(uffd, bounce.as_ptr(), off, self.page)
            }
            Mode::Continue => {
                if kind == FaultKind::Missing {
                    // A hole in the file (MADV_REMOVE): a read through the alias allocates a
                    // zeroed page-cache page without overwriting anything.
                    // SAFETY: `off` is inside the alias mapping.
                    unsafe { std::ptr::read_volatile((self.alias + off as usize) as *const u8) };
                }
                self.map_page_cache(uffd, off, self.page)
            }
        };
        let _ = uffd.wake(
            (self.host + off as usize) as *mut libc::c_void,
            self.page as usize,
        );
        // After retirement the range is unregistered (which woke the vCPU): nothing to refill.
        if self.retired.load(Ordering::Acquire) {
            return;
        }
        if let Err(e) = result {
            tracing::warn!(region = %self.region, "refilling a discarded page: {e}");
        }
    }

    /// Fetches `[off, off + len)` through `buf` into `sink` (see [`PageSource::fetch_pieces`]),
    /// retrying a failed fetch from the first byte `sink` has not had yet.
    fn fetch(
        &self,
        off: u64,
        len: u64,
        buf: &mut [u8],
        by: By,
        sink: &mut dyn FnMut(u64, &[u8]) -> bool,
    ) -> Result<()> {
        let urgent = matches!(by, By::Fault | By::Readahead);
        let end = off + len;
        let mut next = off;
        let mut last = None;
        for attempt in 1..=self.fetch_attempts {
            let fetched =
                self.source
                    .fetch_pieces(next, end - next, buf, urgent, &mut |at, piece| {
                        next = at + piece.len() as u64;
                        sink(at, piece)
                    });
            match fetched {
                Ok(()) => return Ok(()),
                Err(e) => {
                    tracing::warn!(region = %self.region, gpa = self.gpa + next, attempt, "page source: {e}");
                    last = Some(e);
                    if attempt < self.fetch_attempts {
                        std::thread::sleep(self.retry_delay);
                    }
                }
            }
        }
        Err(Error::SourceFailed {
            region: self.region.clone(),
            gpa: self.gpa + next,
            len: end - next,
            attempts: self.fetch_attempts,
            source: last.expect("at least one attempt"),
        })
    }

    /// `UFFDIO_COPY` of `len` bytes from `src` to region offset `off`, without waking.
    /// Pages already present (`EEXIST`) are skipped; a partial copy (`EAGAIN`) continues with
    /// the rest. `Ok(false)` when the mapping is changing (nothing could be copied).
    fn copy(&self, uffd: &Uffd, src: *const u8, off: u64, len: u64) -> Result<bool> {
        let mut done = 0u64;
        let mut page_by_page = false;
        while done < len {
            let n = if page_by_page { self.page } else { len - done };
            // SAFETY: `src + done` has `n` readable bytes (the caller's buffer of `len`), and
            // the destination lies inside the registered region.
            let r = unsafe {
                uffd.copy(
                    src.add(done as usize).cast(),
                    (self.host + (off + done) as usize) as *mut libc::c_void,
                    n as usize,
                    false,
                )
            };
            match r {
                Ok(copied) => done += copied as u64,
                Err(userfaultfd::Error::PartiallyCopied(copied)) if (copied as isize) > 0 => {
                    done += copied as u64
                }
                Err(userfaultfd::Error::PartiallyCopied(_)) => return Ok(false),
                Err(userfaultfd::Error::CopyFailed(errno)) if errno as i32 == libc::EEXIST => {
                    if page_by_page {
                        done += self.page;
                    } else {
                        page_by_page = true;
                    }
                }
                Err(userfaultfd::Error::CopyFailed(errno))
                    if matches!(errno as i32, libc::ENOENT | libc::ESRCH)
                        && self.peer_let_go(off + done, n) =>
                {
                    return Err(Error::Released {
                        region: self.region.clone(),
                    })
                }
                Err(e) => return Err(self.uffd_error("UFFDIO_COPY", e)),
            }
        }
        Ok(true)
    }

    /// Whether the peer let go of region offset `[off, off + len)` (see [`PeerReleased`]).
    fn peer_let_go(&self, off: u64, len: u64) -> bool {
        self.peer_released
            .as_ref()
            .is_some_and(|released| released(self.host as u64 + off, len))
    }

    /// The peer let go of the range: serving it ends (the background fetch stops), without a
    /// failure.
    fn release(&self) {
        if self.released.swap(true, Ordering::AcqRel) {
            return;
        }
        tracing::info!(region = %self.region, "the peer no longer maps the range: serving it ends");
        self.signal_stop();
        let _guard = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        self.changed.notify_all();
    }

    /// `UFFDIO_CONTINUE` over region offset `[off, off + len)` (waking the faulting threads),
    /// skipping pages already mapped.
    fn map_page_cache(&self, uffd: &Uffd, off: u64, len: u64) -> Result<bool> {
        let mut done = 0u64;
        let mut page_by_page = false;
        while done < len {
            let n = if page_by_page { self.page } else { len - done };
            let addr = (self.host + (off + done) as usize) as *mut libc::c_void;
            match uffd.r#continue(addr, n as usize, true) {
                Ok(mapped) if mapped > 0 => done += mapped,
                Ok(_) => return Ok(false),
                Err(userfaultfd::Error::SystemError(errno)) if errno as i32 == libc::EEXIST => {
                    if page_by_page {
                        done += self.page;
                    } else {
                        page_by_page = true;
                    }
                }
                Err(userfaultfd::Error::SystemError(errno)) if errno as i32 == libc::EAGAIN => {
                    return Ok(false)
                }
                Err(e) => return Err(self.uffd_error("UFFDIO_CONTINUE", e)),
            }
        }
        if page_by_page {
            let _ = uffd.wake(
                (self.host + off as usize) as *mut libc::c_void,
                len as usize,
            );
        }
        Ok(true)
    }

    fn uffd_error(&self, op: &'static str, source: userfaultfd::Error) -> Error {
        Error::Uffd {
            region: self.region.clone(),
            op,
            source,
        }
    }

    /// The background fetcher: walks every shard's chunks in turn (so that it runs ahead of
    /// each vCPU touching its own range) until all are resident. Faults come first: it steps
    /// aside while a handler is busy. (It keeps the normal CPU priority: a lower one would
    /// leave a fault waiting on a chunk it holds behind every other task on a busy host.)
    fn fetch_everything(&self) {
        let mut bounce = Vec::new();
        for (i, &chunk) in self.prefetch.iter().enumerate() {
            if self.retired.load(Ordering::Acquire) || self.failure().is_some() {
                break;
            }
            if i % 64 == 0 && self.stopped() {
                return;
            }
            let shard = self
                .shards
                .iter()
                .position(|s| s.contains(&chunk))
                .expect("every chunk is in a shard");
            // Faults first, as in the sweep below.
            self.wait_for_idle_handlers();
            self.make_resident(chunk, shard, &mut bounce, By::Prefetch);
        }
        self.prefetch_done.store(true, Ordering::Release);
        if !self.background {
            return;
        }
        // The guest comes first: on a small host the sweep would take the CPU from the vCPU
        // that is about to run and from the handler serving its first fault (measured: 5-8 ms
        // more to the restored guest's first progress on 2 cores). Wait for a first fault to
        // be served, or for SWEEP_DELAY if none comes.
        let deadline = Instant::now() + SWEEP_DELAY;
        while self.fault_chunks.load(Ordering::Acquire) == 0 && Instant::now() < deadline {
            if self.stopped() {
                return;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        let rounds = self.shards.iter().map(|s| s.len()).max().unwrap_or(0);
        while !self.retired.load(Ordering::Acquire) && self.failure().is_none() {
            if self.stopped() {
                return;
            }
            for round in 0..rounds {
                for (shard, chunks) in self.shards.iter().enumerate() {
                    let chunk = chunks.start + round;
                    if chunk < chunks.end {
                        self.wait_for_idle_handlers();
                        self.make_resident(chunk, shard, &mut bounce, By::Background);
                    }
                }
                if round % 64 == 0 && self.stopped() {
                    return;
                }
            }
            // Chunks still being fetched by a handler, or put back after EAGAIN.
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn failure(&self) -> Option<String> {
        self.failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn stopped(&self) -> bool {
        let mut fd = libc::pollfd {
            fd: self.stop.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: polls one live pollfd without waiting.
        unsafe { libc::poll(&mut fd, 1, 0) > 0 }
    }
}

/// One range of another process's memory registered on a userfaultfd that a [`PeerPager`]
/// serves (a Firecracker-style VMM registered it and passed the fd on).
pub struct PeerRange {
    /// Names the range in errors and logs.
    pub name: String,
    /// The range's start in the registering process's address space.
    pub host_addr: u64,
    pub size: u64,
    /// The page size of the range's mapping (4 KiB, or the huge page size).
    pub page_size: u64,
    /// The range's bytes (offset 0 = `host_addr`).
    pub source: Arc<dyn PageSource>,
}

/// Demand paging over a userfaultfd that someone else created and registered, possibly for
/// several ranges, possibly in another process: the same chunk engine as [`Pager`] (fault-around,
/// readahead, background fetch, `EEXIST`/`EAGAIN` handling, `UFFD_EVENT_REMOVE` making
/// discarded pages read as zero), with one handler thread reading the fd's events and handing
/// each to the range it falls in. Only `MISSING` faults resolved by `UFFDIO_COPY` are served
/// (anonymous and hugetlb memory). Dropping it stops its threads; it does not unregister
/// ranges that are not fully resident.
pub struct PeerPager {
    ranges: Vec<Arc<Shared>>,
    stop: OwnedFd,
    threads: Vec<JoinHandle<()>>,
    cpus: Option<CpuSet>,
}

fn new_eventfd(region: &str) -> Result<OwnedFd> {
    // SAFETY: eventfd returns a new fd (checked) that nobody else owns.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(Error::Os {
            region: region.into(),
            op: "eventfd",
            source: io::Error::last_os_error(),
        });
    }
    // SAFETY: `fd` is the fresh eventfd from above.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

impl PeerPager {
    /// Serves `ranges`, all registered (`MISSING`) on `uffd`, which must already have gone
    /// through `UFFDIO_API`. `config.uffds` and `config.handlers` are ignored (one fd, one
    /// handler); `on_failure` is told when a fetch fails for good; `released` tells a range
    /// the peer let go of (it unmapped it, or is exiting) from a failure (see
    /// [`PeerReleased`]; without it, every failed copy is a failure).
    pub fn start(
        uffd: OwnedFd,
        ranges: Vec<PeerRange>,
        config: &PagerConfig,
        on_failure: Option<OnFailure>,
        released: Option<PeerReleased>,
    ) -> Result<PeerPager> {
        let cpus = pager_cpus(config).map_err(|reason| Error::Config {
            region: "peer pager".into(),
            reason,
        })?;
        let mut shareds: Vec<Arc<Shared>> = Vec::with_capacity(ranges.len());
        let mut sorted = ranges;
        sorted.sort_by_key(|r| r.host_addr);
        for (i, r) in sorted.iter().enumerate() {
            let bad = |reason: String| Error::Config {
                region: r.name.clone(),
                reason,
            };
            let chunk = config.fault_around.max(r.page_size);
            if !r.page_size.is_power_of_two() || r.page_size < 4096 {
                return Err(bad(format!(
                    "page size {:#x} is not a power of two of at least 4 KiB",
                    r.page_size
                )));
            }
            if !chunk.is_power_of_two() {
                return Err(bad(format!(
                    "fault-around {chunk:#x} is not a power of two"
                )));
            }
            if r.size == 0 || r.size % r.page_size != 0 || r.host_addr % r.page_size != 0 {
                return Err(bad(format!(
                    "range {:#x}+{:#x} is empty or not aligned to its page size {:#x}",
                    r.host_addr, r.size, r.page_size
                )));
            }
            if r.source.size() < r.size {
                return Err(bad(format!(
                    "the page source holds {:#x} bytes, less than the range's {:#x}",
                    r.source.size(),
                    r.size
                )));
            }
            if i > 0 && sorted[i - 1].host_addr + sorted[i - 1].size > r.host_addr {
                return Err(bad(format!(
                    "range {:#x}+{:#x} overlaps '{}'",
                    r.host_addr,
                    r.size,
                    sorted[i - 1].name
                )));
            }
            let dup = uffd.try_clone().map_err(|source| Error::Os {
                region: r.name.clone(),
                op: "dup of the userfaultfd",
                source,
            })?;
            // SAFETY: `dup` is a userfaultfd we own; the Uffd takes it over (closes it on drop).
            let uffd = unsafe { Uffd::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(dup)) };
            let chunks = r.size.div_ceil(chunk) as usize;
            // One handler, which reads ahead itself; a prefetch list names offsets of one
            // region, not of each range.
            let config = PagerConfig {
                handlers: 1,
                readahead_threads: 0,
                prefetch: Vec::new(),
                ..config.clone()
            };
            let mut shared = Shared::new(
                Layout {
                    region: r.name.clone(),
                    gpa: 0,
                    host: r.host_addr as usize,
                    size: r.size,
                    page: r.page_size,
                    chunk,
                    mode: Mode::Copy,
                    alias: 0,
                    memfd: -1,
                },
                vec![uffd],
                std::iter::once(0..chunks).collect(),
                r.source.clone(),
                &config,
                new_eventfd(&r.name)?,
                on_failure.clone(),
            );
            shared.peer_released = released.clone();
            shareds.push(Arc::new(shared));
        }
        let mut pager = PeerPager {
            stop: new_eventfd("peer pager")?,
            ranges: shareds,
            threads: Vec::new(),
            cpus,
        };
        // SAFETY: `uffd` is a userfaultfd we own; the handler's Uffd takes it over.
        let reader = unsafe { Uffd::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(uffd)) };
        let ranges = pager.ranges.clone();
        let stop = pager.stop.as_raw_fd();
        pager.spawn("uffd-peer-handler".into(), move || {
            serve_peer_faults(&reader, &ranges, stop)
        })?;
        if config.background {
            for shared in pager.ranges.clone() {
                pager.spawn("uffd-background".into(), move || shared.fetch_everything())?;
            }
        }
        Ok(pager)
    }

    fn spawn(&mut self, name: String, f: impl FnOnce() + Send + 'static) -> Result<()> {
        let ranges = self.ranges.clone();
        let on_panic = move |reason: String| {
            for shared in &ranges {
                let region = shared.region.clone();
                shared.fail(Error::Stopped {
                    region,
                    reason: reason.clone(),
                });
            }
        };
        let handle = spawn_pager_thread("peer pager", name, self.cpus, f, on_panic)?;
        self.threads.push(handle);
        Ok(())
    }

    /// Per range, in address order.
    pub fn stats(&self) -> Vec<PagerStats> {
        self.ranges.iter().map(|s| s.stats()).collect()
    }

    /// The first error that stopped a range, if a fetch failed for good.
    pub fn failure(&self) -> Option<String> {
        self.ranges.iter().find_map(|s| s.failure())
    }

    /// Whether the peer let go of every range (see [`PeerReleased`]) before it was resident.
    pub fn released(&self) -> bool {
        self.ranges
            .iter()
            .all(|s| s.released.load(Ordering::Acquire))
    }

    /// Whether every range is resident and retired (only with background fetch).
    pub fn retired(&self) -> bool {
        self.ranges
            .iter()
            .all(|s| s.retired.load(Ordering::Acquire))
    }
}

impl Drop for PeerPager {
    fn drop(&mut self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer to our eventfd.
        unsafe { libc::write(self.stop.as_raw_fd(), one.as_ptr().cast(), 8) };
        for s in &self.ranges {
            s.signal_stop();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The [`PeerPager`]'s handler: reads events in batches and hands each to its range.
fn serve_peer_faults(uffd: &Uffd, ranges: &[Arc<Shared>], stop: i32) {
    priority::raise();
    let mut events = EventBuffer::new(EVENT_BATCH);
    let mut bounce = Vec::new();
    let find = |addr: usize| {
        ranges
            .iter()
            .find(|s| addr >= s.host && addr < s.host + s.size as usize)
    };
    loop {
        let mut fds = [stop, uffd.as_raw_fd()].map(|fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        });
        // SAFETY: `fds` is a live array of 2 pollfds.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if n < 0 {
            continue; // EINTR
        }
        if fds[0].revents != 0 {
            return;
        }
        if fds[1].revents & (libc::POLLERR | libc::POLLHUP) != 0 {
            tracing::debug!("userfaultfd hung up: the peer's memory is gone");
            return;
        }
        let batch: Vec<Event> = match uffd.read_events(&mut events) {
            Ok(iter) => iter.filter_map(|e| e.ok()).collect(),
            Err(e) => {
                tracing::warn!("reading the peer's userfaultfd events: {e}");
                continue;
            }
        };
        for s in ranges {
            s.handler_busy();
        }
        let mut sequential: Option<(&Arc<Shared>, usize)> = None;
        for event in batch {
            match event {
                Event::Pagefault { kind, addr, .. } => match find(addr as usize) {
                    Some(s) => {
                        if let Some(chunk) = s.on_fault(0, addr as usize, kind, &mut bounce) {
                            sequential = Some((s, chunk));
                        }
                    }
                    // The peer registered memory it did not describe: nobody can serve it,
                    // so serving has failed for good (the faulting thread would wait forever).
                    None => {
                        if let Some(first) = ranges.first() {
                            first.fail(Error::Config {
                                region: first.region.clone(),
                                reason: format!(
                                    "fault at {addr:?}, outside every range the peer described"
                                ),
                            });
                        }
                    }
                },
                Event::Remove { start, end } => {
                    for s in ranges {
                        s.on_remove(start as usize, end as usize);
                    }
                }
                _ => {}
            }
        }
        if let Some((s, chunk)) = sequential {
            s.read_ahead(0, chunk, &mut bounce);
        }
        for s in ranges {
            s.handler_idle();
        }
    }
}

/// The VMM's side of a [`PeerPager`]: creates a userfaultfd with `UFFD_EVENT_REMOVE` and
/// registers every one of `regions` on it in `MISSING` mode, for a page server to serve (the fd
/// is to be sent to it). Backends userfaultfd cannot serve in that mode (guest_memfd) are
/// refused, as by [`Pager::start`].
pub fn register_for_peer(regions: &[&Region]) -> Result<OwnedFd> {
    let mut features = UFFD_FEATURE_EVENT_REMOVE;
    for r in regions {
        features |= match r.backend() {
            Backend::Anon => 0,
            Backend::Memfd => UFFD_FEATURE_MISSING_SHMEM,
            Backend::MemfdHugetlb | Backend::Hugetlbfs => UFFD_FEATURE_MISSING_HUGETLBFS,
            backend @ Backend::GuestMemfd => {
                return Err(Error::Unsupported {
                    region: r.name().into(),
                    backend,
                    reason: "userfaultfd cannot register guest_memfd mappings".into(),
                })
            }
        };
    }
    let name = regions.first().map(|r| r.name()).unwrap_or("none");
    let uffd = UffdBuilder::new()
        .close_on_exec(true)
        .non_blocking(true)
        .user_mode_only(false)
        .require_features(FeatureFlags::from_bits_retain(features))
        .create()
        .map_err(|source| Error::Uffd {
            region: name.into(),
            op: "userfaultfd / UFFDIO_API",
            source,
        })?;
    for r in regions {
        uffd.register_with_mode(
            r.host_addr() as *mut libc::c_void,
            r.size() as usize,
            RegisterMode::MISSING,
        )
        .map_err(|source| Error::Uffd {
            region: r.name().into(),
            op: "UFFDIO_REGISTER",
            source,
        })?;
    }
    // `Uffd::into_raw_fd` (userfaultfd 0.9) still closes the fd on drop: forget the Uffd.
    let fd = uffd.as_raw_fd();
    std::mem::forget(uffd);
    // SAFETY: the forgotten Uffd's fd, which we now own alone.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

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
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "no message".into());
            on_panic(format!("pager thread '{thread}' panicked: {message}"));
        }
    };
    std::thread::Builder::new()
        .name(name)
        .stack_size(256 << 10)
        .spawn(move || {
            if let Some(cpus) = cpus {
                // The CPUs were checked at the pager's start; this fails only if the process
                // lost them since (its cpuset changed): the thread then runs where it may.
                if let Err(e) = cpus.pin_current_thread() {
                    tracing::warn!(region = %region_name, "pinning a pager thread to {cpus:?}: {e}");
                }
            }
            f()
        })
        .map_err(|source| Error::Os {
            region: region.into(),
            op: "spawning a pager thread",
            source,
        })
}
