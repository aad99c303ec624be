//! vCPU setup (CPUID, long mode at CPL3) and the vCPU thread's run loop.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvm_bindings::{kvm_segment, CpuId, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd};
use vmm_sys_util::signal::{register_signal_handler, SIGRTMIN};

use crate::layout;
use crate::payload::{DONE_GPA, SLEEP_GPA};
use crate::{Error, Result};
use guestmem_memory::GuestMemory;
use guestmem_sys::uapi::{KVM_EXIT_DIRTY_RING_FULL, KVM_MEMORY_EXIT_FLAG_USERFAULT_CANDIDATE};

/// The signal that kicks a vCPU thread out of `KVM_RUN` (its handler does nothing; the point is
/// the `EINTR`).
pub(crate) fn kick_signal() -> libc::c_int {
    SIGRTMIN()
}

/// The throttle's period: a vCPU throttled to `p` % sleeps `p` % of each period.
pub const THROTTLE_PERIOD: Duration = Duration::from_millis(10);

extern "C" fn on_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

/// Installs the kick handler once per process.
pub(crate) fn install_kick_handler() -> Result<()> {
    static ONCE: std::sync::Once = std::sync::Once::new();
    let mut result = Ok(());
    ONCE.call_once(|| {
        result = register_signal_handler(kick_signal(), on_kick).map_err(|e| Error::Thread {
            vcpu: 0,
            reason: format!("cannot install the vCPU kick signal handler: {e}"),
        });
    });
    result
}

/// The host's supported CPUID, asked once per process (it is a property of the host's KVM).
pub(crate) fn supported_cpuid(kvm: &Kvm) -> Result<&'static CpuId> {
    static CPUID: std::sync::OnceLock<CpuId> = std::sync::OnceLock::new();
    if let Some(cpuid) = CPUID.get() {
        return Ok(cpuid);
    }
    let cpuid = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(Error::ioctl("KVM_GET_SUPPORTED_CPUID"))?;
    Ok(CPUID.get_or_init(|| cpuid))
}

/// Gives vCPU `id` the host-supported CPUID (with its own APIC id); without it KVM refuses
/// EFER.LME/LMA.
#[allow(clippy::cast_possible_truncation)] // vCPU ids are bounded by the VM config (`u32` in KVM).
pub(crate) fn set_cpuid(vcpu: &VcpuFd, id: usize, base: &CpuId) -> Result<()> {
    let mut cpuid = base.clone();
    for e in cpuid.as_mut_slice() {
        match e.function {
            1 => e.ebx = (e.ebx & 0x00ff_ffff) | ((id as u32 & 0xff) << 24),
            0xb | 0x1f => e.edx = id as u32,
            _ => {}
        }
    }
    vcpu.set_cpuid2(&cpuid)
        .map_err(Error::ioctl("KVM_SET_CPUID2"))
}

/// Puts vCPU `id` at the payload's entry in 64-bit mode at CPL3 (see payload.S for the state).
pub(crate) fn set_entry_state(vcpu: &VcpuFd, id: usize) -> Result<()> {
    let mut sregs = vcpu.get_sregs().map_err(Error::ioctl("KVM_GET_SREGS"))?;
    let code = kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector: 0x0b, // GDT index 1, RPL 3
        type_: 11,      // execute/read, accessed
        present: 1,
        dpl: 3,
        db: 0,
        s: 1,
        l: 1,
        g: 1,
        ..Default::default()
    };
    let data = kvm_segment {
        selector: 0x13, // GDT index 2, RPL 3
        type_: 3,       // read/write, accessed
        db: 1,
        l: 0,
        ..code
    };
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.cr3 = layout::PML4_GPA;
    sregs.cr0 = 0x8005_0033; // PG | AM | WP | NE | ET | MP | PE
    sregs.cr4 = 0x620; // OSXMMEXCPT | OSFXSR | PAE
    sregs.efer = 0x500; // LMA | LME
    vcpu.set_sregs(&sregs)
        .map_err(Error::ioctl("KVM_SET_SREGS"))?;

    let regs = kvm_bindings::kvm_regs {
        rip: layout::PAYLOAD_GPA,
        rdi: layout::control_gpa(id),
        rsp: layout::stack_top(id),
        rflags: 0x2, // reserved bit 1; interrupts off
        ..Default::default()
    };
    vcpu.set_regs(&regs).map_err(Error::ioctl("KVM_SET_REGS"))
}

