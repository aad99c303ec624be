//! Firecracker's userfaultfd page-server protocol (see `docs/firecracker-uffd.md`), both sides:
//!
//! - the page server ([`serve_connection`]): accepts a VMM's connection, receives one message (a
//!   JSON array of [`GuestRegionUffdMapping`] with the userfaultfd attached as `SCM_RIGHTS`),
//!   holds the peer process by a pidfd ([`PeerProcess`]) and serves its faults with the
//!   demand-paging engine ([`PeerPager`]), from a Firecracker memory file (unchecked: such files
//!   carry no checksums) or from any set of RAM regions with their page sources (a snapshot's,
//!   each chunk checked before any of it is served), see [`ServedMemory`];
//! - the VMM ([`hand_memory_to_server`]): registers a VM's RAM on a fresh userfaultfd and hands
//!   it to a page server in the form Firecracker's own handlers accept (RAM regions back to
//!   back from memory-file offset 0; the page size in bytes as both `page_size` and
//!   `page_size_kib`).
//!
//! It knows no snapshot format: the snapshot crates describe their RAM as [`ServedRegion`]s.
//!
//! If serving fails for good after the handshake (a malformed message, a fd that is not a
//! userfaultfd, a mapping outside the memory, a chunk whose checksum is wrong, a fetch that
//! keeps failing), the server kills the peer (when [`PageServerConfig::kill_peer_on_failure`]
//! is set, the default) rather than leave its vCPUs blocked forever on faults nobody will serve.

use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use guestmem_memory::GuestMemory;
use guestmem_paging::{
    register_for_peer, FileSource, OnFailure, PageSource, PagerConfig, PagerStats, PeerPager,
    PeerRange, PeerReleased, WindowSource,
};
use guestmem_vm::layout;
use serde::{Deserialize, Serialize};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

pub use error::{Error, Result};
pub use guestmem_sys::error_chain;

mod error;
mod progress;

/// Largest handshake message accepted (a VMM has a handful of regions).
const MAX_MESSAGE: usize = 1 << 20;

/// One guest memory region as Firecracker describes it to its page server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GuestRegionUffdMapping {
    /// The region's start in the VMM's address space.
    pub base_host_virt_addr: u64,
    /// The region's size in bytes.
    pub size: u64,
    /// Where the region's bytes start in the memory file.
    pub offset: u64,
    /// The region's page size in bytes (see [`parse_mappings`] for how the message's fields
    /// are read).
    pub page_size: u64,
}

/// The page sizes a mapping may have, in bytes: 4 KiB pages, 2 MiB and 1 GiB huge pages.
pub const PAGE_SIZES: [u64; 3] = [4096, 2 << 20, 1 << 30];

/// What the handshake message holds per mapping, as received (every Firecracker release).
#[derive(Deserialize)]
struct WireMapping {
    base_host_virt_addr: u64,
    size: u64,
    offset: u64,
    page_size: Option<u64>,
    page_size_kib: Option<u64>,
}

/// What guestmem's VMM side sends per mapping: the page size twice, in bytes, as Firecracker
/// v1.16 does, so that handlers written for any release find the field they read
/// (`page_size_kib` alone in v1.7-v1.11, where it holds bytes despite its name).
#[derive(Serialize)]
struct SentMapping {
    base_host_virt_addr: u64,
    size: u64,
    offset: u64,
    page_size: u64,
    page_size_kib: u64,
}

/// The host's base page size (`sysconf(_SC_PAGESIZE)`).
fn host_page_size() -> u64 {
    // SAFETY: sysconf reads a constant; no memory is involved.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if n > 0 {
        n as u64
    } else {
        4096
    }
}

