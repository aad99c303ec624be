//! The destination's progress records ([`ReceiveOptions::events`]): the readers' byte counts
//! (one relaxed add per frame, on a counter of the reader's own) and, in post-copy, the
//! pagers' and the link's counters, sampled by a ticker thread at the sink's interval.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use guestmem_events::{Event, Reporter, Status, Ticker};
use guestmem_paging::StatsProbe;

use super::postcopy::PostcopyLink;
use super::{DestinationReport, Postcopy};

/// One reader's count of page bytes placed, on a cache line of its own.
#[derive(Debug, Default)]
#[repr(align(64))]
pub(super) struct ReaderCount(pub(super) AtomicU64);

/// What the pages readers count for the records while the rounds come.
#[derive(Debug, Default)]
pub(super) struct RoundCounters {
    pub(super) readers: Vec<ReaderCount>,
    /// The highest round a reader has ended.
    pub(super) round: AtomicU32,
    /// A reader saw the last round begin or end: the source's guest is stopped.
    pub(super) stopped: AtomicBool,
}

impl RoundCounters {
    pub(super) fn new(readers: usize) -> RoundCounters {
        RoundCounters {
            readers: (0..readers).map(|_| ReaderCount::default()).collect(),
            ..Default::default()
        }
    }

    /// Page bytes placed by every reader.
    pub(super) fn bytes(&self) -> u64 {
        self.readers
            .iter()
            .map(|r| r.0.load(Ordering::Relaxed))
            .sum()
    }
}

/// A receive's records: the reporter, the guest's size, and the bytes the rounds brought.
#[derive(Debug, Clone)]
pub(super) struct RxProgress {
    pub(super) reporter: Arc<Reporter>,
    pub(super) total: u64,
    pub(super) received: u64,
}

impl RxProgress {
    /// A record of `status` with the bytes received so far.
    pub(super) fn event(&self, status: Status) -> Event {
        let mut e = Event::new(status);
        e.bytes_total = self.total;
        e.bytes_transferred = self.received;
        e
    }

    pub(super) fn emit(&self, status: Status) {
        self.reporter.emit(self.event(status));
    }

    /// While the rounds come: a ticker over the readers' counters.
    pub(super) fn rounds_ticker(&self, counters: &Arc<RoundCounters>) -> Ticker {
        let base = self.event(Status::Precopy);
        let counters = counters.clone();
        let sample = move || {
            let mut e = base.clone();
            if counters.stopped.load(Ordering::Relaxed) {
                e.status = Status::Stopped;
            }
            e.bytes_transferred = counters.bytes();
            let round = counters.round.load(Ordering::Relaxed);
            e.round = Some(round + 1);
            e
        };
        self.reporter.emit(sample());
        Ticker::spawn(self.reporter.clone(), move || Some(sample()))
    }

    /// The guest runs here now: in post-copy, the record and a ticker over the pagers and the
    /// link until dropped; in pre-copy, the final record.
    pub(super) fn running(&self, postcopy: Option<&Postcopy>) -> Option<Ticker> {
        let Some(p) = postcopy else {
            let mut e = self.event(Status::Completed);
            e.bytes_remaining = Some(0);
            self.reporter.emit(e);
            return None;
        };
        let sampler = PostcopySampler {
            base: self.event(Status::Postcopy),
            probes: p
                .pagers
                .iter()
                .map(guestmem_paging::Pager::probe)
                .chain(
                    p.userfault_pagers
                        .iter()
                        .map(guestmem_paging::UserfaultPager::probe),
                )
                .collect(),
            sizes: p
                .pagers
                .iter()
                .map(guestmem_paging::Pager::size)
                .chain(
                    p.userfault_pagers
                        .iter()
                        .map(guestmem_paging::UserfaultPager::size),
                )
                .collect(),
            link: p.link.clone(),
        };
        self.reporter.emit(sampler.sample());
        Some(Ticker::spawn(self.reporter.clone(), move || {
            Some(sampler.sample())
        }))
    }

    /// The post-copy's final record, with `report`'s figures, `missing` bytes not resident.
    pub(super) fn finished(&self, report: &DestinationReport, missing: u64) {
        let mut e = self.event(Status::Completed);
        e.bytes_transferred = self.received + report.postcopy_bytes;
        e.bytes_remaining = Some(0);
        e.resident_bytes = Some(self.total.saturating_sub(missing));
        e.faults = Some(report.faults);
        e.postcopy_requests = Some(report.fault_fetches);
        e.fault_latency_p50_us = Some(report.fault_latency_p50_us);
        e.fault_latency_p99_us = Some(report.fault_latency_p99_us);
        self.reporter.emit(e);
    }

    /// The final record of a receive that failed.
    pub(super) fn failed(&self, error: &crate::Error) {
        let mut e = self.event(Status::Failed);
        e.error = Some(crate::error_chain(error, ": "));
        self.reporter.emit(e);
    }
}

/// Post-copy's counters, read by the ticker.
struct PostcopySampler {
    base: Event,
    probes: Vec<StatsProbe>,
    sizes: Vec<u64>,
    link: Arc<PostcopyLink>,
}

impl PostcopySampler {
    fn sample(&self) -> Event {
        let mut e = self.base.clone();
        let stats: Vec<_> = self.probes.iter().map(StatsProbe::stats).collect();
        // The regions not paged (the sys region) are resident.
        let paged: u64 = stats.iter().map(|s| s.resident_bytes).sum();
        let size: u64 = self.sizes.iter().sum();
        let resident = e.bytes_total.saturating_sub(size) + paged;
        let mut report = DestinationReport::default();
        self.link.fill_report(&mut report);
        if self.link.is_broken() {
            e.status = Status::PostcopyPaused;
        }
        e.bytes_transferred += report.postcopy_bytes;
        e.bytes_remaining = Some(size.saturating_sub(resident));
        e.resident_bytes = Some(resident);
        e.faults = Some(stats.iter().map(|s| s.faults).sum());
        e.postcopy_requests = Some(report.fault_fetches);
        e.fault_latency_p50_us = Some(report.fault_latency_p50_us);
        e.fault_latency_p99_us = Some(report.fault_latency_p99_us);
        e
    }
}
