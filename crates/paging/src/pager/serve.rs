//! The pager's threads: fault handlers reading events in batches, readahead, the background
//! fetcher; and the chunk state machine they share (absent, fetching, resident, failed).

use guestmem_sys::to_usize;
use std::collections::VecDeque;
use std::ops::Range;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use guestmem_memory::PageBuf;
use userfaultfd::{Event, EventBuffer, FaultKind, Uffd};

use super::{
    By, Layout, OnFailure, PagerConfig, PagerStats, Shared, ABSENT, BOUNCE_MAX, BOUNCE_SHARE,
    EVENT_BATCH, FAILED, FETCHING, RESIDENT, SWEEP_DELAY,
};
use crate::{priority, Error, PageSource, UffdError};

/// What one background fetch may take on the link (see `background_run`).
const BACKGROUND_FETCH: Duration = Duration::from_micros(250);
/// The most chunks one background fetch brings.
const BACKGROUND_RUN_MAX: usize = 32;
/// Faulted chunks after which a source serving requests concurrently gets its windows read
/// ahead and its background beside the faults (see `Shared::concurrent_under_way`).
const START_FAULTS: u64 = 16;

impl Shared {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
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
        let chunks = to_usize(size.div_ceil(chunk));
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
            image: None,
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
            background_rate: AtomicU64::new(0),
            prefetch: config
                .prefetch
                .iter()
                .filter(|&&off| off < size)
                .map(|&off| to_usize(off / chunk))
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

