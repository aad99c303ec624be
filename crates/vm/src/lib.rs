//! A KVM VM that runs guestmem's guest payload on N vCPU threads over guest memory of any
//! backend. The payload runs in 64-bit mode at CPL3 (see `payload/payload.S` for its entry
//! state and workloads); the host sets it up without firmware: identity page tables, segment
//! registers and CPUID, then one control block per vCPU. Beside it, [`linux`]: a VM that boots
//! a Linux kernel with an initramfs, on the same memory backends.

mod dirty_ring;
mod error;
pub mod layout;
pub mod linux;
pub mod payload;
mod state;
mod vcpu;
mod vm;
mod workload;

pub use dirty_ring::DirtyRing;
pub use error::{Error, Result};
pub use state::{VcpuState, VmState};
pub use vm::{host_tsc_khz, AbortHandle, RunningVm, Vm, VmConfig};
pub use workload::{RunReport, VcpuReport, VcpuWork, Workload};
