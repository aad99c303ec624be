//! A VMM's own VM on both sides of a snapshot and of a live migration, through the driver's
//! traits: the source is a `Machine` whose saved state carries more than guestmem's VM state
//! (the VMM's own part), the receiving side a `TargetMachine` its builder makes from the
//! configuration that comes. The snapshot and the migration carry the machine's state as an
//! opaque blob, and hand it back byte for byte; a builder's refusal refuses the migration, and
//! the source runs on.

mod common;

use guestmem_sys::to_usize;
use std::sync::Arc;

use common::{assert_pages_consistent, dirty_work, wait_for_generation, TempDir};
use guestmem_contract::component::{Components, Machine};
use guestmem_contract::VmBuilder;
use guestmem_contract::{Error, Result};
use guestmem_contract::{MachineBuilder, PayloadVm, SharedFiles, TargetMachine};
use guestmem_memory::{Backend, GuestMemory};
use guestmem_migration::driver::{self, Restore};
use guestmem_migration::migrate::{Links, Mode, ReceiveOptions, SendOptions};
use guestmem_migration::transport::{generate_credentials, Credentials, Endpoint, Listener, Role};
use guestmem_paging::PagerConfig;
use guestmem_snapshot::{self as snapshot, RestoreMode, Snapshot};
use guestmem_tracking::Tracker;
use guestmem_vm::{AbortHandle, RunningVm, Vm, VmConfig};

const SIZE: u64 = 8 << 20;
/// The VMM's own part of its VM state (an interrupt controller's, say).
const VMM_PART: &[u8] = b"\x00irqchip\xffstate";

/// The source: guestmem's VM plus the VMM's part, saved as `[payload length][payload][part]`.
struct SourceVm<'a>(PayloadVm<'a>);

impl Machine for SourceVm<'_> {
    fn memory(&self) -> &Arc<GuestMemory> {
        self.0.memory()
    }
    fn config(&self) -> &VmConfig {
        self.0.config()
    }
    fn start_tracking(&self, mode: guestmem_tracking::Mode) -> Result<Tracker> {
        self.0.start_tracking(mode)
    }
    fn pause(&mut self) -> Result<()> {
        self.0.pause()
    }
    fn resume(&mut self) -> Result<()> {
        self.0.resume()
    }
    fn set_throttle(&mut self, percent: u64) -> Result<()> {
        self.0.set_throttle(percent)
    }
    fn throttle(&self) -> u64 {
        self.0.throttle()
    }
    fn save(&mut self) -> Result<Vec<u8>> {
        let payload = self.0.save()?;
        let mut blob = (payload.len() as u64).to_le_bytes().to_vec();
        blob.extend(payload);
        blob.extend(VMM_PART);
        Ok(blob)
    }
}

/// The restoring side: the VMM's VM, built by its builder, which takes the blob apart.
struct TargetVm {
    vm: Vm,
    part: Option<Vec<u8>>,
}

impl TargetMachine for TargetVm {
    type Running<'a> = RunningVm<'a>;

    fn memory(&self) -> &Arc<GuestMemory> {
        self.vm.memory()
    }
    fn vcpu_count(&self) -> usize {
        self.vm.vcpu_count()
    }
    fn restore(&mut self, state: &[u8]) -> Result<()> {
        let bad = |why: &str| Error::Machine {
            op: "restore",
            source: why.to_string().into(),
        };
        let len = to_usize(u64::from_le_bytes(
            state
                .get(..8)
                .ok_or_else(|| bad("no length"))?
                .try_into()
                .expect("8 bytes"),
        ));
        let payload = state.get(8..8 + len).ok_or_else(|| bad("short payload"))?;
        TargetMachine::restore(&mut self.vm, payload)?;
        self.part = Some(state[8 + len..].to_vec());
        Ok(())
    }
    fn resume(&mut self) -> Result<RunningVm<'_>> {
        Ok(self.vm.resume()?)
    }
    fn abort_handle(&self) -> Option<AbortHandle> {
        Some(self.vm.abort_handle())
    }
}

