//! Progress records of restores and snapshots ([`guestmem_events::Event`], operations
//! `restore` and `snapshot`), made where they report: around the restore engine and the
//! writers, and, for a lazy restore, by a ticker reading the pagers' counters (their probes)
//! at the sink's interval until every page is resident.

use std::sync::Arc;

use guestmem_events::{Event, Operation, Reporter, Sink, Status, Ticker};
use guestmem_paging::{Pager, StatsProbe, UserfaultPager};

/// One restore's records: `setup` when it starts; once the VM is ready, `completed` (full and
/// map restores, whose memory is all in place) or `postcopy` while a lazy restore's pagers
/// bring the memory in (resident bytes, faults, chunks fetched, bytes still missing) and
/// `completed` once all of it is resident; `failed` with the error.
#[derive(Debug)]
pub struct RestoreProgress {
    reporter: Arc<Reporter>,
    total: u64,
    sampler: Option<Arc<LazySampler>>,
    ticker: Option<Ticker>,
}

impl RestoreProgress {
    /// A restore of `total` bytes of guest memory starts: its `setup` record.
    pub fn start(sink: &Sink, total: u64) -> RestoreProgress {
        RestoreProgress::start_session(sink, total, None)
    }

    /// [`RestoreProgress::start`], the records marked as `session` (one of a service's
    /// concurrent restores, see [`Reporter::session`]).
    pub fn start_session(sink: &Sink, total: u64, session: Option<u64>) -> RestoreProgress {
        let reporter = Reporter::new(sink.clone(), Operation::Restore);
        let reporter = Arc::new(match session {
            Some(n) => reporter.session(n),
            None => reporter,
        });
        let mut e = Event::new(Status::Setup);
        e.bytes_total = total;
        e.bytes_remaining = Some(total);
        reporter.emit(e);
        RestoreProgress {
            reporter,
            total,
            sampler: None,
            ticker: None,
        }
    }

    /// Its reporter, for what else tells of the run (a store stall: [`Reporter::stalled`]).
    pub fn reporter(&self) -> Arc<Reporter> {
        self.reporter.clone()
    }

    /// The VM is ready, its memory paged in by `pagers` and `userfault_pagers` (none: all in
    /// place): `completed` now, or `postcopy` and a ticker until everything is resident.
    pub fn ready(&mut self, pagers: &[Pager], userfault_pagers: &[UserfaultPager]) {
        if pagers.is_empty() && userfault_pagers.is_empty() {
            let mut e = Event::new(Status::Completed);
            e.bytes_total = self.total;
            e.bytes_transferred = self.total;
            e.bytes_remaining = Some(0);
            e.resident_bytes = Some(self.total);
            self.reporter.emit(e);
            return;
        }
        let sampler = Arc::new(LazySampler {
            total: self.total,
            probes: pagers
                .iter()
                .map(|p| (p.probe(), p.size()))
                .chain(userfault_pagers.iter().map(|p| (p.probe(), p.size())))
                .collect(),
        });
        self.reporter.emit(sampler.sample());
        let s = sampler.clone();
        self.ticker = Some(Ticker::spawn(self.reporter.clone(), move || {
            Some(s.sample())
        }));
        self.sampler = Some(sampler);
    }

    /// The record of now (`completed` once everything is resident), and the ticker stopped:
    /// call it when the restore's work is over (the guest stopped, the memory resident).
    pub fn finish(&mut self) {
        drop(self.ticker.take());
        if let Some(s) = &self.sampler {
            self.reporter.emit(s.sample());
        }
    }

    /// The restore failed: its final record, naming `error`.
    pub fn failed(&mut self, error: &(dyn std::error::Error + 'static)) {
        drop(self.ticker.take());
        let mut e = Event::new(Status::Failed);
        e.error = Some(guestmem_sys::error_chain(error, ": "));
        self.reporter.emit(e);
    }
}

/// A lazy restore's pagers, read by its ticker.
#[derive(Debug)]
struct LazySampler {
    total: u64,
    /// Each pager's counters and the size of its region.
    probes: Vec<(StatsProbe, u64)>,
}

impl LazySampler {
    fn sample(&self) -> Event {
        let stats: Vec<_> = self.probes.iter().map(|(p, _)| p.stats()).collect();
        let missing: u64 = stats
            .iter()
            .zip(&self.probes)
            .map(|(s, (_, size))| size.saturating_sub(s.resident_bytes))
            .sum();
        let resident = self.total.saturating_sub(missing);
        let mut e = Event::new(if missing == 0 {
            Status::Completed
        } else {
            Status::Postcopy
        });
        e.bytes_total = self.total;
        e.bytes_transferred = resident;
        e.bytes_remaining = Some(missing);
        e.resident_bytes = Some(resident);
        e.faults = Some(stats.iter().map(|s| s.faults).sum());
        e.chunks_fetched = Some(
            stats
                .iter()
                .map(|s| {
                    s.fault_chunks + s.readahead_chunks + s.background_chunks + s.prefetch_chunks
                })
                .sum(),
        );
        e
    }
}

/// A snapshot's records, made around its writer: `setup`, `stopped` (the guest paused while it
/// is written) or `precopy` (a live snapshot's rounds), then `completed` with the bytes
/// stored, or `failed`.
#[derive(Debug)]
pub struct SnapshotProgress {
    reporter: Arc<Reporter>,
    total: u64,
}

impl SnapshotProgress {
    /// A snapshot of `total` bytes of guest memory starts.
    pub fn start(sink: &Sink, total: u64) -> SnapshotProgress {
        let p = SnapshotProgress {
            reporter: Arc::new(Reporter::new(sink.clone(), Operation::Snapshot)),
            total,
        };
        p.emit(Status::Setup, 0);
        p
    }

    /// Its reporter, for what else tells of the run (a store stall: [`Reporter::stalled`]).
    pub fn reporter(&self) -> Arc<Reporter> {
        self.reporter.clone()
    }

    /// A record of `status`, `bytes` stored so far.
    pub fn emit(&self, status: Status, bytes: u64) {
        let mut e = Event::new(status);
        e.bytes_total = self.total;
        e.bytes_transferred = bytes;
        if status == Status::Completed {
            e.bytes_remaining = Some(0);
        }
        self.reporter.emit(e);
    }

    /// The snapshot failed: its final record, naming `error`.
    pub fn failed(&self, error: &(dyn std::error::Error + 'static)) {
        let mut e = Event::new(Status::Failed);
        e.error = Some(guestmem_sys::error_chain(error, ": "));
        self.reporter.emit(e);
    }
}
