//! Why a live migration failed, as variants a caller can match on ([`MigrationError`], inside
//! [`crate::Error::Migration`]). Each message stands alone; a cause that is an error of its own
//! is its `source()`, never repeated in the message.

use std::fmt;

/// One side of a migration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    /// The side that had the guest.
    Source,
    /// The side that takes it.
    Destination,
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Peer::Source => "source",
            Peer::Destination => "destination",
        })
    }
}

/// Why a live migration failed.
#[derive(Debug, thiserror::Error)]
pub enum MigrationError {
    /// An option with which the migration could never work, refused before anything starts.
    #[error("{reason}")]
    BadOption {
        /// The option's name.
        option: &'static str,
        /// What is wrong with it, naming it.
        reason: String,
    },
    /// The destination refused a connection of the migration (busy with another one, a
    /// certificate of the wrong role, …) and said why.
    #[error("the destination at {endpoint} refused the migration: {reason}")]
    Refused {
        /// Where the destination listens.
        endpoint: String,
        /// The reason it gave.
        reason: String,
    },
    /// The destination's answer to the Hello chose what this source does not speak (a protocol
    /// outside its window, a feature it never offered): refused before any page moves.
    #[error("the destination at {endpoint} cannot be migrated to: {reason}")]
    Incompatible {
        /// Where the destination listens.
        endpoint: String,
        /// Why, naming both guestmems.
        reason: String,
    },
    /// The peer gave up (its Abort) and said why; a source that gives up keeps the guest.
    #[error("the {peer} gave up: {reason}")]
    PeerGaveUp {
        /// Which side gave up.
        peer: Peer,
        /// The reason it gave.
        reason: String,
    },
    /// The peer sent a frame the protocol does not allow here.
    #[error("expected {expected} from the {peer}, got {got}")]
    UnexpectedFrame {
        /// Which side sent it.
        peer: Peer,
        /// What the protocol expects.
        expected: &'static str,
        /// The frame that came.
        got: &'static str,
    },
    /// A message of the peer (JSON in a Hello or State frame) is not understood.
    #[error("the {peer}'s {what} is not understood")]
    BadMessage {
        /// Which side sent it.
        peer: Peer,
        /// What it is.
        what: &'static str,
        /// Why it does not parse.
        #[source]
        source: serde_json::Error,
    },
    /// The source's switch-over state is not of the format the negotiated protocol gives.
    #[error(
        "the source's switch-over state is of format {found}; the protocol negotiated in the \
         Hellos gives format {supported}"
    )]
    Format {
        /// The source's format.
        found: u32,
        /// The destination's.
        supported: u32,
    },
    /// The destination cannot take this VM, and says why (told to the source too, which keeps
    /// the guest).
    #[error("the destination cannot take this VM: {reason}")]
    Unsupported {
        /// Why.
        reason: String,
    },
    /// The destination's memory at switch-over is not the source's (pre-copy with `verify`).
    #[error(
        "the destination's memory digest {found:#018x} differs from the source's \
         {expected:#018x}{regions}"
    )]
    DigestMismatch {
        /// The destination's digest.
        found: u64,
        /// The source's.
        expected: u64,
        /// The regions that differ, when the digests say (", regions …"), else empty.
        regions: String,
    },
    /// Landing received pages in fresh memory with userfaultfd failed (see `landing`).
    #[error("landing pages: {op}")]
    Landing {
        /// The operation, and where.
        op: String,
        /// Why.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Receiving the source's pages failed (the connection that failed first says why).
    #[error("receiving pages")]
    Receiving {
        /// Why.
        #[source]
        source: Box<crate::Error>,
    },
    /// The link broke before the source let go: the source keeps the guest.
    #[error("the link broke before the source let go; the source keeps the VM")]
    BrokeBeforeGo {
        /// How it broke.
        #[source]
        source: Box<crate::Error>,
    },
    /// Post-copy: the link broke and this source cannot reconnect; the guest's state is split.
    #[error(
        "the post-copy link broke ({why}) and this source cannot reconnect (no \
         SendOptions::reconnect): the guest's state is split between the destination, which had \
         its vCPUs and the pages it fetched (and waits for the others, if it is alive), and \
         this source, which holds every page not fetched and the VM state at the switch-over"
    )]
    PostcopySplit {
        /// Why the link broke.
        why: String,
    },
    /// Post-copy: the destination is taken for dead (nothing listens where it was, or no
    /// reconnection succeeds), with what the caller knows of it.
    #[error("{reason}")]
    Dead {
        /// Why it is taken for dead, and what became of the guest's state.
        reason: String,
    },
    /// Post-copy: every page arrived, but the source never came back to be told.
    #[error("every page is here, but the source never came back to hear it")]
    SourceGone {
        /// The last failure to reach it.
        #[source]
        source: std::io::Error,
    },
    /// Post-copy: the source reconnected with another number of connections.
    #[error("the source came back with {pages} + {urgent} connections, not {expected} in all")]
    Reconnection {
        /// Pages connections.
        pages: usize,
        /// Urgent connections.
        urgent: usize,
        /// What the migration has.
        expected: usize,
    },
    /// Post-copy: the source answered a request with something else than its pages.
    #[error("asked for {gpa:#x}+{len:#x}, the source answered {got}")]
    BadAnswer {
        /// The guest address asked for.
        gpa: u64,
        /// Its bytes.
        len: u64,
        /// What came.
        got: &'static str,
    },
    /// [`crate::migrate::Transfer::resume`] was called twice.
    #[error("this transfer was already resumed")]
    AlreadyResumed,
    /// An operation on a link (a socket, its file descriptors) failed.
    #[error("{what}")]
    Link {
        /// What was being done.
        what: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// One of the migration's own threads failed or could not start.
    #[error("{what}")]
    Thread {
        /// Which, and how.
        what: String,
    },
    /// The connections of a migration did not come as its first one announced (missing, twice,
    /// or outside the count); the source is told.
    #[error("{reason}")]
    Connections {
        /// What was wrong.
        reason: String,
    },
    /// The memory digests were asked for while chunks were still stale (a bug).
    #[error("memory digests: chunks still stale")]
    StaleDigests,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error_chain;

    #[test]
    fn causes_are_sources_and_the_peer_hears_them_once() {
        let io = std::io::Error::other("connection reset");
        let e = crate::Error::from(MigrationError::Receiving {
            source: Box::new(crate::Error::from(MigrationError::Link {
                what: "reading pages connection 1".into(),
                source: io,
            })),
        });
        assert_eq!(e.to_string(), "receiving pages");
        assert_eq!(
            error_chain(&e, ": "),
            "receiving pages: reading pages connection 1: connection reset"
        );
        assert!(matches!(
            e,
            crate::Error::Migration(MigrationError::Receiving { .. })
        ));
    }

    #[test]
    fn file_and_transport_errors_keep_their_cause_as_the_source_only() {
        let io = || std::io::Error::other("the disk is on fire");
        let e = crate::Error::from(guestmem_sys::FileError::at(
            std::path::Path::new("/snap/manifest.json"),
            "read",
        )(io()));
        assert_eq!(e.to_string(), "/snap/manifest.json: read failed");
        assert_eq!(
            error_chain(&e, ": "),
            "/snap/manifest.json: read failed: the disk is on fire"
        );
        let e = crate::Error::from(crate::transport::TransportError::Unreachable {
            endpoint: "tcp:127.0.0.1:1".into(),
            error: io(),
        });
        assert_eq!(
            e.to_string(),
            "connect to tcp:127.0.0.1:1: nothing listens there"
        );
        assert!(e.is_unreachable());
        assert_eq!(error_chain(&e, ": ").matches("on fire").count(), 1);
        let e = crate::Error::from(crate::stream::StreamError::Io(io()));
        assert_eq!(
            error_chain(&e, ": "),
            "I/O on the migration stream: the disk is on fire"
        );
    }
}