fn builder() -> impl MachineBuilder<Machine = TargetVm> {
    |config: &VmConfig, shared: SharedFiles| -> Result<TargetVm> {
        Ok(TargetVm {
            vm: Vm::new_on(config, shared)?,
            part: None,
        })
    }
}

/// A running VM snapshotted through the driver as the VMM's machine; the pages done per vCPU
/// at the snapshot.
fn snapshot(config: &VmConfig, dir: &TempDir) -> Vec<u64> {
    let mut vm = Vm::new(config).unwrap();
    let running = vm.start(&dirty_work(2, SIZE)).unwrap();
    wait_for_generation(&running, 2);
    let mut machine = SourceVm(PayloadVm::running(running));
    // Saving a running machine is refused: the driver pauses it first.
    assert!(matches!(machine.save(), Err(Error::MachineRunning)));
    let report = driver::snapshot(&mut machine, &mut Components::none(), &dir.0).unwrap();
    assert_eq!(report.memory_bytes, machine.memory().size());
    drop(machine);
    vm.pages_done()
}

#[test]
#[cfg_attr(
    any(not(kvm), not(uffd)),
    ignore = "no usable /dev/kvm or /dev/userfaultfd"
)]
fn a_vmm_machine_state_comes_back_byte_for_byte_and_the_guest_goes_on() {
    let config = VmConfig::simple(2, SIZE, Backend::Memfd);
    let dir = TempDir::new("vmm-machine");
    let at_snapshot = snapshot(&config, &dir);
    let snap = Snapshot::open(&dir.0).unwrap();
    assert_eq!(
        &snap.machine_state()[snap.machine_state().len() - VMM_PART.len()..],
        VMM_PART
    );
    let work = dirty_work(2, SIZE);
    for how in [
        Restore::Full,
        Restore::Map,
        Restore::Lazy(PagerConfig::default()),
    ] {
        let mut restored =
            driver::restore(&snap, how.clone(), &mut builder(), &mut Components::none()).unwrap();
        assert_eq!(restored.vm.part.as_deref(), Some(VMM_PART), "{how:?}");
        let running = driver::resume(&mut restored.vm, &mut Components::none()).unwrap();
        let after = goes_on(running, &at_snapshot, &work, &format!("{how:?}"));
        assert_pages_consistent(&restored.vm.vm, &work, &after);
    }
}

