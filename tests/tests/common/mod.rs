//! What the end-to-end tests share: huge page pools and a hugetlbfs mount for the hugetlb
//! backends (we run as root on the test machines; both are put back or left as the system
//! default location), and deterministic test data.
#![allow(dead_code)]

use std::sync::Mutex;

use guestmem_memory::{Backend, HUGE_PAGE_SIZE};

const NR_HUGEPAGES: &str = "/proc/sys/vm/nr_hugepages";

static POOL: Mutex<()> = Mutex::new(());

fn read_u64(path: &str) -> u64 {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// Adds `bytes` worth of 2 MiB pages to the kernel's huge page pool for as long as it lives,
/// and mounts hugetlbfs at /dev/hugepages (its usual place) if nothing is mounted.
pub struct HugePages {
    pages: u64,
}

impl HugePages {
    pub fn reserve(bytes: u64) -> HugePages {
        let _lock = POOL.lock().unwrap_or_else(|e| e.into_inner());
        let pages = bytes.div_ceil(HUGE_PAGE_SIZE);
        let now = read_u64(NR_HUGEPAGES);
        std::fs::write(NR_HUGEPAGES, (now + pages).to_string())
            .expect("raise nr_hugepages (root?)");
        assert!(
            read_u64(NR_HUGEPAGES) >= now + pages,
            "the kernel could not grow the huge page pool by {pages} pages"
        );
        if guestmem_memory::hugetlbfs_mount().is_none() {
            std::fs::create_dir_all("/dev/hugepages").expect("create /dev/hugepages");
            let status = std::process::Command::new("mount")
                .args([
                    "-t",
                    "hugetlbfs",
                    "-o",
                    "pagesize=2M",
                    "hugetlbfs",
                    "/dev/hugepages",
                ])
                .status()
                .expect("run mount");
            assert!(status.success(), "mount hugetlbfs on /dev/hugepages failed");
        }
        HugePages { pages }
    }

    /// Reserves what a region of `bytes` on `backend` needs (nothing for small-page backends).
    pub fn for_backend(backend: Backend, bytes: u64) -> Option<HugePages> {
        (backend.page_size() == HUGE_PAGE_SIZE).then(|| HugePages::reserve(bytes))
    }
}

impl Drop for HugePages {
    fn drop(&mut self) {
        let _lock = POOL.lock().unwrap_or_else(|e| e.into_inner());
        let now = read_u64(NR_HUGEPAGES);
        let _ = std::fs::write(NR_HUGEPAGES, now.saturating_sub(self.pages).to_string());
    }
}

/// `len` bytes of deterministic pseudo-random data (xorshift64*), different per `seed`.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        out.extend_from_slice(&x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
    }
    out.truncate(len);
    out
}
