//! The contract between a VMM and guestmem's snapshot and migration engines: the VMM's VM core
//! on the sending side ([`component::Machine`]), its VM on the receiving side
//! ([`TargetMachine`], built by a [`MachineBuilder`]) and its devices
//! ([`component::Component`]). guestmem's own VM and payload is one implementation
//! ([`PayloadVm`], [`VmBuilder`]); guestmem's Linux guest another ([`LinuxMachine`],
//! [`LinuxBuilder`], [`SerialComponent`]).

pub mod component;
pub mod envelope;
mod linux_vm;
mod payload_vm;
mod target;

pub use component::Component;
pub use guestmem_sys::error_chain;
pub use linux_vm::{
    is_linux_state, open_linux_state, LinuxBuilder, LinuxMachine, SerialComponent, LINUX_STATE,
    SERIAL_COMPONENT,
};
pub use payload_vm::{
    save as payload_state, state_of as payload_state_of, PayloadVm, VmBuilder,
    STATE as PAYLOAD_STATE,
};
pub use target::{MachineBuilder, SharedFiles, TargetMachine};

/// What the contract's operations return.
pub type Result<T> = std::result::Result<T, Error>;

/// Why a VMM's machine or one of its components failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The VM failed.
    #[error(transparent)]
    Vm(#[from] guestmem_vm::Error),
    /// Guest memory failed.
    #[error(transparent)]
    Memory(#[from] guestmem_memory::Error),
    /// Dirty tracking failed.
    #[error(transparent)]
    Tracking(#[from] guestmem_tracking::Error),
    /// A component's own operation failed.
    #[error("component '{name}': {op} failed")]
    Component {
        /// The component's name.
        name: String,
        /// The operation: pause, resume, save, restore or dirty_log.
        op: &'static str,
        /// The component's error.
        #[source]
        source: component::ComponentError,
    },
    /// Two components of one VM have the same name.
    #[error("two components are named '{name}': names must be unique")]
    DuplicateComponent {
        /// The name.
        name: String,
    },
    /// A saved state names a component the restoring VM does not have.
    #[error("the saved state holds component '{name}', which this VM does not have")]
    UnknownComponent {
        /// The saved component's name.
        name: String,
    },
    /// A component of the restoring VM has no saved state.
    #[error("the saved state holds nothing for component '{name}'")]
    MissingComponentState {
        /// The component's name.
        name: String,
    },
    /// The VMM's VM (a [`component::Machine`] or [`TargetMachine`], or its
    /// [`MachineBuilder`]) failed: a VMM wraps its own errors in this.
    #[error("the VM: {op} failed")]
    Machine {
        /// What it was doing: build, restore, resume, ...
        op: &'static str,
        /// Its error.
        #[source]
        source: component::ComponentError,
    },
    /// The machine must be paused for this (saving its state).
    #[error("the VM is running: pause it first")]
    MachineRunning,
    /// A pause or resume of the machine failed half-way and its vCPUs are gone.
    #[error("the VM's vCPUs were lost by a failed pause or resume")]
    MachineLost,
    /// A saved state of a version the reader does not read ([`envelope`]).
    #[error(
        "the VM's saved state: a '{kind}' state of version {found}, written by {writer}; \
         {reader} reads versions {min} to {max}: restore or migrate it with a guestmem release \
         that reads it (README, \"Compatibility\")"
    )]
    StateVersion {
        /// The state's kind.
        kind: String,
        /// Its version.
        found: u64,
        /// Who wrote it.
        writer: String,
        /// Who refuses it.
        reader: String,
        /// The oldest version the reader reads.
        min: u32,
        /// The newest.
        max: u32,
    },
    /// A saved state of another kind than the machine's ([`envelope`]).
    #[error("the VM's saved state is a '{found}' state, not a '{expected}' one")]
    StateKind {
        /// The state's kind.
        found: String,
        /// The kind the machine reads.
        expected: &'static str,
    },
}
