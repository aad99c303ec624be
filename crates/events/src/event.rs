//! The progress record ([`Event`]), its operation and status.
//!
//! Format: [`crate::PROGRESS_SCHEMA`] (a change here bumps it unless it is additive: a new
//! optional field, or a new status).

use serde::{Deserialize, Serialize};

/// The operation a record is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Operation {
    /// The source of a live migration.
    MigrateSend,
    /// The destination of a live migration.
    MigrateReceive,
    /// Writing a snapshot (the guest paused, or live).
    Snapshot,
    /// Restoring a snapshot (lazily: pages come on demand).
    Restore,
    /// A page server serving a restored VM's faults.
    PageServer,
}

/// Where an operation is. Statuses may be added (an additive change of the schema): a reader
/// takes a status it does not know for work still going on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum Status {
    /// Connecting, handshaking, building the VM or opening the snapshot.
    Setup,
    /// Pages travel while the guest runs (a migration's rounds, a live snapshot's passes).
    Precopy,
    /// The guest is stopped: the last pages and the state (the downtime).
    Stopped,
    /// The guest runs at the destination (or the restored VM runs) and its missing pages come
    /// on demand and in the background.
    Postcopy,
    /// Post-copy with its link broken: the guest's faults wait for the source to reconnect.
    PostcopyPaused,
    /// The chunk store has not answered for its warning time (guestmem_store's `on_stall`):
    /// the work waits on it, until it answers (the status before comes back) or the store
    /// timeout fails the run.
    Stalled,
    /// Done: the last record of a run that succeeded.
    Completed,
    /// Failed: the last record of a run that failed, with `error`.
    Failed,
}

impl Status {
    /// The record's status is the last its operation sends.
    pub fn is_final(self) -> bool {
        matches!(self, Status::Completed | Status::Failed)
    }

    /// Its name in the records (`postcopy-paused`).
    pub fn name(self) -> &'static str {
        match self {
            Status::Setup => "setup",
            Status::Precopy => "precopy",
            Status::Stopped => "stopped",
            Status::Postcopy => "postcopy",
            Status::PostcopyPaused => "postcopy-paused",
            Status::Stalled => "stalled",
            Status::Completed => "completed",
            Status::Failed => "failed",
        }
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One progress record. The common fields (`schema` to `bandwidth_bytes_per_s`) are in every
/// record; the others only where the operation knows them (absent, not zero, elsewhere).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// [`crate::PROGRESS_SCHEMA`].
    pub schema: String,
    /// What the record is about.
    pub operation: Operation,
    /// Where it is.
    pub status: Status,
    /// The record's number in its run, from 0.
    pub seq: u64,
    /// Since the operation started.
    pub elapsed_ms: f64,
    /// Bytes of guest memory the operation moves (the guest's size).
    pub bytes_total: u64,
    /// Page bytes moved so far (sent, received, written or made resident); never decreases.
    pub bytes_transferred: u64,
    /// Bytes still to move as the operation knows it now (a migration's source: the dirty
    /// pages not sent yet; a post-copy destination or a lazy restore: memory not resident);
    /// 0 in the `completed` record. Absent where the side cannot know it (a pre-copy
    /// destination does not know what the source will still send).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_remaining: Option<u64>,
    /// Bytes moved per second since the record before (the reporter's measure).
    pub bandwidth_bytes_per_s: f64,
    /// The pre-copy round (pass) under way, from 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub round: Option<u32>,
    /// Bytes the guest dirtied per second during the last round.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dirty_rate_bytes_per_s: Option<f64>,
    /// The vCPUs' throttle (auto-converge), in percent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub throttle_percent: Option<u64>,
    /// The downtime if the guest stopped now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_downtime_ms: Option<f64>,
    /// Post-copy: page requests served (source) or fetches on behalf of faults (destination).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub postcopy_requests: Option<u64>,
    /// Page faults the pagers read (post-copy, lazy restore, page server).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub faults: Option<u64>,
    /// Fault latency so far: median, in microseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fault_latency_p50_us: Option<f64>,
    /// Fault latency so far: 99th percentile, in microseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fault_latency_p99_us: Option<f64>,
    /// Bytes of guest memory resident (lazy restore, post-copy destination, page server).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resident_bytes: Option<u64>,
    /// Chunks (pages or runs of them) fetched from the page source (lazy restore).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunks_fetched: Option<u64>,
    /// The downtime the guest had (a migration's `completed` record, on the source).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub downtime_ms: Option<f64>,
    /// Why it failed (`failed` only), causes included.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Which of a process's concurrent runs of the operation this is (the page server's
    /// sessions, the restore service's restores), from 1 ([`crate::Reporter::session`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<u64>,
}

impl Event {
    /// A record of `status` with every optional field absent; [`crate::Reporter::emit`] fills
    /// the common ones.
    pub fn new(status: Status) -> Event {
        Event {
            schema: crate::PROGRESS_SCHEMA.to_string(),
            operation: Operation::MigrateSend,
            status,
            seq: 0,
            elapsed_ms: 0.0,
            bytes_total: 0,
            bytes_transferred: 0,
            bytes_remaining: None,
            bandwidth_bytes_per_s: 0.0,
            round: None,
            dirty_rate_bytes_per_s: None,
            throttle_percent: None,
            expected_downtime_ms: None,
            postcopy_requests: None,
            faults: None,
            fault_latency_p50_us: None,
            fault_latency_p99_us: None,
            resident_bytes: None,
            chunks_fetched: None,
            downtime_ms: None,
            error: None,
            session: None,
        }
    }

    /// This record as one JSON line (no newline).
    pub fn to_json_line(&self) -> String {
        serde_json::to_string(self).expect("a progress record serializes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_are_kebab_case_and_absent_fields_are_left_out() {
        let mut e = Event::new(Status::PostcopyPaused);
        e.operation = Operation::MigrateReceive;
        e.resident_bytes = Some(4096);
        let v: serde_json::Value = serde_json::from_str(&e.to_json_line()).unwrap();
        assert_eq!(v["status"], "postcopy-paused");
        assert_eq!(v["operation"], "migrate-receive");
        assert_eq!(v["resident_bytes"], 4096);
        assert!(v.get("round").is_none(), "{v}");
        assert!(v.get("error").is_none(), "{v}");
        let back: Event = serde_json::from_value(v).unwrap();
        assert_eq!(back, e);
        for s in [Status::Setup, Status::Stalled, Status::Failed] {
            assert_eq!(serde_json::to_value(s).unwrap(), s.name());
        }
    }
}
