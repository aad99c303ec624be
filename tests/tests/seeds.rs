//! The seeds kernel's features (kernel/seeds: KVM Userfault, guest_memfd `write()`,
//! userfaultfd on guest_memfd), used for real. These tests need that kernel: they are ignored
//! by default and run in the kernel lab with `--ignored`, where each one fails if its feature
//! is missing.

mod common;

use guestmem_sys::to_usize;
use std::sync::Arc;
use std::time::Duration;

use common::{
    assert_memory_is_snapshot, assert_pages_consistent, dirty_work, resume_and_check_continuation,
    TempDir,
};
use guestmem_contract::VmBuilder;
use guestmem_memory::{populate, Backend, Method, PopulateFrom, PAGE_SIZE};
use guestmem_paging::PagerConfig;
use guestmem_snapshot::{self as snapshot, RestoreMode, Snapshot};
use guestmem_store::chunk as store_chunk;
use guestmem_store::local::LocalObjectStore;
use guestmem_store::restore::StoreSnapshot;
use guestmem_store::write::write as store_write;
use guestmem_store::ObjectStore;
use guestmem_vm::layout::RAM_GPA;
use guestmem_vm::{Vm, VmConfig};

const SIZE: u64 = 8 << 20;
/// `probe` finds all three features present, by trying them.
#[test]
#[ignore = "needs the seeds kernel (scripts/build-seeds-kernel.sh): run in the kernel lab with --ignored"]
fn probe_finds_the_three_seed_features() {
    let p = guestmem_sys::probe::probe();
    let write = p.guest_memfd_write.expect("guest_memfd write() probe ran");
    assert!(write.present, "guest_memfd write(): {}", write.detail);
    assert_eq!(
        write.flag,
        Some(guestmem_sys::uapi::GUEST_MEMFD_FLAG_WRITE_CANDIDATE),
        "{}",
        write.detail
    );
    let userfault = p.kvm_userfault.expect("KVM Userfault probe ran");
    assert!(userfault.present, "KVM Userfault: {}", userfault.detail);
    let uffd = p
        .guest_memfd_uffd
        .expect("guest_memfd userfaultfd probe ran");
    assert!(uffd.missing && uffd.minor, "{}", uffd.detail);
}

/// A snapshot of a guest_memfd VM restores lazily through KVM Userfault: the guest runs at
/// once and carries on from where it stopped while its pages come in on its exits (no
/// background fetch); left alone, the background fetch brings in exactly the snapshot's memory.
#[test]
#[ignore = "needs the seeds kernel (scripts/build-seeds-kernel.sh): run in the kernel lab with --ignored"]
fn gmem_lazy_restore_through_kvm_userfault() {
    let dir = TempDir::new("seeds-lazy-gmem");
    let config = VmConfig::simple(2, SIZE, Backend::GuestMemfd);
    let at_snapshot = common::snapshot_running_vm(&config, SIZE, &dir.0);
    let snap = Snapshot::open(&dir.0).unwrap();
    let work = dirty_work(2, SIZE);

    let quiet = PagerConfig {
        background: false,
        fault_around: 64 << 10,
        ..PagerConfig::default()
    };
    let mut lazy =
        snapshot::restore(&snap, &mut VmBuilder, RestoreMode::Lazy(quiet.clone())).unwrap();
    assert!(
        lazy.pagers.is_empty(),
        "no userfaultfd pager for guest_memfd"
    );
    assert_eq!(lazy.userfault_pagers.len(), 1);
    assert_eq!(lazy.userfault_pagers[0].install_method(), "write");
    assert_eq!(lazy.vm.pages_done(), at_snapshot);
    resume_and_check_continuation(&mut lazy.vm, &work, &at_snapshot);
    let stats = lazy.userfault_pagers[0].stats();
    assert!(stats.faults > 0 && stats.fault_chunks > 0, "{stats:?}");
    assert_eq!(stats.background_chunks, 0, "{stats:?}");
    drop(lazy);

    let lazy = snapshot::restore(
        &snap,
        &mut VmBuilder,
        RestoreMode::Lazy(PagerConfig::default()),
    )
    .unwrap();
    assert!(lazy.userfault_pagers[0]
        .wait_resident(Duration::from_secs(60))
        .unwrap());
    assert_memory_is_snapshot(&lazy.vm, &snap, "restored");
    assert_pages_consistent(&lazy.vm, &work, &at_snapshot);
}