/// Mapping `i`'s page size in bytes, from the fields its release sends:
///
/// - `page_size` (newer releases; v1.16 also sends `page_size_kib` with the same value in
///   bytes): used as is; a `page_size_kib` that differs from it is refused, naming both;
/// - `page_size_kib` alone (v1.7-v1.11, which put the size in **bytes** into it): bytes when it
///   is a page size in bytes (4096, 2097152, 1073741824), else KiB when 1024 times it is one
///   (4, 2048, 1048576; the field's name taken at its word); anything else is refused. The two
///   readings never collide: no page size in KiB is also a page size in bytes;
/// - neither (v1.0-v1.6, which had no huge pages): the host's page size.
///
/// The result must be one of [`PAGE_SIZES`].
fn mapping_page_size(i: usize, page_size: Option<u64>, page_size_kib: Option<u64>) -> Result<u64> {
    let valid = |b: u64| PAGE_SIZES.contains(&b);
    match (page_size, page_size_kib) {
        (Some(b), Some(k)) if k != b => Err(Error::Protocol(format!(
            "mapping {i}: page_size {b} and page_size_kib {k} differ (Firecracker releases \
             that send both send the same size in bytes in each)"
        ))),
        (Some(b), _) if valid(b) => Ok(b),
        (Some(b), _) => Err(Error::Protocol(format!(
            "mapping {i}: page_size {b} is not a page size in bytes (4096, 2097152 or \
             1073741824)"
        ))),
        (None, Some(k)) if valid(k) => Ok(k),
        (None, Some(k)) if k.checked_mul(1024).is_some_and(valid) => Ok(k * 1024),
        (None, Some(k)) => Err(Error::Protocol(format!(
            "mapping {i}: page_size_kib {k} is neither a page size in bytes (4096, 2097152 or \
             1073741824, as Firecracker v1.7-v1.11 send it) nor one in KiB (4, 2048 or 1048576)"
        ))),
        (None, None) => Ok(host_page_size()),
    }
}

/// Parses the handshake's JSON; each problem is named (which mapping, which field). The page
/// size is read from whichever fields the sender's release uses (see `mapping_page_size`):
/// `page_size` (bytes), `page_size_kib` alone (bytes in v1.7-v1.11, or KiB), or none (the
/// host's page size).
pub fn parse_mappings(bytes: &[u8]) -> Result<Vec<GuestRegionUffdMapping>> {
    let wire: Vec<WireMapping> =
        serde_json::from_slice(bytes).map_err(|source| Error::HandshakeJson { source })?;
    if wire.is_empty() {
        return Err(Error::Protocol(
            "the handshake message lists no memory regions".into(),
        ));
    }
    wire.into_iter()
        .enumerate()
        .map(|(i, w)| {
            Ok(GuestRegionUffdMapping {
                base_host_virt_addr: w.base_host_virt_addr,
                size: w.size,
                offset: w.offset,
                page_size: mapping_page_size(i, w.page_size, w.page_size_kib)?,
            })
        })
        .collect()
}

/// The handshake message guestmem's VMM side sends for `mappings`: a JSON array with both
/// `page_size` and `page_size_kib` in bytes (see `SentMapping`).
pub fn handshake_message(mappings: &[GuestRegionUffdMapping]) -> Vec<u8> {
    let sent: Vec<SentMapping> = mappings
        .iter()
        .map(|m| SentMapping {
            base_host_virt_addr: m.base_host_virt_addr,
            size: m.size,
            offset: m.offset,
            page_size: m.page_size,
            page_size_kib: m.page_size,
        })
        .collect();
    serde_json::to_vec(&sent).expect("plain integers serialize")
}

/// Checks that every mapping's bytes lie inside a memory file of `file_len` bytes.
pub fn check_mappings(mappings: &[GuestRegionUffdMapping], file_len: u64) -> Result<()> {
    for (i, m) in mappings.iter().enumerate() {
        match m.offset.checked_add(m.size) {
            Some(end) if end <= file_len => {}
            _ => {
                return Err(Error::Protocol(format!(
                    "mapping {i} (host {:#x}, {:#x} bytes at file offset {:#x}) ends beyond \
                     the memory file's {file_len:#x} bytes",
                    m.base_host_virt_addr, m.size, m.offset
                )))
            }
        }
    }
    Ok(())
}

/// `getsockopt(SO_PEERPIDFD)` (Linux 6.5): a pidfd of the process that connected.
const SO_PEERPIDFD: libc::c_int = 77;

