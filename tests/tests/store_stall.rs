//! A stalled object store, against a real MinIO: frozen with SIGSTOP (its connections stay
//! open, nothing answers) or behind a TCP proxy that stops forwarding. A 5 s stall during a
//! cold lazy restore is ridden out and the memory is the snapshot's; a stall longer than the
//! store timeout fails each path (lazy and full restore, a live snapshot write, the page
//! server, the restore service, gc, merge, delete) within the bound and 5 s, naming the store,
//! the object and how long it waited; a stalled PUT keeps the earlier snapshot restorable and
//! the guest running.

mod common;
#[path = "common/minio.rs"]
mod minio;
#[path = "common/stall_proxy.rs"]
mod stall_proxy;

use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use common::{dirty_work, wait_for_generation, TempDir};
use guestmem_contract::component::Components;
use guestmem_contract::{PayloadVm, VmBuilder};
use guestmem_memory::Backend as MemBackend;
use guestmem_paging::PagerConfig;
use guestmem_snapshot::live::LiveOptions;
use guestmem_snapshot::service::RestoreService;
use guestmem_snapshot::{self as snapshot, RestoreMode};
use guestmem_store::restore::StoreSnapshot;
use guestmem_store::s3::{S3Config, S3ObjectStore};
use guestmem_store::write::write;
use guestmem_store::{Error, ObjectInfo, ObjectStore, StallEvent, StallStatus, StoreOptions};
use guestmem_vm::{Vm, VmConfig};
use minio::Minio;
use stall_proxy::StallProxy;

const SIZE: u64 = 32 << 20;
/// The store timeout of the tests that wait it out.
const BOUND: Duration = Duration::from_secs(3);
/// What a failure may take past the bound.
const SLACK: Duration = Duration::from_secs(5);

/// The stall events a store's options told, with when.
type Heard = Arc<Mutex<Vec<(Instant, StallStatus)>>>;

/// An S3 store at `endpoint` (MinIO's or a proxy's) under a store timeout of `timeout`; what
/// it tells of stalls goes into the returned list.
fn s3_at(
    endpoint: &str,
    bucket: &str,
    prefix: &str,
    timeout: Duration,
) -> (Arc<dyn ObjectStore>, Heard) {
    let config = S3Config {
        endpoint: Some(endpoint.to_string()),
        access_key_id: minio::USER.into(),
        secret_access_key: minio::PASSWORD.into(),
        region: None,
    };
    let heard: Heard = Arc::new(Mutex::new(Vec::new()));
    let h = heard.clone();
    let options = StoreOptions {
        timeout,
        on_stall: Some(Arc::new(move |e: &StallEvent| {
            h.lock().unwrap().push((Instant::now(), e.status));
        })),
    };
    let store = S3ObjectStore::with_options(bucket, prefix, &config, options).unwrap();
    (Arc::new(store), heard)
}

/// A 2-vCPU VM running `dirty` over SIZE bytes, paused after two passes.
fn paused_vm() -> Vm {
    let mut vm = Vm::new(&VmConfig::simple(2, SIZE, MemBackend::Anon)).unwrap();
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

/// A snapshot `name` of a paused VM in `objects`; its region digests.
fn stored_snapshot(objects: &dyn ObjectStore, name: &str) -> Vec<u64> {
    let vm = paused_vm();
    write(objects, name, &vm, None).unwrap();
    digests(&vm)
}

/// An error and its causes, joined.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    guestmem_sys::error_chain(e, ": ")
}

/// `waited` is the bound, within [`SLACK`]; `text` names the store, says it answered nothing
/// and how long it waited.
fn assert_failed_in_bound(what: &str, waited: Duration, text: &str, store: &str) {
    eprintln!(
        "{what}: failed {:.2} s after the stall: {text}",
        waited.as_secs_f64()
    );
    assert!(
        waited >= BOUND - Duration::from_millis(100) && waited <= BOUND + SLACK,
        "{what}: failed after {waited:?} (bound {BOUND:?}): {text}"
    );
    assert!(
        text.contains(store)
            && (text.contains("no answer to") || text.contains("has answered nothing for"))
            && text.contains("the store is stalled or unreachable"),
        "{what}: {text}"
    );
    assert!(text.contains("store timeout is 3.0 s"), "{what}: {text}");
}

