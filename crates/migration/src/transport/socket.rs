//! The sockets under TLS (TCP or Unix) and the cutter that shuts one down from another thread.

use super::*;

/// Cuts a [`Connection`] (see [`Connection::cutter`]).
#[derive(Debug)]
pub struct Cutter(pub(super) Socket);

impl Cutter {
    /// Shuts the connection down both ways: its reads and writes fail at once.
    pub fn cut(&self) {
        let _ = match &self.0 {
            Socket::Tcp(s) => s.shutdown(std::net::Shutdown::Both),
            Socket::Unix(s) => s.shutdown(std::net::Shutdown::Both),
        };
    }

    /// Ends the reads only (a blocked one returns at once); writes still go, e.g. an Abort
    /// telling the peer why.
    pub fn cut_reads(&self) {
        let _ = match &self.0 {
            Socket::Tcp(s) => s.shutdown(std::net::Shutdown::Read),
            Socket::Unix(s) => s.shutdown(std::net::Shutdown::Read),
        };
    }
}

#[derive(Debug)]
pub(super) enum Socket {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Socket {
    pub(super) fn try_clone(&self) -> io::Result<Socket> {
        Ok(match self {
            Socket::Tcp(s) => Socket::Tcp(s.try_clone()?),
            Socket::Unix(s) => Socket::Unix(s.try_clone()?),
        })
    }

    /// Bytes written to the socket that the peer has not yet acknowledged (TCP) or read (a
    /// Unix socket): `SIOCOUTQ`. `None` where the kernel does not say.
    pub(super) fn queued_bytes(&self) -> Option<u64> {
        use std::os::fd::AsRawFd;
        let fd = match self {
            Socket::Tcp(s) => s.as_raw_fd(),
            Socket::Unix(s) => s.as_raw_fd(),
        };
        let mut queued: libc::c_int = 0;
        // SAFETY: SIOCOUTQ (TIOCOUTQ) writes one c_int into `queued`, which is live and
        // writable; `fd` is the open socket `self` owns.
        let r = unsafe { libc::ioctl(fd, libc::TIOCOUTQ, &raw mut queued) };
        (r == 0).then_some(queued.max(0) as u64)
    }

    /// The kernel's latest measure of the rate at which the peer acknowledged this TCP
    /// socket's data, in bytes per second (`TCP_INFO`'s `tcpi_delivery_rate`). `None` for a
    /// Unix socket, before any measure, or where the kernel does not say.
    #[allow(clippy::cast_possible_truncation)] // sizes of small C structs.
    pub(super) fn delivery_rate(&self) -> Option<u64> {
        use std::os::fd::AsRawFd;
        let Socket::Tcp(s) = self else {
            return None;
        };
        // SAFETY: tcp_info is plain old data (integers only): all zeroes is a valid value.
        let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
        // SAFETY: TCP_INFO writes at most `len` bytes into `info`, which is live, writable and
        // that long, and sets `len` to what it wrote; the fd is the open socket `s` owns.
        let r = unsafe {
            libc::getsockopt(
                s.as_raw_fd(),
                libc::IPPROTO_TCP,
                libc::TCP_INFO,
                std::ptr::addr_of_mut!(info).cast(),
                &raw mut len,
            )
        };
        let end = std::mem::offset_of!(libc::tcp_info, tcpi_delivery_rate) + 8;
        (r == 0 && len as usize >= end && info.tcpi_delivery_rate > 0)
            .then_some(info.tcpi_delivery_rate)
    }

    /// Read and write timeouts (shared by every clone of the socket).
    pub(super) fn set_timeouts(&self, t: Option<Duration>) -> io::Result<()> {
        // A zero duration means "forever" to std; the smallest bound instead.
        let t = t.map(|d| d.max(Duration::from_millis(1)));
        match self {
            Socket::Tcp(s) => s.set_read_timeout(t).and_then(|()| s.set_write_timeout(t)),
            Socket::Unix(s) => s.set_read_timeout(t).and_then(|()| s.set_write_timeout(t)),
        }
    }
}

impl Read for Socket {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Socket::Tcp(s) => s.read(buf),
            Socket::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Socket {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Socket::Tcp(s) => s.write(buf),
            Socket::Unix(s) => s.write(buf),
        }
    }
    /// One `writev` for many buffers: rustls hands over every TLS record it holds at once
    /// (up to 64), which the default (the first buffer only) would send one syscall each.
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Socket::Tcp(s) => s.write_vectored(bufs),
            Socket::Unix(s) => s.write_vectored(bufs),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match self {
            Socket::Tcp(s) => s.flush(),
            Socket::Unix(s) => s.flush(),
        }
    }
}

