//! Why the page-server protocol or serving failed.

use std::io;
use std::path::Path;

/// What page-server operations return.
pub type Result<T> = std::result::Result<T, Error>;

/// Why a page server, or the VMM side of its handshake, failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file operation failed.
    #[error(transparent)]
    File(#[from] guestmem_sys::FileError),
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
    /// Demand paging failed.
    #[error(transparent)]
    Paging(#[from] guestmem_paging::Error),
}

impl Error {
    /// A file operation's error, naming the file and the operation.
    pub fn io(path: &Path, op: &'static str) -> impl FnOnce(io::Error) -> Error {
        let at = guestmem_sys::FileError::at(path, op);
        move |source| Error::File(at(source))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file's error names the file and the operation; a killed peer names its pid and keeps
    /// why it was killed as the source.
    #[test]
    fn errors_name_the_file_and_the_peer() {
        let e = Error::io(Path::new("/run/uffd.sock"), "bind")(io::Error::other("in use"));
        assert_eq!(
            guestmem_sys::error_chain(&e, ": "),
            "/run/uffd.sock: bind failed: in use"
        );
        let killed = Error::PeerKilled {
            pid: 42,
            source: Box::new(Error::Protocol("short handshake".into())),
        };
        assert_eq!(
            guestmem_sys::error_chain(&killed, ": "),
            "page-server: peer pid 42 killed: page-server protocol: short handshake"
        );
    }
}
