//! Snapshot a running VM, restore it, and watch the guest carry on.

mod common;

use std::path::Path;

use common::{
    assert_memory_is_snapshot, assert_pages_consistent, dirty_work, flip_byte_in_ram,
    resume_and_check_continuation, small_tmpfs, snapshot_running_vm, wait_for_generation, TempDir,
};
use guestmem_contract::VmBuilder;
use guestmem_memory::{Backend, RegionSpec};
use guestmem_paging::PagerConfig;
use guestmem_snapshot::{self as snapshot, RestoreMode, Snapshot};
use guestmem_vm::{layout, Vm, VmConfig};

const SIZE: u64 = 8 << 20;

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn restored_guest_continues_on_every_backend_and_mode() {
    for backend in [Backend::Anon, Backend::Memfd, Backend::GuestMemfd] {
        for mode in [RestoreMode::Full, RestoreMode::Map] {
            let dir = TempDir::new(&format!("{backend}-{mode:?}"));
            let config = VmConfig::simple(2, SIZE, backend);
            let at_snapshot = snapshot_running_vm(&config, SIZE, &dir.0);

            let snap = Snapshot::open(&dir.0).unwrap();
            let mut vm = snapshot::restore(&snap, &mut VmBuilder, mode.clone())
                .map(|r| r.vm)
                .unwrap();
            // Memory is back as it was: every region's digest equals the one taken at snapshot.
            assert_memory_is_snapshot(&vm, &snap, &format!("{backend} {mode:?}"));
            assert_eq!(vm.pages_done(), at_snapshot);
            let work = dirty_work(2, SIZE);
            assert_pages_consistent(&vm, &work, &at_snapshot);
            resume_and_check_continuation(&mut vm, &work, &at_snapshot);
        }
    }
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn zero_pages_are_holes_in_the_memory_file() {
    let dir = TempDir::new("sparse");
    // 64 MiB of guest memory of which the guest dirties only the first 8 MiB.
    let config = VmConfig::simple(2, 64 << 20, Backend::Anon);
    let mut vm = Vm::new(&config).unwrap();
    let running = vm.start(&dirty_work(2, SIZE)).unwrap();
    wait_for_generation(&running, 1);
    running.pause().unwrap();
    let report = snapshot::write(&vm, &dir.0).unwrap();
    assert!(
        report.data_bytes < 10 << 20,
        "{} bytes of data",
        report.data_bytes
    );
    assert!(
        report.zero_chunks >= 27,
        "{} zero chunks",
        report.zero_chunks
    );
    let meta = std::fs::metadata(dir.0.join("memory")).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!(
        meta.len(),
        64 << 20,
        "the memory file is exactly the guest RAM"
    );
    assert!(
        meta.blocks() * 512 < 12 << 20,
        "only {} bytes allocated",
        meta.blocks() * 512
    );
}

/// Edits `dir`'s manifest as JSON and writes it back as it is (its checksum then no longer
/// matches: what an edit by hand or damage leaves).
fn edit_manifest(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("manifest.json");
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut m);
    std::fs::write(&path, serde_json::to_vec(&m).unwrap()).unwrap();
}

/// Edits `dir`'s manifest and seals it again (a manifest made by another tool, or forged):
/// what the structural checks and the host's checks must catch on their own.
fn edit_and_reseal_manifest(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    edit_manifest(dir, edit);
    let path = dir.join("manifest.json");
    let mut m: snapshot::Manifest = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    m.seal();
    std::fs::write(&path, serde_json::to_vec(&m).unwrap()).unwrap();
}

/// Copies the snapshot files of `from` into a fresh directory.
fn copy_snapshot(from: &Path, name: &str) -> TempDir {
    let dir = TempDir::new(name);
    for f in ["manifest.json", "state.json", "memory", "sys"] {
        std::fs::copy(from.join(f), dir.0.join(f)).unwrap();
    }
    dir
}

