//! A TCP proxy that adds a fixed delay to every byte in each direction: a round-trip time
//! for a server on this host where the kernel cannot add one (`CONFIG_NET_SCH_NETEM` unset,
//! and no `fq` qdisc to honour departure times set by BPF, on this machine's kernel).
//!
//! Each direction of a connection is a reader thread that stamps what it reads with the time
//! it may leave, and a writer thread that sends it at that time, so a delay adds latency
//! without limiting throughput (bytes in flight are not bounded by the delay). The bench
//! puts it between an S3 client and MinIO (`bench snapshot --rtt-ms`).

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A listening proxy on 127.0.0.1; dropping it stops accepting (open connections run on
/// until either side closes).
pub struct DelayProxy {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

impl DelayProxy {
    /// Listens on an ephemeral loopback port and forwards each connection to `target`,
    /// delaying each direction by `one_way`.
    pub fn start(target: SocketAddr, one_way: Duration) -> io::Result<DelayProxy> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let accept = std::thread::Builder::new()
            .name("delay-proxy".into())
            .spawn(move || {
                for client in listener.incoming() {
                    if stopping.load(Ordering::Acquire) {
                        break;
                    }
                    let Ok(client) = client else { continue };
                    if let Err(e) = connect(client, target, one_way) {
                        tracing::warn!("delay proxy: connecting to {target}: {e}");
                    }
                }
            })?;
        Ok(DelayProxy {
            addr,
            stop,
            accept: Some(accept),
        })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake the accept loop so that it sees `stop`; if that fails, leave the thread (it
        // ends with the process) rather than wait for a connection that may never come.
        let woken = TcpStream::connect(self.addr).is_ok();
        if let Some(t) = self.accept.take().filter(|_| woken) {
            let _ = t.join();
        }
    }
}

/// Joins `client` to a new connection to `target`, both directions delayed.
fn connect(client: TcpStream, target: SocketAddr, one_way: Duration) -> io::Result<()> {
    let server = TcpStream::connect(target)?;
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    pipe(client.try_clone()?, server.try_clone()?, one_way)?;
    pipe(server, client, one_way)
}

/// Forwards `from` to `to`, each read leaving `delay` after it arrived.
fn pipe(mut from: TcpStream, mut to: TcpStream, delay: Duration) -> io::Result<()> {
    let (tx, rx) = mpsc::channel::<(Instant, Vec<u8>)>();
    std::thread::Builder::new()
        .name("delay-proxy-rd".into())
        .spawn(move || {
            let mut buf = vec![0u8; 64 << 10];
            loop {
                match from.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if tx
                            .send((Instant::now() + delay, buf[..n].to_vec()))
                            .is_err()
                        {
                            break;
                        }
                    }
                }
            }
            // The writer sends what is queued, then closes its side.
        })?;
    std::thread::Builder::new()
        .name("delay-proxy-wr".into())
        .spawn(move || {
            for (due, data) in rx {
                let now = Instant::now();
                if due > now {
                    std::thread::sleep(due - now);
                }
                if to.write_all(&data).is_err() {
                    break;
                }
            }
            let _ = to.shutdown(Shutdown::Write);
        })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An echo server: what the proxy forwards comes back, every byte in order, and a round
    /// trip takes at least both directions' delay.
    #[test]
    #[allow(clippy::cast_possible_truncation)] // test data: the low byte of a pattern.
    fn forwards_every_byte_after_the_delay() {
        let echo = TcpListener::bind("127.0.0.1:0").unwrap();
        let target = echo.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = echo.accept().unwrap();
            let mut r = s.try_clone().unwrap();
            std::io::copy(&mut r, &mut s).unwrap();
            s.shutdown(Shutdown::Write).unwrap();
        });
        let delay = Duration::from_millis(5);
        let proxy = DelayProxy::start(target, delay).unwrap();
        let mut c = TcpStream::connect(proxy.addr()).unwrap();
        let t = Instant::now();
        c.write_all(b"ping").unwrap();
        let mut got = [0u8; 4];
        c.read_exact(&mut got).unwrap();
        let rtt = t.elapsed();
        assert_eq!(&got, b"ping");
        assert!(rtt >= 2 * delay, "round trip {rtt:?} < {:?}", 2 * delay);

        let data: Vec<u8> = (0..3u32 << 20).map(|i| (i * 7 + i / 4096) as u8).collect();
        let mut w = c.try_clone().unwrap();
        let sent = data.clone();
        let writer = std::thread::spawn(move || {
            w.write_all(&sent).unwrap();
            w.shutdown(Shutdown::Write).unwrap();
        });
        let mut back = Vec::new();
        c.read_to_end(&mut back).unwrap();
        writer.join().unwrap();
        assert_eq!(back.len(), data.len());
        assert!(back == data, "the echoed bytes differ from those sent");
    }
}
