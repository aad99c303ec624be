//! The VM kinds a restore service ([`crate::service::RestoreService`]) pools: guestmem's payload
//! [`Vm`] and its Linux guest's [`LinuxVm`]. What the service needs of a kind beside the
//! restore traits: build one for a configuration, parse a snapshot's machine state once and put
//! it into many VMs, and what a finished clone must have left behind to be reused.

use std::time::Duration;

use guestmem_contract::TargetMachine;
use guestmem_vm::linux::{LinuxState, LinuxVm};
use guestmem_vm::{Vm, VmConfig, VmState};

use crate::Result;

/// A VM kind a restore service builds ahead, restores clones into and recycles.
pub trait PoolMachine: TargetMachine + Sized {
    /// Its machine state, parsed once per service from the snapshot's blob.
    type State: Send + Sync;

    /// Builds a VM of `config`, never run, for the pool. A Linux VM's console goes nowhere
    /// until a restore hands the VM to a clone ([`LinuxVm::serial`] takes its writer then).
    fn build(config: &VmConfig) -> Result<Self>;

    /// Parses the machine state a snapshot holds ([`guestmem_contract::component::Machine::save`]).
    fn parse_state(blob: &[u8]) -> Result<Self::State>;

    /// Puts a parsed state in (a clone's restore).
    fn restore_parsed(&mut self, state: &Self::State) -> Result<()>;

    /// The configuration it was built for.
    fn config(&self) -> &VmConfig;

    /// Whether it has dirty rings (which would hold a finished clone's entries).
    fn has_dirty_rings(&self) -> bool;

    /// Completes what its vCPUs' last exits left pending in KVM (the next `KVM_RUN` would
    /// finish an `in` or `out` over the next clone's registers), without entering the guest.
    fn complete_pending_exits(&mut self) -> Result<()>;

    /// Where building it spent its time, step by step.
    fn build_steps(&self) -> Vec<(&'static str, Duration)>;
}

impl PoolMachine for Vm {
    type State = VmState;

    fn build(config: &VmConfig) -> Result<Vm> {
        Ok(Vm::new(config)?)
    }

    fn parse_state(blob: &[u8]) -> Result<VmState> {
        Ok(guestmem_contract::payload_state_of(blob)?)
    }

    fn restore_parsed(&mut self, state: &VmState) -> Result<()> {
        Ok(self.restore_state(state)?)
    }

    fn config(&self) -> &VmConfig {
        Vm::config(self)
    }

    fn has_dirty_rings(&self) -> bool {
        !self.dirty_rings().is_empty()
    }

    fn complete_pending_exits(&mut self) -> Result<()> {
        Ok(Vm::complete_pending_exits(self)?)
    }

    fn build_steps(&self) -> Vec<(&'static str, Duration)> {
        self.build_phases().to_vec()
    }
}

impl PoolMachine for LinuxVm {
    type State = LinuxState;

    fn build(config: &VmConfig) -> Result<LinuxVm> {
        Ok(LinuxVm::new(config, Box::new(std::io::sink()))?)
    }

    fn parse_state(blob: &[u8]) -> Result<LinuxState> {
        Ok(guestmem_contract::open_linux_state(blob)?)
    }

    fn restore_parsed(&mut self, state: &LinuxState) -> Result<()> {
        Ok(self.restore_state(state)?)
    }

    fn config(&self) -> &VmConfig {
        LinuxVm::config(self)
    }

    fn has_dirty_rings(&self) -> bool {
        !self.dirty_rings().is_empty()
    }

    fn complete_pending_exits(&mut self) -> Result<()> {
        Ok(LinuxVm::complete_pending_exits(self)?)
    }

    fn build_steps(&self) -> Vec<(&'static str, Duration)> {
        self.build_phases().to_vec()
    }
}
