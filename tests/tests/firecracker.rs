//! Firecracker's userfaultfd page-server protocol: guestmem's page server and guestmem's VMM
//! side, end to end, and the server's refusals.

mod common;
#[path = "common/minio.rs"]
mod minio;

use guestmem_sys::to_usize;
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{
    assert_memory_is_snapshot, assert_pages_consistent, dirty_work, flip_byte_in_ram, pattern,
    resume_and_check_continuation, snapshot_running_vm, HugePages, TempDir,
};
use guestmem_contract::VmBuilder;
use guestmem_memory::{Backend, Region, RegionSpec, PAGE_SIZE};
use guestmem_pageserver::{
    check_userfaultfd, parse_mappings, send_handshake, serve_connection, GuestRegionUffdMapping,
    PageServerConfig, PeerProcess, ServedMemory, Session,
};
use guestmem_paging::{register_for_peer, PagerConfig};
use guestmem_snapshot::{self as snapshot, RestoreMode, Snapshot};
use guestmem_vm::{layout, VmConfig};

const SIZE: u64 = 8 << 20;

/// A page server on a thread: accepts one connection on `socket` and hands back its session.
/// It never kills its peer (the peer is this test process).
fn spawn_server(
    socket: &Path,
    memory: ServedMemory,
    pager: PagerConfig,
) -> mpsc::Receiver<guestmem_pageserver::Result<Session>> {
    let listener = UnixListener::bind(socket).unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let (stream, _) = listener.accept().unwrap();
        let config = PageServerConfig {
            pager,
            kill_peer_on_failure: false,
            events: None,
        };
        let _ = tx.send(serve_connection(stream, &memory, &config));
    });
    rx
}

/// The snapshot's RAM regions back to back, each chunk read and checked: what a Firecracker
/// memory file of the same guest would hold.
fn ram_only_file(snap: &Snapshot, path: &Path) {
    let mut out = Vec::new();
    let mut buf = vec![0u8; to_usize(snapshot::CHUNK_BYTES)];
    for image in &snap.manifest().regions {
        if image.spec.gpa == layout::SYS_GPA {
            continue;
        }
        for index in 0..image.chunks.len() {
            let offset = index as u64 * snapshot::CHUNK_BYTES;
            let len = to_usize(snapshot::CHUNK_BYTES.min(image.spec.size - offset));
            snap.read_chunk(image, index, &mut buf).unwrap();
            out.extend_from_slice(&buf[..len]);
        }
    }
    std::fs::write(path, out).unwrap();
}

#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn guest_restored_through_the_socket_continues() {
    for backend in [Backend::Anon, Backend::Memfd] {
        let dir = TempDir::new(&format!("e2e-{backend}"));
        let at_snapshot = snapshot_running_vm(&VmConfig::simple(2, SIZE, backend), SIZE, &dir.0);
        let snap = Snapshot::open(&dir.0).unwrap();
        let work = dirty_work(2, SIZE);
        let socket = dir.0.join("uffd.sock");

        // On demand only: every page the guest and the checks read comes through the server.
        let quiet = PagerConfig {
            background: false,
            ..PagerConfig::default()
        };
        // Served from the snapshot itself: every chunk checked before it is served.
        let memory = snapshot::served_memory(&Snapshot::open(&dir.0).unwrap()).unwrap();
        let session = spawn_server(&socket, memory, quiet);
        let mut restored = snapshot::restore(
            &snap,
            &mut VmBuilder,
            RestoreMode::PageServer(socket.clone()),
        )
        .unwrap();
        let session = session.recv().unwrap().unwrap();
        assert_eq!(session.peer_pid, std::process::id() as i32);
        assert_eq!(session.mappings, restored.peer.as_ref().unwrap().mappings);
        let ram = &snap.manifest().regions[1];
        assert_eq!(
            restored.peer.as_ref().unwrap().mappings.len(),
            1,
            "{backend}: one RAM region"
        );
        // The RAM alone, from offset 0: the snapshot's memory file is exactly its RAM.
        assert_eq!(restored.peer.as_ref().unwrap().mappings[0].offset, 0);
        assert_eq!(ram.file_offset, 0);
        assert_eq!(
            restored.peer.as_ref().unwrap().mappings[0].size,
            ram.spec.size
        );
        assert_eq!(
            restored.vm.pages_done(),
            at_snapshot,
            "{backend}: control blocks restored"
        );
        assert_pages_consistent(&restored.vm, &work, &at_snapshot);
        resume_and_check_continuation(&mut restored.vm, &work, &at_snapshot);
        let stats = session.stats();
        assert!(stats[0].faults > 0, "{backend}: faults served: {stats:?}");
        assert_eq!(session.failure(), None);
        drop(session);
        drop(restored);

        // With background fetch, everything arrives: memory equals the snapshot's. Served from
        // a Firecracker-style memory file (the RAM regions back to back, nothing else).
        let socket = dir.0.join("uffd2.sock");
        let ram_file = dir.0.join("ram-only");
        ram_only_file(&snap, &ram_file);
        let memory = ServedMemory::file(&ram_file).unwrap();
        let session = spawn_server(&socket, memory, PagerConfig::default());
        let restored = snapshot::restore(
            &snap,
            &mut VmBuilder,
            RestoreMode::PageServer(socket.clone()),
        )
        .unwrap();
        let session = session.recv().unwrap().unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        while !session.resident() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(session.resident(), "{backend}: {:?}", session.stats());
        assert_memory_is_snapshot(&restored.vm, &snap, &format!("{backend}"));
        drop(session);
    }
}

