//! Snapshots in the chunk store, on a real VM: written to a local store and to a
//! real MinIO started by the test, restored in full and lazily, diffs and merges, garbage
//! collection, and damaged or missing chunks refused before a guest runs on them.

mod common;
#[path = "common/minio.rs"]
mod minio;

use guestmem_sys::to_usize;
use std::sync::Arc;
use std::time::Duration;

use common::{
    assert_pages_consistent, dirty_work, resume_and_check_continuation, small_tmpfs,
    wait_for_generation, TempDir,
};
use guestmem_contract::VmBuilder;
use guestmem_memory::Backend as MemBackend;
use guestmem_paging::{PageSource, PagerConfig};
use guestmem_snapshot::{self as snapshot, RestoreMode};
use guestmem_store::chunk;
use guestmem_store::gc;
use guestmem_store::local::LocalObjectStore;
use guestmem_store::manifest::{manifest_key, ChunkRef, StoreManifest};
use guestmem_store::pages::StorePages;
use guestmem_store::restore::StoreSnapshot;
use guestmem_store::s3::{S3Config, S3ObjectStore};
use guestmem_store::write::write;
use guestmem_store::Error;
use guestmem_store::ObjectStore;
use guestmem_tracking::{Mode as TrackingMode, Tracker};
use guestmem_vm::{Vm, VmConfig};
use minio::Minio;

const SIZE: u64 = 32 << 20;

/// A 2-vCPU VM running `dirty` over SIZE bytes, paused after two passes.
fn paused_vm() -> Vm {
    paused_vm_on(MemBackend::Anon)
}

/// [`paused_vm`] with its memory on `backend`.
fn paused_vm_on(backend: MemBackend) -> Vm {
    let mut vm = Vm::new(&VmConfig::simple(2, SIZE, backend)).unwrap();
    let running = vm.start(&dirty_work(2, SIZE)).unwrap();
    wait_for_generation(&running, 2);
    running.pause().unwrap();
    vm
}

fn digests(vm: &Vm) -> Vec<u64> {
    vm.memory()
        .regions()
        .iter()
        .map(|r| vm.memory().digest(r.gpa(), r.size()).unwrap())
        .collect()
}

fn s3(m: &Minio, prefix: &str) -> Arc<dyn ObjectStore> {
    let config = S3Config {
        endpoint: Some(m.endpoint()),
        access_key_id: minio::USER.into(),
        secret_access_key: minio::PASSWORD.into(),
        region: None,
    };
    Arc::new(S3ObjectStore::new(&m.bucket, prefix, &config).unwrap())
}

fn cache(dir: &TempDir) -> guestmem_store::cache::ChunkCache {
    guestmem_store::cache::ChunkCache::open(&dir.0.join("cache"), 1 << 30).unwrap()
}

/// The full restore's whole-memory check: memory as restored passes; one byte changed in a
/// data chunk, or written into a zero chunk, is found and named (then put back).
fn memory_checked_chunk_by_chunk(snap: &StoreSnapshot, vm: &Vm) {
    snap.check_memory(vm.memory()).unwrap();
    let cb = snap.manifest.chunk_bytes;
    let find = |data: bool| {
        snap.resolved
            .iter()
            .enumerate()
            .find_map(|(r, chunks)| {
                let i = chunks.iter().position(|c| c.is_some() == data)?;
                Some((snap.manifest.regions[r].spec.gpa, i))
            })
            .expect("a data chunk and a zero chunk")
    };
    for ((gpa, i), what) in [(find(true), "hash "), (find(false), "zero chunk")] {
        let at = gpa + i as u64 * cb + 96;
        let was = vm.memory().read_u64(at).unwrap();
        vm.memory().write_u64(at, was ^ 0x40).unwrap();
        let e = snap.check_memory(vm.memory()).unwrap_err().to_string();
        assert!(
            e.contains(&format!("chunk {i} (offset {:#x})", i as u64 * cb)) && e.contains(what),
            "{e}"
        );
        vm.memory().write_u64(at, was).unwrap();
    }
    snap.check_memory(vm.memory()).unwrap();
}

