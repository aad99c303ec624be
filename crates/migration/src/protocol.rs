//! Live migration of a running VM to another guestmem: pre-copy, post-copy and hybrid.
//!
//! **Connections** (each mutually authenticated TLS, see [`crate::transport`]): `pages`
//! connections carry the rounds of pages; guest 2 MiB block `b` always travels on connection
//! `b % pages`, so a later copy of a page never overtakes an earlier one. The first pages
//! connection is also the control channel. In post-copy the pages connections carry the
//! destination's background fetches and the `urgent` connections its fault fetches, each
//! connection lock-step (one request in flight), so faults never queue behind bulk transfers.
//!
//! **Sequence**: Hello each way on every connection (the source's offers the protocol versions
//! and features it speaks, the destination's answer chooses among them or is an Abort naming
//! both versions: [`crate::negotiate`]) → on the first, the source's Setup (a Hello frame with
//! the VM configuration) and the destination's Hello once its VM is built → rounds of Pages / Zero frames, each closed by EndOfRound on every
//! pages connection (which the destination sends back once it applied the round, except after
//! the last) → the source pauses the VM, sends the last pages and the State (vCPU state,
//! memory digest, and in post-copy which chunks are still to fetch) → the destination answers
//! Ready (or Abort: digest mismatch, bad state) → Go (the source has let go for good) → Running
//! (the destination's vCPUs run: the downtime ends) → in post-copy, Requests until all memory is
//! resident → Complete (with the destination's figures).
//!
//! **Admission**: the destination takes the connections of one migration at a time. Each
//! connection's handshake and Hello run on their own, so a silent or junk connection is
//! refused alone; the first pages connection of a new migration claims the destination, and
//! the connections of any other migration are answered Abort ("the destination is busy with
//! another migration") until it is over. Every connection's Hello is answered (Hello or Abort).
//!
//! **Bounds**: every wait on the peer is bounded, and its error names the wait and the peer:
//! establishing a connection, and the coming of a migration's other connections after its first,
//! [`transport::HANDSHAKE_TIMEOUT`]; any read or write on an established connection,
//! [`transport::IDLE_TIMEOUT`] (post-copy's quiet connections carry a heartbeat every
//! [`HEARTBEAT_INTERVAL`]); after a broken post-copy link, the destination waits for the source
//! [`RESUME_TIMEOUT`], and `guestmem migrate send` takes a destination whose endpoint refuses
//! every reconnection for [`DEAD_PEER_TIMEOUT`] for dead.
//!
//! **Failure**: before Go the source still owns the guest; any error (destination refused or
//! died, link broken or silent, digest mismatch) resumes the source VM. After Go the destination
//! owns it; a link broken during post-copy leaves both sides waiting, within the bounds above
//! (the destination's vCPUs wait for the pages they fault on), until the source reconnects
//! ([`SendOptions::reconnect`], `guestmem migrate resume`) and the destination accepts it;
//! fetches in flight are retried, so no page is lost. A destination that died leaves the guest's
//! state split: it had the vCPUs and the pages it fetched, the source holds every page not
//! fetched yet and the VM state at switch-over (its paused VM).

use guestmem_sys::to_usize;
use std::time::Duration;

use guestmem_vm::VmConfig;
use serde::{Deserialize, Serialize};

use crate::chunk_digests::RegionDigest;
use crate::component::ComponentState;
use crate::negotiate::{Negotiated, ProtocolRange};
use crate::stream::{Frame, StreamError};
use crate::transport::{self, Connection, Credentials, Endpoint};
use crate::{Error, MigrationError, Peer, Result};

/// How the memory moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// Rounds of dirty pages while the guest runs, until the rest fits the downtime target.
    Precopy,
    /// Switch at once; the destination fetches pages on demand and in the background.
    Postcopy,
    /// One pre-copy round, then post-copy for the pages dirtied since.
    Hybrid,
}

impl Mode {
    /// The mode's name (as the CLI takes it).
    pub fn name(self) -> &'static str {
        match self {
            Mode::Precopy => "precopy",
            Mode::Postcopy => "postcopy",
            Mode::Hybrid => "hybrid",
        }
    }

    pub(crate) fn has_postcopy(self) -> bool {
        self != Mode::Precopy
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Mode, String> {
        [Mode::Precopy, Mode::Postcopy, Mode::Hybrid]
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| format!("unknown migration mode '{s}' (precopy, postcopy or hybrid)"))
    }
}

/// Bytes per post-copy chunk: the unit the State frame's stale bits count in.
pub const POSTCOPY_CHUNK: u64 = 128 << 10;

