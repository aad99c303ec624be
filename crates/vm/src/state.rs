//! The complete vCPU and VM state KVM exposes for this VM kind, saved from a paused VM and put
//! back into a new one (snapshot restore, migration). Memory is not part of it: it travels
//! separately, region by region.

use kvm_bindings::{
    kvm_clock_data, kvm_cpuid_entry2, kvm_debugregs, kvm_mp_state, kvm_msr_entry, kvm_regs,
    kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave, CpuId, Msrs,
};
use kvm_ioctls::{Cap, Kvm, VcpuFd, VmFd};
use serde::{Deserialize, Serialize};

use crate::{Error, Result, VcpuWork};

/// Everything KVM holds for one vCPU. There is no in-kernel irqchip in guestmem's VMs, so no
/// LAPIC state; the TSC travels as an MSR, its frequency alongside.
///
/// Format: a change here bumps `guestmem_contract::PAYLOAD_STATE.version` (guestmem's own VM
/// state envelope), and the version of any VMM's machine blob that holds it.
#[derive(Debug, Serialize, Deserialize)]
pub struct VcpuState {
    /// The CPUID the vCPU was given.
    pub cpuid: Vec<kvm_cpuid_entry2>,
    /// The MSRs worth saving (the TSC among them).
    pub msrs: Vec<kvm_msr_entry>,
    /// General registers.
    pub regs: kvm_regs,
    /// Special registers.
    pub sregs: kvm_sregs,
    /// The FPU and vector state.
    pub xsave: kvm_xsave,
    /// Extended control registers.
    pub xcrs: kvm_xcrs,
    /// Debug registers.
    pub debugregs: kvm_debugregs,
    /// Pending events (exceptions, interrupts, NMIs).
    pub vcpu_events: kvm_vcpu_events,
    /// Its multiprocessing state.
    pub mp_state: kvm_mp_state,
    /// Its TSC rate.
    pub tsc_khz: u32,
}

impl VcpuState {
    /// Saves the complete state of a vCPU of any VMM (one that is not running), `vm` being the
    /// VM it belongs to: what a VMM on KVM's x86 vCPUs puts in its own machine blob, without
    /// writing the ioctls and their order itself. The MSRs saved are those this host lets be
    /// read and written back, probed once per process on the first vCPU saved (reading each and
    /// writing its value back), so save a vCPU that has not run yet first, as guestmem's own
    /// [`Vm`](crate::Vm) does. Hosts whose XSAVE area exceeds `kvm_xsave` (4 KiB; e.g. AMX)
    /// are refused.
    pub fn save(vm: &VmFd, vcpu: &VcpuFd) -> Result<VcpuState> {
        check_xsave_size(vm)?;
        let msr_indices = restorable_msrs(vcpu)?;
        save_vcpu(vcpu, &msr_indices)
    }

    /// Puts this state into `vcpu` of `vm` (a vCPU of any VMM, not running), in the order KVM
    /// needs (CPUID first, MSRs after the special registers, events last). An MSR or a CPUID
    /// that this host refuses is an error naming it.
    pub fn restore(&self, vm: &VmFd, vcpu: &VcpuFd) -> Result<()> {
        check_xsave_size(vm)?;
        restore_vcpu(vcpu, self)
    }
}

/// The state of guestmem's own payload VM ([`Vm`](crate::Vm)), paused: KVM's (its vCPUs and
/// its kvmclock) and the workloads its vCPUs were given. It is that VM's machine blob; a VMM
/// keeps its own, saving its vCPUs with [`VcpuState::save`].
///
/// Format: saved inside its versioned envelope (`guestmem_contract::envelope`); a change here
/// bumps `guestmem_contract::PAYLOAD_STATE.version`.
#[derive(Debug, Serialize, Deserialize)]
pub struct VmState {
    /// Every vCPU's state, vCPU `i` at index `i`.
    pub vcpus: Vec<VcpuState>,
    /// The kvmclock.
    pub clock: kvm_clock_data,
    /// What each vCPU's payload was given to do.
    pub work: Vec<VcpuWork>,
}

/// The MSRs worth saving: those of `KVM_GET_MSR_INDEX_LIST` that this vCPU can read and then
/// write back (KVM_GET_MSRS / KVM_SET_MSRS stop at the first entry they refuse, so refused
/// ones are dropped one by one). Probed once per process, on a vCPU that has not run yet (every
/// VM here gets the host's supported CPUID, so the answer is the same for all of them).
pub(crate) fn restorable_msrs(vcpu: &VcpuFd) -> Result<Vec<u32>> {
    static CACHE: std::sync::OnceLock<Vec<u32>> = std::sync::OnceLock::new();
    if let Some(indices) = CACHE.get() {
        return Ok(indices.clone());
    }
    let indices = probe_restorable_msrs(vcpu)?;
    Ok(CACHE.get_or_init(|| indices).clone())
}