/// Snapshot, then restore in full and lazily: the guest sees the same bytes (digests) and goes
/// on from where it was. A second lazy restore on the host fetches nothing from the store.
fn round_trip(objects: Arc<dyn ObjectStore>, tmp: &TempDir) {
    let vm = paused_vm();
    let at_snapshot = vm.pages_done();
    let want = digests(&vm);
    let report = write(&*objects, "vm1", &vm, None).unwrap();
    assert_eq!(report.memory_bytes, vm.memory().size());
    assert!(
        report.new_chunks > 0 && report.zero_chunks > 0,
        "{report:?}"
    );
    // The chunks are packed: a pack per run of memory, not an object per chunk.
    assert!(
        report.new_packs > 0 && report.new_packs * 8 <= report.new_chunks,
        "{report:?}"
    );
    drop(vm);

    let snap = StoreSnapshot::open(objects.clone(), "vm1", Some(cache(tmp))).unwrap();
    // Map mode maps a flat snapshot's memory file: a store snapshot is refused, saying why.
    let e = snapshot::restore(&snap, &mut VmBuilder, RestoreMode::Map)
        .map(|r| r.vm)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("compressed objects, not a memory file to map") && e.contains("full mode"),
        "{e}"
    );
    let mut vm = snapshot::restore(&snap, &mut VmBuilder, RestoreMode::Full)
        .map(|r| r.vm)
        .unwrap();
    assert_eq!(digests(&vm), want, "full restore");
    memory_checked_chunk_by_chunk(&snap, &vm);
    assert_eq!(vm.pages_done(), at_snapshot);
    let work = dirty_work(2, SIZE);
    assert_pages_consistent(&vm, &work, &at_snapshot);
    resume_and_check_continuation(&mut vm, &work, &at_snapshot);
    drop(vm);
    let first = snap.fetcher.stats();
    // Neighbouring chunks of a pack came with one read.
    assert!(
        first.store_gets > 0 && first.store_gets * 4 <= report.new_chunks,
        "{first:?} for {report:?}"
    );
    // Done with it: its chunks are all in the host's cache once its cache writer is (its
    // drop waits for that).
    drop(snap);

    for pass in 0..2 {
        let snap = StoreSnapshot::open(objects.clone(), "vm1", Some(cache(tmp))).unwrap();
        let lazy = common::lazy_restore_resident(&snap, Duration::from_secs(60));
        let (pagers, mut vm) = (lazy.pagers, lazy.vm);
        assert_eq!(digests(&vm), want, "lazy restore {pass}");
        if pass == 0 {
            snapshot::record_working_set(&snap, vm.memory(), &pagers, &[]).unwrap();
        }
        let stats = snap.fetcher.stats();
        if objects.remote() {
            // Everything came from the host's chunk cache, filled by the first restore.
            assert_eq!(stats.store_gets, 0, "lazy restore {pass}: {stats:?}");
            assert!(stats.cache_hits > 0);
        }
        resume_and_check_continuation(&mut vm, &work, &at_snapshot);
        drop(pagers);
        drop(snap);
    }
}

#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn local_store_round_trip_full_and_lazy() {
    let tmp = TempDir::new("store-local");
    round_trip(Arc::new(LocalObjectStore::new(&tmp.0.join("store"))), &tmp);
}

/// A memfd VM restored lazily from a local store: its pages are installed in the memfd's page
/// cache (userfaultfd MINOR and `UFFDIO_CONTINUE`), which must hold the store's bytes, not the
/// zeros of a freshly allocated page.
#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn local_store_lazy_restore_of_a_memfd_vm() {
    let tmp = TempDir::new("store-memfd-lazy");
    let objects: Arc<dyn ObjectStore> = Arc::new(LocalObjectStore::new(&tmp.0.join("store")));
    let vm = paused_vm_on(MemBackend::Memfd);
    let at_snapshot = vm.pages_done();
    let want = digests(&vm);
    write(&*objects, "memfd", &vm, None).unwrap();
    drop(vm);
    let snap = StoreSnapshot::open(objects, "memfd", None).unwrap();
    let lazy = common::lazy_restore_resident(&snap, Duration::from_secs(60));
    let (pagers, mut vm) = (lazy.pagers, lazy.vm);
    assert!(!pagers.is_empty());
    assert_eq!(digests(&vm), want, "lazy restore of a memfd VM");
    memory_checked_chunk_by_chunk(&snap, &vm);
    resume_and_check_continuation(&mut vm, &dirty_work(2, SIZE), &at_snapshot);
}

