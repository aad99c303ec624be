//! The destination's listening socket and the sockets it accepts, before their TLS handshake.

use super::*;

/// The destination's listening socket.
#[derive(Debug)]
pub struct Listener {
    socket: ListenerSocket,
    config: Arc<ServerConfig>,
    timeouts: Timeouts,
    own_problem: Option<String>,
    /// What admits its connections, attached by the first receive on it (the destination's
    /// gate, one migration at a time): opaque to the transport, which only keeps it.
    pub(crate) gate: OnceLock<Arc<dyn Any + Send + Sync>>,
}

#[derive(Debug)]
pub(super) enum ListenerSocket {
    Tcp(TcpListener),
    Unix(UnixListener),
}

/// A socket accepted by a [`Listener`], before its TLS handshake.
#[derive(Debug)]
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
            StreamOwned::new(conn, Wire::new(self.socket)),
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
        let mut config = config;
        // The keys move into the kernel after the handshake where it has TLS (kernel_tls);
        // nothing of the stream may then be left for rustls: no session tickets follow the
        // handshake (guestmem does not resume sessions).
        config.enable_secret_extraction = true;
        config.send_tls13_tickets = 0;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A listener names its endpoint when it cannot listen there; an accepted socket names
    /// its peer before the handshake, and keeps the listener's timeouts.
    #[test]
    fn a_listener_names_its_endpoint_and_its_peers() {
        let dir = std::env::temp_dir().join(format!("guestmem-listener-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        generate_credentials(&dir).unwrap();
        let creds = Credentials::load(&dir, Role::Destination).unwrap();
        let endpoint = Endpoint::Unix(dir.join("sock"));
        let short = Timeouts {
            handshake: Duration::from_millis(100),
            idle: Duration::from_millis(200),
        };
        let listener = Listener::bind(&endpoint, &creds)
            .unwrap()
            .with_timeouts(short);
        assert_eq!((listener.port(), listener.timeouts()), (None, short));
        match Listener::bind(&endpoint, &creds) {
            Err(TransportError::Io { what, error }) => {
                assert_eq!(
                    what,
                    format!("listen on unix:{}", dir.join("sock").display())
                );
                assert_eq!(error.kind(), io::ErrorKind::AddrInUse);
            }
            other => panic!("{other:?}"),
        }
        let _client = UnixStream::connect(dir.join("sock")).unwrap();
        let accepted = listener.accept_socket().unwrap();
        assert_eq!(accepted.peer(), "the source on the Unix socket");
        assert_eq!(accepted.timeouts(), short);

        let tcp = Listener::bind(&"tcp:127.0.0.1:0".parse().unwrap(), &creds).unwrap();
        let port = tcp.port().expect("a TCP port");
        let client = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let accepted = tcp.accept_socket().unwrap();
        assert_eq!(
            accepted.peer(),
            format!("the source at {}", client.local_addr().unwrap())
        );
        assert_eq!(accepted.timeouts(), Timeouts::default());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
