//! The store timeout policy, one for every path that reads or writes an object store (full and
//! lazy restore, a snapshot write, the page server, the restore service, gc, merge, delete):
//!
//! - a request the store has not answered for [`STALL_WARNING`] (less for a bound under twice
//!   that) is a *stall*: one warning names the store and the object, and
//!   [`StoreOptions::on_stall`] hears [`StallStatus::Stalled`] (a progress stream's `stalled`);
//! - a stall shorter than the bound ([`StoreOptions::timeout`], default
//!   [`DEFAULT_STORE_TIMEOUT`]) is ridden out: the request goes on and nothing is lost;
//! - a request the store answers nothing for the bound fails with [`crate::Error::Stalled`],
//!   naming the store, the object and how long it waited. The store is then *dead* until it
//!   answers again: a request in flight fails once it has waited [`StoreOptions::probe`], and a
//!   new one fails at once, but for one a probe long (a *probe*, which finds out whether the
//!   store is back). A dead store fails an operation once, within the bound and a second or
//!   so, however many requests and retries the operation has;
//! - a request the store answered with an error is not retried as a stall is: the S3 client
//!   retries a server error (5xx) or a dropped connection at most [`MAX_RETRIES`] times, all
//!   within the bound; a refusal (4xx: missing, credentials) is final at once.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

/// How long a store may answer nothing before the operation fails, unless set otherwise
/// (`--store-timeout`, [`StoreOptions::timeout`]).
pub const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a request waits for an answer before the stall is told (warning and event).
pub const STALL_WARNING: Duration = Duration::from_secs(2);
/// How long a request waits, once the store has been found dead, before it fails too.
pub const PROBE: Duration = Duration::from_secs(1);
/// The most times the S3 client sends one request again after a server error or a dropped
/// connection (never after a timeout: that is the bound's).
pub const MAX_RETRIES: usize = 2;

/// What a stall listener hears.
pub type StallFn = Arc<dyn Fn(&StallEvent) + Send + Sync>;

/// How an operation treats its store: its timeout and who hears about stalls.
#[derive(Clone)]
pub struct StoreOptions {
    /// A request the store answers nothing for this long fails the operation (default
    /// [`DEFAULT_STORE_TIMEOUT`]). At least 100 ms.
    pub timeout: Duration,
    /// Told when a stall begins, when the store answers again, and when it fails an
    /// operation: a progress stream shows `stalled` from it.
    pub on_stall: Option<StallFn>,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            timeout: DEFAULT_STORE_TIMEOUT,
            on_stall: None,
        }
    }
}

impl std::fmt::Debug for StoreOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreOptions")
            .field("timeout", &self.timeout)
            .field("on_stall", &self.on_stall.is_some())
            .finish()
    }
}

impl StoreOptions {
    /// The default options with the bound `timeout`.
    pub fn with_timeout(timeout: Duration) -> StoreOptions {
        StoreOptions {
            timeout,
            ..StoreOptions::default()
        }
    }

    /// When a request without an answer is told as a stall: [`STALL_WARNING`], or half the
    /// bound when that is shorter.
    pub fn warn_after(&self) -> Duration {
        STALL_WARNING.min(self.timeout / 2)
    }

    /// How long a request waits once the store has been found dead: [`PROBE`], or half the
    /// bound when that is shorter.
    pub fn probe(&self) -> Duration {
        PROBE.min(self.timeout / 2)
    }

    /// Refuses a bound too short to be one (under 100 ms), naming it.
    pub fn check(&self) -> crate::Result<()> {
        if self.timeout < Duration::from_millis(100) {
            return Err(crate::Error::Location(format!(
                "store timeout {:?}: too short (at least 0.1 s)",
                self.timeout
            )));
        }
        Ok(())
    }
}

/// Where a stall stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StallStatus {
    /// The store has answered nothing to a request for a while: the operation waits for it
    /// (up to the bound).
    Stalled,
    /// The store answered again: the stall was ridden out.
    Answered,
    /// The store answered nothing for the bound: the operation fails.
    Failed,
}