#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn minio_round_trip_full_and_lazy() {
    let m = Minio::start("snapshots");
    let tmp = TempDir::new("store-minio");
    round_trip(s3(&m, "fleet"), &tmp);
}

/// Identical chunks are stored once: a second snapshot of the same memory (another VM) puts
/// no chunk; a diff stores only what changed and its merge is a manifest operation; gc
/// removes exactly what no manifest references, and never while a write holds a lease.
fn dedup_diff_merge_gc(objects: Arc<dyn ObjectStore>) {
    let b = &*objects;
    let mut vm = paused_vm();
    let first = write(b, "base", &vm, None).unwrap();
    let again = write(b, "copy", &vm, None).unwrap();
    assert_eq!(again.new_chunks, 0, "{again:?}");
    assert_eq!(
        again.deduplicated_chunks,
        first.new_chunks + first.deduplicated_chunks
    );

    // The guest goes on a little under dirty tracking; the diff stores only those chunks.
    let mut tracker = Tracker::start(&vm, TrackingMode::Bitmap).unwrap();
    let running = vm.resume().unwrap();
    std::thread::sleep(Duration::from_millis(30));
    running.pause().unwrap();
    let dirty = tracker.harvest().unwrap();
    tracker.stop().unwrap();
    let want = digests(&vm);
    let at_diff = vm.pages_done();
    let diff = write(b, "diff", &vm, Some(("base", &dirty))).unwrap();
    assert!(diff.inherited_chunks > 0, "{diff:?}");
    assert!(
        diff.stored_bytes < first.stored_bytes,
        "{diff:?} vs {first:?}"
    );
    drop(vm);

    let restored = StoreSnapshot::open(objects.clone(), "diff", None).unwrap();
    let mut vm = snapshot::restore(&restored, &mut VmBuilder, RestoreMode::Full)
        .map(|r| r.vm)
        .unwrap();
    assert_eq!(digests(&vm), want, "diff over its base");
    resume_and_check_continuation(&mut vm, &dirty_work(2, SIZE), &at_diff);
    drop(vm);

    let merged = guestmem_store::merge::merge(b, "diff", "merged").unwrap();
    assert!(merged.base.is_none());
    assert!(merged
        .regions
        .iter()
        .flat_map(|r| &r.chunks)
        .all(|c| *c != ChunkRef::Base));
    let vm = snapshot::restore(
        &StoreSnapshot::open(objects.clone(), "merged", None).unwrap(),
        &mut VmBuilder,
        RestoreMode::Full,
    )
    .map(|r| r.vm)
    .unwrap();
    assert_eq!(digests(&vm), want, "merged");
    drop(vm);

    // gc: nothing to remove while every snapshot stands; a base with a diff on it cannot go.
    let r = gc::gc(b, Duration::ZERO).unwrap();
    assert_eq!((r.manifests, r.removed_chunks), (4, 0), "{r:?}");
    let e = gc::delete(b, "base").unwrap_err().to_string();
    assert!(e.contains("'diff' is a diff over 'base'"), "{e}");
    gc::delete(b, "diff").unwrap();
    gc::delete(b, "base").unwrap();
    gc::delete(b, "copy").unwrap();
    // A write under way (its lease) stops a collection from removing anything.
    b.put("leases/write-test-writer", b"write x\n").unwrap();
    let e = gc::gc(b, Duration::ZERO).unwrap_err().to_string();
    assert!(e.contains("a snapshot write is under way"), "{e}");
    b.delete("leases/write-test-writer").unwrap();
    // A pack an interrupted write left (no manifest lists it) and a chunk object of the
    // same kind from a store written before packs.
    let stray_pack = chunk::pack_key(&[0xab; 32]);
    let stray_chunk = chunk::key(&[0xcd; 32]);
    b.put(&stray_pack, b"pack").unwrap();
    b.put(&stray_chunk, b"chunk").unwrap();
    let r = gc::gc(b, Duration::ZERO).unwrap();
    // The base's packs whose every chunk the diff replaced, and the strays; the merged
    // snapshot lists the others.
    assert!(r.removed_chunks >= 2, "{r:?}");
    let referenced: std::collections::HashSet<_> =
        merged.data_chunks().map(|c| c.object_key()).collect();
    let left: std::collections::HashSet<_> = ["chunks/", "packs/"]
        .iter()
        .flat_map(|p| b.list(p).unwrap())
        .map(|o| o.key)
        .collect();
    assert_eq!(
        left, referenced,
        "exactly the merged snapshot's packs are left"
    );
    let vm = snapshot::restore(
        &StoreSnapshot::open(objects.clone(), "merged", None).unwrap(),
        &mut VmBuilder,
        RestoreMode::Full,
    )
    .map(|r| r.vm)
    .unwrap();
    assert_eq!(digests(&vm), want, "merged, after gc");
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn local_store_dedup_diff_merge_gc() {
    let tmp = TempDir::new("store-local-gc");
    dedup_diff_merge_gc(Arc::new(LocalObjectStore::new(&tmp.0.join("store"))));
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn minio_dedup_diff_merge_gc() {
    let m = Minio::start("snapshots");
    dedup_diff_merge_gc(s3(&m, "gc"));
}

/// A store written before packs (manifest version 1, every chunk an object of its own) is
/// still read: restored whole, its chunks reused by a new snapshot of the same memory (which
/// then points at them) and kept by gc.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn a_store_written_before_packs_is_read_and_its_chunks_reused() {
    let tmp = TempDir::new("store-v1");
    let objects: Arc<dyn ObjectStore> = Arc::new(LocalObjectStore::new(&tmp.0.join("store")));
    let b = &*objects;
    let vm = paused_vm();
    let want = digests(&vm);
    write(b, "old", &vm, None).unwrap();
    // Rewritten as version 1 wrote it: each chunk's frame an object, no packs.
    let mut m = StoreManifest::load(b, "old").unwrap();
    let ids = m.pack_ids();
    for r in &mut m.regions {
        for c in &mut r.chunks {
            if let Some(s) = StoreManifest::stored(c, &ids) {
                let frame = b.get_range(&s.object_key(), s.offset(), s.stored).unwrap();
                b.put(&chunk::key(&s.hash), &frame).unwrap();
                if let ChunkRef::Data { at, .. } = c {
                    *at = None;
                }
            }
        }
    }
    for id in &ids {
        b.delete(&chunk::pack_key(id)).unwrap();
    }
    // Its state object held guestmem's VM state alone (the machine's blob, bare as it was
    // before envelopes, no components), and it named no writer.
    let key = guestmem_store::manifest::state_key("old");
    let saved: guestmem_snapshot::SavedState =
        serde_json::from_slice(&b.get(&key).unwrap()).unwrap();
    let bare = guestmem_contract::envelope::bare_v1(&saved.machine).unwrap();
    b.put(&key, &bare).unwrap();
    m.state_bytes = bare.len() as u64;
    m.state_blake3 = blake3::hash(&bare).to_hex().to_string();
    m.version = 1;
    m.writer = None;
    m.packs.clear();
    m.seal();
    b.put(
        &manifest_key("old"),
        &serde_json::to_vec_pretty(&m).unwrap(),
    )
    .unwrap();
    let vm2 = snapshot::restore(
        &StoreSnapshot::open(objects.clone(), "old", None).unwrap(),
        &mut VmBuilder,
        RestoreMode::Full,
    )
    .map(|r| r.vm)
    .unwrap();
    assert_eq!(digests(&vm2), want, "a version-1 snapshot restored");
    drop(vm2);
    let again = write(b, "new", &vm, None).unwrap();
    assert_eq!((again.new_chunks, again.new_packs), (0, 0), "{again:?}");
    let new = StoreManifest::load(b, "new").unwrap();
    assert!(new.packs.is_empty() && new.data_chunks().all(|c| c.loc == chunk::Loc::Object));
    let r = gc::gc(b, Duration::ZERO).unwrap();
    assert_eq!(r.removed_chunks, 0, "{r:?}");
    let vm2 = snapshot::restore(
        &StoreSnapshot::open(objects.clone(), "new", None).unwrap(),
        &mut VmBuilder,
        RestoreMode::Full,
    )
    .map(|r| r.vm)
    .unwrap();
    assert_eq!(
        digests(&vm2),
        want,
        "a snapshot pointing at version-1 chunks"
    );
}

/// The first data chunk of the RAM region of snapshot `name`.
fn a_data_chunk(b: &dyn ObjectStore, name: &str) -> (usize, chunk::Stored) {
    let m = StoreManifest::load(b, name).unwrap();
    let ids = m.pack_ids();
    m.regions[1]
        .chunks
        .iter()
        .enumerate()
        .find_map(|(i, c)| Some((i, StoreManifest::stored(c, &ids)?)))
        .unwrap()
}

/// `object` with the chunk `c`'s `stored` bytes replaced by `with` (as long).
fn replaced(object: &[u8], c: &chunk::Stored, with: &[u8]) -> Vec<u8> {
    let at = to_usize(c.offset());
    assert_eq!(with.len() as u64, c.stored);
    [&object[..at], with, &object[at + with.len()..]].concat()
}

/// A chunk replaced by another's bytes, a missing chunk, a damaged manifest: each refused
/// before any vCPU runs, naming the snapshot, region, chunk and what is wrong.
#[allow(clippy::cast_possible_truncation)] // a short test payload.
fn refusals(objects: Arc<dyn ObjectStore>) {
    let b = &*objects;
    let vm = paused_vm();
    write(b, "vm", &vm, None).unwrap();
    drop(vm);
    let (index, c) = a_data_chunk(b, "vm");
    let (hash, key) = (c.hash, c.object_key());
    assert!(key.starts_with("packs/"), "{key}");
    let good = b.get(&key).unwrap();

    // Another chunk's bytes in its place: a well-formed zstd frame (padded to the chunk's
    // stored length with a skippable frame), whose bytes do not hash to the chunk's hash.
    let mut z = zstd::bulk::Compressor::new(1).unwrap();
    let mut other = chunk::encode(
        &mut z,
        &vec![0x5a; to_usize(guestmem_store::chunk::CHUNK_BYTES)],
    );
    let pad = to_usize(c.stored) - other.len() - 8;
    other.extend_from_slice(&0x184D_2A50u32.to_le_bytes());
    other.extend_from_slice(&(pad as u32).to_le_bytes());
    other.resize(to_usize(c.stored), 0);
    b.put(&key, &replaced(&good, &c, &other)).unwrap();
    let snap = StoreSnapshot::open(objects.clone(), "vm", None).unwrap();
    let e = snapshot::restore(&snap, &mut VmBuilder, RestoreMode::Full)
        .map(|r| r.vm)
        .expect_err("refused")
        .to_string();
    assert!(
        e.contains("/vm region 'ram'") && e.contains(&format!("chunk {index} ")),
        "{e}"
    );
    assert!(
        e.contains(&chunk::hex(&hash)) && e.contains("does not match its hash"),
        "{e}"
    );
    // The lazy path's source refuses the chunk too (the pager then stops the VM, naming the
    // guest address; the guest never sees the bytes).
    let source = StorePages::new(
        snap.fetcher.clone(),
        snap.resolved[1].clone(),
        snap.manifest.chunk_bytes,
        snap.manifest.regions[1].spec.size,
        "vm ram".into(),
    );
    let mut buf = vec![0u8; to_usize(snap.manifest.chunk_bytes)];
    let e = source
        .fetch(index as u64 * snap.manifest.chunk_bytes, &mut buf)
        .unwrap_err()
        .to_string();
    assert!(e.contains(&chunk::hex(&hash)), "{e}");

    // Same length, damaged bytes: the check catches it.
    let mut damaged = good.clone();
    damaged[to_usize(c.offset()) + to_usize(c.stored) / 2] ^= 0x40;
    b.put(&key, &damaged).unwrap();
    let full_restore_error = || {
        snapshot::restore(
            &StoreSnapshot::open(objects.clone(), "vm", None).unwrap(),
            &mut VmBuilder,
            RestoreMode::Full,
        )
        .map(|r| r.vm)
        .map_err(guestmem_store::Error::from)
        .expect_err("refused")
    };
    let e = full_restore_error().to_string();
    assert!(
        e.contains(&chunk::hex(&hash)) && e.contains("corrupt"),
        "{e}"
    );

    // A truncated pack: the chunk's bytes are not all there (nor those of the pack's later
    // chunks; the error names the chunk whose read failed first).
    b.put(&key, &good[..to_usize(c.offset() + c.stored / 2)])
        .unwrap();
    let e = full_restore_error().to_string();
    assert!(
        e.contains(&key) && e.contains("truncated") && e.contains("/vm region 'ram' chunk "),
        "{e}"
    );

    // Missing.
    b.delete(&key).unwrap();
    let e = full_restore_error();
    assert!(e.is_missing(), "{e}");
    let e = e.to_string();
    // (The pack holds chunks of both regions; the error names the first it was read for.)
    assert!(
        e.contains(&key) && e.contains("is missing") && e.contains("/vm region '"),
        "{e}"
    );
    b.put(&key, &good).unwrap();
    snapshot::restore(
        &StoreSnapshot::open(objects.clone(), "vm", None).unwrap(),
        &mut VmBuilder,
        RestoreMode::Full,
    )
    .map(|r| r.vm)
    .unwrap();

    // A state object whose hash the manifest has, but that is not a saved state: refused
    // when the snapshot is opened, naming the object.
    let skey = guestmem_store::manifest::state_key("vm");
    let mut m = StoreManifest::load(b, "vm").unwrap();
    let foreign = br#"{"vcpus":[]}"#;
    m.state_bytes = foreign.len() as u64;
    m.state_blake3 = blake3::hash(foreign).to_hex().to_string();
    m.seal();
    b.put(&skey, foreign).unwrap();
    b.put(&manifest_key("vm"), &serde_json::to_vec_pretty(&m).unwrap())
        .unwrap();
    let e = StoreSnapshot::open(objects.clone(), "vm", None).expect_err("refused");
    let text = chain(&e);
    assert!(
        matches!(e, Error::Json { .. }) && text.contains(&skey) && text.contains("unknown field"),
        "{text}"
    );

    // A truncated manifest, and a foreign one.
    let mkey = manifest_key("vm");
    let manifest = b.get(&mkey).unwrap();
    b.put(&mkey, &manifest[..manifest.len() / 2]).unwrap();
    let e = StoreSnapshot::open(objects.clone(), "vm", None)
        .expect_err("refused")
        .to_string();
    assert!(e.contains(&mkey) && e.contains("truncated"), "{e}");
    b.put(&mkey, br#"{"format":"something-else","version":1}"#)
        .unwrap();
    let e = StoreSnapshot::open(objects.clone(), "vm", None)
        .expect_err("refused")
        .to_string();
    assert!(e.contains("not a guestmem store snapshot"), "{e}");
    // A missing snapshot (or one whose write never finished: no manifest).
    let e = StoreSnapshot::open(objects.clone(), "nothing", None)
        .expect_err("refused")
        .to_string();
    assert!(e.contains("no snapshot 'nothing'"), "{e}");
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn local_store_refuses_damaged_and_missing_chunks_and_manifests() {
    let tmp = TempDir::new("store-local-bad");
    refusals(Arc::new(LocalObjectStore::new(&tmp.0.join("store"))));
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn minio_refuses_damaged_and_missing_chunks_and_manifests() {
    let m = Minio::start("snapshots");
    refusals(s3(&m, "bad"));
}

/// Wrong credentials and an unreachable endpoint are told apart and named, quickly.
#[test]
fn minio_wrong_credentials_and_unreachable_store_are_named() {
    let m = Minio::start("snapshots");
    let config = S3Config {
        endpoint: Some(m.endpoint()),
        access_key_id: minio::USER.into(),
        secret_access_key: "not-the-secret".into(),
        region: None,
    };
    let b = S3ObjectStore::new(&m.bucket, "x", &config).unwrap();
    let e = b.get("snapshots/a/manifest.json").unwrap_err();
    assert!(matches!(e, Error::Credentials { .. }), "{e:?}");
    assert!(e.to_string().contains("refused the credentials"), "{e}");

    let good = S3Config {
        secret_access_key: minio::PASSWORD.into(),
        ..config.clone()
    };
    let e = S3ObjectStore::new("no-such-bucket", "x", &good)
        .unwrap()
        .get("snapshots/a/manifest.json")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("s3://no-such-bucket/x: the bucket does not exist"),
        "{e}"
    );

    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let config = S3Config {
        endpoint: Some(format!("http://127.0.0.1:{port}")),
        ..config
    };
    let b = S3ObjectStore::new(&m.bucket, "x", &config).unwrap();
    let t = std::time::Instant::now();
    let e = b.put("chunks/00/x", b"x").unwrap_err();
    assert!(matches!(e, Error::Unreachable { .. }), "{e:?}");
    assert!(e.to_string().contains("unreachable"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
}

/// A store on a full disk: the write fails naming the store, the object and the cause, and
/// leaves no manifest (no snapshot that looks complete); a restore says the snapshot is not
/// there or its write did not finish. Needs root, for a small tmpfs.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn local_store_on_a_full_disk_fails_and_leaves_no_manifest() {
    let tmp = TempDir::new("store-full");
    let (mnt, _unmount) = small_tmpfs(&tmp, "4m");
    let objects: Arc<dyn ObjectStore> = Arc::new(LocalObjectStore::new(&mnt.join("store")));
    let e = write(&*objects, "full", &vm_of_random_bytes(), None).unwrap_err();
    let text = chain(&e);
    assert!(
        text.contains("store:") && text.contains("packs/") && text.contains("No space left"),
        "{text}"
    );
    assert_no_snapshot(objects, "full");
}

/// The same against MinIO whose data directory is on a file system that fills: the write
/// fails naming the store, the object and the S3 error, and leaves no snapshot.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn minio_on_a_full_disk_fails_and_leaves_no_manifest() {
    let tmp = TempDir::new("store-full-s3");
    let (mnt, _unmount) = small_tmpfs(&tmp, "16m");
    let m = Minio::start_in("snaps", &mnt);
    let objects = s3(&m, "full-disk");
    let e = write(&*objects, "full", &vm_of_random_bytes(), None).unwrap_err();
    // MinIO answers a PUT it runs out of space for as an incomplete body (400), or one it
    // has no room for as storage full (507, with or without a body saying so), depending on
    // when the space runs out; the error names the store, the object and what MinIO said.
    let text = chain(&e);
    assert!(
        text.contains("s3://snaps/full-disk: write packs/")
            && ["IncompleteBody", "StorageFull", "507 Insufficient Storage"]
                .iter()
                .any(|t| text.contains(t)),
        "{text}"
    );
    assert_no_snapshot(objects, "full");
}

/// A VM whose RAM (SIZE) holds incompressible bytes.
fn vm_of_random_bytes() -> Vm {
    let vm = Vm::new(&VmConfig::simple(1, SIZE, MemBackend::Anon)).unwrap();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let bytes: Vec<u8> = (0..SIZE / 8)
        .flat_map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()
        })
        .collect();
    vm.memory()
        .write(guestmem_vm::layout::RAM_GPA, &bytes)
        .unwrap();
    vm
}

/// An error and its causes, joined.
fn chain(e: &Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(&format!(": {s}"));
        source = s.source();
    }
    text
}

