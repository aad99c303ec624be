//! Migration channels: TCP or Unix stream sockets inside mutually authenticated TLS.
//!
//! Both peers hold a certificate signed by the same migration CA ([`generate_credentials`] makes
//! one set); the destination listens and only accepts a source whose certificate the CA signed,
//! and the source only talks to a destination whose certificate it signed. Anything else fails
//! the handshake, before a byte of guest memory moves.

use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{
    ClientConfig, ClientConnection, RootCertStore, ServerConfig, ServerConnection, StreamOwned,
};

/// The names the two roles' certificates carry (and that each side checks in the other's).
pub const SOURCE_NAME: &str = "guestmem-source";
pub const DESTINATION_NAME: &str = "guestmem-destination";

#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("'{0}' is not an endpoint (expected tcp:HOST:PORT or unix:PATH)")]
    BadEndpoint(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("{path}: {reason}")]
    Credentials { path: PathBuf, reason: String },
    #[error("TLS with the peer failed: {0}")]
    Tls(String),
}

type Result<T> = std::result::Result<T, TransportError>;

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> TransportError {
    let what = what.into();
    move |source| TransportError::Io { what, source }
}

/// Where a peer listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    Tcp(String),
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
    Source,
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
}

/// One peer's credentials: the migration CA's certificate and its own certificate and key, read
/// from `DIR/ca.pem`, `DIR/<role>.pem` and `DIR/<role>.key`.
pub struct Credentials {
    ca: CertificateDer<'static>,
    cert: CertificateDer<'static>,
    key: PrivateKeyDer<'static>,
    role: Role,
}

impl Credentials {
    pub fn load(dir: &Path, role: Role) -> Result<Credentials> {
        let cert_path = |name: &str| dir.join(format!("{name}.pem"));
        let read_cert = |path: PathBuf| {
            CertificateDer::from_pem_file(&path).map_err(|e| TransportError::Credentials {
                path,
                reason: format!("not a PEM certificate: {e}"),
            })
        };
        let key_path = dir.join(format!("{}.key", role.name()));
        let key =
            PrivateKeyDer::from_pem_file(&key_path).map_err(|e| TransportError::Credentials {
                path: key_path.clone(),
                reason: format!("not a PEM private key: {e}"),
            })?;
        Ok(Credentials {
            ca: read_cert(cert_path("ca"))?,
            cert: read_cert(cert_path(role.name()))?,
            key,
            role,
        })
    }

    fn roots(&self) -> Result<Arc<RootCertStore>> {
        let mut roots = RootCertStore::empty();
        roots
            .add(self.ca.clone())
            .map_err(|e| TransportError::Tls(format!("the CA certificate is unusable: {e}")))?;
        Ok(Arc::new(roots))
    }
}

/// Writes a fresh migration CA and a certificate and key for each role into `dir`.
pub fn generate_credentials(dir: &Path) -> Result<()> {
    let tls = |e: rcgen::Error| TransportError::Tls(format!("generating credentials: {e}"));
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
        let params = rcgen::CertificateParams::new(vec![role.name().to_string()]).map_err(tls)?;
        let cert = params.signed_by(&key, &issuer).map_err(tls)?;
        write(&format!("{}.pem", role.name()), cert.pem())?;
        write(&format!("{}.key", role.name()), key.serialize_pem())?;
    }
    Ok(())
}

/// A byte stream to the peer, authenticated and encrypted.
pub trait Channel: Read + Write + Send {}
impl<T: Read + Write + Send> Channel for T {}

/// One TLS connection to the peer, with a handle that can cut it from another thread.
pub struct Connection {
    tls: Box<dyn Channel>,
    socket: Socket,
}

impl Connection {
    /// A handle that shuts the underlying socket down (both ways), which ends any read or write
    /// blocked on it, in whatever thread, with an error.
    pub fn cutter(&self) -> io::Result<Cutter> {
        Ok(Cutter(self.socket.try_clone()?))
    }

    /// Whether the peer is on this host (a Unix socket): only then can fds be handed over.
    pub fn is_local(&self) -> bool {
        matches!(self.socket, Socket::Unix(_))
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
                match s.recv_with_fd(&mut byte).map_err(io::Error::other)? {
                    (1, Some(file)) => Ok(std::os::fd::OwnedFd::from(file)),
                    _ => Err(io::Error::other(format!(
                        "file descriptor {} of {count} did not come",
                        i + 1
                    ))),
                }
            })
            .collect()
    }

    /// Bounds how long a read waits for the peer (`None`: forever).
    pub fn set_read_timeout(&self, timeout: Option<std::time::Duration>) -> io::Result<()> {
        match &self.socket {
            Socket::Tcp(s) => s.set_read_timeout(timeout),
            Socket::Unix(s) => s.set_read_timeout(timeout),
        }
    }
}

