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
    #[error("region '{region}': {op} failed")]
    Uffd {
        /// The region.
        region: String,
        /// The operation.
        op: &'static str,
        /// The userfaultfd crate's error.
        #[source]
        source: UffdError,
    },
    /// A system call failed.
    #[error("region '{region}': {op} failed")]
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
    /// Write-protect of guest memory (see `crate::write_protect`) cannot work here, or its
    /// handler failed, saying why.
    #[error("regions {regions}: write-protect: {reason}")]
    WriteProtect {
        /// The regions.
        regions: String,
        /// Why.
        reason: String,
    },
    /// The pager stopped (a thread of it failed), saying why.
    #[error("region '{region}': the pager stopped: {reason}")]
    Stopped {
        /// The region.
        region: String,
        /// Why.
        reason: String,
    },
    /// A shared image of a snapshot's memory (see [`crate::SharedImage`]) cannot be used.
    #[error("region '{region}': shared memory {}: {reason}", path.display())]
    Share {
        /// The region.
        region: String,
        /// The file or directory.
        path: std::path::PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A system call on a shared image failed.
    #[error("region '{region}': shared memory {}: {op} failed", path.display())]
    ShareIo {
        /// The region.
        region: String,
        /// The file or directory.
        path: std::path::PathBuf,
        /// The call.
        op: &'static str,
        /// The kernel's error.
        #[source]
        source: io::Error,
    },
    /// The page source could not provide a range, retries included.
    #[error("region '{region}': the page source failed to provide guest address {gpa:#x} (+{len:#x}) after {attempts} attempts")]
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

/// A userfaultfd crate error, displayed with the errno that the crate's own text leaves out
/// ("Copy failed" becomes "copy failed: EEXIST: File exists").
#[derive(Debug)]
pub struct UffdError(pub userfaultfd::Error);

impl std::fmt::Display for UffdError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            userfaultfd::Error::CopyFailed(e) => write!(f, "copy failed: {e}"),
            userfaultfd::Error::ZeropageFailed(e) => write!(f, "zeropage failed: {e}"),
            userfaultfd::Error::SystemError(e) => write!(f, "{e}"),
            userfaultfd::Error::OpenDevUserfaultfd(e) => {
                write!(f, "cannot open /dev/userfaultfd: {e}")
            }
            e => write!(f, "{e}"),
        }
    }
}

// The errno is in the text: no source (it would print it twice).
impl std::error::Error for UffdError {}

impl From<userfaultfd::Error> for UffdError {
    fn from(e: userfaultfd::Error) -> Self {
        UffdError(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_userfaultfd_error_is_the_source_and_says_its_cause_once() {
        let os = io::Error::from_raw_os_error(libc::EACCES);
        let os_text = os.to_string();
        let e = Error::Uffd {
            region: "ram".into(),
            op: "userfaultfd",
            source: UffdError(userfaultfd::Error::OpenDevUserfaultfd(os)),
        };
        assert_eq!(e.to_string(), "region 'ram': userfaultfd failed");
        let source = std::error::Error::source(&e).expect("a source");
        assert_eq!(
            source.to_string(),
            format!("cannot open /dev/userfaultfd: {os_text}")
        );
        assert!(source.source().is_none());
    }
}