/// No manifest `name` in `objects`, and opening it says the write did not finish.
fn assert_no_snapshot(objects: Arc<dyn ObjectStore>, name: &str) {
    assert!(!objects.exists(&manifest_key(name)).unwrap());
    let e = StoreSnapshot::open(objects, name, None)
        .expect_err("no snapshot")
        .to_string();
    assert!(
        e.contains(&format!("no snapshot '{name}'")) && e.contains("did not finish"),
        "{e}"
    );
}

/// A lazily restored guest stops on a damaged chunk when it first touches it, with the error
/// naming the chunk and the guest address, instead of running on its bytes (MinIO).
#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn minio_lazy_restore_stops_on_a_damaged_chunk() {
    let m = Minio::start("snapshots");
    let objects = s3(&m, "lazy-bad");
    let vm = paused_vm();
    write(&*objects, "vm", &vm, None).unwrap();
    drop(vm);
    let hash = common::damage_first_ram_chunk(&*objects, "vm");
    let snap = StoreSnapshot::open(objects.clone(), "vm", None).unwrap();
    let e = common::lazy_run_error(&snap, Duration::from_secs(30));
    assert!(
        e.contains("corrupt store snapshot") && e.contains("region 'ram' chunk 0 (offset 0x0)"),
        "{e}"
    );
    assert!(e.contains(&chunk::hex(&hash)), "{e}");
    assert!(
        e.contains(&format!("{:#x}", guestmem_vm::layout::RAM_GPA)),
        "{e}"
    );
}

