//! Migration channels: TCP or Unix stream sockets inside mutually authenticated TLS.
//!
//! Both peers hold a certificate signed by the same migration CA ([`generate_credentials`] makes
//! one set); the destination listens and only accepts a source whose certificate the CA signed
//! for the source's role (`guestmem-source`), and the source only talks to a destination whose
//! certificate the CA signed for the destination's role (`guestmem-destination`). Anything else
//! fails the handshake, before a byte of guest memory moves (the destination checks the
//! source's role after the handshake, and answers a wrong one with an Abort naming it). Each
//! side checks its own certificate when it loads it (signed by the CA, valid now, of its role),
//! warns of a problem and names it again with any handshake that fails, so that a side whose
//! own certificate expired says so instead of seeing the peer hang up; a side whose peer
//! refused it names the TLS alert it received.
//!
//! **Bounded waits.** Every wait on a peer is bounded, and its error names the wait and the
//! peer: connecting and the TLS handshake take at most [`HANDSHAKE_TIMEOUT`] (a peer that
//! connects and says nothing is dropped after it), and a read or write on an established
//! connection waits at most [`IDLE_TIMEOUT`] for the peer ([`Timeouts`] changes both, e.g. for
//! tests).

use std::any::Any;
use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use rustls::client::danger::ServerCertVerifier;
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::{
    ClientConfig, ClientConnection, RootCertStore, ServerConfig, ServerConnection, StreamOwned,
};

/// The names the two roles' certificates carry (and that each side checks in the other's).
pub const SOURCE_NAME: &str = "guestmem-source";
/// The name a destination's certificate carries.
pub const DESTINATION_NAME: &str = "guestmem-destination";

/// How long establishing one migration connection may take: the TCP (or Unix) connect, the TLS
/// handshake and the peer's first frame (its Hello, and the answer to it). A peer that connects
/// and then sends nothing, or dribbles, is dropped once it is over, so it holds nobody up.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a read or a write on an established migration connection may wait for the peer.
/// Every phase of the protocol keeps each connection busy well within it (post-copy's quiet
/// connections carry heartbeats, [`crate::migrate::HEARTBEAT_INTERVAL`]): a peer silent for
/// this long is dead, stuck or cut off, and the connection fails naming it.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(15);

/// The bounds of a connection's waits (the defaults: [`HANDSHAKE_TIMEOUT`], [`IDLE_TIMEOUT`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// Connect, TLS handshake and first frame of a connection; a migration's other connections after its first.
    pub handshake: Duration,
    /// Any read or write on an established connection.
    pub idle: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            handshake: HANDSHAKE_TIMEOUT,
            idle: IDLE_TIMEOUT,
        }
    }
}

/// Why a connection could not be made or used.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// Not an endpoint.
    #[error("'{0}' is not an endpoint (expected tcp:HOST:PORT or unix:PATH)")]
    BadEndpoint(String),
    /// A socket operation failed.
    #[error("{what}")]
    Io {
        /// What was being done.
        what: String,
        /// The underlying error.
        #[source]
        error: io::Error,
    },
    /// Nothing listens at the endpoint (connection refused, or no such socket).
    #[error("connect to {endpoint}: nothing listens there")]
    Unreachable {
        /// The endpoint.
        endpoint: String,
        /// The underlying error.
        #[source]
        error: io::Error,
    },
    /// A credentials file that cannot be read (missing, unreadable).
    #[error("cannot read {path}")]
    CredentialsUnreadable {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Credentials that cannot be loaded or used.
    #[error("{path}: {reason}")]
    Credentials {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The TLS handshake or a TLS operation failed.
    #[error("TLS with {peer} failed: {reason}")]
    Tls {
        /// The peer.
        peer: String,
        /// Why.
        reason: String,
    },
    /// A wait on the peer outlived its bound.
    #[error("{wait} with {peer} did not end within {} s (the bound of that wait)", .after.as_secs_f64())]
    Timeout {
        /// The wait.
        wait: &'static str,
        /// The peer.
        peer: String,
        /// Its bound.
        after: Duration,
    },
    /// The TLS configuration cannot be built.
    #[error("TLS setup: {0}")]
    Setup(String),
}

impl TransportError {
    /// Whether nothing listens at the peer's endpoint (as opposed to a peer that answered).
    pub fn is_unreachable(&self) -> bool {
        matches!(self, TransportError::Unreachable { .. })
    }
}

type Result<T> = std::result::Result<T, TransportError>;

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> TransportError {
    let what = what.into();
    move |error| TransportError::Io { what, error }
}

/// Where a peer listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// `tcp:HOST:PORT`.
    Tcp(String),
    /// `unix:PATH`.
    Unix(PathBuf),
}

impl FromStr for Endpoint {
    type Err = TransportError;
    fn from_str(s: &str) -> Result<Endpoint> {
        match s.split_once(':') {
            Some(("tcp", addr))
                if addr
                    .rsplit_once(':')
                    .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok()) =>
            {
                Ok(Endpoint::Tcp(addr.to_string()))
            }
            Some(("unix", path)) if !path.is_empty() => Ok(Endpoint::Unix(PathBuf::from(path))),
            _ => Err(TransportError::BadEndpoint(s.to_string())),
        }
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Tcp(a) => write!(f, "tcp:{a}"),
            Endpoint::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

/// Which side of a migration a peer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The side that sends the guest.
    Source,
    /// The side that receives it.
    Destination,
}

