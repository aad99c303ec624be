//! `guestmem page-server --firecracker SOCKET --mem-file FILE`: serves the memory of VMMs that
//! restore a snapshot lazily (Firecracker, or `guestmem restore --mode lazy --uffd-socket`).

use std::os::unix::net::UnixListener;
use std::path::PathBuf;

use guestmem_migration::firecracker::{self, PageServerConfig};

#[derive(clap::Args)]
pub struct Args {
    /// The Unix socket to listen on, speaking Firecracker's userfaultfd handshake.
    #[arg(long, value_name = "SOCKET")]
    firecracker: PathBuf,
    /// The snapshot's memory file (each mapping's bytes are at its `offset`).
    #[arg(long, value_name = "FILE")]
    mem_file: PathBuf,
    /// Do not kill a peer whose serving failed for good (its vCPUs then stay blocked).
    #[arg(long)]
    keep_peer_on_failure: bool,
    /// Serve this many connections, then exit once they end (default: serve forever).
    #[arg(long)]
    connections: Option<usize>,
}

pub fn main(args: Args) -> crate::Result<()> {
    let mem = firecracker::open_mem_file(&args.mem_file)?;
    let _ = std::fs::remove_file(&args.firecracker);
    let listener = UnixListener::bind(&args.firecracker)
        .map_err(|e| format!("{}: bind: {e}", args.firecracker.display()))?;
    let config = PageServerConfig {
        kill_peer_on_failure: !args.keep_peer_on_failure,
        ..PageServerConfig::default()
    };
    eprintln!(
        "guestmem page-server: serving {} on {}",
        args.mem_file.display(),
        args.firecracker.display()
    );
    let mut threads = Vec::new();
    for (n, stream) in listener.incoming().enumerate() {
        let stream = stream.map_err(|e| format!("{}: accept: {e}", args.firecracker.display()))?;
        let (mem, config) = (mem.clone(), config.clone());
        threads.push(std::thread::spawn(move || {
            let result = firecracker::serve_connection(stream, &mem, &config).and_then(|s| {
                eprintln!(
                    "guestmem page-server: serving pid {} ({} mappings)",
                    s.peer_pid,
                    s.mappings.len()
                );
                s.wait()
            });
            if let Err(e) = result {
                eprintln!("guestmem page-server: error: {e}");
            }
        }));
        if args.connections.is_some_and(|c| n + 1 >= c) {
            break;
        }
    }
    for t in threads {
        let _ = t.join();
    }
    Ok(())
}
