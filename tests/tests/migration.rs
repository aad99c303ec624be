//! Live migration between two guestmem ends over real TLS sockets: the guest keeps counting
//! on the destination, its memory arrives whole, and failures leave the source running.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{assert_pages_consistent, dirty_work, wait_for_generation, TempDir};
use guestmem_contract::component::Components;
use guestmem_contract::{SharedFiles, TargetMachine};
use guestmem_events::{Event, Sink, Status};
use guestmem_memory::{Backend, GuestMemory};
use guestmem_migration::compress::Compress;
use guestmem_migration::migrate::{
    self, DestinationReport, Links, Mode, ReceiveOptions, Report, SendOptions,
};
use guestmem_migration::stream::Frame;
use guestmem_migration::transport::{
    self, generate_credentials, Credentials, Endpoint, Listener, Role,
};
use guestmem_vm::payload::{CTL_GENERATION, CTL_GEN_LIMIT};
use guestmem_vm::{layout, RunningVm, Vm, VmConfig};

const SIZE: u64 = 32 << 20;
const VCPUS: usize = 2;

/// An error with its causes (each a `source()`, not repeated in the message).
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// Digest of every region, in order.
fn digest(memory: &GuestMemory) -> Vec<u64> {
    memory
        .regions()
        .iter()
        .map(|r| memory.digest(r.gpa(), r.size()).unwrap())
        .collect()
}

/// Fresh credentials in `dir`, and a destination listening at `endpoint` (with `timeouts`, or
/// the defaults).
fn listen(
    dir: &TempDir,
    endpoint: &Endpoint,
    timeouts: Option<transport::Timeouts>,
) -> Arc<Listener> {
    generate_credentials(&dir.0).unwrap();
    let listener = Listener::bind(
        endpoint,
        &Credentials::load(&dir.0, Role::Destination).unwrap(),
    )
    .unwrap();
    Arc::new(match timeouts {
        Some(t) => listener.with_timeouts(t),
        None => listener,
    })
}

struct Pair {
    dir: TempDir,
    endpoint: Endpoint,
    listener: Arc<Listener>,
}

impl Pair {
    /// The destination on a Unix socket.
    fn new(name: &str) -> Pair {
        Pair::bind(name, false)
    }

    /// The destination on 127.0.0.1, at a port the kernel picks.
    fn tcp(name: &str) -> Pair {
        Pair::bind(name, true)
    }

    fn bind(name: &str, tcp: bool) -> Pair {
        let dir = TempDir::new(&format!("migrate-{name}"));
        let endpoint = match tcp {
            true => Endpoint::Tcp("127.0.0.1:0".into()),
            false => Endpoint::Unix(dir.0.join("sock")),
        };
        let listener = listen(&dir, &endpoint, None);
        let endpoint = match listener.port() {
            Some(port) => Endpoint::Tcp(format!("127.0.0.1:{port}")),
            None => endpoint,
        };
        Pair {
            dir,
            endpoint,
            listener,
        }
    }

    fn connect(&self, mode: Mode, connections: usize) -> Links {
        let creds = Credentials::load(&self.dir.0, Role::Source).unwrap();
        Links::connect(&self.endpoint, &creds, mode, connections).unwrap()
    }
}

/// What the destination saw: pages done at switch-over, the digest of its memory before the
/// guest wrote anything, and its report.
struct Received {
    at_switchover: Vec<u64>,
    digest: Vec<u64>,
    report: DestinationReport,
}

/// The destination: receive, resume, check that the guest counts on from where it stopped
/// and that every page is consistent with its counters. With `gated`, the guest arrives held
/// at its generation gate: its memory is digested (faulting every missing page in) before
/// it is let go.
fn destination(listener: Arc<Listener>, gated: bool) -> std::thread::JoinHandle<Received> {
    std::thread::spawn(move || {
        let migrate::Incoming {
            mut vm,
            mut transfer,
        } = migrate::receive(listener, &ReceiveOptions::default()).unwrap();
        let at_switchover = vm.pages_done();
        let work = dirty_work(VCPUS, SIZE);
        let memory = vm.memory().clone();
        let running = transfer.resume(&mut vm).unwrap();
        let digest = if gated {
            let d = digest(&memory);
            running.set_generation_limit(u64::MAX);
            d
        } else {
            Vec::new()
        };
        let target = at_switchover
            .iter()
            .map(|p| p / work[0].pages() + 2)
            .max()
            .unwrap();
        wait_for_generation(&running, target);
        running.stop();
        let run = running.wait(Duration::from_secs(30)).unwrap();
        let after: Vec<u64> = run.vcpus.iter().map(|v| v.pages).collect();
        for (i, (b, a)) in at_switchover.iter().zip(&after).enumerate() {
            assert!(
                a > b,
                "vCPU {i} went on counting on the destination: {b} -> {a}"
            );
        }
        let report = transfer.finish().unwrap();
        assert_pages_consistent(&vm, &work, &after);
        Received {
            at_switchover,
            digest,
            report,
        }
    })
}

/// A source VM running `dirty` over its RAM, at least one pass done.
fn source_vm(backend: Backend) -> Vm {
    Vm::new(&VmConfig::simple(VCPUS, SIZE, backend)).unwrap()
}

fn start(vm: &mut Vm) -> RunningVm<'_> {
    let running = vm.start(&dirty_work(VCPUS, SIZE)).unwrap();
    wait_for_generation(&running, 1);
    running
}

