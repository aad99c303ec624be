//! What the integration tests share.

use std::fs::File;
use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};

use guestmem_memory::{Backend, GuestMemory};
use guestmem_paging::Pager;

/// `size` bytes of a position-dependent pattern in an unlinked temporary file (one per
/// test: they run in parallel).
pub fn pattern_file(size: u64) -> File {
    static FILES: AtomicUsize = AtomicUsize::new(0);
    let path = std::env::temp_dir().join(format!(
        "guestmem-paging-test-{}-{}",
        std::process::id(),
        FILES.fetch_add(1, Ordering::Relaxed)
    ));
    let mut file = File::options()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)
        .expect("temporary file");
    std::fs::remove_file(&path).expect("unlink the temporary file");
    let bytes: Vec<u8> = (0..size / 8)
        .flat_map(|i| {
            (i ^ 0x5eed)
                .wrapping_mul(0x9e37_79b9_7f4a_7c15)
                .to_le_bytes()
        })
        .collect();
    file.write_all(&bytes).expect("write the pattern");
    file
}

/// Reads all `expected.len()` bytes of `memory` in order through its mapping (each first touch
/// faults into `pager`), and checks that they are `expected` and that the pager made all of it
/// resident without a failure.
pub fn check_read_through(memory: &GuestMemory, pager: &Pager, expected: &[u8], backend: Backend) {
    let mut read = vec![0u8; expected.len()];
    for (i, piece) in read.chunks_mut(1 << 20).enumerate() {
        memory
            .read((i as u64) << 20, piece)
            .expect("read the region");
    }
    assert!(
        read == expected,
        "{backend}: the region's bytes differ from the source's"
    );
    assert_eq!(pager.failure(), None);
    assert_eq!(pager.stats().resident_bytes, expected.len() as u64);
}
