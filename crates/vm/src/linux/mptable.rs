//! The Intel MultiProcessor table (MP spec 1.4) a Linux guest reads to find its CPUs, the
//! IOAPIC and how the ISA interrupts reach it: without it (and without ACPI tables) Linux
//! brings up only the boot CPU and routes every interrupt through the PIC. The same table
//! Firecracker writes (`arch/x86_64/mptable.rs`): one processor entry per vCPU, one ISA bus,
//! the IOAPIC (id vCPUs + 1) with ISA IRQ i on its pin i for all 24 pins, ExtINT on LINT0 and
//! NMI on LINT1. Placed at the EBDA, where the kernel's scan looks.

use guestmem_memory::GuestMemory;

use super::boot::EBDA_GPA;
use crate::Result;

/// The LAPICs' address (also the ACPI MADT's).
pub(super) const APIC_ADDR: u32 = 0xfee0_0000;
/// The IOAPIC's address (also the ACPI MADT's).
pub(super) const IOAPIC_ADDR: u32 = 0xfec0_0000;
const IOAPIC_PINS: u8 = 24;
const APIC_VERSION: u8 = 0x14;
const IOAPIC_VERSION: u8 = 0x11;
/// Processor entry flags: enabled, bootstrap processor.
const CPU_ENABLED: u8 = 1;
const CPU_BSP: u8 = 2;
/// CPU signature (family 6) and feature flags (FPU, APIC) of the processor entries.
const CPU_SIGNATURE: u32 = 0x600;
const CPU_FEATURES: u32 = 0x201;
/// Interrupt types: vectored, NMI, ExtINT.
const MP_INT: u8 = 0;
const MP_NMI: u8 = 1;
const MP_EXTINT: u8 = 3;

/// The byte that makes `bytes` sum to zero.
fn checksum(bytes: &[u8]) -> u8 {
    0u8.wrapping_sub(bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b)))
}

/// The floating pointer and the configuration table for `vcpus` vCPUs, as bytes to write at
/// [`EBDA_GPA`].
#[allow(clippy::cast_possible_truncation)] // vCPU counts are bounded (at most 254)
pub(crate) fn mptable(vcpus: usize) -> Vec<u8> {
    let ioapic_id = vcpus as u8 + 1;
    let mut entries: Vec<u8> = Vec::new();
    let mut count: u16 = 0;
    for id in 0..vcpus {
        let flags = CPU_ENABLED | if id == 0 { CPU_BSP } else { 0 };
        entries.extend_from_slice(&[0, id as u8, APIC_VERSION, flags]);
        entries.extend_from_slice(&CPU_SIGNATURE.to_le_bytes());
        entries.extend_from_slice(&CPU_FEATURES.to_le_bytes());
        entries.extend_from_slice(&[0; 8]);
        count += 1;
    }
    entries.extend_from_slice(&[1, 0]);
    entries.extend_from_slice(b"ISA   ");
    entries.extend_from_slice(&[2, ioapic_id, IOAPIC_VERSION, 1]);
    entries.extend_from_slice(&IOAPIC_ADDR.to_le_bytes());
    count += 2;
    for irq in 0..IOAPIC_PINS {
        entries.extend_from_slice(&[3, MP_INT, 0, 0, 0, irq, ioapic_id, irq]);
        count += 1;
    }
    entries.extend_from_slice(&[4, MP_EXTINT, 0, 0, 0, 0, 0, 0]);
    entries.extend_from_slice(&[4, MP_NMI, 0, 0, 0, 0, 0xff, 1]);
    count += 2;

    let table_gpa = EBDA_GPA as u32 + 16;
    let mut table = Vec::with_capacity(44 + entries.len());
    table.extend_from_slice(b"PCMP");
    table.extend_from_slice(&((44 + entries.len()) as u16).to_le_bytes());
    table.extend_from_slice(&[4, 0]); // spec revision 1.4, checksum (below)
    table.extend_from_slice(b"GUESTMEM");
    table.extend_from_slice(b"LINUX GUEST ");
    table.extend_from_slice(&[0; 4]); // OEM table pointer
    table.extend_from_slice(&[0; 2]); // OEM table size
    table.extend_from_slice(&count.to_le_bytes());
    table.extend_from_slice(&APIC_ADDR.to_le_bytes());
    table.extend_from_slice(&[0; 4]); // extended table length, checksum, reserved
    table.extend_from_slice(&entries);
    table[7] = checksum(&table);

    let mut out = Vec::with_capacity(16 + table.len());
    out.extend_from_slice(b"_MP_");
    out.extend_from_slice(&table_gpa.to_le_bytes());
    out.extend_from_slice(&[1, 4, 0, 0, 0, 0, 0, 0]); // length 1 (16 bytes), rev 1.4, checksum
    out[10] = checksum(&out);
    out.extend_from_slice(&table);
    out
}

/// Writes the MP table for `vcpus` vCPUs into guest memory.
pub(crate) fn write_mptable(memory: &GuestMemory, vcpus: usize) -> Result<()> {
    Ok(memory.write(EBDA_GPA, &mptable(vcpus))?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The floating pointer and the table each sum to zero, the pointer points at the table,
    /// and the table counts one processor a vCPU, the bus, the IOAPIC, 24 interrupts and 2
    /// local interrupts, with the BSP first.
    #[test]
    fn the_mp_table_is_well_formed() {
        let t = mptable(3);
        let sum = |b: &[u8]| b.iter().fold(0u8, |a, x| a.wrapping_add(*x));
        assert_eq!(&t[..4], b"_MP_");
        assert_eq!(sum(&t[..16]), 0);
        let ptr = u32::from_le_bytes(t[4..8].try_into().unwrap());
        assert_eq!(u64::from(ptr), EBDA_GPA + 16);
        let table = &t[16..];
        let len = usize::from(u16::from_le_bytes([table[4], table[5]]));
        assert_eq!((&table[..4], len), (&b"PCMP"[..], table.len()));
        assert_eq!(sum(table), 0);
        assert_eq!(u16::from_le_bytes([table[34], table[35]]), 3 + 2 + 24 + 2);
        assert_eq!(
            (table[44], table[45], table[47]),
            (0, 0, CPU_ENABLED | CPU_BSP)
        );
        assert_eq!((table[64 + 1], table[64 + 3]), (1, CPU_ENABLED));
        assert!(t.len() < 1024, "fits in the EBDA's first KiB");
    }
}
