//! Firecracker's userfaultfd page-server protocol (see `docs/firecracker-uffd.md`), both sides:
//!
//! - the page server ([`serve_connection`]): accepts a VMM's connection, receives one message (a
//!   JSON array of [`GuestRegionUffdMapping`] with the userfaultfd attached as `SCM_RIGHTS`),
//!   reads the peer's pid (`SO_PEERCRED`) and serves its faults from a memory file with the
//!   demand-paging engine ([`PeerPager`]);
//! - the VMM ([`restore_lazy_via_socket`]): builds a VM from a guestmem snapshot, registers its
//!   RAM on a fresh userfaultfd and hands it to a page server exactly as Firecracker does.
//!
//! If serving fails for good after the handshake (a malformed message, a mapping outside the
//! file, a fetch that keeps failing), the server kills the peer (when
//! [`PageServerConfig::kill_peer_on_failure`] is set, the default) rather than leave its vCPUs
//! blocked forever on faults nobody will serve.

use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use guestmem_paging::{
    register_for_peer, FileSource, OnFailure, PageSource, PagerConfig, PagerStats, PeerPager,
    PeerRange, WindowSource,
};
use guestmem_vm::Vm;
use serde::{Deserialize, Serialize};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use crate::snapshot::{self, Snapshot};
use crate::{Error, Result};

/// Largest handshake message accepted (a VMM has a handful of regions).
const MAX_MESSAGE: usize = 1 << 20;

/// One guest memory region as Firecracker describes it to its page server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct GuestRegionUffdMapping {
    /// The region's start in the VMM's address space.
    pub base_host_virt_addr: u64,
    /// The region's size in bytes.
    pub size: u64,
    /// Where the region's bytes start in the memory file.
    pub offset: u64,
    /// The region's page size in bytes (older Firecracker releases send `page_size_kib`).
    pub page_size: u64,
}

#[derive(Deserialize)]
struct WireMapping {
    base_host_virt_addr: u64,
    size: u64,
    offset: u64,
    page_size: Option<u64>,
    page_size_kib: Option<u64>,
}

/// Parses the handshake's JSON; each problem is named (which mapping, which field).
pub fn parse_mappings(bytes: &[u8]) -> Result<Vec<GuestRegionUffdMapping>> {
    let wire: Vec<WireMapping> = serde_json::from_slice(bytes).map_err(|e| {
        Error::Protocol(format!(
            "the handshake message is not a JSON array of GuestRegionUffdMapping \
             {{base_host_virt_addr, size, offset, page_size}}: {e}"
        ))
    })?;
    if wire.is_empty() {
        return Err(Error::Protocol(
            "the handshake message lists no memory regions".into(),
        ));
    }
    wire.into_iter()
        .enumerate()
        .map(|(i, w)| {
            let page_size = match (w.page_size, w.page_size_kib) {
                (Some(b), _) => b,
                (None, Some(kib)) => kib.checked_mul(1024).ok_or_else(|| {
                    Error::Protocol(format!("mapping {i}: page_size_kib {kib} overflows"))
                })?,
                (None, None) => {
                    return Err(Error::Protocol(format!(
                        "mapping {i}: neither page_size nor page_size_kib is given"
                    )))
                }
            };
            Ok(GuestRegionUffdMapping {
                base_host_virt_addr: w.base_host_virt_addr,
                size: w.size,
                offset: w.offset,
                page_size,
            })
        })
        .collect()
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

/// The pid of the process at the other end of `stream` (`SO_PEERCRED`).
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
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r < 0 {
        return Err(Error::Protocol(format!(
            "getsockopt(SO_PEERCRED) on the page-server connection: {}",
            io::Error::last_os_error()
        )));
    }
    Ok(cred.pid)
}

/// What a VMM sent: its regions and the userfaultfd they are registered on.
#[derive(Debug)]
pub struct Handshake {
    pub mappings: Vec<GuestRegionUffdMapping>,
    pub uffd: OwnedFd,
}

