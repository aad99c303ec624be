//! Compatibility across releases (README, "Compatibility"), on the golden artefacts of
//! tests/golden/: snapshots written by guestmem 0.1.0 (flat, and in a local chunk store) restore
//! with this build, in full and lazily, and the guest goes on from where it was; a saved state
//! or a migration peer outside this build's window is refused naming both versions, before
//! anything runs or any page moves. (scripts/compat.sh does the same against a build of the
//! previous release, and migrates both ways.)

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use common::{assert_memory_is_snapshot, resume_and_check_continuation, TempDir};
use guestmem_contract::{payload_state_of, VmBuilder, PAYLOAD_STATE};
use guestmem_migration::migrate::{self, ReceiveOptions, PROTOCOL};
use guestmem_migration::stream::Frame;
use guestmem_migration::transport::{
    self, generate_credentials, Credentials, Endpoint, Listener, Role,
};
use guestmem_paging::PagerConfig;
use guestmem_snapshot::{self as snapshot, RestoreMode, Snapshot, SnapshotImage};
use guestmem_store::local::LocalObjectStore;
use guestmem_store::restore::StoreSnapshot;
use guestmem_vm::Vm;

/// The golden artefacts of release `release`.
fn golden(release: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("golden")
        .join(release)
}

/// Whether this host's CPU is of the vendor whose vCPU state the artefacts of `release` hold
/// (their saved CPUID and MSRs are that vendor's: another vendor's KVM refuses some of them).
/// Says so loudly when not.
fn same_cpu_vendor(release: &str) -> bool {
    let theirs = std::fs::read_to_string(golden(release).join("cpu-vendor")).unwrap();
    let ours = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap()
        .lines()
        .find_map(|l| {
            l.strip_prefix("vendor_id")
                .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_default();
    if theirs.trim() != ours.trim() {
        eprintln!(
            "SKIPPED: the {release} golden snapshots hold {} vCPU state, this host is {ours}: \
             only their decoding is checked here",
            theirs.trim()
        );
        return false;
    }
    true
}

/// A copy of the golden flat snapshot of `release` (restores must not touch the original).
fn flat_copy(release: &str, name: &str) -> TempDir {
    let dir = TempDir::new(name);
    for f in ["manifest.json", "state.json", "memory", "sys"] {
        std::fs::copy(golden(release).join("flat").join(f), dir.0.join(f)).unwrap();
    }
    dir
}

/// The pages done per vCPU at the snapshot, and the workloads, from its saved state.
fn work_of<I: SnapshotImage>(image: &I) -> Vec<guestmem_vm::VcpuWork> {
    payload_state_of(image.machine_state()).unwrap().work
}

/// Restores `image` in full and lazily: memory as the snapshot recorded it (the restore checks
/// every chunk), and the guest goes on counting from where it was, every page agreeing.
fn restore_both_ways<I: SnapshotImage>(image: &I, digests: Option<&Snapshot>) {
    let work = work_of(image);
    let full = snapshot::restore(image, &mut VmBuilder, RestoreMode::Full).unwrap();
    let mut vm: Vm = full.vm;
    if let Some(snap) = digests {
        assert_memory_is_snapshot(&vm, snap, "full restore");
    }
    let before = vm.pages_done();
    assert!(before.iter().all(|&p| p > 0), "{before:?}");
    resume_and_check_continuation(&mut vm, &work, &before);
    drop(vm);

    let quiet = PagerConfig {
        background: false,
        ..PagerConfig::default()
    };
    let mut lazy = snapshot::restore(image, &mut VmBuilder, RestoreMode::Lazy(quiet)).unwrap();
    assert_eq!(
        lazy.vm.pages_done(),
        before,
        "control blocks restored lazily"
    );
    resume_and_check_continuation(&mut lazy.vm, &work, &before);
}

/// guestmem 0.1.0's flat snapshot (manifest version 3, its VM state bare, no writer) reads
/// and restores, in full and lazily.
#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn a_0_1_0_flat_snapshot_restores() {
    let dir = flat_copy("v0.1.0", "golden-flat");
    let snap = Snapshot::open(&dir.0).unwrap();
    assert_eq!(snap.manifest().version, 3);
    assert_eq!(snap.manifest().writer, None);
    assert!(!guestmem_contract::envelope::is_sealed(
        snap.machine_state()
    ));
    assert_eq!(work_of(&snap).len(), 2);
    if same_cpu_vendor("v0.1.0") {
        restore_both_ways(&snap, Some(&snap));
    }
}

/// guestmem 0.1.0's store snapshot (manifest version 2, chunks in a pack) reads and restores,
/// in full and lazily.
#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn a_0_1_0_store_snapshot_restores() {
    let objects = Arc::new(LocalObjectStore::new(&golden("v0.1.0").join("store")));
    let snap = StoreSnapshot::open(objects, "vm", None).unwrap();
    assert_eq!(snap.manifest.version, 2);
    assert_eq!(snap.manifest.writer, None);
    assert_eq!(work_of(&snap).len(), 2);
    if same_cpu_vendor("v0.1.0") {
        restore_both_ways(&snap, None);
    }
}