/// Completes what vCPU `id`'s last exit left pending in KVM (an `in` or `out`, an MMIO
/// access: their end comes at the next `KVM_RUN`) without entering the guest: `KVM_RUN` with
/// immediate_exit, which says EINTR. Only while the vCPU does not run.
pub(crate) fn complete_pending_exit(id: usize, vcpu: &mut VcpuFd) -> Result<()> {
    vcpu.set_kvm_immediate_exit(1);
    let ran = vcpu.run().map(|exit| format!("{exit:?}"));
    vcpu.set_kvm_immediate_exit(0);
    let exit = match ran {
        Err(e) if e.errno() == libc::EINTR => return Ok(()),
        Err(e) => format!("KVM_RUN error completing a pending exit: {e}"),
        Ok(exit) => format!("{exit} while completing a pending exit"),
    };
    Err(Error::UnexpectedExit {
        vcpu: id,
        exit,
        rip: vcpu.get_regs().map_or(u64::MAX, |r| r.rip),
    })
}

/// How a vCPU thread's run ended.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// The payload wrote DONE_GPA.
    Done,
    /// The host asked the vCPU to leave KVM_RUN (kick); the vCPU can be run again.
    Kicked { rip: u64 },
    /// Any other exit or error.
    Failed(Error),
}

/// Runs `vcpu` until the payload signals done, `kicked` is set, or something unexpected happens;
/// while `throttle` is non-zero, each kick out of the guest is followed by a sleep of that share.
/// A full dirty ring (`KVM_EXIT_DIRTY_RING_FULL`, counted in `ring_full`) is waited out: the
/// kernel stopped the vCPU before the ring overflowed and refuses to re-enter the guest until the
/// harvester has collected the ring and issued `KVM_RESET_DIRTY_RINGS`, so no entry is lost.
/// A KVM Userfault exit (an access to a page still marked in its memslot's userfault bitmap)
/// is handed to `memory`'s [`UserfaultRouter`](guestmem_memory::UserfaultRouter), whose pager
/// installs the page and clears its bit; the vCPU then runs again.
pub(crate) fn run_loop(
    id: usize,
    vcpu: &mut VcpuFd,
    kicked: &Arc<AtomicBool>,
    ring_full: &AtomicU64,
    throttle: &AtomicU64,
    tsc_khz: u64,
    memory: &GuestMemory,
) -> Outcome {
    loop {
        if kicked.load(Ordering::Acquire) {
            return Outcome::Kicked { rip: rip(vcpu) };
        }
        let exit = match vcpu.run() {
            Ok(VcpuExit::MmioWrite(addr, _)) if addr == DONE_GPA => return Outcome::Done,
            Ok(VcpuExit::MmioWrite(addr, data)) if addr == SLEEP_GPA => {
                // The guest's throttle is ahead of its schedule: sleep instead of letting it
                // spin (at most 2 ms, so that a stop or a kick is seen soon).
                let ticks = data.try_into().map_or(0, u64::from_le_bytes);
                let ns = ticks.saturating_mul(1_000_000) / tsc_khz.max(1);
                std::thread::sleep(std::time::Duration::from_nanos(ns.min(2_000_000)));
                continue;
            }
            Ok(VcpuExit::MemoryFault { flags, gpa, size })
                if flags & KVM_MEMORY_EXIT_FLAG_USERFAULT_CANDIDATE != 0 =>
            {
                match memory.userfault_router().handle(gpa, size) {
                    Ok(()) => continue,
                    Err(reason) => format!("KVM Userfault at {gpa:#x}: {reason}"),
                }
            }
            Ok(VcpuExit::Unsupported(KVM_EXIT_DIRTY_RING_FULL)) => {
                ring_full.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(std::time::Duration::from_micros(50));
                continue;
            }
            Ok(exit) => format!("{exit:?}"),
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                vcpu.set_kvm_immediate_exit(0);
                // A throttle tick (see RunningVm::set_throttle): sit out the throttled share.
                let percent = throttle.load(Ordering::Acquire);
                if percent > 0 && !kicked.load(Ordering::Acquire) {
                    std::thread::sleep(
                        THROTTLE_PERIOD * u32::try_from(percent).unwrap_or(100) / 100,
                    );
                }
                continue;
            }
            Err(e) => format!("KVM_RUN error: {e}"),
        };
        return Outcome::Failed(Error::UnexpectedExit {
            vcpu: id,
            exit,
            rip: rip(vcpu),
        });
    }
}

fn rip(vcpu: &VcpuFd) -> u64 {
    vcpu.get_regs().map_or(u64::MAX, |r| r.rip)
}
