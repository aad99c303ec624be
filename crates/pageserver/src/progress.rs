//! A page server session's progress records (operation `page-server`, see
//! [`crate::PageServerConfig::events`]): the pager's counters read through its probes by a
//! ticker at the sink's interval.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use guestmem_events::{Event, Operation, Reporter, Sink, Status, Ticker};
use guestmem_paging::StatsProbe;

/// Sessions served by this process so far.
static SESSIONS: AtomicU64 = AtomicU64::new(0);

/// One session's records.
#[derive(Debug)]
pub(crate) struct SessionProgress {
    reporter: Arc<Reporter>,
    sampler: Option<Arc<Sampler>>,
    ticker: Option<Ticker>,
}

impl SessionProgress {
    /// A connection is being served: its records begin (with `setup` once serving starts),
    /// marked with the session's number (this process's connections, from 1).
    pub(crate) fn new(sink: &Sink) -> SessionProgress {
        let session = SESSIONS.fetch_add(1, Ordering::Relaxed) + 1;
        SessionProgress {
            reporter: Arc::new(Reporter::new(sink.clone(), Operation::PageServer).session(session)),
            sampler: None,
            ticker: None,
        }
    }

    /// Serving the mappings of `sizes` bytes, their pagers' counters in `probes`: `setup`,
    /// `postcopy`, and a ticker (which says `completed` once everything is resident).
    pub(crate) fn serving(&mut self, probes: Vec<StatsProbe>, sizes: Vec<u64>) {
        let sampler = Arc::new(Sampler { probes, sizes });
        let mut setup = Event::new(Status::Setup);
        setup.bytes_total = sampler.sizes.iter().sum();
        setup.bytes_remaining = Some(setup.bytes_total);
        self.reporter.emit(setup);
        self.reporter.emit(sampler.sample());
        let s = sampler.clone();
        self.ticker = Some(Ticker::spawn(self.reporter.clone(), move || {
            Some(s.sample())
        }));
        self.sampler = Some(sampler);
    }

    /// Serving ended: `completed` (the memory resident, or the peer gone), or `failed` with
    /// `error`.
    pub(crate) fn end(mut self, error: Option<&crate::Error>) {
        drop(self.ticker.take());
        let mut e = match &self.sampler {
            Some(s) => s.sample(),
            None => Event::new(Status::Setup),
        };
        match error {
            Some(err) => {
                e.status = Status::Failed;
                e.error = Some(crate::error_chain(err, ": "));
            }
            None => e.status = Status::Completed,
        }
        self.reporter.emit(e);
    }
}

/// The session's pager, read by the ticker.
#[derive(Debug)]
struct Sampler {
    probes: Vec<StatsProbe>,
    sizes: Vec<u64>,
}

impl Sampler {
    fn sample(&self) -> Event {
        let stats: Vec<_> = self.probes.iter().map(StatsProbe::stats).collect();
        let total: u64 = self.sizes.iter().sum();
        let resident: u64 = stats
            .iter()
            .zip(&self.sizes)
            .map(|(s, &size)| s.resident_bytes.min(size))
            .sum();
        let mut e = Event::new(if resident >= total {
            Status::Completed
        } else {
            Status::Postcopy
        });
        e.bytes_total = total;
        e.bytes_transferred = resident;
        e.bytes_remaining = Some(total - resident);
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
