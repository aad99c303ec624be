//! `guestmem snapshot --kernel ...` and `guestmem restore` of a Linux guest's snapshot: the
//! guest booted, run, paused and written through the snapshot engine as any machine is (its
//! state the [`LinuxState`](guestmem_vm::linux::LinuxState) blob, its console the component
//! "serial"); restored full, mapped or lazily into a new Linux VM whose console streams to
//! stdout, so that one sees the guest go on.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use guestmem_contract::component::{ComponentState, Components};
use guestmem_contract::{LinuxBuilder, LinuxMachine, SerialComponent};
use guestmem_events::{Reporter, Status};
use guestmem_paging::{Pager, UserfaultPager};
use guestmem_snapshot::live::{write_machine_live, LiveOptions, Strategy};
use guestmem_snapshot::progress::{RestoreProgress, SnapshotProgress};
use guestmem_snapshot::{self as snapshot, RestoreMode, SnapshotImage};
use guestmem_store::location::Location;
use guestmem_vm::linux::{linux_config, BootPlan, LinuxVm};

use crate::linux::{console_or_stdout, first_line_secs, wait_first_line, LinuxArgs};
use crate::vm_args::VmArgs;

/// Whether `out` names a store snapshot (`store:DIR/NAME`, `s3://...`).
fn is_store(out: &Path) -> bool {
    out.to_str()
        .is_some_and(guestmem_store::location::is_store_url)
}

/// How `snapshot --kernel` writes: paused or live (and how), into a flat directory or a
/// store (`store:DIR/NAME`, `s3://...`).
pub struct Written<'a> {
    pub out: &'a Path,
    pub live: Option<Strategy>,
    /// The `--progress` records, told when the write starts.
    pub progress: Option<&'a SnapshotProgress>,
}

/// Boots the guest, lets it run `after` from its first console line (or the `--wait-for`
/// line), and writes the snapshot: paused, or live while the guest runs on; its progress
/// records (`how.progress`, begun) told `stopped` or `precopy` as the write starts, then
/// `completed` with the bytes written, or `failed`.
pub fn snapshot(
    vm: &VmArgs,
    linux: &LinuxArgs,
    (plan, after): (BootPlan, Duration),
    how: Written<'_>,
) -> crate::Result<()> {
    let progress = how.progress;
    let written = boot_and_write(vm, linux, (plan, after), how);
    match (progress, &written) {
        (Some(p), Ok(bytes)) => p.emit(Status::Completed, *bytes),
        (Some(p), Err(e)) => p.failed(&**e),
        _ => {}
    }
    written.map(|_| ())
}

/// [`snapshot`]'s work: the bytes it wrote (a flat snapshot's data, a store's new objects).
fn boot_and_write(
    vm: &VmArgs,
    linux: &LinuxArgs,
    (plan, after): (BootPlan, Duration),
    how: Written<'_>,
) -> crate::Result<u64> {
    let (console, first_line) = linux.console()?;
    let mut machine = LinuxVm::new(&linux_config(vm.vcpus, vm.memory, vm.backend), console)?;
    machine.boot(&plan)?;
    let running = machine.start()?;
    // `after` counts from the guest's first console line: its boot takes what it takes.
    if let Err(e) = wait_first_line(&running, &first_line, "no snapshot was written") {
        let _ = running.pause();
        return Err(e);
    }
    std::thread::sleep(after);
    let mut serial = SerialComponent(running.vm().serial().clone());
    let t = Instant::now();
    if let Some(p) = how.progress {
        p.emit(
            if how.live.is_some() {
                Status::Precopy
            } else {
                Status::Stopped
            },
            0,
        );
    }
    let (summary, bytes) = match how.live {
        Some(strategy) => {
            let mut machine = LinuxMachine::running(running);
            let progress = how.progress.map(SnapshotProgress::reporter);
            let written = write_live(&mut machine, &mut serial, how.out, (strategy, progress));
            if let Some(running) = machine.into_running() {
                running.pause()?;
            }
            written?
        }
        None => {
            let paused = running.pause()?;
            let states = Components::new(vec![&mut serial])?.save()?;
            write_paused(&mut LinuxMachine::paused(paused), &states, how.out)?
        }
    };
    if let Some(first) = first_line_secs(&first_line) {
        eprintln!("guestmem: first console line after {first:.2} s");
    }
    eprintln!(
        "guestmem: {} snapshot of the Linux guest ({} MiB on {}) after {:.1} s written to {} \
         in {:.1} ms: {summary}",
        if how.live.is_some() { "live" } else { "paused" },
        vm.memory >> 20,
        vm.backend,
        after.as_secs_f64(),
        how.out.display(),
        t.elapsed().as_secs_f64() * 1e3,
    );
    Ok(bytes)
}

/// A paused write of `machine` into `out` (flat or a store); what was written, in words, and
/// its bytes.
fn write_paused(
    machine: &mut LinuxMachine<'_>,
    states: &[ComponentState],
    out: &Path,
) -> crate::Result<(String, u64)> {
    if is_store(out) {
        let at = Location::parse(&out.to_string_lossy())?;
        let objects = at.store.open_with(crate::store_options())?;
        let report =
            guestmem_store::write::write_machine(&*objects, &at.name, machine, states, None)?;
        return Ok((
            format!("{} bytes stored", report.stored_bytes),
            report.stored_bytes,
        ));
    }
    let report = snapshot::write_machine(machine, out, states)?;
    Ok((
        format!(
            "{} MiB of data, {} of {} chunks zero",
            report.data_bytes >> 20,
            report.zero_chunks,
            report.chunks
        ),
        report.data_bytes,
    ))
}

