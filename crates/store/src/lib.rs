//! Snapshots in a chunk store: guest memory cut into page-aligned chunks, all-zero chunks not
//! stored, every other chunk zstd-compressed and stored once under its BLAKE3 hash — within a
//! snapshot, across diff snapshots and across snapshots of different VMs — on a local
//! directory or on S3-compatible object storage, behind one [`ObjectStore`] trait.
//!
//! A store is a prefix (a directory, or `s3://bucket/prefix`) holding:
//! - `packs/HH/ID`: packs of chunks: zstd frames of chunks one after another, each named in a
//!   manifest by the BLAKE3 of its uncompressed bytes, its pack, offset and length (HH: ID's
//!   first two hex digits). A pack holds the chunks of one run of guest memory, so a restore
//!   reads neighbouring chunks with one range read;
//! - `chunks/HH/HASH`: a zstd frame of the chunk whose BLAKE3 (of the uncompressed bytes) is
//!   HASH, in stores written before packs (manifest version 1), still read;
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

pub mod cache;
pub mod chunk;
pub mod gc;
mod ledger;
pub mod live;
pub mod local;
pub mod location;
pub mod manifest;
pub mod merge;
pub mod objects;
pub mod pages;
pub mod policy;
pub mod restore;
pub mod s3;
pub mod write;

use std::io;
use std::path::PathBuf;

pub use location::Location;
pub use manifest::{ChunkRef, StoreManifest, StoreRegion};
pub use objects::{ObjectInfo, ObjectStore};
pub use policy::{StallEvent, StallStatus, StoreOptions, DEFAULT_STORE_TIMEOUT};

/// What the store's operations return.
pub type Result<T> = std::result::Result<T, Error>;

