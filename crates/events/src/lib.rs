//! What long work tells while it runs: one progress record ([`Event`]) at a steady interval and
//! at every change of status, the same for every operation (a migration's two sides, a
//! snapshot, a lazy restore, a page server), so that a control plane reads them all alike.
//!
//! A VMM passes a [`Sink`] in (a callback, or a channel: [`Sink::channel`]) with the
//! operation's options; the library's [`Reporter`] fills the record's common fields (schema,
//! operation, sequence number, time, bandwidth), paces the records at the sink's interval and
//! never lets two records of the same status come closer than that. The CLI writes the same
//! records as JSON lines (`--progress json`).
//!
//! The records are a format: [`PROGRESS_SCHEMA`] names its version (see [`check_schema`]),
//! and docs/schemas/ holds its JSON Schema.

mod event;
pub mod metrics;
mod reporter;
mod schema;
mod sink;

pub use event::{Event, Operation, Status};
pub use metrics::{Metrics, MetricsAddr, MetricsServer};
pub use reporter::{Reporter, Ticker};
pub use schema::{check_schema, SchemaError, PROGRESS_SCHEMA};
pub use sink::{Sink, DEFAULT_INTERVAL};
