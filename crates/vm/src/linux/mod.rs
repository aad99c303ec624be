//! A Linux guest: the second machine kind beside the payload [`Vm`](crate::Vm). Guest RAM is one
//! guestmem region at guest address 0 on any backend; the VM has KVM's in-kernel irqchip (PIC,
//! IOAPIC, LAPICs) and PIT, created before the vCPUs; a 16550 console on port 0x3f8
//! ([`serial`]); port stubs for what a kernel probes ([`pio`]); and the boot recipe of
//! Firecracker's x86_64 VMM ([`boot`], [`cpu`]). A stock kernel needs ordinary KVM: on a PVM
//! host ([`pvm_refusal`]) it is refused before anything is built.

pub mod boot;
mod cpu;
mod mptable;
mod pio;
mod run;
pub mod serial;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use guestmem_memory::{Backend, GuestMemory, RegionSpec};
use kvm_bindings::{kvm_pit_config, KVM_PIT_SPEAKER_DUMMY};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};

pub use boot::{BootPlan, KernelKind};
pub use run::{LinuxEnd, RunningLinux};
pub use serial::{ConsoleOut, SerialDevice, SerialDeviceState};

use crate::{vcpu, Error, Result};

/// Where KVM puts the TSS it needs for real mode on Intel (three pages below the BIOS area,
/// Firecracker's address).
const KVM_TSS_GPA: usize = 0xfffb_d000;

/// The most vCPUs a Linux guest gets (its MP table must fit the EBDA's first KiB).
pub const MAX_VCPUS: usize = 32;

/// The command line a Linux guest boots with unless told otherwise: the console on the UART,
/// no PCI (there is none), the i8042 stubs probed as little as possible, a reset through the
/// keyboard controller (which ends the run) and a panic that resets.
pub const DEFAULT_CMDLINE: &str =
    "console=ttyS0 reboot=k panic=1 pci=off nomodule i8042.noaux i8042.nomux i8042.dumbkbd";

/// What Linux VM to build.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinuxConfig {
    /// Guest RAM in bytes (one region at guest address 0, at most [`boot::MAX_MEMORY`]).
    pub memory: u64,
    /// Its backend.
    pub backend: Backend,
    /// vCPUs (described to the guest by an MP table).
    pub vcpus: usize,
}

/// Why a stock Linux kernel cannot be a guest of this host's KVM, if it cannot: the host's KVM
/// is PVM (`kvm_pvm`, found in /sys/module), which runs only PVM-aware guest kernels.
pub fn pvm_refusal() -> Option<String> {
    std::path::Path::new("/sys/module/kvm_pvm")
        .exists()
        .then(|| {
            "this host's KVM is PVM (kvm_pvm), which runs only PVM-aware guest kernels, not a \
             stock Linux kernel: boot the Linux guest in the kernel lab \
             (scripts/kernel-lab.sh --suite linux), where KVM is ordinary kvm_amd"
                .to_string()
        })
}

/// A KVM VM set up to run a Linux guest.
#[derive(Debug)]
pub struct LinuxVm {
    config: LinuxConfig,
    _kvm: Kvm,
    fd: VmFd,
    memory: Arc<GuestMemory>,
    vcpus: Vec<VcpuFd>,
    serial: Arc<Mutex<SerialDevice>>,
}

impl LinuxVm {
    /// Builds the VM: in-kernel irqchip and PIT, guest RAM registered, the UART, and the vCPUs
    /// (CPUID, LINT0/LINT1); nothing is loaded and nothing runs. Refused on a PVM host.
    pub fn new(config: &LinuxConfig, console: ConsoleOut) -> Result<LinuxVm> {
        if let Some(why) = pvm_refusal() {
            return Err(Error::Config(why));
        }
        if config.vcpus == 0 || config.vcpus > MAX_VCPUS {
            return Err(Error::Config(format!(
                "{} vCPUs requested: a Linux guest takes 1 to {MAX_VCPUS}",
                config.vcpus
            )));
        }
        if config.memory > boot::MAX_MEMORY || config.memory < boot::HIMEM_GPA * 2 {
            return Err(Error::Config(format!(
                "a Linux guest's memory must be from 2 MiB to {} MiB; {} bytes requested",
                boot::MAX_MEMORY >> 20,
                config.memory
            )));
        }
        let kvm = Kvm::new().map_err(Error::Kvm)?;
        let fd = kvm.create_vm().map_err(Error::ioctl("KVM_CREATE_VM"))?;
        fd.set_tss_address(KVM_TSS_GPA)
            .map_err(Error::ioctl("KVM_SET_TSS_ADDR"))?;
        fd.create_irq_chip()
            .map_err(Error::ioctl("KVM_CREATE_IRQCHIP"))?;
        let pit = kvm_pit_config {
            flags: KVM_PIT_SPEAKER_DUMMY,
            ..Default::default()
        };
        fd.create_pit2(pit)
            .map_err(Error::ioctl("KVM_CREATE_PIT2"))?;
        let specs = [RegionSpec::new("ram", 0, config.memory, config.backend)];
        let memory = GuestMemory::new(&specs, Some(&fd))?;
        memory.register(&fd)?;
        let serial = SerialDevice::new(&fd, console)?;
        vcpu::install_kick_handler()?;
        let cpuid = vcpu::supported_cpuid(&kvm)?;
        let mut vcpus = Vec::with_capacity(config.vcpus);
        for id in 0..config.vcpus {
            let v = fd
                .create_vcpu(id as u64)
                .map_err(Error::ioctl("KVM_CREATE_VCPU"))?;
            vcpu::set_cpuid(&v, id, cpuid)?;
            cpu::set_lint(&v)?;
            vcpus.push(v);
        }
        Ok(LinuxVm {
            config: config.clone(),
            _kvm: kvm,
            fd,
            memory: Arc::new(memory),
            vcpus,
            serial: Arc::new(Mutex::new(serial)),
        })
    }

    /// Loads `plan` (kernel, initramfs, command line, zero page, boot tables) into guest memory
    /// and puts the boot vCPU at the kernel's entry, its boot MSRs set.
    pub fn boot(&mut self, plan: &BootPlan) -> Result<()> {
        if plan.memory() != self.config.memory {
            return Err(Error::Config(
                "the boot plan was checked for another memory size".into(),
            ));
        }
        let entry = plan.load(&self.memory)?;
        cpu::write_boot_tables(&self.memory)?;
        mptable::write_mptable(&self.memory, self.vcpus.len())?;
        for v in &self.vcpus {
            cpu::set_boot_msrs(v)?;
        }
        cpu::set_boot_state(&self.vcpus[0], entry)?;
        Ok(())
    }

    /// What this VM was built from.
    pub fn config(&self) -> &LinuxConfig {
        &self.config
    }
    /// The KVM VM fd.
    pub fn fd(&self) -> &VmFd {
        &self.fd
    }
    /// The guest memory.
    pub fn memory(&self) -> &Arc<GuestMemory> {
        &self.memory
    }
    /// The console UART.
    pub fn serial(&self) -> &Arc<Mutex<SerialDevice>> {
        &self.serial
    }

    /// Runs the vCPUs (each on its own thread) until [`RunningLinux::pause`] or the guest ends.
    pub fn start(&mut self) -> Result<RunningLinux<'_>> {
        run::spawn(self)
    }

    /// Runs the guest for at most `limit`, or until it resets or shuts down; says which.
    pub fn run_for(&mut self, limit: Duration) -> Result<LinuxEnd> {
        self.start()?.wait(limit)
    }
}