/// Lets the restored guest run two passes past where it was at the snapshot, stops it, and
/// checks every vCPU counted on from there; the pages done per vCPU at the stop.
fn goes_on(
    running: RunningVm<'_>,
    at_snapshot: &[u64],
    work: &[guestmem_vm::VcpuWork],
    what: &str,
) -> Vec<u64> {
    wait_for_generation(
        &running,
        at_snapshot.iter().max().unwrap() / work[0].pages() + 2,
    );
    running.stop();
    let report = running.wait(std::time::Duration::from_secs(30)).unwrap();
    let after: Vec<u64> = report.vcpus.iter().map(|v| v.pages).collect();
    for (b, a) in at_snapshot.iter().zip(&after) {
        assert!(a > b, "{what}: the guest went on counting: {b} -> {a}");
    }
    after
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn a_builder_that_refuses_and_a_state_that_does_not_load_fail_the_restore() {
    let config = VmConfig::simple(2, SIZE, Backend::Anon);
    let dir = TempDir::new("vmm-refusals");
    snapshot(&config, &dir);
    let snap = Snapshot::open(&dir.0).unwrap();

    let mut refuse = |config: &VmConfig, _: SharedFiles| -> Result<TargetVm> {
        Err(Error::Machine {
            op: "build",
            source: format!("{} vCPUs do not fit here", config.vcpus).into(),
        })
    };
    let e = snapshot::restore(&snap, &mut refuse, RestoreMode::Full)
        .map(|r| r.vm)
        .err()
        .expect("refused");
    assert_eq!(
        guestmem_migration::error_chain(&e, ": "),
        "the VM: build failed: 2 vCPUs do not fit here"
    );

    // guestmem's own VM cannot read the VMM's blob: refused before anything runs.
    let e = snapshot::restore(&snap, &mut VmBuilder, RestoreMode::Full)
        .map(|r| r.vm)
        .expect_err("refused");
    assert!(
        matches!(
            e,
            guestmem_snapshot::Error::Contract(Error::Machine {
                op: "read the saved state",
                ..
            })
        ),
        "{e:?}"
    );
}

/// A destination listening on a Unix socket in `dir`, and the source's links to it.
fn listen(dir: &TempDir) -> (Arc<Listener>, impl Fn(Mode) -> Links) {
    generate_credentials(&dir.0).unwrap();
    let endpoint = Endpoint::Unix(dir.0.join("sock"));
    let listener = Listener::bind(
        &endpoint,
        &Credentials::load(&dir.0, Role::Destination).unwrap(),
    )
    .unwrap();
    let creds = Credentials::load(&dir.0, Role::Source).unwrap();
    let connect = move |mode| Links::connect(&endpoint, &creds, mode, 2).unwrap();
    (Arc::new(listener), connect)
}

#[test]
#[cfg_attr(
    any(not(kvm), not(uffd)),
    ignore = "no usable /dev/kvm or /dev/userfaultfd"
)]
fn a_vmm_machine_migrates_into_the_vm_its_builder_makes() {
    let config = VmConfig::simple(2, SIZE, Backend::Memfd);
    let work = dirty_work(2, SIZE);
    for mode in [Mode::Precopy, Mode::Postcopy] {
        let dir = TempDir::new(&format!("vmm-migrate-{mode}"));
        let (listener, connect) = listen(&dir);
        // Pages of one pass of a vCPU's workload.
        let pass = work[0].pages();
        let destination = std::thread::spawn(move || {
            let mut built = None;
            let mut build = |config: &VmConfig, shared: SharedFiles| -> Result<TargetVm> {
                built = Some(config.clone());
                builder().build(config, shared)
            };
            let mut incoming = driver::receive(
                listener,
                &ReceiveOptions::default(),
                &mut build,
                &mut Components::none(),
            )
            .unwrap();
            // Built from the source's configuration, handed the source's blob whole.
            let part = incoming.vm.part.clone();
            let at_switchover = incoming.vm.vm.pages_done();
            let running = driver::resume_incoming(
                &mut incoming.vm,
                &mut incoming.transfer,
                &mut Components::none(),
            )
            .unwrap();
            wait_for_generation(&running, at_switchover.iter().max().unwrap() / pass + 2);
            running.stop();
            let report = running.wait(std::time::Duration::from_secs(30)).unwrap();
            incoming.transfer.finish().unwrap();
            let after: Vec<u64> = report.vcpus.iter().map(|v| v.pages).collect();
            (built, part, at_switchover, after, incoming.vm.vm)
        });

        let mut vm = Vm::new(&config).unwrap();
        let running = vm.start(&work).unwrap();
        wait_for_generation(&running, 1);
        let mut machine = SourceVm(PayloadVm::running(running));
        let opts = SendOptions {
            mode,
            verify: mode == Mode::Precopy,
            ..Default::default()
        };
        let sent = driver::send(&mut machine, &mut Components::none(), connect(mode), &opts);
        let report = sent.unwrap_or_else(|f| panic!("{mode}: {}", f.error));
        assert!(report.downtime_ms > 0.0, "{mode}");
        drop(machine);
        let source_at_switchover = vm.pages_done();

        let (built, part, at_switchover, after, dest_vm) = destination.join().unwrap();
        assert_eq!(built.as_ref(), Some(&config), "{mode}");
        assert_eq!(part.as_deref(), Some(VMM_PART), "{mode}");
        assert_eq!(at_switchover, source_at_switchover, "{mode}");
        for (b, a) in at_switchover.iter().zip(&after) {
            assert!(a > b, "{mode}: the guest went on counting: {b} -> {a}");
        }
        assert_pages_consistent(&dest_vm, &work, &after);
    }
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn a_builder_that_refuses_the_vm_refuses_the_migration_and_the_source_runs_on() {
    let dir = TempDir::new("vmm-migrate-refused");
    let (listener, connect) = listen(&dir);
    let destination = std::thread::spawn(move || {
        let mut refuse = |config: &VmConfig, _: SharedFiles| -> Result<TargetVm> {
            Err(Error::Machine {
                op: "build",
                source: format!("{} vCPUs do not fit here", config.vcpus).into(),
            })
        };
        let refused = driver::receive(
            listener,
            &ReceiveOptions::default(),
            &mut refuse,
            &mut Components::none(),
        );
        guestmem_migration::error_chain(&refused.err().expect("refused"), ": ")
    });
    let mut vm = Vm::new(&VmConfig::simple(2, SIZE, Backend::Anon)).unwrap();
    let running = vm.start(&dirty_work(2, SIZE)).unwrap();
    wait_for_generation(&running, 1);
    let mut machine = SourceVm(PayloadVm::running(running));
    let failure = driver::send(
        &mut machine,
        &mut Components::none(),
        connect(Mode::Precopy),
        &SendOptions::default(),
    )
    .expect_err("refused");
    let there = destination.join().unwrap();
    assert!(
        there.contains("the VM: build failed: 2 vCPUs do not fit here"),
        "{there}"
    );
    // The source is told why, and keeps its guest running.
    assert!(failure.kept, "{}", failure.error);
    let here = guestmem_migration::error_chain(&failure.error, ": ");
    assert!(here.contains("2 vCPUs do not fit here"), "{here}");
    let running = machine.0.into_running().expect("still running");
    let before = running.progress();
    wait_for_generation(&running, before.iter().map(|p| p.1).max().unwrap() + 1);
    running.stop();
    running.wait(std::time::Duration::from_secs(30)).unwrap();
}

/// The same VMM machine into a chunk store (a local one): written through `write_machine`
/// (paused, its state the VMM's blob), restored full and lazily into the VM the builder
/// makes, the blob handed back byte for byte, and the guest going on from where it was.
#[test]
#[cfg_attr(
    any(not(kvm), not(uffd)),
    ignore = "no usable /dev/kvm or /dev/userfaultfd"
)]
fn a_vmm_machine_goes_through_a_chunk_store() {
    use guestmem_store::local::LocalObjectStore;
    use guestmem_store::restore::StoreSnapshot;
    let config = VmConfig::simple(2, SIZE, Backend::Anon);
    let dir = TempDir::new("vmm-store");
    let objects: Arc<dyn guestmem_store::ObjectStore> =
        Arc::new(LocalObjectStore::new(&dir.0.join("store")));
    let mut vm = Vm::new(&config).unwrap();
    let running = vm.start(&dirty_work(2, SIZE)).unwrap();
    wait_for_generation(&running, 2);
    let mut machine = SourceVm(PayloadVm::running(running));
    machine.pause().unwrap();
    let state = guestmem_contract::component::ComponentState {
        name: "dev0".into(),
        data: vec![1, 2, 3],
    };
    guestmem_store::write::write_machine(
        &*objects,
        "vmm",
        &mut machine,
        std::slice::from_ref(&state),
        None,
    )
    .unwrap();
    drop(machine);
    let at_snapshot = vm.pages_done();
    drop(vm);

    let work = dirty_work(2, SIZE);
    for lazy in [false, true] {
        let snap = StoreSnapshot::open(objects.clone(), "vmm", None).unwrap();
        assert_eq!(snap.components, std::slice::from_ref(&state));
        let (pagers, mut restored) = if lazy {
            let l = snapshot::restore(
                &snap,
                &mut builder(),
                RestoreMode::Lazy(PagerConfig::default()),
            )
            .unwrap();
            (l.pagers, l.vm)
        } else {
            (
                Vec::new(),
                snapshot::restore(&snap, &mut builder(), RestoreMode::Full)
                    .map(|r| r.vm)
                    .unwrap(),
            )
        };
        assert_eq!(restored.part.as_deref(), Some(VMM_PART), "lazy {lazy}");
        let running = restored.resume().unwrap();
        let after = goes_on(running, &at_snapshot, &work, &format!("lazy {lazy}"));
        assert_pages_consistent(&restored.vm, &work, &after);
        drop(pagers);
    }
}