impl Role {
    /// The name in the role's certificate (and of its files in a credentials directory).
    pub fn name(self) -> &'static str {
        match self {
            Role::Source => SOURCE_NAME,
            Role::Destination => DESTINATION_NAME,
        }
    }

    /// The role on the other end.
    pub fn peer(self) -> Role {
        match self {
            Role::Source => Role::Destination,
            Role::Destination => Role::Source,
        }
    }

    fn word(self) -> &'static str {
        match self {
            Role::Source => "source",
            Role::Destination => "destination",
        }
    }
}

/// Whether `cert` names `role` (the peer's role, or our own).
fn names_role(cert: &CertificateDer<'_>, role: Role) -> std::result::Result<(), String> {
    let ee = webpki::EndEntityCert::try_from(cert)
        .map_err(|e| format!("the certificate does not parse: {e}"))?;
    let name = |r: Role| ServerName::try_from(r.name()).expect("a valid DNS name");
    if ee.verify_is_valid_for_subject_name(&name(role)).is_ok() {
        return Ok(());
    }
    let other = role.peer();
    if ee.verify_is_valid_for_subject_name(&name(other)).is_ok() {
        return Err(format!(
            "it is a {} certificate ({}), where a {} one ({}) is required",
            other.word(),
            other.name(),
            role.word(),
            role.name()
        ));
    }
    Err(format!(
        "it names neither role, where a {} certificate ({}) is required",
        role.word(),
        role.name()
    ))
}

/// A PEM file that failed to load: unreadable (its I/O error as the source), or not holding
/// a `what`.
fn pem_error(path: PathBuf, what: &str, e: rustls::pki_types::pem::Error) -> TransportError {
    match e {
        rustls::pki_types::pem::Error::Io(source) => {
            TransportError::CredentialsUnreadable { path, source }
        }
        e => TransportError::Credentials {
            path,
            reason: format!("not a PEM {what}: {e}"),
        },
    }
}

/// One peer's credentials: the migration CA's certificate and its own certificate and key, read
/// from `DIR/ca.pem`, `DIR/<role>.pem` and `DIR/<role>.key`.
pub struct Credentials {
    ca: CertificateDer<'static>,
    cert: CertificateDer<'static>,
    key: PrivateKeyDer<'static>,
    role: Role,
    /// What is wrong with our own certificate, if anything (see [`Credentials::load`]).
    problem: Option<String>,
}

impl Credentials {
    /// Reads the credentials and checks our own certificate as the peer will: signed by the CA,
    /// valid now, and of `role`. A problem is warned about at once, and named again in the
    /// error of any handshake that fails; the peer has the last word (its clock may differ), and
    /// says why it refuses, so that both sides tell why the handshake failed.
    pub fn load(dir: &Path, role: Role) -> Result<Credentials> {
        let mut creds = Credentials::load_unchecked(dir, role)?;
        if let Err(reason) = creds.check_own() {
            let problem = format!(
                "this {}'s own certificate {} is unusable: {reason}",
                role.word(),
                dir.join(format!("{}.pem", role.name())).display()
            );
            tracing::warn!("{problem}; the peer will refuse it");
            creds.problem = Some(problem);
        }
        Ok(creds)
    }

    /// What is wrong with our own certificate (expired, not yet valid, of the other role, not
    /// signed by the CA), if anything.
    pub fn problem(&self) -> Option<&str> {
        self.problem.as_deref()
    }

    /// [`Credentials::load`] without the check of our own certificate: for tests of what the
    /// peer does with a bad one.
    #[doc(hidden)]
    pub fn load_unchecked(dir: &Path, role: Role) -> Result<Credentials> {
        let cert_path = |name: &str| dir.join(format!("{name}.pem"));
        let read_cert = |path: PathBuf| {
            CertificateDer::from_pem_file(&path).map_err(|e| pem_error(path, "certificate", e))
        };
        let key_path = dir.join(format!("{}.key", role.name()));
        let key = PrivateKeyDer::from_pem_file(&key_path)
            .map_err(|e| pem_error(key_path.clone(), "private key", e))?;
        Ok(Credentials {
            ca: read_cert(cert_path("ca"))?,
            cert: read_cert(cert_path(role.name()))?,
            key,
            role,
            problem: None,
        })
    }

    fn check_own(&self) -> std::result::Result<(), String> {
        names_role(&self.cert, self.role)?;
        let roots = self.roots().map_err(|e| e.to_string())?;
        let now = UnixTime::now();
        let checked = match self.role {
            Role::Source => WebPkiClientVerifier::builder_with_provider(roots, provider())
                .build()
                .map_err(|e| e.to_string())?
                .verify_client_cert(&self.cert, &[], now)
                .map(|_| ()),
            Role::Destination => WebPkiServerVerifier::builder_with_provider(roots, provider())
                .build()
                .map_err(|e| e.to_string())?
                .verify_server_cert(
                    &self.cert,
                    &[],
                    &ServerName::try_from(DESTINATION_NAME).expect("a valid DNS name"),
                    &[],
                    now,
                )
                .map(|_| ()),
        };
        checked.map_err(|e| e.to_string())
    }

    fn roots(&self) -> Result<Arc<RootCertStore>> {
        let mut roots = RootCertStore::empty();
        roots
            .add(self.ca.clone())
            .map_err(|e| TransportError::Setup(format!("the CA certificate is unusable: {e}")))?;
        Ok(Arc::new(roots))
    }
}