/// A stall, as a progress stream shows it.
#[derive(Debug, Clone, Serialize)]
pub struct StallEvent {
    /// The store (`s3://bucket/prefix`).
    pub store: String,
    /// The object a request waited for.
    pub key: String,
    /// What the request did (`read`, `write`, `list`, …).
    pub op: &'static str,
    /// What happened.
    pub status: StallStatus,
    /// How long the store had answered nothing, in seconds.
    pub waited_s: f64,
    /// The bound, in seconds.
    pub timeout_s: f64,
}

/// One store's stall state, shared by its requests: whether a stall was told, and whether
/// the store was found dead (a request waited the whole bound) with no answer since.
#[derive(Debug, Default)]
struct State {
    /// When the stall being told began (its warning is out).
    stalled_since: Option<Instant>,
    /// When a request found the store dead, and when that request began.
    dead: Option<(Instant, Instant)>,
    /// When the last probe of a dead store began.
    probed: Option<Instant>,
}

/// A store's watch over its requests' answers.
pub(crate) struct Watch {
    store: String,
    options: StoreOptions,
    state: Mutex<State>,
}

impl std::fmt::Debug for Watch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watch")
            .field("store", &self.store)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

/// What a request waiting for an answer does next.
pub(crate) enum Verdict {
    /// Wait on.
    Wait,
    /// Fail: the store answered nothing for so long (this request waited the first, the
    /// store the second).
    Fail(Duration, Duration),
}

impl Watch {
    pub(crate) fn new(store: String, options: StoreOptions) -> Watch {
        Watch {
            store,
            options,
            state: Mutex::new(State::default()),
        }
    }

    pub(crate) fn options(&self) -> &StoreOptions {
        &self.options
    }

    fn tell(&self, key: &str, op: &'static str, status: StallStatus, waited: Duration) {
        if let Some(f) = &self.options.on_stall {
            f(&StallEvent {
                store: self.store.clone(),
                key: key.to_string(),
                op,
                status,
                waited_s: waited.as_secs_f64(),
                timeout_s: self.options.timeout.as_secs_f64(),
            });
        }
    }

    /// Whether a request may be sent now: always, unless the store is dead; then only as a
    /// probe, one per [`StoreOptions::probe`]. `Err`: how long the store has answered nothing.
    pub(crate) fn admit(&self) -> Result<(), Duration> {
        let mut state = self.state.lock().expect("not poisoned");
        let Some((found, began)) = state.dead else {
            return Ok(());
        };
        let last = state.probed.unwrap_or(found);
        if last.elapsed() >= self.options.probe() {
            state.probed = Some(Instant::now());
            return Ok(());
        }
        Err(began.elapsed())
    }

    /// A request for `op` `key` that began at `start` has no answer yet: tells a new stall,
    /// and says whether to fail.
    pub(crate) fn waiting(&self, key: &str, op: &'static str, start: Instant) -> Verdict {
        let waited = start.elapsed();
        let timeout = self.options.timeout;
        let mut state = self.state.lock().expect("not poisoned");
        if let Some((_, began)) = state.dead {
            if waited >= self.options.probe() {
                let silent = began.elapsed().max(waited);
                return Verdict::Fail(waited, silent);
            }
        }
        if waited >= timeout {
            let now = Instant::now();
            state.dead = Some((now, start));
            drop(state);
            tracing::warn!(
                "{}: no answer to {op} {key} for {:.1} s (the store timeout): failing",
                self.store,
                waited.as_secs_f64()
            );
            self.tell(key, op, StallStatus::Failed, waited);
            return Verdict::Fail(waited, waited);
        }
        if waited >= self.options.warn_after() && state.stalled_since.is_none() {
            state.stalled_since = Some(start);
            drop(state);
            tracing::warn!(
                "{}: stalled: no answer to {op} {key} for {:.1} s; waiting up to {:.1} s \
                 (the store timeout) before failing",
                self.store,
                waited.as_secs_f64(),
                timeout.as_secs_f64()
            );
            self.tell(key, op, StallStatus::Stalled, waited);
        }
        Verdict::Wait
    }

