//! `--metrics ADDR`: the metrics served over HTTP (`GET /metrics`) on a Unix socket or a
//! loopback TCP port, by a thread of its own until dropped. Anything but loopback is refused:
//! the metrics name snapshots and VMs, and an operator exposes them further on purpose (a
//! proxy), not by a flag.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::Metrics;

/// Where metrics are served: `unix:PATH`, or `tcp:HOST:PORT` / `HOST:PORT` on a loopback
/// address (port 0: any free port, see [`MetricsServer::port`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetricsAddr {
    /// A Unix socket (created; an old socket file there is replaced).
    Unix(PathBuf),
    /// A loopback TCP address.
    Tcp(SocketAddr),
}

impl std::str::FromStr for MetricsAddr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err("unix: needs a socket path (unix:PATH)".into());
            }
            return Ok(MetricsAddr::Unix(path.into()));
        }
        let tcp = s.strip_prefix("tcp:").unwrap_or(s);
        let addr: SocketAddr = tcp.parse().map_err(|e| {
            format!("'{s}': metrics are served on unix:PATH or a loopback HOST:PORT ({e})")
        })?;
        if !addr.ip().is_loopback() {
            return Err(format!(
                "'{s}': metrics are served on loopback only (127.0.0.1, [::1]) or a Unix socket"
            ));
        }
        Ok(MetricsAddr::Tcp(addr))
    }
}

/// The listener of a [`MetricsServer`].
enum Listening {
    Unix(UnixListener),
    Tcp(TcpListener),
}

/// Serves [`Metrics::encode`] at `GET /metrics` until dropped.
#[derive(Debug)]
pub struct MetricsServer {
    port: Option<u16>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// How long a scrape's request may take to arrive.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

impl MetricsServer {
    /// Listens on `addr` and serves `metrics` from a thread of its own.
    pub fn start(metrics: Arc<Metrics>, addr: &MetricsAddr) -> std::io::Result<MetricsServer> {
        let listening = match addr {
            MetricsAddr::Unix(path) => {
                let _ = std::fs::remove_file(path);
                Listening::Unix(UnixListener::bind(path)?)
            }
            MetricsAddr::Tcp(a) => Listening::Tcp(TcpListener::bind(a)?),
        };
        let port = match &listening {
            Listening::Tcp(l) => Some(l.local_addr()?.port()),
            Listening::Unix(_) => None,
        };
        match &listening {
            Listening::Unix(l) => l.set_nonblocking(true)?,
            Listening::Tcp(l) => l.set_nonblocking(true)?,
        }
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::Builder::new()
            .name("metrics".into())
            .spawn(move || serve(&listening, &metrics, &stopped))?;
        Ok(MetricsServer {
            port,
            stop,
            thread: Some(thread),
        })
    }

    /// The TCP port it listens on (`None` on a Unix socket).
    pub fn port(&self) -> Option<u16> {
        self.port
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Accepts scrapes (polling every 50 ms, so that a drop is seen) until stopped.
fn serve(listening: &Listening, metrics: &Metrics, stop: &AtomicBool) {
    while !stop.load(Ordering::Relaxed) {
        let answered = match listening {
            Listening::Unix(l) => l.accept().map(|(s, _)| {
                let _ = s.set_nonblocking(false);
                let _ = s.set_read_timeout(Some(REQUEST_TIMEOUT));
                answer(s, metrics);
            }),
            Listening::Tcp(l) => l.accept().map(|(s, _)| {
                let _ = s.set_nonblocking(false);
                let _ = s.set_read_timeout(Some(REQUEST_TIMEOUT));
                answer(s, metrics);
            }),
        };
        if answered.is_err() {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Reads one HTTP request (its head, at most 8 KiB) and answers it: the metrics for
/// `GET /metrics`, 404 otherwise.
fn answer(mut s: impl Read + Write, metrics: &Metrics) {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 8192 {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    let line = String::from_utf8_lossy(&head);
    let target = line.split_whitespace().take(2).collect::<Vec<_>>();
    let (status, kind, body) = match target.as_slice() {
        ["GET", path] if *path == "/metrics" || path.starts_with("/metrics?") => (
            "200 OK",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            metrics.encode(),
        ),
        _ => (
            "404 Not Found",
            "text/plain; charset=utf-8",
            "guestmem serves GET /metrics only\n".to_string(),
        ),
    };
    let _ = write!(
        s,
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_unix_sockets_or_loopback() {
        assert_eq!(
            "unix:/tmp/m.sock".parse(),
            Ok(MetricsAddr::Unix("/tmp/m.sock".into()))
        );
        assert!(matches!(
            "127.0.0.1:0".parse::<MetricsAddr>(),
            Ok(MetricsAddr::Tcp(_))
        ));
        assert!(matches!(
            "tcp:[::1]:9100".parse::<MetricsAddr>(),
            Ok(MetricsAddr::Tcp(_))
        ));
        let e = "0.0.0.0:9100".parse::<MetricsAddr>().unwrap_err();
        assert!(e.contains("loopback only"), "{e}");
        assert!("unix:".parse::<MetricsAddr>().is_err());
    }

    /// A scrape over loopback TCP gets the exposition; another path gets 404.
    #[test]
    fn a_scrape_gets_the_exposition() {
        let m = Metrics::new();
        m.recycles.inc();
        let server = MetricsServer::start(m, &"127.0.0.1:0".parse().unwrap()).unwrap();
        let port = server.port().unwrap();
        let get = |path: &str| {
            let mut c = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
            write!(c, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
            let mut text = String::new();
            c.read_to_string(&mut text).unwrap();
            text
        };
        let text = get("/metrics");
        assert!(text.starts_with("HTTP/1.1 200 OK"), "{text}");
        assert!(text.contains("guestmem_restore_recycles_total 1"), "{text}");
        assert!(get("/other").starts_with("HTTP/1.1 404"));
    }
}
