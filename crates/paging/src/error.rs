use std::io;

use guestmem_memory::Backend;

/// What paging returns.
pub type Result<T> = std::result::Result<T, Error>;

/// What can go wrong while demand paging a region. Every variant names the region.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "region '{region}': demand paging of the {backend} backend is not supported: {reason}"
    )]
    /// The backend cannot be demand paged here.
    Unsupported {
        /// The region.
        region: String,
        /// Its backend.
        backend: Backend,
        /// What is missing.
        reason: String,
    },
    /// The pager's configuration cannot work.
    #[error("region '{region}': invalid pager configuration: {reason}")]
    Config {
        /// The region.
        region: String,
        /// What is wrong.
        reason: String,
    },
    /// A userfaultfd operation failed.
    #[error("region '{region}': {op} failed: {source:?}")]
    Uffd {
        /// The region.
        region: String,
        /// The operation.
        op: &'static str,
        /// The userfaultfd crate's error.
        #[source]
        source: userfaultfd::Error,
    },
    /// A system call failed.
    #[error("region '{region}': {op} failed: {source}")]
    Os {
        /// The region.
        region: String,
        /// The call.
        op: &'static str,
        /// The kernel's error.
        #[source]
        source: io::Error,
    },
    /// A peer's range that the peer let go of (see `PeerReleased`): not a failure, serving
    /// it just ends.
    #[error("region '{region}': the peer no longer maps it (unmapped, or its process is exiting)")]
    Released {
        /// The region.
        region: String,
    },
    /// The pager stopped (a thread of it failed), saying why.
    #[error("region '{region}': the pager stopped: {reason}")]
    Stopped {
        /// The region.
        region: String,
        /// Why.
        reason: String,
    },
    /// The page source could not provide a range, retries included.
    #[error("region '{region}': the page source failed to provide guest address {gpa:#x} (+{len:#x}) after {attempts} attempts: {source}")]
    SourceFailed {
        /// The region.
        region: String,
        /// The guest address of the range.
        gpa: u64,
        /// Its bytes.
        len: u64,
        /// How many times it was tried.
        attempts: u32,
        /// The source's last error.
        #[source]
        source: io::Error,
    },
}
