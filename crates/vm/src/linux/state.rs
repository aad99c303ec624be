//! What a paused Linux guest's VM holds in KVM, saved and put back in the order KVM and the
//! guest need (Firecracker's `vstate/vcpu.rs` and `arch/x86_64/vm.rs`):
//!
//! - the VM: the PIT, the kvmclock and the irqchip (PIC master, PIC slave, IOAPIC); the clock
//!   saved with `KVM_CLOCK_REALTIME` where the kernel gives it, so that on restore KVM moves it
//!   on by the wall time the guest was away;
//! - each vCPU: MP state read first (it flushes the LAPIC's pending events into the state),
//!   then the registers, special registers, FPU/vector state, XCRs, debug registers, the LAPIC
//!   and the MSRs, the vCPU events last; put back CPUID first, the LAPIC between the special
//!   registers and the MSRs, the TSC deadline MSR after the TSC, the events last; then
//!   `KVM_KVMCLOCK_CTRL`, which tells the guest it was paused (no soft-lockup warnings).
//!
//! The serial console's state is not here: it is a [`Component`](guestmem_contract) of the
//! machine, saved beside this blob.
//!
//! Format: [`LinuxState`] as JSON, versioned by [`LINUX_STATE_VERSION`]. An additive change
//! bumps it and gives the new field a serde default; a reader refuses a newer version with an
//! error naming both versions before it parses anything else.

use kvm_bindings::{
    kvm_clock_data, kvm_irqchip, kvm_lapic_state, kvm_msr_entry, kvm_pit_state2, Msrs,
    KVM_CLOCK_REALTIME, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE,
};
use kvm_ioctls::{VcpuFd, VmFd};
use serde::{Deserialize, Serialize};

use crate::{Error, Result, VcpuState};

/// The version of [`LinuxState`] this guestmem writes and the newest it reads. Bumped by any
/// change of [`LinuxState`] or [`LinuxVcpuState`].
pub const LINUX_STATE_VERSION: u32 = 1;
/// [`LinuxState::kind`]: tells a Linux machine's blob from the payload VM's.
pub const LINUX_STATE_KIND: &str = "linux";
/// `MSR_IA32_TSC` and `MSR_IA32_TSC_DEADLINE`.
const MSR_TSC: u32 = 0x10;
const MSR_TSC_DEADLINE: u32 = 0x6e0;

/// A paused Linux VM's state in KVM (without memory, which travels region by region, and
/// without its devices, which are components). Format version [`LINUX_STATE_VERSION`].
#[derive(Debug, Serialize, Deserialize)]
pub struct LinuxState {
    /// Always [`LINUX_STATE_KIND`].
    pub kind: String,
    /// [`LINUX_STATE_VERSION`] when written.
    pub version: u32,
    /// Every vCPU's state, vCPU `i` at index `i`.
    pub vcpus: Vec<LinuxVcpuState>,
    /// The PIT (channels, speaker, flags).
    pub pit: kvm_pit_state2,
    /// The kvmclock, with the host's wall time beside it where the kernel gives it.
    pub clock: kvm_clock_data,
    /// The host's wall time (CLOCK_REALTIME, ns) when the state was saved, read by guestmem
    /// itself: what moves the guest's clocks on by the time away where the kernel gives no
    /// wall time with the kvmclock (no `KVM_CLOCK_REALTIME`: a host whose clocksource is not
    /// the TSC). Additive (0: not recorded), within [`LINUX_STATE_VERSION`] 1.
    #[serde(default)]
    pub saved_realtime_ns: u64,
    /// The master PIC.
    pub pic_master: kvm_irqchip,
    /// The slave PIC.
    pub pic_slave: kvm_irqchip,
    /// The IOAPIC.
    pub ioapic: kvm_irqchip,
}

/// One vCPU of a Linux VM: what the payload VM saves ([`VcpuState`]: the TSC and the TSC
/// deadline among its MSRs, the deadline last) and its LAPIC.
#[derive(Debug, Serialize, Deserialize)]
pub struct LinuxVcpuState {
    /// Registers, MSRs, events, MP state, CPUID, TSC rate.
    pub base: VcpuState,
    /// The local APIC's registers.
    pub lapic: kvm_lapic_state,
}

/// Just enough of a blob to know what it is and whether it can be read.
#[derive(Deserialize)]
struct Header {
    kind: Option<String>,
    version: Option<u32>,
}