pub(crate) fn probe_restorable_msrs(vcpu: &VcpuFd) -> Result<Vec<u32>> {
    let kvm = Kvm::new().map_err(Error::Kvm)?;
    let list = kvm
        .get_msr_index_list()
        .map_err(Error::ioctl("KVM_GET_MSR_INDEX_LIST"))?;
    let mut wanted: Vec<kvm_msr_entry> = list
        .as_slice()
        .iter()
        .map(|&index| kvm_msr_entry {
            index,
            ..Default::default()
        })
        .collect();
    let mut restorable = Vec::with_capacity(wanted.len());
    while !wanted.is_empty() {
        let mut msrs = Msrs::from_entries(&wanted)
            .map_err(|e| Error::Config(format!("too many MSRs: {e:?}")))?;
        let read = vcpu
            .get_msrs(&mut msrs)
            .map_err(Error::ioctl("KVM_GET_MSRS"))?;
        let read_back = Msrs::from_entries(&msrs.as_slice()[..read])
            .map_err(|e| Error::Config(format!("too many MSRs: {e:?}")))?;
        let written = vcpu
            .set_msrs(&read_back)
            .map_err(Error::ioctl("KVM_SET_MSRS"))?;
        restorable.extend(msrs.as_slice()[..written].iter().map(|e| e.index));
        // Entry `written` is refused (by GET or SET): skip it and go on with the rest.
        wanted.drain(..(written + 1).min(wanted.len()));
    }
    Ok(restorable)
}

/// Refuses hosts whose XSAVE area does not fit `kvm_xsave` (4 KiB; e.g. AMX), which would need
/// KVM_GET_XSAVE2.
pub(crate) fn check_xsave_size(vm: &VmFd) -> Result<()> {
    let size = vm.check_extension_int(Cap::Xsave2);
    if size as usize > std::mem::size_of::<kvm_xsave>() {
        return Err(Error::Config(format!(
            "this host's XSAVE area is {size} bytes; saving it needs KVM_GET_XSAVE2, which \
             guestmem does not use yet"
        )));
    }
    Ok(())
}