/// The process at the other end of a page-server connection, held by a pidfd: a signal sent
/// through it reaches that process or nobody, never another process that got its pid after it
/// exited (plain `kill(pid)` could).
#[derive(Debug)]
pub struct PeerProcess {
    pid: i32,
    pidfd: OwnedFd,
    /// Set by the first [`kill_peer`]: the later ones (other threads failing because the peer
    /// is gone) neither signal nor log again.
    killed: AtomicBool,
}

impl PeerProcess {
    /// The process that connected `stream`: its pidfd from `SO_PEERPIDFD`, or, on kernels
    /// without it, `pidfd_open` of its `SO_PEERCRED` pid at once (the peer is waiting for our
    /// answer then, so the pid is still its own).
    #[allow(clippy::cast_possible_truncation)] // the size of a c_int.
    pub fn of(stream: &UnixStream) -> Result<PeerProcess> {
        let pid = peer_pid(stream)?;
        let mut fd: libc::c_int = -1;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into `fd`, a live c_int.
        let r = unsafe {
            libc::getsockopt(
                stream.as_raw_fd(),
                libc::SOL_SOCKET,
                SO_PEERPIDFD,
                (&raw mut fd).cast(),
                &raw mut len,
            )
        };
        if r == 0 && fd >= 0 {
            // SAFETY: the kernel gave us this new pidfd; nobody else owns it.
            let pidfd = unsafe { OwnedFd::from_raw_fd(fd) };
            return Ok(PeerProcess {
                pid,
                pidfd,
                killed: AtomicBool::new(false),
            });
        }
        PeerProcess::open(pid)
    }

    /// The process `pid` now (`pidfd_open`).
    pub fn open(pid: i32) -> Result<PeerProcess> {
        // SAFETY: pidfd_open returns a new fd (checked) or -1; no memory is involved.
        let ret = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        // A file descriptor, or -1: both fit a c_int.
        let fd = libc::c_int::try_from(ret).unwrap_or(-1);
        if fd < 0 {
            return Err(Error::ProtocolIo {
                what: format!("pidfd_open of the peer, pid {pid}"),
                source: io::Error::last_os_error(),
            });
        }
        // SAFETY: the fresh pidfd from above, owned by nobody else.
        let pidfd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(PeerProcess {
            pid,
            pidfd,
            killed: AtomicBool::new(false),
        })
    }

    /// Its pid (as it was when it connected).
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// `SIGKILL`s the process through its pidfd. `Ok(false)`: it had already exited (then no
    /// other process is signalled, whoever has its pid now).
    pub fn kill(&self) -> io::Result<bool> {
        // SAFETY: pidfd_send_signal on our own pidfd, with no siginfo; no memory is involved.
        let r = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.pidfd.as_raw_fd(),
                libc::SIGKILL,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        if r == 0 {
            return Ok(true);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::ESRCH) => Ok(false),
            _ => Err(e),
        }
    }

    /// Waits up to `timeout` for the process to exit; whether it has (a pidfd becomes readable
    /// when its process exits; a zombie has exited).
    pub fn wait_exit(&self, timeout: Duration) -> bool {
        let mut fd = libc::pollfd {
            fd: self.pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
        // SAFETY: polls one live pollfd.
        let n = unsafe { libc::poll(&raw mut fd, 1, ms) };
        n > 0 && fd.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0
    }

    /// Whether the process is still running.
    pub fn alive(&self) -> bool {
        !self.wait_exit(Duration::ZERO)
    }

    /// Whether the process no longer maps any of `[addr, addr + len)`: it has exited (or is
    /// exiting), or `/proc/PID/maps` lists nothing there. Read between two looks at the pidfd,
    /// so that the maps read are this process's, not those of one that got its pid since.
    pub fn no_longer_maps(&self, addr: u64, len: u64) -> bool {
        if !self.alive() {
            return true;
        }
        let Ok(maps) = std::fs::read_to_string(format!("/proc/{}/maps", self.pid)) else {
            return !self.alive();
        };
        if !self.alive() {
            return true;
        }
        let end = addr.saturating_add(len);
        !maps.lines().any(|line| {
            let range = line.split_whitespace().next().unwrap_or("");
            let Some((start, stop)) = range.split_once('-') else {
                return false;
            };
            match (
                u64::from_str_radix(start, 16),
                u64::from_str_radix(stop, 16),
            ) {
                (Ok(start), Ok(stop)) => start < end && addr < stop,
                _ => false,
            }
        })
    }
}