/// A corrupt chunk of a guest_memfd snapshot stops the lazily restored guest with the
/// checksum error when a vCPU first touches it, instead of the guest reading bad bytes.
#[test]
#[ignore = "needs the seeds kernel (scripts/build-seeds-kernel.sh): run in the kernel lab with --ignored"]
fn gmem_lazy_restore_stops_on_a_corrupt_chunk() {
    let dir = TempDir::new("seeds-lazy-gmem-corrupt");
    common::snapshot_running_vm(
        &VmConfig::simple(2, SIZE, Backend::GuestMemfd),
        SIZE,
        &dir.0,
    );
    common::flip_byte_in_ram(&dir.0, 5, 1);
    let snap = Snapshot::open(&dir.0).unwrap();
    let e = common::lazy_run_error(&snap, Duration::from_secs(60));
    assert!(
        e.contains("corrupt snapshot") && e.contains("region 'ram' chunk 0"),
        "{e}"
    );
}

/// Population of guest_memfd uses `write()`, and the guest reads exactly the image.
#[test]
#[ignore = "needs the seeds kernel (scripts/build-seeds-kernel.sh): run in the kernel lab with --ignored"]
#[allow(clippy::cast_possible_truncation)] // test data: the low byte of a pattern.
fn gmem_population_uses_write() {
    let mut vm = Vm::new(&VmConfig::simple(1, SIZE, Backend::GuestMemfd)).unwrap();
    let image: Vec<u8> = (0..to_usize(SIZE))
        .map(|i| {
            if (i / 4096).is_multiple_of(3) {
                0
            } else {
                (i * 7 % 251) as u8
            }
        })
        .collect();
    let region = vm.memory().region("ram").unwrap();
    let done = populate(region, 0, SIZE, PopulateFrom::Bytes(&image)).unwrap();
    assert_eq!(done.method, Method::GmemWrite, "{:?}", done.fallback_reason);
    assert!(done.fallback_reason.is_none());
    let work = guestmem_vm::VcpuWork::split(
        guestmem_vm::Workload::Verify,
        guestmem_vm::layout::RAM_GPA,
        SIZE,
        1,
        1,
    );
    let report = vm.run(&work, Duration::from_secs(60)).unwrap();
    assert_eq!(
        report.vcpus[0].digest,
        guestmem_memory::digest_bytes(guestmem_memory::DIGEST_SEED, &image)
    );
}

/// Post-copy of a guest_memfd VM over a Unix socket, the destination's region armed with KVM
/// Userfault: once everything has arrived its memory equals the source's at the switch-over,
/// and the guest, let go, counts on from where it stopped.
#[test]
#[ignore = "needs the seeds kernel (scripts/build-seeds-kernel.sh): run in the kernel lab with --ignored"]
fn gmem_postcopy_through_kvm_userfault() {
    use guestmem_migration::migrate::{self, Links, Mode, ReceiveOptions, SendOptions};
    use guestmem_migration::transport::{
        generate_credentials, Credentials, Endpoint, Listener, Role,
    };
    let dir = TempDir::new("seeds-postcopy-gmem");
    generate_credentials(&dir.0).unwrap();
    let endpoint = Endpoint::Unix(dir.0.join("sock"));
    let listener = Arc::new(
        Listener::bind(
            &endpoint,
            &Credentials::load(&dir.0, Role::Destination).unwrap(),
        )
        .unwrap(),
    );
    let digest = |m: &guestmem_memory::GuestMemory| -> Vec<u64> {
        m.regions()
            .iter()
            .map(|r| m.digest(r.gpa(), r.size()).unwrap())
            .collect()
    };
    let dest = std::thread::spawn(move || {
        let migrate::Incoming {
            mut vm,
            mut transfer,
        } = migrate::receive(listener, &ReceiveOptions::default()).unwrap();
        let at_switchover = vm.pages_done();
        let memory = vm.memory().clone();
        let work = dirty_work(2, SIZE);
        let running = transfer.resume(&mut vm).unwrap();
        // The guest is parked at its generation gate: once every page has arrived (its own
        // faults and the background transfer), the memory is the source's.
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        while transfer.missing_bytes() > 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "post-copy did not finish"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let arrived = digest(&memory);
        running.set_generation_limit(u64::MAX);
        let target = at_switchover
            .iter()
            .map(|p| p / work[0].pages() + 2)
            .max()
            .unwrap();
        common::wait_for_generation(&running, target);
        running.stop();
        let run = running.wait(Duration::from_secs(60)).unwrap();
        let after: Vec<u64> = run.vcpus.iter().map(|v| v.pages).collect();
        let report = transfer.finish().unwrap();
        assert_pages_consistent(&vm, &work, &after);
        (at_switchover, after, arrived, report)
    });

    let mut vm = Vm::new(&VmConfig::simple(2, SIZE, Backend::GuestMemfd)).unwrap();
    let running = vm.start(&dirty_work(2, SIZE)).unwrap();
    common::wait_for_generation(&running, 1);
    // Park the guest after its current pass, so that its memory stops changing.
    let g = running.progress().iter().map(|&(_, g)| g).max().unwrap() + 1;
    running.set_generation_limit(g);
    common::wait_for_generation(&running, g);
    let creds = Credentials::load(&dir.0, Role::Source).unwrap();
    let links = Links::connect(&endpoint, &creds, Mode::Postcopy, 2).unwrap();
    let report = migrate::send(
        running,
        links,
        &SendOptions {
            mode: Mode::Postcopy,
            ..Default::default()
        },
    )
    .unwrap_or_else(|f| panic!("post-copy of guest_memfd: {f:?}"));
    let (at_switchover, after, arrived, dest_report) = dest.join().unwrap();
    assert_eq!(at_switchover, vm.pages_done());
    assert_eq!(
        arrived,
        digest(vm.memory()),
        "the destination's memory is the source's at the switch-over"
    );
    for (b, a) in at_switchover.iter().zip(&after) {
        assert!(a > b, "the guest went on counting: {b} -> {a}");
    }
    // The guest waits at its gate until everything has arrived, so the pages come by the
    // background transfer (vCPU exits served by the same pager: the lazy restore test).
    assert!(
        dest_report.postcopy_bytes >= SIZE / 2,
        "the memory came over post-copy: {dest_report:?}"
    );
    assert!(report.postcopy_requests > 0);
}

