//! The ACPI tables a Linux guest reads to find its vCPUs and the IOAPIC: RSDP, XSDT, FADT,
//! MADT and DSDT, built with rust-vmm's `acpi_tables` and written through guestmem's own write
//! path. Debian's cloud kernel is built without `CONFIG_X86_MPPARSE`: it never reads the MP
//! table ([`super::mptable`]), and without ACPI it says "APIC: ACPI MADT or MP tables are not
//! detected", runs on the boot CPU alone and takes its interrupts through the PIC. The MADT is
//! how such a kernel finds every vCPU and the IOAPIC. A kernel that reads both prefers the MADT
//! ("Using ACPI (MADT) for SMP configuration information"); the MP table stays for kernels
//! built without ACPI.
//!
//! The recipe is Firecracker's (`src/vmm/src/acpi/`): a hardware-reduced ACPI platform (no PM
//! registers, no SCI, no FACS, no legacy PIC or PIT for the kernel to set up), one Local APIC
//! per vCPU and the IOAPIC in the MADT, no interrupt source overrides (KVM's IOAPIC has ISA IRQ
//! i on its pin i, as the MP table says), and a DSDT describing the COM1 UART. The RSDP goes at
//! Firecracker's [`RSDP_GPA`] (0xe0000), the other tables after it in the BIOS area below
//! 1 MiB, which the e820 map does not give as RAM (Linux reserves 0xa0000-0xfffff itself); the
//! zero page's `acpi_rsdp_addr` points at it, and a kernel that scans the BIOS area finds it
//! there too.

use acpi_tables::aml::{Device, EISAName, Interrupt, Name, Path, ResourceTemplate, IO};
use acpi_tables::fadt::{FADTBuilder, Flags, FADT};
use acpi_tables::madt::{
    EnabledStatus, IoApic, LocalInterruptController, ProcessorLocalApic, MADT,
};
use acpi_tables::rsdp::Rsdp;
use acpi_tables::sdt::Sdt;
use acpi_tables::xsdt::XSDT;
use acpi_tables::Aml;
use guestmem_memory::GuestMemory;

use super::boot::{HIMEM_GPA, RSDP_GPA};
use super::mptable::{APIC_ADDR, IOAPIC_ADDR};
use super::serial::SERIAL_PORT;
use crate::{Error, Result};

/// The OEM id every table carries.
const OEM_ID: [u8; 6] = *b"GSTMEM";
/// The OEM revision of every table.
const OEM_REVISION: u32 = 0;
/// The FADT's hypervisor vendor identity (as Firecracker names itself there).
const HYPERVISOR_VENDOR_ID: [u8; 8] = *b"GUESTMEM";
/// The UART's interrupt: ISA IRQ 4, GSI 4 (the irqfd of [`super::serial`]).
const COM1_GSI: u32 = 4;
/// The UART's eight ports.
const COM1_PORTS: u8 = 8;
/// Each table starts on a 16-byte boundary.
const TABLE_ALIGN: u64 = 16;
/// The XSDT's entries: the FADT and the MADT.
const XSDT_ENTRIES: u64 = 2;

/// IA-PC boot architecture flags (FADT `IAPC_BOOT_ARCH`, ACPI 6.5 table 5.11), as Firecracker
/// set them before it had PCI (guestmem has none: `pci=off`):
/// - VGA not present (bit 2): the kernel must not probe the VGA ports and memory.
/// - MSI not supported (bit 3): there is no PCI, so no MSI.
/// - PCIe ASPM controls (bit 4): the OS must not enable PCIe link power management.
/// - CMOS RTC not present (bit 5): guestmem has no RTC (ports 0x70/0x71 read all ones); with
///   the bit clear Linux registers a fallback `rtc_cmos` and probes it ("broken or not
///   accessible"), seconds of a boot under the lab's TCG. The guest's wall clock is kvmclock's.
///
/// Left clear: legacy devices (bit 0: there is no PnP BIOS to ask) and 8042 (bit 1): with it
/// clear and no PS/2 device in the DSDT, Linux skips its i8042 probe ("PNP: No PS/2 controller
/// found"), which could only fail on guestmem's key-less stubs; `reboot=k` writes the reset
/// command to port 0x64 itself, without the driver.
const IAPC_BOOT_ARCH: u16 = (1 << 2) | (1 << 3) | (1 << 4) | (1 << 5);

/// One table's bytes and the guest address they go to.
#[derive(Debug)]
struct Table {
    gpa: u64,
    bytes: Vec<u8>,
}

/// The bytes of an ACPI object (a table, an AML term).
fn bytes(object: &dyn Aml) -> Vec<u8> {
    let mut out = Vec::new();
    object.to_aml_bytes(&mut out);
    out
}

