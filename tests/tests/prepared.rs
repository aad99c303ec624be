//! Restoring into a VM built ahead of time (a warm pool): from a snapshot directory
//! and from a chunk store, in full, map and lazy mode, the guest gets the snapshot's bytes and
//! goes on; a snapshot of another configuration is refused, naming what differs, before
//! anything of it is restored.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{
    assert_memory_is_snapshot, assert_pages_consistent, dirty_work, resume_and_check_continuation,
    snapshot_running_vm, TempDir,
};
use guestmem_contract::VmBuilder;
use guestmem_memory::Backend;
use guestmem_paging::PagerConfig;
use guestmem_snapshot::Error;
use guestmem_snapshot::{self as snapshot, PreparedVm, RestoreMode, Snapshot};
use guestmem_store::local::LocalObjectStore;
use guestmem_store::restore::StoreSnapshot;
use guestmem_vm::VmConfig;

const SIZE: u64 = 16 << 20;

#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn a_prepared_vm_gets_the_snapshots_bytes_and_the_guest_goes_on() {
    for backend in [Backend::Anon, Backend::Memfd] {
        let dir = TempDir::new(&format!("prepared-{backend}"));
        let config = VmConfig::simple(2, SIZE, backend);
        let at_snapshot = snapshot_running_vm(&config, SIZE, &dir.0);
        let snap = Snapshot::open(&dir.0).unwrap();
        let work = dirty_work(2, SIZE);

        for mode in [RestoreMode::Full, RestoreMode::Map] {
            let prepared = PreparedVm::new(&config).unwrap();
            let mut vm = snapshot::restore(&snap, prepared, mode.clone())
                .map(|r| r.vm)
                .unwrap();
            let what = format!("{backend} {mode:?}");
            assert_memory_is_snapshot(&vm, &snap, &what);
            assert_eq!(vm.pages_done(), at_snapshot, "{what}");
            assert_pages_consistent(&vm, &work, &at_snapshot);
            resume_and_check_continuation(&mut vm, &work, &at_snapshot);
        }

        // Lazy: the pagers are armed on the prepared VM's memory. The guest's own pages and
        // the control blocks are right before anything is resident (faults served)...
        let prepared = PreparedVm::new(&config).unwrap();
        let lazy =
            snapshot::restore(&snap, prepared, RestoreMode::Lazy(PagerConfig::default())).unwrap();
        assert!(
            lazy.phases.iter().all(|(p, _)| !p.starts_with("Vm::new")),
            "no VM built during the restore: {:?}",
            lazy.phases
        );
        let (pagers, mut vm) = (lazy.pagers, lazy.vm);
        assert_eq!(vm.pages_done(), at_snapshot, "{backend} lazy");
        assert_pages_consistent(&vm, &work, &at_snapshot);
        // ... and once every chunk is in, memory is the snapshot's.
        for p in &pagers {
            assert!(p.wait_resident(Duration::from_secs(60)).unwrap());
        }
        assert_memory_is_snapshot(&vm, &snap, &format!("{backend} lazy"));
        resume_and_check_continuation(&mut vm, &work, &at_snapshot);
        drop(pagers);
    }
}

