//! Demand paging from a remote peer: every byte read through the region equals the source's,
//! whether the chunks come in by fault, by the readahead threads or by the background sweep.

mod common;

use guestmem_sys::to_usize;
use std::fs::File;
use std::sync::Arc;
use std::time::Duration;

use common::pattern_file;
use guestmem_memory::{Backend, GuestMemory, RegionSpec};
use guestmem_paging::{FileSource, PageSource, Pager, PagerConfig, RemoteSource};

const SIZE: u64 = 32 << 20;

fn remote(file: &File, connections: usize) -> (Arc<dyn PageSource>, Vec<u8>) {
    let local = Arc::new(FileSource::new(file.try_clone().expect("dup")).expect("map the file"));
    let mut expected = vec![0u8; to_usize(SIZE)];
    local.fetch(0, &mut expected).expect("read the file");
    let remote =
        RemoteSource::spawn(local, Duration::from_micros(30), connections).expect("spawn the peer");
    (Arc::new(remote), expected)
}

/// Reads the whole region in order through its mapping (each first touch faults into the
/// pager) and checks the bytes and that every chunk ended up resident.
fn read_through_pager(backend: Backend, config: PagerConfig) {
    let file = pattern_file(SIZE);
    let (source, expected) = remote(&file, config.handlers + config.readahead_threads + 1);
    let memory = GuestMemory::new(&[RegionSpec::new("ram", 0, SIZE, backend)], None)
        .expect("create the region");
    let region = memory.region("ram").expect("the region");
    let pager = Pager::start(region, source, &config).expect("start the pager");
    common::check_read_through(&memory, &pager, &expected, backend);
}

#[test]
fn anon_and_memfd_regions_read_the_remote_bytes_with_readahead_threads() {
    for backend in [Backend::Anon, Backend::Memfd] {
        read_through_pager(
            backend,
            PagerConfig {
                uffds: 2,
                handlers: 1,
                readahead_threads: 3,
                background: false,
                ..PagerConfig::default()
            },
        );
    }
}

#[test]
fn anon_region_reads_the_remote_bytes_with_the_background_sweep() {
    read_through_pager(
        Backend::Anon,
        PagerConfig {
            handlers: 2,
            readahead_threads: 2,
            background: true,
            ..PagerConfig::default()
        },
    );
}

/// A fetch whose sink stops early leaves the connection ready for the next request.
#[test]
fn a_fetch_stopped_early_leaves_the_connection_in_step() {
    let file = pattern_file(SIZE);
    let (source, expected) = remote(&file, 1);
    let mut buf = vec![0u8; 64 << 10];
    let mut pieces = Vec::new();
    source
        .fetch_pieces(4096, 1 << 20, &mut buf, true, &mut |off, piece| {
            assert_eq!(piece, &expected[to_usize(off)..to_usize(off) + piece.len()]);
            pieces.push(off);
            false
        })
        .expect("fetch");
    assert_eq!(pieces, [4096]);
    let mut page = vec![0u8; 4096];
    source
        .fetch(3 << 20, &mut page)
        .expect("fetch after the stopped one");
    assert!(page == expected[3 << 20..(3 << 20) + 4096]);
}
