//! What the integration tests share.

use std::fs::File;
use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};

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