/// The send buffer a pre-copy round's writers ask for on their TCP connections
/// ([`Connection::enlarge_send_buffer`]; the kernel doubles it for its own bookkeeping, and caps
/// the request at `net.core.wmem_max`, 4 MiB by default). Connections that only answer
/// post-copy's requests keep the kernel's autotuning.
///
/// A pages connection's writer compresses a frame and then writes it: while it compresses, the
/// link carries only what the socket already holds. Left to autotuning on a link with little
/// delay (a veth, a LAN) the buffer stays near the bandwidth-delay product, a few hundred KiB,
/// which a 1 Gbit/s link drains before the next frame is compressed; a buffer that holds several
/// compressed frames keeps it busy instead. It bounds memory the kernel may hold per connection,
/// not what it does hold: a link faster than compression never fills it.
pub const SEND_BUFFER_BYTES: usize = 4 << 20;

#[allow(clippy::cast_possible_truncation)] // SEND_BUFFER_BYTES is a few MiB.
pub(super) fn set_send_buffer(s: &TcpStream) -> io::Result<()> {
    use std::os::fd::AsFd;
    let bytes = SEND_BUFFER_BYTES as libc::c_int;
    guestmem_sys::setsockopt(s.as_fd(), libc::SOL_SOCKET, libc::SO_SNDBUF, &bytes)
}

/// The bytes a TCP socket's read fetches at most (see [`Wire`]).
const READ_AHEAD: usize = 128 << 10;

/// The socket under a connection's rustls. During the handshake a TCP socket is read one TLS
/// record at a time, never past a record's end ([`RecordEdge`]): what follows the handshake
/// stays in the socket, for kernel TLS to take over ([`super::kernel_tls`]). After it, rustls
/// reads at most one TLS record (16 KiB) per call; a TCP socket is read ahead instead, up to
/// [`READ_AHEAD`] bytes per `recv`, and rustls's reads served from there: a pages connection
/// then makes one syscall where it made up to eight, for a copy of what was read, made while it
/// is still in the cache. A Unix socket is read as it is: it also carries file descriptors
/// beside the TLS stream, which a read ahead could take.
#[derive(Debug)]
pub(super) struct Wire {
    pub(super) socket: Socket,
    ahead: Vec<u8>,
    /// The bytes of `ahead` read but not yet handed on.
    at: usize,
    end: usize,
    /// While the handshake runs on a TCP socket: where the current record ends.
    edge: Option<RecordEdge>,
}

impl Wire {
    pub(super) fn new(socket: Socket) -> Wire {
        let (ahead, edge) = match socket {
            Socket::Tcp(_) => (vec![0; READ_AHEAD], Some(RecordEdge::default())),
            Socket::Unix(_) => (Vec::new(), None),
        };
        Wire {
            socket,
            ahead,
            at: 0,
            end: 0,
            edge,
        }
    }

    /// The handshake is over: reads go ahead from now on.
    pub(super) fn handshake_done(&mut self) {
        self.edge = None;
    }
}

/// The TLS record a read is in (its 5-byte header, then its body of the length the header
/// gives), so that a read stops at its end.
#[derive(Debug, Default)]
pub(super) struct RecordEdge {
    header: [u8; 5],
    /// Bytes of the header read; when 5, `body_left` bytes of the body are still to come.
    got: usize,
    body_left: usize,
}

impl RecordEdge {
    /// How much of `len` bytes a read may take without crossing the record's end.
    fn allowed(&self, len: usize) -> usize {
        if self.got < self.header.len() {
            len.min(self.header.len() - self.got)
        } else {
            len.min(self.body_left)
        }
    }

