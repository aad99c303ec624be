//! Where the pager gets a region's bytes from.

use guestmem_sys::to_usize;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

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
    /// Fetches `[offset, offset + len)` in order, through `buf` a piece of at most `buf.len()`
    /// bytes at a time, handing each piece and its offset to `sink`; `sink` returning false
    /// stops the fetch (the rest is not wanted). `urgent`: someone waits for these bytes (else
    /// as `fetch_background`). A source with a slow link asks for the whole range in one
    /// request, so that a large range pays the link's latency once, not once per piece.
    fn fetch_pieces(
        &self,
        offset: u64,
        len: u64,
        buf: &mut [u8],
        urgent: bool,
        sink: &mut dyn FnMut(u64, &[u8]) -> bool,
    ) -> io::Result<()> {
        let end = offset + len;
        let mut off = offset;
        while off < end {
            let n = to_usize((end - off).min(buf.len() as u64));
            let piece = &mut buf[..n];
            if urgent {
                self.fetch(off, piece)?;
            } else {
                self.fetch_background(off, piece)?;
            }
            if !sink(off, piece) {
                break;
            }
            off += piece.len() as u64;
        }
        Ok(())
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
    /// How many bytes one background fetch should span, if the source knows better than the
    /// pager's rule (as much as the link carries in a quarter millisecond, so that a fault's
    /// answer never queues behind much background data on a link they share): a source whose
    /// fetches of a range go out in parallel, on their own connections, wants ranges that
    /// keep them all busy.
    fn background_bytes(&self) -> Option<u64> {
        None
    }
    /// Whether the source serves many requests at once, each on its own, and a request's
    /// size barely changes how long it takes (an object store across a round trip): a
    /// background fetch then does not hold a fault's answer back, so the background does not
    /// step aside while faults are served, and readahead goes out as one request per run
    /// instead of one per chunk. A source whose requests share one link in order (post-copy)
    /// or one CPU (a local file) says no.
    fn concurrent_requests(&self) -> bool {
        false
    }
}

/// Zero-filled memory of `size` bytes (a fresh VM, or pages known to be zero).
#[derive(Debug, Clone, Copy)]
pub struct ZeroSource {
    /// The region's bytes.
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
    /// The file at `path`.
    pub fn open(path: &Path) -> io::Result<FileSource> {
        FileSource::new(File::open(path)?)
    }

    /// The open `file`, mapped read-only.
    pub fn new(file: File) -> io::Result<FileSource> {
        let size = file.metadata()?.len();
        let map = if size == 0 {
            std::ptr::null()
        } else {
            // SAFETY: a fresh read-only mapping of the whole file; nothing aliases it mutably.
            let addr = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    to_usize(size),
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
            unsafe { libc::munmap(self.map as *mut libc::c_void, to_usize(self.size)) };
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
/// thread per connection in this process, serving from another source after a per-request
/// `delay` (simulated network latency); requests on different connections overlap, and a
/// range fetched with [`PageSource::fetch_pieces`] is one request, streamed.
pub struct RemoteSource {
    connections: Vec<Mutex<UnixStream>>,
    size: u64,
    delays: Arc<DelayLog>,
}

impl std::fmt::Debug for RemoteSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteSource")
            .field("connections", &self.connections.len())
            .field("size", &self.size)
            .finish_non_exhaustive()
    }
}

/// The delays the peer threads really waited (a sleep takes longer than asked).
#[derive(Default)]
struct DelayLog {
    nanos: AtomicU64,
    count: AtomicU64,
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
        let delays = Arc::new(DelayLog::default());
        let mut ours = Vec::with_capacity(connections);
        for i in 0..connections.max(1) {
            let (local, peer) = UnixStream::pair()?;
            let inner = inner.clone();
            let delays = delays.clone();
            std::thread::Builder::new()
                .name(format!("page-peer{i}"))
                .spawn(move || serve(peer, &*inner, delay, &delays))?;
            ours.push(Mutex::new(local));
        }
        Ok(RemoteSource {
            connections: ours,
            size,
            delays,
        })
    }