/// A live write of the running `machine` into `out` (flat or a store); its pause and mode, in
/// words, and the bytes it wrote.
fn write_live(
    machine: &mut LinuxMachine<'_>,
    serial: &mut SerialComponent,
    out: &Path,
    (strategy, progress): (Strategy, Option<Arc<Reporter>>),
) -> crate::Result<(String, u64)> {
    let opts = LiveOptions {
        strategy,
        progress,
        ..LiveOptions::default()
    };
    let mut components = Components::new(vec![serial])?;
    let (live, bytes) = if is_store(out) {
        let at = Location::parse(&out.to_string_lossy())?;
        let objects = at.store.open_with(crate::store_options())?;
        let w = guestmem_store::live::write_machine_live(
            &*objects,
            &at.name,
            machine,
            &mut components,
            None,
            &opts,
        )?;
        (w.live, w.report.stored_bytes)
    } else {
        let w = write_machine_live(machine, &mut components, out, None, &opts)?;
        (w.live, w.report.data_bytes)
    };
    Ok((
        format!(
            "mode {}, {} rounds, pause {:.2} ms",
            live.mode,
            live.rounds.len(),
            live.pause_ms
        ),
        bytes,
    ))
}

/// Restores a Linux guest's snapshot as `mode` says, its console to stdout (or `console`),
/// runs it `run_for` and says how long the restore took and when its first console line came;
/// its `--progress` records (`progress`, begun) go on to `completed` (a lazy restore's once all
/// memory is resident) or `failed`.
pub fn restore<I: SnapshotImage>(
    snap: &I,
    mode: RestoreMode,
    (console, run_for): (Option<&Path>, Duration),
    mut progress: Option<RestoreProgress>,
) -> crate::Result<()> {
    let done = restore_and_run(snap, mode, (console, run_for), progress.as_mut());
    if let (Some(p), Err(e)) = (progress.as_mut(), &done) {
        p.failed(&**e);
    }
    done
}

/// Waits until a lazy restore's memory is all resident, whichever pagers bring it in
/// (userfaultfd, or KVM Userfault for guest_memfd), and says on stderr how each served it.
pub(crate) fn wait_resident(
    pagers: &[Pager],
    userfault_pagers: &[UserfaultPager],
) -> crate::Result<()> {
    let limit = Duration::from_secs(300);
    let not_resident = "the lazily restored memory did not become resident in 300 s";
    for pager in pagers {
        if !pager.wait_resident(limit)? {
            return Err(not_resident.into());
        }
        let s = pager.stats();
        eprintln!(
            "guestmem: userfaultfd served {} faults ({} chunks on demand, {} in the background)",
            s.faults, s.fault_chunks, s.background_chunks
        );
    }
    for pager in userfault_pagers {
        if !pager.wait_resident(limit)? {
            return Err(not_resident.into());
        }
        let s = pager.stats();
        eprintln!(
            "guestmem: KVM Userfault served {} faults ({} chunks on demand, {} in the background, installed by {})",
            s.faults,
            s.fault_chunks,
            s.background_chunks,
            pager.install_method()
        );
    }
    Ok(())
}

/// [`restore`]'s work.
fn restore_and_run<I: SnapshotImage>(
    snap: &I,
    mode: RestoreMode,
    (console, run_for): (Option<&Path>, Duration),
    mut progress: Option<&mut RestoreProgress>,
) -> crate::Result<()> {
    let t = Instant::now();
    let mut first = None;
    let mut builder = LinuxBuilder(|| console_or_stdout(console, &mut first));
    let lazy = matches!(mode, RestoreMode::Lazy(_));
    let restored = snapshot::restore(snap, &mut builder, mode)?;
    let snapshot::Restored {
        pagers,
        userfault_pagers,
        mut vm,
        peer,
        prefetched,
        ..
    } = restored;
    if let Some(p) = &mut progress {
        p.ready(&pagers, &userfault_pagers);
    }
    let mut serial = SerialComponent(vm.serial().clone());
    Components::new(vec![&mut serial])?.restore(snap.components())?;
    let restore_ms = t.elapsed().as_secs_f64() * 1e3;
    let end = vm.start()?.wait(run_for)?;
    if lazy {
        wait_resident(&pagers, &userfault_pagers)?;
    }
    let stats = crate::working_set::pager_stats(&pagers, &userfault_pagers);
    let working_set = crate::working_set::output(&stats, prefetched, || {
        Ok(snapshot::record_working_set(
            snap,
            vm.memory(),
            &pagers,
            &userfault_pagers,
        )?)
    })?;
    if let Some(p) = progress {
        p.finish();
    }
    drop(pagers);
    drop(userfault_pagers);
    drop(peer);
    eprintln!("guestmem: restored the Linux guest in {restore_ms:.1} ms");
    if let Some(secs) = first.as_ref().and_then(first_line_secs) {
        eprintln!("guestmem: first console line after the restore began: {secs:.2} s");
    }
    if let Some(ws) = working_set {
        eprintln!(
            "guestmem: working set: {} chunks {}; {} page faults served during the run",
            ws.chunks, ws.action, ws.faults
        );
    }
    eprintln!("guestmem: the restored guest ran until {end:?}");
    for line in vm.vcpu_report() {
        eprintln!("guestmem: {line}");
    }
    Ok(())
}