impl LinuxState {
    /// The JSON blob.
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a Linux VM state serializes")
    }

    /// Whether `blob` is a Linux machine's state (of any version).
    pub fn is_linux(blob: &[u8]) -> bool {
        serde_json::from_slice::<Header>(blob)
            .is_ok_and(|h| h.kind.as_deref() == Some(LINUX_STATE_KIND))
    }

    /// Reads a blob of [`LinuxState::to_bytes`]; a newer version is refused naming both
    /// versions, a blob of another machine kind naming what it is.
    pub fn from_bytes(blob: &[u8]) -> Result<LinuxState> {
        let header: Header = serde_json::from_slice(blob).map_err(|e| {
            Error::Config(format!("the saved machine state is not a JSON object: {e}"))
        })?;
        if header.kind.as_deref() != Some(LINUX_STATE_KIND) {
            return Err(Error::Config(
                "the saved machine state is not a Linux guest's (no kind \"linux\")".into(),
            ));
        }
        match header.version {
            Some(v) if v > LINUX_STATE_VERSION => Err(Error::Config(format!(
                "the saved Linux machine state is version {v}; this guestmem reads version \
                 {LINUX_STATE_VERSION} and earlier"
            ))),
            Some(_) => serde_json::from_slice(blob).map_err(|e| {
                Error::Config(format!("the saved Linux machine state is damaged: {e}"))
            }),
            None => Err(Error::Config(
                "the saved Linux machine state has no version".into(),
            )),
        }
    }
}

fn irqchip(vm: &VmFd, chip_id: u32) -> Result<kvm_irqchip> {
    let mut chip = kvm_irqchip {
        chip_id,
        ..Default::default()
    };
    vm.get_irqchip(&mut chip)
        .map_err(Error::ioctl("KVM_GET_IRQCHIP"))?;
    Ok(chip)
}

/// The MSRs to save, in the order they are put back: the TSC before the TSC deadline, which
/// goes last (KVM computes the deadline against the TSC as it is when the deadline is set).
pub(crate) fn order_msrs(mut indices: Vec<u32>) -> Vec<u32> {
    let (tsc, deadline) = (
        indices.contains(&MSR_TSC),
        indices.contains(&MSR_TSC_DEADLINE),
    );
    indices.retain(|&i| i != MSR_TSC && i != MSR_TSC_DEADLINE);
    indices.extend(tsc.then_some(MSR_TSC));
    indices.extend(deadline.then_some(MSR_TSC_DEADLINE));
    indices
}

