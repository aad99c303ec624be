//! Clones: one snapshot restored lazily several times on one host, sharing one copy of its
//! memory (a shared image on tmpfs that every clone maps copy-on-write).

mod common;

use guestmem_sys::to_usize;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use common::{
    dirty_work, flip_byte_in_ram, resume_and_check_continuation, snapshot_running_vm,
    wait_for_generation, TempDir,
};
use guestmem_contract::VmBuilder;
use guestmem_memory::Backend as MemBackend;
use guestmem_paging::{PagerConfig, Share, SharedImage};
use guestmem_snapshot::service::RestoreService;
use guestmem_snapshot::{self as snapshot, PreparedVm, RestoreMode, Snapshot};
use guestmem_store::local::LocalObjectStore;
use guestmem_store::restore::StoreSnapshot;
use guestmem_store::write::write;
use guestmem_store::ObjectStore;
use guestmem_vm::{Vm, VmConfig};

const RAM: u64 = 32 << 20;

/// A directory on tmpfs for the shared images, removed on drop.
struct ShareDir(PathBuf);

impl ShareDir {
    fn new(name: &str) -> ShareDir {
        let d = PathBuf::from(format!(
            "/dev/shm/guestmem-test-{}-{name}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&d);
        ShareDir(d)
    }

    /// Demand paging only (no background sweep), sharing through this directory.
    fn config(&self) -> PagerConfig {
        PagerConfig {
            background: false,
            share: Some(Share::new(&self.0)),
            ..PagerConfig::default()
        }
    }

    fn image(&self, snapshot_id: &str) -> SharedImage {
        SharedImage::open(&Share::new(&self.0).of(snapshot_id), "ram", RAM).unwrap()
    }
}

impl Drop for ShareDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn ram_bytes(vm: &Vm) -> Vec<u8> {
    let region = vm
        .memory()
        .regions()
        .iter()
        .find(|r| r.name() == "ram")
        .unwrap();
    let mut buf = vec![0u8; to_usize(region.size())];
    vm.memory().read(region.gpa(), &mut buf).unwrap();
    buf
}

/// Clone `a` runs its guest (which writes its pages), clone `b` does not: `b` reads exactly the
/// snapshot's bytes (`snapshot_ram`), `a` its own, and the shared image holds each page once,
/// the snapshot's.
fn check_two_clones(
    a: &mut Vm,
    b: &Vm,
    at_snapshot: &[u64],
    snapshot_ram: &[u8],
    image: &SharedImage,
) {
    resume_and_check_continuation(a, &dirty_work(2, RAM), at_snapshot);
    let a_ram = ram_bytes(a);
    let b_ram = ram_bytes(b);
    assert!(a_ram != snapshot_ram, "clone a's guest wrote its memory");
    assert!(
        b_ram == snapshot_ram,
        "clone b sees the snapshot's bytes only"
    );
    // Every page either clone touched is in the image once, published, and is the snapshot's.
    let published = image.published_bytes();
    assert!(published > 0);
    assert_eq!(
        image.resident_bytes(),
        published,
        "each published page held once"
    );
    let mut file = vec![0u8; to_usize(RAM)];
    std::fs::File::open(image.path())
        .unwrap()
        .read_exact_at(&mut file, 0)
        .unwrap();
    assert!(
        file == snapshot_ram,
        "the image holds the snapshot's bytes, not a's writes"
    );
}

/// Two lazy restores of one flat snapshot sharing memory: one writes, the other sees only the
/// snapshot's bytes; the shared image is filled once.
#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn two_clones_of_a_snapshot_share_one_copy_and_keep_their_own_writes() {
    let dir = TempDir::new("clones");
    let at_snapshot = snapshot_running_vm(&VmConfig::simple(2, RAM, MemBackend::Anon), RAM, &dir.0);
    let snap = Snapshot::open(&dir.0).unwrap();
    let full = snapshot::restore(&snap, &mut VmBuilder, RestoreMode::Full)
        .map(|r| r.vm)
        .unwrap();
    let snapshot_ram = ram_bytes(&full);
    drop(full);
    let share = ShareDir::new("flat");
    let mut a =
        snapshot::restore(&snap, &mut VmBuilder, RestoreMode::Lazy(share.config())).unwrap();
    let b = snapshot::restore(&snap, &mut VmBuilder, RestoreMode::Lazy(share.config())).unwrap();
    let image = share.image(&snap.manifest().checksum);
    check_two_clones(&mut a.vm, &b.vm, &at_snapshot, &snapshot_ram, &image);
    // A third clone, restored into a VM prepared ahead of time (a warm pool), finds every
    // page b read published: it fetches nothing new.
    let published = image.published_bytes();
    let prepared = snapshot::PreparedVm::new(&snap.manifest().config).unwrap();
    let c = snapshot::restore(&snap, prepared, RestoreMode::Lazy(share.config())).unwrap();
    assert!(ram_bytes(&c.vm) == snapshot_ram);
    assert_eq!(image.published_bytes(), published);
}

/// The same from a store snapshot (local store).
#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn two_clones_of_a_store_snapshot_share_one_copy_and_keep_their_own_writes() {
    let tmp = TempDir::new("clones-store");
    let objects: Arc<dyn ObjectStore> = Arc::new(LocalObjectStore::new(&tmp.0));
    let mut vm = Vm::new(&VmConfig::simple(2, RAM, MemBackend::Anon)).unwrap();
    let running = vm.start(&dirty_work(2, RAM)).unwrap();
    wait_for_generation(&running, 2);
    running.pause().unwrap();
    write(&*objects, "vm", &vm, None).unwrap();
    let at_snapshot = vm.pages_done();
    let snapshot_ram = ram_bytes(&vm);
    drop(vm);
    let snap = StoreSnapshot::open(objects, "vm", None).unwrap();
    let share = ShareDir::new("store");
    let mut a =
        snapshot::restore(&snap, &mut VmBuilder, RestoreMode::Lazy(share.config())).unwrap();
    let b = snapshot::restore(&snap, &mut VmBuilder, RestoreMode::Lazy(share.config())).unwrap();
    let image = share.image(&snap.manifest.checksum);
    check_two_clones(&mut a.vm, &b.vm, &at_snapshot, &snapshot_ram, &image);
}