/// `gpa` rounded up to the next table boundary.
fn align(gpa: u64) -> u64 {
    gpa.next_multiple_of(TABLE_ALIGN)
}

/// The DSDT: the COM1 UART (`PNP0501`, ports 0x3f8-0x3ff, edge-triggered active-high GSI 4),
/// as Firecracker describes it. With hardware-reduced ACPI Linux has no legacy PIC and maps no
/// ISA IRQ by default; the 8250 PnP driver takes the UART's interrupt from here. Revision 2:
/// AML integers are 64 bits.
fn dsdt() -> Vec<u8> {
    let port = SERIAL_PORT;
    let com1 = bytes(&Device::new(
        Path::new("_SB_.COM1"),
        vec![
            &Name::new(Path::new("_HID"), &EISAName::new("PNP0501")),
            &Name::new(Path::new("_UID"), &0u8),
            &Name::new(Path::new("_DDN"), &"COM1"),
            &Name::new(
                Path::new("_CRS"),
                &ResourceTemplate::new(vec![
                    &Interrupt::new(true, true, false, false, COM1_GSI),
                    &IO::new(port, port, 1, COM1_PORTS),
                ]),
            ),
        ],
    ));
    let mut table = Sdt::new(*b"DSDT", 36, 2, OEM_ID, *b"GMVMDSDT", OEM_REVISION);
    table.append_slice(&com1);
    table.as_slice().to_vec()
}

/// The FADT (revision 6.5, from the crate), pointing at the DSDT by its 64-bit `X_DSDT`. Its
/// flags, as Firecracker sets them:
/// - `HW_REDUCED_ACPI` (bit 20): there are no fixed-hardware ACPI registers (PM1 event and
///   control blocks, PM timer, GPEs), no SCI and no FACS; Linux then also skips the legacy PIC
///   and the PIT setup and runs on the LAPIC timer (TSC deadline where the CPUID has it).
/// - `PWR_BUTTON` and `SLP_BUTTON` (bits 4, 5): no fixed-feature power or sleep button.
///
/// and the IA-PC boot flags of [`IAPC_BOOT_ARCH`].
fn fadt(dsdt_gpa: u64) -> Vec<u8> {
    let mut builder = FADTBuilder::new(OEM_ID, *b"GMVMFACP", OEM_REVISION)
        .dsdt_64(dsdt_gpa)
        .flag(Flags::HwReducedAcpi)
        .flag(Flags::PwrButton)
        .flag(Flags::SlpButton);
    builder.iapc_boot_arch = IAPC_BOOT_ARCH.into();
    builder.hypervisor_vendor_identity = u64::from_le_bytes(HYPERVISOR_VENDOR_ID).into();
    bytes(&builder.finalize())
}

/// The MADT: the LAPICs at [`APIC_ADDR`], one Local APIC entry per vCPU (enabled, processor
/// UID and APIC id the vCPU's index, the ids `LinuxVm::new` gives its vCPUs), then the IOAPIC
/// at [`IOAPIC_ADDR`] with GSI base 0 and the MP table's id, `vcpus + 1` (Firecracker's MADT
/// says 0; Linux takes any id no other IOAPIC has, and 64-bit Linux never writes it to the
/// IOAPIC). No interrupt source overrides: KVM's default routing has GSI i on IOAPIC pin i, the
/// PIT's included, which is ACPI's identity default. The flags stay 0 (no `PCAT_COMPAT`):
/// with hardware-reduced ACPI the kernel does not use the 8259s.
fn madt(vcpus: u8) -> Vec<u8> {
    let mut madt = MADT::new(
        OEM_ID,
        *b"GMVMAPIC",
        OEM_REVISION,
        LocalInterruptController::Address(APIC_ADDR),
    );
    for id in 0..vcpus {
        madt.add_structure(ProcessorLocalApic::new(id, id, EnabledStatus::Enabled));
    }
    madt.add_structure(IoApic::new(vcpus + 1, IOAPIC_ADDR, 0));
    bytes(&madt)
}

/// The XSDT, listing `entries` (the FADT and the MADT; the DSDT is reached through the FADT).
fn xsdt(entries: &[u64]) -> Vec<u8> {
    let mut xsdt = XSDT::new(OEM_ID, *b"GMVMXSDT", OEM_REVISION);
    for &entry in entries {
        xsdt.add_entry(entry);
    }
    bytes(&xsdt)
}