/// guestmem 0.2.0's snapshots (flat manifest 4 and store manifest 3, naming their writer; the
/// VM state in its envelope) read and restore, in full and lazily.
#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn the_0_2_0_snapshots_restore() {
    let dir = flat_copy("v0.2.0", "golden-flat-0.2.0");
    let snap = Snapshot::open(&dir.0).unwrap();
    assert_eq!(snap.manifest().version, 4);
    let writer = snap.manifest().writer.clone().expect("0.2.0 names itself");
    assert_eq!(writer.version, "0.2.0");
    assert!(guestmem_contract::envelope::is_sealed(snap.machine_state()));
    let objects = Arc::new(LocalObjectStore::new(&golden("v0.2.0").join("store")));
    let store = StoreSnapshot::open(objects, "vm", None).unwrap();
    assert_eq!(store.manifest.version, 3);
    assert_eq!(store.manifest.writer.as_ref(), Some(&writer));
    if same_cpu_vendor("v0.2.0") {
        restore_both_ways(&snap, Some(&snap));
        restore_both_ways(&store, None);
    }
}

/// A store snapshot of manifest version 1 (every chunk an object of its own, the VM state bare
/// as the state object; converted from the 0.1.0 one, see tests/golden/README.md) reads and
/// restores, in full and lazily.
#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn a_version_1_store_snapshot_restores() {
    let objects = Arc::new(LocalObjectStore::new(&golden("store-v1")));
    let snap = StoreSnapshot::open(objects, "vm", None).unwrap();
    assert_eq!(snap.manifest.version, 1);
    assert!(snap.manifest.packs.is_empty());
    assert_eq!(work_of(&snap).len(), 2);
    if same_cpu_vendor("v0.1.0") {
        restore_both_ways(&snap, None);
    }
}

/// A snapshot whose machine state is of a version this build does not read (a field added by
/// a later guestmem) is refused naming both versions and its writer, never with a parse error,
/// before any guest runs.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn a_newer_machine_state_is_refused_naming_both_versions() {
    let dir = flat_copy("v0.1.0", "golden-newer-state");
    let state_path = dir.0.join("state.json");
    let mut saved: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&state_path).unwrap()).unwrap();
    let bare = hex_decode(saved["machine"].as_str().unwrap());
    let mut inner: serde_json::Value = serde_json::from_slice(&bare).unwrap();
    inner["lapic"] = serde_json::json!([1, 2, 3]);
    let sealed = serde_json::json!({
        "guestmem_state": PAYLOAD_STATE.name,
        "version": PAYLOAD_STATE.version + 1,
        "writer": {"version": "9.9.9", "commit": "f00d"},
        "state": inner,
    });
    saved["machine"] = hex_encode(&serde_json::to_vec(&sealed).unwrap()).into();
    let state = serde_json::to_vec(&saved).unwrap();
    std::fs::write(&state_path, &state).unwrap();
    let manifest_path = dir.0.join("manifest.json");
    let mut m: snapshot::Manifest =
        serde_json::from_slice(&std::fs::read(&manifest_path).unwrap()).unwrap();
    m.state_bytes = state.len() as u64;
    m.state_blake3 = blake3::hash(&state).to_hex().to_string();
    m.seal();
    std::fs::write(&manifest_path, serde_json::to_vec(&m).unwrap()).unwrap();

    let snap = Snapshot::open(&dir.0).unwrap();
    let e = match snapshot::restore(&snap, &mut VmBuilder, RestoreMode::Full) {
        Ok(_) => panic!("a state of a newer version was restored"),
        Err(e) => guestmem_sys::error_chain(&e, ": "),
    };
    let newer = PAYLOAD_STATE.version + 1;
    assert!(
        e.contains(&format!("'guestmem-payload-vm' state of version {newer}"))
            && e.contains("written by guestmem 9.9.9 (commit f00d)")
            && e.contains(guestmem_sys::release::LONG_VERSION)
            && e.contains(&format!(
                "reads versions {} to {}",
                PAYLOAD_STATE.min_version, PAYLOAD_STATE.version
            ))
            && !e.contains("unknown field"),
        "{e}"
    );
}

