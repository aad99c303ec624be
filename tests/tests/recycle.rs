//! Recycling: a restore service takes a finished clone's VM back into its pool
//! (`RestoreService::recycle`) instead of tearing it down, and the next clone restored from it
//! sees exactly the snapshot, never a byte the last clone wrote.

mod common;

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use common::{
    assert_memory_is_snapshot, dirty_work, flip_byte_in_ram, resume_and_check_continuation,
    snapshot_running_vm, TempDir,
};
use guestmem_contract::VmBuilder;
use guestmem_memory::Backend as MemBackend;
use guestmem_paging::{PagerConfig, Share};
use guestmem_snapshot::service::RestoreService;
use guestmem_snapshot::{RestoreMode, Restored, Snapshot};
use guestmem_vm::{Vm, VmConfig};

const RAM: u64 = 32 << 20;

/// The tests count the process's descriptors and memory: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

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
}

impl Drop for ShareDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Demand paging only (no background sweep), sharing through `share` if given.
fn config(share: Option<&ShareDir>) -> PagerConfig {
    PagerConfig {
        background: false,
        share: share.map(|s| Share::new(&s.0)),
        ..PagerConfig::default()
    }
}

/// A snapshot of a 2-vCPU guest (its RAM on anonymous memory) that ran `dirty` over its RAM,
/// in `dir`: the pages each vCPU had done at the snapshot.
fn snapshot_in(dir: &TempDir) -> Vec<u64> {
    snapshot_running_vm(&VmConfig::simple(2, RAM, MemBackend::Anon), RAM, &dir.0)
}

/// Runs a restored clone until every vCPU has written pages past `before`, then asks the
/// payload to finish and waits for it (its vCPUs end on the payload's "done" exit); returns
/// the pages done.
fn run_and_write(vm: &mut Vm, before: &[u64]) -> Vec<u64> {
    let running = vm.resume().unwrap();
    let n = dirty_work(2, RAM)[0].pages();
    while running
        .progress()
        .iter()
        .zip(before)
        .any(|((p, _), b)| *p < b + n / 2)
    {
        std::thread::sleep(Duration::from_millis(1));
    }
    running.stop();
    let report = running.wait(Duration::from_secs(30)).unwrap();
    report.vcpus.iter().map(|v| v.pages).collect()
}

fn digest_of_ram(vm: &Vm) -> u64 {
    let ram = vm.memory().region("ram").unwrap();
    vm.memory().digest(ram.gpa(), ram.size()).unwrap()
}

/// Clone A is restored, runs and rewrites half its RAM, and is recycled; clone B, restored
/// from the recycled VM (the pool's only one), reads exactly the snapshot's memory (every
/// region's digest, the sys region's included) before it runs, and its guest then goes on
/// from where the snapshot stopped, every page agreeing with its counters. Anonymous RAM with
/// and without a shared image, and memfd RAM (its file emptied).
#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn a_recycled_vm_gives_the_next_clone_exactly_the_snapshot() {
    let _serial = SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    for (backend, shared) in [
        (MemBackend::Anon, false),
        (MemBackend::Anon, true),
        (MemBackend::Memfd, false),
    ] {
        let dir = TempDir::new("recycle-bytes");
        let at_snapshot = snapshot_running_vm(&VmConfig::simple(2, RAM, backend), RAM, &dir.0);
        let share = ShareDir::new("recycle-bytes");
        let service = RestoreService::new(
            Snapshot::open(&dir.0).unwrap(),
            config(shared.then_some(&share)),
        )
        .unwrap();
        let snapshot_ram = service
            .image()
            .manifest()
            .regions
            .iter()
            .find(|r| r.spec.name == "ram")
            .unwrap()
            .digest;
        service.fill(1).unwrap();
        let mut a = service.restore().unwrap();
        let written = run_and_write(&mut a.lazy.vm, &at_snapshot);
        assert!(
            written.iter().zip(&at_snapshot).all(|(w, s)| w > s),
            "{backend} shared {shared}: clone A wrote pages"
        );
        assert_ne!(
            digest_of_ram(&a.lazy.vm),
            snapshot_ram,
            "{backend} shared {shared}: clone A's RAM is its own"
        );
        assert_eq!(service.pooled(), 0);
        service.recycle(a.lazy).unwrap();
        assert_eq!(service.pooled(), 1, "{backend} shared {shared}");

        let mut b = service.restore().unwrap();
        assert!(
            !b.phases.iter().any(|(n, _)| n.starts_with("prepare")),
            "{backend} shared {shared}: clone B came from the pool: {:?}",
            b.phases
        );
        assert_eq!(
            b.lazy.vm.pages_done(),
            at_snapshot,
            "{backend} shared {shared}"
        );
        assert_memory_is_snapshot(
            &b.lazy.vm,
            service.image(),
            &format!("{backend} shared {shared}: the recycled VM"),
        );
        resume_and_check_continuation(&mut b.lazy.vm, &dirty_work(2, RAM), &at_snapshot);
    }
}