#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn removed_range_reads_as_zero() {
    let dir = TempDir::new("remove");
    snapshot_running_vm(&VmConfig::simple(2, SIZE, Backend::Anon), SIZE, &dir.0);
    let snap = Snapshot::open(&dir.0).unwrap();
    let socket = dir.0.join("uffd.sock");
    let quiet = PagerConfig {
        background: false,
        ..PagerConfig::default()
    };
    let session = spawn_server(
        &socket,
        snapshot::served_memory(&Snapshot::open(&dir.0).unwrap()).unwrap(),
        quiet,
    );
    let restored = snapshot::restore(
        &snap,
        &mut VmBuilder,
        RestoreMode::PageServer(socket.clone()),
    )
    .unwrap();
    let session = session.recv().unwrap().unwrap();
    let memory = restored.vm.memory();
    let ram = memory
        .regions()
        .iter()
        .find(|r| r.gpa() == layout::RAM_GPA)
        .unwrap()
        .clone();

    // The second 2 MiB chunk is never fetched; the third is fetched, then discarded.
    let untouched = layout::RAM_GPA + (2 << 20);
    let touched = layout::RAM_GPA + (4 << 20);
    assert_ne!(memory.read_u64(touched).unwrap(), 0, "the guest wrote it");
    for gpa in [untouched, touched] {
        let offset = to_usize(gpa - ram.gpa());
        // SAFETY: a 2 MiB range inside the region's own mapping; the VM is not running.
        let r = unsafe {
            libc::madvise(
                ram.host_addr().add(offset).cast(),
                2 << 20,
                libc::MADV_DONTNEED,
            )
        };
        assert_eq!(r, 0);
    }
    for gpa in [untouched, touched] {
        for p in [0, 1, 511] {
            assert_eq!(
                memory.read_u64(gpa + p * PAGE_SIZE).unwrap(),
                0,
                "{gpa:#x} page {p}"
            );
        }
    }
    // The snapshot holds non-zero bytes there: the zeros come from the REMOVE handling.
    let file = std::fs::read(dir.0.join("memory")).unwrap();
    let image = &snap.manifest().regions[1];
    let at = to_usize(image.file_offset + (untouched - layout::RAM_GPA));
    assert!(file[at..at + to_usize(PAGE_SIZE)].iter().any(|&b| b != 0));
    assert!(
        session.stats()[0].discarded_chunks >= 1,
        "{:?}",
        session.stats()
    );
    drop(session);
}

fn mem_file(dir: &Path, len: u64) -> ServedMemory {
    let path = dir.join("memory");
    let f = std::fs::File::create(&path).unwrap();
    f.set_len(len).unwrap();
    ServedMemory::file(&path).unwrap()
}

/// Sends `message` (with `/dev/null` attached when `with_fd`) and returns the server's error.
fn server_error(mem: &ServedMemory, message: &[u8], with_fd: bool) -> String {
    use std::io::Write;
    use vmm_sys_util::sock_ctrl_msg::ScmSocket;
    let (mut client, server) = UnixStream::pair().unwrap();
    if with_fd {
        let fd = std::fs::File::open("/dev/null").unwrap();
        client.send_with_fd(message, fd.as_raw_fd()).unwrap();
    } else {
        client.write_all(message).unwrap();
    }
    let config = PageServerConfig {
        kill_peer_on_failure: false,
        ..PageServerConfig::default()
    };
    match serve_connection(server, mem, &config) {
        Ok(_) => panic!("{:?} was accepted", String::from_utf8_lossy(message)),
        Err(e) => guestmem_migration::error_chain(&e, ": "),
    }
}

/// The cause a handshake of `bytes` is refused with (what the JSON parser says of it).
fn serde_json_error(bytes: &[u8]) -> String {
    let e = guestmem_pageserver::parse_mappings(bytes).unwrap_err();
    std::error::Error::source(&e)
        .expect("a JSON error has its cause")
        .to_string()
}

