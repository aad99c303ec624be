//! guestmem's Linux guest ([`LinuxVm`]) as a second implementation of the driver's traits,
//! beside the payload VM: on the sending side a [`LinuxMachine`] (the VM running or paused) is
//! a [`Machine`], its console a [`SerialComponent`]; on the receiving side [`LinuxVm`] is a
//! [`TargetMachine`], built by a [`LinuxBuilder`]. The snapshot and migration engines move a
//! Linux guest's memory exactly as they move the payload's; the machine blob is the JSON of a
//! [`LinuxState`], the serial console's state travels as the component "serial".

use std::sync::{Arc, Mutex};

use guestmem_memory::GuestMemory;
use guestmem_tracking::Tracker;
use guestmem_vm::linux::{
    ConsoleOut, LinuxState, LinuxVm, RunningLinux, SerialDevice, SerialDeviceState,
};
use guestmem_vm::VmConfig;

use crate::component::{ComponentError, Machine};
use crate::envelope::StateKind;
use crate::{Component, Error, MachineBuilder, Result, SharedFiles, TargetMachine};

/// The Linux machine's state in its envelope: a [`LinuxState`] (whose own
/// `LINUX_STATE_VERSION` a change to its fields bumps, together with this kind's `version`).
/// Version 1 is also read bare (a state saved before it was sealed). A guestmem of before the
/// Linux guest (0.2.0) refuses the kind by name.
pub const LINUX_STATE: StateKind = StateKind {
    name: "guestmem-linux-vm",
    version: 1,
    min_version: 1,
};

/// Whether `blob` is a Linux machine's saved state (sealed or bare, of any version).
pub fn is_linux_state(blob: &[u8]) -> bool {
    crate::envelope::kind_of(blob).as_deref() == Some(LINUX_STATE.name)
        || LinuxState::is_linux(blob)
}

/// The [`LinuxState`] in `blob`: a version this build reads, or a refusal naming both.
pub fn open_linux_state(blob: &[u8]) -> Result<LinuxState> {
    let (state, _) = LINUX_STATE.open::<serde_json::Value>(blob)?;
    Ok(LinuxState::from_bytes(
        &serde_json::to_vec(&state).expect("a JSON value serializes"),
    )?)
}

enum LinuxRun<'a> {
    Running(RunningLinux<'a>),
    Paused(&'a mut LinuxVm),
    Lost,
}

/// A Linux VM on the sending side of a snapshot or a migration, running or paused.
pub struct LinuxMachine<'a> {
    state: LinuxRun<'a>,
    memory: Arc<GuestMemory>,
    config: VmConfig,
}

impl std::fmt::Debug for LinuxMachine<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match self.state {
            LinuxRun::Running(_) => "running",
            LinuxRun::Paused(_) => "paused",
            LinuxRun::Lost => "lost",
        };
        f.debug_struct("LinuxMachine")
            .field("state", &state)
            .finish_non_exhaustive()
    }
}

impl<'a> LinuxMachine<'a> {
    /// The machine of a VM whose vCPUs are running.
    pub fn running(running: RunningLinux<'a>) -> LinuxMachine<'a> {
        LinuxMachine {
            memory: running.vm().memory().clone(),
            config: running.vm().config().clone(),
            state: LinuxRun::Running(running),
        }
    }

    /// The machine of a paused (or never started) VM.
    pub fn paused(vm: &'a mut LinuxVm) -> LinuxMachine<'a> {
        LinuxMachine {
            memory: vm.memory().clone(),
            config: vm.config().clone(),
            state: LinuxRun::Paused(vm),
        }
    }

    /// The running vCPUs, if they run.
    pub fn into_running(self) -> Option<RunningLinux<'a>> {
        match self.state {
            LinuxRun::Running(r) => Some(r),
            _ => None,
        }
    }

    /// The paused VM, if it is paused.
    pub fn into_paused(self) -> Option<&'a mut LinuxVm> {
        match self.state {
            LinuxRun::Paused(vm) => Some(vm),
            _ => None,
        }
    }

    fn vm(&self) -> Result<&LinuxVm> {
        match &self.state {
            LinuxRun::Running(r) => Ok(r.vm()),
            LinuxRun::Paused(vm) => Ok(vm),
            LinuxRun::Lost => Err(Error::MachineLost),
        }
    }
}