    /// Accounts for `bytes`, just read.
    fn took(&mut self, bytes: &[u8]) {
        if self.got < self.header.len() {
            self.header[self.got..self.got + bytes.len()].copy_from_slice(bytes);
            self.got += bytes.len();
            if self.got == self.header.len() {
                self.body_left = usize::from(u16::from_be_bytes([self.header[3], self.header[4]]));
            }
        } else {
            self.body_left -= bytes.len();
        }
        if self.got == self.header.len() && self.body_left == 0 {
            self.got = 0;
        }
    }
}

impl Read for Wire {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if let Some(edge) = &mut self.edge {
            let allowed = edge.allowed(buf.len());
            let n = self.socket.read(&mut buf[..allowed])?;
            edge.took(&buf[..n]);
            return Ok(n);
        }
        if self.at == self.end {
            if buf.len() >= self.ahead.len() {
                return self.socket.read(buf);
            }
            self.end = self.socket.read(&mut self.ahead)?;
            self.at = 0;
        }
        let n = buf.len().min(self.end - self.at);
        buf[..n].copy_from_slice(&self.ahead[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

impl Write for Wire {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.socket.write(buf)
    }
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        self.socket.write_vectored(bufs)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.socket.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A zero timeout bounds a read (the smallest bound) instead of lifting the bound.
    #[test]
    fn a_zero_timeout_still_bounds_a_read() {
        let (a, _b) = UnixStream::pair().unwrap();
        let mut s = Socket::Unix(a);
        s.set_timeouts(Some(Duration::ZERO)).unwrap();
        let started = Instant::now();
        let e = s.read(&mut [0u8; 1]).unwrap_err();
        assert!(
            matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ),
            "{e}"
        );
        assert!(started.elapsed() < Duration::from_secs(1));
    }

    /// Cutting the reads ends a blocked read at once while writes still reach the peer; a
    /// full cut ends the writes too.
    #[test]
    fn cutting_reads_leaves_writes() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let mut s = Socket::Unix(a);
        let cutter = Cutter(s.try_clone().unwrap());
        let mut reader = s.try_clone().unwrap();
        let blocked = std::thread::spawn(move || reader.read(&mut [0u8; 1]).unwrap());
        std::thread::sleep(Duration::from_millis(20));
        cutter.cut_reads();
        assert_eq!(blocked.join().unwrap(), 0);
        s.write_all(b"abort").unwrap();
        let mut got = [0u8; 5];
        b.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"abort");
        cutter.cut();
        assert!(s.write_all(b"x").is_err());
    }

    /// A TCP send buffer is enlarged to what was asked, as far as the kernel's cap allows.
    #[test]
    fn the_send_buffer_is_enlarged() {
        use std::os::fd::AsRawFd;
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let s = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let sndbuf = || {
            let mut v: libc::c_int = 0;
            let mut len = libc::socklen_t::try_from(std::mem::size_of::<libc::c_int>()).unwrap();
            // SAFETY: SO_SNDBUF writes one c_int into `v`, live and that long.
            let r = unsafe {
                libc::getsockopt(
                    s.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_SNDBUF,
                    std::ptr::addr_of_mut!(v).cast(),
                    &raw mut len,
                )
            };
            assert_eq!(r, 0);
            u64::try_from(v).unwrap()
        };
        let before = sndbuf();
        set_send_buffer(&s).unwrap();
        let cap: u64 = std::fs::read_to_string("/proc/sys/net/core/wmem_max")
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        // The kernel doubles what it is given for its bookkeeping.
        assert_eq!(
            sndbuf(),
            2 * (SEND_BUFFER_BYTES as u64).min(cap),
            "was {before}"
        );
    }

    /// A TCP socket is read ahead: a small read leaves the rest of what arrived in the
    /// wire's buffer, and reads of any size, small or larger than the read ahead, give the
    /// bytes in order; writes of many buffers go whole.
    #[test]
    fn tcp_reads_ahead_and_keeps_the_order() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut peer = Socket::Tcp(TcpStream::connect(listener.local_addr().unwrap()).unwrap());
        let mut wire = Wire::new(Socket::Tcp(listener.accept().unwrap().0));
        wire.handshake_done();
        let bytes: Vec<u8> = (0..3 * READ_AHEAD + 777)
            .map(|i| u8::try_from(i * 7 % 251).expect("below 251"))
            .collect();
        let sender = std::thread::spawn(move || {
            let (a, b) = bytes.split_at(1000);
            let n = peer
                .write_vectored(&[io::IoSlice::new(a), io::IoSlice::new(b)])
                .unwrap();
            assert!(n > a.len(), "{n} bytes of the first buffer only");
            peer.write_all(&bytes[n..]).unwrap();
            bytes
        });
        let mut got = vec![0u8; 16];
        wire.read_exact(&mut got).unwrap();
        assert!(wire.end > wire.at, "nothing read ahead");
        for size in [5, 16 << 10, READ_AHEAD + 3, 1] {
            let mut piece = vec![0u8; size];
            wire.read_exact(&mut piece).unwrap();
            got.extend_from_slice(&piece);
        }
        let mut rest = Vec::new();
        wire.read_to_end(&mut rest).unwrap();
        got.extend_from_slice(&rest);
        assert!(got == sender.join().unwrap());
    }

    /// During the handshake a TCP socket is read a TLS record at a time: a read never takes
    /// a byte past the end of the record it is in, whatever it asks for, so what follows the
    /// handshake stays in the socket; records of any length (none, one byte, the largest)
    /// are followed across reads of any size.
    #[test]
    fn handshake_reads_stop_at_each_record_end() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut peer = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let mut wire = Wire::new(Socket::Tcp(listener.accept().unwrap().0));
        let record = |kind: u8, len: usize| -> Vec<u8> {
            let mut r = vec![kind, 3, 3];
            r.extend_from_slice(&u16::try_from(len).unwrap().to_be_bytes());
            r.extend((0..len).map(|i| u8::try_from(i % 251).expect("below 251")));
            r
        };
        let records = [
            record(22, 300),
            record(23, 0),
            record(23, 1),
            record(23, 16 * 1024 + 256),
        ];
        let all: Vec<u8> = records.concat();
        peer.write_all(&all).unwrap();
        peer.write_all(b"after the handshake").unwrap();
        // Whatever was asked, each read ended inside its record or at its end.
        let mut ends = Vec::new();
        let mut at = 0;
        let mut got = Vec::new();
        for ask in [3usize, 100, 1 << 20, 7].iter().cycle() {
            if at == all.len() {
                break;
            }
            let mut buf = vec![0u8; *ask];
            let n = wire.read(&mut buf).unwrap();
            assert!(n > 0);
            got.extend_from_slice(&buf[..n]);
            at += n;
            ends.push(at);
        }
        assert!(got == all);
        let mut boundaries = vec![0];
        for r in &records {
            let last = *boundaries.last().unwrap();
            boundaries.push(last + 5);
            boundaries.push(last + r.len());
        }
        for w in ends.windows(2) {
            let crossed = boundaries.iter().any(|b| w[0] < *b && *b < w[1]);
            assert!(
                !crossed,
                "a read from {} to {} crossed a record's end",
                w[0], w[1]
            );
        }
        // Past the handshake, what followed is read as it is.
        wire.handshake_done();
        let mut rest = [0u8; 19];
        wire.read_exact(&mut rest).unwrap();
        assert_eq!(&rest, b"after the handshake");
    }

    /// A Unix socket is read as asked, never ahead: bytes after a read stay in the socket
    /// (where a descriptor passed beside the TLS stream waits for its own read).
    #[test]
    fn unix_reads_are_not_read_ahead() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let mut raw = a.try_clone().unwrap();
        raw.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut wire = Wire::new(Socket::Unix(a));
        b.write_all(b"headrest").unwrap();
        let mut head = [0u8; 4];
        wire.read_exact(&mut head).unwrap();
        let mut rest = [0u8; 4];
        raw.read_exact(&mut rest).unwrap();
        assert_eq!((&head, &rest), (b"head", b"rest"));
    }
}
