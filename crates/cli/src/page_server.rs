//! `guestmem page-server --firecracker SOCKET --snapshot DIR|s3://…|store:… | --mem-file FILE`:
//! serves the memory of VMMs that restore a snapshot lazily (Firecracker, or `guestmem restore
//! --mode lazy --uffd-socket`), from a snapshot directory, a chunk store's snapshot or a memory
//! file.

use std::os::unix::net::UnixListener;
use std::path::PathBuf;

use guestmem_pageserver::{self as firecracker, PageServerConfig, ServedMemory};
use guestmem_snapshot::Snapshot;

use crate::progress::{with_metrics, MetricsArgs, Progress, ProgressArgs};

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("memory").required(true).args(["snapshot", "mem_file"])))]
pub struct Args {
    /// The Unix socket to listen on, speaking Firecracker's userfaultfd handshake.
    #[arg(long, value_name = "SOCKET")]
    firecracker: PathBuf,
    /// A guestmem snapshot to serve (for `guestmem restore DIR --mode lazy --uffd-socket`):
    /// its RAM regions back to back from offset 0, each chunk checked before any of it is
    /// served (against the manifest's CRC-32 in a directory, against its BLAKE3 hash in a
    /// store: s3://BUCKET/PREFIX/NAME or store:DIR/NAME, through the host's chunk cache for
    /// S3); a mismatch is refused (and the peer killed), naming the snapshot, region and chunk.
    #[arg(long, value_name = "DIR|s3://…|store:…")]
    snapshot: Option<PathBuf>,
    /// A Firecracker memory file: exactly the guest regions back to back (each mapping's bytes
    /// at its `offset`). Served as is, NOT checked: Firecracker's memory files carry no
    /// checksums.
    #[arg(long, value_name = "FILE")]
    mem_file: Option<PathBuf>,
    /// Do not kill a peer whose serving failed for good (its vCPUs then stay blocked).
    #[arg(long)]
    keep_peer_on_failure: bool,
    /// Serve this many connections, then exit once they end (default: serve forever).
    #[arg(long)]
    connections: Option<usize>,
    #[command(flatten)]
    progress: ProgressArgs,
    #[command(flatten)]
    metrics: MetricsArgs,
}

pub fn main(args: Args) -> crate::Result<()> {
    let memory = std::sync::Arc::new(match (&args.snapshot, &args.mem_file) {
        (Some(at), _) if crate::snapshot::is_store(at) => store_memory(at)?,
        (Some(dir), _) => guestmem_snapshot::served_memory(&Snapshot::open(dir)?)?,
        (None, Some(file)) => ServedMemory::file(file)?,
        (None, None) => unreachable!("clap requires one of --snapshot and --mem-file"),
    });
    let _ = std::fs::remove_file(&args.firecracker);
    let listener = UnixListener::bind(&args.firecracker)
        .map_err(|e| format!("{}: bind: {e}", args.firecracker.display()))?;
    let lines = Progress::new(&args.progress, false)?;
    let metrics = args.metrics.start()?;
    let config = PageServerConfig {
        kill_peer_on_failure: !args.keep_peer_on_failure,
        events: with_metrics(lines.sink.clone(), metrics.as_ref()),
        ..PageServerConfig::default()
    };
    eprintln!(
        "guestmem page-server: serving {} on {}",
        memory.describe(),
        args.firecracker.display()
    );
    let mut threads = Vec::new();
    for (n, stream) in listener.incoming().enumerate() {
        let stream = stream.map_err(|e| format!("{}: accept: {e}", args.firecracker.display()))?;
        let (memory, config) = (memory.clone(), config.clone());
        threads.push(std::thread::spawn(move || {
            let result = firecracker::serve_connection(stream, &memory, &config).and_then(|s| {
                eprintln!(
                    "guestmem page-server: serving pid {} ({} mappings)",
                    s.peer_pid,
                    s.mappings.len()
                );
                s.wait()
            });
            if let Err(e) = result {
                eprintln!("guestmem page-server: error: {}", crate::error_text(&e));
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

/// A store snapshot's RAM, served through a [`guestmem_store::pages::StorePages`] per region
/// (the host's chunk cache in front of a remote store).
fn store_memory(at: &std::path::Path) -> crate::Result<ServedMemory> {
    use guestmem_store::location::Location;
    let at = Location::parse(&at.to_string_lossy())?;
    let snap = crate::snapshot::open_store_snapshot(&at)?;
    Ok(guestmem_snapshot::served_memory(&snap)?)
}
