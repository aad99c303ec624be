use std::io;

use guestmem_memory::Backend;

pub type Result<T> = std::result::Result<T, Error>;

/// What can go wrong while demand paging a region. Every variant names the region.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "region '{region}': demand paging of the {backend} backend is not supported: {reason}"
    )]
    Unsupported {
        region: String,
        backend: Backend,
        reason: String,
    },
    #[error("region '{region}': invalid pager configuration: {reason}")]
    Config { region: String, reason: String },
    #[error("region '{region}': {op} failed: {source:?}")]
    Uffd {
        region: String,
        op: &'static str,
        #[source]
        source: userfaultfd::Error,
    },
    #[error("region '{region}': {op} failed: {source}")]
    Os {
        region: String,
        op: &'static str,
        #[source]
        source: io::Error,
    },
    /// A peer's range that the peer let go of (see `PeerReleased`): not a failure, serving
    /// it just ends.
    #[error("region '{region}': the peer no longer maps it (unmapped, or its process is exiting)")]
    Released { region: String },
    #[error("region '{region}': the pager stopped: {reason}")]
    Stopped { region: String, reason: String },
    #[error("region '{region}': the page source failed to provide guest address {gpa:#x} (+{len:#x}) after {attempts} attempts: {source}")]
    SourceFailed {
        region: String,
        gpa: u64,
        len: u64,
        attempts: u32,
        #[source]
        source: io::Error,
    },
}
