//! Helpers shared by the end-to-end tests: what the hugetlb backends need from the host.
#![allow(dead_code)] // each test binary uses its own subset

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};

use guestmem_memory::hugetlbfs_mount;

const NR_HUGEPAGES: &str = "/proc/sys/vm/nr_hugepages";
const FREE_HUGEPAGES: &str = "/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages";

fn read_u64(path: &str) -> u64 {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{path}: {e}"))
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Huge pages reserved for one test: the pool grows by what is missing for `pages` free pages,
/// and is set back to its previous size on drop. Holds a lock so tests of one binary take turns.
pub struct HugePages {
    previous: u64,
    _turn: MutexGuard<'static, ()>,
}

impl HugePages {
    pub fn reserve(pages: u64) -> HugePages {
        static TURN: Mutex<()> = Mutex::new(());
        let turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
        let previous = read_u64(NR_HUGEPAGES);
        let free = read_u64(FREE_HUGEPAGES);
        if free < pages {
            let want = previous + (pages - free);
            std::fs::write(NR_HUGEPAGES, want.to_string())
                .unwrap_or_else(|e| panic!("{NR_HUGEPAGES}: {e} (these tests run as root)"));
            let got = read_u64(FREE_HUGEPAGES);
            assert!(
                got >= pages,
                "asked for {want} huge pages, only {got} free: the host lacks contiguous memory"
            );
        }
        HugePages {
            previous,
            _turn: turn,
        }
    }
}

impl Drop for HugePages {
    fn drop(&mut self) {
        let _ = std::fs::write(NR_HUGEPAGES, self.previous.to_string());
    }
}

/// A hugetlbfs mount with 2 MiB pages: the host's own if it has one, else one mounted on a
/// temporary directory for the test's lifetime.
pub struct Hugetlbfs {
    mounted: Option<PathBuf>,
}

impl Hugetlbfs {
    pub fn ensure() -> Hugetlbfs {
        if hugetlbfs_mount().is_some() {
            return Hugetlbfs { mounted: None };
        }
        let dir = std::env::temp_dir().join(format!("guestmem-hugetlbfs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let status = std::process::Command::new("mount")
            .args(["-t", "hugetlbfs", "-o", "pagesize=2M", "none"])
            .arg(&dir)
            .status()
            .expect("run mount");
        assert!(status.success(), "mount -t hugetlbfs on {dir:?} failed");
        Hugetlbfs { mounted: Some(dir) }
    }
}

impl Drop for Hugetlbfs {
    fn drop(&mut self) {
        if let Some(dir) = &self.mounted {
            let _ = std::process::Command::new("umount").arg(dir).status();
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// `len` bytes whose pages alternate between runs of zero pages and pages of non-zero words
/// (run lengths 1, 2, 3, ... pages), so that zero skipping has work at every boundary.
pub fn image_with_zero_runs(len: usize, page: usize) -> Vec<u8> {
    let mut image = vec![0u8; len];
    let (mut at, mut run, mut zero) = (0usize, 1usize, true);
    while at < len {
        let end = (at + run * page).min(len);
        if !zero {
            for (i, w) in image[at..end].chunks_exact_mut(8).enumerate() {
                let v = ((at + i * 8) as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
                w.copy_from_slice(&v.to_le_bytes());
            }
        }
        at = end;
        zero = !zero;
        run += 1;
    }
    image
}

/// Which pages of `[addr, addr + len)` are resident (`mincore`), one bool per 4 KiB page.
pub fn resident(addr: *mut u8, len: usize) -> Vec<bool> {
    let mut vec = vec![0u8; len.div_ceil(4096)];
    // SAFETY: `addr`/`len` is inside a live mapping the caller owns; `vec` has one byte per page.
    let ret = unsafe { libc::mincore(addr.cast(), len, vec.as_mut_ptr()) };
    assert_eq!(ret, 0, "mincore: {}", std::io::Error::last_os_error());
    vec.iter().map(|b| b & 1 != 0).collect()
}
