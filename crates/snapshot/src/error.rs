//! Why a snapshot could not be written or restored.

use std::io;
use std::path::{Path, PathBuf};

/// What snapshot operations return.
pub type Result<T> = std::result::Result<T, Error>;

/// Why a snapshot or restore failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file operation failed.
    #[error(transparent)]
    File(#[from] guestmem_sys::FileError),
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
    /// A snapshot of a version this guestmem does not read (README, "Compatibility").
    #[error(
        "{path}: snapshot format version {found}, written by {writer}; this guestmem ({}) reads \
         versions {min} to {supported}: restore it with a guestmem release that reads it (the \
         two minor releases after its writer do), or take a new snapshot",
        guestmem_sys::release::LONG_VERSION
    )]
    Version {
        /// The file.
        path: PathBuf,
        /// Its version.
        found: u64,
        /// The guestmem that wrote it, as its manifest names it.
        writer: String,
        /// The oldest version this build reads.
        min: u32,
        /// The newest version this build reads (the one it writes).
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
    /// A finished clone's VM that a restore service would not take back into its pool (it
    /// was torn down instead): what made it unfit to be reused.
    #[error("the clone's VM was not recycled (torn down instead): {0}")]
    NotRecycled(String),
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
    /// The VMM's machine or one of its components failed.
    #[error(transparent)]
    Contract(#[from] guestmem_contract::Error),
    /// The page server's handshake failed.
    #[error(transparent)]
    PageServer(#[from] guestmem_pageserver::Error),
    /// Another format's image (a chunk store's snapshot) failed, for its own reason.
    #[error(transparent)]
    Image(Box<dyn std::error::Error + Send + Sync>),
}

impl Error {
    /// A file operation's error, naming the file and the operation.
    pub fn io(path: &Path, op: &'static str) -> impl FnOnce(io::Error) -> Error {
        let at = guestmem_sys::FileError::at(path, op);
        move |source| Error::File(at(source))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A file of the wrong length says whether it was cut short or grew; a file operation's
    /// error names the file and the operation, its cause kept as the source.
    #[test]
    fn errors_say_what_happened_to_the_file() {
        let e = |found, expected| {
            Error::WrongLength {
                path: "/s/memory".into(),
                found,
                expected,
            }
            .to_string()
        };
        assert_eq!(
            e(10, 20),
            "/s/memory: 10 bytes, the manifest says 20: truncated"
        );
        assert_eq!(
            e(30, 20),
            "/s/memory: 30 bytes, the manifest says 20: longer than written (bytes appended, \
             or another file in its place)"
        );
        let io = Error::io(Path::new("/s/state.json"), "read")(io::Error::other("gone"));
        assert_eq!(
            guestmem_sys::error_chain(&io, ": "),
            "/s/state.json: read failed: gone"
        );
    }
}