/// A cold lazy restore whose MinIO is frozen for 5 s right as it starts rides the stall out
/// (default 30 s bound): the stall is told within 5 s and its end too, and the memory is the
/// snapshot's, chunk by chunk.
#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn a_5_s_stall_during_a_cold_lazy_restore_is_ridden_out() {
    let m = Minio::start("snapshots");
    let (objects, heard) = s3_at(
        &m.endpoint(),
        &m.bucket,
        "ride",
        StoreOptions::default().timeout,
    );
    let want = stored_snapshot(&*objects, "vm");
    let snap = StoreSnapshot::open(objects.clone(), "vm", None).unwrap();
    heard.lock().unwrap().clear();
    m.freeze();
    let frozen = Instant::now();
    let thaw = std::thread::scope(|s| {
        let thaw = s.spawn(|| {
            std::thread::sleep(Duration::from_secs(5));
            let at = Instant::now();
            m.thaw();
            at
        });
        let lazy = common::lazy_restore_resident(&snap, Duration::from_secs(60));
        assert_eq!(digests(&lazy.vm), want, "lazy restore across a 5 s stall");
        snap.check_memory(lazy.vm.memory()).unwrap();
        thaw.join().unwrap()
    });
    let heard = heard.lock().unwrap().clone();
    let stalled = heard
        .iter()
        .find(|(_, s)| *s == StallStatus::Stalled)
        .expect("the stall was told");
    assert!(
        stalled.0 - frozen <= Duration::from_secs(5),
        "told {:?} after the stall began",
        stalled.0 - frozen
    );
    assert!(
        heard
            .iter()
            .any(|(t, s)| *s == StallStatus::Answered && *t >= thaw),
        "{heard:?}"
    );
    assert!(
        !heard.iter().any(|(_, s)| *s == StallStatus::Failed),
        "{heard:?}"
    );
}

/// A lazy restore whose store stops answering (the proxy stops forwarding) once the guest
/// runs: the guest is stopped within the bound and 5 s, the error naming the store, the object,
/// the wait and the chunks never fetched.
#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn a_long_stall_stops_a_lazily_restored_guest_naming_the_chunks_never_fetched() {
    let m = Minio::start("snapshots");
    let proxy = StallProxy::start(format!("127.0.0.1:{}", m.port).parse().unwrap());
    let (objects, _) = s3_at(&proxy.endpoint(), &m.bucket, "lazy", BOUND);
    stored_snapshot(&*objects, "vm");
    let snap = StoreSnapshot::open(objects, "vm", None).unwrap();
    let quiet = PagerConfig {
        background: false,
        ..PagerConfig::default()
    };
    let mut lazy = snapshot::restore(&snap, &mut VmBuilder, RestoreMode::Lazy(quiet)).unwrap();
    proxy.stall();
    let t = Instant::now();
    let running = lazy.vm.resume().unwrap();
    let e = running.wait(Duration::from_secs(60)).unwrap_err();
    let text = chain(&e);
    assert_failed_in_bound("lazy restore", t.elapsed(), &text, "s3://snapshots/lazy");
    assert!(
        text.contains("s3://snapshots/lazy/vm region 'ram': ")
            && text.contains("data chunks never fetched: chunks ")
            && (text.contains(": read packs/") || text.contains("no answer to read packs/")),
        "{text}"
    );
    proxy.resume();
}

/// A full restore from a frozen MinIO fails within the bound and 5 s, naming the object.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn a_long_stall_fails_a_full_restore_within_the_bound() {
    let m = Minio::start("snapshots");
    let (objects, heard) = s3_at(&m.endpoint(), &m.bucket, "full", BOUND);
    stored_snapshot(&*objects, "vm");
    let snap = StoreSnapshot::open(objects, "vm", None).unwrap();
    m.freeze();
    let t = Instant::now();
    let e = snapshot::restore(&snap, &mut VmBuilder, RestoreMode::Full)
        .map(|r| r.vm)
        .expect_err("the store answers nothing");
    let waited = t.elapsed();
    m.thaw();
    let e = Error::from(e);
    assert!(e.is_stalled(), "{e:?}");
    assert_failed_in_bound("full restore", waited, &chain(&e), "s3://snapshots/full");
    let statuses: Vec<StallStatus> = heard.lock().unwrap().iter().map(|h| h.1).collect();
    assert_eq!(
        &statuses[..2],
        &[StallStatus::Stalled, StallStatus::Failed],
        "{statuses:?}"
    );
}