/// Every table for `vcpus` vCPUs at its guest address: the RSDP (revision 2, its checksum over
/// the first 20 bytes and its extended checksum over all 36) at [`RSDP_GPA`], then the XSDT,
/// FADT, MADT and DSDT, each on a 16-byte boundary.
fn tables(vcpus: u8) -> Vec<Table> {
    let madt = madt(vcpus);
    let dsdt = dsdt();
    let xsdt_gpa = align(RSDP_GPA + Rsdp::len() as u64);
    let fadt_gpa = align(xsdt_gpa + 36 + 8 * XSDT_ENTRIES);
    let madt_gpa = align(fadt_gpa + FADT::len() as u64);
    let dsdt_gpa = align(madt_gpa + madt.len() as u64);
    vec![
        Table {
            gpa: RSDP_GPA,
            bytes: bytes(&Rsdp::new(OEM_ID, xsdt_gpa)),
        },
        Table {
            gpa: xsdt_gpa,
            bytes: xsdt(&[fadt_gpa, madt_gpa]),
        },
        Table {
            gpa: fadt_gpa,
            bytes: fadt(dsdt_gpa),
        },
        Table {
            gpa: madt_gpa,
            bytes: madt,
        },
        Table {
            gpa: dsdt_gpa,
            bytes: dsdt,
        },
    ]
}

/// Writes the ACPI tables for `vcpus` vCPUs into guest memory (which must reach 1 MiB, as a
/// Linux guest's does) and returns the RSDP's address, [`RSDP_GPA`]. Refuses a vCPU count the
/// MADT cannot hold (APIC ids are 8 bits, and the IOAPIC takes `vcpus + 1`) and tables that
/// would run past the BIOS area.
pub(crate) fn write_acpi_tables(memory: &GuestMemory, vcpus: usize) -> Result<u64> {
    let n = u8::try_from(vcpus)
        .ok()
        .filter(|n| (1..u8::MAX).contains(n))
        .ok_or_else(|| Error::Config(format!("{vcpus} vCPUs do not fit in an ACPI MADT")))?;
    let tables = tables(n);
    let end = tables
        .iter()
        .map(|t| t.gpa + t.bytes.len() as u64)
        .max()
        .unwrap_or(RSDP_GPA);
    if end > HIMEM_GPA {
        return Err(Error::Config(format!(
            "the ACPI tables for {vcpus} vCPUs end at {end:#x}, past the BIOS area"
        )));
    }
    for table in &tables {
        memory.write(table.gpa, &table.bytes)?;
    }
    Ok(RSDP_GPA)
}

#[cfg(test)]
mod tests {
    use guestmem_memory::{Backend, RegionSpec};

    use super::*;
    use crate::linux::boot::{EBDA_GPA, MAX_MEMORY};
    use crate::linux::{mptable, MAX_VCPUS};

    /// A little-endian integer of `N` bytes at `at` in `b`.
    fn le<const N: usize>(b: &[u8], at: usize) -> u64 {
        let mut v = [0u8; 8];
        v[..N].copy_from_slice(&b[at..at + N]);
        u64::from_le_bytes(v)
    }

    fn sum(b: &[u8]) -> u8 {
        b.iter().fold(0u8, |a, x| a.wrapping_add(*x))
    }

    /// Guest memory as a Linux guest's (one region at 0, past 1 MiB) with the tables for
    /// `vcpus` written, and the RSDP address returned.
    fn written(vcpus: usize) -> (GuestMemory, u64) {
        let spec = RegionSpec::new("ram", 0, 4 << 20, Backend::Anon);
        let memory = GuestMemory::new(&[spec], None).unwrap();
        let rsdp = write_acpi_tables(&memory, vcpus).unwrap();
        (memory, rsdp)
    }

    /// The table at `gpa`, read back by the length its header gives; its checksum must sum to
    /// zero over that length and its signature be `signature`.
    fn table(memory: &GuestMemory, gpa: u64, signature: &[u8; 4]) -> Vec<u8> {
        let mut header = [0u8; 36];
        memory.read(gpa, &mut header).unwrap();
        assert_eq!(&header[..4], signature, "the table at {gpa:#x}");
        let mut bytes = vec![0u8; guestmem_sys::to_usize(le::<4>(&header, 4))];
        memory.read(gpa, &mut bytes).unwrap();
        assert_eq!(
            sum(&bytes),
            0,
            "{} checksum",
            String::from_utf8_lossy(signature)
        );
        bytes
    }

    /// The RSDP at its address: signature, revision 2, both checksums, and the XSDT address.
    fn rsdp(memory: &GuestMemory, gpa: u64) -> u64 {
        assert_eq!(gpa, RSDP_GPA);
        let mut r = [0u8; 36];
        memory.read(gpa, &mut r).unwrap();
        assert_eq!(&r[..8], b"RSD PTR ");
        assert_eq!((r[15], le::<4>(&r, 20)), (2, 36), "revision 2, 36 bytes");
        assert_eq!(sum(&r[..20]), 0, "checksum");
        assert_eq!(sum(&r), 0, "extended checksum");
        le::<8>(&r, 24)
    }