/// The process's open descriptors.
fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// The process's anonymous and shared-memory resident bytes (`RssAnon` + `RssShmem`).
fn rss_anon_and_shmem() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .filter(|l| l.starts_with("RssAnon:") || l.starts_with("RssShmem:"))
        .map(|l| {
            l.split_whitespace()
                .nth(1)
                .and_then(|kb| kb.parse::<u64>().ok())
                .unwrap()
                * 1024
        })
        .sum()
}

/// One clone of `service` that runs, rewrites half its RAM and is recycled.
fn one_recycled_clone(service: &RestoreService<Snapshot>, at_snapshot: &[u64]) {
    let mut clone = service.restore().unwrap();
    assert!(!clone.phases.iter().any(|(n, _)| n.starts_with("prepare")));
    run_and_write(&mut clone.lazy.vm, at_snapshot);
    service.recycle(clone.lazy).unwrap();
}

/// The same VM recycled again and again (each clone rewriting half of its RAM): the
/// process's descriptors stay the same and its memory does not grow by the clones' pages.
#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn recycling_again_and_again_keeps_descriptors_and_memory_flat() {
    const ROUNDS: usize = 12;
    let _serial = SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = TempDir::new("recycle-flat");
    let at_snapshot = snapshot_in(&dir);
    let share = ShareDir::new("recycle-flat");
    let service =
        RestoreService::new(Snapshot::open(&dir.0).unwrap(), config(Some(&share))).unwrap();
    service.fill(1).unwrap();
    // The first rounds warm what stays (the shared image, thread stacks, allocator arenas).
    for _ in 0..3 {
        one_recycled_clone(&service, &at_snapshot);
    }
    let (fds_before, mem_before) = (fds(), rss_anon_and_shmem());
    for _ in 0..ROUNDS {
        one_recycled_clone(&service, &at_snapshot);
    }
    let (fds_after, mem_after) = (fds(), rss_anon_and_shmem());
    assert_eq!(service.pooled(), 1);
    assert_eq!(fds_after, fds_before, "descriptors after {ROUNDS} recycles");
    // Each clone writes half of the RAM (16 MiB): kept pages would add that much per round.
    assert!(
        mem_after < mem_before + (RAM / 4),
        "memory after {ROUNDS} recycles: {mem_before} -> {mem_after} bytes"
    );
}

/// A clone whose pager failed (a damaged chunk) is torn down, not pooled, and the error says
/// why; so is a VM of another configuration, and one with guest_memfd RAM.
#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn a_clone_whose_pager_failed_is_not_recycled() {
    let _serial = SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = TempDir::new("recycle-bad");
    snapshot_in(&dir);
    flip_byte_in_ram(&dir.0, 5, 1);
    let service = RestoreService::new(Snapshot::open(&dir.0).unwrap(), config(None)).unwrap();
    service.fill(1).unwrap();
    let mut clone = service.restore().unwrap();
    let running = clone.lazy.vm.resume().unwrap();
    let e = running
        .wait(Duration::from_secs(30))
        .unwrap_err()
        .to_string();
    assert!(e.contains("corrupt snapshot"), "{e}");
    let e = service.recycle(clone.lazy).unwrap_err().to_string();
    assert!(
        e.contains("not recycled") && e.contains("a pager failed") && e.contains("chunk 0"),
        "{e}"
    );
    assert_eq!(service.pooled(), 0);

    // A VM of another configuration.
    let dir2 = TempDir::new("recycle-other");
    snapshot_running_vm(
        &VmConfig::simple(2, 2 * RAM, MemBackend::Anon),
        RAM,
        &dir2.0,
    );
    let other = RestoreService::new(Snapshot::open(&dir2.0).unwrap(), config(None)).unwrap();
    let clone: Restored = other.restore().unwrap().lazy;
    let e = service.recycle(clone).unwrap_err().to_string();
    assert!(
        e.contains("not recycled") && e.contains("configuration"),
        "{e}"
    );
    assert_eq!(service.pooled(), 0);

    // A guest_memfd VM (restored in full: no KVM Userfault needed), refused naming it.
    let dir3 = TempDir::new("recycle-gmem");
    let gmem = VmConfig::simple(2, RAM, MemBackend::GuestMemfd);
    snapshot_running_vm(&gmem, RAM, &dir3.0);
    let snap = Snapshot::open(&dir3.0).unwrap();
    let clone = guestmem_snapshot::restore(&snap, &mut VmBuilder, RestoreMode::Full).unwrap();
    let service = RestoreService::new(snap, config(None)).unwrap();
    let e = service.recycle(clone).unwrap_err().to_string();
    assert!(
        e.contains("not recycled") && e.contains("region 'ram' is guest_memfd"),
        "{e}"
    );
    assert_eq!(service.pooled(), 0);
}
