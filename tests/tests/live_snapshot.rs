//! Live snapshots (flat and chunk store, full and diff; dirty rounds and copy-before-write; anon,
//! memfd and hugetlb memory, and a restore service's clone) of a guest that keeps writing: each
//! restores, in full and lazily, to exactly the guest's memory at its pause (a digest taken
//! during the pause by a component, saved with the snapshot, against the restored memory's);
//! a guest_memfd region is stored during the pause; a failed live write leaves the guest
//! running and the previous snapshot intact.

mod common;

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{assert_pages_consistent, resume_and_check_continuation, small_tmpfs, TempDir};
use guestmem_contract::component::{Component, ComponentError, Components};
use guestmem_contract::PayloadVm;
use guestmem_contract::VmBuilder;
use guestmem_memory::{Backend as MemBackend, GuestMemory};
use guestmem_snapshot::live::{write_machine_live, LiveBase, LiveOptions, LiveReport, Strategy};
use guestmem_snapshot::{self as snapshot, RestoreMode, Snapshot};
use guestmem_store::local::LocalObjectStore;
use guestmem_store::restore::StoreSnapshot;
use guestmem_store::{ObjectInfo, ObjectStore};
use guestmem_vm::{layout, VcpuWork, Vm, VmConfig, Workload};

const SIZE: u64 = 32 << 20;

/// A component that, during the pause, takes the digest of every region of guest memory and
/// the guest's page counters: its saved state, kept with the snapshot.
struct PauseDigest {
    memory: Arc<GuestMemory>,
    vcpus: usize,
}

/// What [`PauseDigest`] saved: the region digests, then each vCPU's pages done.
fn parse_saved(state: &[u8], regions: usize) -> (Vec<u64>, Vec<u64>) {
    let words: Vec<u64> = state
        .chunks_exact(8)
        .map(|w| u64::from_le_bytes(w.try_into().unwrap()))
        .collect();
    (words[..regions].to_vec(), words[regions..].to_vec())
}

impl Component for PauseDigest {
    fn name(&self) -> &str {
        "pause-digest"
    }
    fn pause(&mut self) -> Result<(), ComponentError> {
        Ok(())
    }
    fn resume(&mut self) -> Result<(), ComponentError> {
        Ok(())
    }
    fn save(&mut self) -> Result<Vec<u8>, ComponentError> {
        let mut out = Vec::new();
        for r in self.memory.regions() {
            out.extend(self.memory.digest(r.gpa(), r.size())?.to_le_bytes());
        }
        for id in 0..self.vcpus {
            let done = self
                .memory
                .read_u64(layout::control_gpa(id) + guestmem_vm::payload::CTL_PAGES_DONE)?;
            out.extend(done.to_le_bytes());
        }
        Ok(out)
    }
    fn restore(&mut self, _state: &[u8]) -> Result<(), ComponentError> {
        Ok(())
    }
}

fn digests(vm: &Vm) -> Vec<u64> {
    vm.memory()
        .regions()
        .iter()
        .map(|r| vm.memory().digest(r.gpa(), r.size()).unwrap())
        .collect()
}

/// The `dirty` workload over the first half of RAM (the second half, filled with a pattern,
/// is not written after the start: a diff inherits it).
fn half_work(vcpus: usize) -> Vec<VcpuWork> {
    half_work_of(SIZE, vcpus, None)
}

/// [`half_work`] at `pages_per_s` (all vCPUs; `None`: unthrottled).
fn half_work_at(vcpus: usize, pages_per_s: Option<u64>) -> Vec<VcpuWork> {
    half_work_of(SIZE, vcpus, pages_per_s)
}

/// [`half_work_at`] over the first half of `size` bytes of RAM.
fn half_work_of(size: u64, vcpus: usize, pages_per_s: Option<u64>) -> Vec<VcpuWork> {
    let dirty = Workload::Dirty {
        pages_per_s: pages_per_s.map(|r| (r / vcpus as u64).max(1)),
        passes: None,
        fill_first: false,
    };
    VcpuWork::split(dirty, layout::RAM_GPA, size / 2, vcpus, 9)
}

fn fill_second_half(vm: &Vm) {
    fill_second_half_of(vm, SIZE);
}