/// Holds the guest at the gate after its current pass, and waits until it is there.
fn gate(running: &RunningVm<'_>) {
    let g = running.progress().iter().map(|&(_, g)| g).max().unwrap() + 1;
    running.set_generation_limit(g);
    wait_for_generation(running, g);
}

/// Holds the guest at its generation gate after its current pass, through its control blocks
/// (from a thread that has no `RunningVm`), and waits until it is there.
fn park_guest(memory: &GuestMemory) {
    for i in 0..VCPUS {
        let ctl = layout::control_gpa(i);
        let g = memory.read_u64(ctl + CTL_GENERATION).unwrap() + 1;
        memory.write_u64(ctl + CTL_GEN_LIMIT, g).unwrap();
        while memory.read_u64(ctl + CTL_GENERATION).unwrap() < g {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

fn check(report: &Report, received: &Received, source_at_switchover: &[u64]) {
    assert_eq!(received.at_switchover, source_at_switchover);
    assert!(report.downtime_ms > 0.0 && report.total_ms >= report.downtime_ms);
    assert!(!report.rounds.is_empty());
    assert!(
        report.destination.is_some(),
        "the destination's figures came back"
    );
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn precopy_moves_a_running_guest_on_every_backend() {
    for (backend, connections) in [
        (Backend::Anon, 1),
        (Backend::Memfd, 3),
        (Backend::GuestMemfd, 2),
    ] {
        let pair = Pair::new(&format!("pre-{backend}"));
        let dest = destination(pair.listener.clone(), false);
        let mut vm = source_vm(backend);
        let running = start(&mut vm);
        let opts = SendOptions {
            verify: true,
            ..Default::default()
        };
        let report = migrate::send(running, pair.connect(Mode::Precopy, connections), &opts)
            .unwrap_or_else(|f| panic!("{backend}: {f:?}"));
        let received = dest.join().unwrap();
        check(&report, &received, &vm.pages_done());
        assert_eq!(report.connections, connections);
        // The destination checked its digest against the source's at switch-over.
        assert!(report.verify_ms > 0.0, "{backend}: the digest was checked");
        assert!(report.pages_sent > 0 && report.bytes >= report.pages_sent * 4096);
    }
}

/// Pre-copy over TCP: where the kernel has TLS (with the CPU's AES-GCM), every connection of
/// both ends hands its records to the kernel after the handshake (else none does, and the probe
/// names what is missing); with `rustls_source`, the source keeps rustls and the destination still takes
/// kernel TLS (the two talk, both ways). The memory arrives whole either way.
fn precopy_over_tcp(name: &str, rustls_source: bool) {
    let pair = Pair::tcp(name);
    let dest = destination(pair.listener.clone(), false);
    let mut vm = source_vm(Backend::Anon);
    let running = start(&mut vm);
    let links = transport::with_kernel_tls(!rustls_source, || pair.connect(Mode::Precopy, 2));
    let count = links.connection_count();
    let kernel = match guestmem_sys::probe::kernel_tls() {
        Ok(()) => true,
        Err(why) => {
            // It names what is missing: the ULP, a key direction, or the CPU's AES-GCM.
            assert!(
                ["TCP_ULP", "TLS_TX", "TLS_RX", "AES-GCM"]
                    .iter()
                    .any(|w| why.contains(w)),
                "{why}"
            );
            false
        }
    };
    let expected = |on: bool| if kernel && on { count } else { 0 };
    assert_eq!(links.kernel_tls_connections(), expected(!rustls_source));
    let opts = SendOptions {
        verify: true,
        ..Default::default()
    };
    let report = migrate::send(running, links, &opts).unwrap_or_else(|f| panic!("{f:?}"));
    let received = dest.join().unwrap();
    check(&report, &received, &vm.pages_done());
    assert!(report.verify_ms > 0.0, "the digest was checked");
    assert_eq!(received.report.kernel_tls_connections, expected(true));
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn precopy_over_tcp_takes_kernel_tls_where_the_kernel_has_it() {
    precopy_over_tcp("ktls", false);
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn a_rustls_source_migrates_to_a_kernel_tls_destination() {
    precopy_over_tcp("ktls-mixed", true);
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn postcopy_and_hybrid_bring_every_page() {
    // Hybrid with zstd: its pre-copy round goes on zstd streams, then post-copy uses the same
    // pages connections (its answers uncompressed).
    for (backend, mode, compress) in [
        (Backend::Anon, Mode::Postcopy, Compress::None),
        (Backend::Memfd, Mode::Postcopy, Compress::None),
        (Backend::Anon, Mode::Hybrid, Compress::None),
        (Backend::Memfd, Mode::Hybrid, Compress::None),
        (Backend::Anon, Mode::Hybrid, Compress::Zstd),
    ] {
        let pair = Pair::new(&format!("{mode}-{backend}-{compress:?}"));
        let dest = destination(pair.listener.clone(), true);
        let mut vm = source_vm(backend);
        let running = start(&mut vm);
        let memory = running.memory().clone();
        if mode == Mode::Postcopy {
            gate(&running);
        }
        // Hybrid: the guest writes during the pre-copy round, and parks after it.
        let park = move |p: &Event| {
            if p.status == Status::Precopy && p.expected_downtime_ms.is_some() {
                park_guest(&memory);
            }
        };
        let report = migrate::send(
            running,
            pair.connect(mode, 2),
            &SendOptions {
                mode,
                compress,
                // Hybrid's round on zstd streams: 128 MiB asked for.
                zstd_window_bytes: if compress == Compress::Zstd {
                    128 << 20
                } else {
                    0
                },
                events: Some(Sink::new(park)),
                ..Default::default()
            },
        )
        .unwrap_or_else(|f| panic!("{mode} {backend}: {f:?}"));
        if compress == Compress::Zstd {
            // 128 MiB asked for, cut to what a connection carries of the guest.
            let w = report.zstd_window_bytes;
            assert!(w > 0 && w <= SIZE, "{w}");
            assert!(
                report.compression.zstd_frames > 0,
                "{:?}",
                report.compression
            );
            let d = report.destination.as_ref().unwrap();
            assert!(report.zstd_stream_bytes > 0 && d.zstd_stream_bytes > 0);
        }
        let received = dest.join().unwrap();
        // The source is stopped since the switch-over: its memory is the switch-over's.
        assert_eq!(
            received.digest,
            digest(vm.memory()),
            "{mode} {backend}: the destination's memory is the source's"
        );
        check(&report, &received, &vm.pages_done());
        let d = report.destination.as_ref().unwrap();
        if mode == Mode::Postcopy {
            assert!(
                d.fault_fetches > 0,
                "{mode} {backend}: pages were faulted in"
            );
            assert!(report.postcopy_requests > 0);
        }
    }
}

/// guestmem's payload VM, whose state load also writes into its RAM through the host mapping,
/// one byte in every 2 MiB: what KVM does when a Linux guest's kvmclock MSR is loaded (it maps
/// the page for itself, and with huge pages advised the fault fills 2 MiB).
struct TouchingRestore(Vm);

impl TargetMachine for TouchingRestore {
    type Running<'a> = RunningVm<'a>;

    fn memory(&self) -> &Arc<GuestMemory> {
        self.0.memory()
    }

    fn vcpu_count(&self) -> usize {
        self.0.vcpu_count()
    }

    fn restore(&mut self, state: &[u8]) -> guestmem_contract::Result<()> {
        TargetMachine::restore(&mut self.0, state)?;
        let memory = self.0.memory();
        for region in memory
            .regions()
            .iter()
            .filter(|r| r.gpa() != layout::SYS_GPA)
        {
            for offset in (0..region.size()).step_by(2 << 20) {
                let mut byte = [0u8];
                memory.read(region.gpa() + offset, &mut byte).unwrap();
                memory.write(region.gpa() + offset, &byte).unwrap();
            }
        }
        Ok(())
    }

    fn resume(&mut self) -> guestmem_contract::Result<RunningVm<'_>> {
        TargetMachine::resume(&mut self.0)
    }

    fn abort_handle(&self) -> Option<guestmem_vm::AbortHandle> {
        Some(self.0.abort_handle())
    }
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn pages_the_state_load_touched_still_come_from_the_source() {
    for (backend, mode) in [
        (Backend::Anon, Mode::Postcopy),
        (Backend::Memfd, Mode::Postcopy),
        (Backend::Anon, Mode::Hybrid),
    ] {
        let pair = Pair::new(&format!("touch-{mode}-{backend}"));
        let listener = pair.listener.clone();
        let dest = std::thread::spawn(move || {
            let mut builder = |config: &VmConfig, shared: SharedFiles| {
                Ok(TouchingRestore(Vm::new_on(config, shared)?))
            };
            let migrate::Incoming {
                mut vm,
                mut transfer,
            } = migrate::receive_into(
                listener,
                &ReceiveOptions::default(),
                &mut builder,
                &mut Components::none(),
            )
            .unwrap();
            let memory = vm.memory().clone();
            let running = transfer.resume(&mut vm).unwrap();
            // The guest stays at its gate (set on the source): the memory is the source's.
            let digest = digest(&memory);
            running.stop();
            running.wait(Duration::from_secs(30)).unwrap();
            transfer.finish().unwrap();
            digest
        });
        let mut vm = source_vm(backend);
        let running = start(&mut vm);
        gate(&running);
        migrate::send(
            running,
            pair.connect(mode, 1),
            &SendOptions {
                mode,
                ..Default::default()
            },
        )
        .unwrap_or_else(|f| panic!("{mode} {backend}: {f:?}"));
        assert_eq!(
            dest.join().unwrap(),
            digest(vm.memory()),
            "{mode} {backend}: the destination's memory is the source's"
        );
    }
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn a_local_migration_hands_the_memfd_over_instead_of_copying_it() {
    for mode in [Mode::Precopy, Mode::Hybrid] {
        let pair = Pair::new(&format!("share-{mode}"));
        let dest = destination(pair.listener.clone(), true);
        let mut vm = source_vm(Backend::Memfd);
        let running = start(&mut vm);
        let memory = running.memory().clone();
        let opts = SendOptions {
            mode,
            verify: mode == Mode::Precopy,
            share_memory: true,
            events: Some(Sink::new(move |p: &Event| {
                if p.status == Status::Precopy && p.expected_downtime_ms.is_some() {
                    park_guest(&memory);
                }
            })),
            ..Default::default()
        };
        let report = migrate::send(running, pair.connect(mode, 1), &opts)
            .unwrap_or_else(|f| panic!("{mode}: {f:?}"));
        let received = dest.join().unwrap();
        check(&report, &received, &vm.pages_done());
        assert_eq!(
            report.shared_bytes, SIZE,
            "{mode}: the RAM region went as a file"
        );
        // Only the sys region's pages travelled.
        assert!(
            report.pages_sent * 4096 < layout::SYS_SIZE,
            "{mode}: {} pages sent",
            report.pages_sent
        );
        if mode == Mode::Precopy {
            assert!(report.verify_ms > 0.0);
        }
    }
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn a_cut_postcopy_link_is_resumed_without_losing_a_page() {
    let pair = Pair::new("cut");
    let dest = destination(pair.listener.clone(), true);
    let mut vm = source_vm(Backend::Anon);
    let running = start(&mut vm);
    gate(&running);
    let links = pair.connect(Mode::Postcopy, 1);
    let cutters = Arc::new(Mutex::new(links.cutters().unwrap()));
    let cut = cutters.clone();
    let creds_dir = pair.dir.0.clone();
    let endpoint = pair.endpoint.clone();
    let opts = SendOptions {
        mode: Mode::Postcopy,
        // The moment post-copy starts, the link goes down.
        events: Some(Sink::new(move |p: &Event| {
            if p.status == Status::Postcopy {
                for c in cut.lock().unwrap().drain(..) {
                    c.cut();
                }
            }
        })),
        reconnect: Some(Arc::new(move |resume: &migrate::Resume| {
            assert!(!resume.reason.is_empty());
            let creds = Credentials::load(&creds_dir, Role::Source).unwrap();
            resume.connect(&endpoint, &creds)
        })),
        ..Default::default()
    };
    let report = migrate::send(running, links, &opts).unwrap();
    let received = dest.join().unwrap();
    assert_eq!(report.link_breaks, 1);
    assert_eq!(received.report.link_breaks, 1);
    assert_eq!(received.digest, digest(vm.memory()), "no page lost");
    check(&report, &received, &vm.pages_done());
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn a_dead_destination_leaves_the_source_running() {
    let pair = Pair::new("dead");
    // A destination that says hello, takes the first pages, and dies.
    let listener = pair.listener.clone();
    let dest = std::thread::spawn(move || {
        let mut conn = listener.accept().unwrap();
        let _hello = Frame::read_from(&mut conn).unwrap();
        answer_hello(&mut conn);
        let _setup = Frame::read_from(&mut conn).unwrap();
        Frame::Hello {
            config_json: b"{}".to_vec(),
        }
        .write_to(&mut conn)
        .unwrap();
        std::io::Write::flush(&mut conn).unwrap();
        for _ in 0..4 {
            let _ = Frame::read_from(&mut conn);
        }
        drop(conn);
    });
    let mut vm = source_vm(Backend::Anon);
    let running = start(&mut vm);
    let failure = migrate::send(
        running,
        pair.connect(Mode::Precopy, 1),
        &SendOptions::default(),
    )
    .expect_err("the migration fails");
    dest.join().unwrap();
    assert!(!failure.error.to_string().is_empty());
    runs_on(failure.vm.expect("the source keeps its VM"));
}

/// A destination whose receive path misplaces a word: the digest check at switch-over refuses
/// the migration, naming the guest range that differs, and the source runs on.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn a_destination_with_wrong_bytes_is_refused_and_the_source_runs_on() {
    let pair = Pair::new("corrupt");
    let listener = pair.listener.clone();
    let at = layout::RAM_GPA + SIZE / 2 + 64;
    let dest = std::thread::spawn(move || {
        let opts = ReceiveOptions {
            corrupt_landing_at: Some(at),
            ..Default::default()
        };
        migrate::receive(listener, &opts).map(|_| ()).unwrap_err()
    });
    let mut vm = source_vm(Backend::Anon);
    let running = start(&mut vm);
    let opts = SendOptions {
        verify: true,
        ..Default::default()
    };
    let failure = migrate::send(running, pair.connect(Mode::Precopy, 2), &opts)
        .expect_err("a migration with wrong bytes at the destination fails");
    let refused = dest.join().unwrap().to_string();
    let range = format!("{:#x}..{:#x}", layout::RAM_GPA, layout::RAM_GPA + SIZE);
    for e in [failure.error.to_string(), refused] {
        assert!(e.contains("digest") && e.contains(&range), "{e}");
    }
    runs_on(failure.vm.expect("the source keeps its VM"));
}

/// What a destination answers a connection's Hello with, to take it.
fn answer_hello(conn: &mut transport::Connection) {
    Frame::Hello {
        config_json: b"{}".to_vec(),
    }
    .write_to(conn)
    .unwrap();
    std::io::Write::flush(conn).unwrap();
}

/// A failed migration's source VM is running: its counters move on. Then it is stopped.
fn runs_on(running: RunningVm) {
    let before: u64 = running.progress().iter().map(|p| p.0).sum();
    std::thread::sleep(Duration::from_millis(50));
    let after: u64 = running.progress().iter().map(|p| p.0).sum();
    assert!(
        after > before,
        "the source guest runs on ({before} -> {after})"
    );
    running.stop();
    running.wait(Duration::from_secs(30)).unwrap();
}

/// Memory files travel only over a Unix socket: asked to share memory with a destination
/// over TCP, the source refuses before anything moves, says why, and runs on.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn sharing_memory_over_tcp_is_refused_and_the_source_runs_on() {
    let pair = Pair::tcp("share-tcp");
    let listener = pair.listener.clone();
    // The destination reads until the source hangs up.
    let dest = std::thread::spawn(move || {
        let mut conn = listener.accept().unwrap();
        let mut frames = vec![Frame::read_from(&mut conn).unwrap()];
        answer_hello(&mut conn);
        while let Ok(f) = Frame::read_from(&mut conn) {
            frames.push(f);
        }
        frames
    });
    let mut vm = source_vm(Backend::Memfd);
    let running = start(&mut vm);
    let opts = SendOptions {
        share_memory: true,
        ..Default::default()
    };
    let failure = migrate::send(running, pair.connect(Mode::Precopy, 1), &opts)
        .expect_err("sharing memory over TCP fails");
    assert!(
        failure.error.to_string().contains("unix:"),
        "{}",
        failure.error
    );
    runs_on(failure.vm.expect("the source keeps its VM"));
    let frames = dest.join().unwrap();
    assert!(
        !frames.iter().any(|f| matches!(f, Frame::Pages { .. })),
        "no page moved: {frames:?}"
    );
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn a_destination_that_cannot_build_the_vm_refuses_before_anything_moves() {
    // Post-copy of guest_memfd needs KVM Userfault: where the destination finds (by trying)
    // that the kernel lacks it, it refuses before any page moves.
    // On a kernel that serves it (or has no guest_memfd), this refusal cannot be shown.
    let gmem = match Vm::new(&VmConfig::simple(1, 4 << 20, Backend::GuestMemfd)) {
        Ok(vm) => vm,
        Err(e) => return eprintln!("no guest_memfd VM here ({e}): nothing to refuse"),
    };
    let missing = match guestmem_paging::check_demand_paging(gmem.memory().region("ram").unwrap()) {
        Ok(()) => return eprintln!("this kernel demand pages guest_memfd: nothing to refuse"),
        Err(e) => e.to_string(),
    };
    drop(gmem);
    assert!(missing.contains("KVM_MEM_USERFAULT"), "{missing}");
    let pair = Pair::new("refuse");
    let listener = pair.listener.clone();
    let dest = std::thread::spawn(move || {
        migrate::receive(listener, &ReceiveOptions::default())
            .expect_err("refused")
            .to_string()
    });
    let mut vm = source_vm(Backend::GuestMemfd);
    let running = start(&mut vm);
    let opts = SendOptions {
        mode: Mode::Postcopy,
        ..Default::default()
    };
    let failure =
        migrate::send(running, pair.connect(Mode::Postcopy, 1), &opts).expect_err("refused");
    let reason = dest.join().unwrap();
    assert!(reason.contains("KVM_MEM_USERFAULT"), "{reason}");
    assert!(
        failure.error.to_string().contains("KVM_MEM_USERFAULT"),
        "{}",
        failure.error
    );
    let running = failure.vm.expect("the source keeps its VM");
    running.stop();
    running.wait(Duration::from_secs(30)).unwrap();
}

/// A source's Hello as raw JSON (the protocol's first frame on each connection).
fn raw_hello(migration: u64, channel: &str, pages: usize) -> Frame {
    Frame::Hello {
        config_json: format!(
            r#"{{"guestmem_version":"0","migration":{migration},"channel":{channel},"pages":{pages},"urgent":0,"resume":false}}"#
        )
        .into_bytes(),
    }
}

/// Junk before a migration: a connection that says nothing, random bytes, a line of text, a
/// stranger's certificate, a source certificate sending no Hello, a source presenting the
/// destination's certificate. Each is refused on its own (the TLS ones told why); the
/// genuine migration after them goes through, its memory whole.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn junk_connections_are_refused_and_the_migration_after_them_goes_through() {
    use std::io::{Read, Write};
    let pair = Pair::tcp("junk");
    let dest = destination(pair.listener.clone(), true);
    let Endpoint::Tcp(addr) = &pair.endpoint else {
        unreachable!()
    };
    let _silent = std::net::TcpStream::connect(addr).unwrap();
    for junk in [
        &[0x16u8, 0x03, 0x01, 0xff, 0xff, 0x9a, 0x42][..],
        b"hello there\n",
    ] {
        let mut c = std::net::TcpStream::connect(addr).unwrap();
        c.write_all(junk).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        // The destination hangs up on it (after a TLS alert, maybe).
        let mut sink = Vec::new();
        let _ = c.read_to_end(&mut sink);
    }
    let stranger = TempDir::new("migrate-stranger");
    generate_credentials(&stranger.0).unwrap();
    let e = Links::connect(
        &pair.endpoint,
        &Credentials::load(&stranger.0, Role::Source).unwrap(),
        Mode::Precopy,
        1,
    )
    .expect_err("the destination is not ours");
    assert!(e.to_string().contains("TLS"), "{e}");

    let source_creds = Credentials::load(&pair.dir.0, Role::Source).unwrap();
    let mut conn = transport::connect(&pair.endpoint, &source_creds).unwrap();
    conn.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    conn.flush().unwrap();
    match Frame::read_from(&mut conn) {
        Ok(Frame::Abort { reason }) => {
            assert!(
                reason.contains("not a guestmem migration stream"),
                "{reason}"
            );
        }
        other => panic!("expected an Abort, got {other:?}"),
    }

    // The destination's own certificate, presented by a source.
    let swapped = TempDir::new("migrate-swapped");
    std::fs::create_dir_all(&swapped.0).unwrap();
    std::fs::copy(pair.dir.0.join("ca.pem"), swapped.0.join("ca.pem")).unwrap();
    for ext in ["pem", "key"] {
        std::fs::copy(
            pair.dir.0.join(format!("guestmem-destination.{ext}")),
            swapped.0.join(format!("guestmem-source.{ext}")),
        )
        .unwrap();
    }
    let e = Links::connect(
        &pair.endpoint,
        &Credentials::load_unchecked(&swapped.0, Role::Source).unwrap(),
        Mode::Precopy,
        1,
    )
    .expect_err("a destination's certificate on a source");
    assert!(
        e.to_string()
            .contains("it is a destination certificate (guestmem-destination), where a source one"),
        "{e}"
    );

    let mut vm = source_vm(Backend::Anon);
    let running = start(&mut vm);
    gate(&running);
    let report = migrate::send(
        running,
        pair.connect(Mode::Precopy, 2),
        &SendOptions::default(),
    )
    .unwrap_or_else(|f| panic!("{f:?}"));
    let received = dest.join().unwrap();
    assert_eq!(
        received.digest,
        digest(vm.memory()),
        "the memory came whole"
    );
    check(&report, &received, &vm.pages_done());
}

/// Two sources at once: the first one's migration completes; the second is refused, told
/// that the destination is busy with another migration, and keeps nothing from trying.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn a_second_source_is_told_the_destination_is_busy_and_the_first_completes() {
    let pair = Pair::new("busy");
    let dest = destination(pair.listener.clone(), false);
    let mut vm = source_vm(Backend::Anon);
    let running = start(&mut vm);
    let first = pair.connect(Mode::Precopy, 2);
    let creds = Credentials::load(&pair.dir.0, Role::Source).unwrap();
    let e = Links::connect(&pair.endpoint, &creds, Mode::Precopy, 2)
        .expect_err("the second source is refused");
    assert!(
        e.to_string()
            .contains("the destination is busy with another migration"),
        "{e}"
    );
    let report =
        migrate::send(running, first, &SendOptions::default()).unwrap_or_else(|f| panic!("{f:?}"));
    let received = dest.join().unwrap();
    check(&report, &received, &vm.pages_done());
}

/// A source that opens its first connection of two and no more: the destination gives up
/// after the handshake timeout, naming the connection that did not come, and tells the source.
#[test]
fn a_missing_connection_is_waited_for_the_handshake_timeout_only() {
    let dir = TempDir::new("migrate-missing");
    let timeouts = transport::Timeouts {
        handshake: Duration::from_secs(1),
        idle: Duration::from_secs(5),
    };
    let listener = listen(&dir, &Endpoint::Tcp("127.0.0.1:0".into()), Some(timeouts));
    let endpoint = Endpoint::Tcp(format!("127.0.0.1:{}", listener.port().unwrap()));
    let l = listener.clone();
    let dest = std::thread::spawn(move || {
        let started = std::time::Instant::now();
        let e = migrate::receive(l, &ReceiveOptions::default())
            .expect_err("refused")
            .to_string();
        (e, started.elapsed())
    });
    let mut conn =
        transport::connect(&endpoint, &Credentials::load(&dir.0, Role::Source).unwrap()).unwrap();
    raw_hello(7, r#"{"pages":0}"#, 2)
        .write_to(&mut conn)
        .unwrap();
    std::io::Write::flush(&mut conn).unwrap();
    assert!(matches!(
        Frame::read_from(&mut conn),
        Ok(Frame::Hello { .. })
    ));
    let (e, took) = dest.join().unwrap();
    assert!(
        e.contains("pages connection 1 of migration 0x7 did not come within 1 s"),
        "{e}"
    );
    assert!(took < Duration::from_secs(5), "waited {took:?}");
    match Frame::read_from(&mut conn) {
        Ok(Frame::Abort { reason }) => assert!(reason.contains("pages connection 1"), "{reason}"),
        other => panic!("expected an Abort, got {other:?}"),
    }
}

/// A bandwidth limit that never lets the migration finish is refused before anything moves,
/// naming the option; the source keeps its VM running.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn a_bandwidth_limit_that_never_finishes_is_refused() {
    let pair = Pair::new("bw0");
    let listener = pair.listener.clone();
    let dest = std::thread::spawn(move || migrate::receive(listener, &ReceiveOptions::default()));
    let mut vm = source_vm(Backend::Anon);
    let running = start(&mut vm);
    let opts = SendOptions {
        max_bandwidth: Some(0),
        ..Default::default()
    };
    let failure = migrate::send(running, pair.connect(Mode::Precopy, 2), &opts)
        .expect_err("a zero bandwidth is refused");
    assert!(
        failure
            .error
            .to_string()
            .contains("max_bandwidth of 0 bytes/s"),
        "{}",
        failure.error
    );
    runs_on(failure.vm.expect("the source keeps its VM"));
    assert!(
        dest.join().unwrap().is_err(),
        "the destination got nothing to run"
    );
}

/// A relay to `to` of one connection that flips one bit of the byte at offset `at` of what the
/// client sends, and forwards all else as it is.
fn damaging_relay(to: u16, at: usize) -> u16 {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let Ok((client, _)) = listener.accept() else {
            return;
        };
        let server = std::net::TcpStream::connect(("127.0.0.1", to)).unwrap();
        for (mut from, mut into, flip) in [
            (
                client.try_clone().unwrap(),
                server.try_clone().unwrap(),
                Some(at),
            ),
            (server, client, None),
        ] {
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 64 << 10];
                let mut offset = 0;
                loop {
                    let n = match from.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    if let Some(at) = flip.filter(|at| (offset..offset + n).contains(at)) {
                        buf[at - offset] ^= 0x10;
                    }
                    offset += n;
                    if into.write_all(&buf[..n]).is_err() {
                        return;
                    }
                }
            });
        }
    });
    port
}

/// A byte damaged on the way, past the handshake, fails the destination's read with an error
/// that says the peer's record did not decrypt, whichever TLS the ends run (rustls, or the
/// kernel's where it has it): no damaged byte is ever handed on.
#[test]
fn a_record_damaged_on_the_way_is_refused_by_either_tls() {
    use std::io::{Read, Write};
    for kernel in [false, true] {
        let dir = TempDir::new(&format!("damaged-{kernel}"));
        let listener = listen(&dir, &Endpoint::Tcp("127.0.0.1:0".into()), None);
        let relay = damaging_relay(listener.port().unwrap(), 200 << 10);
        let to = Endpoint::Tcp(format!("127.0.0.1:{relay}"));
        let creds = Credentials::load(&dir.0, Role::Source).unwrap();
        let writer = std::thread::spawn(move || {
            let mut conn =
                transport::with_kernel_tls(kernel, || transport::connect(&to, &creds)).unwrap();
            // The destination may fail, and hang up, before all is written.
            let _ = conn.write_all(&vec![7u8; 1 << 20]);
            let _ = conn.flush();
        });
        let mut conn = transport::with_kernel_tls(kernel, || listener.accept()).unwrap();
        let expected = kernel && guestmem_sys::probe::kernel_tls().is_ok();
        assert_eq!(conn.kernel_tls(), expected);
        let mut buf = vec![0u8; 1 << 20];
        let mut got = 0;
        let e = loop {
            match conn.read(&mut buf[got..]) {
                Ok(0) => panic!("the stream ended after {got} bytes, no error"),
                Ok(n) => got += n,
                Err(e) => break e,
            }
        };
        assert!(got < 200 << 10, "{got} bytes read, past the damaged one");
        assert!(
            buf[..got].iter().all(|&b| b == 7),
            "a damaged byte was handed on"
        );
        let text = e.to_string();
        assert!(
            text.starts_with("TLS with the source at ") && text.contains("decrypt"),
            "kernel TLS {kernel}: {text}"
        );
        writer.join().unwrap();
    }
}

/// A relay to `to` that forwards both ways until frozen, then forwards nothing and keeps its
/// sockets open: a link cut without a word (no FIN, no RST), as a dead host or a partition.
fn freezing_relay(to: u16) -> (u16, Arc<std::sync::atomic::AtomicBool>) {
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicBool, Ordering};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let frozen = Arc::new(AtomicBool::new(false));
    let f = frozen.clone();
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(client) = client else { return };
            let server = std::net::TcpStream::connect(("127.0.0.1", to)).unwrap();
            for (mut from, mut into) in [
                (client.try_clone().unwrap(), server.try_clone().unwrap()),
                (server, client),
            ] {
                let f = f.clone();
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 64 << 10];
                    loop {
                        if f.load(Ordering::SeqCst) {
                            // Hold the sockets, say nothing.
                            std::thread::sleep(Duration::from_secs(60));
                            return;
                        }
                        let n = match from.read(&mut buf) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        if !f.load(Ordering::SeqCst) {
                            // A failed write is the peer gone: the next read ends the loop.
                            let _ = into.write_all(&buf[..n]);
                        }
                    }
                });
            }
        }
    });
    (port, frozen)
}