/// Writes a fresh migration CA and a certificate and key for each role into `dir`.
pub fn generate_credentials(dir: &Path) -> Result<()> {
    write_credentials(dir, |_, _| {})
}

/// [`generate_credentials`], with `tweak` applied to each role's certificate parameters (tests
/// make expired certificates with it).
#[doc(hidden)]
pub fn write_credentials(
    dir: &Path,
    tweak: impl Fn(Role, &mut rcgen::CertificateParams),
) -> Result<()> {
    let tls = |e: rcgen::Error| TransportError::Setup(format!("generating credentials: {e}"));
    std::fs::create_dir_all(dir).map_err(io_err(format!("{}: create", dir.display())))?;
    let ca_key = rcgen::KeyPair::generate().map_err(tls)?;
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(tls)?;
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "guestmem migration CA");
    let ca_cert = ca_params.self_signed(&ca_key).map_err(tls)?;
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let write = |name: &str, contents: String| {
        let path = dir.join(name);
        std::fs::write(&path, contents).map_err(io_err(format!("{}: write", path.display())))
    };
    write("ca.pem", ca_cert.pem())?;
    for role in [Role::Source, Role::Destination] {
        let key = rcgen::KeyPair::generate().map_err(tls)?;
        let mut params =
            rcgen::CertificateParams::new(vec![role.name().to_string()]).map_err(tls)?;
        tweak(role, &mut params);
        let cert = params.signed_by(&key, &issuer).map_err(tls)?;
        write(&format!("{}.pem", role.name()), cert.pem())?;
        write(&format!("{}.key", role.name()), key.serialize_pem())?;
    }
    Ok(())
}

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
            None if e.kind() == io::ErrorKind::UnexpectedEof => io::Error::new(
                e.kind(),
                format!(
                    "{} closed the connection in the middle of the stream (it ended, died or \
                     was cut off)",
                    self.peer
                ),
            ),
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
fn with_own(reason: String, own: Option<&str>) -> String {
    match own {
        Some(own) => format!("{reason} ({own})"),
        None => reason,
    }
}

/// The rustls error inside an I/O error, if it is one.
fn tls_error(e: &io::Error) -> Option<&rustls::Error> {
    e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>())
}

/// What a TLS failure means, in the terms of a migration.
fn explain_tls(e: &rustls::Error, peer: &str) -> String {
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

/// Measures how fast a connection's link carries what its writer queued: the bytes the socket's
/// queue lost over the time that passed, both between two writes and during one (what was
/// queued before, plus what was written, less what is queued after), counted only while the
/// queue stayed long (then the link, not the writer, set the pace) and summed until they make a
/// sample of [`LinkGauge::SAMPLE_BYTES`] (acknowledgements come in whole segments, so shorter
/// spans would read too fast or too slow). With a send buffer that holds several frames
/// ([`SEND_BUFFER_BYTES`]) a write returns as soon as its bytes are queued, so the time a write
/// blocks no longer tells the link's speed; this does, whether the writer compresses or not.
#[derive(Debug, Default)]
pub struct LinkGauge {
    /// When the last write ended, and what was queued then.
    after: Option<(Instant, u64)>,
    /// When the current write started, and what was queued then.
    before: Option<(Instant, u64)>,
    /// Busy time and bytes drained, not yet a sample.
    pending: (Duration, u64),
}

impl LinkGauge {
    /// A queue at least this long when a span starts means the link never waited for the
    /// writer during it.
    pub const BUSY_BYTES: u64 = 128 << 10;
    /// A sample spans at least this many drained bytes.
    pub const SAMPLE_BYTES: u64 = 1 << 20;

    /// Called just before writing on `conn`.
    pub fn before_write(&mut self, conn: &Connection) {
        let now = conn.queued_bytes().map(|q| (Instant::now(), q));
        if let (Some((t0, q0)), Some((t1, q1))) = (self.after.take(), now) {
            self.span(t1 - t0, q0, 0, q1);
        }
        self.before = now;
    }

    /// Called just after writing `written` bytes on `conn`: a sample of the link, when enough
    /// busy time has gathered.
    pub fn after_write(&mut self, conn: &Connection, written: u64) -> Option<LinkSample> {
        let now = conn.queued_bytes().map(|q| (Instant::now(), q));
        if let (Some((t0, q0)), Some((t1, q1))) = (self.before.take(), now) {
            self.span(t1 - t0, q0, written, q1);
        }
        self.after = now;
        let (elapsed, bytes) = self.pending;
        (bytes >= Self::SAMPLE_BYTES).then(|| {
            self.pending = (Duration::ZERO, 0);
            LinkSample { elapsed, bytes }
        })
    }

    /// A span of `elapsed` that started with `then` bytes queued, added `written`, and ended
    /// with `now` queued: counted if the link was busy, else what had gathered is dropped.
    fn span(&mut self, elapsed: Duration, then: u64, written: u64, now: u64) {
        match (then + written).checked_sub(now) {
            Some(drained) if then >= Self::BUSY_BYTES => {
                self.pending.0 += elapsed;
                self.pending.1 += drained;
            }
            _ => self.pending = (Duration::ZERO, 0),
        }
    }
}

/// Measures the link of a lock-step connection, where each answer written is followed by the
/// peer's next request (post-copy's background fetches): there the queue drains between answers
/// and [`LinkGauge`] never sees it stay long, and the time from an answer to the next request
/// holds the peer's handling of it as much as the link. TCP measures the link itself: on every
/// acknowledgement the kernel takes the rate at which the peer acknowledged the data in flight
/// ([`Connection::delivery_rate`]). The estimate is the median of the last
/// [`AnswerGauge::WINDOW`] such rates: an answer's burst is often shorter than what the link
/// holds in flight, which reads it slow, and a shaper's burst allowance lets a short one through
/// at the speed of the wire beneath, which reads it fast. A Unix socket gives none: its peer is
/// on this host.
#[derive(Debug, Default)]
pub struct AnswerGauge {
    /// The last rates measured, in bytes per second, newest last.
    recent: std::collections::VecDeque<u64>,
}

impl AnswerGauge {
    /// How many recent rates the estimate is the median of.
    pub const WINDOW: usize = 8;

    /// Called when the peer's next request arrived on `conn` (so that the last answer's
    /// acknowledgements are in): the link's estimate, as a sample of [`LinkGauge::SAMPLE_BYTES`].
    pub fn requested(&mut self, conn: &Connection) -> Option<LinkSample> {
        self.rate(conn.delivery_rate())
    }

    fn rate(&mut self, measured: Option<u64>) -> Option<LinkSample> {
        if let Some(rate) = measured.filter(|&r| r > 0) {
            if self.recent.len() == Self::WINDOW {
                self.recent.pop_front();
            }
            self.recent.push_back(rate);
        }
        let mut rates: Vec<u64> = self.recent.iter().copied().collect();
        rates.sort_unstable();
        let median = *rates.get(rates.len() / 2)?;
        let bytes = LinkGauge::SAMPLE_BYTES;
        Some(LinkSample {
            elapsed: Duration::from_secs_f64(bytes as f64 / median as f64),
            bytes,
        })
    }
}

/// A busy link's bytes carried over a time (see [`LinkGauge`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkSample {
    /// How long it took.
    pub elapsed: Duration,
    /// The bytes it carried meanwhile.
    pub bytes: u64,
}

