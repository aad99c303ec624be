//! The Linux boot recipe's vCPU side, after Firecracker's `arch/x86_64/{regs,interrupts,msr}.rs`
//! (Apache-2.0): the boot GDT and identity page tables, the 64-bit boot protocol's entry state
//! (long mode, flat `__BOOT_CS`/`__BOOT_DS`, RSI at the zero page), the FPU's reset values, the
//! MSRs Linux expects at boot (MTRR default type write-back among them) and the LAPIC's LINT0
//! (ExtINT, the PIC's line) and LINT1 (NMI).

use guestmem_memory::GuestMemory;
use kvm_bindings::{kvm_fpu, kvm_regs, kvm_segment, CpuId, Msrs};
use kvm_ioctls::{Cap, Kvm, VcpuFd};

use super::boot::{BOOT_STACK_GPA, GDT_GPA, IDT_GPA, PML4_GPA, ZERO_PAGE_GPA};
use crate::{Error, Result};

/// The boot GDT: null, null, then the boot protocol's `__BOOT_CS` (0x10, 64-bit code) and
/// `__BOOT_DS` (0x18, flat data), and a TSS descriptor (0x20) for TR.
const GDT: [u64; 5] = [
    0,
    0,
    gdt_entry(0xa09b, 0, 0xfffff),
    gdt_entry(0xc093, 0, 0xfffff),
    gdt_entry(0x808b, 0, 0xfffff),
];

/// A GDT descriptor from its flags (access byte and granularity nibble), base and limit.
const fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    ((base as u64 & 0xff00_0000) << 32)
        | ((flags as u64 & 0xf0ff) << 40)
        | ((limit as u64 & 0x000f_0000) << 32)
        | ((base as u64 & 0x00ff_ffff) << 16)
        | (limit as u64 & 0x0000_ffff)
}

/// The `kvm_segment` KVM takes for GDT entry `index`.
#[allow(clippy::cast_possible_truncation)] // bit fields of a descriptor
fn segment(index: usize) -> kvm_segment {
    let e = GDT[index];
    let flag = |bit: u32| ((e >> bit) & 1) as u8;
    kvm_segment {
        base: ((e >> 16) & 0xff_ffff) | (((e >> 56) & 0xff) << 24),
        limit: {
            let raw = ((e & 0xffff) | (((e >> 48) & 0xf) << 16)) as u32;
            if flag(55) == 1 {
                (raw << 12) | 0xfff
            } else {
                raw
            }
        },
        selector: (index * 8) as u16,
        type_: ((e >> 40) & 0xf) as u8,
        present: flag(47),
        dpl: ((e >> 45) & 3) as u8,
        db: flag(54),
        s: flag(44),
        l: flag(53),
        g: flag(55),
        avl: flag(52),
        unusable: u8::from(flag(47) == 0),
        padding: 0,
    }
}

/// Writes the boot GDT, an empty IDT and the identity page tables of the first GiB (2 MiB
/// pages): what the 64-bit boot protocol needs mapped (the kernel, the zero page, the command
/// line) lies there.
pub(crate) fn write_boot_tables(memory: &GuestMemory) -> Result<()> {
    let gdt: Vec<u8> = GDT.iter().flat_map(|e| e.to_le_bytes()).collect();
    memory.write(GDT_GPA, &gdt)?;
    memory.write_u64(IDT_GPA, 0)?;
    let pdpt = PML4_GPA + 0x1000;
    let pd = PML4_GPA + 0x2000;
    memory.write_u64(PML4_GPA, pdpt | 0x03)?;
    memory.write_u64(pdpt, pd | 0x03)?;
    let entries: Vec<u8> = (0..512u64)
        .flat_map(|i| ((i << 21) | 0x83).to_le_bytes())
        .collect();
    memory.write(pd, &entries)?;
    Ok(())
}

/// Puts the boot vCPU at the kernel's 64-bit `entry` as the boot protocol describes.
pub(crate) fn set_boot_state(vcpu: &VcpuFd, entry: u64) -> Result<()> {
    let mut sregs = vcpu.get_sregs().map_err(Error::ioctl("KVM_GET_SREGS"))?;
    sregs.gdt.base = GDT_GPA;
    sregs.gdt.limit = u16::try_from(GDT.len() * 8 - 1).unwrap_or(u16::MAX);
    sregs.idt.base = IDT_GPA;
    sregs.idt.limit = 7;
    let (code, data) = (segment(2), segment(3));
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = segment(4);
    sregs.cr3 = PML4_GPA;
    sregs.cr4 |= 0x20; // PAE
    sregs.cr0 |= 0x8000_0001; // PG | PE
    sregs.efer |= 0x500; // LMA | LME
    vcpu.set_sregs(&sregs)
        .map_err(Error::ioctl("KVM_SET_SREGS"))?;
    let regs = kvm_regs {
        rflags: 0x2,
        rip: entry,
        rsp: BOOT_STACK_GPA,
        rbp: BOOT_STACK_GPA,
        rsi: ZERO_PAGE_GPA,
        ..Default::default()
    };
    vcpu.set_regs(&regs).map_err(Error::ioctl("KVM_SET_REGS"))?;
    let fpu = kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    };
    vcpu.set_fpu(&fpu).map_err(Error::ioctl("KVM_SET_FPU"))
}