/// [`fill_second_half`] of `size` bytes of RAM.
fn fill_second_half_of(vm: &Vm, size: u64) {
    let data = common::pattern((size / 2) as usize, 7);
    vm.memory()
        .write(layout::RAM_GPA + size / 2, &data)
        .unwrap();
}

/// RAM of the store tests: four of the store sink's batches (a pack of chunks per writer
/// thread, a thread per core). The guest's half then outlasts the first batch: while
/// copy-before-write's copier puts that batch (each put 150 ms slower), the guest writes
/// chunks of the next, still protected, and they are copied before its write.
fn store_size() -> u64 {
    let cores = std::thread::available_parallelism().map_or(2, std::num::NonZero::get) as u64;
    4 * cores * guestmem_store::write::PACK_CHUNKS as u64 * guestmem_store::chunk::CHUNK_BYTES
}

/// The guest is still running and going on.
fn assert_running(machine: &mut PayloadVm<'_>) {
    let running = machine
        .as_running()
        .expect("the guest runs after a live snapshot");
    let before: u64 = running.progress().iter().map(|p| p.0).sum();
    let t = std::time::Instant::now();
    let mut after = before;
    // Within 5 s (others share this host's CPUs; a guest stuck on a write would not move).
    while after == before && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(20));
        after = running.progress().iter().map(|p| p.0).sum();
    }
    assert!(after > before, "the guest goes on: {before} -> {after}");
}

/// The report says the strategy used; rounds: running rounds then the paused one;
/// copy-before-write: the one round of the memory at the pause.
fn assert_live(live: &LiveReport, strategy: Strategy) {
    let last = live.rounds.last().unwrap();
    assert!(last.paused, "{live:?}");
    assert!(live.rounds[..live.rounds.len() - 1]
        .iter()
        .all(|r| !r.paused));
    match strategy {
        Strategy::CopyBeforeWrite => {
            assert_eq!(live.mode, "copy-before-write", "{live:?}");
            assert_eq!(live.rounds.len(), 1, "{live:?}");
        }
        _ => {
            assert_eq!(live.mode, "rounds", "{live:?}");
            assert!(live.rounds.len() >= 2, "{live:?}");
        }
    }
}

fn opts(strategy: Strategy, keep_tracking: bool) -> LiveOptions {
    LiveOptions {
        keep_tracking,
        strategy,
        ..LiveOptions::default()
    }
}

/// Flat snapshot at `dir`: full and lazy restores both hold the memory digested at the pause,
/// and the guest goes on from the counters it had then.
fn check_flat(dir: &Path, work: &[VcpuWork]) {
    let snap = Snapshot::open(dir).unwrap();
    let saved = &snap.components()[0];
    assert_eq!(saved.name, "pause-digest");
    let (want, pages) = parse_saved(&saved.data, snap.manifest().regions.len());
    let mut vm = snapshot::restore(&snap, &mut VmBuilder, RestoreMode::Full)
        .map(|r| r.vm)
        .unwrap();
    assert_eq!(digests(&vm), want, "{}: full restore", dir.display());
    for (image, d) in snap.manifest().regions.iter().zip(&want) {
        assert_eq!(image.digest, *d, "the manifest's digest is the pause's");
    }
    assert_eq!(vm.pages_done(), pages);
    assert_pages_consistent(&vm, work, &pages);
    resume_and_check_continuation(&mut vm, work, &pages);
    drop(vm);
    let lazy = common::lazy_restore_resident(&snap, Duration::from_secs(60));
    assert_eq!(digests(&lazy.vm), want, "{}: lazy restore", dir.display());
}