/// An object store that stalls its proxy as a chunk's PUT begins.
struct StallOnChunkPut<'a> {
    inner: Arc<dyn ObjectStore>,
    proxy: &'a StallProxy,
    at: Mutex<Option<Instant>>,
}

impl ObjectStore for StallOnChunkPut<'_> {
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
        self.at.lock().unwrap().get_or_insert_with(|| {
            self.proxy.stall();
            Instant::now()
        });
        self.inner.put_chunk(key, bytes)
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
        true
    }
}

/// A live snapshot write whose chunk PUT stalls (the proxy stops forwarding) fails within the
/// bound and 5 s naming the object; the guest runs on, and the earlier snapshot of the same
/// name restores to its bytes.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn a_stalled_put_fails_the_write_and_keeps_the_earlier_snapshot_and_the_guest() {
    let m = Minio::start("snapshots");
    let proxy = StallProxy::start(format!("127.0.0.1:{}", m.port).parse().unwrap());
    let (objects, _) = s3_at(&proxy.endpoint(), &m.bucket, "write", BOUND);
    let mut vm = Vm::new(&VmConfig::simple(2, SIZE, MemBackend::Anon)).unwrap();
    let work = dirty_work(2, SIZE);
    let running = vm.start(&work).unwrap();
    wait_for_generation(&running, 2);
    let vm = running.pause().unwrap();
    write(&*objects, "vm", vm, None).unwrap();
    let first = digests(vm);

    let mut machine = PayloadVm::running(vm.resume().unwrap());
    std::thread::sleep(Duration::from_millis(100));
    let stalling = StallOnChunkPut {
        inner: objects.clone(),
        proxy: &proxy,
        at: Mutex::new(None),
    };
    let e = guestmem_store::live::write_machine_live(
        &stalling,
        "vm",
        &mut machine,
        &mut Components::none(),
        None,
        &LiveOptions::default(),
    )
    .expect_err("the store answers nothing");
    let waited = stalling
        .at
        .lock()
        .unwrap()
        .expect("a chunk was put")
        .elapsed();
    assert!(e.is_stalled(), "{e:?}");
    let text = chain(&e);
    assert_failed_in_bound("live snapshot write", waited, &text, "s3://snapshots/write");
    assert!(text.contains("no answer to write packs/"), "{text}");
    // The guest runs on.
    let r = machine
        .as_running()
        .expect("the guest runs after a failed write");
    let pages = || -> u64 { r.progress().iter().map(|p| p.0).sum() };
    let (before, t) = (pages(), Instant::now());
    // Within 2 s: the host's 2 cores may be busy with others' builds.
    while pages() == before && t.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(pages() > before, "the guest goes on after the failed write");
    let running = machine.into_running().unwrap();
    running.stop();
    running.wait(Duration::from_secs(30)).unwrap();

    // The earlier snapshot of the name is whole and restores to its bytes.
    proxy.resume();
    let (direct, _) = s3_at(&m.endpoint(), &m.bucket, "write", BOUND);
    let snap = StoreSnapshot::open(direct, "vm", None).unwrap();
    let restored = snapshot::restore(&snap, &mut VmBuilder, RestoreMode::Full)
        .map(|r| r.vm)
        .unwrap();
    assert_eq!(digests(&restored), first, "the earlier snapshot");
}

