//! A Linux guest: the second machine kind beside the payload [`Vm`](crate::Vm). Guest RAM is one
//! guestmem region at guest address 0 on any backend; the VM has KVM's in-kernel irqchip (PIC,
//! IOAPIC, LAPICs) and PIT, created before the vCPUs; a 16550 console on port 0x3f8
//! ([`serial`]); port stubs for what a kernel probes ([`pio`]); and the boot recipe of
//! Firecracker's x86_64 VMM ([`boot`], [`cpu`]), with an MP table ([`mptable`]) and ACPI tables
//! ([`acpi`]) describing the vCPUs and the IOAPIC. A stock kernel needs ordinary KVM: on a PVM
//! host ([`pvm_refusal`]) it is refused before anything is built.

mod acpi;
pub mod boot;
mod cpu;
mod mptable;
mod pio;
mod run;
pub mod serial;
pub mod state;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use guestmem_memory::{Backend, GuestMemory, RegionSpec};
use kvm_bindings::{kvm_pit_config, KVM_PIT_SPEAKER_DUMMY};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};

pub use boot::{BootPlan, KernelKind};
pub use run::{LinuxEnd, RunningLinux};
pub use serial::{ConsoleOut, SerialDevice, SerialDeviceState};
pub use state::{LinuxState, LinuxVcpuState, LINUX_STATE_VERSION};

/// Files that back RAM regions by name (see [`LinuxVm::new_on`]).
pub type SharedFiles = std::collections::HashMap<String, std::os::fd::OwnedFd>;

use crate::{vcpu, DirtyRing, Error, Result, VmConfig};

/// Refuses a configuration a Linux guest cannot run on, naming the problem.
fn check_config(config: &VmConfig) -> Result<()> {
    if config.vcpus == 0 || config.vcpus > MAX_VCPUS {
        return Err(Error::Config(format!(
            "{} vCPUs requested: a Linux guest takes 1 to {MAX_VCPUS}",
            config.vcpus
        )));
    }
    let size = match config.regions.as_slice() {
        [r] if r.gpa == 0 => r.size,
        _ => {
            return Err(Error::Config(
                "a Linux guest's RAM is one region at guest address 0".into(),
            ))
        }
    };
    if !(boot::HIMEM_GPA * 2..=boot::MAX_MEMORY).contains(&size) {
        return Err(Error::Config(format!(
            "a Linux guest's memory must be from 2 MiB to {} MiB; {size} bytes requested",
            boot::MAX_MEMORY >> 20
        )));
    }
    Ok(())
}

/// Where KVM puts the TSS it needs for real mode on Intel (three pages below the BIOS area,
/// Firecracker's address).
const KVM_TSS_GPA: usize = 0xfffb_d000;

/// The most vCPUs a Linux guest gets (its MP table must fit the EBDA's first KiB).
pub const MAX_VCPUS: usize = 32;

/// The command line a Linux guest boots with unless told otherwise: the console on the UART,
/// no PCI (there is none), the i8042 stubs probed as little as possible, a reset through the
/// keyboard controller (which ends the run) and a panic that resets; `no_timer_check`: the
/// kernel's check that the IOAPIC delivers the timer interrupt within a few ticks fails, now
/// and then, where vCPUs run slowly (nested, TCG) and then panics before its console is up
/// (Firecracker's and Kata's guests boot with it too).
pub const DEFAULT_CMDLINE: &str = "console=ttyS0 reboot=k panic=1 pci=off nomodule \
                                   i8042.noaux i8042.nomux i8042.dumbkbd no_timer_check";

/// The [`VmConfig`] of a Linux guest: `vcpus` vCPUs and `memory` bytes of RAM on `backend`, one
/// region "ram" at guest address 0 (at most [`boot::MAX_MEMORY`]). Snapshots and migrations
/// carry it as they carry the payload VM's.
pub fn linux_config(vcpus: usize, memory: u64, backend: Backend) -> VmConfig {
    VmConfig {
        vcpus,
        regions: vec![RegionSpec::new("ram", 0, memory, backend)],
        dirty_ring_bytes: None,
    }
}

