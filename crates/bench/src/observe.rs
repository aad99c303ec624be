//! `--progress` of the benches that time long work (`migrate`, `restore`): the progress
//! records and metrics that a CLI run with `--progress json=FILE --metrics ADDR` makes, each
//! record encoded as its JSON line (then dropped) and fed to a metrics registry, at the CLI's
//! default interval. So `scripts/bench-ab` can run one build with and without them
//! (`--b-arg=--progress`) and tell whether they cost anything.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use guestmem_events::{Event, Metrics, Sink};

/// Records made by every sink of this process (the output's `progress_records`: proof that
/// the records were on).
static RECORDS: AtomicU64 = AtomicU64::new(0);

/// The CLI's default interval between two records of one status (`--progress-interval-ms`).
const INTERVAL: Duration = Duration::from_millis(1000);

/// With `on`, a sink that does what the CLI's `--progress json=FILE` and `--metrics` do with
/// each record (a line written to a sink that keeps nothing; the metrics updated); else none.
pub fn sink(on: bool) -> Option<Sink> {
    if !on {
        return None;
    }
    let metrics = Metrics::new();
    let lines = Sink::new(|e: &Event| {
        RECORDS.fetch_add(1, Ordering::Relaxed);
        let _ = writeln!(std::io::sink(), "{}", e.to_json_line());
    })
    .every(INTERVAL);
    Some(lines.tee(metrics.sink()))
}

/// How many records the sinks made so far (None when `on` is false: none were asked for).
pub fn records(on: bool) -> Option<u64> {
    on.then(|| RECORDS.load(Ordering::Relaxed))
}

#[cfg(test)]
mod tests {
    use super::*;
    use guestmem_events::Status;

    #[test]
    fn records_are_counted_only_when_on() {
        assert!(sink(false).is_none());
        assert_eq!(records(false), None);
        let before = records(true).unwrap();
        sink(true).unwrap().send(&Event::new(Status::Setup));
        assert!(records(true).unwrap() > before);
    }
}
