//! One TLS connection to the peer: connecting, the handshake, bounded reads and writes, and the errors that name the peer.

use super::*;

/// A byte stream to the peer, authenticated and encrypted.
pub trait Channel: Read + Write + Send {}
impl<T: Read + Write + Send> Channel for T {}

/// One TLS connection to the peer, with a handle that can cut it from another thread. Its reads
/// and writes wait at most the idle timeout for the peer; the error then names the peer.
pub struct Connection {
    tls: Box<dyn Channel>,
    socket: Socket,
    /// Who is on the other end, for errors ("the destination at tcp:...").
    peer: String,
    idle: Option<Duration>,
    /// The certificate the peer presented.
    peer_cert: Option<CertificateDer<'static>>,
    /// What is wrong with our own certificate (named with any TLS failure).
    own_problem: Option<String>,
    /// Whether the kernel encrypts and decrypts its records ([`kernel_tls`]).
    kernel_tls: bool,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("peer", &self.peer)
            .field("socket", &self.socket)
            .field("idle", &self.idle)
            .finish_non_exhaustive()
    }
}

impl Connection {
    /// A handle that shuts the underlying socket down (both ways), which ends any read or write
    /// blocked on it, in whatever thread, with an error.
    pub fn cutter(&self) -> io::Result<Cutter> {
        Ok(Cutter(self.socket.try_clone()?))
    }

    /// Bytes written that the peer has not acknowledged (TCP) or read (Unix) yet: what the
    /// link still has to carry of what was written (see [`LinkGauge`]). `None` where the
    /// kernel does not say.
    pub fn queued_bytes(&self) -> Option<u64> {
        self.socket.queued_bytes()
    }

    /// Gives a TCP connection a send buffer of [`SEND_BUFFER_BYTES`] (the kernel's
    /// autotuning of it ends there); a Unix socket is left as it is.
    pub fn enlarge_send_buffer(&self) -> io::Result<()> {
        match &self.socket {
            Socket::Tcp(s) => set_send_buffer(s),
            Socket::Unix(_) => Ok(()),
        }
    }

    /// The rate at which the peer acknowledged what was written, as the kernel last measured
    /// it (TCP), in bytes per second (see [`AnswerGauge`]).
    pub fn delivery_rate(&self) -> Option<u64> {
        self.socket.delivery_rate()
    }

    /// Whether the kernel encrypts and decrypts this connection's TLS records (kernel TLS),
    /// rather than rustls in this process.
    pub fn kernel_tls(&self) -> bool {
        self.kernel_tls
    }

    /// Whether the peer is on this host (a Unix socket): only then can fds be handed over.
    pub fn is_local(&self) -> bool {
        matches!(self.socket, Socket::Unix(_))
    }

    /// Who is on the other end ("the source at 127.0.0.1:40000").
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Checks that the peer's certificate is of `role` (the destination checks that a source
    /// connects, not another destination).
    pub fn check_peer_role(&self, role: Role) -> std::result::Result<(), String> {
        let cert = self
            .peer_cert
            .as_ref()
            .ok_or_else(|| format!("{} presented no certificate", self.peer))?;
        names_role(cert, role).map_err(|why| {
            format!(
                "{} presented a certificate of the wrong role: {why}",
                self.peer
            )
        })
    }

    /// Hands `fds` to the peer over the Unix socket, one `SCM_RIGHTS` message of one byte each,
    /// outside the TLS stream: both sides must be at a point of the protocol where no TLS data
    /// is in flight (the receiver asked for them and waits in [`Connection::recv_fds`]).
    pub fn send_fds(&self, fds: &[std::os::fd::RawFd]) -> io::Result<()> {
        use vmm_sys_util::sock_ctrl_msg::ScmSocket;
        let Socket::Unix(s) = &self.socket else {
            return Err(io::Error::other(
                "file descriptors travel only over Unix sockets",
            ));
        };
        for &fd in fds {
            s.send_with_fd(&[1u8][..], fd).map_err(io::Error::other)?;
        }
        Ok(())
    }