#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn a_prepared_vm_restores_from_a_store() {
    let tmp = TempDir::new("prepared-store");
    let config = VmConfig::simple(2, SIZE, Backend::Anon);
    let flat = tmp.0.join("flat");
    let at_snapshot = snapshot_running_vm(&config, SIZE, &flat);
    let flat_snap = Snapshot::open(&flat).unwrap();
    // The same guest into a local store: restored from there into prepared VMs.
    let objects: Arc<dyn guestmem_store::ObjectStore> =
        Arc::new(LocalObjectStore::new(&tmp.0.join("store")));
    {
        let vm = snapshot::restore(&flat_snap, &mut VmBuilder, RestoreMode::Full)
            .map(|r| r.vm)
            .unwrap();
        guestmem_store::write::write(&*objects, "vm1", &vm, None).unwrap();
    }
    let store = StoreSnapshot::open(objects, "vm1", None).unwrap();
    let work = dirty_work(2, SIZE);

    let mut vm = snapshot::restore(&store, PreparedVm::new(&config).unwrap(), RestoreMode::Full)
        .map(|r| r.vm)
        .unwrap();
    assert_memory_is_snapshot(&vm, &flat_snap, "store full");
    resume_and_check_continuation(&mut vm, &work, &at_snapshot);
    drop(vm);

    let lazy = snapshot::restore(
        &store,
        PreparedVm::new(&config).unwrap(),
        RestoreMode::Lazy(PagerConfig::default()),
    )
    .unwrap();
    let (pagers, mut vm) = (lazy.pagers, lazy.vm);
    assert_eq!(vm.pages_done(), at_snapshot);
    for p in &pagers {
        assert!(p.wait_resident(Duration::from_secs(60)).unwrap());
    }
    assert_memory_is_snapshot(&vm, &flat_snap, "store lazy");
    resume_and_check_continuation(&mut vm, &work, &at_snapshot);
    drop(pagers);
}

#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn a_snapshot_of_another_layout_is_refused_naming_the_difference() {
    let tmp = TempDir::new("prepared-mismatch");
    let config = VmConfig::simple(2, SIZE, Backend::Anon);
    let dir = tmp.0.join("snap");
    snapshot_running_vm(&config, SIZE, &dir);
    let snap = Snapshot::open(&dir).unwrap();

    // Another vCPU count, and another RAM size: each named, with both sides' values.
    let cases = [
        (
            VmConfig::simple(1, SIZE, Backend::Anon),
            "the snapshot has 2 vCPU(s), the prepared VM 1",
        ),
        (
            VmConfig::simple(2, 2 * SIZE, Backend::Anon),
            "region 'ram': 16777216 bytes (16 MiB) in the snapshot, 33554432 bytes (32 MiB) in \
             the prepared VM",
        ),
        (
            VmConfig::simple(2, SIZE, Backend::Memfd),
            "region 'ram': backend anon in the snapshot, memfd in the prepared VM",
        ),
    ];
    for (other, says) in &cases {
        // A pool can ask first, and keeps its VM on a refusal.
        let prepared = PreparedVm::new(other).unwrap();
        let err = prepared
            .check(&snap.manifest().config, &snap.describe())
            .unwrap_err();
        assert!(err.to_string().contains(says), "{err}");
        for mode in ["full", "lazy"] {
            let prepared = PreparedVm::new(other).unwrap();
            let result = match mode {
                "full" => snapshot::restore(&snap, prepared, RestoreMode::Full)
                    .map(|r| r.vm)
                    .map(drop),
                _ => snapshot::restore(&snap, prepared, RestoreMode::Lazy(PagerConfig::default()))
                    .map(drop),
            };
            let err = result.unwrap_err();
            assert!(
                matches!(&err, Error::PreparedMismatch { reason, .. } if reason.contains(says)),
                "{mode}: {err}"
            );
            let text = err.to_string();
            assert!(
                text.contains(&dir.display().to_string())
                    && text.contains("does not fit the prepared VM")
                    && text.contains("nothing was restored"),
                "{mode}: {text}"
            );
        }
    }

    // The same from a store: refused before any chunk is fetched.
    let objects: Arc<dyn guestmem_store::ObjectStore> =
        Arc::new(LocalObjectStore::new(&tmp.0.join("store")));
    {
        let vm = snapshot::restore(&snap, &mut VmBuilder, RestoreMode::Full)
            .map(|r| r.vm)
            .unwrap();
        guestmem_store::write::write(&*objects, "vm1", &vm, None).unwrap();
    }
    let store = StoreSnapshot::open(objects, "vm1", None).unwrap();
    let prepared = PreparedVm::new(&cases[0].0).unwrap();
    let err = snapshot::restore(&store, prepared, RestoreMode::Lazy(PagerConfig::default()))
        .map(drop)
        .unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("store snapshot") && text.contains("vm1") && text.contains(cases[0].1),
        "{text}"
    );
    assert_eq!(store.fetcher.stats().store_gets, 0, "no chunk fetched");
}
