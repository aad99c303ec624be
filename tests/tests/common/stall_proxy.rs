//! A TCP proxy between an S3 client and MinIO that stops forwarding on demand: while stalled,
//! every connection (open or new) stays open and nothing passes either way; resumed, what
//! waited passes on. A server that hangs without closing anything, as a stalled network path
//! or an overloaded load balancer does.

#![allow(dead_code)]

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

pub struct StallProxy {
    addr: SocketAddr,
    stalled: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

impl StallProxy {
    /// Listens on a loopback port, forwarding each connection to `target`.
    pub fn start(target: SocketAddr) -> StallProxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let stalled = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let (st, sp) = (stalled.clone(), stop.clone());
        let accept = std::thread::spawn(move || {
            for client in listener.incoming() {
                if sp.load(Ordering::Acquire) {
                    break;
                }
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(target) else {
                    continue;
                };
                for (from, to) in [
                    (client.try_clone().unwrap(), server.try_clone().unwrap()),
                    (server, client),
                ] {
                    let (st, sp) = (st.clone(), sp.clone());
                    std::thread::spawn(move || pump(from, to, &st, &sp));
                }
            }
        });
        StallProxy {
            addr,
            stalled,
            stop,
            accept: Some(accept),
        }
    }

    /// `http://127.0.0.1:PORT`, for AWS_ENDPOINT_URL.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops forwarding (connections stay open).
    pub fn stall(&self) {
        self.stalled.store(true, Ordering::Release);
    }

    /// Forwards again, what waited first.
    pub fn resume(&self) {
        self.stalled.store(false, Ordering::Release);
    }
}

/// Copies `from` to `to` until either ends or the proxy stops, holding what it read while
/// the proxy is stalled.
fn pump(mut from: TcpStream, mut to: TcpStream, stalled: &AtomicBool, stop: &AtomicBool) {
    from.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let mut buf = vec![0u8; 64 << 10];
    while !stop.load(Ordering::Acquire) {
        let n = match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => continue,
            Err(_) => break,
        };
        while stalled.load(Ordering::Acquire) && !stop.load(Ordering::Acquire) {
            std::thread::sleep(Duration::from_millis(20));
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

impl Drop for StallProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = TcpStream::connect(self.addr);
        if let Some(a) = self.accept.take() {
            let _ = a.join();
        }
    }
}