/// Runs a lazily restored clone and returns the error that stopped it.
fn run_to_error(vm: &mut Vm) -> String {
    let running = vm.resume().unwrap();
    running
        .wait(Duration::from_secs(30))
        .unwrap_err()
        .to_string()
}

/// Restores `clones` clones of `snap`, whose first RAM chunk is damaged, lazily through
/// `share`: each stops with the error (`corrupt`, naming the chunk), and the image of the
/// snapshot (`checksum`) never publishes the chunk.
fn every_clone_refuses<I: snapshot::SnapshotImage + ?Sized>(
    snap: &I,
    share: &ShareDir,
    checksum: &str,
    clones: usize,
    corrupt: &str,
) {
    let image = share.image(checksum);
    for clone in 0..clones {
        let mut lazy =
            snapshot::restore(snap, &mut VmBuilder, RestoreMode::Lazy(share.config())).unwrap();
        let e = run_to_error(&mut lazy.vm);
        assert!(
            e.contains(corrupt) && e.contains("region 'ram' chunk 0 (offset 0x0)"),
            "clone {clone}: {e}"
        );
        assert!(!image.is_published(0, 4096), "clone {clone}");
    }
}

/// A damaged chunk is never published: every clone fetches it, finds it damaged and stops
/// with the error naming it, none runs on its bytes (flat snapshot and store). Sharing is
/// refused for guest_memfd RAM, saying why.
#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn a_damaged_chunk_is_refused_by_every_clone() {
    let dir = TempDir::new("clones-bad");
    snapshot_running_vm(&VmConfig::simple(2, RAM, MemBackend::Anon), RAM, &dir.0);
    flip_byte_in_ram(&dir.0, 5, 1);
    let snap = Snapshot::open(&dir.0).unwrap();
    let share = ShareDir::new("bad");
    let checksum = snap.manifest().checksum.clone();
    every_clone_refuses(&snap, &share, &checksum, 3, "corrupt snapshot");

    // A store chunk damaged in its pack.
    let tmp = TempDir::new("clones-bad-store");
    let (objects, _, _) = store_snapshot(&tmp, RAM);
    common::damage_first_ram_chunk(&*objects, "vm");
    let snap = StoreSnapshot::open(objects.clone(), "vm", None).unwrap();
    let checksum = snap.manifest.checksum.clone();
    every_clone_refuses(&snap, &share, &checksum, 2, "corrupt store snapshot");

    // guest_memfd RAM is mapped for the guest by KVM, not through a mapping of the image.
    let dir = TempDir::new("clones-gmem");
    snapshot_running_vm(
        &VmConfig::simple(2, RAM, MemBackend::GuestMemfd),
        RAM,
        &dir.0,
    );
    let snap = Snapshot::open(&dir.0).unwrap();
    let e = snapshot::restore(&snap, &mut VmBuilder, RestoreMode::Lazy(share.config()))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("guest_memfd") && e.contains("without sharing"),
        "{e}"
    );
}

/// Clones restored and read at once, each from its own thread: they race to publish the same
/// chunks, and every one of them reads exactly the snapshot's bytes.
#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn clones_racing_to_publish_the_same_chunks_all_read_the_snapshots_bytes() {
    let dir = TempDir::new("clones-race");
    snapshot_running_vm(&VmConfig::simple(2, RAM, MemBackend::Anon), RAM, &dir.0);
    let snap = Snapshot::open(&dir.0).unwrap();
    let full = snapshot::restore(&snap, &mut VmBuilder, RestoreMode::Full)
        .map(|r| r.vm)
        .unwrap();
    let snapshot_ram = ram_bytes(&full);
    drop(full);
    let share = ShareDir::new("race");
    let config = PagerConfig {
        // The background sweeps race the readers too.
        background: true,
        ..share.config()
    };
    let start = std::sync::Barrier::new(4);
    std::thread::scope(|s| {
        for clone in 0..4 {
            let (snap, config, start, snapshot_ram) = (&snap, &config, &start, &snapshot_ram);
            s.spawn(move || {
                start.wait();
                let lazy =
                    snapshot::restore(snap, &mut VmBuilder, RestoreMode::Lazy(config.clone()))
                        .unwrap();
                assert!(ram_bytes(&lazy.vm) == *snapshot_ram, "clone {clone}");
            });
        }
    });
    let image = share.image(&snap.manifest().checksum);
    assert_eq!(image.resident_bytes(), image.published_bytes());
}