/// What one post-copy fault (and each background fetch) brings: a piece of a
/// [`POSTCOPY_CHUNK`], stale when its chunk is. Small, because a fault's answer has to cross
/// the link whole before the guest goes on: 128 KiB alone take 1.1 ms at 1 Gbit/s, 32 KiB
/// 0.27 ms (see docs/benchmarks.md).
pub const POSTCOPY_FAULT_BYTES: u64 = 32 << 10;

/// The guest block that always travels on the same pages connection.
pub(crate) const BLOCK: u64 = 2 << 20;

/// The pages connection (of `connections`) that carries the block at `offset` of the region at
/// `region_gpa`: blocks are counted from each region's start.
pub(crate) fn block_connection(region_gpa: u64, offset: u64, connections: usize) -> usize {
    to_usize((region_gpa / BLOCK + offset / BLOCK) % connections as u64)
}

/// Pages connections a migration opens unless told otherwise: on loopback one connection is
/// bound by its receiving thread (decrypt, check, copy into guest memory), and a second one
/// overlaps it (see docs/benchmarks.md, live migration).
pub const DEFAULT_CONNECTIONS: usize = 2;

/// Post-copy: the destination sends a one-page request on each connection of the link that
/// carried nothing for this long, so that a quiet destination (every page resident, or a guest
/// that faults rarely) is told from a dead one by the source's idle timeout
/// ([`crate::transport::IDLE_TIMEOUT`], several of these intervals).
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(2);

/// Post-copy, after the link broke: how long the source tries to reconnect to the destination's
/// endpoint while nothing listens there (connection refused, no such socket, or a new
/// destination that knows nothing of the migration) before it takes the destination for dead,
/// says so and gives up. A destination that is alive keeps listening, and a reconnection to it
/// goes on with the migration. A destination that listens but never completes a reconnection
/// (stuck, or cut off) is given up after twice this.
pub const DEAD_PEER_TIMEOUT: Duration = Duration::from_secs(15);

/// Urgent connections opened for post-copy (one fault fetch in flight on each).
pub(crate) const URGENT_CONNECTIONS: usize = 2;

/// What each connection's first frame says (JSON in a Hello). Format: a change bumps
/// [`crate::negotiate::PROTOCOL`] (fields may only be added, with a default: guestmem 0.1.0
/// reads this and ignores what it does not know).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Hello {
    pub guestmem_version: String,
    /// The source's build (version and commit); absent from guestmem 0.1.0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guestmem: Option<String>,
    /// The protocol versions the source speaks; absent from guestmem 0.1.0 (protocol 1 only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocols: Option<ProtocolRange>,
    /// The features the source may use ([`crate::negotiate::FEATURES`]); absent from
    /// guestmem 0.1.0 (all of protocol 1's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub features: Option<Vec<String>>,
    /// Names one migration; every connection of it (and of its resumption) carries it.
    pub migration: u64,
    pub channel: ChannelRole,
    /// How many pages and urgent connections the migration has.
    pub pages: usize,
    pub urgent: usize,
    /// Set on the connections of a post-copy resumed after a broken link.
    pub resume: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum ChannelRole {
    Pages(usize),
    Urgent(usize),
}

/// What to build: the second frame on the first pages connection (a Hello frame). Format: a
/// change bumps [`crate::negotiate::PROTOCOL`] (guestmem 0.1.0 reads it: fields may only be
/// added, with a default, and only sent when negotiated).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Setup {
    pub config: VmConfig,
    pub mode: Mode,
    /// The State frame's format, the negotiated protocol's
    /// ([`crate::negotiate::state_format`]; guestmem 0.1.0 requires 2); a destination refuses
    /// another.
    #[serde(default)]
    pub format: u32,
    /// Regions whose backing files the source hands over (local migration): the destination
    /// maps the same memory, so their pages never travel. When not empty, the destination
    /// answers Ready, the fds follow outside TLS (in this order), then its Hello.
    #[serde(default)]
    pub shared: Vec<String>,
    /// Pre-copy with a digest check at switch-over (the State brings the source's digest to
    /// compare with).
    #[serde(default)]
    pub verify: bool,
    /// With `verify`: the chunk size of the digests both sides keep as the rounds land
    /// ([`crate::chunk_digests`]), so that only the chunks written since are hashed at
    /// switch-over. `None` (a source that predates chunk digests): the destination digests all
    /// of its memory with [`memory_digest`] once the last round is in.
    ///
    /// [`memory_digest`]: crate::source::memory_digest
    #[serde(default)]
    pub verify_chunk: Option<u64>,
    /// The pre-copy pages connections compress with a zstd stream each
    /// ([`crate::stream::ZstdStream`]) of a window of `2^zstd_window_log` bytes: the
    /// destination keeps a decoder per connection, bounded to it. `None`: frames are
    /// compressed one by one (a stream frame is then an error).
    #[serde(default)]
    pub zstd_window_log: Option<u32>,
}