/// The pid of the process at the other end of `stream` (`SO_PEERCRED`).
#[allow(clippy::cast_possible_truncation)] // the size of a small C struct.
pub fn peer_pid(stream: &UnixStream) -> Result<i32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, a live ucred.
    let r = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast(),
            &raw mut len,
        )
    };
    if r < 0 {
        return Err(Error::ProtocolIo {
            what: "getsockopt(SO_PEERCRED) on the page-server connection".into(),
            source: io::Error::last_os_error(),
        });
    }
    Ok(cred.pid)
}

/// Refuses a descriptor that is not a userfaultfd (e.g. `/dev/null` sent by mistake) with one
/// error naming what it is: serving it would poll a fd that is always readable and never yields
/// a fault. A userfaultfd is an anonymous inode named `[userfaultfd]`, whether it came from the
/// `userfaultfd` syscall or from `/dev/userfaultfd`.
pub fn check_userfaultfd(fd: BorrowedFd<'_>) -> Result<()> {
    let link = format!("/proc/self/fd/{}", fd.as_raw_fd());
    match std::fs::read_link(&link) {
        Ok(target) if target.as_os_str() == "anon_inode:[userfaultfd]" => Ok(()),
        Ok(target) => Err(Error::Protocol(format!(
            "the file descriptor attached to the handshake message is {}, not a userfaultfd",
            target.display()
        ))),
        Err(source) => Err(Error::ProtocolIo {
            what: format!(
                "cannot tell what the file descriptor attached to the handshake message is (a \
                 userfaultfd is expected): readlink {link}"
            ),
            source,
        }),
    }
}

/// What a VMM sent: its regions and the userfaultfd they are registered on.
#[derive(Debug)]
pub struct Handshake {
    /// The regions, as the VMM maps them.
    pub mappings: Vec<GuestRegionUffdMapping>,
    /// The userfaultfd they are registered on.
    pub uffd: OwnedFd,
}

/// Receives the one handshake message: the JSON mappings with the userfaultfd as `SCM_RIGHTS`.
pub fn receive_handshake(stream: &UnixStream) -> Result<Handshake> {
    let mut buf = vec![0u8; 64 << 10];
    let (n, file) = stream
        .recv_with_fd(&mut buf)
        .map_err(|e| Error::ProtocolIo {
            what: "receiving the handshake message".into(),
            source: io::Error::from_raw_os_error(e.errno()),
        })?;
    if n == 0 {
        return Err(Error::Protocol(
            "the peer closed the connection without sending the handshake message".into(),
        ));
    }
    let Some(file) = file else {
        return Err(Error::Protocol(
            "the handshake message carries no file descriptor: the userfaultfd must be \
             attached as SCM_RIGHTS"
                .into(),
        ));
    };
    let uffd: OwnedFd = file.into();
    let mut message = buf[..n].to_vec();
    // A large message may arrive in pieces: read on while the JSON is incomplete.
    loop {
        match parse_mappings(&message) {
            Err(Error::HandshakeJson { .. })
                if serde_json::from_slice::<serde_json::Value>(&message)
                    .err()
                    .is_some_and(|e| e.is_eof())
                    && message.len() < MAX_MESSAGE =>
            {
                let mut more = vec![0u8; 64 << 10];
                let n = (&*stream)
                    .read(&mut more)
                    .map_err(|source| Error::ProtocolIo {
                        what: "receiving the rest of the handshake message".into(),
                        source,
                    })?;
                if n == 0 {
                    return Err(Error::Protocol(format!(
                        "the peer closed the connection after {} bytes of an incomplete \
                         handshake message",
                        message.len()
                    )));
                }
                message.extend_from_slice(&more[..n]);
            }
            result => return result.map(|mappings| Handshake { mappings, uffd }),
        }
    }
}

