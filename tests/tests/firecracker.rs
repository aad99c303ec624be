//! Firecracker's userfaultfd page-server protocol: guestmem's page server and guestmem's VMM
//! side, end to end, and the server's refusals.

mod common;

use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use common::{
    assert_pages_consistent, dirty_work, resume_and_check_continuation, snapshot_running_vm,
    TempDir,
};
use guestmem_memory::{Backend, PAGE_SIZE};
use guestmem_migration::firecracker::{
    self, parse_mappings, restore_lazy_via_socket, send_handshake, serve_connection,
    GuestRegionUffdMapping, PageServerConfig, Session,
};
use guestmem_migration::snapshot::Snapshot;
use guestmem_paging::{FileSource, PagerConfig};
use guestmem_vm::{layout, VmConfig};

const SIZE: u64 = 8 << 20;

/// A page server on a thread: accepts one connection on `socket` and hands back its session.
/// It never kills its peer (the peer is this test process).
fn spawn_server(
    socket: &Path,
    mem_file: &Path,
    pager: PagerConfig,
) -> mpsc::Receiver<guestmem_migration::Result<Session>> {
    let listener = UnixListener::bind(socket).unwrap();
    let mem = firecracker::open_mem_file(mem_file).unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let (stream, _) = listener.accept().unwrap();
        let config = PageServerConfig {
            pager,
            kill_peer_on_failure: false,
        };
        let _ = tx.send(serve_connection(stream, &mem, &config));
    });
    rx
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
        let session = spawn_server(&socket, &dir.0.join("memory"), quiet);
        let mut restored = restore_lazy_via_socket(&snap, &socket).unwrap();
        let session = session.recv().unwrap().unwrap();
        assert_eq!(session.peer_pid, std::process::id() as i32);
        assert_eq!(session.mappings, restored.mappings);
        let ram = &snap.manifest().regions[1];
        assert_eq!(restored.mappings.len(), 1, "{backend}: one RAM region");
        assert_eq!(restored.mappings[0].offset, ram.file_offset);
        assert_eq!(restored.mappings[0].size, ram.spec.size);
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

        // With background fetch, everything arrives: memory equals the snapshot's.
        let socket = dir.0.join("uffd2.sock");
        let session = spawn_server(&socket, &dir.0.join("memory"), PagerConfig::default());
        let restored = restore_lazy_via_socket(&snap, &socket).unwrap();
        let session = session.recv().unwrap().unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        while !session.resident() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(session.resident(), "{backend}: {:?}", session.stats());
        for (region, image) in restored
            .vm
            .memory()
            .regions()
            .iter()
            .zip(&snap.manifest().regions)
        {
            let digest = restored
                .vm
                .memory()
                .digest(region.gpa(), region.size())
                .unwrap();
            assert_eq!(
                digest,
                image.digest,
                "{backend}: region '{}'",
                region.name()
            );
        }
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
    let session = spawn_server(&socket, &dir.0.join("memory"), quiet);
    let restored = restore_lazy_via_socket(&snap, &socket).unwrap();
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
        let offset = (gpa - ram.gpa()) as usize;
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
    let at = (image.file_offset + (untouched - layout::RAM_GPA)) as usize;
    assert!(file[at..at + PAGE_SIZE as usize].iter().any(|&b| b != 0));
    assert!(
        session.stats()[0].discarded_chunks >= 1,
        "{:?}",
        session.stats()
    );
    drop(session);
}

fn mem_file(dir: &Path, len: u64) -> Arc<FileSource> {
    let path = dir.join("memory");
    let f = std::fs::File::create(&path).unwrap();
    f.set_len(len).unwrap();
    firecracker::open_mem_file(&path).unwrap()
}

/// Sends `message` (with `/dev/null` attached when `with_fd`) and returns the server's error.
fn server_error(mem: &Arc<FileSource>, message: &[u8], with_fd: bool) -> String {
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
        Err(e) => e.to_string(),
    }
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

    let ok = br#"[{"base_host_virt_addr":1073741824,"size":2097152,"offset":0,"page_size":4096}]"#;
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

    let e = server_error(
        &mem,
        br#"[{"base_host_virt_addr":0,"size":4096,"offset":0}]"#,
        true,
    );
    assert!(e.contains("neither page_size nor page_size_kib"), "{e}");

    let e = server_error(&mem, b"[]", true);
    assert!(e.contains("lists no memory regions"), "{e}");
}

#[test]
fn both_page_size_spellings_are_accepted() {
    let m = parse_mappings(
        br#"[{"base_host_virt_addr":4096,"size":8192,"offset":0,"page_size_kib":4},
             {"base_host_virt_addr":1048576,"size":2097152,"offset":8192,"page_size":2097152}]"#,
    )
    .unwrap();
    assert_eq!(
        m,
        vec![
            GuestRegionUffdMapping {
                base_host_virt_addr: 4096,
                size: 8192,
                offset: 0,
                page_size: 4096
            },
            GuestRegionUffdMapping {
                base_host_virt_addr: 1 << 20,
                size: 2 << 20,
                offset: 8192,
                page_size: 2 << 20
            },
        ]
    );
}

const PEER_ENV: &str = "GUESTMEM_FC_TEST_PEER_SOCKET";
const PEER_UNREGISTERED_ENV: &str = "GUESTMEM_FC_TEST_PEER_UNREGISTERED";

/// Not a test on its own: the peer process of `failed_serving_kills_the_peer` (the test binary
/// re-run with `PEER_ENV` set). It sends a mapping the server must refuse, then waits to die.
#[test]
fn peer_process_helper() {
    let Some(socket) = std::env::var_os(PEER_ENV) else {
        return;
    };
    use std::os::fd::{AsFd, FromRawFd, OwnedFd};
    let _stream = if std::env::var_os(PEER_UNREGISTERED_ENV).is_some() {
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
        let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC) } as i32;
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
    let listener = UnixListener::bind(&socket).unwrap();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "peer_process_helper", "--nocapture"])
        .env(PEER_ENV, &socket)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let (stream, _) = listener.accept().unwrap();
    let err = match serve_connection(stream, &mem, &PageServerConfig::default()) {
        Ok(_) => panic!("a mapping beyond the file was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("ends beyond the memory file"), "{err}");
    assert!(
        err.contains(&format!("peer pid {} killed", child.id())),
        "{err}"
    );
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
    let listener = UnixListener::bind(&socket).unwrap();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "peer_process_helper", "--nocapture"])
        .env(PEER_ENV, &socket)
        .env(PEER_UNREGISTERED_ENV, "1")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let (stream, _) = listener.accept().unwrap();
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
