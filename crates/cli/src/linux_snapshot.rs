//! `guestmem snapshot --kernel ...` and `guestmem restore` of a Linux guest's snapshot: the
//! guest booted, run, paused and written through the snapshot engine as any machine is (its
//! state the [`LinuxState`](guestmem_vm::linux::LinuxState) blob, its console the component
//! "serial"); restored full, mapped or lazily into a new Linux VM whose console streams to
//! stdout, so that one sees the guest go on.

use std::path::Path;
use std::time::{Duration, Instant};

use guestmem_contract::component::Components;
use guestmem_contract::{LinuxBuilder, LinuxMachine, SerialComponent};
use guestmem_snapshot::{self as snapshot, RestoreMode, Snapshot};
use guestmem_vm::linux::{linux_config, BootPlan, LinuxVm};

use crate::linux::{console_to, first_line_secs, LinuxArgs};
use crate::vm_args::VmArgs;

/// How long a Linux guest may take to print its first console line before `snapshot` gives up.
const FIRST_LINE_LIMIT: Duration = Duration::from_secs(600);

/// Boots the guest, lets it run `after` from its first console line, pauses it and writes the
/// snapshot into `out`.
pub fn snapshot(
    vm: &VmArgs,
    linux: &LinuxArgs,
    plan: BootPlan,
    after: Duration,
    out: &Path,
) -> crate::Result<()> {
    let (console, first_line) = linux.console()?;
    let mut machine = LinuxVm::new(&linux_config(vm.vcpus, vm.memory, vm.backend), console)?;
    machine.boot(&plan)?;
    let running = machine.start()?;
    // `after` counts from the guest's first console line: its boot takes what it takes.
    let boot_limit = Instant::now() + FIRST_LINE_LIMIT;
    while first_line_secs(&first_line).is_none() {
        if Instant::now() >= boot_limit {
            running.pause()?;
            return Err(format!(
                "the Linux guest printed no console line in {} s; no snapshot was written",
                FIRST_LINE_LIMIT.as_secs()
            )
            .into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(after);
    let paused = running.pause()?;
    let serial = SerialComponent(paused.serial().clone());
    let states = vec![guestmem_contract::component::ComponentState {
        name: guestmem_contract::SERIAL_COMPONENT.into(),
        data: serde_json::to_vec(&serial.0.lock().map_err(|_| "serial lock")?.state())?,
    }];
    let t = Instant::now();
    let report = snapshot::write_machine(&mut LinuxMachine::paused(paused), out, &states)?;
    if let Some(first) = first_line_secs(&first_line) {
        eprintln!("guestmem: first console line after {first:.2} s");
    }
    eprintln!(
        "guestmem: snapshot of the Linux guest ({} MiB on {}) after {:.1} s written to {} in \
         {:.1} ms: {} MiB of data, {} of {} chunks zero",
        vm.memory >> 20,
        vm.backend,
        after.as_secs_f64(),
        out.display(),
        t.elapsed().as_secs_f64() * 1e3,
        report.data_bytes >> 20,
        report.zero_chunks,
        report.chunks
    );
    Ok(())
}

/// Restores a Linux guest's snapshot as `mode` says, its console to stdout (or `console`),
/// runs it `run_for` and says how long the restore took and when its first console line came.
pub fn restore(
    snap: &Snapshot,
    mode: RestoreMode,
    console: Option<&Path>,
    run_for: Duration,
) -> crate::Result<()> {
    let t = Instant::now();
    let mut first = None;
    let mut builder = LinuxBuilder(|| match console_to(console, None) {
        Ok((out, line)) => {
            first = Some(line);
            out
        }
        Err(e) => {
            eprintln!("guestmem: {e}; the console goes to stdout");
            Box::new(std::io::stdout())
        }
    });
    let lazy = matches!(mode, RestoreMode::Lazy(_));
    let restored = snapshot::restore(snap, &mut builder, mode)?;
    let snapshot::Restored {
        pagers,
        userfault_pagers,
        mut vm,
        peer,
        ..
    } = restored;
    let mut serial = SerialComponent(vm.serial().clone());
    Components::new(vec![&mut serial])?.restore(snap.components())?;
    let restore_ms = t.elapsed().as_secs_f64() * 1e3;
    let end = vm.start()?.wait(run_for)?;
    if lazy {
        for pager in &pagers {
            if !pager.wait_resident(Duration::from_secs(300))? {
                return Err("the lazily restored memory did not become resident in 300 s".into());
            }
        }
    }
    drop(pagers);
    drop(userfault_pagers);
    drop(peer);
    eprintln!("guestmem: restored the Linux guest in {restore_ms:.1} ms");
    if let Some(secs) = first.as_ref().and_then(first_line_secs) {
        eprintln!("guestmem: first console line after the restore began: {secs:.2} s");
    }
    eprintln!("guestmem: the restored guest ran until {end:?}");
    Ok(())
}