/// The MSRs Linux expects at boot (Firecracker's `create_boot_msr_entries`): the syscall and
/// sysenter MSRs cleared, fast strings on, the TSC at 0, and the MTRRs' default type
/// write-back with MTRRs enabled (without it the kernel maps all of RAM uncached).
pub(crate) fn set_boot_msrs(vcpu: &VcpuFd) -> Result<()> {
    const MSRS: [(u32, u64); 11] = [
        (0x174, 0),             // IA32_SYSENTER_CS
        (0x175, 0),             // IA32_SYSENTER_ESP
        (0x176, 0),             // IA32_SYSENTER_EIP
        (0xc000_0081, 0),       // STAR
        (0xc000_0082, 0),       // LSTAR
        (0xc000_0083, 0),       // CSTAR
        (0xc000_0102, 0),       // KERNEL_GS_BASE
        (0xc000_0084, 0),       // SYSCALL_MASK
        (0x10, 0),              // TSC
        (0x1a0, 1),             // IA32_MISC_ENABLE: fast strings
        (0x2ff, (1 << 11) | 6), // MTRRdefType: enabled, write-back
    ];
    let entries: Vec<kvm_bindings::kvm_msr_entry> = MSRS
        .iter()
        .map(|&(index, data)| kvm_bindings::kvm_msr_entry {
            index,
            data,
            ..Default::default()
        })
        .collect();
    let msrs =
        Msrs::from_entries(&entries).map_err(|e| Error::Config(format!("boot MSRs: {e:?}")))?;
    let set = vcpu.set_msrs(&msrs).map_err(Error::ioctl("KVM_SET_MSRS"))?;
    if set != entries.len() {
        return Err(Error::Config(format!(
            "KVM took {set} of the {} boot MSRs; it refused MSR {:#x}",
            entries.len(),
            entries[set].index
        )));
    }
    Ok(())
}

/// LAPIC register offsets of LVT LINT0 and LINT1.
const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;

/// Sets LINT0 to ExtINT (the PIC's interrupts reach the boot CPU through it) and LINT1 to NMI,
/// as a BIOS leaves them.
pub(crate) fn set_lint(vcpu: &VcpuFd) -> Result<()> {
    let mut lapic = vcpu.get_lapic().map_err(Error::ioctl("KVM_GET_LAPIC"))?;
    let mode = |regs: &mut [std::os::raw::c_char], at: usize, mode: u32| {
        let mut raw = [0u8; 4];
        for (i, b) in raw.iter_mut().enumerate() {
            *b = regs[at + i].to_ne_bytes()[0];
        }
        let v = (u32::from_le_bytes(raw) & !0x700) | (mode << 8);
        for (i, b) in v.to_le_bytes().into_iter().enumerate() {
            regs[at + i] = std::os::raw::c_char::from_ne_bytes([b]);
        }
    };
    mode(&mut lapic.regs, APIC_LVT0, 0x7); // ExtINT
    mode(&mut lapic.regs, APIC_LVT1, 0x4); // NMI
    vcpu.set_lapic(&lapic)
        .map_err(Error::ioctl("KVM_SET_LAPIC"))
}

/// CPUID leaf 1 ECX: the TSC deadline timer.
const CPUID_1_ECX_TSC_DEADLINE: u32 = 1 << 24;

/// The CPUID a Linux guest's vCPUs get: the host-supported one plus the TSC deadline timer
/// where KVM emulates it (`KVM_CAP_TSC_DEADLINE_TIMER`; KVM leaves that bit out of
/// `KVM_GET_SUPPORTED_CPUID` for the VMM to set, as QEMU and Firecracker do). With it the guest
/// arms its LAPIC timer by MSR, which a saved state restores after the TSC.
pub(crate) fn linux_cpuid(kvm: &Kvm, base: &CpuId) -> CpuId {
    let mut cpuid = base.clone();
    if kvm.check_extension(Cap::TscDeadlineTimer) {
        for e in cpuid.as_mut_slice().iter_mut().filter(|e| e.function == 1) {
            e.ecx |= CPUID_1_ECX_TSC_DEADLINE;
        }
    }
    cpuid
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The boot segments are what the 64-bit boot protocol asks: 64-bit code at 0x10, flat
    /// read/write data at 0x18, both present, base 0, 4 GiB limit.
    #[test]
    fn boot_segments_follow_the_boot_protocol() {
        let cs = segment(2);
        assert_eq!(
            (cs.selector, cs.type_, cs.l, cs.db, cs.present),
            (0x10, 0xb, 1, 0, 1)
        );
        assert_eq!(
            (cs.base, cs.limit, cs.g, cs.s, cs.dpl),
            (0, 0xffff_ffff, 1, 1, 0)
        );
        let ds = segment(3);
        assert_eq!(
            (ds.selector, ds.type_, ds.l, ds.db, ds.present),
            (0x18, 0x3, 0, 1, 1)
        );
        let tr = segment(4);
        assert_eq!((tr.selector, tr.type_, tr.s), (0x20, 0xb, 0));
        assert_eq!(GDT[2], 0x00af_9b00_0000_ffff);
        assert_eq!(GDT[3], 0x00cf_9300_0000_ffff);
    }

    /// Leaf 1 offers the TSC deadline timer exactly where KVM says it emulates it; the other
    /// leaves stay the host's.
    #[test]
    fn the_tsc_deadline_timer_is_offered_where_kvm_has_it() {
        let kvm = Kvm::new().unwrap();
        let base = crate::vcpu::supported_cpuid(&kvm).unwrap();
        let cpuid = linux_cpuid(&kvm, base);
        let leaf1 = cpuid.as_slice().iter().find(|e| e.function == 1).unwrap();
        assert_eq!(
            leaf1.ecx & CPUID_1_ECX_TSC_DEADLINE != 0,
            kvm.check_extension(Cap::TscDeadlineTimer)
        );
        for (a, b) in cpuid.as_slice().iter().zip(base.as_slice()) {
            if a.function != 1 {
                assert_eq!((a.eax, a.ebx, a.ecx, a.edx), (b.eax, b.ebx, b.ecx, b.edx));
            }
        }
    }
}
