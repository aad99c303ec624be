//! What a [`Pager`](super::Pager)(super::Pager) is asked to do, and what it reports having done.

use std::time::Duration;

use guestmem_vm::AbortHandle;

/// How a [`Pager`](super::Pager) works.
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
    /// (e.g. the working set a previous run faulted on, see [`Pager::fault_order`](super::Pager::fault_order)). Fetched
    /// by the background thread, which runs for them even without `background`.
    pub prefetch: Vec<u64>,
    /// Run the fault handlers under `SCHED_FIFO` ([`priority::make_realtime`](crate::priority::make_realtime)) instead of at
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
    /// Share the snapshot's clean pages with the other clones restored from it on this host
    /// (see [`SharedImage`](crate::SharedImage)): the region becomes a copy-on-write mapping of
    /// the snapshot's shared image, filled by whichever clone first needs a chunk. Anonymous
    /// regions only; the restore sets the snapshot's id.
    pub share: Option<crate::Share>,
    /// The nice value of the background thread (working-set prefetch and sweep), `None`: the
    /// process's. A lazy restore's clones run it at a lower priority than their vCPUs and
    /// fault handlers, so that on a busy host new restores and the guests' faults are served
    /// first and the prefetch takes the CPU they leave.
    pub background_nice: Option<i32>,
    /// The background thread (prefetch and sweep) waits for [`Pager::release`](super::Pager::release)
    /// before it fetches anything: a pager armed ahead of the restore that runs its VM (a
    /// pool of armed VMs) fetches nothing until a clone is restored into it.
    pub hold_background: bool,
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
            share: None,
            background_nice: None,
            hold_background: false,
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
