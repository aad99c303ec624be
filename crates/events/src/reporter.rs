//! The pace of an operation's records: [`Reporter`] numbers, times and orders them, and says
//! when the next periodic one is due (a check of one atomic, so that a hot loop can ask per
//! block); [`Ticker`] samples counters on a thread of its own where the operation's thread is
//! blocked (post-copy, a destination's rounds).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::{Event, Operation, Sink, Status};

/// Paces one run's records to its [`Sink`].
#[derive(Debug)]
pub struct Reporter {
    sink: Sink,
    operation: Operation,
    started: Instant,
    /// When the next periodic record is due, in nanoseconds from `started`.
    next_due_ns: AtomicU64,
    last: Mutex<Last>,
    /// The run's number among the process's concurrent runs of the operation, if it has one.
    session: Option<u64>,
}

/// The last record sent.
#[derive(Debug, Default)]
struct Last {
    seq: u64,
    status: Option<Status>,
    at: Duration,
    bytes: u64,
    total: u64,
    bandwidth: f64,
    /// The status a store stall overrides, while the store does not answer.
    stalled_from: Option<Status>,
}

impl Reporter {
    /// A reporter of `operation`'s records to `sink`, its clock started now.
    pub fn new(sink: Sink, operation: Operation) -> Reporter {
        Reporter {
            sink,
            operation,
            started: Instant::now(),
            next_due_ns: AtomicU64::new(0),
            last: Mutex::new(Last::default()),
            session: None,
        }
    }

    /// The same reporter, its records marked as session `session` (from 1): one of the
    /// concurrent runs of a long-lived process (a page server's connections, a restore
    /// service's restores), told apart in one stream.
    #[must_use]
    pub fn session(mut self, session: u64) -> Reporter {
        self.session = Some(session);
        self
    }

    /// A reporter when there is a sink.
    pub fn maybe(sink: Option<&Sink>, operation: Operation) -> Option<Arc<Reporter>> {
        sink.map(|s| Arc::new(Reporter::new(s.clone(), operation)))
    }

    /// Since the run started.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// Whether a periodic record is due (the sink's interval has passed since the last).
    pub fn due(&self) -> bool {
        nanos(self.started.elapsed()) >= self.next_due_ns.load(Ordering::Relaxed)
    }

    /// The interval between periodic records.
    pub fn interval(&self) -> Duration {
        self.sink.interval()
    }

    /// Sends `event` now (a change of status, or a periodic record), its common fields filled:
    /// schema, operation, sequence number, time and the bandwidth since the record before;
    /// `bytes_transferred` never below the last record's, `bytes_total` the last one's where
    /// the event leaves it 0 (a failure's record knows neither). Nothing is sent after a final
    /// record (`completed`, `failed`): a sampler racing the end cannot follow it.
    pub fn emit(&self, mut event: Event) {
        let mut last = self
            .last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if last.status.is_some_and(Status::is_final) {
            return;
        }
        if last.stalled_from.is_some() && !event.status.is_final() {
            event.status = Status::Stalled;
        }
        let now = self.started.elapsed();
        event.schema = crate::PROGRESS_SCHEMA.to_string();
        event.operation = self.operation;
        event.session = self.session;
        event.seq = last.seq;
        event.elapsed_ms = now.as_secs_f64() * 1e3;
        event.bytes_transferred = event.bytes_transferred.max(last.bytes);
        if event.bytes_total == 0 {
            event.bytes_total = last.total;
        }
        let dt = now.saturating_sub(last.at).as_secs_f64();
        if dt >= 1e-3 {
            let moved = event.bytes_transferred.saturating_sub(last.bytes);
            last.bandwidth = moved as f64 / dt;
        }
        event.bandwidth_bytes_per_s = last.bandwidth;
        if event.status == Status::Completed {
            event.bytes_remaining = event.bytes_remaining.map(|_| 0);
        }
        self.sink.send(&event);
        last.seq += 1;
        last.status = Some(event.status);
        last.at = now;
        last.bytes = event.bytes_transferred;
        last.total = event.bytes_total;
        self.next_due_ns
            .store(nanos(now + self.sink.interval()), Ordering::Relaxed);
    }

    /// Sends the record `make` builds, if one is due.
    pub fn tick(&self, make: impl FnOnce() -> Event) {
        if self.due() {
            self.emit(make());
        }
    }

    /// The chunk store stopped answering (guestmem_store's `on_stall`): a `stalled` record
    /// now, and every record after it says `stalled` (its counters as sampled) until
    /// [`Reporter::answered`]; a final record keeps its own status.
    pub fn stalled(&self) {
        let event = {
            let mut last = self
                .last
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if last.stalled_from.is_some() || last.status.is_some_and(Status::is_final) {
                return;
            }
            last.stalled_from = Some(last.status.unwrap_or(Status::Setup));
            let mut e = Event::new(Status::Stalled);
            e.bytes_transferred = last.bytes;
            e
        };
        self.emit(event);
    }