    /// Receives `count` fds sent by [`Connection::send_fds`].
    pub fn recv_fds(&self, count: usize) -> io::Result<Vec<std::os::fd::OwnedFd>> {
        use vmm_sys_util::sock_ctrl_msg::ScmSocket;
        let Socket::Unix(s) = &self.socket else {
            return Err(io::Error::other(
                "file descriptors travel only over Unix sockets",
            ));
        };
        (0..count)
            .map(|i| {
                let mut byte = [0u8; 1];
                match s
                    .recv_with_fd(&mut byte)
                    .map_err(|e| self.explain(io::Error::other(e), "sent no memory file"))?
                {
                    (1, Some(file)) => Ok(std::os::fd::OwnedFd::from(file)),
                    _ => Err(io::Error::other(format!(
                        "file descriptor {} of {count} did not come",
                        i + 1
                    ))),
                }
            })
            .collect()
    }

    /// Bounds how long a read or a write waits for the peer (`None`: forever).
    pub fn set_idle_timeout(&mut self, timeout: Option<Duration>) -> io::Result<()> {
        self.socket.set_timeouts(timeout)?;
        self.idle = timeout;
        Ok(())
    }

    /// Turns a socket timeout into an error naming the wait and the peer, and a TLS failure
    /// into one naming the alert.
    fn explain(&self, e: io::Error, what: &str) -> io::Error {
        if matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
        ) {
            return io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "{} {what} for {} s (the idle timeout of a migration connection)",
                    self.peer,
                    self.idle.unwrap_or_default().as_secs_f64()
                ),
            );
        }
        match tls_error(&e) {
            Some(tls) => io::Error::new(
                e.kind(),
                with_own(explain_tls(tls, &self.peer), self.own_problem.as_deref()),
            ),
            // A reset or a broken pipe is the peer gone as well: the kernel's words alone
            // would not say which peer.
            None if matches!(
                e.kind(),
                io::ErrorKind::UnexpectedEof
                    | io::ErrorKind::ConnectionReset
                    | io::ErrorKind::BrokenPipe
            ) =>
            {
                io::Error::new(
                    e.kind(),
                    format!(
                        "{} closed the connection in the middle of the stream (it ended, died or \
                         was cut off)",
                        self.peer
                    ),
                )
            }
            None => e,
        }
    }

    /// After a write failed because the peer hung up: the TLS alert it may have sent first
    /// (it refused our certificate), read within a second.
    fn alert_after(&mut self, e: io::Error) -> io::Error {
        if !matches!(
            e.kind(),
            io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
        ) {
            return e;
        }
        let _ = self.socket.set_timeouts(Some(Duration::from_secs(1)));
        let mut byte = [0u8; 1];
        let alert = match self.tls.read(&mut byte) {
            Err(r) if tls_error(&r).is_some() => Some(r),
            _ => None,
        };
        let _ = self.socket.set_timeouts(self.idle);
        match alert {
            Some(r) => self.explain(r, "sent nothing"),
            None => e,
        }
    }
}

/// `reason`, and what is wrong with our own certificate if anything.
pub(super) fn with_own(reason: String, own: Option<&str>) -> String {
    match own {
        Some(own) => format!("{reason} ({own})"),
        None => reason,
    }
}

/// The rustls error inside an I/O error, if it is one.
pub(super) fn tls_error(e: &io::Error) -> Option<&rustls::Error> {
    e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>())
}

/// What a TLS failure means, in the terms of a migration.
pub(super) fn explain_tls(e: &rustls::Error, peer: &str) -> String {
    use rustls::AlertDescription as A;
    match e {
        rustls::Error::AlertReceived(a) => {
            let why = match a {
                A::CertificateExpired => "our certificate has expired (or is not valid yet)",
                A::UnknownCA => "our certificate is signed by a CA it does not trust",
                A::BadCertificate | A::CertificateUnknown => {
                    "our certificate is not one it accepts (wrong role or name)"
                }
                A::CertificateRequired => "it requires a certificate",
                _ => "it refused the session",
            };
            format!("{peer} refused the TLS handshake: {why} (TLS alert {a:?})")
        }
        rustls::Error::InvalidCertificate(
            c @ (rustls::CertificateError::NotValidForName
            | rustls::CertificateError::NotValidForNameContext { .. }),
        ) => format!(
            "{peer} presented a certificate of the wrong role: {c} (a source must present a \
             {SOURCE_NAME} certificate, a destination a {DESTINATION_NAME} one)"
        ),
        rustls::Error::InvalidCertificate(c) => {
            format!("{peer} presented a certificate we refuse: {c}")
        }
        other => format!("TLS with {peer}: {other}"),
    }
}

