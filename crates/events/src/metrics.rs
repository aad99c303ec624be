//! Metrics for the long-lived processes (a restore service, a page server, a destination
//! waiting for migrations), in the Prometheus / OpenMetrics text exposition
//! (`prometheus-client`), fed by the same progress records the sinks get: [`Metrics::sink`]
//! turns each run's records into counters, gauges and histograms, so the metrics and the
//! records never disagree. [`MetricsServer`] answers `GET /metrics` on a Unix socket or a
//! loopback TCP port.
//!
//! Names follow KubeVirt's for migrations (`..._migration_data_processed_bytes`,
//! `..._data_remaining_bytes`, `..._dirty_memory_rate_bytes`, `..._memory_transfer_rate_bytes`)
//! with the `guestmem_` prefix, and Prometheus's conventions elsewhere (`_total` counters,
//! `_seconds` and `_bytes` units). The list is in docs/metrics.md.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::{Event, Operation, Sink, Status};

mod server;
pub use server::{MetricsAddr, MetricsServer};

/// Labels: the operation (`migrate-send`, `restore`, ...).
type Op = Vec<(&'static str, &'static str)>;
/// Labels: the operation and the final status.
type OpStatus = Vec<(&'static str, &'static str)>;
type FloatGauge = Gauge<f64, AtomicU64>;

/// The metrics of one process (see the module docs).
pub struct Metrics {
    registry: Registry,
    runs: Family<OpStatus, Counter>,
    bytes: Family<Op, Counter>,
    faults: Family<Op, Counter>,
    chunks: Family<Op, Counter>,
    postcopy_requests: Family<Op, Counter>,
    duration: Family<Op, Histogram>,
    downtime: Histogram,
    processed: Family<Op, Gauge>,
    remaining: Family<Op, Gauge>,
    dirty_rate: Family<Op, FloatGauge>,
    transfer_rate: Family<Op, FloatGauge>,
    resident: Family<Op, Gauge>,
    /// A restore service's pool of armed VMs, and the clones' VMs recycled into it.
    pub pool_size: Gauge,
    /// Clones' VMs wiped and armed again instead of built anew.
    pub recycles: Counter,
    /// Serializes encoding (the registry is read-only once built).
    encoding: Mutex<()>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

fn op(o: Operation) -> Op {
    vec![("operation", operation_name(o))]
}

fn operation_name(o: Operation) -> &'static str {
    match o {
        Operation::MigrateSend => "migrate-send",
        Operation::MigrateReceive => "migrate-receive",
        Operation::Snapshot => "snapshot",
        Operation::Restore => "restore",
        Operation::PageServer => "page-server",
    }
}

