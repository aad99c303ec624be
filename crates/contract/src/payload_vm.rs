//! guestmem's own VM and its payload as one implementation of the driver's traits: on the
//! source a [`PayloadVm`] is a [`Machine`], on the receiving side [`Vm`] is a
//! [`TargetMachine`] that [`VmBuilder`] builds.
//!
//! Its saved state (the blob [`Machine::save`] gives and [`TargetMachine::restore`] takes) is
//! the JSON of [`VmState`] (the vCPUs' and the VM's KVM state and the workloads the payload's
//! vCPUs were given) in its versioned envelope ([`STATE`], [`crate::envelope`]); guestmem 0.1.0
//! saved it bare, which reads as version 1. The payload's workloads are this VM's business: the snapshot and
//! migration core carry the blob without reading it.

use std::sync::Arc;
use std::time::Duration;

use guestmem_memory::GuestMemory;
use guestmem_tracking::Tracker;
use guestmem_vm::{AbortHandle, RunningVm, Vm, VmConfig, VmState};

use crate::component::Machine;
use crate::envelope::StateKind;
use crate::target::{MachineBuilder, SharedFiles, TargetMachine};
use crate::{Error, Result};

/// guestmem's own VM running its payload, as a [`Machine`]: running (its vCPU threads) or
/// paused (the VM handed back).
pub struct PayloadVm<'a> {
    state: PayloadState<'a>,
    config: VmConfig,
    memory: Arc<GuestMemory>,
}

impl std::fmt::Debug for PayloadVm<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match self.state {
            PayloadState::Running(_) => "running",
            PayloadState::Paused(_) => "paused",
            PayloadState::Lost => "lost",
        };
        f.debug_struct("PayloadVm")
            .field("state", &state)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

enum PayloadState<'a> {
    Running(RunningVm<'a>),
    Paused(&'a mut Vm),
    /// A pause or resume failed half-way: the vCPUs are gone.
    Lost,
}

impl<'a> PayloadVm<'a> {
    /// The running VM.
    pub fn running(running: RunningVm<'a>) -> PayloadVm<'a> {
        PayloadVm {
            config: running.vm().config().clone(),
            memory: running.memory().clone(),
            state: PayloadState::Running(running),
        }
    }

    /// A VM that is not running (built, restored or paused).
    pub fn paused(vm: &'a mut Vm) -> PayloadVm<'a> {
        PayloadVm {
            config: vm.config().clone(),
            memory: vm.memory().clone(),
            state: PayloadState::Paused(vm),
        }
    }

    /// The running VM, if it runs.
    pub fn as_running(&mut self) -> Option<&mut RunningVm<'a>> {
        match &mut self.state {
            PayloadState::Running(r) => Some(r),
            _ => None,
        }
    }

    /// The paused VM, if it is paused.
    pub fn as_paused(&mut self) -> Option<&mut Vm> {
        match &mut self.state {
            PayloadState::Paused(vm) => Some(vm),
            _ => None,
        }
    }

    /// The running VM back, if it runs.
    pub fn into_running(self) -> Option<RunningVm<'a>> {
        match self.state {
            PayloadState::Running(r) => Some(r),
            _ => None,
        }
    }

    /// The paused VM back, if it is paused.
    pub fn into_paused(self) -> Option<&'a mut Vm> {
        match self.state {
            PayloadState::Paused(vm) => Some(vm),
            _ => None,
        }
    }

    fn vm(&self) -> Result<&Vm> {
        match &self.state {
            PayloadState::Running(r) => Ok(r.vm()),
            PayloadState::Paused(vm) => Ok(vm),
            PayloadState::Lost => Err(Error::MachineLost),
        }
    }
}

