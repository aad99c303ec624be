//! Moving a guestmem VM through time and space: snapshots and restore (live migration comes on
//! top of the same pieces).

#![warn(missing_docs)]

pub mod chunk_digests;
pub mod component;
pub mod compress;
pub mod delta;
mod destination;
pub mod driver;
pub mod firecracker;
mod landing;
pub mod migrate;
mod migration_error;
mod payload;
pub mod snapshot;
mod source;
pub mod stream;
mod target;
pub mod transport;

use std::io;
use std::path::{Path, PathBuf};

pub use guestmem_sys::error_chain;
pub use migration_error::{MigrationError, Peer};

/// What snapshot and migration operations return.
pub type Result<T> = std::result::Result<T, Error>;

/// Why a snapshot, restore or migration failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file operation failed.
    #[error("{path}: {op} failed")]
    Io {
        /// The file.
        path: PathBuf,
        /// The operation.
        op: &'static str,
        /// The operating system's error.
        #[source]
        source: io::Error,
    },
    /// A file that is not the JSON it should be.
    #[error("{path}: not valid JSON of the expected shape")]
    Json {
        /// The file.
        path: PathBuf,
        /// Why it does not parse.
        #[source]
        source: serde_json::Error,
    },
    /// A manifest of another format.
    #[error("{path}: not a guestmem snapshot (format {found})")]
    NotASnapshot {
        /// The file.
        path: PathBuf,
        /// The format it names.
        found: String,
    },
    /// A snapshot of another version.
    #[error("{path}: snapshot version {found}; this guestmem reads version {supported}")]
    Version {
        /// The file.
        path: PathBuf,
        /// Its version.
        found: u64,
        /// The version this build reads.
        supported: u32,
    },
    /// A file shorter or longer than its manifest says.
    #[error(
        "{path}: {found} bytes, the manifest says {expected}: {}",
        length_mismatch(*found, *expected)
    )]
    WrongLength {
        /// The file.
        path: PathBuf,
        /// The manifest's length.
        expected: u64,
        /// The file's.
        found: u64,
    },
    /// The Firecracker page-server protocol was not followed.
    #[error("page-server protocol: {0}")]
    Protocol(String),
    /// A step of the Firecracker page-server protocol failed for a cause of its own (a socket
    /// that would not receive, a query of the system that failed).
    #[error("page-server protocol: {what}")]
    ProtocolIo {
        /// The step: receiving the handshake message, reading what its fd is, ...
        what: String,
        /// The operating system's error.
        #[source]
        source: io::Error,
    },
    /// The page-server handshake message is not the JSON it should be.
    #[error(
        "page-server protocol: the handshake message is not a JSON array of \
         GuestRegionUffdMapping {{base_host_virt_addr, size, offset[, page_size][, \
         page_size_kib]}}"
    )]
    HandshakeJson {
        /// Why it does not parse.
        #[source]
        source: serde_json::Error,
    },
    /// The page server killed its peer (the VMM) for a failure serving it, so that its guest
    /// never runs on memory it could not be given.
    #[error("page-server: peer pid {pid} killed")]
    PeerKilled {
        /// The peer's pid.
        pid: i32,
        /// The failure.
        #[source]
        source: Box<Error>,
    },
    /// A snapshot whose bytes are not what its manifest says.
    #[error("corrupt snapshot: {0}")]
    Corrupt(String),
    /// A snapshot that cannot be restored here.
    #[error("cannot restore here: {0}")]
    Layout(String),
    /// A snapshot taken of a VM of another configuration than the prepared VM it was to be
    /// restored into; nothing of it was restored.
    #[error("{snapshot} does not fit the prepared VM: {reason}; nothing was restored")]
    PreparedMismatch {
        /// The snapshot.
        snapshot: String,
        /// What differs (vCPUs, regions and their address, size, backend).
        reason: String,
    },
    /// A snapshot that cannot be written.
    #[error("cannot write the snapshot: {0}")]
    Write(String),
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
    /// A component's own operation failed.
    #[error("component '{name}': {op} failed")]
    Component {
        /// The component's name.
        name: String,
        /// The operation: pause, resume, save, restore or dirty_log.
        op: &'static str,
        /// The component's error.
        #[source]
        source: component::ComponentError,
    },
    /// Two components of one VM have the same name.
    #[error("two components are named '{name}': names must be unique")]
    DuplicateComponent {
        /// The name.
        name: String,
    },
    /// A saved state names a component the restoring VM does not have.
    #[error("the saved state holds component '{name}', which this VM does not have")]
    UnknownComponent {
        /// The saved component's name.
        name: String,
    },
    /// A component of the restoring VM has no saved state.
    #[error("the saved state holds nothing for component '{name}'")]
    MissingComponentState {
        /// The component's name.
        name: String,
    },
    /// The VMM's VM (a [`component::Machine`] or [`component::TargetMachine`], or its
    /// [`component::MachineBuilder`]) failed: a VMM wraps its own errors in this.
    #[error("the VM: {op} failed")]
    Machine {
        /// What it was doing: build, restore, resume, ...
        op: &'static str,
        /// Its error.
        #[source]
        source: component::ComponentError,
    },
    /// The machine must be paused for this (saving its state).
    #[error("the VM is running: pause it first")]
    MachineRunning,
    /// A pause or resume of the machine failed half-way and its vCPUs are gone.
    #[error("the VM's vCPUs were lost by a failed pause or resume")]
    MachineLost,
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

    pub(crate) fn io(path: &Path, op: &'static str) -> impl FnOnce(io::Error) -> Error {
        let path = path.to_path_buf();
        move |source| Error::Io { path, op, source }
    }
}

/// What a file's length, against its manifest's, says happened to it.
fn length_mismatch(found: u64, expected: u64) -> &'static str {
    if found < expected {
        "truncated"
    } else {
        "longer than written (bytes appended, or another file in its place)"
    }
}