#[test]
fn bad_handshakes_are_refused_naming_the_problem() {
    let dir = TempDir::new("protocol");
    let mem = mem_file(&dir.0, 4 << 20);

    let e = server_error(&mem, b"{not json", true);
    assert!(
        e.contains("not a JSON array of GuestRegionUffdMapping"),
        "{e}"
    );
    // The JSON error is the cause, printed once after it.
    let json = serde_json_error(b"{not json");
    assert!(e.ends_with(&format!(": {json}")), "{e}");
    assert_eq!(e.matches(&json).count(), 1, "{e}");

    let ok = br#"[{"base_host_virt_addr":1073741824,"size":4194304,"offset":0,"page_size":4096}]"#;
    let e = server_error(&mem, ok, false);
    assert!(e.contains("carries no file descriptor"), "{e}");
    assert!(e.contains("SCM_RIGHTS"), "{e}");

    let outside =
        br#"[{"base_host_virt_addr":1073741824,"size":4194304,"offset":2097152,"page_size":4096}]"#;
    let e = server_error(&mem, outside, true);
    assert!(e.contains("mapping 0"), "{e}");
    assert!(
        e.contains("ends beyond the memory file's 0x400000 bytes"),
        "{e}"
    );

    // A file that is more than the regions would put other bytes at the offsets the peer
    // names: refused.
    let half =
        br#"[{"base_host_virt_addr":1073741824,"size":2097152,"offset":0,"page_size":4096}]"#;
    let e = server_error(&mem, half, true);
    assert!(
        e.contains("the mappings total 0x200000 bytes but the memory file"),
        "{e}"
    );
    assert!(e.contains("--snapshot DIR"), "{e}");

    let e = server_error(
        &mem,
        br#"[{"base_host_virt_addr":0,"size":4194304,"offset":0,"page_size":4096,"page_size_kib":4}]"#,
        true,
    );
    assert!(
        e.contains("page_size 4096 and page_size_kib 4 differ"),
        "{e}"
    );

    let e = server_error(&mem, b"[]", true);
    assert!(e.contains("lists no memory regions"), "{e}");
}

/// `/dev/null` (always readable, never a fault) in place of the userfaultfd: one error that
/// says what it is, and no pager is started (which would spin on it, warning each time).
#[test]
fn a_fd_that_is_not_a_userfaultfd_is_refused_once() {
    let dir = TempDir::new("devnull");
    let mem = mem_file(&dir.0, 4 << 20);
    let ok = br#"[{"base_host_virt_addr":1073741824,"size":4194304,"offset":0,"page_size":4096}]"#;
    let e = server_error(&mem, ok, true);
    assert_eq!(
        e,
        "page-server protocol: the file descriptor attached to the handshake message is \
         /dev/null, not a userfaultfd"
    );
    let null = std::fs::File::open("/dev/null").unwrap();
    use std::os::fd::AsFd;
    assert!(check_userfaultfd(null.as_fd()).is_err());
}

