//! The link's pace as the sender sees it: bytes carried over time while the send queue stays long, and the answers' latency.

use super::*;

/// Measures how fast a connection's link carries what its writer queued: the bytes the socket's
/// queue lost over the time that passed, both between two writes and during one (what was
/// queued before, plus what was written, less what is queued after), counted only while the
/// queue stayed long (then the link, not the writer, set the pace) and summed until they make a
/// sample of [`LinkGauge::SAMPLE_BYTES`] (acknowledgements come in whole segments, so shorter
/// spans would read too fast or too slow). With a send buffer that holds several frames
/// ([`SEND_BUFFER_BYTES`]) a write returns as soon as its bytes are queued, so the time a write
/// blocks no longer tells the link's speed; this does, whether the writer compresses or not.
#[derive(Debug, Default)]
pub struct LinkGauge {
    /// When the last write ended, and what was queued then.
    after: Option<(Instant, u64)>,
    /// When the current write started, and what was queued then.
    before: Option<(Instant, u64)>,
    /// Busy time and bytes drained, not yet a sample.
    pub(super) pending: (Duration, u64),
}

impl LinkGauge {
    /// A queue at least this long when a span starts means the link never waited for the
    /// writer during it.
    pub const BUSY_BYTES: u64 = 128 << 10;
    /// A sample spans at least this many drained bytes.
    pub const SAMPLE_BYTES: u64 = 1 << 20;

    /// Called just before writing on `conn`.
    pub fn before_write(&mut self, conn: &Connection) {
        let now = conn.queued_bytes().map(|q| (Instant::now(), q));
        if let (Some((t0, q0)), Some((t1, q1))) = (self.after.take(), now) {
            self.span(t1 - t0, q0, 0, q1);
        }
        self.before = now;
    }

    /// Called just after writing `written` bytes on `conn`: a sample of the link, when enough
    /// busy time has gathered.
    pub fn after_write(&mut self, conn: &Connection, written: u64) -> Option<LinkSample> {
        let now = conn.queued_bytes().map(|q| (Instant::now(), q));
        if let (Some((t0, q0)), Some((t1, q1))) = (self.before.take(), now) {
            self.span(t1 - t0, q0, written, q1);
        }
        self.after = now;
        let (elapsed, bytes) = self.pending;
        (bytes >= Self::SAMPLE_BYTES).then(|| {
            self.pending = (Duration::ZERO, 0);
            LinkSample { elapsed, bytes }
        })
    }

    /// A span of `elapsed` that started with `then` bytes queued, added `written`, and ended
    /// with `now` queued: counted if the link was busy, else what had gathered is dropped.
    pub(super) fn span(&mut self, elapsed: Duration, then: u64, written: u64, now: u64) {
        match (then + written).checked_sub(now) {
            Some(drained) if then >= Self::BUSY_BYTES => {
                self.pending.0 += elapsed;
                self.pending.1 += drained;
            }
            _ => self.pending = (Duration::ZERO, 0),
        }
    }
}

/// Measures the link of a lock-step connection, where each answer written is followed by the
/// peer's next request (post-copy's background fetches): there the queue drains between answers
/// and [`LinkGauge`] never sees it stay long, and the time from an answer to the next request
/// holds the peer's handling of it as much as the link. TCP measures the link itself: on every
/// acknowledgement the kernel takes the rate at which the peer acknowledged the data in flight
/// ([`Connection::delivery_rate`]). The estimate is the median of the last
/// [`AnswerGauge::WINDOW`] such rates: an answer's burst is often shorter than what the link
/// holds in flight, which reads it slow, and a shaper's burst allowance lets a short one through
/// at the speed of the wire beneath, which reads it fast. A Unix socket gives none: its peer is
/// on this host.
#[derive(Debug, Default)]
pub struct AnswerGauge {
    /// The last rates measured, in bytes per second, newest last.
    recent: std::collections::VecDeque<u64>,
}

impl AnswerGauge {
    /// How many recent rates the estimate is the median of.
    pub const WINDOW: usize = 8;

    /// Called when the peer's next request arrived on `conn` (so that the last answer's
    /// acknowledgements are in): the link's estimate, as a sample of [`LinkGauge::SAMPLE_BYTES`].
    pub fn requested(&mut self, conn: &Connection) -> Option<LinkSample> {
        self.rate(conn.delivery_rate())
    }

    pub(super) fn rate(&mut self, measured: Option<u64>) -> Option<LinkSample> {
        if let Some(rate) = measured.filter(|&r| r > 0) {
            if self.recent.len() == Self::WINDOW {
                self.recent.pop_front();
            }
            self.recent.push_back(rate);
        }
        let mut rates: Vec<u64> = self.recent.iter().copied().collect();
        rates.sort_unstable();
        let median = *rates.get(rates.len() / 2)?;
        let bytes = LinkGauge::SAMPLE_BYTES;
        Some(LinkSample {
            elapsed: Duration::from_secs_f64(bytes as f64 / median as f64),
            bytes,
        })
    }
}

/// A busy link's bytes carried over a time (see [`LinkGauge`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkSample {
    /// How long it took.
    pub elapsed: Duration,
    /// The bytes it carried meanwhile.
    pub bytes: u64,
}