/// Connects to the page server at `socket` and sends the handshake ([`handshake_message`]) with
/// `uffd` attached, as Firecracker does. The returned stream is the connection (keep it while
/// the server serves).
pub fn send_handshake(
    socket: &Path,
    mappings: &[GuestRegionUffdMapping],
    uffd: BorrowedFd<'_>,
) -> Result<UnixStream> {
    let stream = UnixStream::connect(socket).map_err(Error::io(socket, "connect"))?;
    let json = handshake_message(mappings);
    let sent = stream
        .send_with_fd(&json[..], uffd.as_raw_fd())
        .map_err(|e| {
            Error::io(socket, "sendmsg of the handshake")(io::Error::from_raw_os_error(e.errno()))
        })?;
    if sent != json.len() {
        return Err(Error::Protocol(format!(
            "{}: sent {sent} of the handshake's {} bytes",
            socket.display(),
            json.len()
        )));
    }
    Ok(stream)
}

/// How a page server serves its peers.
#[derive(Debug, Clone)]
pub struct PageServerConfig {
    /// Fault-around, readahead, background fetch, retries (`abort`, `uffds` and `handlers`
    /// are not used).
    pub pager: PagerConfig,
    /// Kill the peer (`SIGKILL`) when serving it fails for good, so that its vCPUs are not left
    /// blocked forever on faults nobody will serve.
    pub kill_peer_on_failure: bool,
    /// Where each session's progress records go ([`guestmem_events::Event`], operation
    /// `page-server`): setup once the handshake is read, postcopy while serving (resident
    /// bytes, faults, chunks fetched, bytes missing), completed once the memory is all
    /// resident or the peer is gone, failed with the error.
    pub events: Option<guestmem_events::Sink>,
}

impl Default for PageServerConfig {
    fn default() -> Self {
        PageServerConfig {
            pager: PagerConfig::default(),
            kill_peer_on_failure: true,
            events: None,
        }
    }
}

fn kill_peer(peer: &PeerProcess, reason: &str) {
    if peer.killed.swap(true, Ordering::AcqRel) {
        return;
    }
    tracing::error!(
        pid = peer.pid(),
        "page server failed for good, killing the peer: {reason}"
    );
    match peer.kill() {
        Ok(true) => {}
        Ok(false) => tracing::info!(pid = peer.pid(), "the peer had already exited"),
        Err(e) => tracing::error!(pid = peer.pid(), "pidfd_send_signal(SIGKILL): {e}"),
    }
}

/// What a page server serves its peers' mappings from.
#[derive(Debug)]
pub enum ServedMemory {
    /// A Firecracker memory file: the guest regions back to back, mapping `m` served from
    /// `file[m.offset..][..m.size]`. Its bytes cannot be checked: Firecracker's memory files
    /// carry no checksums.
    File {
        /// The file.
        path: PathBuf,
        /// Its mapping.
        source: Arc<FileSource>,
    },
    /// RAM regions laid back to back from offset 0, each served from its own page source (a
    /// snapshot's: a flat snapshot's regions check each chunk against the manifest's CRC-32, a
    /// chunk store's against its hash, before serving any of it). Each mapping must be exactly
    /// one region.
    Regions {
        /// Names the memory in messages ("snapshot DIR", "store snapshot s3://…/NAME").
        label: String,
        /// How its sources check the bytes they serve, in words ("each chunk checked against
        /// its CRC-32 before it is served").
        checks: String,
        /// The regions, in the order of the peer's layout.
        regions: Vec<ServedRegion>,
    },
}

/// One RAM region of [`ServedMemory::Regions`].
pub struct ServedRegion {
    /// Its name (in messages).
    pub name: String,
    /// Its bytes.
    pub size: u64,
    /// Where its bytes come from (shared by every connection).
    pub source: Arc<dyn PageSource>,
}

// By hand: a page source need not implement `Debug`.
impl std::fmt::Debug for ServedRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServedRegion")
            .field("name", &self.name)
            .field("size", &self.size)
            .finish_non_exhaustive()
    }
}

impl ServedMemory {
    /// A Firecracker memory file (see [`ServedMemory::File`]).
    pub fn file(path: &Path) -> Result<ServedMemory> {
        Ok(ServedMemory::File {
            path: path.to_path_buf(),
            source: open_mem_file(path)?,
        })
    }