/// Cuts a [`Connection`] (see [`Connection::cutter`]).
pub struct Cutter(Socket);

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

enum Socket {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Socket {
    fn try_clone(&self) -> io::Result<Socket> {
        Ok(match self {
            Socket::Tcp(s) => Socket::Tcp(s.try_clone()?),
            Socket::Unix(s) => Socket::Unix(s.try_clone()?),
        })
    }

    /// Bytes written to the socket that the peer has not yet acknowledged (TCP) or read (a
    /// Unix socket): `SIOCOUTQ`. `None` where the kernel does not say.
    fn queued_bytes(&self) -> Option<u64> {
        use std::os::fd::AsRawFd;
        let fd = match self {
            Socket::Tcp(s) => s.as_raw_fd(),
            Socket::Unix(s) => s.as_raw_fd(),
        };
        let mut queued: libc::c_int = 0;
        // SAFETY: SIOCOUTQ (TIOCOUTQ) writes one c_int into `queued`, which is live and
        // writable; `fd` is the open socket `self` owns.
        let r = unsafe { libc::ioctl(fd, libc::TIOCOUTQ, &mut queued as *mut libc::c_int) };
        (r == 0).then_some(queued.max(0) as u64)
    }

    /// The kernel's latest measure of the rate at which the peer acknowledged this TCP
    /// socket's data, in bytes per second (`TCP_INFO`'s `tcpi_delivery_rate`). `None` for a
    /// Unix socket, before any measure, or where the kernel does not say.
    fn delivery_rate(&self) -> Option<u64> {
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
                &mut len,
            )
        };
        let end = std::mem::offset_of!(libc::tcp_info, tcpi_delivery_rate) + 8;
        (r == 0 && len as usize >= end && info.tcpi_delivery_rate > 0)
            .then_some(info.tcpi_delivery_rate)
    }

    /// Read and write timeouts (shared by every clone of the socket).
    fn set_timeouts(&self, t: Option<Duration>) -> io::Result<()> {
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
    fn flush(&mut self) -> io::Result<()> {
        match self {
            Socket::Tcp(s) => s.flush(),
            Socket::Unix(s) => s.flush(),
        }
    }
}