/// Why a store operation failed. Each message stands alone; a cause that is an error of its own
/// is its `source()`, never repeated in the message.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An object the store does not hold.
    #[error("{store}: {key} is missing")]
    Missing {
        /// The store.
        store: String,
        /// The object's key.
        key: String,
    },
    /// A local store's file operation failed.
    #[error("{store}: {op} {key} failed")]
    Io {
        /// The store.
        store: String,
        /// The object's key.
        key: String,
        /// The operation.
        op: &'static str,
        /// The operating system's error.
        #[source]
        source: io::Error,
    },
    /// An object store request failed (none of the causes below).
    #[error("{store}: {op} {key} failed")]
    Object {
        /// The store.
        store: String,
        /// The object's key.
        key: String,
        /// The operation.
        op: &'static str,
        /// The object store's error.
        #[source]
        source: Box<object_store::Error>,
    },
    /// The object store cannot be reached (nothing listens at its endpoint).
    #[error(
        "{store}: the store is unreachable ({op} {key}); check AWS_ENDPOINT_URL and that the \
         server runs"
    )]
    Unreachable {
        /// The store.
        store: String,
        /// The object's key.
        key: String,
        /// The operation.
        op: &'static str,
        /// The object store's error.
        #[source]
        source: Box<object_store::Error>,
    },
    /// The object store answered nothing to a request for the store timeout (or, once it had
    /// done so, for the probe that followed): the store is stalled or unreachable.
    #[error("{}", stalled_text(store, key, op, *waited_s, *silent_s, *timeout_s))]
    Stalled {
        /// The store.
        store: String,
        /// The object's key.
        key: String,
        /// The operation.
        op: &'static str,
        /// How long this request waited, in seconds.
        waited_s: f64,
        /// How long the store had answered nothing, in seconds (at least `waited_s`).
        silent_s: f64,
        /// The store timeout, in seconds.
        timeout_s: f64,
    },
    /// A lazy restore's memory source failed for good on a stalled store: the chunks it never
    /// fetched (its guest was stopped, never run on them).
    #[error("{unfetched}")]
    NeverFetched {
        /// Which chunks, per region.
        unfetched: String,
        /// Why they were not fetched.
        #[source]
        source: Box<Error>,
    },
    /// The object store refused the credentials.
    #[error(
        "{store}: the store refused the credentials ({op} {key}); check AWS_ACCESS_KEY_ID and \
         AWS_SECRET_ACCESS_KEY"
    )]
    Credentials {
        /// The store.
        store: String,
        /// The object's key.
        key: String,
        /// The operation.
        op: &'static str,
        /// The object store's error.
        #[source]
        source: Box<object_store::Error>,
    },
    /// The store's bucket does not exist.
    #[error("{store}: the bucket does not exist ({op} {key})")]
    NoBucket {
        /// The store.
        store: String,
        /// The object's key.
        key: String,
        /// The operation.
        op: &'static str,
        /// The object store's error.
        #[source]
        source: Box<object_store::Error>,
    },
    /// The object store client cannot be built.
    #[error("{store}: cannot set up the store")]
    Setup {
        /// The store.
        store: String,
        /// The object store's error.
        #[source]
        source: Box<object_store::Error>,
    },
    /// A store or snapshot location that is not one (the text says which and why).
    #[error("{0}")]
    Location(String),
    /// A manifest (or state) that does not parse.
    #[error("{store}: {key}: not valid JSON of the expected shape (truncated or not a manifest)")]
    Json {
        /// The store.
        store: String,
        /// The object's key.
        key: String,
        /// Why it does not parse.
        #[source]
        source: serde_json::Error,
    },
    /// A manifest of another format.
    #[error("{store}: {key}: not a guestmem store snapshot (format {found})")]
    Foreign {
        /// The store.
        store: String,
        /// The manifest's key.
        key: String,
        /// The format it names.
        found: String,
    },
    /// A manifest of a version this guestmem does not read (README, "Compatibility").
    #[error(
        "{store}: {key}: store snapshot version {found}, written by {writer}; this guestmem \
         ({}) reads versions {min} to {supported}: restore it with a guestmem release that \
         reads it (the two minor releases after its writer do), or take a new snapshot",
        guestmem_sys::release::LONG_VERSION
    )]
    Version {
        /// The store.
        store: String,
        /// The manifest's key.
        key: String,
        /// Its version.
        found: u64,
        /// The guestmem that wrote it, as its manifest names it.
        writer: String,
        /// The oldest version this build reads.
        min: u32,
        /// The newest version this build reads (the one it writes).
        supported: u32,
    },
    /// A snapshot whose bytes are not what its manifest says (naming the snapshot, region,
    /// chunk and hash).
    #[error("corrupt store snapshot: {0}")]
    Corrupt(String),
    /// A snapshot that cannot be restored here.
    #[error("cannot restore here: {0}")]
    Layout(String),
    /// A snapshot (or a collection) that cannot be written.
    #[error("cannot write the snapshot: {0}")]
    Write(String),
    /// A collection that found a manifest it cannot read, and so removed nothing.
    #[error(
        "{store}: gc removed nothing: the manifest of snapshot '{name}' cannot be read, so its \
         chunks cannot be told from garbage; repair or delete it"
    )]
    GcUnreadableManifest {
        /// The store.
        store: String,
        /// The snapshot whose manifest cannot be read.
        name: String,
        /// Why it cannot be read.
        #[source]
        source: Box<Error>,
    },
    /// The host's chunk cache failed.
    #[error("chunk cache {path}: {op} failed")]
    Cache {
        /// The cache's file or directory.
        path: PathBuf,
        /// The operation.
        op: &'static str,
        /// The operating system's error.
        #[source]
        source: io::Error,
    },
    /// A snapshot operation failed (a store error that went through the restore engine comes
    /// back as itself, see the `From` conversion).
    #[error(transparent)]
    Snapshot(guestmem_snapshot::Error),
    /// The VMM's machine or one of its components failed.
    #[error(transparent)]
    Contract(#[from] guestmem_contract::Error),
    /// The VM failed.
    #[error(transparent)]
    Vm(#[from] guestmem_vm::Error),
    /// Guest memory failed.
    #[error(transparent)]
    Memory(#[from] guestmem_memory::Error),
    /// Demand paging failed.
    #[error(transparent)]
    Paging(#[from] guestmem_paging::Error),
}

impl From<guestmem_snapshot::Error> for Error {
    /// The restore engine carries the store's own errors boxed: they come back as themselves.
    fn from(e: guestmem_snapshot::Error) -> Error {
        match e {
            guestmem_snapshot::Error::Image(inner) => match inner.downcast::<Error>() {
                Ok(store) => *store,
                Err(other) => Error::Snapshot(guestmem_snapshot::Error::Image(other)),
            },
            e => Error::Snapshot(e),
        }
    }
}

impl Error {
    /// Whether the error is an object the store does not hold.
    pub fn is_missing(&self) -> bool {
        matches!(self, Error::Missing { .. })
    }

    /// Whether the store answered nothing for the store timeout.
    pub fn is_stalled(&self) -> bool {
        match self {
            Error::Stalled { .. } => true,
            Error::NeverFetched { source, .. } => source.is_stalled(),
            _ => false,
        }
    }
}

/// [`Error::Stalled`]'s message.
fn stalled_text(
    store: &str,
    key: &str,
    op: &str,
    waited: f64,
    silent: f64,
    timeout: f64,
) -> String {
    let what = if waited == 0.0 {
        format!("{op} {key} not sent: the store has answered nothing for {silent:.1} s")
    } else if silent > waited + 0.5 {
        format!(
            "no answer to {op} {key} for {waited:.1} s (the store has answered nothing for \
             {silent:.1} s)"
        )
    } else {
        format!("no answer to {op} {key} for {waited:.1} s")
    };
    format!(
        "{store}: {what}: the store is stalled or unreachable (the store timeout is \
         {timeout:.1} s: --store-timeout)"
    )
}

/// An error and its causes in one line, each cause once (to sort errors by what they say).
pub(crate) fn chain_text(e: &(dyn std::error::Error + 'static)) -> String {
    guestmem_snapshot::error_chain(e, ": ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store error the restore engine carried boxed comes back as itself (still missing,
    /// with its words); another boxed error stays the snapshot's; the chain names each cause
    /// once.
    #[test]
    fn store_errors_come_back_from_the_restore_engine_as_themselves() {
        let missing = Error::Missing {
            store: "store:/s".into(),
            key: "chunks/ab".into(),
        };
        let boxed = guestmem_snapshot::Error::Image(Box::new(missing));
        let back = Error::from(boxed);
        assert!(back.is_missing(), "{back:?}");
        assert_eq!(back.to_string(), "store:/s: chunks/ab is missing");

        let other = guestmem_snapshot::Error::Image(Box::new(std::io::Error::other("net down")));
        let back = Error::from(other);
        assert!(!back.is_missing());
        assert!(
            matches!(&back, Error::Snapshot(guestmem_snapshot::Error::Image(_))),
            "{back:?}"
        );
        assert_eq!(chain_text(&back), "net down");
        let corrupt = Error::from(guestmem_snapshot::Error::Corrupt("bad".into()));
        assert_eq!(chain_text(&corrupt), "corrupt snapshot: bad");
        assert!(!Error::Location("x".into()).is_missing());
    }
}