/// The format of the switch-over's State this build writes at best: 3 since the machine's
/// state travels in its versioned envelope (protocol 2); 2 (protocol 1, guestmem 0.1.0): the
/// machine's state and the components' as opaque blobs, the machine's bare; 1, unnamed,
/// carried the payload VM's state as JSON. The negotiated protocol says which one a migration
/// uses ([`crate::negotiate::state_format`]).
pub const FORMAT: u32 = crate::negotiate::state_format(crate::negotiate::PROTOCOL);

/// The State frame's JSON: everything the destination needs at switch-over. Format: a change
/// bumps [`crate::negotiate::PROTOCOL`] (and [`FORMAT`] with it).
#[derive(Serialize, Deserialize)]
pub(crate) struct Switchover {
    /// The machine's state ([`crate::component::Machine::save`]), hex in JSON.
    #[serde(with = "crate::component::hex_bytes")]
    pub state: Vec<u8>,
    /// The components' states.
    pub components: Vec<ComponentState>,
    /// The round whose EndOfRound closed the pages (the destination waits for it everywhere).
    pub last_round: u32,
    /// Digest of guest memory at switch-over (pre-copy, when asked to verify): the regions'
    /// chunk digests combined ([`crate::chunk_digests::combine`]) when the setup named a
    /// `verify_chunk`, else the FNV digest of all of it.
    pub digest: Option<u64>,
    /// The regions' digests that `digest` combines (chunk digests): the destination names the
    /// regions that differ.
    #[serde(default)]
    pub region_digests: Option<Vec<RegionDigest>>,
    /// Post-copy: per region (by guest address), the chunks of [`POSTCOPY_CHUNK`] bytes still
    /// to fetch, one bit each; `None` for all of them.
    pub postcopy: Option<Vec<StaleChunks>>,
}

/// Post-copy's stale chunks of one region. Format: a change bumps
/// [`crate::negotiate::PROTOCOL`].
#[derive(Serialize, Deserialize)]
pub(crate) struct StaleChunks {
    pub gpa: u64,
    pub bits: Option<Vec<u64>>,
}

/// The connections of one migration, seen from either side.
#[derive(Debug)]
pub struct Links {
    pub(crate) pages: Vec<Connection>,
    pub(crate) urgent: Vec<Connection>,
    pub(crate) migration: u64,
    pub(crate) mode: Mode,
    /// What the two sides agreed on in the Hellos.
    pub(crate) negotiated: Negotiated,
}

/// Why and how to re-establish a broken post-copy link (given to [`SendOptions::reconnect`]).
#[derive(Debug, Clone)]
pub struct Resume {
    /// Why the link broke.
    pub reason: String,
    migration: u64,
    mode: Mode,
    connections: usize,
}

impl Resume {
    /// Connects again to the destination (at `endpoint`: the same one, or where it is reachable
    /// now), as the same migration.
    pub fn connect(&self, endpoint: &Endpoint, creds: &Credentials) -> Result<Links> {
        Links::open(
            endpoint,
            creds,
            self.migration,
            self.mode,
            self.connections,
            true,
        )
    }
}

impl Links {
    /// What the two sides agreed on (protocol version, features, the peer's guestmem).
    pub fn negotiated(&self) -> &Negotiated {
        &self.negotiated
    }

    /// How many of the connections have their TLS records encrypted and decrypted by the
    /// kernel (kernel TLS, where it has it), not by rustls.
    pub fn kernel_tls_connections(&self) -> usize {
        self.pages
            .iter()
            .chain(&self.urgent)
            .filter(|c| c.kernel_tls())
            .count()
    }

    /// How many connections the migration has (pages and urgent ones).
    pub fn connection_count(&self) -> usize {
        self.pages.len() + self.urgent.len()
    }

    /// Connects to the destination at `endpoint`: `connections` pages connections, plus the
    /// urgent ones post-copy needs. Each says Hello as soon as it is up.
    pub fn connect(
        endpoint: &Endpoint,
        creds: &Credentials,
        mode: Mode,
        connections: usize,
    ) -> Result<Links> {
        Links::open(
            endpoint,
            creds,
            new_migration_id(),
            mode,
            connections,
            false,
        )
    }