/// A two-connection pre-copy whose link goes silent after its first round: both sides fail
/// within their idle timeout, each naming the wait and the peer, and the source keeps its VM.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn a_link_cut_silently_fails_both_sides_within_the_idle_timeout() {
    use std::sync::atomic::Ordering;
    let timeouts = transport::Timeouts {
        handshake: Duration::from_secs(2),
        idle: Duration::from_secs(1),
    };
    let dir = TempDir::new("migrate-silent-cut");
    let listener = listen(&dir, &Endpoint::Tcp("127.0.0.1:0".into()), Some(timeouts));
    let (relay, frozen) = freezing_relay(listener.port().unwrap());
    let l = listener.clone();
    let dest = std::thread::spawn(move || {
        let e = migrate::receive(l, &ReceiveOptions::default()).expect_err("the link went silent");
        (chain(&e), std::time::Instant::now())
    });
    let mut vm = source_vm(Backend::Anon);
    let running = start(&mut vm);
    let links = Links::connect_with(
        &Endpoint::Tcp(format!("127.0.0.1:{relay}")),
        &Credentials::load(&dir.0, Role::Source).unwrap(),
        Mode::Precopy,
        2,
        timeouts,
    )
    .unwrap();
    let froze = Arc::new(Mutex::new(None));
    let (f, at) = (frozen.clone(), froze.clone());
    let opts = SendOptions {
        // Small rounds, and many: the guest keeps dirtying its memory.
        downtime: Duration::from_micros(1),
        auto_converge: false,
        // After the first round: its last record says the downtime it expects.
        events: Some(Sink::new(move |p: &Event| {
            if p.status == Status::Precopy
                && p.expected_downtime_ms.is_some()
                && !f.swap(true, Ordering::SeqCst)
            {
                *at.lock().unwrap() = Some(std::time::Instant::now());
            }
        })),
        ..Default::default()
    };
    let failure = migrate::send(running, links, &opts).expect_err("the link went silent");
    let froze = froze.lock().unwrap().expect("the link froze");
    let source_took = froze.elapsed();
    let e = guestmem_migration::error_chain(&failure.error, ": ");
    assert!(
        e.contains("the destination at tcp:127.0.0.1:") && e.contains("idle timeout"),
        "{e}"
    );
    runs_on(failure.vm.expect("the source keeps its VM"));
    let (dest_error, dest_ended) = dest.join().unwrap();
    assert!(
        dest_error.contains("the source at 127.0.0.1:") && dest_error.contains("idle timeout"),
        "{dest_error}"
    );
    assert!(
        source_took < Duration::from_secs(5),
        "the source waited {source_took:?}"
    );
    assert!(
        dest_ended.duration_since(froze) < Duration::from_secs(5),
        "the destination waited {:?}",
        dest_ended.duration_since(froze)
    );
}