/// Receives the one handshake message: the JSON mappings with the userfaultfd as `SCM_RIGHTS`.
pub fn receive_handshake(stream: &UnixStream) -> Result<Handshake> {
    let mut buf = vec![0u8; 64 << 10];
    let (n, file) = stream
        .recv_with_fd(&mut buf)
        .map_err(|e| Error::Protocol(format!("receiving the handshake message: {e}")))?;
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
            Err(Error::Protocol(_))
                if serde_json::from_slice::<serde_json::Value>(&message)
                    .err()
                    .is_some_and(|e| e.is_eof())
                    && message.len() < MAX_MESSAGE =>
            {
                let mut more = vec![0u8; 64 << 10];
                let n = (&*stream).read(&mut more).map_err(|e| {
                    Error::Protocol(format!("receiving the rest of the handshake message: {e}"))
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

/// Connects to the page server at `socket` and sends the handshake, as Firecracker does. The
/// returned stream is the connection (keep it while the server serves).
pub fn send_handshake(
    socket: &Path,
    mappings: &[GuestRegionUffdMapping],
    uffd: BorrowedFd<'_>,
) -> Result<UnixStream> {
    let stream = UnixStream::connect(socket).map_err(Error::io(socket, "connect"))?;
    let json = serde_json::to_vec(mappings).map_err(|e| Error::Json {
        path: socket.to_path_buf(),
        source: e,
    })?;
    let sent = stream
        .send_with_fd(&json[..], uffd.as_raw_fd())
        .map_err(|e| Error::Io {
            path: socket.to_path_buf(),
            op: "sendmsg of the handshake",
            source: io::Error::from_raw_os_error(e.errno()),
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
#[derive(Clone)]
pub struct PageServerConfig {
    /// Fault-around, readahead, background fetch, retries (`abort`, `uffds` and `handlers`
    /// are not used).
    pub pager: PagerConfig,
    /// Kill the peer (`SIGKILL`) when serving it fails for good, so that its vCPUs are not left
    /// blocked forever on faults nobody will serve.
    pub kill_peer_on_failure: bool,
}

impl Default for PageServerConfig {
    fn default() -> Self {
        PageServerConfig {
            pager: PagerConfig::default(),
            kill_peer_on_failure: true,
        }
    }
}

fn kill_peer(pid: i32, reason: &str) {
    tracing::error!(
        pid,
        "page server failed for good, killing the peer: {reason}"
    );
    // SAFETY: sends a signal; no memory is involved.
    unsafe { libc::kill(pid, libc::SIGKILL) };
}

/// One peer being served.
pub struct Session {
    pub peer_pid: i32,
    pub mappings: Vec<GuestRegionUffdMapping>,
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

    /// Serves until the peer process is gone (`Ok`) or serving fails for good (`Err`).
    pub fn wait(self) -> Result<()> {
        loop {
            if let Some(reason) = self.failure() {
                return Err(Error::Protocol(format!(
                    "serving peer pid {}: {reason}",
                    self.peer_pid
                )));
            }
            if !process_alive(self.peer_pid) {
                tracing::info!(pid = self.peer_pid, stats = ?self.stats(), "peer gone");
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Whether `pid` is a live (not zombie) process.
fn process_alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name in parentheses.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with(['Z', 'X'])),
        Err(_) => false,
    }
}

/// The page server's side of one connection: handshake, checks, then serving from `mem_file`
/// (the snapshot's memory file: mapping `m` is served from `mem_file[m.offset..][..m.size]`).
/// Failures after the peer is known kill it when the config says so (the error says so too).
pub fn serve_connection(
    stream: UnixStream,
    mem_file: &Arc<FileSource>,
    config: &PageServerConfig,
) -> Result<Session> {
    let peer_pid = peer_pid(&stream)?;
    tracing::info!(pid = peer_pid, "page-server connection");
    let fail = |e: Error| -> Error {
        if config.kill_peer_on_failure {
            kill_peer(peer_pid, &e.to_string());
            Error::Protocol(format!("{e} (peer pid {peer_pid} killed)"))
        } else {
            e
        }
    };
    let handshake = receive_handshake(&stream).map_err(fail)?;
    check_mappings(&handshake.mappings, mem_file.size()).map_err(fail)?;
    let source: Arc<dyn PageSource> = mem_file.clone();
    let mut ranges = Vec::new();
    for (i, m) in handshake.mappings.iter().enumerate() {
        let window = WindowSource::new(source.clone(), m.offset, m.size)
            .map_err(|e| fail(Error::Protocol(format!("mapping {i}: {e}"))))?;
        ranges.push(PeerRange {
            name: format!(
                "peer {peer_pid} mapping {i} (host {:#x}, file offset {:#x})",
                m.base_host_virt_addr, m.offset
            ),
            host_addr: m.base_host_virt_addr,
            size: m.size,
            page_size: m.page_size,
            source: Arc::new(window),
        });
    }
    let on_failure: Option<OnFailure> = config
        .kill_peer_on_failure
        .then(|| Arc::new(move |reason: &str| kill_peer(peer_pid, reason)) as OnFailure);
    let pager = PeerPager::start(handshake.uffd, ranges, &config.pager, on_failure)
        .map_err(|e| fail(e.into()))?;
    tracing::info!(pid = peer_pid, mappings = ?handshake.mappings, "serving");
    Ok(Session {
        peer_pid,
        mappings: handshake.mappings,
        pager,
        _stream: stream,
    })
}

/// A VM restored from a snapshot whose RAM a page server provides through a userfaultfd. Keep
/// the server serving until the VM is dropped.
pub struct PeerRestoredVm {
    pub vm: Vm,
    /// The handshake's connection and our copy of the userfaultfd.
    pub stream: UnixStream,
    pub uffd: OwnedFd,
    pub mappings: Vec<GuestRegionUffdMapping>,
}

/// Builds a VM from `snapshot` as [`snapshot::restore_lazy`] does, but its RAM is served by the
/// page server listening on `socket` (e.g. `guestmem page-server --firecracker SOCKET
/// --mem-file DIR/memory`): every guest RAM region is registered (`MISSING`, with
/// `UFFD_EVENT_REMOVE`) on a new userfaultfd, which is sent with the mappings (`offset` = the
/// region's place in the snapshot's memory file). The sys region is copied in at once. The
/// caller resumes the VM.
pub fn restore_lazy_via_socket(snapshot: &Snapshot, socket: &Path) -> Result<PeerRestoredVm> {
    if let Some(base) = &snapshot.manifest().base {
        return Err(Error::Layout(format!(
            "a diff snapshot spans several memory files (its base is {}), and a page server \
             serves one: restore it in full mode, or lazily in this process",
            base.dir.display()
        )));
    }
    let mut vm = snapshot::vm_for_lazy_restore(snapshot, &mut Vec::new())?;
    let mut ram = Vec::new();
    let mut mappings = Vec::new();
    for (region, image) in snapshot::lazy_regions(&vm, snapshot) {
        ram.push(region);
        mappings.push(GuestRegionUffdMapping {
            base_host_virt_addr: region.host_addr() as u64,
            size: region.size(),
            offset: image.file_offset,
            page_size: region.backend().page_size(),
        });
    }
    let uffd = register_for_peer(&ram)?;
    let stream = send_handshake(socket, &mappings, uffd.as_fd())?;
    vm.restore_state(snapshot.state())?;
    Ok(PeerRestoredVm {
        vm,
        stream,
        uffd,
        mappings,
    })
}

/// Opens a memory file for [`serve_connection`].
pub fn open_mem_file(path: &Path) -> Result<Arc<FileSource>> {
    let file = File::open(path).map_err(Error::io(path, "open"))?;
    Ok(Arc::new(
        FileSource::new(file).map_err(Error::io(path, "mmap"))?,
    ))
}
