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

mod connection;
mod endpoint;
mod gauge;
mod kernel_tls;
mod listener;
mod pki;
mod socket;

pub use connection::*;
pub use endpoint::*;
pub use gauge::*;
pub use kernel_tls::with_kernel_tls;
pub use listener::*;
pub use pki::*;
pub use socket::*;

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
            .expect_err("refused");
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
        let e = listener.accept().expect_err("a silent peer").to_string();
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
            .expect_err("a mute destination")
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
            .expect_err("refused")
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
            .expect_err("refused")
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
