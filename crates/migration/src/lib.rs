//! Moving a guestmem VM through time and space: snapshots and restore (live migration comes on
//! top of the same pieces).

pub mod chunk_digests;
pub mod compress;
pub mod delta;
mod destination;
pub mod firecracker;
mod landing;
pub mod migrate;
pub mod snapshot;
mod source;
pub mod stream;
pub mod transport;

use std::io;
use std::path::{Path, PathBuf};

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
    #[error("migration: {0}")]
    Migration(String),
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