/// A full live snapshot and a live diff over it, flat, of a guest on `backend` writing the
/// first half of its RAM at `pages_per_s`, by `strategy`: both restore (full and lazy) to the
/// memory at their pause, the diff inheriting the half not written.
fn flat_full_and_diff(backend: MemBackend, strategy: Strategy, pages_per_s: Option<u64>) {
    let tmp = TempDir::new(&format!(
        "live-flat-{backend}-{}-{}",
        strategy.name(),
        pages_per_s.unwrap_or(0)
    ));
    let (full, diff) = (tmp.0.join("full"), tmp.0.join("diff"));
    // The guest's RAM, and that of the restores that check it.
    let _huge = common::HugePages::for_backend(backend, 2 * SIZE);
    let mut vm = Vm::new(&VmConfig::simple(2, SIZE, backend)).unwrap();
    fill_second_half(&vm);
    let work = half_work_at(2, pages_per_s);
    let memory = vm.memory().clone();
    let running = vm.start(&work).unwrap();
    common::wait_for_generation(&running, 1);
    let mut machine = PayloadVm::running(running);
    let mut probe = PauseDigest {
        memory: memory.clone(),
        vcpus: 2,
    };
    let w = {
        let mut components = Components::new(vec![&mut probe as &mut dyn Component]).unwrap();
        write_machine_live(
            &mut machine,
            &mut components,
            &full,
            None,
            &opts(strategy, true),
        )
        .unwrap()
    };
    assert_live(&w.live, strategy);
    assert_eq!(w.report.memory_bytes, memory.size());
    assert_running(&mut machine);

    std::thread::sleep(Duration::from_millis(50));
    let base = LiveBase {
        dir: &full,
        tracker: w.tracker.expect("kept"),
    };
    let d = {
        let mut components = Components::new(vec![&mut probe as &mut dyn Component]).unwrap();
        write_machine_live(
            &mut machine,
            &mut components,
            &diff,
            Some(base),
            &opts(strategy, false),
        )
        .unwrap()
    };
    assert_live(&d.live, strategy);
    assert_running(&mut machine);
    let running = machine.into_running().unwrap();
    running.stop();
    running.wait(Duration::from_secs(30)).unwrap();

    // The diff stores only what was written since its base: the second half is inherited.
    let inherited = Snapshot::open(&diff)
        .unwrap()
        .manifest()
        .regions
        .iter()
        .flat_map(|r| &r.chunks)
        .filter(|c| c.inherited)
        .count() as u64;
    assert!(inherited >= SIZE / 2 / snapshot::CHUNK_BYTES, "{inherited}");
    check_flat(&full, &work);
    check_flat(&diff, &work);
}

#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn live_flat_snapshot_and_diff_are_the_memory_at_their_pause() {
    flat_full_and_diff(MemBackend::Anon, Strategy::Rounds, None);
    flat_full_and_diff(MemBackend::Anon, Strategy::CopyBeforeWrite, None);
}

/// Copy-before-write on every backend userfaultfd write-protect takes (flat and, for huge
/// pages larger than a store's chunk, a store), the guest unthrottled and throttled.
#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn copy_before_write_on_memfd_and_hugetlb_is_the_memory_at_the_pause() {
    flat_full_and_diff(MemBackend::Memfd, Strategy::CopyBeforeWrite, None);
    flat_full_and_diff(MemBackend::MemfdHugetlb, Strategy::CopyBeforeWrite, None);
    // Chunks of 256 KiB in huge pages of 2 MiB: a write copies every chunk of its huge page.
    store_full_and_diff(Strategy::CopyBeforeWrite, MemBackend::MemfdHugetlb);
    flat_full_and_diff(MemBackend::Anon, Strategy::CopyBeforeWrite, Some(20_000));
}

#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn a_guest_memfd_region_is_stored_during_the_pause() {
    let tmp = TempDir::new("live-gmem");
    let dir = tmp.0.join("snap");
    let mut vm = Vm::new(&VmConfig::simple(2, SIZE, MemBackend::GuestMemfd)).unwrap();
    let work = half_work(2);
    let memory = vm.memory().clone();
    let mut machine = PayloadVm::running(vm.start(&work).unwrap());
    std::thread::sleep(Duration::from_millis(50));
    let mut probe = PauseDigest { memory, vcpus: 2 };
    let w = {
        let mut components = Components::new(vec![&mut probe as &mut dyn Component]).unwrap();
        write_machine_live(
            &mut machine,
            &mut components,
            &dir,
            None,
            &LiveOptions::default(),
        )
        .unwrap()
    };
    assert_eq!(w.live.paused_untracked_bytes, SIZE, "{:?}", w.live);
    // The sys region (anonymous) is write-protected; the guest_memfd one cannot be.
    assert_eq!(w.live.mode, "copy-before-write", "{:?}", w.live);
    assert_running(&mut machine);
    let running = machine.into_running().unwrap();
    running.stop();
    running.wait(Duration::from_secs(30)).unwrap();
    let snap = Snapshot::open(&dir).unwrap();
    let (want, pages) = parse_saved(&snap.components()[0].data, 2);
    let mut vm = snapshot::restore(&snap, &mut VmBuilder, RestoreMode::Full)
        .map(|r| r.vm)
        .unwrap();
    assert_eq!(digests(&vm), want);
    resume_and_check_continuation(&mut vm, &work, &pages);
}

