//! What the end-to-end tests share: huge page pools and a hugetlbfs mount for the hugetlb
//! backends (we run as root on the test machines; both are put back or left as the system
//! default location), deterministic test data, and checks of the `dirty` workload's pages.
#![allow(dead_code)]

use std::cmp::Ordering;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use guestmem_memory::{Backend, HUGE_PAGE_SIZE, PAGE_SIZE};
use guestmem_snapshot as snapshot;
use guestmem_vm::payload::page_value;
use guestmem_vm::{layout, RunningVm, VcpuWork, Vm, VmConfig, Workload};

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
        let _lock = POOL
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
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
        let _lock = POOL
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
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

/// A `dirty` workload over `size` bytes at RAM_GPA, split over `vcpus`, running until stopped.
pub fn dirty_work(vcpus: usize, size: u64) -> Vec<VcpuWork> {
    let dirty = Workload::Dirty {
        pages_per_s: None,
        passes: None,
        fill_first: false,
    };
    VcpuWork::split(dirty, layout::RAM_GPA, size, vcpus, 9)
}

/// Waits until every vCPU has completed `generation` passes.
pub fn wait_for_generation(running: &RunningVm<'_>, generation: u64) {
    while running.progress().iter().any(|&(_, g)| g < generation) {
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Every page holds the value of the `dirty` pass the guest's own counters say it is in. The
/// page at the cursor may hold either value: the guest counts a page just after writing it, and
/// a pause can fall between the two.
pub fn assert_pages_consistent(vm: &Vm, work: &[VcpuWork], pages_done: &[u64]) {
    for (w, &done) in work.iter().zip(pages_done) {
        let n = w.pages();
        let (generation, cursor) = (done / n, done % n);
        assert!(generation >= 1, "at least one whole pass");
        for p in 0..n {
            let gpa = w.gpa + p * PAGE_SIZE;
            let value = vm.memory().read_u64(gpa).unwrap();
            let new = page_value(w.seed, gpa, generation);
            let old = page_value(w.seed, gpa, generation - 1);
            match p.cmp(&cursor) {
                Ordering::Less => assert_eq!(value, new, "page {gpa:#x}"),
                Ordering::Equal => assert!(value == new || value == old, "page {gpa:#x}"),
                Ordering::Greater => assert_eq!(value, old, "page {gpa:#x}"),
            }
        }
    }
}

/// Resumes `vm` (paused or restored, its pages done per vCPU being `before`), lets every vCPU
/// get two passes past the furthest one, stops it, and checks that every vCPU went on counting
/// from where it was and that every page agrees with the counters.
pub fn resume_and_check_continuation(vm: &mut Vm, work: &[VcpuWork], before: &[u64]) {
    let running = vm.resume().unwrap();
    let target = before
        .iter()
        .map(|p| p / work[0].pages() + 2)
        .max()
        .unwrap();
    wait_for_generation(&running, target);
    running.stop();
    let report = running.wait(Duration::from_secs(30)).unwrap();
    let after: Vec<u64> = report.vcpus.iter().map(|v| v.pages).collect();
    for (i, (b, a)) in before.iter().zip(&after).enumerate() {
        assert!(a > b, "vCPU {i} went on counting: {b} -> {a}");
    }
    assert_pages_consistent(vm, work, &after);
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

/// A fresh directory under the system temp dir, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(name: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("guestmem-test-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A tmpfs of `size` mounted in `tmp` (unmounted when the guard goes).
pub fn small_tmpfs(tmp: &TempDir, size: &str) -> (std::path::PathBuf, impl Drop) {
    assert_eq!(
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() },
        0,
        "this test mounts a small tmpfs and needs root"
    );
    let mnt = tmp.0.join("small");
    std::fs::create_dir_all(&mnt).unwrap();
    let ok = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
        .arg(&mnt)
        .status()
        .unwrap();
    assert!(ok.success(), "mount a {size} tmpfs on {}", mnt.display());
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
        }
    }
    (mnt.clone(), Unmount(mnt))
}