/// The page server serving a store snapshot whose store stops answering (the proxy stops
/// forwarding) fails serving within the bound and 5 s, across its pager's attempts, naming the
/// store, the object and the chunks never fetched.
#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn a_long_stall_fails_the_page_server_within_the_bound() {
    let m = Minio::start("snapshots");
    let proxy = StallProxy::start(format!("127.0.0.1:{}", m.port).parse().unwrap());
    let (through, _) = s3_at(&proxy.endpoint(), &m.bucket, "served", BOUND);
    let (direct, _) = s3_at(&m.endpoint(), &m.bucket, "served", BOUND);
    stored_snapshot(&*direct, "vm");
    // The server reads through the proxy; the VMM side (its sys region) straight from MinIO.
    let served = StoreSnapshot::open(through, "vm", None).unwrap();
    let memory = snapshot::served_memory(&served).unwrap();
    let vmm = StoreSnapshot::open(direct, "vm", None).unwrap();
    let tmp = TempDir::new("stall-page-server");
    let socket = tmp.0.join("uffd.sock");
    let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let (stream, _) = listener.accept().unwrap();
        let config = guestmem_pageserver::PageServerConfig {
            pager: PagerConfig::default(),
            kill_peer_on_failure: false,
            events: None,
        };
        let _ = tx.send(guestmem_pageserver::serve_connection(
            stream, &memory, &config,
        ));
    });
    proxy.stall();
    let t = Instant::now();
    let restored =
        snapshot::restore(&vmm, &mut VmBuilder, RestoreMode::PageServer(socket)).unwrap();
    let session = rx.recv().unwrap().unwrap();
    let failure = loop {
        if let Some(f) = session.failure() {
            break f;
        }
        assert!(t.elapsed() < BOUND + SLACK * 2, "no failure yet");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_failed_in_bound(
        "page server",
        t.elapsed(),
        &failure,
        "s3://snapshots/served",
    );
    // It serves RAM only: the sys region is the VMM's.
    assert!(
        failure.contains(
            "s3://snapshots/served/vm region 'ram': 128 of 128 data chunks never fetched"
        ) && !failure.contains("region 'sys'"),
        "{failure}"
    );
    drop(restored);
    proxy.resume();
}

/// A restore service whose MinIO freezes after the service opened the snapshot: its clone's
/// guest is stopped within the bound and 5 s, naming the store, the object and the wait.
#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn a_long_stall_stops_a_restore_services_clone_within_the_bound() {
    let m = Minio::start("snapshots");
    let (objects, _) = s3_at(&m.endpoint(), &m.bucket, "service", BOUND);
    stored_snapshot(&*objects, "vm");
    let quiet = PagerConfig {
        background: false,
        ..PagerConfig::default()
    };
    let service =
        RestoreService::new(StoreSnapshot::open(objects, "vm", None).unwrap(), quiet).unwrap();
    let mut clone = service.restore().unwrap();
    m.freeze();
    let t = Instant::now();
    let running = clone.lazy.vm.resume().unwrap();
    let e = running.wait(Duration::from_secs(60)).unwrap_err();
    let waited = t.elapsed();
    m.thaw();
    let text = chain(&e);
    assert_failed_in_bound("restore service", waited, &text, "s3://snapshots/service");
    assert!(text.contains("data chunks never fetched"), "{text}");
}

/// gc, merge and delete on a frozen MinIO each fail within the bound and 5 s, naming the
/// object; a missing object is an answer, never waited on as a stall.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn a_long_stall_fails_gc_merge_and_delete_within_the_bound() {
    let m = Minio::start("snapshots");
    let (objects, heard) = s3_at(&m.endpoint(), &m.bucket, "ops", BOUND);
    stored_snapshot(&*objects, "vm");
    let t = Instant::now();
    let e = objects.get("snapshots/none/manifest.json").unwrap_err();
    assert!(
        e.is_missing() && t.elapsed() < Duration::from_secs(1),
        "{e}"
    );
    assert!(heard.lock().unwrap().is_empty());

    m.freeze();
    type Op = fn(&dyn ObjectStore) -> guestmem_store::Result<()>;
    let ops: [(&str, Op); 3] = [
        ("gc", |o| {
            guestmem_store::gc::gc(o, Duration::ZERO).map(|_| ())
        }),
        ("merge", |o| {
            guestmem_store::merge::merge(o, "vm", "merged").map(|_| ())
        }),
        ("delete", |o| guestmem_store::gc::delete(o, "vm")),
    ];
    for (what, op) in ops {
        // A store of its own each: one found dead fails the next request after a probe.
        let (o, _) = s3_at(&m.endpoint(), &m.bucket, "ops", BOUND);
        let t = Instant::now();
        let e = op(&*o).expect_err("the store answers nothing");
        assert!(e.is_stalled(), "{what}: {e:?}");
        assert_failed_in_bound(what, t.elapsed(), &chain(&e), "s3://snapshots/ops");
    }
    m.thaw();
    guestmem_store::gc::delete(&*objects, "vm").unwrap();
}