/// A snapshot written to a fresh local store in `tmp` from a guest that ran a while: the
/// object store, the guest's progress and its RAM at the snapshot.
fn store_snapshot(tmp: &TempDir, ram: u64) -> (Arc<dyn ObjectStore>, Vec<u64>, Vec<u8>) {
    let objects: Arc<dyn ObjectStore> = Arc::new(LocalObjectStore::new(&tmp.0));
    let mut vm = Vm::new(&VmConfig::simple(2, ram, MemBackend::Anon)).unwrap();
    let running = vm.start(&dirty_work(2, ram)).unwrap();
    wait_for_generation(&running, 2);
    running.pause().unwrap();
    write(&*objects, "vm", &vm, None).unwrap();
    let at_snapshot = vm.pages_done();
    let snapshot_ram = ram_bytes(&vm);
    (objects, at_snapshot, snapshot_ram)
}

/// A restore service (the snapshot held open, a pool of VMs armed ahead: sys region in,
/// pagers registered, prefetch held): two clones restored from its pool share one copy, one
/// runs on from where the snapshot stopped, the other reads exactly the snapshot's bytes; a
/// clone restored with the pool empty too (its build reported step by step). A VM built for another layout, or armed for
/// another snapshot, is refused; a damaged chunk is refused by every clone of the service.
#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn a_restore_service_restores_armed_clones_to_the_snapshots_bytes() {
    let tmp = TempDir::new("clones-service");
    let (objects, at_snapshot, snapshot_ram) = store_snapshot(&tmp, RAM);
    let share = ShareDir::new("service");
    let service = RestoreService::new(
        StoreSnapshot::open(objects.clone(), "vm", None).unwrap(),
        share.config(),
    )
    .unwrap();
    service.fill(2).unwrap();
    assert_eq!(service.pooled(), 2);
    let image = share.image(&service.image().manifest.checksum);
    assert_eq!(image.published_bytes(), 0, "an armed VM fetches nothing");
    let mut a = service.restore().unwrap();
    let b = service.restore().unwrap();
    assert_eq!(service.pooled(), 0);
    assert!(!a.phases.iter().any(|(n, _)| n.starts_with("prepare")));
    assert!(a.built.is_empty(), "a clone from the pool reports no build");
    check_two_clones(
        &mut a.lazy.vm,
        &b.lazy.vm,
        &at_snapshot,
        &snapshot_ram,
        &image,
    );
    let c = service.restore().unwrap();
    assert_eq!(c.phases[0].0, "prepare (pool empty)");
    // Its build on the clock, step by step: the VM's build, then the sys region and pagers,
    // all inside its "prepare (pool empty)" phase.
    assert_eq!(
        c.built.last().map(|s| s.0),
        Some("copy the sys region and arm the pagers")
    );
    assert!(c.built.len() > 1);
    assert!(c.built.iter().map(|s| s.1).sum::<std::time::Duration>() <= c.phases[0].1);
    assert!(ram_bytes(&c.lazy.vm) == snapshot_ram);
    drop((a, b, c));

    // Another layout: refused, naming what differs, before anything is restored into it.
    let other = PreparedVm::new(&VmConfig::simple(2, 2 * RAM, MemBackend::Anon)).unwrap();
    let e = service.arm(other).err().unwrap().to_string();
    assert!(e.contains("region 'ram'") && e.contains("MiB"), "{e}");

    // A VM armed for another snapshot (same layout, other bytes) is refused.
    let tmp2 = TempDir::new("clones-service-other");
    let (backend2, _, _) = store_snapshot(&tmp2, RAM);
    let service2 = RestoreService::new(
        StoreSnapshot::open(backend2, "vm", None).unwrap(),
        share.config(),
    )
    .unwrap();
    let armed = service2.prepare().unwrap();
    let e = service.restore_armed(armed).err().unwrap().to_string();
    assert!(e.contains("armed for the snapshot"), "{e}");

    // A damaged chunk: every clone of the service stops naming it; none publishes it.
    common::damage_first_ram_chunk(&*objects, "vm");
    let share = ShareDir::new("service-bad");
    let service = RestoreService::new(
        StoreSnapshot::open(objects, "vm", None).unwrap(),
        share.config(),
    )
    .unwrap();
    let image = share.image(&service.image().manifest.checksum);
    service.fill(2).unwrap();
    for clone in 0..2 {
        let mut r = service.restore().unwrap();
        let e = run_to_error(&mut r.lazy.vm);
        assert!(
            e.contains("corrupt store snapshot") && e.contains("region 'ram' chunk 0 (offset 0x0)"),
            "clone {clone}: {e}"
        );
        assert!(!image.is_published(0, 4096), "clone {clone}");
    }
}