/// A post-copy destination that has every page but says Complete only seconds later (it is
/// quiet): its heartbeats keep the link alive through the source's idle timeout, several
/// times over; nothing breaks.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn a_quiet_postcopy_destination_keeps_its_link_alive_with_heartbeats() {
    let timeouts = transport::Timeouts {
        handshake: Duration::from_secs(2),
        idle: Duration::from_secs(1),
    };
    let dir = TempDir::new("migrate-heartbeat");
    let listener = listen(&dir, &Endpoint::Unix(dir.0.join("sock")), Some(timeouts));
    let l = listener.clone();
    let dest = std::thread::spawn(move || {
        let migrate::Incoming {
            mut vm,
            mut transfer,
        } = migrate::receive(l, &ReceiveOptions::default()).unwrap();
        let running = transfer.resume(&mut vm).unwrap();
        while transfer.missing_bytes() > 0 {
            std::thread::sleep(Duration::from_millis(10));
        }
        // Every page is here; the Complete waits three idle timeouts.
        std::thread::sleep(3 * timeouts.idle);
        running.stop();
        running.wait(Duration::from_secs(30)).unwrap();
        transfer.finish().unwrap()
    });
    let mut vm = source_vm(Backend::Anon);
    let running = start(&mut vm);
    let links = Links::connect_with(
        &Endpoint::Unix(dir.0.join("sock")),
        &Credentials::load(&dir.0, Role::Source).unwrap(),
        Mode::Postcopy,
        1,
        timeouts,
    )
    .unwrap();
    let opts = SendOptions {
        mode: Mode::Postcopy,
        ..Default::default()
    };
    let report = migrate::send(running, links, &opts).unwrap_or_else(|f| panic!("{f:?}"));
    let received = dest.join().unwrap();
    assert_eq!(report.link_breaks, 0, "{report:?}");
    assert_eq!(received.link_breaks, 0);
    assert!(report.postcopy_requests > 0);
}