fn hex_decode(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn hex_encode(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A destination and a source's credentials.
fn destination(dir: &TempDir) -> (Arc<Listener>, Endpoint, Credentials) {
    generate_credentials(&dir.0).unwrap();
    let listener = Listener::bind(
        &Endpoint::Tcp("127.0.0.1:0".into()),
        &Credentials::load(&dir.0, Role::Destination).unwrap(),
    )
    .unwrap();
    let endpoint = Endpoint::Tcp(format!("127.0.0.1:{}", listener.port().unwrap()));
    let creds = Credentials::load(&dir.0, Role::Source).unwrap();
    (Arc::new(listener), endpoint, creds)
}

/// Sends `hello` on a new connection to `endpoint` and returns the answer.
fn answer_to(endpoint: &Endpoint, creds: &Credentials, hello: &str) -> Frame {
    let mut conn = transport::connect(endpoint, creds).unwrap();
    Frame::Hello {
        config_json: hello.as_bytes().to_vec(),
    }
    .write_to(&mut conn)
    .unwrap();
    std::io::Write::flush(&mut conn).unwrap();
    Frame::read_from(&mut conn).unwrap()
}

/// A real destination: a source of a protocol outside its window is refused at its Hello (an
/// Abort naming both guestmems and both ranges, before any page moves), and the destination
/// stays free; guestmem 0.1.0's recorded Hello is answered with protocol 1.
#[test]
fn peers_are_answered_by_their_protocol() {
    let dir = TempDir::new("compat-window");
    let (listener, endpoint, creds) = destination(&dir);
    let l = listener.clone();
    // It never gets a whole migration: the thread ends with the test process.
    std::thread::spawn(move || migrate::receive(l, &ReceiveOptions::default()));

    let future = r#"{"guestmem_version":"9.0.0","guestmem":"9.0.0 (commit beef)",
        "protocols":{"min":7,"max":9},"features":["pages-z"],"migration":5,
        "channel":{"pages":0},"pages":1,"urgent":0,"resume":false}"#;
    match answer_to(&endpoint, &creds, future) {
        Frame::Abort { reason } => assert!(
            reason.contains("guestmem 9.0.0 (commit beef)")
                && reason.contains("protocols 7 to 9")
                && reason.contains(guestmem_sys::release::LONG_VERSION)
                && reason.contains(&format!("to {PROTOCOL}"))
                && reason.contains("upgrading the older side first"),
            "{reason}"
        ),
        other => panic!("expected an Abort, got {other:?}"),
    }

    // The destination was not claimed by the refused source: 0.1.0's first Hello is taken.
    let old = std::fs::read_to_string(golden("v0.1.0").join("migration/hello.json")).unwrap();
    match answer_to(&endpoint, &creds, &old) {
        Frame::Hello { config_json } => {
            let answer: serde_json::Value = serde_json::from_slice(&config_json).unwrap();
            assert_eq!(answer["protocol"], 1, "{answer}");
            assert!(answer["guestmem_version"].is_string(), "{answer}");
        }
        other => panic!("expected a Hello, got {other:?}"),
    }
    std::thread::sleep(Duration::from_millis(50));
}