/// Runs a 2-vCPU `dirty` VM over the first `size` bytes of its RAM for two passes, pauses it,
/// snapshots it into `dir`, and returns the pages done per vCPU at the snapshot.
pub fn snapshot_running_vm(config: &VmConfig, size: u64, dir: &Path) -> Vec<u64> {
    let mut vm = Vm::new(config).unwrap();
    let running = vm.start(&dirty_work(2, size)).unwrap();
    wait_for_generation(&running, 2);
    running.pause().unwrap();
    let report = snapshot::write(&vm, dir).unwrap();
    assert_eq!(report.memory_bytes, vm.memory().size());
    vm.pages_done()
}

/// Every region of `vm`'s memory has the digest the snapshot recorded for it (`what` names the
/// case in the failure).
pub fn assert_memory_is_snapshot(vm: &Vm, snap: &snapshot::Snapshot, what: &str) {
    for (region, image) in vm.memory().regions().iter().zip(&snap.manifest().regions) {
        let digest = vm.memory().digest(region.gpa(), region.size()).unwrap();
        assert_eq!(digest, image.digest, "{what}: region '{}'", region.name());
    }
}

/// Flips the bits `mask` of the byte at `offset` into the "ram" region of the snapshot in `dir`.
pub fn flip_byte_in_ram(dir: &Path, offset: u64, mask: u8) {
    update_byte_in_ram(dir, offset, |b| b ^ mask);
}

/// Writes `value` at `offset` into the "ram" region of the snapshot in `dir` (inside a hole,
/// this allocates the page).
pub fn write_byte_in_ram(dir: &Path, offset: u64, value: u8) {
    update_byte_in_ram(dir, offset, |_| value);
}

fn update_byte_in_ram(dir: &Path, offset: u64, update: impl FnOnce(u8) -> u8) {
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap();
    let ram = manifest["regions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["spec"]["name"] == "ram")
        .unwrap();
    let at = ram["file_offset"].as_u64().unwrap() + offset;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.join("memory"))
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[update(b[0])], at).unwrap();
}

/// Restores `snap` lazily without the background fetch (only what the guest touches is
/// fetched), runs the guest until it stops with an error (within `timeout`), and returns that
/// error.
pub fn lazy_run_error<I: snapshot::SnapshotImage + ?Sized>(snap: &I, timeout: Duration) -> String {
    let quiet = guestmem_paging::PagerConfig {
        background: false,
        ..guestmem_paging::PagerConfig::default()
    };
    let mut lazy = snapshot::restore(
        snap,
        &mut guestmem_contract::VmBuilder,
        snapshot::RestoreMode::Lazy(quiet),
    )
    .unwrap();
    let running = lazy.vm.resume().unwrap();
    running.wait(timeout).unwrap_err().to_string()
}

/// Flips a bit in the middle of the stored bytes of the first chunk of RAM (region 1, which
/// the guest wrote) of store snapshot `name` in `objects`, in its pack. Returns the chunk's
/// hash.
pub fn damage_first_ram_chunk(
    objects: &dyn guestmem_store::ObjectStore,
    name: &str,
) -> guestmem_store::chunk::Hash {
    use guestmem_store::StoreManifest;
    let manifest = StoreManifest::load(objects, name).unwrap();
    let c = StoreManifest::stored(&manifest.regions[1].chunks[0], &manifest.pack_ids())
        .expect("the guest wrote the first chunk of RAM");
    let key = c.object_key();
    let mut bytes = objects.get(&key).unwrap();
    bytes[guestmem_sys::to_usize(c.offset() + c.stored / 2)] ^= 1;
    objects.put(&key, &bytes).unwrap();
    c.hash
}

/// Restores `snap` lazily with the default pager settings (the background fetch on) and waits
/// until every pager has made its region resident (within `timeout` each).
pub fn lazy_restore_resident<I: snapshot::SnapshotImage + ?Sized>(
    snap: &I,
    timeout: Duration,
) -> snapshot::Restored<Vm> {
    let lazy = snapshot::restore(
        snap,
        &mut guestmem_contract::VmBuilder,
        snapshot::RestoreMode::Lazy(guestmem_paging::PagerConfig::default()),
    )
    .unwrap();
    for p in &lazy.pagers {
        assert!(p.wait_resident(timeout).unwrap());
    }
    lazy
}