impl Machine for LinuxMachine<'_> {
    fn memory(&self) -> &Arc<GuestMemory> {
        &self.memory
    }

    fn config(&self) -> &VmConfig {
        &self.config
    }

    fn start_tracking(&self, mode: guestmem_tracking::Mode) -> Result<Tracker> {
        let vm = self.vm()?;
        Ok(Tracker::start_on(
            vm.fd(),
            vm.memory(),
            vm.dirty_rings(),
            mode,
        )?)
    }

    fn pause(&mut self) -> Result<()> {
        match std::mem::replace(&mut self.state, LinuxRun::Lost) {
            LinuxRun::Running(r) => self.state = LinuxRun::Paused(r.pause()?),
            other => self.state = other,
        }
        Ok(())
    }

    fn resume(&mut self) -> Result<()> {
        match std::mem::replace(&mut self.state, LinuxRun::Lost) {
            LinuxRun::Paused(vm) => self.state = LinuxRun::Running(vm.start()?),
            other => self.state = other,
        }
        Ok(())
    }

    fn save(&mut self) -> Result<Vec<u8>> {
        match &self.state {
            LinuxRun::Paused(vm) => Ok(LINUX_STATE.seal(&vm.save_state()?)),
            LinuxRun::Running(_) => Err(Error::MachineRunning),
            LinuxRun::Lost => Err(Error::MachineLost),
        }
    }
}

impl TargetMachine for LinuxVm {
    type Running<'a> = RunningLinux<'a>;

    fn memory(&self) -> &Arc<GuestMemory> {
        LinuxVm::memory(self)
    }

    fn vcpu_count(&self) -> usize {
        LinuxVm::vcpu_count(self)
    }

    fn restore(&mut self, state: &[u8]) -> Result<()> {
        Ok(self.restore_state(&open_linux_state(state)?)?)
    }

    fn resume(&mut self) -> Result<RunningLinux<'_>> {
        Ok(self.start()?)
    }

    fn abort_handle(&self) -> Option<guestmem_vm::AbortHandle> {
        Some(LinuxVm::abort_handle(self))
    }
}

/// Builds a [`LinuxVm`] for the configuration a snapshot or a migration's source gives, its
/// console going where `console` says (called once per VM built, after the host is known to
/// run a stock kernel: on a PVM host the build is refused before `console` is called).
pub struct LinuxBuilder<F: FnMut() -> ConsoleOut>(pub F);

impl<F: FnMut() -> ConsoleOut> std::fmt::Debug for LinuxBuilder<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LinuxBuilder")
    }
}

impl<F: FnMut() -> ConsoleOut> MachineBuilder for LinuxBuilder<F> {
    type Machine = LinuxVm;

    fn build(&mut self, config: &VmConfig, shared: SharedFiles) -> Result<LinuxVm> {
        // Refused before the console is made (a console file is not left behind).
        if let Some(why) = guestmem_vm::linux::pvm_refusal() {
            return Err(guestmem_vm::Error::Config(why).into());
        }
        Ok(LinuxVm::new_on(config, shared, (self.0)())?)
    }
}

/// The Linux guest's 16550 console as the component "serial": its registers and pending
/// input move with the guest (JSON of [`SerialDeviceState`]).
#[derive(Debug, Clone)]
pub struct SerialComponent(pub Arc<Mutex<SerialDevice>>);

/// The name the serial console's state travels under.
pub const SERIAL_COMPONENT: &str = "serial";

impl Component for SerialComponent {
    fn name(&self) -> &str {
        SERIAL_COMPONENT
    }

    fn pause(&mut self) -> std::result::Result<(), ComponentError> {
        Ok(())
    }

    fn resume(&mut self) -> std::result::Result<(), ComponentError> {
        Ok(())
    }

    fn save(&mut self) -> std::result::Result<Vec<u8>, ComponentError> {
        let state = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .state();
        Ok(serde_json::to_vec(&state)?)
    }

    fn restore(&mut self, state: &[u8]) -> std::result::Result<(), ComponentError> {
        let state: SerialDeviceState = serde_json::from_slice(state)?;
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .set_state(&state)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sealed Linux state is told apart from the payload's; a newer version of it is refused
    /// naming both versions, never with a parse error.
    #[test]
    fn linux_state_kind_is_recognized_and_a_newer_version_refused() {
        let v2 = br#"{"guestmem_state":"guestmem-linux-vm","version":2,"state":{"x":1}}"#;
        assert!(is_linux_state(v2));
        assert!(matches!(
            open_linux_state(v2).unwrap_err(),
            Error::StateVersion { found: 2, .. }
        ));
        let payload = crate::PAYLOAD_STATE.seal(&serde_json::json!({"vcpus": []}));
        assert!(!is_linux_state(&payload));
        assert!(!is_linux_state(br#"{"vcpus":[]}"#));
        assert!(matches!(
            open_linux_state(&payload).unwrap_err(),
            Error::StateKind { .. }
        ));
    }
}