impl Read for Connection {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.tls.read(buf)
    }
}

impl Write for Connection {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.tls.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.tls.flush()
    }
}

/// Cuts a [`Connection`] (see [`Connection::cutter`]).
pub struct Cutter(Socket);

impl Cutter {
    pub fn cut(&self) {
        let _ = match &self.0 {
            Socket::Tcp(s) => s.shutdown(std::net::Shutdown::Both),
            Socket::Unix(s) => s.shutdown(std::net::Shutdown::Both),
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

/// Connects to the destination at `endpoint` as the source, and completes the TLS handshake.
pub fn connect(endpoint: &Endpoint, creds: &Credentials) -> Result<Connection> {
    let socket = match endpoint {
        Endpoint::Tcp(addr) => {
            let s = TcpStream::connect(addr).map_err(io_err(format!("connect to {endpoint}")))?;
            s.set_nodelay(true).map_err(io_err("TCP_NODELAY"))?;
            Socket::Tcp(s)
        }
        Endpoint::Unix(path) => Socket::Unix(
            UnixStream::connect(path).map_err(io_err(format!("connect to {endpoint}")))?,
        ),
    };
    let peer = match creds.role {
        Role::Source => Role::Destination,
        Role::Destination => Role::Source,
    };
    let config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TransportError::Tls(e.to_string()))?
        .with_root_certificates(creds.roots()?)
        .with_client_auth_cert(vec![creds.cert.clone()], creds.key.clone_key())
        .map_err(|e| TransportError::Tls(format!("our certificate or key is unusable: {e}")))?;
    let name = ServerName::try_from(peer.name()).expect("a valid DNS name");
    let conn = ClientConnection::new(Arc::new(config), name)
        .map_err(|e| TransportError::Tls(e.to_string()))?;
    handshake(StreamOwned::new(conn, socket))
}

/// The destination's listening socket.
pub struct Listener {
    socket: ListenerSocket,
    config: Arc<ServerConfig>,
}

enum ListenerSocket {
    Tcp(TcpListener),
    Unix(UnixListener),
}

impl Listener {
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
            .map_err(|e| TransportError::Tls(e.to_string()))?;
        let config = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TransportError::Tls(e.to_string()))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(vec![creds.cert.clone()], creds.key.clone_key())
            .map_err(|e| TransportError::Tls(format!("our certificate or key is unusable: {e}")))?;
        Ok(Listener {
            socket,
            config: Arc::new(config),
        })
    }

    /// The TCP port actually bound (for `tcp:HOST:0`).
    pub fn port(&self) -> Option<u16> {
        match &self.socket {
            ListenerSocket::Tcp(l) => l.local_addr().ok().map(|a| a.port()),
            ListenerSocket::Unix(_) => None,
        }
    }

    /// Accepts one source and completes the TLS handshake (which refuses an unauthenticated one).
    pub fn accept(&self) -> Result<Connection> {
        let socket = match &self.socket {
            ListenerSocket::Tcp(l) => {
                let (s, _) = l.accept().map_err(io_err("accept"))?;
                s.set_nodelay(true).map_err(io_err("TCP_NODELAY"))?;
                Socket::Tcp(s)
            }
            ListenerSocket::Unix(l) => Socket::Unix(l.accept().map_err(io_err("accept"))?.0),
        };
        let conn = ServerConnection::new(self.config.clone())
            .map_err(|e| TransportError::Tls(e.to_string()))?;
        handshake(StreamOwned::new(conn, socket))
    }
}

/// Drives the handshake to its end now, so that a refused peer is an error here, not at the
/// first read or write.
fn handshake<C, D>(mut stream: StreamOwned<C, Socket>) -> Result<Connection>
where
    C: std::ops::DerefMut + std::ops::Deref<Target = rustls::ConnectionCommon<D>> + Send + 'static,
    D: rustls::SideData + 'static,
{
    while stream.conn.is_handshaking() {
        stream
            .conn
            .complete_io(&mut stream.sock)
            .map_err(|e| TransportError::Tls(e.to_string()))?;
    }
    let socket = stream
        .sock
        .try_clone()
        .map_err(io_err("dup of the connection's socket"))?;
    Ok(Connection {
        tls: Box::new(stream),
        socket,
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

    #[test]
    fn missing_credentials_name_the_file() {
        let e = Credentials::load(Path::new("/nonexistent-guestmem"), Role::Source)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("/nonexistent-guestmem/guestmem-source.key"),
            "{e}"
        );
    }
}