/// The error of opening and restoring `dir` in `mode` (lazily: opening and starting the
/// pagers); panics if it is accepted.
fn restore_error(dir: &Path, mode: &str) -> String {
    let snap = match Snapshot::open(dir) {
        Ok(s) => s,
        Err(e) => return e.to_string(),
    };
    let result = match mode {
        "full" => snapshot::restore(&snap, &mut VmBuilder, RestoreMode::Full)
            .map(|r| r.vm)
            .map(drop),
        "map" => snapshot::restore(&snap, &mut VmBuilder, RestoreMode::Map)
            .map(|r| r.vm)
            .map(drop),
        _ => snapshot::restore(
            &snap,
            &mut VmBuilder,
            RestoreMode::Lazy(PagerConfig::default()),
        )
        .map(drop),
    };
    match result {
        Ok(()) => panic!("{} was accepted in {mode} mode", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn bad_snapshots_are_refused_before_anything_runs() {
    let good = TempDir::new("good");
    snapshot_running_vm(&VmConfig::simple(2, SIZE, Backend::Memfd), SIZE, &good.0);
    let copy = |name: &str| copy_snapshot(&good.0, name);
    let restore_err = |dir: &Path| -> String {
        match Snapshot::open(dir)
            .and_then(|s| snapshot::restore(&s, &mut VmBuilder, RestoreMode::Full).map(|r| r.vm))
        {
            Ok(_) => panic!("{} was accepted", dir.display()),
            Err(e) => e.to_string(),
        }
    };

    // A snapshot of the version before (its state.json held guestmem's VM state field by
    // field), or of a later one: refused naming both versions.
    for version in [2, 99] {
        let d = copy(&format!("version-{version}"));
        edit_manifest(&d.0, |m| m["version"] = version.into());
        let e = restore_err(&d.0);
        assert!(
            e.contains(&format!(
                "snapshot format version {version}, written by guestmem "
            )) && e.contains(&format!(
                "reads versions {} to {}",
                snapshot::MIN_VERSION,
                snapshot::VERSION
            )),
            "{e}"
        );
    }

    let d = copy("format");
    edit_manifest(&d.0, |m| m["format"] = "qcow2".into());
    assert!(restore_err(&d.0).contains("not a guestmem snapshot"));

    let d = copy("truncated");
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(d.0.join("memory"))
        .unwrap();
    f.set_len(SIZE / 2).unwrap();
    let e = restore_err(&d.0);
    assert!(e.contains("truncated") && e.contains("memory"), "{e}");

    // A file longer than its manifest says is not called truncated.
    let d = copy("longer");
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(d.0.join("memory"))
        .unwrap();
    f.set_len(SIZE * 2).unwrap();
    let e = restore_err(&d.0);
    assert!(
        e.contains("longer than written") && !e.contains("truncated") && e.contains("memory"),
        "{e}"
    );

    // One flipped byte in the guest's RAM region: the chunk's checksum catches it.
    let d = copy("flipped");
    flip_byte_in_ram(&d.0, 3 * 4096 + 8, 0x40);
    let e = restore_err(&d.0);
    assert!(
        e.contains("corrupt snapshot") && e.contains("region 'ram' chunk 0 (offset 0x0)"),
        "{e}"
    );

    let d = copy("state");
    let mut state = std::fs::read(d.0.join("state.json")).unwrap();
    let i = state.iter().position(|&c| c.is_ascii_digit()).unwrap();
    state[i] = if state[i] == b'7' { b'8' } else { b'7' };
    std::fs::write(d.0.join("state.json"), state).unwrap();
    let e = restore_err(&d.0);
    assert!(e.contains("state.json: BLAKE3"), "{e}");

    // A FIFO where a file should be: refused at once, not an open that blocks forever.
    for f in ["memory", "manifest.json"] {
        let d = copy(&format!("fifo-{f}"));
        std::fs::remove_file(d.0.join(f)).unwrap();
        let status = std::process::Command::new("mkfifo")
            .arg(d.0.join(f))
            .status()
            .unwrap();
        assert!(status.success());
        let e = restore_err(&d.0);
        assert!(e.contains(f) && e.contains("not a regular file"), "{e}");
    }

    let d = copy("missing");
    std::fs::remove_file(d.0.join("manifest.json")).unwrap();
    let e = restore_err(&d.0);
    assert!(e.contains("manifest.json: read failed"), "{e}");

    // A layout this host cannot provide: more huge pages than the pool holds.
    let d = copy("layout");
    edit_and_reseal_manifest(&d.0, |m| {
        m["config"]["regions"][0]["backend"] = "memfd-hugetlb".into();
        m["config"]["regions"][0]["size"] = (64u64 << 30).into();
    });
    let e = restore_err(&d.0);
    assert!(
        e.contains("region 'ram'") && e.contains("not available"),
        "{e}"
    );

    // A configuration whose regions differ from the saved memory layout.
    let d = copy("regions");
    edit_and_reseal_manifest(&d.0, |m| {
        let moved = RegionSpec::new("ram", layout::RAM_GPA * 2, SIZE, Backend::Memfd);
        m["config"]["regions"][0] = serde_json::to_value(moved).unwrap();
    });
    let e = restore_err(&d.0);
    assert!(
        e.contains("cannot restore here") && e.contains("differ"),
        "{e}"
    );

    // The untouched snapshot still restores.
    let snap = Snapshot::open(&good.0).unwrap();
    assert!(snapshot::restore(&snap, &mut VmBuilder, RestoreMode::Full)
        .map(|r| r.vm)
        .is_ok());
}

#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn lazily_restored_guest_continues_while_memory_arrives() {
    for backend in [Backend::Anon, Backend::Memfd] {
        let dir = TempDir::new(&format!("lazy-{backend}"));
        let at_snapshot = snapshot_running_vm(&VmConfig::simple(2, SIZE, backend), SIZE, &dir.0);
        let snap = Snapshot::open(&dir.0).unwrap();
        let work = dirty_work(2, SIZE);

        // The guest runs at once; its pages come in as it touches them.
        let quiet = PagerConfig {
            background: false,
            ..PagerConfig::default()
        };
        let mut lazy =
            snapshot::restore(&snap, &mut VmBuilder, RestoreMode::Lazy(quiet.clone())).unwrap();
        assert_eq!(
            lazy.vm.pages_done(),
            at_snapshot,
            "{backend}: control blocks restored"
        );
        resume_and_check_continuation(&mut lazy.vm, &work, &at_snapshot);
        drop(lazy);

        // Left alone, the background fetch brings in exactly the snapshot's memory.
        let lazy = common::lazy_restore_resident(&snap, std::time::Duration::from_secs(30));
        assert_memory_is_snapshot(&lazy.vm, &snap, &format!("{backend}"));
        assert_pages_consistent(&lazy.vm, &work, &at_snapshot);
    }
}

#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn lazy_restore_refuses_what_it_cannot_serve_and_stops_on_corrupt_pages() {
    let dir = TempDir::new("lazy-gmem");
    snapshot_running_vm(
        &VmConfig::simple(2, SIZE, Backend::GuestMemfd),
        SIZE,
        &dir.0,
    );
    let snap = Snapshot::open(&dir.0).unwrap();
    // With KVM Userfault (the seeds kernel) a guest_memfd restores lazily: tests/tests/seeds.rs.
    let userfault = guestmem_sys::probe::kvm_userfault_on_a_new_vm().unwrap();
    if !userfault.present {
        let e = snapshot::restore(
            &snap,
            &mut VmBuilder,
            RestoreMode::Lazy(PagerConfig::default()),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(
            e.contains("KVM_MEM_USERFAULT") && e.contains("region 'ram'"),
            "{e}"
        );
    }

    // A flipped byte in RAM is found when the guest first touches that chunk: the run stops
    // with the checksum error and the guest address, instead of the guest reading bad bytes.
    let dir = TempDir::new("lazy-corrupt");
    snapshot_running_vm(&VmConfig::simple(2, SIZE, Backend::Anon), SIZE, &dir.0);
    flip_byte_in_ram(&dir.0, 5, 1);
    let snap = Snapshot::open(&dir.0).unwrap();
    let e = common::lazy_run_error(&snap, std::time::Duration::from_secs(30));
    assert!(
        e.contains("corrupt snapshot") && e.contains("region 'ram' chunk 0 (offset 0x0)"),
        "{e}"
    );
    assert!(e.contains(&format!("{:#x}", layout::RAM_GPA)), "{e}");
}

/// A diff snapshot holds only the chunks written since its base, and restores (with its base,
/// in full and lazily) to exactly the memory and guest state of the moment it was taken.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn a_diff_snapshot_restores_over_its_base() {
    use guestmem_tracking::{Mode, Tracker};
    let (base, diff) = (TempDir::new("diff-base"), TempDir::new("diff"));
    let config = VmConfig::simple(2, 64 << 20, Backend::Memfd);
    let mut vm = Vm::new(&config).unwrap();
    let work = dirty_work(2, SIZE);
    let running = vm.start(&work).unwrap();
    wait_for_generation(&running, 2);
    running.pause().unwrap();
    let base_report = snapshot::write(&vm, &base.0).unwrap();
    let at_base = vm.pages_done();

    // The guest goes on for a few hundred pages, watched by a tracker.
    let mut tracker = Tracker::start(&vm, Mode::Bitmap).unwrap();
    let running = vm.resume().unwrap();
    while running
        .progress()
        .iter()
        .zip(&at_base)
        .any(|(&(p, _), &b)| p < b + 300)
    {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    running.pause().unwrap();
    let dirty = tracker.harvest().unwrap();
    tracker.stop().unwrap();
    let at_diff = vm.pages_done();
    let diff_report = snapshot::write_diff(&vm, &diff.0, &base.0, &dirty).unwrap();
    // Only the first 8 MiB of the 64 MiB are ever written: the rest is inherited.
    assert!(
        diff_report.data_bytes < base_report.data_bytes,
        "{diff_report:?}"
    );

    let snap = Snapshot::open(&diff.0).unwrap();
    let inherited = snap
        .manifest()
        .regions
        .iter()
        .flat_map(|r| &r.chunks)
        .filter(|c| c.inherited)
        .count();
    assert!(inherited >= 28, "{inherited} chunks inherited");
    let mut restored = snapshot::restore(&snap, &mut VmBuilder, RestoreMode::Full)
        .map(|r| r.vm)
        .unwrap();
    for (region, image) in restored
        .memory()
        .regions()
        .iter()
        .zip(&snap.manifest().regions)
    {
        let digest = restored
            .memory()
            .digest(region.gpa(), region.size())
            .unwrap();
        assert_eq!(digest, image.digest, "region '{}'", region.name());
        let now = vm.memory().digest(region.gpa(), region.size()).unwrap();
        assert_eq!(
            digest,
            now,
            "region '{}' equals the source VM's",
            region.name()
        );
    }
    assert_eq!(restored.pages_done(), at_diff);
    resume_and_check_continuation(&mut restored, &work, &at_diff);

    // Lazily, pages come from the diff where it holds them, else from the base: the guest
    // continues from the same point and the memory ends up equal to the snapshot's.
    let mut lazy = common::lazy_restore_resident(&snap, std::time::Duration::from_secs(30));
    assert_eq!(lazy.vm.pages_done(), at_diff);
    assert_memory_is_snapshot(&lazy.vm, &snap, "lazy");
    resume_and_check_continuation(&mut lazy.vm, &work, &at_diff);
    drop(lazy);

    // A diff needs its base, whole, and cannot be mapped from one file.
    let e = snapshot::restore(&snap, &mut VmBuilder, RestoreMode::Map)
        .map(|r| r.vm)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("full mode"), "{e}");
    // Nor can a page server be handed it: its RAM is in several files.
    let e = snapshot::restore(
        &snap,
        &mut VmBuilder,
        RestoreMode::PageServer(snap.dir().join("no-server.sock")),
    )
    .map(|r| r.vm)
    .err()
    .unwrap()
    .to_string();
    assert!(
        e.contains("spread over its memory file and its base's"),
        "{e}"
    );

    // The base replaced by another snapshot, whole and self-consistent (the same VM a little
    // later): the diff is refused in every mode, naming the base, instead of restoring over
    // the wrong bytes.
    let running = vm.resume().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(50));
    running.pause().unwrap();
    snapshot::write(&vm, &base.0).unwrap();
    assert!(Snapshot::open(&base.0).is_ok(), "the new base is whole");
    for mode in ["full", "lazy"] {
        let e = restore_error(&diff.0, mode);
        assert!(
            e.contains("diff-base") && e.contains("not the base the diff was written over"),
            "{mode}: {e}"
        );
    }

    std::fs::remove_file(base.0.join("manifest.json")).unwrap();
    let e = Snapshot::open(&diff.0).err().unwrap().to_string();
    assert!(
        e.contains("manifest.json") && e.contains("diff-base"),
        "{e}"
    );
}

