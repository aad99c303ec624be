//! Where the pager gets a region's bytes from.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The bytes of one region, as the pager fetches them: offset 0 is the region's first byte.
/// Sources are shared by the pager's threads, which fetch concurrently.
pub trait PageSource: Send + Sync {
    /// Fills `buf` with the bytes at `[offset, offset + buf.len())`.
    fn fetch(&self, offset: u64, buf: &mut [u8]) -> io::Result<()>;
    /// Like `fetch`, for the background fetcher (nobody waits for these bytes): a source with
    /// a slow link may send it down another, less urgent path.
    fn fetch_background(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.fetch(offset, buf)
    }
    /// How many bytes the source holds; the pager refuses a larger region.
    fn size(&self) -> u64;
    /// The source's bytes, if they are mapped in this process (a file source maps its file):
    /// the pager then copies straight from them into guest memory, without a bounce buffer.
    fn mapped(&self) -> Option<*const u8> {
        None
    }
    /// Whether `[offset, offset + len)` is known to be all zeros without fetching it (a
    /// snapshot's zero chunks): anonymous memory then maps the zero page (`UFFDIO_ZEROPAGE`)
    /// instead of copying zeros.
    fn is_zero(&self, _offset: u64, _len: u64) -> bool {
        false
    }
}

/// Zero-filled memory of `size` bytes (a fresh VM, or pages known to be zero).
#[derive(Debug, Clone, Copy)]
pub struct ZeroSource {
    pub size: u64,
}

impl PageSource for ZeroSource {
    fn fetch(&self, _offset: u64, buf: &mut [u8]) -> io::Result<()> {
        buf.fill(0);
        Ok(())
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn is_zero(&self, _offset: u64, _len: u64) -> bool {
        true
    }
}

/// A local file holding the region's bytes at offset 0 (a snapshot's memory file), read
/// through a read-only shared mapping of it.
#[derive(Debug)]
pub struct FileSource {
    file: File,
    size: u64,
    map: *const u8,
}

// SAFETY: `map` is a read-only mapping owned by the source (unmapped on drop); reading it from
// several threads is fine.
unsafe impl Send for FileSource {}
// SAFETY: as above.
unsafe impl Sync for FileSource {}

impl FileSource {
    pub fn open(path: &Path) -> io::Result<FileSource> {
        FileSource::new(File::open(path)?)
    }

    pub fn new(file: File) -> io::Result<FileSource> {
        let size = file.metadata()?.len();
        let map = if size == 0 {
            std::ptr::null()
        } else {
            // SAFETY: a fresh read-only mapping of the whole file; nothing aliases it mutably.
            let addr = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    size as usize,
                    libc::PROT_READ,
                    libc::MAP_SHARED,
                    file.as_raw_fd(),
                    0,
                )
            };
            if addr == libc::MAP_FAILED {
                return Err(io::Error::last_os_error());
            }
            addr as *const u8
        };
        Ok(FileSource { file, size, map })
    }
}

impl Drop for FileSource {
    fn drop(&mut self) {
        if !self.map.is_null() {
            // SAFETY: the mapping made in `new`, of `size` bytes, unmapped once.
            unsafe { libc::munmap(self.map as *mut libc::c_void, self.size as usize) };
        }
    }
}

impl PageSource for FileSource {
    fn fetch(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.file.read_exact_at(buf, offset)
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn mapped(&self) -> Option<*const u8> {
        (!self.map.is_null()).then_some(self.map)
    }
}

/// A peer that serves pages over stream connections, as the migration source does: each fetch
/// sends a request (offset, length) and reads back a status and the bytes. The peer here is a
/// thread per connection in this process, serving from another source after a per-fetch
/// `delay` (simulated network latency); fetches on different connections overlap.
pub struct RemoteSource {
    connections: Vec<Mutex<UnixStream>>,
    size: u64,
}

/// Request: offset u64, length u64. Response: status i64 (0, or -errno), then the bytes.
const HEADER: usize = 16;

impl RemoteSource {
    /// Starts `connections` peer threads serving `inner`, each waiting `delay` before every
    /// answer.
    pub fn spawn(
        inner: Arc<dyn PageSource>,
        delay: Duration,
        connections: usize,
    ) -> io::Result<RemoteSource> {
        let size = inner.size();
        let mut ours = Vec::with_capacity(connections);
        for i in 0..connections.max(1) {
            let (local, peer) = UnixStream::pair()?;
            let inner = inner.clone();
            std::thread::Builder::new()
                .name(format!("page-peer{i}"))
                .spawn(move || serve(peer, &*inner, delay))?;
            ours.push(Mutex::new(local));
        }
        Ok(RemoteSource {
            connections: ours,
            size,
        })
    }
}

/// The peer's loop: answers requests until the connection closes.
fn serve(mut stream: UnixStream, source: &dyn PageSource, delay: Duration) {
    let mut buf = Vec::new();
    let mut req = [0u8; HEADER];
    while stream.read_exact(&mut req).is_ok() {
        let offset = u64::from_le_bytes(req[..8].try_into().expect("8 bytes"));
        let len = u64::from_le_bytes(req[8..].try_into().expect("8 bytes")) as usize;
        if !delay.is_zero() {
            std::thread::sleep(delay);
        }
        buf.resize(len, 0);
        let status: i64 = match source.fetch(offset, &mut buf) {
            Ok(()) => 0,
            Err(e) => -(e.raw_os_error().unwrap_or(libc::EIO) as i64),
        };
        let sent = stream.write_all(&status.to_le_bytes()).and_then(|()| {
            if status == 0 {
                stream.write_all(&buf)
            } else {
                Ok(())
            }
        });
        if sent.is_err() {
            return;
        }
    }
}

impl PageSource for RemoteSource {
    fn fetch(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        // Spread fetches over the connections by 2 MiB block.
        let i = (offset >> 21) as usize % self.connections.len();
        let mut stream = self.connections[i]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let mut req = [0u8; HEADER];
        req[..8].copy_from_slice(&offset.to_le_bytes());
        req[8..].copy_from_slice(&(buf.len() as u64).to_le_bytes());
        stream.write_all(&req)?;
        let mut status = [0u8; 8];
        stream.read_exact(&mut status)?;
        match i64::from_le_bytes(status) {
            0 => stream.read_exact(buf),
            e => Err(io::Error::from_raw_os_error(-e as i32)),
        }
    }
    fn size(&self) -> u64 {
        self.size
    }
}

/// `size` bytes of another source starting at `offset` (one region of a memory file that holds
/// several).
pub struct WindowSource {
    inner: Arc<dyn PageSource>,
    offset: u64,
    size: u64,
}

impl WindowSource {
    /// Fails, naming the numbers, when the window does not lie inside `inner`.
    pub fn new(inner: Arc<dyn PageSource>, offset: u64, size: u64) -> io::Result<WindowSource> {
        match offset.checked_add(size) {
            Some(end) if end <= inner.size() => Ok(WindowSource {
                inner,
                offset,
                size,
            }),
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "window at offset {offset:#x} of {size:#x} bytes ends beyond the source's \
                     {:#x} bytes",
                    inner.size()
                ),
            )),
        }
    }
}

impl PageSource for WindowSource {
    fn fetch(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        if offset + buf.len() as u64 > self.size {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("fetch {offset:#x}+{:#x} outside the window", buf.len()),
            ));
        }
        self.inner.fetch(self.offset + offset, buf)
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn mapped(&self) -> Option<*const u8> {
        // SAFETY: the window lies inside the inner source's mapping (checked in `new`).
        self.inner
            .mapped()
            .map(|p| unsafe { p.add(self.offset as usize) })
    }
}