/// Saves a paused vCPU in the order of the module's doc.
pub(crate) fn save_vcpu(vcpu: &VcpuFd, msr_indices: &[u32]) -> Result<LinuxVcpuState> {
    let mp_state = vcpu
        .get_mp_state()
        .map_err(Error::ioctl("KVM_GET_MP_STATE"))?;
    let regs = vcpu.get_regs().map_err(Error::ioctl("KVM_GET_REGS"))?;
    let sregs = vcpu.get_sregs().map_err(Error::ioctl("KVM_GET_SREGS"))?;
    let xsave = vcpu.get_xsave().map_err(Error::ioctl("KVM_GET_XSAVE"))?;
    let xcrs = vcpu.get_xcrs().map_err(Error::ioctl("KVM_GET_XCRS"))?;
    let debugregs = vcpu
        .get_debug_regs()
        .map_err(Error::ioctl("KVM_GET_DEBUGREGS"))?;
    let lapic = vcpu.get_lapic().map_err(Error::ioctl("KVM_GET_LAPIC"))?;
    let entries: Vec<kvm_msr_entry> = msr_indices
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
    let cpuid = vcpu
        .get_cpuid2(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
        .map_err(Error::ioctl("KVM_GET_CPUID2"))?;
    let tsc_khz = vcpu
        .get_tsc_khz()
        .map_err(Error::ioctl("KVM_GET_TSC_KHZ"))?;
    let vcpu_events = vcpu
        .get_vcpu_events()
        .map_err(Error::ioctl("KVM_GET_VCPU_EVENTS"))?;
    Ok(LinuxVcpuState {
        base: VcpuState {
            cpuid: cpuid.as_slice().to_vec(),
            msrs: msrs.as_slice().to_vec(),
            regs,
            sregs,
            xsave,
            xcrs,
            debugregs,
            vcpu_events,
            mp_state,
            tsc_khz,
        },
        lapic,
    })
}

/// Puts a saved vCPU back in the order of the module's doc.
pub(crate) fn restore_vcpu(vcpu: &VcpuFd, state: &LinuxVcpuState, away_ns: u64) -> Result<()> {
    let s = &state.base;
    let cpuid = kvm_bindings::CpuId::from_entries(&s.cpuid)
        .map_err(|e| Error::Config(format!("saved CPUID does not fit: {e:?}")))?;
    vcpu.set_cpuid2(&cpuid)
        .map_err(Error::ioctl("KVM_SET_CPUID2"))?;
    if vcpu.get_tsc_khz().ok() != Some(s.tsc_khz) {
        vcpu.set_tsc_khz(s.tsc_khz)
            .map_err(Error::ioctl("KVM_SET_TSC_KHZ"))?;
    }
    vcpu.set_mp_state(s.mp_state)
        .map_err(Error::ioctl("KVM_SET_MP_STATE"))?;
    vcpu.set_regs(&s.regs)
        .map_err(Error::ioctl("KVM_SET_REGS"))?;
    vcpu.set_sregs(&s.sregs)
        .map_err(Error::ioctl("KVM_SET_SREGS"))?;
    // SAFETY: LinuxVm::new checked with `check_xsave_size` that this host's XSAVE area is no
    // larger than `kvm_xsave`, so the kernel reads only within `s.xsave`.
    unsafe { vcpu.set_xsave(&s.xsave) }.map_err(Error::ioctl("KVM_SET_XSAVE"))?;
    vcpu.set_xcrs(&s.xcrs)
        .map_err(Error::ioctl("KVM_SET_XCRS"))?;
    vcpu.set_debug_regs(&s.debugregs)
        .map_err(Error::ioctl("KVM_SET_DEBUGREGS"))?;
    vcpu.set_lapic(&state.lapic)
        .map_err(Error::ioctl("KVM_SET_LAPIC"))?;
    // The TSC goes on by the time away, as the kvmclock does (KVM_CLOCK_REALTIME): a guest
    // whose clocksource is the TSC (Linux prefers it over kvmclock where the TSC is invariant)
    // sees the pause on its clock, not a clock stopped for as long.
    let mut entries = s.msrs.clone();
    for e in entries.iter_mut().filter(|e| e.index == MSR_TSC) {
        e.data = advanced_tsc(e.data, s.tsc_khz, away_ns);
    }
    let msrs = Msrs::from_entries(&entries)
        .map_err(|e| Error::Config(format!("saved MSRs do not fit: {e:?}")))?;
    let n = vcpu.set_msrs(&msrs).map_err(Error::ioctl("KVM_SET_MSRS"))?;
    if n != s.msrs.len() {
        return Err(Error::Config(format!(
            "KVM_SET_MSRS took {n} of {} saved MSRs (refused {:#x})",
            s.msrs.len(),
            s.msrs[n].index
        )));
    }
    vcpu.set_vcpu_events(&s.vcpu_events)
        .map_err(Error::ioctl("KVM_SET_VCPU_EVENTS"))?;
    // The guest learns it was paused; EINVAL means it has not set kvmclock up (nothing to tell).
    match vcpu.kvmclock_ctrl() {
        Err(e) if e.errno() != libc::EINVAL => Err(Error::ioctl("KVM_KVMCLOCK_CTRL")(e)),
        _ => Ok(()),
    }
}

/// `tsc` advanced by `ns` nanoseconds at `khz` kHz.
fn advanced_tsc(tsc: u64, khz: u32, ns: u64) -> u64 {
    let ticks = u128::from(ns) * u128::from(khz) / 1_000_000;
    tsc.wrapping_add(u64::try_from(ticks).unwrap_or(u64::MAX))
}

/// How long ago (host wall time) `state` was saved, in ns: from guestmem's own record, else
/// the kernel's (`KVM_CLOCK_REALTIME`); 0 where neither is known or the wall clock went back.
pub(crate) fn time_away_ns(state: &LinuxState) -> u64 {
    let saved = if state.saved_realtime_ns != 0 {
        state.saved_realtime_ns
    } else if state.clock.flags & KVM_CLOCK_REALTIME != 0 {
        state.clock.realtime
    } else {
        return 0;
    };
    realtime_ns().saturating_sub(saved)
}

/// The host's CLOCK_REALTIME in ns (0 if it cannot be read).
fn realtime_ns() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into `now`, which lives across the call.
    if unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &raw mut now) } != 0 {
        return 0;
    }
    u64::try_from(now.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(now.tv_nsec).unwrap_or(0)
}