    /// The mean delay the peer really waited per request so far (`None` before the first
    /// delayed request).
    pub fn observed_delay(&self) -> Option<Duration> {
        let count = self.delays.count.load(Ordering::Relaxed);
        (count > 0).then(|| Duration::from_nanos(self.delays.nanos.load(Ordering::Relaxed) / count))
    }

    /// A connection for a request at `offset`: the first idle one, starting from the one of
    /// its 2 MiB block, or else that one once it is free.
    fn connection(&self, offset: u64) -> MutexGuard<'_, UnixStream> {
        let n = self.connections.len();
        let first = (offset >> 21) as usize % n;
        (0..n)
            .find_map(|k| self.connections[(first + k) % n].try_lock().ok())
            .unwrap_or_else(|| {
                self.connections[first]
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
            })
    }
}

/// The peer's loop: answers requests until the connection closes. It sends straight from the
/// source's mapping when it has one (a real peer sends from its own memory).
fn serve(mut stream: UnixStream, source: &dyn PageSource, delay: Duration, delays: &DelayLog) {
    // The peer stands for another machine: its wait should be `delay`, not `delay` plus the
    // timer slack (50 us by default) and a wait for a CPU behind the vCPU threads, which a
    // real peer would not share (best effort: raising priority needs CAP_SYS_NICE). The
    // delays really waited are logged either way.
    // SAFETY: prctl on this thread only.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong) };
    crate::priority::raise();
    let mut buf = Vec::new();
    let mut req = [0u8; HEADER];
    while stream.read_exact(&mut req).is_ok() {
        let offset = u64::from_le_bytes(req[..8].try_into().expect("8 bytes"));
        let len = u64::from_le_bytes(req[8..].try_into().expect("8 bytes"));
        if !delay.is_zero() {
            let slept = Instant::now();
            std::thread::sleep(delay);
            delays.nanos.fetch_add(
                u64::try_from(slept.elapsed().as_nanos()).unwrap_or(u64::MAX),
                Ordering::Relaxed,
            );
            delays.count.fetch_add(1, Ordering::Relaxed);
        }
        let bytes: io::Result<&[u8]> = match source.mapped() {
            Some(map)
                if offset
                    .checked_add(len)
                    .is_some_and(|end| end <= source.size()) =>
            {
                // SAFETY: `[offset, offset + len)` lies inside the source's mapping (checked),
                // which lives as long as `source`.
                Ok(unsafe { std::slice::from_raw_parts(map.add(to_usize(offset)), to_usize(len)) })
            }
            _ => {
                buf.resize(to_usize(len), 0);
                source.fetch(offset, &mut buf).map(|()| &buf[..])
            }
        };
        let status: i64 = match &bytes {
            Ok(_) => 0,
            Err(e) => -i64::from(e.raw_os_error().unwrap_or(libc::EIO)),
        };
        let sent = stream
            .write_all(&status.to_le_bytes())
            .and_then(|()| match bytes {
                Ok(bytes) => stream.write_all(bytes),
                Err(_) => Ok(()),
            });
        if sent.is_err() {
            return;
        }
    }
}

/// Sends a request for `len` bytes at `offset` and reads the status of its answer.
fn request(stream: &mut UnixStream, offset: u64, len: u64) -> io::Result<()> {
    let mut req = [0u8; HEADER];
    req[..8].copy_from_slice(&offset.to_le_bytes());
    req[8..].copy_from_slice(&len.to_le_bytes());
    stream.write_all(&req)?;
    let mut status = [0u8; 8];
    stream.read_exact(&mut status)?;
    match i64::from_le_bytes(status) {
        0 => Ok(()),
        e => Err(io::Error::from_raw_os_error(
            i32::try_from(-e).unwrap_or(libc::EIO),
        )),
    }
}