    /// A MADT's Local APIC entries (APIC id, flags) and IOAPIC entries (id, address, GSI base);
    /// any other entry type fails the test, as do entries that overrun the table.
    #[allow(clippy::type_complexity)]
    fn madt_entries(madt: &[u8]) -> (Vec<(u8, u64)>, Vec<(u8, u64, u64)>) {
        let (mut lapics, mut ioapics) = (Vec::new(), Vec::new());
        let mut at = 44;
        while at < madt.len() {
            match madt[at] {
                0 => lapics.push((madt[at + 3], le::<4>(madt, at + 4))),
                1 => ioapics.push((madt[at + 2], le::<4>(madt, at + 4), le::<4>(madt, at + 8))),
                other => panic!("unexpected MADT entry type {other}"),
            }
            at += usize::from(madt[at + 1]);
        }
        assert_eq!(at, madt.len());
        (lapics, ioapics)
    }

    /// Read back from guest memory, the tables chain RSDP -> XSDT -> FADT and MADT, FADT ->
    /// DSDT, each summing to zero; the FADT is hardware-reduced; the MADT has one enabled LAPIC
    /// per vCPU with ids 0..n and the one IOAPIC (id n + 1, 0xfec00000, GSI base 0).
    #[test]
    fn the_acpi_tables_chain_from_the_rsdp_and_describe_every_vcpu_and_the_ioapic() {
        for vcpus in [1, 2, MAX_VCPUS] {
            let (memory, rsdp_gpa) = written(vcpus);
            let xsdt = table(&memory, rsdp(&memory, rsdp_gpa), b"XSDT");
            assert_eq!(xsdt.len(), 36 + 16, "two entries");
            let fadt = table(&memory, le::<8>(&xsdt, 36), b"FACP");
            let flags = le::<4>(&fadt, 112);
            assert_eq!(flags & (1 << 20), 1 << 20, "HW_REDUCED_ACPI");
            assert_eq!(le::<2>(&fadt, 109), u64::from(IAPC_BOOT_ARCH));
            let dsdt = table(&memory, le::<8>(&fadt, 140), b"DSDT");
            assert!(dsdt.windows(4).any(|w| w == b"COM1"), "the DSDT has COM1");
            let madt = table(&memory, le::<8>(&xsdt, 44), b"APIC");
            assert_eq!(le::<4>(&madt, 36), u64::from(APIC_ADDR));
            let (lapics, ioapics) = madt_entries(&madt);
            let expected: Vec<_> = (0..vcpus).map(|i| (u8::try_from(i).unwrap(), 1)).collect();
            assert_eq!(lapics, expected, "{vcpus} enabled LAPICs, ids 0..{vcpus}");
            let ioapic_id = u8::try_from(vcpus + 1).unwrap();
            assert_eq!(ioapics, [(ioapic_id, u64::from(IOAPIC_ADDR), 0)]);
        }
    }

    /// The tables sit in the BIOS area: past every e820 RAM range, the MP table and the boot
    /// tables (all below the EBDA's end), and below 1 MiB, without overlapping each other.
    #[test]
    fn the_acpi_tables_stay_out_of_ram_the_mp_table_and_each_other() {
        let mut ranges: Vec<(u64, u64)> = tables(u8::try_from(MAX_VCPUS).unwrap())
            .iter()
            .map(|t| (t.gpa, t.gpa + t.bytes.len() as u64))
            .collect();
        ranges.sort_unstable();
        let mptable_end = EBDA_GPA + mptable::mptable(MAX_VCPUS).len() as u64;
        let ram = [(0, EBDA_GPA), (HIMEM_GPA, MAX_MEMORY)];
        for &(start, end) in &ranges {
            assert!(
                start >= mptable_end && end <= HIMEM_GPA,
                "{start:#x}-{end:#x}"
            );
            for &(r0, r1) in &ram {
                assert!(end <= r0 || start >= r1, "{start:#x}-{end:#x} is in RAM");
            }
            assert_eq!(start % TABLE_ALIGN, 0);
        }
        assert!(ranges.windows(2).all(|w| w[0].1 <= w[1].0), "{ranges:x?}");
        assert_eq!(ranges[0].0, RSDP_GPA);
    }

    /// No vCPU, or more than the MADT's 8-bit APIC ids leave room for beside the IOAPIC, is
    /// refused.
    #[test]
    fn a_vcpu_count_the_madt_cannot_hold_is_refused() {
        let spec = RegionSpec::new("ram", 0, 4 << 20, Backend::Anon);
        let memory = GuestMemory::new(&[spec], None).unwrap();
        for vcpus in [0, 255, 300] {
            let e = write_acpi_tables(&memory, vcpus).unwrap_err().to_string();
            assert!(e.contains("do not fit in an ACPI MADT"), "{e}");
        }
    }
}
