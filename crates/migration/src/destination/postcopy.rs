//! Post-copy: the pagers armed on the stale chunks of each RAM region, and the destination's
//! end of the post-copy link (lock-step fetches, heartbeats, re-establishment after a break).

use guestmem_sys::to_usize;
use std::io::{self, Write};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use guestmem_memory::{Backend, PAGE_SIZE};
use guestmem_paging::{PageSource, Pager, PagerConfig, UserfaultPager};
use guestmem_vm::layout;

use super::*;
use crate::protocol::{
    frame_name, percentile, write_frame, Links, StaleChunks, BLOCK, POSTCOPY_CHUNK,
    POSTCOPY_FAULT_BYTES,
};
use crate::stream::{Frame, FrameRef, Lend, MAX_REQUEST};
use crate::transport::{Connection, Cutter, Listener};
use crate::{error_chain, Error, MigrationError, Result};
use guestmem_contract::TargetMachine;

/// Discards the stale chunks of each RAM region and starts its pager (nothing fetches until
/// the link opens, after Running).
pub(super) fn arm_postcopy(
    vm: &impl TargetMachine,
    shared: &[String],
    stale: &[StaleChunks],
    links: &Links,
    opts: &ReceiveOptions,
    heartbeat: Duration,
) -> Result<(Arc<PostcopyLink>, Vec<Pager>, Vec<UserfaultPager>)> {
    let link = Arc::new(PostcopyLink::new(
        links.pages.len(),
        links.urgent.len(),
        opts.resume_timeout,
        heartbeat,
    ));
    let mut pagers = Vec::new();
    let mut userfault_pagers = Vec::new();
    for (index, region) in vm
        .memory()
        .regions()
        .iter()
        .enumerate()
        .filter(|(_, r)| r.gpa() != layout::SYS_GPA && !shared.contains(&r.name().to_string()))
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
        let is_stale = |offset: u64| chunk_is_stale(bits, offset, chunk);
        // Every stale chunk is discarded, in a pure post-copy too (the whole region): loading
        // the vCPU state may have faulted pages in before the pager was armed (KVM maps a Linux
        // guest's kvmclock page when its MSR is set, and with huge pages advised that fills 2
        // MiB with zeros), and a page present when the pager starts is never fetched.
        let slots = vm.memory().memslots().expect("a VM's memory is registered");
        // One discard per run of stale chunks (each discard is a memslot change).
        for (start, len) in stale_runs(region.size(), chunk, &is_stale) {
            slots.discard(region.gpa() + start, len)?;
        }
        let config = pager_config(vm, opts, chunk, to_usize(region.size().div_ceil(chunk)));
        let source = RegionSource {
            link: link.clone(),
            gpa: region.gpa(),
            size: region.size(),
        };
        // guest_memfd: KVM maps its pages for the guest without the host mapping, so only KVM
        // Userfault sees the vCPUs' first accesses (where it is absent, the region is refused,
        // naming what is missing: the destination checked that before anything moved).
        if region.backend() == Backend::GuestMemfd {
            userfault_pagers.push(UserfaultPager::start_partial(
                vm.memory(),
                index,
                Arc::new(source.clone()),
                &config,
                &|offset| !is_stale(offset),
            )?);
            continue;
        }
        pagers.push(Pager::start_partial(
            region,
            Arc::new(source),
            &config,
            &|offset| !is_stale(offset),
        )?);
    }
    Ok((link, pagers, userfault_pagers))
}

/// Whether the pre-copy left stale any of the post-copy chunks (`POSTCOPY_CHUNK` bits of
/// `bits`; every chunk when there are none) that the `chunk` bytes at `offset` overlap.
fn chunk_is_stale(bits: Option<&[u64]>, offset: u64, chunk: u64) -> bool {
    let Some(bits) = bits else {
        return true;
    };
    (offset / POSTCOPY_CHUNK..(offset + chunk).div_ceil(POSTCOPY_CHUNK)).any(|c| {
        bits.get((c / 64) as usize)
            .is_some_and(|w| w >> (c % 64) & 1 != 0)
    })
}

/// The runs of consecutive stale chunks of `chunk` bytes of a region of `size` bytes, as
/// (offset, bytes).
fn stale_runs(size: u64, chunk: u64, is_stale: &dyn Fn(u64) -> bool) -> Vec<(u64, u64)> {
    let mut runs = Vec::new();
    let mut run: Option<u64> = None;
    let ends = (0..size).step_by(to_usize(chunk)).chain([size]);
    for offset in ends {
        let stale = offset < size && is_stale(offset);
        match (run, stale) {
            (None, true) => run = Some(offset),
            (Some(start), false) => {
                runs.push((start, offset - start));
                run = None;
            }
            _ => {}
        }
    }
    runs
}

/// The pager settings of a post-copy region of `chunks` chunks of `chunk` bytes: a
/// userfaultfd per vCPU, every chunk fetched in the background, each fetch tried once.
fn pager_config(
    vm: &impl TargetMachine,
    opts: &ReceiveOptions,
    chunk: u64,
    chunks: usize,
) -> PagerConfig {
    PagerConfig {
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
    }
}