/// Post-copy over a link that goes silent (no FIN, no RST: a dead host, a partition): the
/// source misses the destination's heartbeats and reports the broken link within its idle
/// timeout (here without a way to reconnect: it gives up, saying what it holds); the
/// destination gives up after its resume timeout.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn a_silent_postcopy_link_is_noticed_within_the_idle_timeout() {
    use std::sync::atomic::Ordering;
    let timeouts = transport::Timeouts {
        handshake: Duration::from_secs(2),
        idle: Duration::from_secs(1),
    };
    let dir = TempDir::new("migrate-silent-postcopy");
    let listener = listen(&dir, &Endpoint::Tcp("127.0.0.1:0".into()), Some(timeouts));
    let (relay, frozen) = freezing_relay(listener.port().unwrap());
    let l = listener.clone();
    let dest = std::thread::spawn(move || {
        let opts = ReceiveOptions {
            resume_timeout: Duration::from_secs(2),
            ..Default::default()
        };
        let migrate::Incoming {
            mut vm,
            mut transfer,
        } = migrate::receive(l, &opts).unwrap();
        let running = transfer.resume(&mut vm).unwrap();
        let finished = transfer.finish();
        running.stop();
        let _ = running.wait(Duration::from_secs(30));
        finished.map(|_| ()).map_err(|e| e.to_string())
    });
    let mut vm = source_vm(Backend::Anon);
    let running = start(&mut vm);
    let links = Links::connect_with(
        &Endpoint::Tcp(format!("127.0.0.1:{relay}")),
        &Credentials::load(&dir.0, Role::Source).unwrap(),
        Mode::Postcopy,
        1,
        timeouts,
    )
    .unwrap();
    let froze = Arc::new(Mutex::new(None));
    let (f, at) = (frozen.clone(), froze.clone());
    let opts = SendOptions {
        mode: Mode::Postcopy,
        // The moment post-copy starts, the link goes silent.
        events: Some(Sink::new(move |p: &Event| {
            if p.status == Status::Postcopy && !f.swap(true, Ordering::SeqCst) {
                *at.lock().unwrap() = Some(std::time::Instant::now());
            }
        })),
        ..Default::default()
    };
    let failure = migrate::send(running, links, &opts).expect_err("the link went silent");
    let took = froze.lock().unwrap().expect("the link froze").elapsed();
    let e = failure.error.to_string();
    assert!(
        e.contains("the post-copy link broke")
            && e.contains("idle timeout")
            && e.contains("holds every page not fetched and the VM state at the switch-over"),
        "{e}"
    );
    assert!(took < Duration::from_secs(5), "noticed after {took:?}");
    assert!(failure.vm.is_none(), "after Go the source VM is not ours");
    let dest_error = dest
        .join()
        .unwrap()
        .expect_err("the source never came back");
    assert!(dest_error.contains("post-copy"), "{dest_error}");
}
