//! `guestmem bench transport`: what a migration connection's TLS costs its two ends, per GiB
//! carried, with each TLS engine this kernel offers: rustls in user space, and kernel TLS
//! where the kernel has it (the default of a TCP connection then; see
//! `guestmem_migration::transport`). The bytes are random, as compressed pages are to a
//! cipher (what TLS costs does not depend on what it carries), written in frames of
//! `--frame` bytes over loopback TCP and read into a reused buffer, nothing else done with
//! them. CPU time is each end's thread's (`getrusage(RUSAGE_THREAD)`: user and system, so
//! the kernel's encryption and decryption count); every figure is the median of `--runs`.
//! `bench floor` uses [`receive`] for its transport figure.

use std::io::{Read, Write};

use guestmem_migration::transport::{
    connect, generate_credentials, with_kernel_tls, Credentials, Endpoint, Listener, Role,
};
use serde::Serialize;

use crate::cpu::thread_cpu_s;
use crate::units::parse_size;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Bytes carried per run, e.g. 1G.
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    size: u64,
    /// Bytes per write (a compressed frame of pages is about 0.3-1.2 MiB).
    #[arg(long, default_value = "1M", value_parser = parse_size)]
    frame: u64,
    /// Runs per engine; every figure is the median.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

/// What one transfer cost its two ends.
#[derive(Debug, Clone, Copy)]
pub struct Costs {
    /// The reader's and the writer's CPU seconds.
    pub receive_s: f64,
    pub send_s: f64,
    /// Whether both ends' records went through the kernel's TLS.
    pub kernel_tls: bool,
}

/// One engine's figures.
#[derive(Debug, Serialize)]
struct Engine {
    engine: &'static str,
    receive_cpu_s_per_gib: f64,
    send_cpu_s_per_gib: f64,
    receive_cpu_s_per_gib_runs: Vec<f64>,
    send_cpu_s_per_gib_runs: Vec<f64>,
}

#[derive(Debug, Serialize)]
struct Output {
    bytes: u64,
    frame_bytes: u64,
    runs: usize,
    engines: Vec<Engine>,
    /// Why the kernel's TLS was not measured (it has none), if it was not.
    kernel_tls_absent: Option<String>,
    /// Kernel TLS's CPU per GiB over rustls's, each end.
    receive_kernel_to_rustls: Option<f64>,
    send_kernel_to_rustls: Option<f64>,
}

pub fn main(args: Args) -> crate::Result<()> {
    let frame = usize::try_from(args.frame)?;
    let size = usize::try_from(args.size)?;
    if args.runs == 0 || frame == 0 || size < frame {
        return Err("--runs and --frame need at least one, --size at least a frame".into());
    }
    let frames = random_frames(size, frame);
    let gib = (frames.len() * frame) as f64 / (1u64 << 30) as f64;
    let absent = guestmem_sys::probe::kernel_tls().err();
    let mut engines = Vec::new();
    for kernel in [false, true] {
        if kernel && absent.is_some() {
            continue;
        }
        let (mut rx, mut tx) = (Vec::new(), Vec::new());
        for _ in 0..args.runs {
            let c = receive(&frames, kernel)?;
            if c.kernel_tls != kernel {
                return Err(format!(
                    "the connection did not take the engine asked (kernel TLS {kernel})"
                )
                .into());
            }
            rx.push(c.receive_s / gib);
            tx.push(c.send_s / gib);
        }
        engines.push(Engine {
            engine: if kernel { "kernel" } else { "rustls" },
            receive_cpu_s_per_gib: median(rx.clone()),
            send_cpu_s_per_gib: median(tx.clone()),
            receive_cpu_s_per_gib_runs: rx,
            send_cpu_s_per_gib_runs: tx,
        });
    }
    let ratio = |f: fn(&Engine) -> f64| match engines.as_slice() {
        [rustls, kernel] => Some(f(kernel) / f(rustls)),
        _ => None,
    };
    let out = Output {
        bytes: (frames.len() * frame) as u64,
        frame_bytes: frame as u64,
        runs: args.runs,
        receive_kernel_to_rustls: ratio(|e| e.receive_cpu_s_per_gib),
        send_kernel_to_rustls: ratio(|e| e.send_cpu_s_per_gib),
        engines,
        kernel_tls_absent: absent,
    };
    if args.json {
        return crate::envelope::print(&out);
    }
    println!(
        "TLS over loopback TCP, {} MiB in writes of {} KiB, CPU-s per GiB, median of {} run(s)",
        out.bytes >> 20,
        out.frame_bytes >> 10,
        out.runs
    );
    println!("{:>8} {:>9} {:>9}", "engine", "receive", "send");
    for e in &out.engines {
        println!(
            "{:>8} {:>9.3} {:>9.3}",
            e.engine, e.receive_cpu_s_per_gib, e.send_cpu_s_per_gib
        );
    }
    if let Some(why) = &out.kernel_tls_absent {
        println!("kernel TLS not measured: {why}");
    }
    Ok(())
}