/// The destination's end of the post-copy link: lock-step requests on the pages connections
/// (background fetches) and the urgent ones (faults), and their re-establishment after a
/// break.
pub(super) struct PostcopyLink {
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
    pub(super) fn open(&self, links: Links) -> Result<()> {
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
            let mut slot = slot
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            slot.conn = Some(conn);
            slot.used = Some(Instant::now());
        }
        *self
            .cutters
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = cutters;
        let mut st = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
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
                let mut guard = self.slots[index]
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                let slot = &mut *guard;
                if let Some(conn) = slot.conn.as_mut() {
                    let asked = Instant::now();
                    let answered = request(conn, &mut slot.frame, gpa, buf);
                    slot.used = Some(Instant::now());
                    match answered {
                        Ok(()) => {
                            self.bytes.fetch_add(buf.len() as u64, Ordering::Relaxed);
                            if urgent {
                                let us = asked.elapsed().as_micros().min(u128::from(u32::MAX));
                                self.latencies
                                    .lock()
                                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                                    .push(u32::try_from(us).unwrap_or(u32::MAX));
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
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .generation
    }

    /// Waits until the link is re-established after `generation` (up to the resume timeout
    /// since `started`), or closed.
    fn wait_for_new_link(&self, generation: u64, started: Instant) -> io::Result<()> {
        let mut st = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
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
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
        if st.closed {
            return Err(io::Error::other("the post-copy link is closed"));
        }
        Ok(())
    }

    fn break_link(&self, e: &Error) {
        let mut st = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
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
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .iter()
            {
                c.cut();
            }
            self.changed.notify_all();
        }
    }

    /// The keeper: after each break, accepts the source's new connections and opens them.
    pub(super) fn keep(&self, listener: &Arc<Listener>, migration: u64) {
        loop {
            // While the link is up: heartbeats on its quiet connections.
            loop {
                let st = self
                    .state
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                if st.closed {
                    return;
                }
                if st.broken {
                    break;
                }
                let st = self
                    .changed
                    .wait_timeout(st, self.heartbeat / 2)
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .0;
                let up = !st.broken && !st.closed;
                drop(st);
                if up {
                    self.heartbeat();
                }
            }
            let gate = Gate::of(listener);
            let closed = || {
                self.state
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .closed
            };
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
            let mut page = vec![0u8; to_usize(PAGE_SIZE)];
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

    /// Whether the link is broken now (the faults wait for the source to resume it).
    pub(super) fn is_broken(&self) -> bool {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .broken
    }

    pub(super) fn fill_report(&self, report: &mut DestinationReport) {
        let mut lat: Vec<Duration> = self
            .latencies
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .map(|&us| Duration::from_micros(us.into()))
            .collect();
        lat.sort();
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        report.fault_fetches = lat.len() as u64;
        report.fault_latency_p50_us = us(percentile(&lat, 50.0));
        report.fault_latency_p99_us = us(percentile(&lat, 99.0));
        report.fault_latency_max_us = us(lat.last().copied().unwrap_or_default());
        report.fault_latency_buckets_us = crate::protocol::latency_buckets(&lat);
        report.background_fetches = self.background_fetches.load(Ordering::Relaxed);
        report.postcopy_bytes = self.bytes.load(Ordering::Relaxed);
        report.link_breaks = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .breaks;
    }

    /// Says Complete on every connection (waiting out a broken link), then closes the link.
    pub(super) fn close(&self, report_json: &[u8]) -> Result<()> {
        let started = Instant::now();
        let mut done = Vec::new();
        for slot in &self.slots {
            loop {
                let generation = self.generation();
                {
                    let mut s = slot
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
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
        let mut st = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
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
#[allow(clippy::cast_possible_truncation)] // a piece is at most a chunk (far below 4 GiB).
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
#[derive(Clone)]
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

    #[test]
    fn the_stale_chunks_are_discarded_in_runs() {
        // Post-copy chunks 1 and 2 stale (bits), faulted in chunks of a quarter of one.
        let bits = [0b110u64];
        let chunk = POSTCOPY_CHUNK / 4;
        assert!(!chunk_is_stale(Some(&bits), 0, chunk));
        assert!(chunk_is_stale(Some(&bits), POSTCOPY_CHUNK, chunk));
        assert!(chunk_is_stale(None, 0, chunk));
        let size = 4 * POSTCOPY_CHUNK;
        let runs = stale_runs(size, chunk, &|o| chunk_is_stale(Some(&bits), o, chunk));
        assert_eq!(runs, [(POSTCOPY_CHUNK, 2 * POSTCOPY_CHUNK)]);
        // A run reaching the region's end is closed there.
        let tail = stale_runs(size, chunk, &|o| o >= 3 * POSTCOPY_CHUNK);
        assert_eq!(tail, [(3 * POSTCOPY_CHUNK, POSTCOPY_CHUNK)]);
        assert!(stale_runs(size, chunk, &|_| false).is_empty());
    }

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

    #[allow(clippy::cast_possible_truncation)] // a request is at most a chunk (far below 4 GiB).
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
        let mut pages = vec![0u8; 2 * to_usize(PAGE_SIZE)];
        pages[0] = 7;
        pages[to_usize(PAGE_SIZE) + 100] = 9;
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