    /// Names it in messages.
    pub fn describe(&self) -> String {
        match self {
            ServedMemory::File { path, .. } => {
                format!(
                    "memory file {} (not checked: it carries no checksums)",
                    path.display()
                )
            }
            ServedMemory::Regions { label, checks, .. } => format!("{label} ({checks})"),
        }
    }

    /// Each mapping's name and page source, after checking the mappings against the memory.
    fn sources(
        &self,
        mappings: &[GuestRegionUffdMapping],
        peer_pid: i32,
    ) -> Result<Vec<(String, Arc<dyn PageSource>)>> {
        match self {
            ServedMemory::File { path, source } => {
                check_mappings(mappings, source.size())?;
                let total: u64 = mappings.iter().map(|m| m.size).sum();
                if total != source.size() {
                    return Err(Error::Protocol(format!(
                        "the mappings total {total:#x} bytes but the memory file {} holds \
                         {:#x}: a Firecracker memory file is exactly the guest regions back to \
                         back (for a guestmem snapshot, serve it with --snapshot DIR, which \
                         also checks its bytes)",
                        path.display(),
                        source.size()
                    )));
                }
                let inner: Arc<dyn PageSource> = source.clone();
                mappings
                    .iter()
                    .enumerate()
                    .map(|(i, m)| {
                        let window = WindowSource::new(inner.clone(), m.offset, m.size).map_err(
                            |source| Error::ProtocolIo {
                                what: format!("mapping {i}"),
                                source,
                            },
                        )?;
                        let name = format!(
                            "peer {peer_pid} mapping {i} (host {:#x}, file offset {:#x})",
                            m.base_host_virt_addr, m.offset
                        );
                        Ok((name, Arc::new(window) as Arc<dyn PageSource>))
                    })
                    .collect()
            }
            ServedMemory::Regions { label, regions, .. } => {
                let mut offset = 0;
                let ram: Vec<(&ServedRegion, u64)> = regions
                    .iter()
                    .map(|r| {
                        let at = offset;
                        offset += r.size;
                        (r, at)
                    })
                    .collect();
                mappings
                    .iter()
                    .enumerate()
                    .map(|(i, m)| {
                        let Some(&(region, _)) = ram
                            .iter()
                            .find(|&&(r, at)| at == m.offset && r.size == m.size)
                        else {
                            let layout: Vec<String> = ram
                                .iter()
                                .map(|(r, at)| {
                                    format!("'{}' {:#x} bytes at {at:#x}", r.name, r.size)
                                })
                                .collect();
                            return Err(Error::Protocol(format!(
                                "mapping {i} ({:#x} bytes at offset {:#x}) is not one of {label}'s \
                                 RAM regions laid back to back ({})",
                                m.size,
                                m.offset,
                                layout.join(", ")
                            )));
                        };
                        let name = format!(
                            "{label} region '{}' (peer {peer_pid} mapping {i}, host {:#x})",
                            region.name, m.base_host_virt_addr
                        );
                        Ok((name, region.source.clone()))
                    })
                    .collect()
            }
        }
    }
}

/// One peer being served.
#[derive(Debug)]
pub struct Session {
    /// The peer's process id.
    pub peer_pid: i32,
    /// The regions it registered.
    pub mappings: Vec<GuestRegionUffdMapping>,
    peer: Arc<PeerProcess>,
    /// The session's progress records, if asked for (dropped before the pager).
    progress: Option<progress::SessionProgress>,
    pager: PeerPager,
    _stream: UnixStream,
}

impl Session {
    /// Per mapping, in address order.
    pub fn stats(&self) -> Vec<PagerStats> {
        self.pager.stats()
    }

    /// The error that stopped serving, if a fetch failed for good.
    pub fn failure(&self) -> Option<String> {
        self.pager.failure()
    }

    /// Whether every mapping is resident and retired (with background fetch).
    pub fn resident(&self) -> bool {
        self.pager.retired()
    }

