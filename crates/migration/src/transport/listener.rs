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
