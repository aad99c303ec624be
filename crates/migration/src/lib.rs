//! Live migration of a guestmem VM ([`migrate`]): its protocol, the mutually authenticated TLS
//! transport ([`transport`]), the stream with compression and delta ([`stream`], [`compress`],
//! [`delta`]), the source and the destination; and the driver ([`driver`]) that moves a VMM's
//! machine by a migration or a snapshot (`guestmem-snapshot`).

pub mod chunk_digests;
pub mod compress;
pub mod delta;
mod destination;
pub mod driver;
mod landing;
mod migration_error;
mod negotiate;
mod protocol;
mod source;
pub mod stream;
pub mod transport;

/// Live migration: the protocol and its types, the source ([`migrate::send`],
/// [`migrate::send_machine`]) and the destination ([`migrate::receive`],
/// [`migrate::receive_into`]).
pub mod migrate {
    pub use crate::destination::{
        receive, receive_components, receive_into, DestinationReport, Incoming, ReceiveOptions,
        Transfer, RESUME_TIMEOUT,
    };
    pub use crate::negotiate::{
        state_format, Negotiated, ProtocolRange, FEATURES, MIN_PROTOCOL, PROTOCOL,
        PROTOCOL_1_FEATURES,
    };
    pub use crate::protocol::*;
    pub use crate::source::{
        send, send_machine, Failure, MachineFailure, Reconnect, Report, Round, SendOptions,
        DEFAULT_ZSTD_WINDOW_BYTES,
    };
}

use guestmem_contract::component;
use guestmem_snapshot as snapshot;

/// Progress records and the sinks that receive them (see [`guestmem_events`]).
pub use guestmem_events as events;
pub use guestmem_sys::error_chain;
pub use migration_error::{MigrationError, Peer};

/// What migration operations return.
pub type Result<T> = std::result::Result<T, Error>;

/// Why a migration, or a snapshot or restore through the driver, failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file operation failed.
    #[error(transparent)]
    File(#[from] guestmem_sys::FileError),
    /// The VM failed.
    #[error(transparent)]
    Vm(#[from] guestmem_vm::Error),
    /// Guest memory failed.
    #[error(transparent)]
    Memory(#[from] guestmem_memory::Error),
    /// Demand paging failed.
    #[error(transparent)]
    Paging(#[from] guestmem_paging::Error),
    /// Dirty tracking failed.
    #[error(transparent)]
    Tracking(#[from] guestmem_tracking::Error),
    /// A live migration failed (see [`MigrationError`] for why).
    #[error(transparent)]
    Migration(#[from] MigrationError),
    /// The VMM's machine or one of its components failed.
    #[error(transparent)]
    Contract(#[from] guestmem_contract::Error),
    /// A snapshot or restore failed.
    #[error(transparent)]
    Snapshot(#[from] guestmem_snapshot::Error),
    /// The migration stream failed.
    #[error(transparent)]
    Stream(#[from] stream::StreamError),
    /// A migration connection failed.
    #[error(transparent)]
    Transport(#[from] transport::TransportError),
}

impl Error {
    /// Whether nothing listens at the peer's endpoint (connection refused, no such socket).
    pub fn is_unreachable(&self) -> bool {
        matches!(self, Error::Transport(e) if e.is_unreachable())
    }
}