    /// The store answers again: a record of the status the stall interrupted, now.
    pub fn answered(&self) {
        let event = {
            let mut last = self
                .last
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let Some(status) = last.stalled_from.take() else {
                return;
            };
            let mut e = Event::new(status);
            e.bytes_transferred = last.bytes;
            e
        };
        self.emit(event);
    }

    /// The status of the last record sent.
    pub fn status(&self) -> Option<Status> {
        self.last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .status
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Sends the record a sampler builds at the reporter's interval, on a thread of its own, until
/// dropped (which returns at once: the thread is woken, not waited out).
#[derive(Debug)]
pub struct Ticker {
    stop: Option<Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Ticker {
    /// Every interval, `sample`'s record (or none, when it returns `None`) goes to `reporter`.
    pub fn spawn(
        reporter: Arc<Reporter>,
        mut sample: impl FnMut() -> Option<Event> + Send + 'static,
    ) -> Ticker {
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("progress".into())
            .spawn(move || loop {
                match stopped.recv_timeout(reporter.interval()) {
                    Err(RecvTimeoutError::Timeout) => {
                        if let Some(e) = sample() {
                            reporter.emit(e);
                        }
                    }
                    _ => return,
                }
            })
            .ok();
        Ticker {
            stop: Some(stop),
            thread,
        }
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store stall turns the records after it `stalled`, once, until the store answers and
    /// the interrupted status comes back; a final record keeps its status.
    #[test]
    fn a_store_stall_shows_as_stalled_until_answered() {
        let (sink, rx) = Sink::channel();
        let r = Reporter::new(sink, Operation::Restore);
        r.emit(at(Status::Postcopy, 10));
        r.stalled();
        r.stalled();
        r.emit(at(Status::Postcopy, 20));
        r.answered();
        r.answered();
        r.emit(at(Status::Postcopy, 30));
        r.stalled();
        r.emit(at(Status::Completed, 100));
        let got: Vec<(Status, u64)> = rx
            .try_iter()
            .map(|e| (e.status, e.bytes_transferred))
            .collect();
        assert_eq!(
            got,
            [
                (Status::Postcopy, 10),
                (Status::Stalled, 10),
                (Status::Stalled, 20),
                (Status::Postcopy, 20),
                (Status::Postcopy, 30),
                (Status::Stalled, 30),
                (Status::Completed, 100),
            ]
        );
    }

    fn at(status: Status, bytes: u64) -> Event {
        let mut e = Event::new(status);
        e.bytes_transferred = bytes;
        e.bytes_remaining = Some(100 - bytes);
        e
    }

    /// Records are numbered and timed, periodic ones wait for the interval, the bandwidth is
    /// the bytes moved since the record before, and nothing follows the final record.
    #[test]
    fn records_are_paced_numbered_and_end_with_the_final_one() {
        let (sink, rx) = Sink::channel();
        let r = Reporter::new(sink.every(Duration::from_millis(50)), Operation::Restore);
        assert!(r.due());
        r.emit(at(Status::Setup, 0));
        assert!(!r.due());
        let mut ticked = false;
        r.tick(|| {
            ticked = true;
            at(Status::Precopy, 1)
        });
        assert!(!ticked, "a record came before the interval");
        std::thread::sleep(Duration::from_millis(60));
        r.tick(|| at(Status::Precopy, 40));
        r.emit(at(Status::Completed, 90));
        r.emit(at(Status::Postcopy, 95));
        let got: Vec<Event> = rx.try_iter().collect();
        assert_eq!(got.len(), 3, "{got:?}");
        assert_eq!(got.iter().map(|e| e.seq).collect::<Vec<_>>(), [0, 1, 2]);
        assert!(got.iter().all(|e| e.operation == Operation::Restore));
        let bw = got[1].bandwidth_bytes_per_s;
        assert!(bw > 0.0 && bw < 40.0 / 0.06 + 1.0, "{bw}");
        assert_eq!(got[2].status, Status::Completed);
        assert_eq!(got[2].bytes_remaining, Some(0));
        assert!(got[2].elapsed_ms >= got[1].elapsed_ms);
    }

    #[test]
    fn a_ticker_samples_until_dropped() {
        let (sink, rx) = Sink::channel();
        let r = Arc::new(Reporter::new(
            sink.every(Duration::from_millis(10)),
            Operation::PageServer,
        ));
        let t = Ticker::spawn(r.clone(), || Some(at(Status::Postcopy, 5)));
        let first = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!(first.status, Status::Postcopy);
        let dropped = Instant::now();
        drop(t);
        assert!(dropped.elapsed() < Duration::from_secs(1));
        r.emit(at(Status::Completed, 100));
        let last = rx.try_iter().last().unwrap();
        assert_eq!(last.status, Status::Completed);
    }
}