    /// [`Links::connect`] with other bounds for the connections' waits.
    pub fn connect_with(
        endpoint: &Endpoint,
        creds: &Credentials,
        mode: Mode,
        connections: usize,
        timeouts: transport::Timeouts,
    ) -> Result<Links> {
        Links::open_with(
            endpoint,
            creds,
            new_migration_id(),
            mode,
            connections,
            false,
            timeouts,
        )
    }

    fn open(
        endpoint: &Endpoint,
        creds: &Credentials,
        migration: u64,
        mode: Mode,
        connections: usize,
        resume: bool,
    ) -> Result<Links> {
        let timeouts = transport::Timeouts::default();
        Links::open_with(
            endpoint,
            creds,
            migration,
            mode,
            connections,
            resume,
            timeouts,
        )
    }

    fn open_with(
        endpoint: &Endpoint,
        creds: &Credentials,
        migration: u64,
        mode: Mode,
        connections: usize,
        resume: bool,
        timeouts: transport::Timeouts,
    ) -> Result<Links> {
        if connections == 0 || connections > 64 {
            return Err(MigrationError::BadOption {
                option: "connections",
                reason: format!("{connections} connections requested; 1 to 64 are possible"),
            }
            .into());
        }
        let urgent = if mode.has_postcopy() {
            URGENT_CONNECTIONS
        } else {
            0
        };
        let open = |channel| -> Result<(Connection, Negotiated)> {
            let mut conn = transport::connect_with(endpoint, creds, timeouts)?;
            let hello = Hello {
                guestmem_version: env!("CARGO_PKG_VERSION").into(),
                guestmem: Some(guestmem_sys::release::LONG_VERSION.into()),
                protocols: Some(ProtocolRange {
                    min: crate::negotiate::MIN_PROTOCOL,
                    max: crate::negotiate::PROTOCOL,
                }),
                features: Some(
                    crate::negotiate::FEATURES
                        .iter()
                        .map(|f| (*f).to_string())
                        .collect(),
                ),
                migration,
                channel,
                pages: connections,
                urgent,
                resume,
            };
            let json = serde_json::to_vec(&hello).expect("a Hello serializes");
            write_frame(&mut conn, &Frame::Hello { config_json: json })?;
            // The destination answers each connection: Hello (taken, with its choice of
            // protocol and features) or Abort (why not).
            let refused = |reason| MigrationError::Refused {
                endpoint: endpoint.to_string(),
                reason,
            };
            match read_frame(&mut conn)? {
                Frame::Hello { config_json } => {
                    tracing::debug!(
                        answer = %String::from_utf8_lossy(&config_json),
                        "the destination's answer to a Hello"
                    );
                    let negotiated = crate::negotiate::accept(&config_json).map_err(|reason| {
                        MigrationError::Incompatible {
                            endpoint: endpoint.to_string(),
                            reason,
                        }
                    })?;
                    Ok((conn, negotiated))
                }
                Frame::Abort { reason } => Err(refused(reason).into()),
                other => Err(MigrationError::UnexpectedFrame {
                    peer: Peer::Destination,
                    expected: "Hello",
                    got: frame_name(&other),
                }
                .into()),
            }
        };
        let (pages, answers): (Vec<Connection>, Vec<Negotiated>) = (0..connections)
            .map(|i| open(ChannelRole::Pages(i)))
            .collect::<Result<Vec<_>>>()?
            .into_iter()
            .unzip();
        let urgent = (0..urgent)
            .map(|i| open(ChannelRole::Urgent(i)).map(|(c, _)| c))
            .collect::<Result<_>>()?;
        let negotiated = answers.into_iter().next().expect("at least one connection");
        tracing::info!(
            protocol = negotiated.protocol,
            peer = %negotiated.peer,
            features = %negotiated.features.join(","),
            "migration negotiated"
        );
        Ok(Links {
            pages,
            urgent,
            migration,
            mode,
            negotiated,
        })
    }

    /// Cutters for every connection (a test or a watchdog cuts the link with them).
    pub fn cutters(&self) -> Result<Vec<transport::Cutter>> {
        self.pages
            .iter()
            .chain(&self.urgent)
            .map(|c| c.cutter().map_err(|e| link_error("dup of a socket", e)))
            .collect()
    }

    /// What a broken link's re-establishment needs.
    pub(crate) fn resume(&self, reason: String) -> Resume {
        Resume {
            reason,
            migration: self.migration,
            mode: self.mode,
            connections: self.pages.len(),
        }
    }
}

pub(crate) fn read_hello(conn: &mut Connection) -> Result<Hello> {
    read_json(conn, "Hello")
}