/// Every way found to make a restore run a guest on wrong bytes, in every mode: each is
/// refused before a vCPU runs, naming the snapshot, region and chunk where there is one.
#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn no_restore_mode_runs_a_guest_on_wrong_bytes() {
    let good = TempDir::new("wrong-bytes");
    // 16 MiB of RAM of which the guest writes the first 8 MiB: chunks 4.. are zero chunks.
    snapshot_running_vm(&VmConfig::simple(2, 2 * SIZE, Backend::Anon), SIZE, &good.0);
    let ram_chunk = |m: &serde_json::Value, i: usize| m["regions"][1]["chunks"][i].clone();
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(good.0.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["regions"][1]["spec"]["name"], "ram");
    assert_eq!(ram_chunk(&manifest, 0)["zero"], false);
    assert_eq!(ram_chunk(&manifest, 5)["zero"], true);

    for mode in ["full", "map", "lazy"] {
        // A data chunk marked zero in the manifest (which would hand the guest zeros).
        let d = copy_snapshot(&good.0, &format!("zeroed-{mode}"));
        edit_manifest(&d.0, |m| m["regions"][1]["chunks"][0]["zero"] = true.into());
        let e = restore_error(&d.0, mode);
        assert!(
            e.contains("manifest.json") && e.contains("do not match its checksum"),
            "{mode}: {e}"
        );

        // A chunk list one entry short, sealed again: refused as malformed, not a panic.
        let d = copy_snapshot(&good.0, &format!("short-{mode}"));
        edit_and_reseal_manifest(&d.0, |m| {
            m["regions"][1]["chunks"].as_array_mut().unwrap().pop();
        });
        let e = restore_error(&d.0, mode);
        assert!(e.contains("region 'ram' lists 7 chunks"), "{mode}: {e}");
    }

    // A byte written into a hole of a zero chunk: map mode would show the guest the file
    // itself, so it checks zero chunks too, naming the chunk. Full and lazy restores give the
    // guest zeros for a zero chunk whatever the file holds, so they restore the right bytes.
    let d = copy_snapshot(&good.0, "hole");
    common::write_byte_in_ram(&d.0, 5 * (2 << 20) + 123, 0x5a);
    let e = restore_error(&d.0, "map");
    assert!(
        e.contains("region 'ram' chunk 5 (offset 0xa00000)") && e.contains("hole"),
        "{e}"
    );
    let snap = Snapshot::open(&d.0).unwrap();
    let vm = snapshot::restore(&snap, &mut VmBuilder, RestoreMode::Full)
        .map(|r| r.vm)
        .unwrap();
    assert_memory_is_snapshot(&vm, &snap, "full");
}

