//! The receiving side of a move: the VM a VMM builds to take a guest in, from a live migration's
//! source or from a snapshot.
//!
//! The source side is a [`Machine`](crate::component::Machine); the receiving side is its
//! mirror, in two traits (Cloud Hypervisor's destination builds its VM from the configuration
//! the source sends, then restores the state the source's `Snapshottable`s gave):
//!
//! - a [`MachineBuilder`] builds the VM from the [`VmConfig`] the source sends or the snapshot
//!   records (memory registered as memslots, vCPUs created, nothing run), or refuses it;
//! - the VM it builds is a [`TargetMachine`]: its guest memory is where the pages land (copied,
//!   mapped, or paged in by guestmem's pagers), [`TargetMachine::restore`] takes the opaque
//!   blob [`Machine::save`](crate::component::Machine::save) produced on the other side, and
//!   [`TargetMachine::resume`] runs it once the memory is in place.
//!
//! guestmem's own VM is one implementation ([`guestmem_vm::Vm`] is a [`TargetMachine`],
//! [`VmBuilder`](crate::VmBuilder) builds it); any closure
//! `FnMut(&VmConfig, SharedFiles) -> Result<M>` is a builder.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use guestmem_memory::GuestMemory;
use guestmem_vm::{AbortHandle, VmConfig};

use crate::Result;

/// RAM regions whose backing files the source handed over (a local migration), by region name:
/// the built VM maps these files instead of fresh memory, and their pages never travel.
pub type SharedFiles = HashMap<String, OwnedFd>;

/// A VM built to receive a guest: memory registered, vCPUs created, never run. The driver puts
/// the memory in place, then [`TargetMachine::restore`]s the vCPU and VM state, then (when the
/// VMM says so) [`TargetMachine::resume`]s it.
pub trait TargetMachine {
    /// What [`TargetMachine::resume`] gives: the running VM (guestmem's `Vm` gives a
    /// [`guestmem_vm::RunningVm`] borrowing it).
    type Running<'a>
    where
        Self: 'a;

    /// The guest memory, laid out as the configuration it was built from says (memslot `i` is
    /// region `i`).
    fn memory(&self) -> &Arc<GuestMemory>;

    /// How many vCPUs it has (post-copy and lazy restore open a userfaultfd per vCPU, at most).
    fn vcpu_count(&self) -> usize;

    /// Takes the state [`Machine::save`](crate::component::Machine::save) produced on the
    /// source (or before the snapshot), before anything runs: in a lazy restore once the pagers
    /// are armed, in a migration once the pre-copy's pages are in and before the post-copy's
    /// pagers are armed (the pages it faults in, as KVM does for a kvmclock page, are discarded
    /// then and come from the source). A state it cannot load refuses the migration (the
    /// source keeps the guest) or the restore.
    fn restore(&mut self, state: &[u8]) -> Result<()>;

    /// Runs the vCPUs from the restored state.
    fn resume(&mut self) -> Result<Self::Running<'_>>;

    /// A handle that stops the running VM with an error when a pager cannot bring a page in
    /// (its source failed for good): its vCPUs would otherwise wait on that page forever.
    /// `None`: the VMM watches its pagers itself.
    fn abort_handle(&self) -> Option<AbortHandle> {
        None
    }

    /// Where building it spent its time, step by step (restore-latency profiles).
    fn build_phases(&self) -> Vec<(String, Duration)> {
        Vec::new()
    }
}

/// Builds the VM that receives a guest.
pub trait MachineBuilder {
    /// The VM it builds.
    type Machine: TargetMachine;

    /// Builds the VM of `config` (its vCPU count and RAM regions), the regions named in
    /// `shared` backed by those files. A VMM refuses a configuration it cannot host with an
    /// error (see [`crate::Error::Machine`]): the source is told why and keeps its guest.
    fn build(&mut self, config: &VmConfig, shared: SharedFiles) -> Result<Self::Machine>;
}

impl<M, F> MachineBuilder for F
where
    M: TargetMachine,
    F: FnMut(&VmConfig, SharedFiles) -> Result<M>,
{
    type Machine = M;

    fn build(&mut self, config: &VmConfig, shared: SharedFiles) -> Result<M> {
        self(config, shared)
    }
}
