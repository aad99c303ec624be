//! The source's progress records ([`SendOptions::events`]): what the driver already counts,
//! sampled where it reports (after a round, per block queued when a record is due, on a
//! ticker thread during post-copy), never per page.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use guestmem_events::{Event, Reporter, Status, Ticker};
use guestmem_memory::PAGE_SIZE;

use super::postcopy::ServeCounters;
use super::{MachineFailure, Report, RoundQueue, Source};
use crate::protocol::{StaleChunks, POSTCOPY_CHUNK};

/// What the last round told, carried into the records until the next.
#[derive(Debug, Default, Clone)]
pub(super) struct Seen {
    /// The round under way (0 before the first).
    pub(super) round: u32,
    /// Bytes still to send: the dirty pages not sent yet.
    pub(super) remaining: u64,
    pub(super) dirty_rate: Option<f64>,
    pub(super) expected_downtime_ms: Option<f64>,
    pub(super) throttle: Option<u64>,
    /// Post-copy: the bytes the destination still lacks at switch-over (its stale chunks).
    pub(super) postcopy_bytes: u64,
}

impl Source<'_> {
    /// A record of `status` with what the source knows now.
    pub(super) fn event(&self, status: Status) -> Event {
        let mut e = Event::new(status);
        e.bytes_total = self.report.guest_bytes;
        e.bytes_transferred = self.report.bytes;
        e.bytes_remaining = Some(self.seen.remaining);
        e.round = (self.seen.round > 0).then_some(self.seen.round);
        e.dirty_rate_bytes_per_s = self.seen.dirty_rate;
        e.expected_downtime_ms = self.seen.expected_downtime_ms;
        e.throttle_percent = self.seen.throttle;
        e
    }

    /// Sends a record of `status` now (a change of status).
    pub(super) fn emit(&self, status: Status) {
        if let Some(r) = &self.reporter {
            r.emit(self.event(status));
        }
    }

    /// Round `round` starts: `pages` to go through, with the guest running (`precopy`) or
    /// stopped; a record if that changes the status (the round before ended with one).
    pub(super) fn round_starts(&mut self, round: u32, pages: u64, last: bool) {
        self.seen.round = round;
        self.seen.remaining = pages * PAGE_SIZE;
        let status = if last {
            Status::Stopped
        } else {
            Status::Precopy
        };
        if self.reporter.as_ref().and_then(|r| r.status()) != Some(status) {
            self.emit(status);
        }
    }

    /// Within a round, when a record is due: the bytes queued so far, the pages left.
    pub(super) fn tick_in_round(&self, q: &RoundQueue) {
        let Some(r) = &self.reporter else {
            return;
        };
        if r.due() {
            let mut e = self.event(r.status().unwrap_or(Status::Precopy));
            e.bytes_transferred += q.bytes;
            e.bytes_remaining = Some(q.total.saturating_sub(q.pages) * PAGE_SIZE);
            r.emit(e);
        }
    }

    /// A round ended: `dirty` pages dirtied meanwhile in its `ms`, which would take `est` to
    /// send with the guest stopped; the vCPUs throttled by `throttle`.
    pub(super) fn round_ends(&mut self, dirty: u64, ms: f64, est: f64, throttle: u64) {
        self.seen.remaining = dirty * PAGE_SIZE;
        self.seen.dirty_rate = Some((dirty * PAGE_SIZE) as f64 / (ms / 1e3).max(1e-6));
        self.seen.expected_downtime_ms = Some(est);
        self.seen.throttle = Some(throttle);
        self.emit(Status::Precopy);
    }

    /// At switch-over: the bytes post-copy still has to bring (every stale chunk, whole
    /// regions where no chunk map travels).
    pub(super) fn postcopy_starts(&mut self, stale: &[StaleChunks]) {
        self.seen.postcopy_bytes = stale
            .iter()
            .map(|s| {
                let size = self
                    .memory
                    .regions()
                    .iter()
                    .find(|r| r.gpa() == s.gpa)
                    .map_or(0, |r| r.size());
                match &s.bits {
                    None => size,
                    Some(bits) => {
                        let chunks: u64 = bits.iter().map(|w| u64::from(w.count_ones())).sum();
                        (chunks * POSTCOPY_CHUNK).min(size)
                    }
                }
            })
            .sum();
    }

    /// Post-copy (again, after a reconnection): the record, and a ticker sampling the
    /// servers' counters until it is dropped.
    pub(super) fn postcopy_ticker(&mut self, counters: &Arc<ServeCounters>) -> Option<Ticker> {
        let reporter = self.reporter.clone()?;
        let base = self.event(Status::Postcopy);
        let total = self.seen.postcopy_bytes;
        let counters = counters.clone();
        let sample = move |status| {
            let mut e = base.clone();
            e.status = status;
            let served = counters.bytes.load(Ordering::Relaxed);
            e.bytes_transferred += served;
            e.bytes_remaining = Some(total.saturating_sub(served));
            e.postcopy_requests = Some(counters.requests.load(Ordering::Relaxed));
            e
        };
        reporter.emit(sample(Status::Postcopy));
        Some(Ticker::spawn(reporter, move || {
            Some(sample(Status::Postcopy))
        }))
    }

    /// The post-copy link broke: the record says so until it is back.
    pub(super) fn postcopy_paused(&self, counters: &ServeCounters) {
        if let Some(r) = &self.reporter {
            let mut e = self.event(Status::PostcopyPaused);
            let served = counters.bytes.load(Ordering::Relaxed);
            e.bytes_transferred += served;
            e.bytes_remaining = Some(self.seen.postcopy_bytes.saturating_sub(served));
            e.postcopy_requests = Some(counters.requests.load(Ordering::Relaxed));
            r.emit(e);
        }
    }
}

/// The run's last record: `completed` with the report's totals, or `failed` with the error.
pub(super) fn finish(reporter: Option<&Reporter>, result: &Result<Report, MachineFailure>) {
    let Some(r) = reporter else {
        return;
    };
    match result {
        Ok(report) => {
            let mut e = Event::new(Status::Completed);
            e.bytes_total = report.guest_bytes;
            e.bytes_transferred = report.bytes;
            e.bytes_remaining = Some(0);
            e.round = u32::try_from(report.rounds.len()).ok().filter(|&n| n > 0);
            e.throttle_percent = Some(report.max_throttle_percent);
            e.downtime_ms = Some(report.downtime_ms);
            if report.mode.has_postcopy() {
                e.postcopy_requests = Some(report.postcopy_requests);
                if let Some(d) = &report.destination {
                    e.faults = Some(d.faults);
                    e.fault_latency_p50_us = Some(d.fault_latency_p50_us);
                    e.fault_latency_p99_us = Some(d.fault_latency_p99_us);
                }
            }
            r.emit(e);
        }
        Err(failure) => {
            let mut e = Event::new(Status::Failed);
            e.error = Some(format!(
                "{}{}",
                crate::error_chain(&failure.error, ": "),
                if failure.kept {
                    " (the source keeps the guest)"
                } else {
                    " (the destination had taken the guest over)"
                }
            ));
            r.emit(e);
        }
    }
}