impl Read for Connection {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.tls
            .read(buf)
            .map_err(|e| self.explain(e, "sent nothing"))
    }
}

impl Write for Connection {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self.tls.write(buf) {
            Ok(n) => Ok(n),
            Err(e) => {
                let e = self.alert_after(e);
                Err(self.explain(e, "took no data"))
            }
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match self.tls.flush() {
            Ok(()) => Ok(()),
            Err(e) => {
                let e = self.alert_after(e);
                Err(self.explain(e, "took no data"))
            }
        }
    }
}

/// ring's suites with TLS 1.3 AES-128-GCM first (both peers run this provider, so it is the
/// one negotiated): guest memory is the bulk of the traffic, and AES-128 does 10 rounds per
/// block where AES-256 does 14.
pub(super) fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    let mut provider = rustls::crypto::ring::default_provider();
    provider
        .cipher_suites
        .sort_by_key(|s| s.suite() != rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
    Arc::new(provider)
}

/// Connects to the destination at `endpoint` as the source, and completes the TLS handshake
/// (with the default [`Timeouts`]).
pub fn connect(endpoint: &Endpoint, creds: &Credentials) -> Result<Connection> {
    connect_with(endpoint, creds, Timeouts::default())
}

/// [`connect`] with other bounds.
pub fn connect_with(
    endpoint: &Endpoint,
    creds: &Credentials,
    timeouts: Timeouts,
) -> Result<Connection> {
    let peer_role = creds.role.peer();
    let peer = format!("the {} at {endpoint}", peer_role.word());
    let unreachable = |source: io::Error| {
        if matches!(
            source.kind(),
            io::ErrorKind::ConnectionRefused | io::ErrorKind::NotFound
        ) {
            TransportError::Unreachable {
                endpoint: endpoint.to_string(),
                error: source,
            }
        } else if matches!(
            source.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
        ) {
            TransportError::Timeout {
                wait: "connecting",
                peer: peer.clone(),
                after: timeouts.handshake,
            }
        } else {
            TransportError::Io {
                what: format!("connect to {endpoint}"),
                error: source,
            }
        }
    };
    let socket = match endpoint {
        Endpoint::Tcp(addr) => {
            let addrs: Vec<_> = addr
                .to_socket_addrs()
                .map_err(io_err(format!("resolve {endpoint}")))?
                .collect();
            let mut last = io::Error::new(io::ErrorKind::NotFound, "no address");
            let mut stream = None;
            for a in addrs {
                match TcpStream::connect_timeout(&a, timeouts.handshake) {
                    Ok(s) => {
                        stream = Some(s);
                        break;
                    }
                    Err(e) => last = e,
                }
            }
            let s = stream.ok_or_else(|| unreachable(last))?;
            s.set_nodelay(true).map_err(io_err("TCP_NODELAY"))?;
            Socket::Tcp(s)
        }
        Endpoint::Unix(path) => Socket::Unix(UnixStream::connect(path).map_err(unreachable)?),
    };
    let config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TransportError::Setup(e.to_string()))?
        .with_root_certificates(creds.roots()?)
        .with_client_auth_cert(vec![creds.cert.clone()], creds.key.clone_key())
        .map_err(|e| TransportError::Setup(format!("our certificate or key is unusable: {e}")))?;
    let mut config = config;
    // The keys move into the kernel after the handshake where it has TLS (kernel_tls).
    config.enable_secret_extraction = true;
    let name = ServerName::try_from(peer_role.name()).expect("a valid DNS name");
    let conn = ClientConnection::new(Arc::new(config), name)
        .map_err(|e| TransportError::Setup(e.to_string()))?;
    handshake(
        StreamOwned::new(conn, Wire::new(socket)),
        peer,
        timeouts,
        creds.problem.clone(),
    )
}