/// Where a stopped vCPU is, in one line: RIP, its run state (halted or runnable), whether it
/// takes interrupts (RFLAGS.IF), the LAPIC's pending and in-service vectors and its TSC
/// deadline against its TSC: what to read when a guest went quiet.
pub(crate) fn vcpu_report(vcpu: &VcpuFd, id: usize) -> String {
    let regs = vcpu.get_regs().ok();
    let mp = vcpu.get_mp_state().ok().map(|m| match m.mp_state {
        0 => "runnable".to_string(),
        3 => "halted".to_string(),
        other => format!("mp_state {other}"),
    });
    let msrs = [MSR_TSC, MSR_TSC_DEADLINE].map(|index| kvm_msr_entry {
        index,
        ..Default::default()
    });
    let timer = Msrs::from_entries(&msrs).ok().and_then(|mut m| {
        (vcpu.get_msrs(&mut m).ok()? == 2).then(|| (m.as_slice()[0].data, m.as_slice()[1].data))
    });
    let khz = vcpu.get_tsc_khz().unwrap_or(0).max(1);
    let timer = match timer {
        Some((_, 0)) => "no TSC deadline armed".to_string(),
        Some((tsc, deadline)) => format!(
            "TSC deadline in {:.1} ms",
            (i128::from(deadline) - i128::from(tsc)) as f64 / f64::from(khz)
        ),
        None => "TSC deadline unknown".to_string(),
    };
    let lapic = vcpu.get_lapic().ok().map(|l| {
        let vectors = |base: usize| -> Vec<usize> {
            (0..8)
                .flat_map(|i| {
                    // Each 32-bit register of the LAPIC page sits at a 16-byte stride.
                    let word = (0..4).fold(0u32, |w, k| {
                        w | u32::from(l.regs[base + i * 16 + k] as u8) << (8 * k)
                    });
                    (0..32)
                        .filter(move |b| word >> b & 1 != 0)
                        .map(move |b| i * 32 + b)
                })
                .collect()
        };
        format!("IRR {:?} ISR {:?}", vectors(0x200), vectors(0x100))
    });
    format!(
        "vCPU {id}: rip {:#x}, {}, interrupts {}, {}, {}",
        regs.map_or(0, |r| r.rip),
        mp.unwrap_or_else(|| "run state unknown".into()),
        match regs.map(|r| r.rflags & 0x200 != 0) {
            Some(true) => "on",
            Some(false) => "off",
            None => "unknown",
        },
        lapic.unwrap_or_else(|| "LAPIC unknown".into()),
        timer
    )
}

/// The VM's part: PIT, clock, irqchip.
pub(crate) fn save_vm(vm: &VmFd, vcpus: Vec<LinuxVcpuState>) -> Result<LinuxState> {
    let pit = vm.get_pit2().map_err(Error::ioctl("KVM_GET_PIT2"))?;
    let mut clock = vm.get_clock().map_err(Error::ioctl("KVM_GET_CLOCK"))?;
    let saved_realtime_ns = realtime_ns();
    // KVM_SET_CLOCK takes only KVM_CLOCK_REALTIME among the flags KVM_GET_CLOCK gives.
    clock.flags &= KVM_CLOCK_REALTIME;
    Ok(LinuxState {
        kind: LINUX_STATE_KIND.into(),
        version: LINUX_STATE_VERSION,
        vcpus,
        pit,
        clock,
        saved_realtime_ns,
        pic_master: irqchip(vm, KVM_IRQCHIP_PIC_MASTER)?,
        pic_slave: irqchip(vm, KVM_IRQCHIP_PIC_SLAVE)?,
        ioapic: irqchip(vm, KVM_IRQCHIP_IOAPIC)?,
    })
}