impl PageSource for RemoteSource {
    fn fetch(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let mut stream = self.connection(offset);
        request(&mut stream, offset, buf.len() as u64)?;
        stream.read_exact(buf)
    }
    fn fetch_pieces(
        &self,
        offset: u64,
        len: u64,
        buf: &mut [u8],
        _urgent: bool,
        sink: &mut dyn FnMut(u64, &[u8]) -> bool,
    ) -> io::Result<()> {
        let mut stream = self.connection(offset);
        request(&mut stream, offset, len)?;
        let end = offset + len;
        let mut off = offset;
        let mut wanted = true;
        while off < end {
            let n = to_usize((end - off).min(buf.len() as u64));
            let piece = &mut buf[..n];
            stream.read_exact(piece)?;
            // Once the sink has stopped, the rest is still read: the answer must be consumed
            // for the connection's next request.
            wanted = wanted && sink(off, piece);
            off += piece.len() as u64;
        }
        Ok(())
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

impl std::fmt::Debug for WindowSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WindowSource")
            .field("offset", &self.offset)
            .field("size", &self.size)
            .finish_non_exhaustive()
    }
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

    /// Fails, naming the range, when `[offset, offset + len)` is not inside the window.
    fn check(&self, offset: u64, len: u64) -> io::Result<()> {
        if offset.checked_add(len).is_none_or(|end| end > self.size) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("fetch {offset:#x}+{len:#x} outside the window"),
            ));
        }
        Ok(())
    }
}