/// The TLS records a connection holds, encrypted, before its writes wait for the socket: as
/// many as one `writev` sends (rustls hands over 64 at most, of up to 16 KiB each).
const SEND_AHEAD: usize = 1 << 20;

/// Drives the handshake to its end now (within the handshake timeout), so that a refused peer
/// is an error here, not at the first read or write.
pub(super) fn handshake<C, D>(
    mut stream: StreamOwned<C, Wire>,
    peer: String,
    timeouts: Timeouts,
    own_problem: Option<String>,
) -> Result<Connection>
where
    C: kernel_tls::IntoSecrets
        + std::ops::DerefMut
        + std::ops::Deref<Target = rustls::ConnectionCommon<D>>
        + Send
        + 'static,
    D: rustls::SideData + 'static,
{
    let deadline = Instant::now() + timeouts.handshake;
    while stream.conn.is_handshaking() {
        let left = deadline.saturating_duration_since(Instant::now());
        let timed_out = || TransportError::Timeout {
            wait: "the TLS handshake",
            peer: peer.clone(),
            after: timeouts.handshake,
        };
        if left.is_zero() {
            return Err(timed_out());
        }
        stream
            .sock
            .socket
            .set_timeouts(Some(left))
            .map_err(io_err("socket timeout"))?;
        if let Err(e) = stream.conn.complete_io(&mut stream.sock) {
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) {
                return Err(timed_out());
            }
            // Tell the peer why before hanging up (rustls queued the alert).
            let _ = stream.conn.write_tls(&mut stream.sock);
            let reason = match tls_error(&e) {
                Some(tls) => explain_tls(tls, &peer),
                None if e.kind() == io::ErrorKind::UnexpectedEof => {
                    format!(
                        "{peer} hung up during the handshake (it may have refused our certificate)"
                    )
                }
                None => e.to_string(),
            };
            let reason = with_own(reason, own_problem.as_deref());
            return Err(TransportError::Tls { peer, reason });
        }
    }
    // Our last handshake records leave before the keys can move.
    while stream.conn.wants_write() {
        stream
            .conn
            .write_tls(&mut stream.sock)
            .map_err(io_err("sending the end of the TLS handshake"))?;
    }
    let peer_cert = stream
        .conn
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.clone().into_owned());
    let socket = stream
        .sock
        .socket
        .try_clone()
        .map_err(io_err("dup of the connection's socket"))?;
    socket
        .set_timeouts(Some(timeouts.idle))
        .map_err(io_err("socket timeout"))?;
    let (tls, kernel_tls): (Box<dyn Channel>, bool) = match kernel_tls::try_move(stream) {
        Ok(kernel_tls::Moved::Kernel(k)) => (Box::new(k), true),
        Ok(kernel_tls::Moved::Rustls(mut stream, why)) => {
            if let Some(why) = why {
                note_user_space_tls(&why);
            }
            stream.sock.handshake_done();
            // A write of a whole frame is taken at once and leaves in one `writev` of its
            // records (see `Wire`), where rustls's default (64 KiB) cut it in many.
            stream.conn.set_buffer_limit(Some(SEND_AHEAD));
            (Box::new(stream), false)
        }
        Err(reason) => return Err(TransportError::Tls { peer, reason }),
    };
    Ok(Connection {
        tls,
        socket,
        peer,
        idle: Some(timeouts.idle),
        peer_cert,
        own_problem,
        kernel_tls,
    })
}