impl Machine for PayloadVm<'_> {
    fn memory(&self) -> &Arc<GuestMemory> {
        &self.memory
    }

    fn config(&self) -> &VmConfig {
        &self.config
    }

    fn start_tracking(&self, mode: guestmem_tracking::Mode) -> Result<Tracker> {
        Ok(Tracker::start(self.vm()?, mode)?)
    }

    fn pause(&mut self) -> Result<()> {
        match std::mem::replace(&mut self.state, PayloadState::Lost) {
            PayloadState::Running(r) => self.state = PayloadState::Paused(r.pause()?),
            other => self.state = other,
        }
        Ok(())
    }

    fn resume(&mut self) -> Result<()> {
        match std::mem::replace(&mut self.state, PayloadState::Lost) {
            PayloadState::Paused(vm) => self.state = PayloadState::Running(vm.resume()?),
            other => self.state = other,
        }
        Ok(())
    }

    fn save(&mut self) -> Result<Vec<u8>> {
        match &self.state {
            PayloadState::Paused(vm) => save(vm),
            PayloadState::Running(_) => Err(Error::MachineRunning),
            PayloadState::Lost => Err(Error::MachineLost),
        }
    }

    fn set_throttle(&mut self, percent: u64) -> Result<()> {
        match &mut self.state {
            PayloadState::Running(r) => Ok(r.set_throttle(percent)?),
            _ => Ok(()),
        }
    }

    fn throttle(&self) -> u64 {
        match &self.state {
            PayloadState::Running(r) => r.throttle(),
            _ => 0,
        }
    }
}

/// The kind and versions of guestmem's own VM state ([`VmState`], with its [`VcpuState`]s and
/// workloads). Version 1: guestmem 0.1.0's (saved bare, without the envelope). A change to
/// [`VmState`], [`VcpuState`] or [`guestmem_vm::VcpuWork`] (a field added, removed or changed)
/// bumps `version`; `min_version` stays at the oldest one still read (README, "Compatibility":
/// the two minor releases before).
///
/// [`VcpuState`]: guestmem_vm::VcpuState
pub const STATE: StateKind = StateKind {
    name: "guestmem-payload-vm",
    version: 1,
    min_version: 1,
};

/// The state blob of guestmem's `vm`, which is not running: its [`VmState`] in its envelope.
pub fn save(vm: &Vm) -> Result<Vec<u8>> {
    Ok(STATE.seal(&vm.save_state()?))
}

/// Reads the state blob of guestmem's VM ([`save`]; a bare one of guestmem 0.1.0 too). A state
/// of a version this build does not read is refused naming both versions.
pub fn state_of(blob: &[u8]) -> Result<VmState> {
    Ok(STATE.open(blob)?.0)
}

impl TargetMachine for Vm {
    type Running<'a> = RunningVm<'a>;

    fn memory(&self) -> &Arc<GuestMemory> {
        Vm::memory(self)
    }

    fn vcpu_count(&self) -> usize {
        Vm::vcpu_count(self)
    }

    fn restore(&mut self, state: &[u8]) -> Result<()> {
        Ok(self.restore_state(&state_of(state)?)?)
    }

    fn resume(&mut self) -> Result<RunningVm<'_>> {
        Ok(Vm::resume(self)?)
    }

    fn abort_handle(&self) -> Option<AbortHandle> {
        Some(Vm::abort_handle(self))
    }

    fn build_phases(&self) -> Vec<(String, Duration)> {
        Vm::build_phases(self)
            .iter()
            .map(|(name, d)| (format!("Vm::new: {name}"), *d))
            .collect()
    }
}

/// Builds guestmem's own [`Vm`] ([`Vm::new_on`]) for whatever configuration comes.
#[derive(Debug, Clone, Copy, Default)]
pub struct VmBuilder;

impl MachineBuilder for VmBuilder {
    type Machine = Vm;

    fn build(&mut self, config: &VmConfig, shared: SharedFiles) -> Result<Vm> {
        Ok(Vm::new_on(config, shared)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_blob_that_is_not_a_payload_state_is_refused_naming_the_step() {
        let e = state_of(b"{\"vcpus\": 3}").err().unwrap();
        assert!(
            matches!(
                e,
                Error::Machine {
                    op: "read the saved state",
                    ..
                }
            ),
            "{e:?}"
        );
        // The cause is the source, not repeated in the message.
        assert_eq!(e.to_string(), "the VM: read the saved state failed");
        assert!(std::error::Error::source(&e).is_some());
    }

    #[test]
    fn closures_are_builders_and_their_refusals_come_back() {
        let mut refuse = |config: &VmConfig, _: SharedFiles| -> Result<Vm> {
            Err(Error::Machine {
                op: "build",
                source: format!("{} vCPUs is more than this host takes", config.vcpus).into(),
            })
        };
        let config = VmConfig::simple(64, 1 << 20, guestmem_memory::Backend::Anon);
        let e = MachineBuilder::build(&mut refuse, &config, SharedFiles::new())
            .err()
            .unwrap();
        assert_eq!(
            crate::error_chain(&e, ": "),
            "the VM: build failed: 64 vCPUs is more than this host takes"
        );
    }
}