/// A 2-vCPU guest_memfd VM running `dirty` over SIZE bytes, paused after two passes, written
/// to a local store in `dir` as snapshot "gmem": the store, the pages done per vCPU, and the
/// digest of each region at the snapshot.
fn gmem_store_snapshot(dir: &TempDir) -> (Arc<dyn ObjectStore>, Vec<u64>, Vec<u64>, Vm) {
    let mut vm = Vm::new(&VmConfig::simple(2, SIZE, Backend::GuestMemfd)).unwrap();
    let running = vm.start(&dirty_work(2, SIZE)).unwrap();
    common::wait_for_generation(&running, 2);
    running.pause().unwrap();
    let objects: Arc<dyn ObjectStore> = Arc::new(LocalObjectStore::new(&dir.0.join("store")));
    store_write(&*objects, "gmem", &vm, None).unwrap();
    let digests = region_digests(vm.memory());
    (objects, vm.pages_done(), digests, vm)
}

fn region_digests(m: &guestmem_memory::GuestMemory) -> Vec<u64> {
    m.regions()
        .iter()
        .map(|r| m.digest(r.gpa(), r.size()).unwrap())
        .collect()
}

/// A guest_memfd VM restores lazily from the chunk store through KVM Userfault: the guest runs
/// at once and carries on while its exits bring the chunks in (each checked against its hash);
/// left alone, the background fetch brings in exactly the snapshot's memory (digests, and the
/// manifest's hashes chunk by chunk); the faults are recorded as a working set, which the next
/// lazy restore fetches first.
#[test]
#[ignore = "needs the seeds kernel (scripts/build-seeds-kernel.sh): run in the kernel lab with --ignored"]
fn gmem_store_lazy_restore_through_kvm_userfault() {
    let dir = TempDir::new("seeds-store-lazy-gmem");
    let (objects, at_snapshot, want, source_vm) = gmem_store_snapshot(&dir);
    drop(source_vm);
    let work = dirty_work(2, SIZE);
    let snap = StoreSnapshot::open(objects.clone(), "gmem", None).unwrap();
    let quiet = PagerConfig {
        background: false,
        ..PagerConfig::default()
    };
    let mut lazy =
        snapshot::restore(&snap, &mut VmBuilder, RestoreMode::Lazy(quiet.clone())).unwrap();
    assert!(
        lazy.pagers.is_empty(),
        "no userfaultfd pager for guest_memfd"
    );
    assert_eq!(lazy.userfault_pagers.len(), 1);
    assert!(!lazy.prefetched);
    assert_eq!(lazy.vm.pages_done(), at_snapshot);
    resume_and_check_continuation(&mut lazy.vm, &work, &at_snapshot);
    let stats = lazy.userfault_pagers[0].stats();
    assert!(stats.faults > 0 && stats.fault_chunks > 0, "{stats:?}");
    assert_eq!(stats.background_chunks, 0, "{stats:?}");
    let recorded = lazy.record_working_set(&snap).unwrap();
    assert_eq!(recorded as u64, stats.fault_chunks);
    drop(lazy);

    let lazy = snapshot::restore(
        &snap,
        &mut VmBuilder,
        RestoreMode::Lazy(PagerConfig::default()),
    )
    .unwrap();
    assert!(lazy.prefetched, "the recorded working set is fetched first");
    let pager = &lazy.userfault_pagers[0];
    assert!(pager.wait_resident(Duration::from_secs(60)).unwrap());
    let stats = pager.stats();
    assert_eq!(to_usize(stats.prefetch_chunks), recorded, "{stats:?}");
    assert_eq!(region_digests(lazy.vm.memory()), want);
    snap.check_memory(lazy.vm.memory()).unwrap();
    assert_pages_consistent(&lazy.vm, &work, &at_snapshot);
}