/// Says once per process why TCP connections keep TLS in user space (rustls).
fn note_user_space_tls(why: &str) {
    static NOTED: std::sync::Once = std::sync::Once::new();
    NOTED.call_once(|| tracing::info!("TLS in user space (rustls): {why}"));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connected pair over `tcp` or a Unix socket, with credentials of one fresh CA: (the
    /// source's end, the destination's end).
    fn pair(name: &str, tcp: bool, timeouts: Timeouts) -> (Connection, Connection) {
        let dir = std::env::temp_dir().join(format!("guestmem-conn-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        generate_credentials(&dir).unwrap();
        let endpoint: Endpoint = if tcp {
            "tcp:127.0.0.1:0".parse().unwrap()
        } else {
            Endpoint::Unix(dir.join("sock"))
        };
        let listener = Listener::bind(
            &endpoint,
            &Credentials::load(&dir, Role::Destination).unwrap(),
        )
        .unwrap()
        .with_timeouts(timeouts);
        let endpoint = match listener.port() {
            Some(port) => format!("tcp:127.0.0.1:{port}").parse().unwrap(),
            None => endpoint,
        };
        let server = std::thread::spawn(move || listener.accept().unwrap());
        let source = Credentials::load(&dir, Role::Source).unwrap();
        let src = connect_with(&endpoint, &source, timeouts).unwrap();
        let dst = server.join().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        (src, dst)
    }

    fn short() -> Timeouts {
        Timeouts {
            handshake: Duration::from_secs(5),
            idle: Duration::from_millis(200),
        }
    }

    /// Each TLS alert a peer may send is explained in the terms of a migration, naming the
    /// peer and the alert; a certificate for another name is called one of the wrong role.
    #[test]
    fn tls_failures_are_explained_naming_the_peer() {
        use rustls::AlertDescription as A;
        let peer = "the destination at tcp:h:1";
        for (alert, why) in [
            (
                A::CertificateExpired,
                "our certificate has expired (or is not valid yet)",
            ),
            (
                A::UnknownCA,
                "our certificate is signed by a CA it does not trust",
            ),
            (
                A::BadCertificate,
                "our certificate is not one it accepts (wrong role or name)",
            ),
            (
                A::CertificateUnknown,
                "our certificate is not one it accepts (wrong role or name)",
            ),
            (A::CertificateRequired, "it requires a certificate"),
            (A::HandshakeFailure, "it refused the session"),
        ] {
            assert_eq!(
                explain_tls(&rustls::Error::AlertReceived(alert), peer),
                format!("{peer} refused the TLS handshake: {why} (TLS alert {alert:?})")
            );
        }
        let wrong = explain_tls(
            &rustls::Error::InvalidCertificate(rustls::CertificateError::NotValidForName),
            peer,
        );
        assert!(
            wrong.starts_with(&format!(
                "{peer} presented a certificate of the wrong role: "
            )) && wrong.ends_with(
                "(a source must present a guestmem-source certificate, a destination a \
                     guestmem-destination one)"
            ),
            "{wrong}"
        );
        let expired = explain_tls(
            &rustls::Error::InvalidCertificate(rustls::CertificateError::Expired),
            peer,
        );
        assert!(
            expired.starts_with(&format!("{peer} presented a certificate we refuse: ")),
            "{expired}"
        );
        assert_eq!(
            explain_tls(&rustls::Error::DecryptError, peer),
            format!("TLS with {peer}: {}", rustls::Error::DecryptError)
        );
        assert_eq!(with_own("r".into(), None), "r");
        assert_eq!(with_own("r".into(), Some("own")), "r (own)");
        let e = io::Error::new(io::ErrorKind::InvalidData, rustls::Error::DecryptError);
        assert_eq!(tls_error(&e), Some(&rustls::Error::DecryptError));
        assert_eq!(tls_error(&io::Error::other("not tls")), None);
    }

    /// Bytes go both ways; a peer silent for the idle timeout ends a read with an error naming
    /// it and the bound; a peer gone mid-stream is named as such.
    #[test]
    fn waits_are_bounded_and_a_lost_peer_is_named() {
        let (mut src, mut dst) = pair("idle", true, short());
        assert!(!src.is_local() && !dst.is_local());
        assert!(
            src.peer().starts_with("the destination at tcp:127.0.0.1:"),
            "{}",
            src.peer()
        );
        assert!(
            dst.peer().starts_with("the source at 127.0.0.1:"),
            "{}",
            dst.peer()
        );
        src.write_all(b"hello").unwrap();
        src.flush().unwrap();
        let mut got = [0u8; 5];
        dst.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"hello");
        assert!(src.delivery_rate().is_some());

        let started = Instant::now();
        let e = dst.read(&mut got).unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(2));
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert_eq!(
            e.to_string(),
            format!(
                "{} sent nothing for 0.2 s (the idle timeout of a migration connection)",
                dst.peer()
            )
        );
        // Unbounded, then the peer is gone without ending the TLS session.
        dst.set_idle_timeout(None).unwrap();
        drop(src);
        let gone = |e: io::Error, peer: &str| {
            assert_eq!(
                e.to_string(),
                format!(
                    "{peer} closed the connection in the middle of the stream (it ended, died \
                     or was cut off)"
                )
            );
            e.kind()
        };
        let peer = dst.peer().to_string();
        let kind = gone(dst.read(&mut got).unwrap_err(), &peer);
        assert!(
            matches!(
                kind,
                io::ErrorKind::ConnectionReset | io::ErrorKind::UnexpectedEof
            ),
            "{kind:?}"
        );
        // A write to a peer gone is named the same way (the first writes may still be taken
        // by the socket, before the peer's reset comes back).
        let write_fails = (0..100).find_map(|_| {
            let r = dst.write_all(&[0u8; 1 << 16]).and_then(|()| dst.flush());
            std::thread::sleep(Duration::from_millis(10));
            r.err()
        });
        let kind = gone(write_fails.expect("writes to a peer gone fail"), &peer);
        assert!(
            matches!(
                kind,
                io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe
            ),
            "{kind:?}"
        );
        // A peer that read all it was sent closes without a reset: an end of file.
        let (mut src, mut dst) = pair("eof", false, short());
        let e = src.read(&mut got).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        drop(src);
        let peer = dst.peer().to_string();
        assert_eq!(
            gone(dst.read(&mut got).unwrap_err(), &peer),
            io::ErrorKind::UnexpectedEof
        );
    }

    /// A cutter ends a read blocked in another thread; file descriptors travel over a Unix
    /// connection (the same open file arrives) and are refused over TCP.
    #[test]
    fn a_cut_ends_a_blocked_read_and_fds_travel_only_locally() {
        let (src, mut dst) = pair("fds", false, Timeouts::default());
        assert!(src.is_local() && dst.is_local());
        assert_eq!(src.enlarge_send_buffer().ok(), Some(()));
        let file = tempfile_with(b"guest memory");
        src.send_fds(&[file.as_raw_fd()]).unwrap();
        let fds = dst.recv_fds(1).unwrap();
        let mut back = [0u8; 12];
        File::from(fds.into_iter().next().unwrap())
            .read_exact_at(&mut back, 0)
            .unwrap();
        assert_eq!(&back, b"guest memory");

        let cutter = dst.cutter().unwrap();
        let reader = std::thread::spawn(move || {
            let mut byte = [0u8; 1];
            dst.read(&mut byte)
        });
        std::thread::sleep(Duration::from_millis(50));
        cutter.cut();
        let ended = reader.join().unwrap();
        assert!(matches!(ended, Ok(0) | Err(_)), "{ended:?}");

        let (tcp, _peer) = pair("fds-tcp", true, Timeouts::default());
        let e = tcp.send_fds(&[file.as_raw_fd()]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "file descriptors travel only over Unix sockets"
        );
        let e = tcp.recv_fds(1).unwrap_err();
        assert_eq!(
            e.to_string(),
            "file descriptors travel only over Unix sockets"
        );
    }

    use std::fs::File;
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;

    fn tempfile_with(bytes: &[u8]) -> File {
        let p = std::env::temp_dir().join(format!("guestmem-conn-fd-{}", std::process::id()));
        std::fs::write(&p, bytes).unwrap();
        let f = File::open(&p).unwrap();
        let _ = std::fs::remove_file(&p);
        f
    }
}