    pub(super) fn stats(&self) -> PagerStats {
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

    pub(super) fn signal_stop(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer to our eventfd.
        unsafe { libc::write(self.stop.as_raw_fd(), one.as_ptr().cast(), 8) };
        let _queue = self
            .readahead_queue
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.readahead_queued.notify_all();
    }

    pub(super) fn unregister(&self) {
        for (uffd, shard) in self.uffds.iter().zip(&self.shards) {
            let (start, len) = self.byte_range(shard.clone());
            // Unregistering also wakes any thread still waiting on a fault in the range.
            let _ = uffd.unregister(
                (self.host + to_usize(start)) as *mut libc::c_void,
                to_usize(len),
            );
        }
    }

    /// Host offset and length of a range of chunks.
    pub(super) fn byte_range(&self, chunks: Range<usize>) -> (u64, u64) {
        let start = chunks.start as u64 * self.chunk;
        let end = (chunks.end as u64 * self.chunk).min(self.size);
        (start, end - start)
    }

    /// A handler thread: reads events in batches from the `served` userfaultfds until stopped.
    pub(super) fn serve_faults(&self, served: &[usize]) {
        // A vCPU waits while its fault is served: handlers run ahead of the vCPU threads when
        // the host is busy.
        if self.realtime {
            priority::make_realtime();
        } else {
            priority::raise();
        }
        let mut events = EventBuffer::new(EVENT_BATCH);
        let mut bounce = PageBuf::zeroed(0);
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
                    Ok(iter) => iter.filter_map(std::result::Result::ok).collect(),
                    Err(e) => {
                        tracing::warn!(region = %self.region, "reading userfaultfd events: {}", UffdError(e));
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
                            self.on_remove(start as usize, end as usize);
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
    pub(super) fn on_fault(
        &self,
        shard: usize,
        addr: usize,
        kind: FaultKind,
        bounce: &mut PageBuf,
    ) -> Option<usize> {
        self.faults.fetch_add(1, Ordering::Relaxed);
        let off = ((addr - self.host) as u64) & !(self.page - 1);
        let chunk = to_usize(off / self.chunk);
        if self.make_resident(chunk, shard, bounce, By::Fault) {
            // The chunk was installed earlier: either this event was queued before that, or
            // the VMM discarded the page since (it then reads as zero, or as the page cache).
            self.refill_page(shard, off, kind, bounce);
        }
        // A source serving requests concurrently reads ahead after every fault (the rest of
        // the chunk's window, see `read_ahead`): its requests cost a round trip each, not
        // bandwidth, and a guest touching memory at random would otherwise fetch it a
        // chunk per fault.
        let sequential = self.concurrent_under_way()
            || (chunk > self.shards[shard].start
                && self.states[chunk - 1].load(Ordering::Acquire) == RESIDENT);
        sequential.then_some(chunk)
    }

    /// Installs the chunks after `chunk` in its shard until the readahead window ends, a chunk
    /// is already there, or another event waits on the shard's userfaultfd (faults first); with
    /// readahead threads, queues the absent ones of the window for them instead. From a
    /// source serving requests concurrently, the window is the background's run that holds
    /// `chunk` (aligned), queued around it for the readahead threads, which fetch each stretch
    /// of it as one request.
    pub(super) fn read_ahead(&self, shard: usize, chunk: usize, bounce: &mut PageBuf) {
        let mut start = chunk + 1;
        let mut end = (chunk + 1 + self.readahead).min(self.shards[shard].end);
        if self.readahead_threads > 0 && self.concurrent_under_way() {
            let run = self.background_run().max(self.readahead);
            start = (chunk - chunk % run).max(self.shards[shard].start);
            end = (start + run).min(self.shards[shard].end);
        }
        if self.readahead_threads > 0 {
            let mut queue = self
                .readahead_queue
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            for next in start..end {
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
    pub(super) fn serve_readahead(&self) {
        // The guest is about to touch these chunks: nearly as urgent as a fault. (From a
        // source serving requests concurrently, once the guest is under way, readahead brings
        // whole windows, which are not: at the normal priority, they leave the vCPUs their
        // share.)
        priority::raise();
        let mut raised = true;
        let mut bounce = PageBuf::zeroed(0);
        loop {
            if raised && self.concurrent_under_way() {
                priority::normal();
                raised = false;
            }
            let next = {
                let mut queue = self
                    .readahead_queue
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
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
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                }
            };
            let (chunk, shard) = next;
            if !self.source.concurrent_requests() {
                self.make_resident(chunk, shard, &mut bounce, By::Readahead);
                continue;
            }
            // The queued chunks right after it, in one request.
            let mut run = 1;
            {
                let mut queue = self
                    .readahead_queue
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                while run < BACKGROUND_RUN_MAX && queue.front() == Some(&(chunk + run, shard)) {
                    queue.pop_front();
                    run += 1;
                }
            }
            if run == 1 {
                self.make_resident(chunk, shard, &mut bounce, By::Readahead);
            } else {
                self.make_resident_run(chunk, run, shard, &mut bounce, By::Readahead);
            }
        }
    }

    pub(super) fn events_waiting(&self, shard: usize) -> bool {
        let mut fd = libc::pollfd {
            fd: self.uffds[shard].as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: polls one live pollfd without waiting.
        unsafe { libc::poll(&raw mut fd, 1, 0) > 0 }
    }

    /// `UFFD_EVENT_REMOVE`: chunks wholly discarded before anyone fetched them read as zero
    /// from now on, so they are never fetched.
    pub(super) fn on_remove(&self, start: usize, end: usize) {
        let lo = (start.max(self.host) - self.host) as u64;
        let hi = (end
            .min(self.host + to_usize(self.size))
            .saturating_sub(self.host)) as u64;
        let first = to_usize(lo.div_ceil(self.chunk));
        let last = to_usize(hi / self.chunk);
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

    /// How many chunks one background fetch brings: as many as the link carries in
    /// [`BACKGROUND_FETCH`] at the background's measured rate, so that on a slow link a fault's
    /// answer never queues behind much background data, and on a fast one the fetches are few;
    /// or what the source asks for ([`PageSource::background_bytes`]). Runs only from a
    /// source that is not mapped (a remote one) into copied memory.
    #[allow(clippy::cast_possible_truncation)] // a float to integer cast saturates; the result is clamped.
    fn background_run(&self) -> usize {
        if self.mode != super::Mode::Copy || self.source.mapped().is_some() {
            return 1;
        }
        if let Some(bytes) = self.source.background_bytes() {
            return to_usize((bytes / self.chunk).clamp(1, BACKGROUND_RUN_MAX as u64));
        }
        let rate = f64::from_bits(self.background_rate.load(Ordering::Relaxed));
        let bytes = rate * BACKGROUND_FETCH.as_secs_f64();
        ((bytes / self.chunk as f64) as usize).clamp(1, BACKGROUND_RUN_MAX)
    }

    /// The background's step (and a remote source's prefetch step, `by`): from `first`,
    /// claims up to `max` absent chunks in a row (of `shard`), fetches them as one range and
    /// installs them. Returns how many chunks it went past (at least 1).
    fn make_resident_run(
        &self,
        first: usize,
        max: usize,
        shard: usize,
        bounce: &mut PageBuf,
        by: By,
    ) -> usize {
        let end = self.shards[shard].end.min(first + max);
        let mut claimed = first;
        while claimed < end
            && self.states[claimed]
                .compare_exchange(ABSENT, FETCHING, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            claimed += 1;
        }
        if claimed == first {
            return 1;
        }
        let t = Instant::now();
        match self.install(first..claimed, shard, bounce, By::Background) {
            Ok(true) => {
                let (_, len) = self.byte_range(first..claimed);
                let rate = len as f64 / t.elapsed().as_secs_f64().max(1e-6);
                let old = f64::from_bits(self.background_rate.load(Ordering::Relaxed));
                let new = if old == 0.0 {
                    rate
                } else {
                    0.8 * old + 0.2 * rate
                };
                self.background_rate.store(new.to_bits(), Ordering::Relaxed);
                for chunk in first..claimed {
                    self.set_state(chunk, RESIDENT);
                    // A prefetch run's first chunk is the working set's; its neighbours come
                    // as the background's would.
                    let counter = match by {
                        By::Prefetch if chunk == first => &self.prefetch_chunks,
                        By::Readahead => &self.readahead_chunks,
                        _ => &self.background_chunks,
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                    self.count_resident();
                }
            }
            Ok(false) => {
                // The mapping was changing (EAGAIN): the chunks go back, their faults come again.
                for chunk in first..claimed {
                    self.set_state(chunk, ABSENT);
                }
                let (start, len) = self.byte_range(first..claimed);
                let _ = self.uffds[shard].wake(
                    (self.host + to_usize(start)) as *mut libc::c_void,
                    to_usize(len),
                );
            }
            Err(Error::Released { .. }) => {
                for chunk in first..claimed {
                    self.set_state(chunk, FAILED);
                }
                self.release();
            }
            Err(e) => {
                for chunk in first..claimed {
                    self.set_state(chunk, FAILED);
                }
                self.fail(e);
            }
        }
        claimed - first
    }

    /// Makes `chunk` resident unless it is already; returns true when it already was. A fault
    /// waits for a chunk another thread is installing; readahead and background skip it.
    #[allow(clippy::cast_possible_truncation)] // chunk indices of one region fit in u32 (16 TiB of 4 KiB chunks).
    pub(super) fn make_resident(
        &self,
        chunk: usize,
        shard: usize,
        bounce: &mut PageBuf,
        by: By,
    ) -> bool {
        loop {
            match self.states[chunk].compare_exchange(
                ABSENT,
                FETCHING,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => match self.install(chunk..chunk + 1, shard, bounce, by) {
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
                                .unwrap_or_else(std::sync::PoisonError::into_inner)
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
                            (self.host + to_usize(start)) as *mut libc::c_void,
                            to_usize(len),
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
    pub(super) fn handler_busy(&self) {
        self.busy_handlers.fetch_add(1, Ordering::AcqRel);
    }

    /// A handler is done with its batch: the last one wakes the background fetcher.
    pub(super) fn handler_idle(&self) {
        if self.busy_handlers.fetch_sub(1, Ordering::AcqRel) == 1 {
            let _guard = self
                .failure
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            self.changed.notify_all();
        }
    }

    /// The background fetcher's step aside: sleeps while a handler serves faults, so that a
    /// fault's fetch has the CPU to itself (a `yield_now` loop here kept one of two cores busy
    /// for the whole fetch, away from the page server and the vCPUs).
    /// Waits for the fault handlers to be idle before a background or prefetch fetch, unless
    /// the source serves requests concurrently
    /// ([`crate::PageSource::concurrent_requests`]): then a fault's request does not queue
    /// behind the background's, and waiting would only starve the background while the guest
    /// faults chunk by chunk.
    fn step_aside_for_faults(&self) {
        if !self.concurrent_under_way() {
            self.wait_for_idle_handlers();
        }
    }

    /// Whether the source serves requests concurrently and the guest is under way (it has
    /// faulted [`START_FAULTS`] chunks in): until then the pager serves its first faults
    /// alone, as for any source (the guest's first progress waits on a few of them, and on 2
    /// cores background work beside them delays it).
    fn concurrent_under_way(&self) -> bool {
        self.source.concurrent_requests()
            && self.fault_chunks.load(Ordering::Relaxed) >= START_FAULTS
    }

    pub(super) fn wait_for_idle_handlers(&self) {
        let mut guard = self
            .failure
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        while self.busy_handlers.load(Ordering::Acquire) > 0 && guard.is_none() {
            // The timeout only bounds a wait that a stop (which does not notify) would prolong.
            guard = self
                .changed
                .wait_timeout(guard, Duration::from_millis(1))
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }

    /// Sleeps until `chunk` leaves FETCHING (another thread is installing it).
    pub(super) fn wait_for_change(&self, chunk: usize) {
        let guard = self
            .failure
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if self.states[chunk].load(Ordering::Acquire) == FETCHING {
            let _ = self.changed.wait_timeout(guard, Duration::from_millis(1));
        }
    }

    /// Sets `chunk`'s state and wakes the threads waiting for it.
    pub(super) fn set_state(&self, chunk: usize, state: u8) {
        self.states[chunk].store(state, Ordering::Release);
        let _guard = self
            .failure
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.changed.notify_all();
    }

    pub(super) fn count_resident(&self) {
        let n = self.resident_chunks.fetch_add(1, Ordering::AcqRel) + 1;
        if n == self.states.len() as u64 && self.background {
            self.retire();
        }
    }

    /// Everything is resident: unregister, so the guest no longer goes through us at all.
    pub(super) fn retire(&self) {
        if self.retired.swap(true, Ordering::AcqRel) {
            return;
        }
        *self
            .retired_at
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Instant::now());
        self.unregister();
        self.signal_stop();
        let _guard = self
            .failure
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.changed.notify_all();
        tracing::debug!(region = %self.region, "pager retired: region fully resident");
    }

    pub(super) fn fail(&self, e: Error) {
        let reason = guestmem_sys::error_chain(&e, ": ");
        // Recorded before anyone is told, so that whoever sees the VM (or peer) stop finds
        // the reason. Only the first failure is reported: the ones that follow (other chunks
        // in flight when the VM or peer went away) are its consequences, told once already.
        {
            let mut failure = self
                .failure
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
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

    /// The background fetcher: walks every shard's chunks in turn (so that it runs ahead of
    /// each vCPU touching its own range) until all are resident. Faults come first: it steps
    /// aside while a handler is busy. (It keeps the normal CPU priority: a lower one would
    /// leave a fault waiting on a chunk it holds behind every other task on a busy host.)
    pub(super) fn fetch_everything(&self) {
        let mut bounce = PageBuf::zeroed(0);
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
            self.step_aside_for_faults();
            // From a remote source, the chunks after it come in the same request (as the
            // sweep would fetch them later, one request each run): a working set in the
            // order the guest touched it is scattered, and a request per chunk made its
            // prefetch cost a round trip per chunk.
            match self.background_run() {
                // Until the guest is under way, one chunk at a time: a run would hold its
                // first faults behind it.
                _ if !self.concurrent_under_way() => {
                    self.make_resident(chunk, shard, &mut bounce, By::Prefetch);
                }
                1 => {
                    self.make_resident(chunk, shard, &mut bounce, By::Prefetch);
                }
                run => {
                    if self.states[chunk].load(Ordering::Acquire) == ABSENT {
                        self.make_resident_run(chunk, run, shard, &mut bounce, By::Prefetch);
                    }
                }
            }
        }
        self.prefetch_done.store(true, Ordering::Release);
        if !self.background {
            return;
        }
        // The guest comes first: on a small host the sweep would take the CPU from the vCPU
        // that is about to run and from the handler serving its first fault, and delay the
        // restored guest's first progress. Wait for a first fault to be served, or for
        // SWEEP_DELAY if none comes.
        let deadline = Instant::now() + SWEEP_DELAY;
        while self.fault_chunks.load(Ordering::Acquire) == 0 && Instant::now() < deadline {
            if self.stopped() {
                return;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        while !self.retired.load(Ordering::Acquire) && self.failure().is_none() {
            if self.stopped() {
                return;
            }
            // Each shard's chunks in turn, a run of them at a time from each shard's cursor.
            let mut next: Vec<usize> = self.shards.iter().map(|s| s.start).collect();
            let mut steps = 0u64;
            while next.iter().zip(&self.shards).any(|(n, s)| *n < s.end) {
                for (shard, chunks) in self.shards.iter().enumerate() {
                    if next[shard] < chunks.end {
                        self.step_aside_for_faults();
                        let run = self.background_run();
                        next[shard] += self.make_resident_run(
                            next[shard],
                            run,
                            shard,
                            &mut bounce,
                            By::Background,
                        );
                    }
                }
                steps += 1;
                if steps.is_multiple_of(64) && (self.stopped() || self.failure().is_some()) {
                    return;
                }
            }
            // Chunks still being fetched by a handler, or put back after EAGAIN.
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    pub(super) fn failure(&self) -> Option<String> {
        self.failure
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    pub(super) fn stopped(&self) -> bool {
        let mut fd = libc::pollfd {
            fd: self.stop.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: polls one live pollfd without waiting.
        unsafe { libc::poll(&raw mut fd, 1, 0) > 0 }
    }
}