/// Puts the VM's part back (before the vCPUs, as Firecracker does): PIT, clock, irqchip.
pub(crate) fn restore_vm(vm: &VmFd, state: &LinuxState) -> Result<()> {
    vm.set_pit2(&state.pit)
        .map_err(Error::ioctl("KVM_SET_PIT2"))?;
    // With KVM_CLOCK_REALTIME the kernel moves the kvmclock on by the time away; without it,
    // guestmem does, by its own record of when the state was saved.
    let realtime = state.clock.flags & KVM_CLOCK_REALTIME != 0;
    let clock = kvm_clock_data {
        clock: if realtime {
            state.clock.clock
        } else {
            state.clock.clock + time_away_ns(state)
        },
        flags: state.clock.flags & KVM_CLOCK_REALTIME,
        realtime: state.clock.realtime,
        ..Default::default()
    };
    vm.set_clock(&clock)
        .map_err(Error::ioctl("KVM_SET_CLOCK"))?;
    for chip in [&state.pic_master, &state.pic_slave, &state.ioapic] {
        vm.set_irqchip(chip)
            .map_err(Error::ioctl("KVM_SET_IRQCHIP"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The TSC goes on by the time away at the vCPU's rate; a clock without wall time says
    /// no time went by.
    #[test]
    fn the_tsc_goes_on_by_the_time_away() {
        assert_eq!(
            advanced_tsc(1000, 2_000_000, 1_500_000_000),
            1000 + 3_000_000_000
        );
        assert_eq!(advanced_tsc(5, 1_000_000, 0), 5);
        let state = |saved_realtime_ns, clock| LinuxState {
            kind: LINUX_STATE_KIND.into(),
            version: LINUX_STATE_VERSION,
            vcpus: Vec::new(),
            pit: kvm_pit_state2::default(),
            clock,
            saved_realtime_ns,
            pic_master: kvm_irqchip::default(),
            pic_slave: kvm_irqchip::default(),
            ioapic: kvm_irqchip::default(),
        };
        let unknown = state(0, kvm_clock_data::default());
        assert_eq!(time_away_ns(&unknown), 0);
        let ours = state(realtime_ns() - 1_000_000_000, kvm_clock_data::default());
        let away = time_away_ns(&ours);
        assert!((1_000_000_000..2_000_000_000).contains(&away), "{away}");
        let kernels = state(
            0,
            kvm_clock_data {
                flags: KVM_CLOCK_REALTIME,
                realtime: realtime_ns() - 2_000_000_000,
                ..Default::default()
            },
        );
        let away = time_away_ns(&kernels);
        assert!((2_000_000_000..3_000_000_000).contains(&away), "{away}");
    }

    /// The TSC deadline goes last, right after the TSC, whatever order KVM listed them in.
    #[test]
    fn the_tsc_deadline_is_put_back_after_the_tsc() {
        let order = order_msrs(vec![MSR_TSC_DEADLINE, 0x174, MSR_TSC, 0xc000_0080]);
        assert_eq!(order, [0x174, 0xc000_0080, MSR_TSC, MSR_TSC_DEADLINE]);
        assert_eq!(order_msrs(vec![MSR_TSC, 0x174]), [0x174, MSR_TSC]);
    }

    /// A newer version is refused naming both versions (not a serde error about a field), a
    /// payload VM's blob as not a Linux guest's; a blob of this version reads back.
    #[test]
    fn a_newer_state_is_refused_naming_both_versions() {
        let newer = format!(
            "{{\"kind\":\"linux\",\"version\":{},\"a_new_field\":[1,2]}}",
            LINUX_STATE_VERSION + 1
        );
        let e = LinuxState::from_bytes(newer.as_bytes())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!(
                "version {}; this guestmem reads version {LINUX_STATE_VERSION}",
                LINUX_STATE_VERSION + 1
            )),
            "{e}"
        );
        let e = LinuxState::from_bytes(b"{\"vcpus\":[],\"work\":[]}")
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a Linux guest's"), "{e}");
        assert!(!LinuxState::is_linux(b"{\"vcpus\":[]}"));
        let kvm = kvm_ioctls::Kvm::new().unwrap();
        let vm = kvm.create_vm().unwrap();
        vm.create_irq_chip().unwrap();
        vm.create_pit2(kvm_bindings::kvm_pit_config::default())
            .unwrap();
        let state = save_vm(&vm, Vec::new()).unwrap();
        let bytes = state.to_bytes();
        assert!(LinuxState::is_linux(&bytes));
        let back = LinuxState::from_bytes(&bytes).unwrap();
        assert_eq!(back.version, LINUX_STATE_VERSION);
        assert_eq!(back.ioapic.chip_id, KVM_IRQCHIP_IOAPIC);
        let vm2 = kvm.create_vm().unwrap();
        vm2.create_irq_chip().unwrap();
        vm2.create_pit2(kvm_bindings::kvm_pit_config::default())
            .unwrap();
        restore_vm(&vm2, &back).unwrap();
    }
}