/// `size` bytes (whole frames) of a fixed pseudo-random sequence, cut into frames.
fn random_frames(size: usize, frame: usize) -> Vec<Vec<u8>> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    (0..size / frame)
        .map(|_| {
            (0..frame / 8)
                .flat_map(|_| {
                    // xorshift64*
                    state ^= state >> 12;
                    state ^= state << 25;
                    state ^= state >> 27;
                    state.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes()
                })
                .collect()
        })
        .collect()
}

/// `frames` written over a loopback TLS connection (kernel TLS tried or not, per `kernel`)
/// and read into a reused buffer: what each end's thread spent.
pub fn receive(frames: &[Vec<u8>], kernel: bool) -> crate::Result<Costs> {
    let dir = std::env::temp_dir().join(format!("guestmem-bench-tls-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    generate_credentials(&dir)?;
    let creds = (
        Credentials::load(&dir, Role::Destination),
        Credentials::load(&dir, Role::Source),
    );
    let _ = std::fs::remove_dir_all(&dir);
    let (destination, source) = (creds.0?, creds.1?);
    let listener = Listener::bind(&"tcp:127.0.0.1:0".parse::<Endpoint>()?, &destination)?;
    let port = listener.port().ok_or("the loopback listener has no port")?;
    let to: Endpoint = format!("tcp:127.0.0.1:{port}").parse()?;
    let total: usize = frames.iter().map(Vec::len).sum();
    std::thread::scope(|s| -> crate::Result<Costs> {
        let writer = s.spawn(move || -> Result<(f64, bool), String> {
            let mut conn = with_kernel_tls(kernel, || connect(&to, &source)).map_err(|e| {
                // The reader waits in `accept`: a bare connection ends that wait (its
                // handshake then fails within the handshake timeout).
                let _ = std::net::TcpStream::connect(("127.0.0.1", port));
                e.to_string()
            })?;
            conn.enlarge_send_buffer().map_err(|e| e.to_string())?;
            let t = thread_cpu_s();
            for f in frames {
                conn.write_all(f).map_err(|e| e.to_string())?;
            }
            conn.flush().map_err(|e| e.to_string())?;
            let secs = thread_cpu_s() - t;
            // Closed before the reader has it all, the socket could be reset under it.
            conn.read_exact(&mut [0u8]).map_err(|e| e.to_string())?;
            Ok((secs, conn.kernel_tls()))
        });
        let read = || -> crate::Result<(f64, bool)> {
            let mut conn = with_kernel_tls(kernel, || listener.accept())?;
            let mut buf = vec![0u8; 1 << 20];
            let t = thread_cpu_s();
            let mut left = total;
            while left > 0 {
                let n = left.min(buf.len());
                conn.read_exact(&mut buf[..n])?;
                left -= n;
            }
            let secs = thread_cpu_s() - t;
            conn.write_all(&[1])?;
            conn.flush()?;
            Ok((secs, conn.kernel_tls()))
        };
        let read = read();
        // The writer's failure first: it is why a read fails.
        let (send_s, send_kernel) = writer
            .join()
            .map_err(|_| "the writer panicked")?
            .map_err(|e| format!("the TLS writer: {e}"))?;
        let (receive_s, receive_kernel) = read?;
        Ok(Costs {
            receive_s,
            send_s,
            kernel_tls: send_kernel && receive_kernel,
        })
    })
}

/// The median of `v` as the figures report it (the mean of the middle two for an even count).
fn median(v: Vec<f64>) -> f64 {
    crate::envelope::Figure::of(&v).map_or(f64::NAN, |f| f.median)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every byte the writer sent is read (a lost tail would be an error), with either
    /// engine; kernel TLS is taken exactly where the kernel has it.
    #[test]
    fn every_frame_is_read_with_each_engine() {
        let frames: Vec<Vec<u8>> = (0..40u8)
            .map(|i| vec![i; 300_000 + usize::from(i)])
            .collect();
        for kernel in [false, true] {
            let c = receive(&frames, kernel).unwrap();
            assert!(c.receive_s > 0.0 && c.receive_s < 10.0, "{c:?}");
            assert_eq!(
                c.kernel_tls,
                kernel && guestmem_sys::probe::kernel_tls().is_ok()
            );
        }
    }

    /// The frames are the size asked, and not all alike (a cipher sees no pattern).
    #[test]
    fn random_frames_are_whole_and_differ() {
        let f = random_frames(10 << 20, 1 << 20);
        assert_eq!(f.len(), 10);
        assert!(f.iter().all(|x| x.len() == 1 << 20));
        assert!(f[0] != f[1]);
        let zeros = f[0].iter().filter(|&&b| b == 0).count();
        assert!(zeros < (1 << 20) / 100, "{zeros} zero bytes");
    }
}