/// ring's suites with TLS 1.3 AES-128-GCM first (both peers run this provider, so it is the
/// one negotiated): guest memory is the bulk of the traffic, and AES-128 does 10 rounds per
/// block where AES-256 does 14.
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    let mut provider = rustls::crypto::ring::default_provider();
    provider
        .cipher_suites
        .sort_by_key(|s| s.suite() != rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
    Arc::new(provider)
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

fn set_send_buffer(s: &TcpStream) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let bytes = SEND_BUFFER_BYTES as libc::c_int;
    // SAFETY: setsockopt reads `size_of::<c_int>()` bytes from `bytes`, a live c_int, and the
    // fd is the open socket `s` borrows.
    let r = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            (&bytes as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
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
    let name = ServerName::try_from(peer_role.name()).expect("a valid DNS name");
    let conn = ClientConnection::new(Arc::new(config), name)
        .map_err(|e| TransportError::Setup(e.to_string()))?;
    handshake(
        StreamOwned::new(conn, socket),
        peer,
        timeouts,
        creds.problem.clone(),
    )
}

/// The destination's listening socket.
pub struct Listener {
    socket: ListenerSocket,
    config: Arc<ServerConfig>,
    timeouts: Timeouts,
    own_problem: Option<String>,
    /// What admits its connections, attached by the first receive on it (the destination's
    /// gate, one migration at a time): opaque to the transport, which only keeps it.
    pub(crate) gate: OnceLock<Arc<dyn Any + Send + Sync>>,
}

enum ListenerSocket {
    Tcp(TcpListener),
    Unix(UnixListener),
}

/// A socket accepted by a [`Listener`], before its TLS handshake.
pub struct Accepted {
    socket: Socket,
    peer: String,
    config: Arc<ServerConfig>,
    timeouts: Timeouts,
    own_problem: Option<String>,
}

impl Accepted {
    /// Who connected ("the source at 127.0.0.1:40000").
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// The bounds of the connection's waits.
    pub fn timeouts(&self) -> Timeouts {
        self.timeouts
    }

    /// Completes the TLS handshake (which refuses an unauthenticated peer) within the
    /// handshake timeout.
    pub fn handshake(self) -> Result<Connection> {
        let conn =
            ServerConnection::new(self.config).map_err(|e| TransportError::Setup(e.to_string()))?;
        handshake(
            StreamOwned::new(conn, self.socket),
            self.peer,
            self.timeouts,
            self.own_problem,
        )
    }
}

impl Listener {
    /// Listens at `endpoint` as a destination with `creds`.
    pub fn bind(endpoint: &Endpoint, creds: &Credentials) -> Result<Listener> {
        let socket = match endpoint {
            Endpoint::Tcp(addr) => ListenerSocket::Tcp(
                TcpListener::bind(addr).map_err(io_err(format!("listen on {endpoint}")))?,
            ),
            Endpoint::Unix(path) => ListenerSocket::Unix(
                UnixListener::bind(path).map_err(io_err(format!("listen on {endpoint}")))?,
            ),
        };
        let verifier = WebPkiClientVerifier::builder_with_provider(creds.roots()?, provider())
            .build()
            .map_err(|e| TransportError::Setup(e.to_string()))?;
        let config = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TransportError::Setup(e.to_string()))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(vec![creds.cert.clone()], creds.key.clone_key())
            .map_err(|e| {
                TransportError::Setup(format!("our certificate or key is unusable: {e}"))
            })?;
        Ok(Listener {
            socket,
            config: Arc::new(config),
            timeouts: Timeouts::default(),
            own_problem: creds.problem.clone(),
            gate: OnceLock::new(),
        })
    }

    /// The same listener with other bounds for its connections' waits.
    pub fn with_timeouts(mut self, timeouts: Timeouts) -> Listener {
        self.timeouts = timeouts;
        self
    }

    /// The bounds of its connections' waits.
    pub fn timeouts(&self) -> Timeouts {
        self.timeouts
    }

    /// The TCP port actually bound (for `tcp:HOST:0`).
    pub fn port(&self) -> Option<u16> {
        match &self.socket {
            ListenerSocket::Tcp(l) => l.local_addr().ok().map(|a| a.port()),
            ListenerSocket::Unix(_) => None,
        }
    }

    /// Accepts one socket, without its handshake (see [`Accepted::handshake`]).
    pub fn accept_socket(&self) -> Result<Accepted> {
        let (socket, peer) = match &self.socket {
            ListenerSocket::Tcp(l) => {
                let (s, addr) = l.accept().map_err(io_err("accept"))?;
                s.set_nodelay(true).map_err(io_err("TCP_NODELAY"))?;
                (Socket::Tcp(s), format!("the source at {addr}"))
            }
            ListenerSocket::Unix(l) => (
                Socket::Unix(l.accept().map_err(io_err("accept"))?.0),
                "the source on the Unix socket".to_string(),
            ),
        };
        Ok(Accepted {
            socket,
            peer,
            config: self.config.clone(),
            timeouts: self.timeouts,
            own_problem: self.own_problem.clone(),
        })
    }

    /// Accepts one source and completes the TLS handshake (which refuses an unauthenticated one).
    pub fn accept(&self) -> Result<Connection> {
        self.accept_socket()?.handshake()
    }
}