/// Store snapshot `name`: full and lazy restores hold the memory digested at the pause.
/// (A lazy restore from a store pages 256 KiB chunks, which huge pages cannot take: `lazy`
/// false checks the full restore only.)
fn check_store(
    objects: &Arc<dyn ObjectStore>,
    name: &str,
    work: &[VcpuWork],
    tmp: &TempDir,
    lazy: bool,
) {
    let cache = guestmem_store::cache::ChunkCache::open(&tmp.0.join("cache"), 1 << 30).unwrap();
    let snap = StoreSnapshot::open(objects.clone(), name, Some(cache)).unwrap();
    let (want, pages) = parse_saved(&snap.components[0].data, 2);
    let mut vm = snapshot::restore(&snap, &mut VmBuilder, RestoreMode::Full)
        .map(|r| r.vm)
        .unwrap();
    assert_eq!(digests(&vm), want, "{name}: full restore");
    assert_pages_consistent(&vm, work, &pages);
    resume_and_check_continuation(&mut vm, work, &pages);
    drop(vm);
    if !lazy {
        return;
    }
    let lazy = common::lazy_restore_resident(&snap, Duration::from_secs(60));
    assert_eq!(digests(&lazy.vm), want, "{name}: lazy restore");
}

#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn live_store_snapshot_and_diff_are_the_memory_at_their_pause() {
    store_full_and_diff(Strategy::Rounds, MemBackend::Anon);
    store_full_and_diff(Strategy::CopyBeforeWrite, MemBackend::Anon);
}

/// A full live snapshot and a live diff into a chunk store by `strategy`, of a guest on
/// `backend`: both restore (full and lazy) to the memory at their pause.
fn store_full_and_diff(strategy: Strategy, backend: MemBackend) {
    let size = store_size();
    let tmp = TempDir::new(&format!("live-store-{}-{backend}", strategy.name()));
    let _huge = common::HugePages::for_backend(backend, 2 * size);
    // Each put of chunks takes 150 ms more: the guest, unthrottled, writes chunks meanwhile
    // that are not stored yet (copy-before-write copies them first).
    let objects: Arc<dyn ObjectStore> = Arc::new(Refusing {
        inner: LocalObjectStore::new(&tmp.0.join("store")),
        armed: Mutex::new(false),
        delay: Duration::from_millis(150),
    });
    let mut vm = Vm::new(&VmConfig::simple(2, size, backend)).unwrap();
    fill_second_half_of(&vm, size);
    let work = half_work_of(size, 2, None);
    let memory = vm.memory().clone();
    let running = vm.start(&work).unwrap();
    common::wait_for_generation(&running, 1);
    let mut machine = PayloadVm::running(running);
    let mut probe = PauseDigest { memory, vcpus: 2 };
    let w = {
        let mut c = Components::new(vec![&mut probe as &mut dyn Component]).unwrap();
        guestmem_store::live::write_machine_live(
            &*objects,
            "base",
            &mut machine,
            &mut c,
            None,
            &opts(strategy, true),
        )
        .unwrap()
    };
    assert_live(&w.live, strategy);
    if strategy == Strategy::CopyBeforeWrite {
        assert!(w.live.write_faults > 0, "{:?}", w.live);
        assert!(w.live.copied_before_write_pages > 0, "{:?}", w.live);
        assert!(w.live.held_peak_bytes > 0, "{:?}", w.live);
    }
    assert_running(&mut machine);
    std::thread::sleep(Duration::from_millis(50));
    let d = {
        let mut c = Components::new(vec![&mut probe as &mut dyn Component]).unwrap();
        let base = Some(("base", w.tracker.expect("kept")));
        guestmem_store::live::write_machine_live(
            &*objects,
            "diff",
            &mut machine,
            &mut c,
            base,
            &opts(strategy, false),
        )
        .unwrap()
    };
    assert_live(&d.live, strategy);
    let chunks_per_half = size / 2 / guestmem_store::chunk::CHUNK_BYTES;
    assert!(
        d.report.inherited_chunks >= chunks_per_half,
        "{:?}",
        d.report
    );
    assert_running(&mut machine);
    let running = machine.into_running().unwrap();
    running.stop();
    running.wait(Duration::from_secs(30)).unwrap();
    let lazy = backend.page_size() <= guestmem_store::chunk::CHUNK_BYTES;
    check_store(&objects, "base", &work, &tmp, lazy);
    check_store(&objects, "diff", &work, &tmp, lazy);
}