/// Whether `config` describes a Linux guest's memory ([`linux_config`]: one region at guest
/// address 0, where the payload VM's RAM starts above its sys region).
pub fn is_linux_config(config: &VmConfig) -> bool {
    matches!(config.regions.as_slice(), [r] if r.gpa == 0)
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
    config: VmConfig,
    _kvm: Kvm,
    fd: VmFd,
    memory: Arc<GuestMemory>,
    vcpus: Vec<VcpuFd>,
    serial: Arc<Mutex<SerialDevice>>,
    /// The MSRs saved with each vCPU, probed on vCPU 0 before it first ran, TSC deadline last.
    msr_indices: Vec<u32>,
    dirty_rings: Arc<Vec<DirtyRing>>,
    /// Where building it spent its time, step by step.
    build_phases: Vec<(&'static str, Duration)>,
    /// Ends a run when a pager cannot bring a page in ([`LinuxVm::abort_handle`]).
    abort: crate::AbortHandle,
}

impl LinuxVm {
    /// Builds the VM of `config` ([`linux_config`]): in-kernel irqchip and PIT, guest RAM
    /// registered, the UART, and the vCPUs (CPUID, LINT0/LINT1); nothing is loaded and nothing
    /// runs. Refused on a PVM host.
    pub fn new(config: &VmConfig, console: ConsoleOut) -> Result<LinuxVm> {
        LinuxVm::new_on(config, SharedFiles::new(), console)
    }

    /// Like [`LinuxVm::new`], with the RAM backed by the files in `shared` (another process's
    /// memfds, handed over by a local migration) where they are named.
    pub fn new_on(
        config: &VmConfig,
        mut shared: SharedFiles,
        console: ConsoleOut,
    ) -> Result<LinuxVm> {
        if let Some(why) = pvm_refusal() {
            return Err(Error::Config(why));
        }
        check_config(config)?;
        let mut phases = crate::vm::Phases::start();
        let kvm = Kvm::new().map_err(Error::Kvm)?;
        let fd = kvm.create_vm().map_err(Error::ioctl("KVM_CREATE_VM"))?;
        crate::state::check_xsave_size(&fd)?;
        if let Some(bytes) = config.dirty_ring_bytes {
            crate::vm::enable_dirty_ring(&fd, bytes)?;
        }
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
        phases.mark("create the VM, its irqchip and PIT");
        let memory = GuestMemory::new_on(&config.regions, Some(&fd), &mut shared)?;
        memory.register(&fd)?;
        phases.mark("create and register memory");
        let serial = SerialDevice::new(&fd, console)?;
        vcpu::install_kick_handler()?;
        let cpuid = cpu::linux_cpuid(&kvm, vcpu::supported_cpuid(&kvm)?);
        let mut vcpus = Vec::with_capacity(config.vcpus);
        for id in 0..config.vcpus {
            let v = fd
                .create_vcpu(id as u64)
                .map_err(Error::ioctl("KVM_CREATE_VCPU"))?;
            vcpu::set_cpuid(&v, id, &cpuid)?;
            cpu::set_lint(&v)?;
            vcpus.push(v);
        }
        // Probed on this VM's own vCPU (with its LAPIC, the TSC deadline is among them), which
        // has not run yet: the probe writes back what it reads.
        let msr_indices = state::order_msrs(crate::state::probe_restorable_msrs(&vcpus[0])?);
        let dirty_rings = match config.dirty_ring_bytes {
            Some(bytes) => vcpus
                .iter()
                .enumerate()
                .map(|(id, v)| DirtyRing::map(v, id, bytes))
                .collect::<Result<Vec<_>>>()?,
            None => Vec::new(),
        };
        phases.mark("create the UART and the vCPUs");
        Ok(LinuxVm {
            config: config.clone(),
            _kvm: kvm,
            fd,
            memory: Arc::new(memory),
            vcpus,
            serial: Arc::new(Mutex::new(serial)),
            msr_indices,
            dirty_rings: Arc::new(dirty_rings),
            build_phases: phases.done(),
            abort: crate::AbortHandle::default(),
        })
    }

    /// A handle that ends the VM's run ([`RunningLinux::wait`], [`RunningLinux::pause`]) with
    /// [`Error::Aborted`]: a pager that cannot bring a page in (its chunk failed its check, its
    /// source failed for good) stops the guest, which would otherwise wait on that page
    /// forever, and the run says why.
    pub fn abort_handle(&self) -> crate::AbortHandle {
        self.abort.clone()
    }

    /// Where building it spent its time, step by step.
    pub fn build_phases(&self) -> &[(&'static str, Duration)] {
        &self.build_phases
    }

    /// Completes what the vCPUs' last exits left pending in KVM without entering the guest
    /// (`KVM_RUN` with immediate_exit): a run that ended on the guest's reset leaves the `out`
    /// that asked for it unfinished, which the next `KVM_RUN` would finish over a restored
    /// state. A pause completes them itself. Only while no vCPU runs.
    pub fn complete_pending_exits(&mut self) -> Result<()> {
        if self.vcpus.len() != self.config.vcpus {
            return Err(Error::Config(
                "the vCPUs are running: pause them first".into(),
            ));
        }
        for (id, vcpu) in self.vcpus.iter_mut().enumerate() {
            vcpu::complete_pending_exit(id, vcpu)?;
        }
        Ok(())
    }

    /// Loads `plan` (kernel, initramfs, command line, zero page, boot tables, MP table, ACPI
    /// tables) into guest memory and puts the boot vCPU at the kernel's entry, its boot MSRs set.
    pub fn boot(&mut self, plan: &BootPlan) -> Result<()> {
        if plan.memory() != self.memory.size() {
            return Err(Error::Config(
                "the boot plan was checked for another memory size".into(),
            ));
        }
        let entry = plan.load(&self.memory)?;
        cpu::write_boot_tables(&self.memory)?;
        mptable::write_mptable(&self.memory, self.vcpus.len())?;
        acpi::write_acpi_tables(&self.memory, self.vcpus.len())?;
        for v in &self.vcpus {
            cpu::set_boot_msrs(v)?;
        }
        cpu::set_boot_state(&self.vcpus[0], entry)?;
        Ok(())
    }

    /// What this VM was built from.
    pub fn config(&self) -> &VmConfig {
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

    /// The vCPUs' dirty rings, vCPU `i` at index `i` (empty without `dirty_ring_bytes`).
    pub fn dirty_rings(&self) -> &Arc<Vec<DirtyRing>> {
        &self.dirty_rings
    }
    /// How many vCPUs.
    pub fn vcpu_count(&self) -> usize {
        self.vcpus.len()
    }

    /// The state of the paused VM in KVM (see [`state`]); the serial console's is saved apart.
    pub fn save_state(&self) -> Result<LinuxState> {
        if self.vcpus.len() != self.config.vcpus {
            return Err(Error::Config(
                "the vCPUs are running: pause them first".into(),
            ));
        }
        let vcpus = self
            .vcpus
            .iter()
            .map(|v| state::save_vcpu(v, &self.msr_indices))
            .collect::<Result<Vec<_>>>()?;
        state::save_vm(&self.fd, vcpus)
    }

    /// Puts a saved state into this VM (built with the same configuration, not run): the VM's
    /// part first, then every vCPU; the guest goes on at the next [`LinuxVm::start`].
    pub fn restore_state(&mut self, saved: &LinuxState) -> Result<()> {
        if saved.vcpus.len() != self.vcpus.len() {
            return Err(Error::Config(format!(
                "the saved state has {} vCPUs, this VM {}",
                saved.vcpus.len(),
                self.vcpus.len()
            )));
        }
        state::restore_vm(&self.fd, saved)?;
        let away_ns = state::time_away_ns(saved);
        for (vcpu, s) in self.vcpus.iter().zip(&saved.vcpus) {
            state::restore_vcpu(vcpu, s, away_ns)?;
        }
        Ok(())
    }

    /// Where each vCPU stopped, one line each ([`state::vcpu_report`]): said after a restored
    /// or migrated guest's run, so that a guest that went quiet shows where it sits.
    pub fn vcpu_report(&self) -> Vec<String> {
        self.vcpus
            .iter()
            .enumerate()
            .map(|(id, v)| state::vcpu_report(v, id))
            .collect()
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