    /// Whether the peer let go of every mapping (unmapped it, or is exiting) before it was all
    /// served: serving has ended without a failure.
    pub fn released(&self) -> bool {
        self.pager.released()
    }

    /// Serves until the peer process is gone (`Ok`) or serving fails for good (`Err`). The
    /// peer is watched through its pidfd, so a new process with its pid does not keep it
    /// serving.
    pub fn wait(mut self) -> Result<()> {
        let progress = self.progress.take();
        let served = self.serve_until_gone();
        if let Some(p) = progress {
            p.end(served.as_ref().err());
        }
        served
    }

    /// [`Session::wait`], before its last progress record.
    fn serve_until_gone(&self) -> Result<()> {
        loop {
            // Looked at after the exit too: a failure is recorded before the peer is killed
            // for it, so a peer that died of our kill is reported as the failure.
            let exited = self.peer.wait_exit(Duration::from_millis(100));
            if let Some(reason) = self.failure() {
                return Err(Error::Protocol(format!(
                    "serving peer pid {}: {reason}",
                    self.peer_pid
                )));
            }
            if exited {
                tracing::info!(pid = self.peer_pid, stats = ?self.stats(), "peer gone");
                return Ok(());
            }
        }
    }
}

/// The page server's side of one connection: the peer held by its pidfd, the handshake, checks
/// (the fd is a userfaultfd, the mappings fit `memory`), then serving from `memory`. Failures
/// after the peer is known kill it when the config says so (the error says so too).
pub fn serve_connection(
    stream: UnixStream,
    memory: &ServedMemory,
    config: &PageServerConfig,
) -> Result<Session> {
    let progress = config.events.as_ref().map(progress::SessionProgress::new);
    let session = serve_connection_now(stream, memory, config);
    match (progress, session) {
        (None, session) => session,
        (Some(p), Err(e)) => {
            p.end(Some(&e));
            Err(e)
        }
        (Some(mut p), Ok(mut s)) => {
            let sizes = s.mappings.iter().map(|m| m.size).collect();
            p.serving(s.pager.probes(), sizes);
            s.progress = Some(p);
            Ok(s)
        }
    }
}

/// [`serve_connection`], before its progress records.
fn serve_connection_now(
    stream: UnixStream,
    memory: &ServedMemory,
    config: &PageServerConfig,
) -> Result<Session> {
    let peer = Arc::new(PeerProcess::of(&stream)?);
    let peer_pid = peer.pid();
    tracing::info!(pid = peer_pid, "page-server connection");
    let fail = |e: Error| -> Error {
        if !config.kill_peer_on_failure {
            return e;
        }
        kill_peer(&peer, &crate::error_chain(&e, ": "));
        // The failure is the cause, printed once (not folded into this error's text).
        Error::PeerKilled {
            pid: peer_pid,
            source: Box::new(e),
        }
    };
    let handshake = receive_handshake(&stream).map_err(fail)?;
    let sources = memory
        .sources(&handshake.mappings, peer_pid)
        .map_err(fail)?;
    check_userfaultfd(handshake.uffd.as_fd()).map_err(fail)?;
    let ranges = handshake
        .mappings
        .iter()
        .zip(sources)
        .map(|(m, (name, source))| PeerRange {
            name,
            host_addr: m.base_host_virt_addr,
            size: m.size,
            page_size: m.page_size,
            source,
        })
        .collect();
    let on_failure: Option<OnFailure> = config.kill_peer_on_failure.then(|| {
        let peer = peer.clone();
        Arc::new(move |reason: &str| kill_peer(&peer, reason)) as OnFailure
    });
    // A VMM unmaps its RAM as it shuts down, maybe while a chunk is being copied: a copy that
    // finds the range gone is a failure only if the peer still maps it.
    let released: PeerReleased = {
        let peer = peer.clone();
        Arc::new(move |addr, len| peer.no_longer_maps(addr, len))
    };
    let pager = PeerPager::start(
        handshake.uffd,
        ranges,
        &config.pager,
        on_failure,
        Some(released),
    )
    .map_err(|e| fail(e.into()))?;
    tracing::info!(pid = peer_pid, mappings = ?handshake.mappings, "serving");
    Ok(Session {
        peer_pid,
        mappings: handshake.mappings,
        peer,
        progress: None,
        pager,
        _stream: stream,
    })
}