/// A snapshot written over an existing one on a file system that fills up fails, and the
/// previous snapshot is left whole and restorable; a directory holding other files is not
/// replaced.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn a_failed_snapshot_write_keeps_the_previous_snapshot() {
    let mnt = TempDir::new("enospc");
    let (small, _unmount) = small_tmpfs(&mnt, "24m");

    // 16 MiB of RAM, every page of it written: one snapshot fits in 24 MiB, two do not.
    let dir = small.join("snap");
    let config = VmConfig::simple(2, 2 * SIZE, Backend::Anon);
    let mut vm = Vm::new(&config).unwrap();
    let work = dirty_work(2, 2 * SIZE);
    let running = vm.start(&work).unwrap();
    wait_for_generation(&running, 1);
    running.pause().unwrap();
    snapshot::write(&vm, &dir).unwrap();
    let at_first = vm.pages_done();
    let first_manifest = std::fs::read(dir.join("manifest.json")).unwrap();

    let running = vm.resume().unwrap();
    wait_for_generation(&running, 2);
    running.pause().unwrap();
    let e = snapshot::write(&vm, &dir).unwrap_err();
    let e = guestmem_migration::error_chain(&e, ": ");
    assert!(e.contains("write failed: No space left on device"), "{e}");

    // The first snapshot is still there, unchanged, with nothing of the failed write beside it.
    assert_eq!(
        std::fs::read(dir.join("manifest.json")).unwrap(),
        first_manifest
    );
    let leftovers: Vec<_> = std::fs::read_dir(&small)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(leftovers, vec![std::ffi::OsString::from("snap")]);
    let snap = Snapshot::open(&dir).unwrap();
    let mut restored = snapshot::restore(&snap, &mut VmBuilder, RestoreMode::Full)
        .map(|r| r.vm)
        .unwrap();
    assert_eq!(restored.pages_done(), at_first);
    resume_and_check_continuation(&mut restored, &work, &at_first);

    // A directory with someone else's file in it is not a snapshot to replace.
    let other = TempDir::new("not-a-snapshot");
    std::fs::write(other.0.join("notes.txt"), b"keep me").unwrap();
    let e = snapshot::write(&vm, &other.0).unwrap_err().to_string();
    assert!(
        e.contains("notes.txt") && e.contains("not part of a snapshot"),
        "{e}"
    );
    assert_eq!(
        std::fs::read(other.0.join("notes.txt")).unwrap(),
        b"keep me"
    );
}