/// A local store that refuses chunk puts once armed, and takes `delay` more for each.
struct Refusing {
    inner: LocalObjectStore,
    armed: Mutex<bool>,
    delay: Duration,
}

impl ObjectStore for Refusing {
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn get(&self, key: &str) -> guestmem_store::Result<Vec<u8>> {
        self.inner.get(key)
    }
    fn get_range(&self, key: &str, start: u64, len: u64) -> guestmem_store::Result<Vec<u8>> {
        self.inner.get_range(key, start, len)
    }
    fn put(&self, key: &str, bytes: &[u8]) -> guestmem_store::Result<()> {
        self.inner.put(key, bytes)
    }
    fn put_chunk(&self, key: &str, bytes: &[u8]) -> guestmem_store::Result<()> {
        std::thread::sleep(self.delay);
        if *self.armed.lock().unwrap() {
            return Err(guestmem_store::Error::Write(format!(
                "{key}: refused by the test"
            )));
        }
        self.inner.put_chunk(key, bytes)
    }
    fn sync(&self) -> guestmem_store::Result<()> {
        self.inner.sync()
    }
    fn exists(&self, key: &str) -> guestmem_store::Result<bool> {
        self.inner.exists(key)
    }
    fn list(&self, prefix: &str) -> guestmem_store::Result<Vec<ObjectInfo>> {
        self.inner.list(prefix)
    }
    fn delete(&self, key: &str) -> guestmem_store::Result<()> {
        self.inner.delete(key)
    }
    fn remote(&self) -> bool {
        false
    }
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn a_failed_live_snapshot_leaves_the_guest_running_and_the_previous_snapshot() {
    failed_live_snapshot(Strategy::Rounds);
    failed_live_snapshot(Strategy::CopyBeforeWrite);
}

/// A live snapshot by `strategy` onto a full disk, then into a store that refuses its chunks:
/// each fails naming why, the guest runs on, the snapshots taken before are intact.
fn failed_live_snapshot(strategy: Strategy) {
    // Flat: a 24 MiB tmpfs holds one snapshot of 16 MiB of written RAM, not two.
    let mnt = TempDir::new("live-enospc");
    let (small, _unmount) = small_tmpfs(&mnt, "24m");
    let dir = small.join("snap");
    let store_dir = TempDir::new("live-refused");
    let store = Refusing {
        inner: LocalObjectStore::new(&store_dir.0.join("store")),
        armed: Mutex::new(false),
        delay: Duration::ZERO,
    };

    let mut vm = Vm::new(&VmConfig::simple(2, SIZE, MemBackend::Anon)).unwrap();
    let work = half_work(2);
    let running = vm.start(&work).unwrap();
    common::wait_for_generation(&running, 1);
    let vm = running.pause().unwrap();
    snapshot::write(vm, &dir).unwrap();
    guestmem_store::write::write(&store, "snap", vm, None).unwrap();
    let at_first = vm.pages_done();
    let first_manifest = std::fs::read(dir.join("manifest.json")).unwrap();
    let first_store = guestmem_store::StoreManifest::load(&store, "snap").unwrap();

    let mut machine = PayloadVm::running(vm.resume().unwrap());
    let e = write_machine_live(
        &mut machine,
        &mut Components::none(),
        &dir,
        None,
        &opts(strategy, false),
    )
    .expect_err("the disk is full");
    let e = guestmem_migration::error_chain(&e, ": ");
    assert!(e.contains("No space left on device"), "{e}");
    assert_running(&mut machine);
    *store.armed.lock().unwrap() = true;
    let e = guestmem_store::live::write_machine_live(
        &store,
        "snap",
        &mut machine,
        &mut Components::none(),
        None,
        &opts(strategy, false),
    )
    .expect_err("the store refuses")
    .to_string();
    assert!(e.contains("refused by the test"), "{e}");
    assert_running(&mut machine);
    let running = machine.into_running().unwrap();
    running.stop();
    running.wait(Duration::from_secs(30)).unwrap();

    // Both earlier snapshots are there, unchanged, and restore to the first pause.
    assert_eq!(
        std::fs::read(dir.join("manifest.json")).unwrap(),
        first_manifest
    );
    let leftovers: Vec<_> = std::fs::read_dir(&small)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(leftovers, vec![std::ffi::OsString::from("snap")]);
    let mut restored = snapshot::restore(
        &Snapshot::open(&dir).unwrap(),
        &mut VmBuilder,
        RestoreMode::Full,
    )
    .map(|r| r.vm)
    .unwrap();
    assert_eq!(restored.pages_done(), at_first);
    resume_and_check_continuation(&mut restored, &work, &at_first);
    assert_eq!(
        guestmem_store::StoreManifest::load(&store, "snap")
            .unwrap()
            .checksum,
        first_store.checksum
    );
    let store: Arc<dyn ObjectStore> = Arc::new(store.inner);
    let snap = StoreSnapshot::open(store, "snap", None).unwrap();
    let restored = snapshot::restore(&snap, &mut VmBuilder, RestoreMode::Full)
        .map(|r| r.vm)
        .unwrap();
    assert_eq!(restored.pages_done(), at_first);
}

/// A restore service's clone (its RAM a private mapping of the shared image on tmpfs, its
/// pager retired once the clone is resident) snapshotted live by copy-before-write while its
/// guest writes: the snapshot restores to the clone's memory at the pause, and the shared
/// image keeps the original snapshot's bytes.
#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn a_live_snapshot_of_a_restore_service_clone_is_the_clones_memory_at_the_pause() {
    use guestmem_paging::{PagerConfig, Share};
    use guestmem_snapshot::service::RestoreService;