/// The VMM's end of a handshake with a page server ([`hand_memory_to_server`]): keep it while
/// the server serves the RAM.
#[derive(Debug)]
pub struct PeerHandoff {
    /// The handshake's connection.
    pub stream: UnixStream,
    /// Our copy of the userfaultfd the RAM is registered on.
    pub uffd: OwnedFd,
    /// The regions as sent to the server.
    pub mappings: Vec<GuestRegionUffdMapping>,
}

/// The VMM side's handshake for guest memory whose RAM regions (every region but the sys
/// region) were never touched: registers them (`MISSING`, with `UFFD_EVENT_REMOVE`) on a fresh
/// userfaultfd and sends it with the mappings to the page server on `socket`, in the form
/// Firecracker's own handlers accept: the RAM regions back to back from offset 0 (as
/// Firecracker's memory file holds its regions, which its example handler maps whole and
/// requires to be exactly the regions' total size), the page size in bytes as both
/// `page_size` and `page_size_kib`. The server then brings the RAM in; the RAM's bytes never
/// pass through this process, so whatever checks them is the server's (see [`ServedMemory`]).
pub fn hand_memory_to_server(memory: &GuestMemory, socket: &Path) -> Result<PeerHandoff> {
    let mut ram = Vec::new();
    let mut mappings = Vec::new();
    // The RAM regions in memory order, which a served memory's regions follow.
    let mut offset = 0;
    for region in memory
        .regions()
        .iter()
        .filter(|r| r.gpa() != layout::SYS_GPA)
    {
        ram.push(&**region);
        mappings.push(GuestRegionUffdMapping {
            base_host_virt_addr: region.host_addr() as u64,
            size: region.size(),
            offset,
            page_size: region.backend().page_size(),
        });
        offset += region.size();
    }
    let uffd = register_for_peer(&ram)?;
    let stream = send_handshake(socket, &mappings, uffd.as_fd())?;
    Ok(PeerHandoff {
        stream,
        uffd,
        mappings,
    })
}

/// Opens a memory file to serve (see [`ServedMemory::file`]).
pub fn open_mem_file(path: &Path) -> Result<Arc<FileSource>> {
    let file = File::open(path).map_err(Error::io(path, "open"))?;
    Ok(Arc::new(
        FileSource::new(file).map_err(Error::io(path, "mmap"))?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A handshake that is not JSON: the JSON error is the cause, printed once after the
    /// protocol's own text, never folded into it.
    #[test]
    fn a_handshake_that_is_not_json_keeps_the_json_error_as_its_source() {
        let e = parse_mappings(b"{not json").unwrap_err();
        let Error::HandshakeJson { source } = &e else {
            panic!("{e:?}");
        };
        let json = source.to_string();
        assert!(json.contains("line 1"), "{json}");
        assert!(!e.to_string().contains(&json), "{e}");
        let chain = crate::error_chain(&e, "\n  caused by: ");
        assert_eq!(
            chain,
            format!(
                "page-server protocol: the handshake message is not a JSON array of \
                 GuestRegionUffdMapping {{base_host_virt_addr, size, offset[, page_size][, \
                 page_size_kib]}}\n  caused by: {json}"
            )
        );
    }

    /// A fd whose kind cannot be read: the readlink's error is the cause.
    #[test]
    fn an_unreadable_fd_keeps_the_os_error_as_its_source() {
        // SAFETY: a number no descriptor of this process has; only its /proc link is read.
        let fd = unsafe { BorrowedFd::borrow_raw(1 << 20) };
        let e = check_userfaultfd(fd).unwrap_err();
        let Error::ProtocolIo { what, source } = &e else {
            panic!("{e:?}");
        };
        assert!(
            what.ends_with(&format!("readlink /proc/self/fd/{}", 1 << 20)),
            "{what}"
        );
        assert_eq!(source.kind(), io::ErrorKind::NotFound);
        assert_eq!(
            crate::error_chain(&e, ": ").matches("No such file").count(),
            1
        );
    }
}
