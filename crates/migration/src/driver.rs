//! The driver: snapshot, restore (full, map, lazy) and live migration (pre-copy, post-copy,
//! hybrid) of a VM with its [`Components`], in the order each step needs.
//!
//! - [`snapshot()`]: pauses the vCPUs, then the components; writes the memory, the machine's
//!   state and the components' states. Both stay paused ([`Machine::resume`] and
//!   [`Components::resume`] let them go on).
//! - [`restore`]: builds the VM from a snapshot with a [`MachineBuilder`] (memory copied,
//!   mapped or paged in lazily), hands it its machine state and each component its state.
//!   Nothing runs until [`resume`]. [`restore_into`] does the same into a VM built ahead of
//!   time ([`PreparedVm`]).
//! - [`send`] (the source of a live migration, [`crate::migrate::send_machine`]): the
//!   components' writes are tracked with the guest's during the rounds; at switch-over they are
//!   paused with the vCPUs, before the last harvest, and their states travel with the VM's.
//! - [`receive`]: the destination's VM, built by a [`MachineBuilder`] from the configuration the
//!   source sends, up to the switch-over, its components given their states;
//!   [`resume_incoming`] runs both and tells the source.
//!
//! In post-copy and lazy restore a component may touch guest memory that has not arrived yet:
//! its access faults like a vCPU's and the pager fetches the page first (so nothing it writes
//! is overwritten by an older copy).

use std::path::Path;
use std::sync::Arc;

use guestmem_paging::{Pager, PagerConfig};
use guestmem_vm::Vm;

use crate::component::{Components, Machine};
use crate::migrate::{Incoming, ReceiveOptions, Transfer};
use crate::snapshot::{self, PreparedVm, RestoreMode, RestoreTarget, Snapshot, WriteReport};
use crate::transport::Listener;
use crate::Result;
use guestmem_contract::{MachineBuilder, TargetMachine};

pub use crate::migrate::{send_machine as send, MachineFailure};

/// Writes a snapshot of `machine` and its `components` into `dir` (see [`snapshot::write`]):
/// the vCPUs are paused, then the components, whose states are saved beside the machine's
/// ([`Machine::save`]). Both stay paused.
pub fn snapshot<M: Machine + ?Sized>(
    machine: &mut M,
    components: &mut Components<'_>,
    dir: &Path,
) -> Result<WriteReport> {
    machine.pause()?;
    components.pause()?;
    let states = components.save()?;
    Ok(snapshot::write_machine(machine, dir, &states)?)
}

/// How [`restore`] brings the memory back.
#[derive(Debug, Clone)]
pub enum Restore {
    /// Copied in before anything runs ([`RestoreMode::Full`]).
    Full,
    /// Mapped copy-on-write ([`RestoreMode::Map`]).
    Map,
    /// Paged in on first access and in the background ([`RestoreMode::Lazy`]).
    Lazy(PagerConfig),
}

/// A VM restored by [`restore`], not running yet. The pagers (lazy restore) are dropped
/// before the VM, as the field order says.
#[derive(Debug)]
pub struct Restored<M = Vm> {
    /// Lazy restore: the pagers bringing the memory in (keep them while the VM runs).
    pub pagers: Vec<Pager>,
    /// The VM, its memory and vCPU state in place.
    pub vm: M,
}

/// Restores `snapshot` ([`Restore`] says how) into the VM `builder` builds for its
/// configuration (guestmem's own with [`guestmem_contract::VmBuilder`]), hands it the machine
/// state ([`TargetMachine::restore`]) and each of `components` its saved state (by name; a
/// state without its component, or the reverse, is refused before anything runs).
pub fn restore<B: MachineBuilder>(
    snapshot: &Snapshot,
    how: Restore,
    builder: &mut B,
    components: &mut Components<'_>,
) -> Result<Restored<B::Machine>> {
    let restored = restore_as(snapshot, builder, how)?;
    components.restore(snapshot.components())?;
    Ok(restored)
}

/// [`restore`] into `prepared`, guestmem's VM built ahead of time for the snapshot's
/// configuration (a warm pool, see [`PreparedVm`]): a snapshot of another configuration is
/// refused naming what differs, before anything is restored or runs.
pub fn restore_into(
    prepared: PreparedVm,
    snapshot: &Snapshot,
    how: Restore,
    components: &mut Components<'_>,
) -> Result<Restored> {
    let restored = restore_as(snapshot, prepared, how)?;
    components.restore(snapshot.components())?;
    Ok(restored)
}

/// `snapshot` restored into the VM `into` gives, as `how` says (the snapshot crate's engine).
fn restore_as<T: RestoreTarget>(
    snapshot: &Snapshot,
    into: T,
    how: Restore,
) -> Result<Restored<T::Machine>> {
    let mode = match how {
        Restore::Full => RestoreMode::Full,
        Restore::Map => RestoreMode::Map,
        Restore::Lazy(config) => RestoreMode::Lazy(config),
    };
    let restored = snapshot::restore(snapshot, into, mode)?;
    Ok(Restored {
        pagers: restored.pagers,
        vm: restored.vm,
    })
}

/// Lets a restored (or paused) VM's vCPUs go on, then its components.
pub fn resume<'v, M: TargetMachine>(
    vm: &'v mut M,
    components: &mut Components<'_>,
) -> Result<M::Running<'v>> {
    let running = vm.resume()?;
    components.resume()?;
    Ok(running)
}

/// Accepts one migration on `listener` and receives it up to the switch-over into the VM
/// `builder` builds from the configuration the source sends ([`crate::migrate::receive_into`]):
/// each of `components` is handed the state its namesake had on the source before the
/// destination says Ready, so that a state refused (or missing, or of an unknown component)
/// refuses the migration and the source keeps the guest.
pub fn receive<B: MachineBuilder>(
    listener: Arc<Listener>,
    opts: &ReceiveOptions,
    builder: &mut B,
    components: &mut Components<'_>,
) -> Result<Incoming<B::Machine>> {
    crate::migrate::receive_into(listener, opts, builder, components)
}

/// Runs a received VM's vCPUs, tells the source (the downtime ends), then resumes the
/// components.
pub fn resume_incoming<'v, M: TargetMachine>(
    incoming_vm: &'v mut M,
    transfer: &mut Transfer,
    components: &mut Components<'_>,
) -> Result<M::Running<'v>> {
    let running = transfer.resume(incoming_vm)?;
    components.resume()?;
    Ok(running)
}