    let tmp = TempDir::new("live-clone");
    let (original, live) = (tmp.0.join("original"), tmp.0.join("live"));
    let work = common::dirty_work(2, SIZE / 2);
    common::snapshot_running_vm(
        &VmConfig::simple(2, SIZE, MemBackend::Anon),
        SIZE / 2,
        &original,
    );
    let share = format!("/dev/shm/guestmem-test-{}-live-clone", std::process::id());
    let _ = std::fs::remove_dir_all(&share);
    let service = RestoreService::new(
        Snapshot::open(&original).unwrap(),
        PagerConfig {
            share: Some(Share::new(Path::new(&share))),
            ..PagerConfig::default()
        },
    )
    .unwrap();
    let clone = service.restore().unwrap();
    for p in &clone.lazy.pagers {
        assert!(p.wait_resident(Duration::from_secs(60)).unwrap());
    }
    let mut vm = clone.lazy.vm;
    let memory = vm.memory().clone();
    let mut machine = PayloadVm::running(vm.resume().unwrap());
    std::thread::sleep(Duration::from_millis(100));
    let mut probe = PauseDigest { memory, vcpus: 2 };
    let w = {
        let mut components = Components::new(vec![&mut probe as &mut dyn Component]).unwrap();
        write_machine_live(
            &mut machine,
            &mut components,
            &live,
            None,
            &opts(Strategy::CopyBeforeWrite, false),
        )
        .unwrap()
    };
    assert_live(&w.live, Strategy::CopyBeforeWrite);
    assert_running(&mut machine);
    let running = machine.into_running().unwrap();
    running.stop();
    running.wait(Duration::from_secs(30)).unwrap();
    drop(clone.lazy.pagers);
    drop(vm);
    check_flat(&live, &work);
    // The original snapshot is what the image and a fresh restore still hold.
    let snap = Snapshot::open(&original).unwrap();
    let restored = snapshot::restore(&snap, &mut VmBuilder, RestoreMode::Full)
        .map(|r| r.vm)
        .unwrap();
    common::assert_memory_is_snapshot(&restored, &snap, "the original after the clone's");
    drop(service);
    let _ = std::fs::remove_dir_all(&share);
}