impl Metrics {
    /// Every metric, registered, at zero.
    pub fn new() -> Arc<Metrics> {
        let mut registry = Registry::with_prefix("guestmem");
        let m = Metrics {
            runs: Family::default(),
            bytes: Family::default(),
            faults: Family::default(),
            chunks: Family::default(),
            postcopy_requests: Family::default(),
            // 1 ms to about 65 s.
            duration: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.001, 2.0, 17))
            }),
            // 0.1 ms to about 3 s.
            downtime: Histogram::new(exponential_buckets(0.0001, 2.0, 15)),
            processed: Family::default(),
            remaining: Family::default(),
            dirty_rate: Family::default(),
            transfer_rate: Family::default(),
            resident: Family::default(),
            pool_size: Gauge::default(),
            recycles: Counter::default(),
            encoding: Mutex::new(()),
            registry: Registry::default(),
        };
        m.register(&mut registry);
        Arc::new(Metrics { registry, ..m })
    }

    fn register(&self, r: &mut Registry) {
        r.register(
            "operations",
            "Runs ended, by operation and final status (completed, failed)",
            self.runs.clone(),
        );
        r.register(
            "data_processed_bytes",
            "Page bytes moved by ended runs (sent, received, stored, made resident)",
            self.bytes.clone(),
        );
        r.register(
            "page_faults",
            "Page faults served by ended runs (post-copy, lazy restores, page server)",
            self.faults.clone(),
        );
        r.register(
            "chunks_fetched",
            "Chunks fetched from the page source by ended runs",
            self.chunks.clone(),
        );
        r.register(
            "postcopy_requests",
            "Post-copy page requests of ended migrations",
            self.postcopy_requests.clone(),
        );
        r.register(
            "operation_duration_seconds",
            "From start to completed: snapshot create, restore (to all memory resident), migration",
            self.duration.clone(),
        );
        r.register(
            "migration_downtime_seconds",
            "Migration downtime, source vCPUs stopped to destination vCPUs running",
            self.downtime.clone(),
        );
        r.register(
            "migration_data_processed_bytes",
            "The last record's bytes moved, per operation (KubeVirt's migrate data processed)",
            self.processed.clone(),
        );
        r.register(
            "migration_data_remaining_bytes",
            "The last record's bytes still to move, per operation",
            self.remaining.clone(),
        );
        r.register(
            "migration_dirty_memory_rate_bytes",
            "The last record's dirty rate, bytes per second",
            self.dirty_rate.clone(),
        );
        r.register(
            "migration_memory_transfer_rate_bytes",
            "The last record's transfer rate, bytes per second",
            self.transfer_rate.clone(),
        );
        r.register(
            "resident_bytes",
            "The last record's guest memory resident, per operation",
            self.resident.clone(),
        );
        r.register(
            "restore_pool_size",
            "VMs armed ahead of restores in the restore service's pool",
            self.pool_size.clone(),
        );
        r.register(
            "restore_recycles",
            "Clones' VMs wiped and armed again for the pool",
            self.recycles.clone(),
        );
    }

    /// A sink that feeds these metrics from progress records (pair it with another with
    /// [`Sink::tee`]).
    pub fn sink(self: &Arc<Metrics>) -> Sink {
        let m = self.clone();
        Sink::new(move |e| m.record(e))
    }

    /// Takes one progress record in: the gauges follow every record; a final record adds the
    /// run to the counters and histograms.
    pub fn record(&self, e: &Event) {
        let o = op(e.operation);
        let gauge = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        self.processed
            .get_or_create(&o)
            .set(gauge(e.bytes_transferred));
        if let Some(r) = e.bytes_remaining {
            self.remaining.get_or_create(&o).set(gauge(r));
        }
        if let Some(d) = e.dirty_rate_bytes_per_s {
            self.dirty_rate.get_or_create(&o).set(d);
        }
        self.transfer_rate
            .get_or_create(&o)
            .set(e.bandwidth_bytes_per_s);
        if let Some(r) = e.resident_bytes {
            self.resident.get_or_create(&o).set(gauge(r));
        }
        if !e.status.is_final() {
            return;
        }
        let status = if e.status == Status::Completed {
            "completed"
        } else {
            "failed"
        };
        let mut os = o.clone();
        os.push(("status", status));
        self.runs.get_or_create(&os).inc();
        self.bytes.get_or_create(&o).inc_by(e.bytes_transferred);
        self.faults.get_or_create(&o).inc_by(e.faults.unwrap_or(0));
        self.chunks
            .get_or_create(&o)
            .inc_by(e.chunks_fetched.unwrap_or(0));
        self.postcopy_requests
            .get_or_create(&o)
            .inc_by(e.postcopy_requests.unwrap_or(0));
        if e.status == Status::Completed {
            self.duration.get_or_create(&o).observe(e.elapsed_ms / 1e3);
            if let Some(d) = e.downtime_ms {
                self.downtime.observe(d / 1e3);
            }
        }
    }

    /// The exposition: OpenMetrics text (which Prometheus scrapes), ending with `# EOF`.
    pub fn encode(&self) -> String {
        let _one = self
            .encoding
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String does not fail");
        out
    }
}

impl Sink {
    /// A sink handing each record to this one, then to `other`.
    #[must_use]
    pub fn tee(self, other: Sink) -> Sink {
        let interval = self.interval().min(other.interval());
        let (a, b) = (self, other);
        Sink::new(move |e| {
            a.send(e);
            b.send(e);
        })
        .every(interval)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Reporter;

    /// A value of the exposition: the sample line that starts with `series` (name and labels).
    pub(crate) fn value(text: &str, series: &str) -> Option<f64> {
        text.lines()
            .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    }

    #[test]
    fn final_records_count_runs_and_their_figures() {
        let m = Metrics::new();
        let r = Reporter::new(m.sink(), Operation::Restore);
        let mut e = Event::new(Status::Postcopy);
        e.bytes_transferred = 4096;
        e.bytes_remaining = Some(8192);
        r.emit(e);
        let text = m.encode();
        let remaining = "guestmem_migration_data_remaining_bytes{operation=\"restore\"}";
        assert_eq!(value(&text, remaining), Some(8192.0), "{text}");
        let mut e = Event::new(Status::Completed);
        e.bytes_transferred = 12288;
        e.faults = Some(3);
        e.chunks_fetched = Some(5);
        r.emit(e);
        let text = m.encode();
        let runs = "guestmem_operations_total{operation=\"restore\",status=\"completed\"}";
        assert_eq!(value(&text, runs), Some(1.0), "{text}");
        let faults = "guestmem_page_faults_total{operation=\"restore\"}";
        assert_eq!(value(&text, faults), Some(3.0), "{text}");
        let chunks = "guestmem_chunks_fetched_total{operation=\"restore\"}";
        assert_eq!(value(&text, chunks), Some(5.0), "{text}");
        let count = "guestmem_operation_duration_seconds_count{operation=\"restore\"}";
        assert_eq!(value(&text, count), Some(1.0), "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
    }
}
