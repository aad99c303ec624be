//! Snapshots in a chunk store: guest memory cut into page-aligned chunks, all-zero chunks not
//! stored, every other chunk zstd-compressed and stored once under its BLAKE3 hash — within a
//! snapshot, across diff snapshots and across snapshots of different VMs — on a local
//! directory or on S3-compatible object storage, behind one [`Backend`] trait.
//!
//! A store is a prefix (a directory, or `s3://bucket/prefix`) holding:
//! - `chunks/HH/HASH`: a zstd frame of the chunk whose BLAKE3 (of the uncompressed bytes) is
//!   HASH (hex, HH its first two digits);
//! - `snapshots/NAME/manifest.json` ([`StoreManifest`]): format, version, VM configuration,
//!   each region's chunks by hash (zero, or inherited from a diff's base), region digests, the
//!   state object's BLAKE3 and a BLAKE3 checksum over the whole manifest;
//! - `snapshots/NAME/state.json`: the vCPU and VM state, as a flat snapshot's `state.json`;
//! - `snapshots/NAME/working-set.json`: the chunks a lazy restore's guest faulted on first;
//! - `leases/ID`: markers of snapshot writes and collections under way (see [`gc`]).
//!
//! A snapshot is named by the store location followed by its name: `s3://bucket/fleet/vm1`
//! is snapshot `vm1` of the store `s3://bucket/fleet`, `store:/var/lib/snap/vm1` snapshot `vm1`
//! of the store in `/var/lib/snap` ([`Location`]). Writing puts the chunks first and the
//! manifest last, in one atomic put: an interrupted write leaves no manifest that looks
//! complete. Reading checks the manifest as a whole before anything else, and every chunk's
//! hash before any of its bytes reach guest memory.

pub mod backend;
pub mod cache;
pub mod chunk;
pub mod gc;
pub mod local;
pub mod location;
pub mod manifest;
pub mod restore;
pub mod s3;
pub mod source;
pub mod write;

use std::io;
use std::path::PathBuf;

pub use backend::{Backend, ObjectInfo};
pub use location::Location;
pub use manifest::{ChunkRef, StoreManifest, StoreRegion};

pub type Result<T> = std::result::Result<T, Error>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{store}: {key} is missing")]
    Missing { store: String, key: String },
    #[error("{store}: {op} {key} failed")]
    Io {
        store: String,
        key: String,
        op: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("{store}: {op} {key} failed")]
    Object {
        store: String,
        key: String,
        op: &'static str,
        #[source]
        source: Box<object_store::Error>,
    },
    #[error(
        "{store}: the store is unreachable ({op} {key}); check AWS_ENDPOINT_URL and that the \
         server runs"
    )]
    Unreachable {
        store: String,
        key: String,
        op: &'static str,
        #[source]
        source: Box<object_store::Error>,
    },
    #[error(
        "{store}: the store refused the credentials ({op} {key}); check AWS_ACCESS_KEY_ID and \
         AWS_SECRET_ACCESS_KEY"
    )]
    Credentials {
        store: String,
        key: String,
        op: &'static str,
        #[source]
        source: Box<object_store::Error>,
    },
    #[error("{store}: the bucket does not exist ({op} {key})")]
    NoBucket {
        store: String,
        key: String,
        op: &'static str,
        #[source]
        source: Box<object_store::Error>,
    },
    #[error("{store}: cannot set up the store")]
    Setup {
        store: String,
        #[source]
        source: Box<object_store::Error>,
    },
    #[error("{0}")]
    Location(String),
    #[error("{store}: {key}: not valid JSON of the expected shape (truncated or not a manifest)")]
    Json {
        store: String,
        key: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("{store}: {key}: not a guestmem store snapshot (format {found})")]
    Foreign {
        store: String,
        key: String,
        found: String,
    },
    #[error(
        "{store}: {key}: store snapshot version {found}; this guestmem reads version {supported}"
    )]
    Version {
        store: String,
        key: String,
        found: u64,
        supported: u32,
    },
    #[error("corrupt store snapshot: {0}")]
    Corrupt(String),
    #[error("cannot restore here: {0}")]
    Layout(String),
    #[error("cannot write the snapshot: {0}")]
    Write(String),
    #[error(
        "{store}: gc removed nothing: the manifest of snapshot '{name}' cannot be read, so its \
         chunks cannot be told from garbage; repair or delete it"
    )]
    GcUnreadableManifest {
        store: String,
        name: String,
        #[source]
        source: Box<Error>,
    },
    #[error("chunk cache {path}: {op} failed")]
    Cache {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    Migration(#[from] guestmem_migration::Error),
    #[error(transparent)]
    Vm(#[from] guestmem_vm::Error),
    #[error(transparent)]
    Memory(#[from] guestmem_memory::Error),
    #[error(transparent)]
    Paging(#[from] guestmem_paging::Error),
}

impl Error {
    /// Whether the error is an object the store does not hold.
    pub fn is_missing(&self) -> bool {
        matches!(self, Error::Missing { .. })
    }
}

/// An error and its causes in one line, each cause once (to sort errors by what they say).
pub(crate) fn chain_text(e: &(dyn std::error::Error + 'static)) -> String {
    guestmem_migration::error_chain(e, ": ")
}