    /// The store answered a request for `op` `key` (with bytes or with an error of its own):
    /// a stall told is over, and the store is not dead.
    pub(crate) fn answered(&self, key: &str, op: &'static str) {
        let mut state = self.state.lock().expect("not poisoned");
        state.dead = None;
        state.probed = None;
        if let Some(since) = state.stalled_since.take() {
            drop(state);
            let waited = since.elapsed();
            tracing::warn!(
                "{}: answered again ({op} {key}) after a stall of {:.1} s",
                self.store,
                waited.as_secs_f64()
            );
            self.tell(key, op, StallStatus::Answered, waited);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The default bound is 30 s; the warning comes within 5 s of a stall, sooner under a
    /// short bound; a bound under 0.1 s is refused.
    #[test]
    fn the_default_bound_is_30_s_and_a_stall_is_told_within_5_s() {
        let o = StoreOptions::default();
        assert_eq!(o.timeout, Duration::from_secs(30));
        assert!(o.warn_after() <= Duration::from_secs(5));
        assert_eq!(o.probe(), Duration::from_secs(1));
        let short = StoreOptions::with_timeout(Duration::from_secs(2));
        assert_eq!(short.warn_after(), Duration::from_secs(1));
        assert!(short.check().is_ok());
        let e = StoreOptions::with_timeout(Duration::from_millis(10))
            .check()
            .unwrap_err()
            .to_string();
        assert!(e.contains("too short"), "{e}");
    }

    /// A stall is told once (event and warning), its end once; the bound fails the request,
    /// and then another request fails after the probe until the store answers again.
    #[test]
    fn a_stall_is_told_once_and_a_dead_store_fails_fast_until_it_answers() {
        let heard = Arc::new(Mutex::new(Vec::new()));
        let h = heard.clone();
        let options = StoreOptions {
            timeout: Duration::from_millis(400),
            on_stall: Some(Arc::new(move |e: &StallEvent| {
                h.lock().unwrap().push(e.status);
            })),
        };
        let w = Watch::new("s3://b/p".into(), options);
        let start = Instant::now();
        assert!(matches!(w.waiting("k", "read", start), Verdict::Wait));
        std::thread::sleep(Duration::from_millis(210));
        assert!(matches!(w.waiting("k", "read", start), Verdict::Wait));
        assert!(matches!(w.waiting("k2", "read", start), Verdict::Wait));
        assert_eq!(*heard.lock().unwrap(), vec![StallStatus::Stalled]);
        std::thread::sleep(Duration::from_millis(200));
        let Verdict::Fail(waited, _) = w.waiting("k", "read", start) else {
            panic!("the bound fails the request");
        };
        assert!(waited >= Duration::from_millis(400));
        // A new request is refused at once, until a probe's time has passed: then one probe
        // goes, and fails after the probe (200 ms), not the bound.
        assert!(w.admit().is_err());
        std::thread::sleep(Duration::from_millis(210));
        assert!(w.admit().is_ok(), "a probe");
        assert!(w.admit().is_err(), "one probe at a time");
        let other = Instant::now();
        assert!(matches!(w.waiting("k3", "read", other), Verdict::Wait));
        std::thread::sleep(Duration::from_millis(210));
        let Verdict::Fail(_, silent) = w.waiting("k3", "read", other) else {
            panic!("a dead store fails the next request after the probe");
        };
        assert!(silent >= Duration::from_millis(800), "{silent:?}");
        w.answered("k3", "read");
        assert!(w.admit().is_ok(), "the store answered: not dead");
        let again = Instant::now();
        std::thread::sleep(Duration::from_millis(210));
        assert!(matches!(w.waiting("k4", "read", again), Verdict::Wait));
        assert_eq!(
            *heard.lock().unwrap(),
            vec![
                StallStatus::Stalled,
                StallStatus::Failed,
                StallStatus::Answered,
                StallStatus::Stalled
            ]
        );
    }
}