/// A damaged chunk of a guest_memfd store snapshot: the lazily restored guest stops with the
/// error naming the chunk when a vCPU first touches it, and the background fetch stops the
/// restore with the same error; the guest never runs on the chunk's bytes.
#[test]
#[ignore = "needs the seeds kernel (scripts/build-seeds-kernel.sh): run in the kernel lab with --ignored"]
fn gmem_store_lazy_restore_refuses_a_damaged_chunk() {
    let dir = TempDir::new("seeds-store-lazy-gmem-bad");
    let (objects, _, _, source_vm) = gmem_store_snapshot(&dir);
    drop(source_vm);
    let hash = common::damage_first_ram_chunk(&*objects, "gmem");
    let named = |e: &str| {
        assert!(
            e.contains("corrupt store snapshot")
                && e.contains("region 'ram' chunk 0 (offset 0x0)")
                && e.contains(&store_chunk::hex(&hash)),
            "{e}"
        );
    };

    let snap = StoreSnapshot::open(objects.clone(), "gmem", None).unwrap();
    named(&common::lazy_run_error(&snap, Duration::from_secs(60)));

    let lazy = snapshot::restore(
        &snap,
        &mut VmBuilder,
        RestoreMode::Lazy(PagerConfig::default()),
    )
    .unwrap();
    let e = lazy.userfault_pagers[0]
        .wait_resident(Duration::from_secs(60))
        .unwrap_err();
    named(&guestmem_sys::error_chain(&e, ": "));
}

/// The VMM's own reads of a lazily restored guest_memfd region (through its host mapping, which
/// KVM Userfault does not trap) are served by the same pager through userfaultfd on the
/// mapping: before any vCPU runs and with no background fetch, a page never fetched reads the
/// snapshot's bytes, its chunk's bits are cleared, the whole memory's digest is the snapshot's,
/// and the guest then carries on.
#[test]
#[ignore = "needs the seeds kernel (scripts/build-seeds-kernel.sh): run in the kernel lab with --ignored"]
fn gmem_host_read_of_an_unfetched_page_gets_the_snapshot_bytes() {
    let dir = TempDir::new("seeds-store-gmem-host-read");
    let (objects, at_snapshot, want, source_vm) = gmem_store_snapshot(&dir);
    // A page in the second half of RAM holding data at the snapshot.
    let page = to_usize(PAGE_SIZE);
    let mut expected = vec![0u8; page];
    let mut gpa = RAM_GPA + SIZE / 2;
    loop {
        source_vm.memory().read(gpa, &mut expected).unwrap();
        if expected.iter().any(|b| *b != 0) {
            break;
        }
        gpa += PAGE_SIZE;
        assert!(
            gpa < RAM_GPA + SIZE,
            "the guest wrote the second half of RAM"
        );
    }
    drop(source_vm);
    let snap = StoreSnapshot::open(objects, "gmem", None).unwrap();
    let quiet = PagerConfig {
        background: false,
        ..PagerConfig::default()
    };
    let mut lazy =
        snapshot::restore(&snap, &mut VmBuilder, RestoreMode::Lazy(quiet.clone())).unwrap();
    let pager = &lazy.userfault_pagers[0];
    assert!(pager.serves_host_access(), "{}", pager.host_access());
    assert_eq!(pager.host_access(), guestmem_paging::HOST_UFFD);
    assert_eq!(pager.stats().resident_bytes, 0);

    let mut seen = vec![0u8; page];
    lazy.vm.memory().read(gpa, &mut seen).unwrap();
    assert!(seen == expected, "the VMM read the snapshot's bytes");
    let (faults, chunks) = pager.host_faults();
    assert!(
        faults >= 1 && chunks == 1,
        "{faults} faults, {chunks} chunks"
    );
    // The same chunk, the same bits: installed once, and a vCPU will not exit on it.
    assert_eq!(pager.stats().resident_bytes, pager.chunk_bytes());
    assert_eq!(pager.stats().faults, 0, "no vCPU ran yet");

    // Every other page too (zero pages of fetched chunks included): the digest is the
    // snapshot's, and every bit is clear.
    assert_eq!(region_digests(lazy.vm.memory()), want);
    assert!(pager.wait_resident(Duration::from_secs(5)).unwrap());
    let work = dirty_work(2, SIZE);
    resume_and_check_continuation(&mut lazy.vm, &work, &at_snapshot);
}