/// Reads a Hello frame of the source carrying `what` as JSON.
pub(crate) fn read_json<T: serde::de::DeserializeOwned>(
    conn: &mut Connection,
    what: &'static str,
) -> Result<T> {
    let peer = Peer::Source;
    match read_frame(conn)? {
        Frame::Hello { config_json } => {
            tracing::debug!(json = %String::from_utf8_lossy(&config_json), "the source's {what}");
            serde_json::from_slice(&config_json)
                .map_err(|source| MigrationError::BadMessage { peer, what, source }.into())
        }
        Frame::Abort { reason } => Err(MigrationError::PeerGaveUp { peer, reason }.into()),
        other => Err(MigrationError::UnexpectedFrame {
            peer,
            expected: what,
            got: frame_name(&other),
        }
        .into()),
    }
}

pub(crate) fn write_frame(conn: &mut impl std::io::Write, frame: &Frame) -> Result<()> {
    frame
        .write_to(conn)
        .and_then(|()| conn.flush().map_err(StreamError::from))
        .map_err(Error::Stream)
}

pub(crate) fn read_frame(conn: &mut impl std::io::Read) -> Result<Frame> {
    Frame::read_from(conn).map_err(Error::Stream)
}

pub(crate) fn frame_name(frame: &Frame) -> &'static str {
    match frame {
        Frame::Hello { .. } => "Hello",
        Frame::Pages { .. } => "Pages",
        Frame::Zero { .. } => "Zero",
        Frame::State { .. } => "State",
        Frame::Request { .. } => "Request",
        Frame::EndOfRound { .. } => "EndOfRound",
        Frame::Complete { .. } => "Complete",
        Frame::Abort { .. } => "Abort",
        Frame::Ready => "Ready",
        Frame::Go => "Go",
        Frame::Running => "Running",
        Frame::Delta { .. } => "PagesD",
    }
}

/// What `peer` sent instead of `wanted`: its Abort's reason, or the frame that came.
pub(crate) fn unexpected_frame(peer: Peer, frame: &Frame, wanted: &'static str) -> Error {
    match frame {
        Frame::Abort { reason } => MigrationError::PeerGaveUp {
            peer,
            reason: reason.clone(),
        }
        .into(),
        other => MigrationError::UnexpectedFrame {
            peer,
            expected: wanted,
            got: frame_name(other),
        }
        .into(),
    }
}

pub(crate) fn link_error(what: &str, source: std::io::Error) -> Error {
    MigrationError::Link {
        what: what.into(),
        source,
    }
    .into()
}

/// A random migration id.
pub(crate) fn new_migration_id() -> u64 {
    let mut id = [0u8; 8];
    // SAFETY: getrandom writes at most 8 bytes into the 8-byte buffer.
    let n = unsafe { libc::getrandom(id.as_mut_ptr().cast(), 8, 0) };
    if n != 8 {
        return std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    }
    u64::from_le_bytes(id)
}

/// Percentile `p` (0..=100) of `sorted` latencies.
#[allow(clippy::cast_possible_truncation)] // a percentile index: a float to integer cast saturates.
pub(crate) fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() - 1) as f64 * p / 100.0).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// `sorted` latencies as a histogram: `(bound, count)` per power-of-two bucket of whole µs
/// (a latency of `l` µs counts in the bucket of the smallest power of two `>= l`), buckets in
/// order, empty ones left out.
pub(crate) fn latency_buckets(sorted: &[Duration]) -> Vec<(u64, u64)> {
    let mut buckets: Vec<(u64, u64)> = Vec::new();
    for d in sorted {
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        let bound = us.max(1).checked_next_power_of_two().unwrap_or(u64::MAX);
        match buckets.last_mut() {
            Some((b, n)) if *b == bound => *n += 1,
            _ => buckets.push((bound, 1)),
        }
    }
    buckets
}

#[cfg(test)]
mod tests {
    use super::Mode;

    #[test]
    fn modes_parse_by_their_names() {
        for m in [Mode::Precopy, Mode::Postcopy, Mode::Hybrid] {
            assert_eq!(m.name().parse::<Mode>(), Ok(m));
        }
        let e = "lazy".parse::<Mode>().unwrap_err();
        assert!(e.contains("'lazy'") && e.contains("hybrid"), "{e}");
    }

    #[test]
    fn latencies_fall_in_power_of_two_buckets() {
        let us = |v: &[u64]| -> Vec<std::time::Duration> {
            v.iter()
                .map(|&u| std::time::Duration::from_micros(u))
                .collect()
        };
        assert_eq!(
            super::latency_buckets(&us(&[0, 1, 3, 4, 5, 100, 128, 129])),
            [(1, 2), (4, 2), (8, 1), (128, 2), (256, 1)]
        );
        assert!(super::latency_buckets(&[]).is_empty());
    }
}