/// A lazy restore of a guest_memfd VM from a local store goes through KVM Userfault: where the
/// kernel has it the region gets a KVM Userfault pager (no userfaultfd pager), where it lacks
/// it the restore is refused naming KVM Userfault before any vCPU runs (the seeds suite runs
/// the guest on such a restore: tests/tests/seeds.rs).
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn gmem_store_lazy_restore_is_served_or_refused_naming_kvm_userfault() {
    let tmp = TempDir::new("store-gmem-lazy");
    let config = VmConfig::simple(1, 8 << 20, MemBackend::GuestMemfd);
    let mut vm = match Vm::new(&config) {
        Ok(vm) => vm,
        Err(e) => {
            // No host-mapped guest_memfd on this kernel: refused naming what it lacks.
            let msg = e.to_string();
            assert!(
                msg.contains("KVM_CAP_GUEST_MEMFD") || msg.contains("MMAP|INIT_SHARED"),
                "{msg}"
            );
            return;
        }
    };
    let running = vm.start(&dirty_work(1, 8 << 20)).unwrap();
    wait_for_generation(&running, 1);
    running.pause().unwrap();
    let at_snapshot = vm.pages_done();
    let objects: Arc<dyn ObjectStore> = Arc::new(LocalObjectStore::new(&tmp.0.join("store")));
    write(&*objects, "gmem", &vm, None).unwrap();
    drop(vm);
    let snap = StoreSnapshot::open(objects, "gmem", None).unwrap();
    let restored = snapshot::restore(
        &snap,
        &mut VmBuilder,
        RestoreMode::Lazy(PagerConfig::default()),
    );
    let userfault = guestmem_sys::probe::kvm_userfault_on_a_new_vm().unwrap();
    if userfault.present {
        let lazy = restored.unwrap_or_else(|e| panic!("{e}"));
        assert!(
            lazy.pagers.is_empty(),
            "no userfaultfd pager for guest_memfd"
        );
        assert_eq!(lazy.userfault_pagers.len(), 1);
        assert!(lazy.userfault_pagers[0]
            .wait_resident(Duration::from_secs(60))
            .unwrap());
        snap.check_memory(lazy.vm.memory()).unwrap();
        assert_eq!(lazy.vm.pages_done(), at_snapshot);
    } else {
        let e = restored.expect_err("refused without KVM Userfault");
        let msg = guestmem_sys::error_chain(&e, ": ");
        assert!(
            msg.contains("region 'ram'")
                && msg.contains("KVM Userfault")
                && msg.contains("KVM_MEM_USERFAULT")
                && msg.contains("is absent"),
            "{msg}"
        );
    }
}