#[test]
#[cfg_attr(not(uffd), ignore = "no usable /dev/userfaultfd on this host")]
fn a_userfaultfd_passes_the_check() {
    use std::os::fd::{AsFd, FromRawFd, OwnedFd};
    // SAFETY: the userfaultfd syscall returns a new fd (checked) that we own.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC) }
        .try_into()
        .expect("an fd fits in an i32");
    assert!(fd >= 0, "userfaultfd: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` is the fresh userfaultfd from above.
    let uffd = unsafe { OwnedFd::from_raw_fd(fd) };
    check_userfaultfd(uffd.as_fd()).unwrap();
}

/// One mapping's page size as parsed from a message with `fields` after its offset.
fn page_size_of(fields: &str) -> Result<u64, String> {
    let message = format!(r#"[{{"base_host_virt_addr":0,"size":2097152,"offset":0{fields}}}]"#);
    parse_mappings(message.as_bytes())
        .map(|m| m[0].page_size)
        .map_err(|e| e.to_string())
}

#[test]
fn each_message_shape_gives_the_page_size_in_bytes() {
    // v1.0-v1.6: no page-size field: the host's page size.
    assert_eq!(page_size_of(""), Ok(4096));
    // v1.7-v1.11: `page_size_kib` alone, holding bytes despite its name.
    assert_eq!(page_size_of(r#","page_size_kib":4096"#), Ok(4096));
    assert_eq!(page_size_of(r#","page_size_kib":2097152"#), Ok(2 << 20));
    assert_eq!(page_size_of(r#","page_size_kib":1073741824"#), Ok(1 << 30));
    // `page_size_kib` alone holding KiB (its name taken at its word).
    assert_eq!(page_size_of(r#","page_size_kib":4"#), Ok(4096));
    assert_eq!(page_size_of(r#","page_size_kib":2048"#), Ok(2 << 20));
    // v1.16: `page_size` and `page_size_kib`, both bytes; or `page_size` alone.
    assert_eq!(
        page_size_of(r#","page_size":4096,"page_size_kib":4096"#),
        Ok(4096)
    );
    assert_eq!(
        page_size_of(r#","page_size":2097152,"page_size_kib":2097152"#),
        Ok(2 << 20)
    );
    assert_eq!(page_size_of(r#","page_size":2097152"#), Ok(2 << 20));
    // Refused, naming the fields.
    let e = page_size_of(r#","page_size":2097152,"page_size_kib":2048"#).unwrap_err();
    assert!(
        e.contains("mapping 0: page_size 2097152 and page_size_kib 2048 differ"),
        "{e}"
    );
    let e = page_size_of(r#","page_size_kib":3000"#).unwrap_err();
    assert!(
        e.contains("mapping 0: page_size_kib 3000 is neither a page size in bytes"),
        "{e}"
    );
    let e = page_size_of(r#","page_size":4"#).unwrap_err();
    assert!(
        e.contains("mapping 0: page_size 4 is not a page size in bytes"),
        "{e}"
    );
}

/// Serves a region of `backend` memory in this process, registered on a userfaultfd as a VMM
/// does, described by a message with the page-size `fields` of one Firecracker release; the
/// bytes read through it must be the memory file's.
fn serve_one_shape(backend: Backend, fields: &str, page_size: u64) {
    use std::os::fd::AsRawFd;
    use vmm_sys_util::sock_ctrl_msg::ScmSocket;
    const LEN: u64 = 4 << 20;
    let _huge = HugePages::for_backend(backend, LEN);
    let dir = TempDir::new(&format!("shape-{backend}"));
    let bytes = pattern(to_usize(LEN), page_size);
    std::fs::write(dir.0.join("memory"), &bytes).unwrap();
    let memory = ServedMemory::file(&dir.0.join("memory")).unwrap();
    let region = Region::create(RegionSpec::new("peer", 0, LEN, backend), None).unwrap();
    let uffd = register_for_peer(&[&region]).unwrap();
    let message = format!(
        r#"[{{"base_host_virt_addr":{},"size":{LEN},"offset":0{fields}}}]"#,
        region.host_addr() as u64
    );
    let (client, server) = UnixStream::pair().unwrap();
    client
        .send_with_fd(message.as_bytes(), uffd.as_raw_fd())
        .unwrap();
    let config = PageServerConfig {
        pager: PagerConfig {
            background: false,
            ..PagerConfig::default()
        },
        kill_peer_on_failure: false,
        events: None,
    };
    let session = serve_connection(server, &memory, &config)
        .unwrap_or_else(|e| panic!("{backend} {fields}: {e}"));
    assert_eq!(session.mappings[0].page_size, page_size, "{fields}");
    // SAFETY: the region's own mapping of LEN bytes, alive until `region` drops; the reads
    // fault and the session serves them.
    let seen = unsafe { std::slice::from_raw_parts(region.host_addr(), to_usize(LEN)) };
    assert!(
        seen == &bytes[..],
        "{backend} {fields}: the bytes read differ"
    );
    assert!(session.stats()[0].faults > 0, "{:?}", session.stats());
    assert_eq!(session.failure(), None);
    drop(session);
}

#[test]
#[cfg_attr(not(uffd), ignore = "no usable /dev/userfaultfd on this host")]
fn each_message_shape_is_served_with_4k_pages() {
    for fields in [
        "",
        r#","page_size_kib":4096"#,
        r#","page_size_kib":4"#,
        r#","page_size":4096,"page_size_kib":4096"#,
    ] {
        serve_one_shape(Backend::Anon, fields, 4096);
    }
}

#[test]
#[cfg_attr(not(uffd), ignore = "no usable /dev/userfaultfd on this host")]
fn each_message_shape_is_served_with_2m_pages() {
    for fields in [
        r#","page_size_kib":2097152"#,
        r#","page_size_kib":2048"#,
        r#","page_size":2097152,"page_size_kib":2097152"#,
    ] {
        serve_one_shape(Backend::MemfdHugetlb, fields, 2 << 20);
    }
}

/// What guestmem's VMM side sends is what Firecracker's example handlers read: per RAM region
/// `base_host_virt_addr`, `size`, `offset` (back to back from 0: the handler maps its memory
/// file whole, requires it to be exactly the regions' total size and reads region bytes at
/// `offset + (address - base)`), and the page size in bytes as both `page_size` and
/// `page_size_kib`; one message of less than the 1024 bytes the handler reads, with a
/// userfaultfd attached.
#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn the_vmm_side_sends_what_firecrackers_handlers_accept() {
    use vmm_sys_util::sock_ctrl_msg::ScmSocket;
    let dir = TempDir::new("vmm-message");
    snapshot_running_vm(&VmConfig::simple(2, SIZE, Backend::Anon), SIZE, &dir.0);
    let snap = Snapshot::open(&dir.0).unwrap();
    let socket = dir.0.join("uffd.sock");
    let listener = UnixListener::bind(&socket).unwrap();
    let server = std::thread::spawn(move || {
        let (stream, _) = listener.accept().unwrap();
        let mut buf = vec![0u8; 1024];
        let (n, file) = stream.recv_with_fd(&mut buf).unwrap();
        let file = file.expect("a fd attached");
        check_userfaultfd(std::os::fd::AsFd::as_fd(&file)).unwrap();
        (buf[..n].to_vec(), n, stream)
    });
    let restored = snapshot::restore(
        &snap,
        &mut VmBuilder,
        RestoreMode::PageServer(socket.clone()),
    )
    .unwrap();
    let (message, n, _stream) = server.join().unwrap();
    assert!(n < 1024, "the message takes {n} bytes");
    let json: serde_json::Value = serde_json::from_slice(&message).unwrap();
    let regions = json.as_array().unwrap();
    let ram: Vec<_> = snap
        .manifest()
        .regions
        .iter()
        .filter(|r| r.spec.gpa != layout::SYS_GPA)
        .collect();
    assert_eq!(regions.len(), ram.len());
    let mut offset = 0;
    for (m, image) in regions.iter().zip(&ram) {
        let mut keys: Vec<&str> = m
            .as_object()
            .unwrap()
            .keys()
            .map(std::string::String::as_str)
            .collect();
        keys.sort();
        assert_eq!(
            keys,
            [
                "base_host_virt_addr",
                "offset",
                "page_size",
                "page_size_kib",
                "size"
            ]
        );
        assert_eq!(m["offset"].as_u64(), Some(offset), "{m}");
        assert_eq!(m["size"].as_u64(), Some(image.spec.size), "{m}");
        assert_eq!(m["page_size"].as_u64(), Some(4096), "{m}");
        assert_eq!(m["page_size_kib"].as_u64(), Some(4096), "{m}");
        let region = restored
            .vm
            .memory()
            .regions()
            .iter()
            .find(|r| r.gpa() == image.spec.gpa)
            .unwrap()
            .clone();
        assert_eq!(
            m["base_host_virt_addr"].as_u64(),
            Some(region.host_addr() as u64)
        );
        offset += image.spec.size;
    }
    // guestmem's own parser reads the same message the same way.
    assert_eq!(
        parse_mappings(&message).unwrap(),
        restored.peer.as_ref().unwrap().mappings
    );
}

const PEER_ENV: &str = "GUESTMEM_FC_TEST_PEER_SOCKET";
const PEER_UNREGISTERED_ENV: &str = "GUESTMEM_FC_TEST_PEER_UNREGISTERED";
/// With `PEER_ENV`: the peer unmaps its memory before it sends the handshake (as a VMM shutting
/// down does while the server still fetches).
const PEER_UNMAPPED_ENV: &str = "GUESTMEM_FC_TEST_PEER_UNMAPPED";
/// With `PEER_ENV`: the peer is guestmem's VMM side, restoring the snapshot in this directory.
const PEER_SNAPSHOT_ENV: &str = "GUESTMEM_FC_TEST_PEER_SNAPSHOT";
/// The guest RAM offset of the byte `a_corrupt_chunk_is_refused_naming_it` corrupts (in the
/// second 2 MiB chunk).
const CORRUPT_AT: u64 = (2 << 20) + 4096 * 3 + 100;

/// Starts the peer process (this test binary run again as `peer_process_helper`) on a socket
/// at `socket`, with `env` set as well and its stdout to `stdout`; returns it and the
/// connection it made.
fn spawn_peer(
    socket: &Path,
    env: &[(&str, &std::ffi::OsStr)],
    stdout: std::process::Stdio,
) -> (std::process::Child, std::os::unix::net::UnixStream) {
    let listener = UnixListener::bind(socket).unwrap();
    let child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "peer_process_helper", "--nocapture"])
        .env(PEER_ENV, socket)
        .envs(env.iter().copied())
        .stdout(stdout)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let (stream, _) = listener.accept().unwrap();
    (child, stream)
}

/// Not a test on its own: the peer process of `failed_serving_kills_the_peer` (the test binary
/// re-run with `PEER_ENV` set). It sends a mapping the server must refuse, then waits to die.
#[test]
fn peer_process_helper() {
    let Some(socket) = std::env::var_os(PEER_ENV) else {
        return;
    };
    use std::os::fd::{AsFd, FromRawFd, OwnedFd};
    if let Some(dir) = std::env::var_os(PEER_SNAPSHOT_ENV) {
        // The VMM side: restore, then read the corrupted byte as the guest would. A page
        // server that refuses the chunk kills us before the read returns.
        let snap = Snapshot::open(Path::new(&dir)).unwrap();
        let restored = snapshot::restore(
            &snap,
            &mut VmBuilder,
            RestoreMode::PageServer(Path::new(&socket).to_path_buf()),
        )
        .unwrap();
        let value = restored
            .vm
            .memory()
            .read_u64(layout::RAM_GPA + CORRUPT_AT)
            .unwrap();
        println!("the VMM read {value:#x} from the corrupt chunk");
        std::process::exit(0);
    }
    let _stream = if std::env::var_os(PEER_UNMAPPED_ENV).is_some() {
        // Registered as a VMM does, then unmapped before the server copies anything.
        let region =
            Region::create(RegionSpec::new("peer", 0, 4 << 20, Backend::Anon), None).unwrap();
        let uffd = register_for_peer(&[&region]).unwrap();
        let mapping = [GuestRegionUffdMapping {
            base_host_virt_addr: region.host_addr() as u64,
            size: 4 << 20,
            offset: 0,
            page_size: 4096,
        }];
        drop(region);
        send_handshake(Path::new(&socket), &mapping, uffd.as_fd()).unwrap()
    } else if std::env::var_os(PEER_UNREGISTERED_ENV).is_some() {
        // A mapping inside the file, of memory never registered on the uffd sent: every
        // UFFDIO_COPY the server tries fails.
        // SAFETY: a fresh anonymous mapping, never unmapped (the process is killed).
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4 << 20,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(addr, libc::MAP_FAILED);
        // SAFETY: the userfaultfd syscall returns a new fd (checked) that we own.
        let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC) }
            .try_into()
            .expect("an fd fits in an i32");
        assert!(fd >= 0, "userfaultfd: {}", std::io::Error::last_os_error());
        // SAFETY: `fd` is the fresh userfaultfd from above.
        let uffd = unsafe { OwnedFd::from_raw_fd(fd) };
        let inside = [GuestRegionUffdMapping {
            base_host_virt_addr: addr as u64,
            size: 4 << 20,
            offset: 0,
            page_size: 4096,
        }];
        send_handshake(Path::new(&socket), &inside, uffd.as_fd()).unwrap()
    } else {
        let null = std::fs::File::open("/dev/null").unwrap();
        let outside = [GuestRegionUffdMapping {
            base_host_virt_addr: 1 << 30,
            size: 64 << 20,
            offset: 0,
            page_size: 4096,
        }];
        send_handshake(Path::new(&socket), &outside, null.as_fd()).unwrap()
    };
    std::thread::sleep(Duration::from_secs(120));
    panic!("the page server did not kill its peer");
}

#[test]
fn failed_serving_kills_the_peer() {
    use std::os::unix::process::ExitStatusExt;
    let dir = TempDir::new("kill");
    let mem = mem_file(&dir.0, 4 << 20);
    let socket = dir.0.join("uffd.sock");
    let (mut child, stream) = spawn_peer(&socket, &[], std::process::Stdio::null());
    let err = match serve_connection(stream, &mem, &PageServerConfig::default()) {
        Ok(_) => panic!("a mapping beyond the file was accepted"),
        Err(e) => guestmem_migration::error_chain(&e, ": "),
    };
    // The kill first, then the failure it was for, each once.
    assert!(
        err.starts_with(&format!("page-server: peer pid {} killed: ", child.id())),
        "{err}"
    );
    assert!(err.contains("ends beyond the memory file"), "{err}");
    // The error's prefix once, not once per layer that handled it.
    assert_eq!(err.matches("page-server protocol:").count(), 1, "{err}");
    let status = child.wait().unwrap();
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
}

#[test]
#[cfg_attr(not(uffd), ignore = "no usable /dev/userfaultfd on this host")]
fn a_fetch_failing_for_good_kills_the_peer() {
    use std::os::unix::process::ExitStatusExt;
    let dir = TempDir::new("kill-serving");
    let mem = mem_file(&dir.0, 4 << 20);
    let socket = dir.0.join("uffd.sock");
    let (mut child, stream) = spawn_peer(
        &socket,
        &[(PEER_UNREGISTERED_ENV, "1".as_ref())],
        std::process::Stdio::null(),
    );
    // The handshake is fine; the background fetch's first UFFDIO_COPY is not.
    let session = serve_connection(stream, &mem, &PageServerConfig::default()).unwrap();
    assert_eq!(session.peer_pid, child.id() as i32);
    let err = session.wait().unwrap_err().to_string();
    assert!(
        err.contains(&format!("serving peer pid {}", child.id())),
        "{err}"
    );
    assert!(err.contains("UFFDIO_COPY"), "{err}");
    let status = child.wait().unwrap();
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
}

/// A corrupt chunk in a snapshot served with `--snapshot` is refused before any of it reaches
/// the guest: serving fails naming the snapshot, region and chunk, and the VMM (a child
/// process restoring with `RestoreMode::PageServer`) is killed before its read of the chunk
/// returns.
#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn a_corrupt_chunk_is_refused_naming_it() {
    use std::io::Read;
    use std::os::unix::process::ExitStatusExt;
    let dir = TempDir::new("corrupt-chunk");
    snapshot_running_vm(&VmConfig::simple(2, SIZE, Backend::Anon), SIZE, &dir.0);
    flip_byte_in_ram(&dir.0, CORRUPT_AT, 0x40);
    let memory = snapshot::served_memory(&Snapshot::open(&dir.0).unwrap()).unwrap();
    let socket = dir.0.join("uffd.sock");
    let (mut child, stream) = spawn_peer(
        &socket,
        &[(PEER_SNAPSHOT_ENV, dir.0.as_os_str())],
        std::process::Stdio::piped(),
    );
    // On demand only: the VMM's read is what reaches the corrupt chunk.
    let config = PageServerConfig {
        pager: PagerConfig {
            background: false,
            ..PagerConfig::default()
        },
        kill_peer_on_failure: true,
        events: None,
    };
    let session = serve_connection(stream, &memory, &config).unwrap();
    assert_eq!(session.peer_pid, child.id() as i32);
    let err = session.wait().unwrap_err().to_string();
    assert!(
        err.contains(&format!("snapshot {}", dir.0.display())),
        "{err}"
    );
    assert!(err.contains("region 'ram'"), "{err}");
    assert!(err.contains("chunk 1 (offset 0x200000)"), "{err}");
    assert!(err.contains("the manifest says"), "{err}");
    let status = child.wait().unwrap();
    let mut out = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}: {out}");
    assert!(!out.contains("the VMM read"), "{out}");
}

/// Starts `sleep 60` with pid `pid` (the kernel's next pid set through `ns_last_pid`, root
/// only), retrying while other processes or threads take it first.
fn spawn_with_pid(pid: u32) -> std::process::Child {
    for _ in 0..200 {
        std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string())
            .expect("write /proc/sys/kernel/ns_last_pid (root?)");
        let mut child = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        if child.id() == pid {
            return child;
        }
        let _ = child.kill();
        let _ = child.wait();
    }
    panic!("could not start a process with pid {pid}");
}

/// The peer is held by its pidfd: once it has exited, a kill reaches nobody, not even a new
/// process that got its pid (`kill(pid)` would have killed that one).
#[test]
fn a_kill_never_reaches_a_process_that_reused_the_peers_pid() {
    let mut peer_child = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    let pid = peer_child.id();
    let peer = PeerProcess::open(pid as i32).unwrap();
    assert!(peer.alive());
    peer_child.kill().unwrap();
    peer_child.wait().unwrap();
    assert!(!peer.alive());

    let mut stranger = spawn_with_pid(pid);
    assert!(!peer.alive(), "the pidfd still names the exited peer");
    assert!(!peer.kill().unwrap(), "the kill reported a process killed");
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        stranger.try_wait().unwrap().is_none(),
        "the process that reused pid {pid} was killed"
    );
    stranger.kill().unwrap();
    stranger.wait().unwrap();
}

/// A live peer is killed through its pidfd.
#[test]
fn a_live_peer_is_killed_through_its_pidfd() {
    use std::os::unix::process::ExitStatusExt;
    let mut child = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    let peer = PeerProcess::open(child.id() as i32).unwrap();
    assert!(peer.kill().unwrap());
    assert!(peer.wait_exit(Duration::from_secs(10)));
    assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGKILL));
}

/// A range the peer unmapped (a VMM shutting down unmaps its RAM while the server may still be
/// fetching) ends serving quietly: no failure, and the peer is not killed; the session ends
/// when the peer exits. (Memory still mapped but not registered is a failure:
/// `a_fetch_failing_for_good_kills_the_peer`.)
#[test]
#[cfg_attr(not(uffd), ignore = "no usable /dev/userfaultfd on this host")]
fn a_range_the_peer_unmapped_ends_serving_without_a_kill() {
    let dir = TempDir::new("unmapped");
    let mem = mem_file(&dir.0, 4 << 20);
    let socket = dir.0.join("uffd.sock");
    let (mut child, stream) = spawn_peer(
        &socket,
        &[(PEER_UNMAPPED_ENV, "1".as_ref())],
        std::process::Stdio::null(),
    );
    // The background fetch's first UFFDIO_COPY finds the range gone.
    let session = serve_connection(stream, &mem, &PageServerConfig::default()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !session.released() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(session.released(), "{:?}", session.stats());
    assert_eq!(session.failure(), None);
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        child.try_wait().unwrap().is_none(),
        "the peer was killed for unmapping its memory"
    );
    child.kill().unwrap();
    session.wait().unwrap();
    child.wait().unwrap();
}

/// A page server serving a chunk store's snapshot: the VMM side restores from the same store
/// snapshot (its sys region and state), the server brings the RAM through the store's page
/// source (each chunk checked against its hash): memory ends equal to the snapshot's and the
/// guest goes on.
fn serve_from_store(objects: std::sync::Arc<dyn guestmem_store::ObjectStore>, tag: &str) {
    use guestmem_store::restore::StoreSnapshot;
    let dir = TempDir::new(&format!("store-server-{tag}"));
    let config = VmConfig::simple(2, SIZE, Backend::Anon);
    let flat = dir.0.join("flat");
    let at_snapshot = snapshot_running_vm(&config, SIZE, &flat);
    let snap = Snapshot::open(&flat).unwrap();
    {
        let vm = snapshot::restore(&snap, &mut VmBuilder, RestoreMode::Full)
            .map(|r| r.vm)
            .unwrap();
        guestmem_store::write::write(&*objects, "vm1", &vm, None).unwrap();
    }
    let work = dirty_work(2, SIZE);
    for background in [false, true] {
        let store = StoreSnapshot::open(objects.clone(), "vm1", None).unwrap();
        let memory = snapshot::served_memory(&store).unwrap();
        assert!(memory.describe().contains("vm1"), "{}", memory.describe());
        let socket = dir.0.join(format!("uffd-{background}.sock"));
        let pager = PagerConfig {
            background,
            ..PagerConfig::default()
        };
        let session = spawn_server(&socket, memory, pager);
        let vmm_side = StoreSnapshot::open(objects.clone(), "vm1", None).unwrap();
        let mut restored = snapshot::restore(
            &vmm_side,
            &mut VmBuilder,
            RestoreMode::PageServer(socket.clone()),
        )
        .unwrap();
        let session = session.recv().unwrap().unwrap();
        assert_eq!(session.mappings, restored.peer.as_ref().unwrap().mappings);
        assert_eq!(restored.peer.as_ref().unwrap().mappings.len(), 1);
        assert_eq!(
            restored.vm.pages_done(),
            at_snapshot,
            "{tag}: control blocks"
        );
        if background {
            let deadline = Instant::now() + Duration::from_secs(60);
            while !session.resident() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            assert!(session.resident(), "{tag}: {:?}", session.stats());
            assert_memory_is_snapshot(&restored.vm, &snap, tag);
        } else {
            // On demand only: every page the checks and the guest read came through the server.
            assert_pages_consistent(&restored.vm, &work, &at_snapshot);
            assert!(session.stats()[0].faults > 0, "{:?}", session.stats());
        }
        resume_and_check_continuation(&mut restored.vm, &work, &at_snapshot);
        assert_eq!(session.failure(), None);
        assert!(
            store.fetcher.stats().store_gets > 0,
            "served from the store"
        );
        drop(session);
        drop(restored);
    }

    // A damaged chunk is refused when first served, naming the store snapshot and the chunk.
    let (key, at) = {
        let m = guestmem_store::StoreManifest::load(&*objects, "vm1").unwrap();
        let ids = m.pack_ids();
        let ram = m.regions.iter().find(|r| r.spec.name == "ram").unwrap();
        let c = ram
            .chunks
            .iter()
            .find_map(|c| guestmem_store::StoreManifest::stored(c, &ids))
            .unwrap();
        (c.object_key(), to_usize(c.offset() + c.stored / 2))
    };
    let good = objects.get(&key).unwrap();
    let mut bad = good.clone();
    bad[at] ^= 0xff;
    objects.put(&key, &bad).unwrap();
    let store = StoreSnapshot::open(objects.clone(), "vm1", None).unwrap();
    let socket = dir.0.join("uffd-bad.sock");
    let session = spawn_server(
        &socket,
        snapshot::served_memory(&store).unwrap(),
        PagerConfig::default(),
    );
    let restored = snapshot::restore(
        &store,
        &mut VmBuilder,
        RestoreMode::PageServer(socket.clone()),
    )
    .unwrap();
    let session = session.recv().unwrap().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while session.failure().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let failure = session.failure().expect("a damaged chunk stops serving");
    assert!(
        failure.contains("vm1") && failure.contains("region 'ram' chunk"),
        "{failure}"
    );
    drop(session);
    drop(restored);
    objects.put(&key, &good).unwrap();
}

#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn a_local_store_snapshot_is_served_over_the_handshake() {
    let tmp = TempDir::new("store-server-local");
    serve_from_store(
        std::sync::Arc::new(guestmem_store::local::LocalObjectStore::new(
            &tmp.0.join("store"),
        )),
        "local",
    );
}

#[test]
#[cfg_attr(
    not(all(kvm, uffd)),
    ignore = "no usable /dev/kvm and /dev/userfaultfd on this host"
)]
fn a_minio_store_snapshot_is_served_over_the_handshake() {
    let m = minio::Minio::start("pageserver");
    let config = guestmem_store::s3::S3Config {
        endpoint: Some(m.endpoint()),
        access_key_id: minio::USER.into(),
        secret_access_key: minio::PASSWORD.into(),
        region: None,
    };
    serve_from_store(
        std::sync::Arc::new(
            guestmem_store::s3::S3ObjectStore::new(&m.bucket, "fleet", &config).unwrap(),
        ),
        "minio",
    );
}