impl PageSource for WindowSource {
    fn fetch(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.check(offset, buf.len() as u64)?;
        self.inner.fetch(self.offset + offset, buf)
    }
    fn fetch_background(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.check(offset, buf.len() as u64)?;
        self.inner.fetch_background(self.offset + offset, buf)
    }
    fn fetch_pieces(
        &self,
        offset: u64,
        len: u64,
        buf: &mut [u8],
        urgent: bool,
        sink: &mut dyn FnMut(u64, &[u8]) -> bool,
    ) -> io::Result<()> {
        self.check(offset, len)?;
        self.inner
            .fetch_pieces(self.offset + offset, len, buf, urgent, &mut |off, piece| {
                sink(off - self.offset, piece)
            })
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn background_bytes(&self) -> Option<u64> {
        self.inner.background_bytes()
    }
    fn concurrent_requests(&self) -> bool {
        self.inner.concurrent_requests()
    }
    fn mapped(&self) -> Option<*const u8> {
        // SAFETY: the window lies inside the inner source's mapping (checked in `new`).
        self.inner
            .mapped()
            .map(|p| unsafe { p.add(to_usize(self.offset)) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    /// A source whose byte at `o` is `o % 251`, counting its fetches by kind.
    #[derive(Default)]
    struct Counting {
        urgent: AtomicU64,
        background: AtomicU64,
    }

    #[allow(clippy::cast_possible_truncation)] // `% 251` fits a byte.
    fn pattern(offset: u64, buf: &mut [u8]) {
        for (i, b) in buf.iter_mut().enumerate() {
            *b = ((offset + i as u64) % 251) as u8;
        }
    }

    impl PageSource for Counting {
        fn fetch(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
            self.urgent.fetch_add(1, Ordering::Relaxed);
            pattern(offset, buf);
            Ok(())
        }
        fn fetch_background(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
            self.background.fetch_add(1, Ordering::Relaxed);
            pattern(offset, buf);
            Ok(())
        }
        fn size(&self) -> u64 {
            1 << 20
        }
    }

    fn expected(offset: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        pattern(offset, &mut v);
        v
    }

    fn temp_file(name: &str, bytes: &[u8]) -> PathBuf {
        let p = std::env::temp_dir().join(format!("guestmem-source-{}-{name}", std::process::id()));
        std::fs::write(&p, bytes).unwrap();
        p
    }

    /// The default `fetch_pieces` walks the range a buffer at a time (the last piece short),
    /// through `fetch` when urgent and `fetch_background` otherwise, and stops once the sink
    /// says so.
    #[test]
    fn pieces_cover_the_range_in_order_and_stop_when_told() {
        let s = Counting::default();
        let mut buf = [0u8; 100];
        let mut got = Vec::new();
        s.fetch_pieces(1000, 250, &mut buf, true, &mut |off, piece| {
            assert_eq!(piece, &expected(off, piece.len())[..]);
            got.push((off, piece.len()));
            true
        })
        .unwrap();
        assert_eq!(got, vec![(1000, 100), (1100, 100), (1200, 50)]);
        assert_eq!(s.urgent.load(Ordering::Relaxed), 3);
        assert_eq!(s.background.load(Ordering::Relaxed), 0);

        let mut pieces = 0;
        s.fetch_pieces(0, 1000, &mut buf, false, &mut |_, _| {
            pieces += 1;
            pieces < 2
        })
        .unwrap();
        assert_eq!(pieces, 2);
        assert_eq!(s.background.load(Ordering::Relaxed), 2);
        assert_eq!(s.urgent.load(Ordering::Relaxed), 3);
    }

    /// A file source reads and maps the file's bytes; an empty file has no mapping.
    #[test]
    fn a_file_source_reads_and_maps_its_file() {
        let bytes = expected(0, 10_000);
        let path = temp_file("file", &bytes);
        let s = FileSource::open(&path).unwrap();
        assert_eq!(s.size(), 10_000);
        let mut buf = [0u8; 300];
        s.fetch(9_000, &mut buf).unwrap();
        assert_eq!(buf[..], bytes[9_000..9_300]);
        let map = s.mapped().expect("mapped");
        // SAFETY: the mapping is 10 000 bytes long and lives as long as `s`.
        let mapped = unsafe { std::slice::from_raw_parts(map, 10_000) };
        assert!(mapped == &bytes[..]);
        let e = s.fetch(9_900, &mut buf).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
        let empty = temp_file("empty", &[]);
        let s = FileSource::open(&empty).unwrap();
        assert_eq!((s.size(), s.mapped()), (0, None));
        assert!(!s.is_zero(0, 0));
        for p in [path, empty] {
            let _ = std::fs::remove_file(p);
        }
    }

    /// A window reads its inner source shifted by its offset, pieces named by their offset in
    /// the window, its mapping shifted too; a window or a fetch that does not fit is refused
    /// naming the numbers.
    #[test]
    fn a_window_shifts_its_inner_source() {
        let bytes = expected(0, 8192);
        let path = temp_file("window", &bytes);
        let inner: Arc<dyn PageSource> = Arc::new(FileSource::open(&path).unwrap());
        let e = WindowSource::new(inner.clone(), 4096, 4097).unwrap_err();
        assert_eq!(
            e.to_string(),
            "window at offset 0x1000 of 0x1001 bytes ends beyond the source's 0x2000 bytes"
        );
        assert!(WindowSource::new(inner.clone(), u64::MAX, 2).is_err());
        let w = WindowSource::new(inner, 4096, 4096).unwrap();
        assert_eq!(w.size(), 4096);
        let mut buf = [0u8; 16];
        w.fetch(8, &mut buf).unwrap();
        assert_eq!(buf[..], bytes[4104..4120]);
        w.fetch_background(4080, &mut buf).unwrap();
        assert_eq!(buf[..], bytes[8176..8192]);
        let e = w.fetch(4088, &mut buf).unwrap_err();
        assert_eq!(e.to_string(), "fetch 0xff8+0x10 outside the window");
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        let mut offsets = Vec::new();
        w.fetch_pieces(100, 40, &mut buf, true, &mut |off, piece| {
            assert_eq!(piece, &bytes[to_usize(4096 + off)..][..piece.len()]);
            offsets.push(off);
            true
        })
        .unwrap();
        assert_eq!(offsets, vec![100, 116, 132]);
        assert!(w
            .fetch_pieces(4000, 97, &mut buf, true, &mut |_, _| true)
            .is_err());
        // SAFETY: one byte inside the inner mapping, which `w` keeps alive.
        assert_eq!(unsafe { *w.mapped().unwrap().add(5) }, bytes[4101]);
        let _ = std::fs::remove_file(path);
    }

    /// The peer threads answer with exactly the bytes asked for; a range fetched in pieces is
    /// read to its end even when the sink stops early, so the connection's next answer is
    /// still its own; a failed fetch comes back as the peer's errno and leaves the connection
    /// usable.
    #[test]
    fn a_remote_source_answers_exact_bytes_and_keeps_its_connection_in_step() {
        let bytes = expected(0, 3 << 20);
        let path = temp_file("remote", &bytes);
        let inner: Arc<dyn PageSource> = Arc::new(FileSource::open(&path).unwrap());
        let remote = RemoteSource::spawn(inner, Duration::ZERO, 1).unwrap();
        assert_eq!(remote.size(), 3 << 20);
        assert_eq!(remote.observed_delay(), None);
        let mut buf = vec![0u8; 4096];
        remote.fetch((2 << 20) + 5, &mut buf).unwrap();
        assert!(buf[..] == bytes[(2 << 20) + 5..][..4096]);
        let mut seen = 0;
        remote
            .fetch_pieces(0, 64 << 10, &mut buf, true, &mut |off, piece| {
                assert!(piece == &bytes[to_usize(off)..][..piece.len()]);
                seen += 1;
                false
            })
            .unwrap();
        assert_eq!(seen, 1);
        remote.fetch(777, &mut buf[..100]).unwrap();
        assert!(buf[..100] == bytes[777..877]);

        let e = remote.fetch((3 << 20) - 10, &mut buf[..20]).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
        remote.fetch(12345, &mut buf[..10]).unwrap();
        assert!(buf[..10] == bytes[12345..12355]);
        let _ = std::fs::remove_file(path);
    }

    /// Requests go to the connection of their 2 MiB block when it is idle, else to the next
    /// idle one; a delayed peer reports the delays it waited.
    #[test]
    fn requests_spread_over_idle_connections() {
        let remote = RemoteSource::spawn(
            Arc::new(ZeroSource { size: 8 << 20 }),
            Duration::from_millis(2),
            3,
        )
        .unwrap();
        let ptr = |g: &MutexGuard<'_, UnixStream>| std::ptr::from_ref::<UnixStream>(g);
        let conn =
            |i: usize| std::ptr::from_ref::<UnixStream>(&remote.connections[i].lock().unwrap());
        let (c0, c1, c2) = (conn(0), conn(1), conn(2));
        {
            let a = remote.connection(2 << 20);
            assert_eq!(ptr(&a), c1, "block 1's connection");
            let b = remote.connection((2 << 20) + 4096);
            assert_eq!(ptr(&b), c2, "the next idle one");
            let c = remote.connection(5 << 20);
            assert_eq!(
                ptr(&c),
                c0,
                "block 2's connection is busy: the next idle one"
            );
        }
        assert_eq!(ptr(&remote.connection(6 << 20)), c0, "block 3 wraps to 0");
        let mut buf = [1u8; 64];
        remote.fetch(4 << 20, &mut buf).unwrap();
        assert_eq!(buf, [0u8; 64]);
        let waited = remote.observed_delay().expect("one delayed request");
        assert!(waited >= Duration::from_millis(2), "{waited:?}");
    }

    /// Zero memory is zeros, and says so without a fetch.
    #[test]
    fn a_zero_source_is_zeros() {
        let z = ZeroSource { size: 8192 };
        let mut buf = [9u8; 32];
        z.fetch(100, &mut buf).unwrap();
        assert_eq!(buf, [0u8; 32]);
        assert!(z.is_zero(0, 8192));
        assert_eq!((z.size(), z.mapped()), (8192, None));
        assert_eq!(z.background_bytes(), None);
        assert!(!z.concurrent_requests());
    }
}
