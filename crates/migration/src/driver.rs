//! The driver: snapshot, restore (full, map, lazy) and live migration (pre-copy, post-copy,
//! hybrid) of a VM with its [`Components`], in the order each step needs.
//!
//! - [`snapshot()`]: pauses the vCPUs, then the components; writes the memory, the VM's state and
//!   the components' states. Both stay paused ([`resume`] lets them go on).
//! - [`restore`]: builds the VM from a snapshot (memory copied, mapped or paged in lazily), puts
//!   its vCPU state back and hands each component its state. Nothing runs until [`resume`].
//!   [`restore_into`] does the same into a VM built ahead of time ([`PreparedVm`]).
//! - [`send`] (the source of a live migration, [`crate::migrate::send_machine`]): the
//!   components' writes are tracked with the guest's during the rounds; at switch-over they are
//!   paused with the vCPUs, before the last harvest, and their states travel with the VM's.
//! - [`receive`]: the destination's VM up to the switch-over, its components given their
//!   states; [`resume_incoming`] runs both and tells the source.
//!
//! In post-copy and lazy restore a component may touch guest memory that has not arrived yet:
//! its access faults like a vCPU's and the pager fetches the page first (so nothing it writes
//! is overwritten by an older copy).

use std::path::Path;

use guestmem_paging::{Pager, PagerConfig};
use guestmem_vm::{RunningVm, Vm};

use crate::component::{Components, PayloadVm};
use crate::snapshot::{self, PreparedVm, RestoreMode, Snapshot, WriteReport};
use crate::{Error, Result};

pub use crate::migrate::{send_machine as send, MachineFailure};

/// Writes a snapshot of `vm` and its `components` into `dir` (see [`snapshot::write`]): the
/// vCPUs are paused, then the components, whose states are saved beside the VM's. Both stay
/// paused.
pub fn snapshot(
    vm: &mut PayloadVm<'_>,
    components: &mut Components<'_>,
    dir: &Path,
) -> Result<WriteReport> {
    use crate::component::Machine;
    vm.pause()?;
    components.pause()?;
    let states = components.save()?;
    let paused = vm.as_paused().ok_or(Error::MachineLost)?;
    snapshot::write_with_components(paused, dir, &states)
}

/// How [`restore`] brings the memory back.
#[derive(Debug, Clone)]
pub enum Restore {
    /// Copied in before anything runs ([`RestoreMode::Full`]).
    Full,
    /// Mapped copy-on-write ([`RestoreMode::Map`]).
    Map,
    /// Paged in on first access and in the background ([`snapshot::restore_lazy`]).
    Lazy(PagerConfig),
}

/// A VM restored by [`restore`], not running yet. The pagers (lazy restore) are dropped
/// before the VM, as the field order says.
pub struct Restored {
    /// Lazy restore: the pagers bringing the memory in (keep them while the VM runs).
    pub pagers: Vec<Pager>,
    /// The VM, its memory and vCPU state in place.
    pub vm: Vm,
}

/// Restores `snapshot` ([`Restore`] says how) and hands each of `components` its saved state
/// (by name; a state without its component, or the reverse, is refused before anything runs).
pub fn restore(
    snapshot: &Snapshot,
    how: Restore,
    components: &mut Components<'_>,
) -> Result<Restored> {
    let restored = match how {
        Restore::Full => Restored {
            pagers: Vec::new(),
            vm: snapshot::restore(snapshot, RestoreMode::Full)?,
        },
        Restore::Map => Restored {
            pagers: Vec::new(),
            vm: snapshot::restore(snapshot, RestoreMode::Map)?,
        },
        Restore::Lazy(config) => {
            let lazy = snapshot::restore_lazy(snapshot, &config)?;
            Restored {
                pagers: lazy.pagers,
                vm: lazy.vm,
            }
        }
    };
    components.restore(snapshot.components())?;
    Ok(restored)
}

/// [`restore`] into `prepared`, a VM built ahead of time for the snapshot's configuration (a
/// warm pool, see [`PreparedVm`]): a snapshot of another configuration is refused naming what
/// differs, before anything is restored or runs.
pub fn restore_into(
    prepared: PreparedVm,
    snapshot: &Snapshot,
    how: Restore,
    components: &mut Components<'_>,
) -> Result<Restored> {
    let restored = match how {
        Restore::Full => Restored {
            pagers: Vec::new(),
            vm: snapshot::restore_into(prepared, snapshot, RestoreMode::Full)?,
        },
        Restore::Map => Restored {
            pagers: Vec::new(),
            vm: snapshot::restore_into(prepared, snapshot, RestoreMode::Map)?,
        },
        Restore::Lazy(config) => {
            let lazy = snapshot::restore_lazy_into(prepared, snapshot, &config)?;
            Restored {
                pagers: lazy.pagers,
                vm: lazy.vm,
            }
        }
    };
    components.restore(snapshot.components())?;
    Ok(restored)
}

/// Lets a restored (or paused) VM's vCPUs go on, then its components.
pub fn resume<'v>(vm: &'v mut Vm, components: &mut Components<'_>) -> Result<RunningVm<'v>> {
    let running = vm.resume()?;
    components.resume()?;
    Ok(running)
}

pub use crate::migrate::receive_components as receive;

/// Runs a received VM's vCPUs, tells the source (the downtime ends), then resumes the
/// components.
pub fn resume_incoming<'v>(
    incoming_vm: &'v mut Vm,
    transfer: &mut crate::migrate::Transfer,
    components: &mut Components<'_>,
) -> Result<RunningVm<'v>> {
    let running = transfer.resume(incoming_vm)?;
    components.resume()?;
    Ok(running)
}
