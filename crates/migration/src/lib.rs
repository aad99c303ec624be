//! Moving a guestmem VM through time and space: snapshots and restore (live migration comes on
//! top of the same pieces).

pub mod chunk_digests;
pub mod component;
pub mod compress;
pub mod delta;
mod destination;
pub mod driver;
pub mod firecracker;
pub mod migrate;
mod migration_error;
pub mod snapshot;
mod source;
pub mod stream;
pub mod transport;

use std::io;
use std::path::{Path, PathBuf};

pub use migration_error::{MigrationError, Peer};

pub type Result<T> = std::result::Result<T, Error>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {op} failed: {source}")]
    Io {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("{path}: not valid JSON of the expected shape: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{path}: not a guestmem snapshot (format {found})")]
    NotASnapshot { path: PathBuf, found: String },
    #[error("{path}: snapshot version {found}; this guestmem reads version {supported}")]
    Version {
        path: PathBuf,
        found: u64,
        supported: u32,
    },
    #[error("{path}: truncated: {found} bytes, the manifest says {expected}")]
    Truncated {
        path: PathBuf,
        expected: u64,
        found: u64,
    },
    #[error("page-server protocol: {0}")]
    Protocol(String),
    #[error("corrupt snapshot: {0}")]
    Corrupt(String),
    #[error("cannot restore here: {0}")]
    Layout(String),
    #[error("cannot write the snapshot: {0}")]
    Write(String),
    #[error(transparent)]
    Vm(#[from] guestmem_vm::Error),
    #[error(transparent)]
    Memory(#[from] guestmem_memory::Error),
    #[error(transparent)]
    Paging(#[from] guestmem_paging::Error),
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
    /// The machine must be paused for this (saving its state).
    #[error("the VM is running: pause it first")]
    MachineRunning,
    /// A pause or resume of the machine failed half-way and its vCPUs are gone.
    #[error("the VM's vCPUs were lost by a failed pause or resume")]
    MachineLost,
    #[error(transparent)]
    Stream(#[from] stream::StreamError),
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