/// Drives the handshake to its end now (within the handshake timeout), so that a refused peer
/// is an error here, not at the first read or write.
fn handshake<C, D>(
    mut stream: StreamOwned<C, Socket>,
    peer: String,
    timeouts: Timeouts,
    own_problem: Option<String>,
) -> Result<Connection>
where
    C: std::ops::DerefMut + std::ops::Deref<Target = rustls::ConnectionCommon<D>> + Send + 'static,
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
    let peer_cert = stream
        .conn
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.clone().into_owned());
    let socket = stream
        .sock
        .try_clone()
        .map_err(io_err("dup of the connection's socket"))?;
    socket
        .set_timeouts(Some(timeouts.idle))
        .map_err(io_err("socket timeout"))?;
    Ok(Connection {
        tls: Box::new(stream),
        socket,
        peer,
        idle: Some(timeouts.idle),
        peer_cert,
        own_problem,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::Frame;

    fn temp_dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("guestmem-tls-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    /// The link's pace is read only while the queue stayed long (the writer was not what the
    /// link waited for), between writes and during them, over a sample's worth of bytes.
    /// The median of the recent delivery rates is the estimate: one spike either way leaves it;
    /// the rates age out after WINDOW others; no measure, no estimate.
    #[test]
    fn answer_gauge_takes_the_median_recent_delivery_rate() {
        let mut g = AnswerGauge::default();
        assert_eq!(g.rate(None), None, "nothing measured yet");
        let mib_per_s =
            |s: LinkSample| (s.bytes as f64 / s.elapsed.as_secs_f64() / 1048576.0).round();
        assert_eq!(g.rate(Some(100 << 20)).map(mib_per_s), Some(100.0));
        g.rate(Some(100 << 20));
        assert_eq!(g.rate(Some(4000 << 20)).map(mib_per_s), Some(100.0));
        assert_eq!(g.rate(Some(1 << 20)).map(mib_per_s), Some(100.0));
        assert_eq!(g.rate(None).map(mib_per_s), Some(100.0));
        for _ in 0..AnswerGauge::WINDOW {
            g.rate(Some(50 << 20));
        }
        assert_eq!(g.rate(None).map(mib_per_s), Some(50.0));
    }

    /// A real TCP connection's delivery rate, once data was acknowledged; none on a Unix
    /// socket.
    #[test]
    fn a_tcp_socket_reports_its_delivery_rate() {
        use std::io::{Read as _, Write as _};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let reader = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut buf = vec![0u8; 1 << 20];
            let mut got = 0;
            while got < 4 << 20 {
                got += s.read(&mut buf).unwrap();
            }
            s.write_all(b"k").unwrap();
        });
        let mut tcp = Socket::Tcp(std::net::TcpStream::connect(addr).unwrap());
        tcp.write_all(&vec![7u8; 4 << 20]).unwrap();
        let mut ack = [0u8; 1];
        tcp.read_exact(&mut ack).unwrap();
        reader.join().unwrap();
        let rate = tcp
            .delivery_rate()
            .expect("a delivery rate after 4 MiB acknowledged");
        assert!(rate > 1 << 20, "{rate} bytes/s on loopback");
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        assert_eq!(Socket::Unix(a).delivery_rate(), None);
    }

    #[test]
    fn a_link_gauge_samples_only_a_busy_link() {
        let ms = Duration::from_millis(1);
        let mut g = LinkGauge::default();
        // Between writes: 512 KiB drained in 1 ms with 2 MiB still queued.
        g.span(ms, (2 << 20) + (512 << 10), 0, 2 << 20);
        // During a write of 1 MiB: 512 KiB drained in 1 ms.
        g.span(ms, 2 << 20, 1 << 20, (2 << 20) + (512 << 10));
        assert_eq!(g.pending, (2 * ms, 1 << 20));
        // The queue ran (nearly) dry: the writer set the pace, what gathered is dropped.
        g.span(ms, 4 << 10, 1 << 20, 1 << 20);
        assert_eq!(g.pending, (Duration::ZERO, 0));
        // A span with nothing drained counts its time (a slow link), and one whose queue grew
        // past what was written is not a link's doing.
        g.span(ms, 1 << 20, 0, 1 << 20);
        assert_eq!(g.pending, (ms, 0));
        g.span(ms, 1 << 20, 0, 2 << 20);
        assert_eq!(g.pending, (Duration::ZERO, 0));
    }

    /// Over a real socket whose reader does not read, the queue holds what was written; once
    /// the reader reads, the gauge sees it drain.
    #[test]
    fn a_link_gauge_reads_the_socket_queue() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let mut socket = Socket::Unix(a);
        assert_eq!(socket.queued_bytes(), Some(0));
        socket.write_all(&[7u8; 100_000]).unwrap();
        assert!(socket.queued_bytes().unwrap() >= 100_000);
        let mut buf = vec![0u8; 100_000];
        b.read_exact(&mut buf).unwrap();
        assert_eq!(socket.queued_bytes(), Some(0));
    }

    #[test]
    fn endpoints_parse_or_name_the_problem() {
        assert_eq!(
            "tcp:127.0.0.1:7000".parse::<Endpoint>().unwrap(),
            Endpoint::Tcp("127.0.0.1:7000".into())
        );
        assert_eq!(
            "unix:/tmp/s".parse::<Endpoint>().unwrap(),
            Endpoint::Unix("/tmp/s".into())
        );
        for bad in [
            "127.0.0.1:7000",
            "tcp:host",
            "tcp::80",
            "tcp:h:99999",
            "unix:",
            "udp:h:1",
        ] {
            let e = bad.parse::<Endpoint>().unwrap_err().to_string();
            assert!(e.contains(bad) && e.contains("tcp:HOST:PORT"), "{e}");
        }
    }

    /// Peers with credentials from one CA talk; a source from another CA is refused by the
    /// destination, and a destination from another CA is refused by the source.
    #[test]
    fn only_peers_of_the_same_ca_talk() {
        let (ours, theirs) = (temp_dir("ours"), temp_dir("theirs"));
        generate_credentials(&ours).unwrap();
        generate_credentials(&theirs).unwrap();
        let dest = Credentials::load(&ours, Role::Destination).unwrap();
        let listener = Listener::bind(&"tcp:127.0.0.1:0".parse().unwrap(), &dest).unwrap();
        let endpoint: Endpoint = format!("tcp:127.0.0.1:{}", listener.port().unwrap())
            .parse()
            .unwrap();

        let server = std::thread::spawn(move || {
            let mut results = Vec::new();
            for _ in 0..2 {
                results.push(
                    listener
                        .accept()
                        .map(|mut ch| Frame::read_from(&mut ch).map_err(|e| e.to_string())),
                );
            }
            results
        });
        let mut good =
            connect(&endpoint, &Credentials::load(&ours, Role::Source).unwrap()).unwrap();
        Frame::Go.write_to(&mut good).unwrap();
        good.flush().unwrap();
        let _stranger = connect(
            &endpoint,
            &Credentials::load(&theirs, Role::Source).unwrap(),
        );
        let results = server.join().unwrap();
        assert!(
            matches!(&results[0], Ok(Ok(Frame::Go))),
            "trusted source: {:?}",
            results[0].as_ref().err()
        );
        assert!(results[1].is_err(), "an untrusted source was accepted");

        // The source refuses a destination its CA did not sign.
        let other_dest = Credentials::load(&theirs, Role::Destination).unwrap();
        let listener = Listener::bind(&"tcp:127.0.0.1:0".parse().unwrap(), &other_dest).unwrap();
        let endpoint: Endpoint = format!("tcp:127.0.0.1:{}", listener.port().unwrap())
            .parse()
            .unwrap();
        let server = std::thread::spawn(move || listener.accept().map(|_| ()));
        let e = connect(&endpoint, &Credentials::load(&ours, Role::Source).unwrap())
            .err()
            .expect("refused");
        assert!(e.to_string().contains("TLS"), "{e}");
        let _ = server.join();
        let _ = std::fs::remove_dir_all(&ours);
        let _ = std::fs::remove_dir_all(&theirs);
    }

    #[test]
    fn unix_sockets_carry_frames_too() {
        let dir = temp_dir("unix");
        generate_credentials(&dir).unwrap();
        let endpoint = Endpoint::Unix(dir.join("sock"));
        let listener = Listener::bind(
            &endpoint,
            &Credentials::load(&dir, Role::Destination).unwrap(),
        )
        .unwrap();
        let server = std::thread::spawn(move || {
            let mut ch = listener.accept().unwrap();
            Frame::read_from(&mut ch).unwrap()
        });
        let mut ch = connect(&endpoint, &Credentials::load(&dir, Role::Source).unwrap()).unwrap();
        let request = Frame::Request {
            gpa: 0x1000,
            len: 0x2000,
        };
        request.write_to(&mut ch).unwrap();
        ch.flush().unwrap();
        assert_eq!(server.join().unwrap(), request);
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn short() -> Timeouts {
        Timeouts {
            handshake: Duration::from_millis(300),
            idle: Duration::from_millis(300),
        }
    }

    fn listen(dir: &Path, creds: &Credentials, timeouts: Timeouts) -> (Listener, Endpoint) {
        let _ = dir;
        let listener = Listener::bind(&"tcp:127.0.0.1:0".parse().unwrap(), creds)
            .unwrap()
            .with_timeouts(timeouts);
        let endpoint = format!("tcp:127.0.0.1:{}", listener.port().unwrap())
            .parse()
            .unwrap();
        (listener, endpoint)
    }

    /// A peer that connects and says nothing is dropped once the handshake timeout is over, on
    /// either side, and the error names the wait and the peer.
    #[test]
    fn a_silent_peer_ends_the_handshake_wait_naming_it() {
        let dir = temp_dir("silent");
        generate_credentials(&dir).unwrap();
        let dest = Credentials::load(&dir, Role::Destination).unwrap();
        let (listener, endpoint) = listen(&dir, &dest, short());
        let Endpoint::Tcp(addr) = &endpoint else {
            unreachable!()
        };
        let _silent = TcpStream::connect(addr).unwrap();
        let started = Instant::now();
        let e = listener.accept().err().expect("a silent peer").to_string();
        assert!(started.elapsed() < Duration::from_secs(3), "{e}");
        assert!(
            e.contains("the TLS handshake with the source at 127.0.0.1:")
                && e.contains("within 0.3 s"),
            "{e}"
        );

        // A destination that accepts and says nothing.
        let mute = TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint: Endpoint = format!("tcp:{}", mute.local_addr().unwrap())
            .parse()
            .unwrap();
        let source = Credentials::load(&dir, Role::Source).unwrap();
        let e = connect_with(&endpoint, &source, short())
            .err()
            .expect("a mute destination")
            .to_string();
        assert!(
            e.contains("the TLS handshake with the destination at tcp:127.0.0.1:"),
            "{e}"
        );
        drop(mute);
        // Nothing listens there any more: said as such.
        let e = connect_with(&endpoint, &source, short()).err().unwrap();
        assert!(e.is_unreachable(), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Credentials whose `expired` role's certificate ended in 2021.
    fn expired(name: &str, expired: Role) -> PathBuf {
        let dir = temp_dir(name);
        write_credentials(&dir, |role, params| {
            if role == expired {
                params.not_before = rcgen::date_time_ymd(2020, 1, 1);
                params.not_after = rcgen::date_time_ymd(2021, 1, 1);
            }
        })
        .unwrap();
        dir
    }

    /// An expired source certificate: the source says so when it loads it; the destination
    /// refuses it saying why, and the source names the alert it received and its own problem.
    #[test]
    fn an_expired_source_certificate_is_named_by_both_sides() {
        let dir = expired("expired-source", Role::Source);
        let source = Credentials::load(&dir, Role::Source).unwrap();
        let problem = source
            .problem()
            .expect("an expired certificate")
            .to_string();
        assert!(
            problem.contains("guestmem-source.pem") && problem.contains("expired"),
            "{problem}"
        );
        let dest = Credentials::load(&dir, Role::Destination).unwrap();
        let (listener, endpoint) = listen(&dir, &dest, Timeouts::default());
        let server = std::thread::spawn(move || listener.accept().map(|_| ()));
        // TLS 1.3: the client's handshake ends before the server checked its certificate; the
        // verdict comes with the first read (or write).
        let e = connect(&endpoint, &source)
            .and_then(|mut c| {
                let mut byte = [0u8; 1];
                Frame::Go
                    .write_to(&mut c)
                    .map_err(|e| TransportError::Setup(e.to_string()))?;
                c.read(&mut byte).map_err(io_err("read"))?;
                Ok(())
            })
            .expect_err("refused");
        // The TLS alert is the read's cause.
        let e = crate::error_chain(&e, ": ");
        assert!(
            e.contains("refused the TLS handshake: our certificate has expired")
                && e.contains(&problem),
            "{e}"
        );
        let e = server.join().unwrap().expect_err("refused").to_string();
        assert!(e.contains("the source at") && e.contains("expired"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// An expired destination certificate: the destination says so when it loads it; the
    /// source refuses it saying why, and the destination names the alert and its own problem.
    #[test]
    fn an_expired_destination_certificate_is_named_by_both_sides() {
        let dir = expired("expired-dest", Role::Destination);
        let dest = Credentials::load(&dir, Role::Destination).unwrap();
        let problem = dest.problem().expect("an expired certificate").to_string();
        assert!(
            problem.contains("guestmem-destination.pem") && problem.contains("expired"),
            "{problem}"
        );
        let (listener, endpoint) = listen(&dir, &dest, Timeouts::default());
        let server = std::thread::spawn(move || listener.accept().map(|_| ()));
        let source = Credentials::load(&dir, Role::Source).unwrap();
        let e = connect(&endpoint, &source)
            .err()
            .expect("refused")
            .to_string();
        assert!(
            e.contains("the destination at tcp:127.0.0.1:") && e.contains("expired"),
            "{e}"
        );
        let e = server.join().unwrap().expect_err("refused").to_string();
        assert!(
            e.contains("CertificateExpired") && e.contains(&problem),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// `dir`'s `from` certificate and key, copied as the `to` role's.
    fn swapped(dir: &Path, name: &str, from: Role, to: Role) -> PathBuf {
        let out = temp_dir(name);
        std::fs::create_dir_all(&out).unwrap();
        std::fs::copy(dir.join("ca.pem"), out.join("ca.pem")).unwrap();
        for ext in ["pem", "key"] {
            std::fs::copy(
                dir.join(format!("{}.{ext}", from.name())),
                out.join(format!("{}.{ext}", to.name())),
            )
            .unwrap();
        }
        out
    }

    /// A source presenting the destination's certificate is refused by the destination naming
    /// the roles (and warned about when loaded); a destination presenting the source's is
    /// refused by the source naming the role, and told so by an alert.
    #[test]
    fn each_side_must_present_its_own_role() {
        let dir = temp_dir("roles");
        generate_credentials(&dir).unwrap();
        let fake_source = swapped(&dir, "roles-src", Role::Destination, Role::Source);
        let fake = Credentials::load(&fake_source, Role::Source).unwrap();
        let e = fake.problem().expect("the wrong role");
        assert!(
            e.contains(
                "it is a destination certificate (guestmem-destination), where a source \
                 one (guestmem-source) is required"
            ),
            "{e}"
        );
        let dest = Credentials::load(&dir, Role::Destination).unwrap();
        let (listener, endpoint) = listen(&dir, &dest, Timeouts::default());
        let server =
            std::thread::spawn(move || listener.accept().unwrap().check_peer_role(Role::Source));
        let _conn = connect(&endpoint, &fake).unwrap();
        let e = server.join().unwrap().expect_err("the wrong role");
        assert!(
            e.contains("the source at 127.0.0.1:")
                && e.contains("it is a destination certificate (guestmem-destination)"),
            "{e}"
        );

        let fake_dest = swapped(&dir, "roles-dst", Role::Source, Role::Destination);
        let dest = Credentials::load(&fake_dest, Role::Destination).unwrap();
        let e = dest.problem().expect("the wrong role");
        assert!(e.contains("it is a source certificate"), "{e}");
        let (listener, endpoint) = listen(&dir, &dest, Timeouts::default());
        let server = std::thread::spawn(move || listener.accept().map(|_| ()));
        let e = connect(&endpoint, &Credentials::load(&dir, Role::Source).unwrap())
            .err()
            .expect("refused")
            .to_string();
        assert!(
            e.contains("presented a certificate of the wrong role")
                && e.contains("guestmem-destination"),
            "{e}"
        );
        let e = server.join().unwrap().expect_err("refused").to_string();
        assert!(e.contains("wrong role or name"), "{e}");
        for d in [dir, fake_source, fake_dest] {
            let _ = std::fs::remove_dir_all(&d);
        }
    }

    /// A missing file cannot be read (its OS error the source, once); a file that is there but
    /// holds no key is not a PEM private key.
    #[test]
    fn missing_credentials_name_the_file() {
        let e = Credentials::load(Path::new("/nonexistent-guestmem"), Role::Source)
            .err()
            .unwrap();
        let TransportError::CredentialsUnreadable { path, source } = &e else {
            panic!("{e:?}");
        };
        assert_eq!(
            path,
            Path::new("/nonexistent-guestmem/guestmem-source.key"),
            "{e}"
        );
        assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
        assert_eq!(
            e.to_string(),
            "cannot read /nonexistent-guestmem/guestmem-source.key"
        );
        let dir = temp_dir("junk-key");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("guestmem-source.key"), "not a key\n").unwrap();
        let e = Credentials::load(&dir, Role::Source)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("not a PEM private key"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