pub(crate) fn save_vcpu(vcpu: &VcpuFd, msr_indices: &[u32]) -> Result<VcpuState> {
    let cpuid = vcpu
        .get_cpuid2(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
        .map_err(Error::ioctl("KVM_GET_CPUID2"))?;
    let entries: Vec<_> = msr_indices
        .iter()
        .map(|&index| kvm_msr_entry {
            index,
            ..Default::default()
        })
        .collect();
    let mut msrs =
        Msrs::from_entries(&entries).map_err(|e| Error::Config(format!("too many MSRs: {e:?}")))?;
    let n = vcpu
        .get_msrs(&mut msrs)
        .map_err(Error::ioctl("KVM_GET_MSRS"))?;
    if n != entries.len() {
        return Err(Error::Config(format!(
            "KVM_GET_MSRS read {n} of {} MSRs (stopped at {:#x})",
            entries.len(),
            entries[n].index
        )));
    }
    Ok(VcpuState {
        cpuid: cpuid.as_slice().to_vec(),
        msrs: msrs.as_slice().to_vec(),
        regs: vcpu.get_regs().map_err(Error::ioctl("KVM_GET_REGS"))?,
        sregs: vcpu.get_sregs().map_err(Error::ioctl("KVM_GET_SREGS"))?,
        xsave: vcpu.get_xsave().map_err(Error::ioctl("KVM_GET_XSAVE"))?,
        xcrs: vcpu.get_xcrs().map_err(Error::ioctl("KVM_GET_XCRS"))?,
        debugregs: vcpu
            .get_debug_regs()
            .map_err(Error::ioctl("KVM_GET_DEBUGREGS"))?,
        vcpu_events: vcpu
            .get_vcpu_events()
            .map_err(Error::ioctl("KVM_GET_VCPU_EVENTS"))?,
        mp_state: vcpu
            .get_mp_state()
            .map_err(Error::ioctl("KVM_GET_MP_STATE"))?,
        tsc_khz: vcpu
            .get_tsc_khz()
            .map_err(Error::ioctl("KVM_GET_TSC_KHZ"))?,
    })
}

/// Puts `state` into `vcpu`, in the order KVM needs (CPUID first, MSRs after the special
/// registers, events last).
pub(crate) fn restore_vcpu(vcpu: &VcpuFd, state: &VcpuState) -> Result<()> {
    let cpuid = CpuId::from_entries(&state.cpuid)
        .map_err(|e| Error::Config(format!("saved CPUID does not fit: {e:?}")))?;
    vcpu.set_cpuid2(&cpuid)
        .map_err(Error::ioctl("KVM_SET_CPUID2"))?;
    if vcpu.get_tsc_khz().ok() != Some(state.tsc_khz) {
        vcpu.set_tsc_khz(state.tsc_khz)
            .map_err(Error::ioctl("KVM_SET_TSC_KHZ"))?;
    }
    vcpu.set_mp_state(state.mp_state)
        .map_err(Error::ioctl("KVM_SET_MP_STATE"))?;
    vcpu.set_regs(&state.regs)
        .map_err(Error::ioctl("KVM_SET_REGS"))?;
    vcpu.set_sregs(&state.sregs)
        .map_err(Error::ioctl("KVM_SET_SREGS"))?;
    // SAFETY: every caller checked first with `check_xsave_size` (`Vm::new` when the VM was
    // built, `VcpuState::restore` before calling) that this host's XSAVE area is no larger than
    // `kvm_xsave`, so the kernel reads only within `state.xsave`.
    unsafe { vcpu.set_xsave(&state.xsave) }.map_err(Error::ioctl("KVM_SET_XSAVE"))?;
    vcpu.set_xcrs(&state.xcrs)
        .map_err(Error::ioctl("KVM_SET_XCRS"))?;
    vcpu.set_debug_regs(&state.debugregs)
        .map_err(Error::ioctl("KVM_SET_DEBUGREGS"))?;
    let msrs = Msrs::from_entries(&state.msrs)
        .map_err(|e| Error::Config(format!("saved MSRs do not fit: {e:?}")))?;
    let n = vcpu.set_msrs(&msrs).map_err(Error::ioctl("KVM_SET_MSRS"))?;
    if n != state.msrs.len() {
        return Err(Error::Config(format!(
            "KVM_SET_MSRS took {n} of {} saved MSRs (refused {:#x})",
            state.msrs.len(),
            state.msrs[n].index
        )));
    }
    vcpu.set_vcpu_events(&state.vcpu_events)
        .map_err(Error::ioctl("KVM_SET_VCPU_EVENTS"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A VM with one vCPU given the host's supported CPUID (as `Vm::new` does).
    fn new_vcpu() -> (Kvm, VmFd, VcpuFd) {
        let kvm = Kvm::new().unwrap();
        let vm = kvm.create_vm().unwrap();
        let vcpu = vm.create_vcpu(0).unwrap();
        let cpuid = kvm
            .get_supported_cpuid(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
            .unwrap();
        vcpu.set_cpuid2(&cpuid).unwrap();
        (kvm, vm, vcpu)
    }

    /// The state saved from one vCPU, put into another VM's, reads back the same: registers,
    /// special registers, MSRs and the TSC rate; every MSR kept is one KVM both reads and
    /// writes.
    #[test]
    fn a_vcpu_state_round_trips_into_another_vm() {
        let (_kvm, vm, vcpu) = new_vcpu();
        let mut regs = vcpu.get_regs().unwrap();
        (regs.rax, regs.rbx, regs.rip, regs.rflags) = (0x1234, 0xfeed_f00d, 0x10_0000, 0x2);
        vcpu.set_regs(&regs).unwrap();
        let mut sregs = vcpu.get_sregs().unwrap();
        sregs.cr3 = 0x11_0000;
        vcpu.set_sregs(&sregs).unwrap();
        let saved = VcpuState::save(&vm, &vcpu).unwrap();
        assert!(!saved.msrs.is_empty() && !saved.cpuid.is_empty());
        assert!(saved.tsc_khz > 0);

        let (_kvm2, vm2, other) = new_vcpu();
        saved.restore(&vm2, &other).unwrap();
        let again = VcpuState::save(&vm2, &other).unwrap();
        let r = other.get_regs().unwrap();
        assert_eq!(
            (r.rax, r.rbx, r.rip, r.rflags),
            (0x1234, 0xfeed_f00d, 0x10_0000, 0x2)
        );
        assert_eq!(other.get_sregs().unwrap().cr3, 0x11_0000);
        assert_eq!(again.tsc_khz, saved.tsc_khz);
        let indices = |s: &VcpuState| s.msrs.iter().map(|m| m.index).collect::<Vec<_>>();
        assert_eq!(indices(&again), indices(&saved));
    }
}