/// Runs a lazily restored VM until every vCPU is `pages` past `before`, stops it, and returns
/// the pagers' fault count.
fn run_lazy_for(lazy: &mut snapshot::Restored, before: &[u64], pages: u64) -> u64 {
    let running = lazy.vm.resume().unwrap();
    while running
        .progress()
        .iter()
        .zip(before)
        .any(|(&(p, _), &b)| p < b + pages)
    {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    running.stop();
    running.wait(std::time::Duration::from_secs(30)).unwrap();
    lazy.pagers.iter().map(|p| p.stats().faults).sum()
}

/// A lazy restore records the chunks its guest faulted on; the next lazy restore of the same
/// snapshot fetches them first, so the guest faults less, and the memory is still the
/// snapshot's.
#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn a_recorded_working_set_is_fetched_first_and_saves_faults() {
    const RAM: u64 = 64 << 20;
    let dir = TempDir::new("working-set");
    let at_snapshot = snapshot_running_vm(&VmConfig::simple(2, RAM, Backend::Anon), RAM, &dir.0);
    let quiet = PagerConfig {
        background: false,
        ..PagerConfig::default()
    };
    // 3000 pages (almost 12 MiB) per vCPU after the restore: several chunks each.
    let snap = Snapshot::open(&dir.0).unwrap();
    assert!(snap.working_set().unwrap().is_none());
    let mut lazy =
        snapshot::restore(&snap, &mut VmBuilder, RestoreMode::Lazy(quiet.clone())).unwrap();
    assert!(!lazy.prefetched);
    let first = run_lazy_for(&mut lazy, &at_snapshot, 3000);
    let recorded = lazy.record_working_set(&snap).unwrap();
    assert!(
        first > 0 && recorded >= 4,
        "{first} faults, {recorded} chunks"
    );
    drop(lazy);

    // The next restore fetches the recorded chunks first (here before the guest runs).
    let snap = Snapshot::open(&dir.0).unwrap();
    let ws = snap.working_set().unwrap().expect("recorded");
    assert_eq!(ws.chunks(), recorded);
    let mut lazy =
        snapshot::restore(&snap, &mut VmBuilder, RestoreMode::Lazy(quiet.clone())).unwrap();
    assert!(lazy.prefetched);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !lazy.pagers.iter().all(|p| p.stats().prefetch_done) {
        assert!(std::time::Instant::now() < deadline, "prefetch never ended");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let prefetched: u64 = lazy.pagers.iter().map(|p| p.stats().prefetch_chunks).sum();
    assert_eq!(prefetched, recorded as u64);
    let second = run_lazy_for(&mut lazy, &at_snapshot, 3000);
    assert!(
        second < first,
        "{second} faults with the working set prefetched, {first} without"
    );
    drop(lazy);

    // With the background sweep after the prefetch, memory ends up equal to the snapshot's.
    let lazy = common::lazy_restore_resident(&snap, std::time::Duration::from_secs(30));
    assert_memory_is_snapshot(&lazy.vm, &snap, "restored");
    drop(lazy);

    // A working set whose list was altered is refused, as is one of another snapshot.
    let path = dir.0.join("working-set.json");
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let first = json["regions"][0]["chunks"][0].as_u64().unwrap();
    json["regions"][0]["chunks"][0] = ((first + (2 << 20)) % RAM).into();
    std::fs::write(&path, serde_json::to_vec(&json).unwrap()).unwrap();
    let e = snap.working_set().unwrap_err().to_string();
    assert!(
        e.contains("working-set.json") && e.contains("checksum"),
        "{e}"
    );
    snapshot_running_vm(&VmConfig::simple(2, RAM, Backend::Anon), RAM, &dir.0);
    assert!(
        !path.exists(),
        "a new snapshot in the directory drops the old working set"
    );
}
