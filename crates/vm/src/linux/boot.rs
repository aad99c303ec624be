//! The Linux boot recipe's memory side: the kernel image checked and loaded (bzImage or ELF
//! `vmlinux`, through `linux-loader`), the initramfs placed, the command line, the e820 map and
//! the zero page (`boot_params`) written, all before a vCPU runs. Everything the user gave that
//! cannot boot is refused here, naming what is wrong: a file that is no kernel, a truncated
//! bzImage, an initramfs that does not fit, a command line over the kernel's limit.
//!
//! Guest physical layout (Firecracker's, `arch/x86_64/layout.rs`): GDT at 0x500, IDT at 0x520,
//! the zero page at 0x7000, the boot stack below 0x8ff0, the boot page tables at 0x9000-0xbfff,
//! the command line at 0x20000, RAM from 0 to 0x9fc00 (below the EBDA) and from 1 MiB to the end
//! of memory; the MP table at the EBDA (0x9fc00), the ACPI tables from 0xe0000 (the RSDP first,
//! named in the zero page); the bzImage at its `code32_start` (1 MiB), the initramfs at the top
//! of memory.

use std::io::Cursor;
use std::path::Path;

use guestmem_memory::GuestMemory;
use linux_loader::loader::bootparam::{boot_e820_entry, boot_params, setup_header};
use linux_loader::loader::{BzImage, Elf, KernelLoader, KernelLoaderResult};
use vm_memory::{ByteValued, GuestAddress};

use crate::{Error, Result};

/// The GDT's guest physical address.
pub const GDT_GPA: u64 = 0x500;
/// The (empty) IDT's guest physical address.
pub const IDT_GPA: u64 = 0x520;
/// The zero page (`boot_params`), handed to the kernel in RSI.
pub const ZERO_PAGE_GPA: u64 = 0x7000;
/// The boot stack's top.
pub const BOOT_STACK_GPA: u64 = 0x8ff0;
/// The boot page tables: PML4, then one PDPT and one PD mapping the first GiB.
pub const PML4_GPA: u64 = 0x9000;
/// The command line.
pub const CMDLINE_GPA: u64 = 0x2_0000;
/// Where the EBDA would start: the end of low RAM in the e820 map.
pub const EBDA_GPA: u64 = 0x9_fc00;
/// The ACPI RSDP, the first of the ACPI tables ([`super::acpi`]): Firecracker's address, in the
/// BIOS area (0xe0000-0xfffff) that the e820 map leaves out and where a kernel that scans for
/// the RSDP looks; the zero page's `acpi_rsdp_addr` names it.
pub const RSDP_GPA: u64 = 0xe_0000;
/// Where high memory (and the kernel) starts.
pub const HIMEM_GPA: u64 = 0x10_0000;
/// The most guest RAM a Linux guest gets here: all of it sits below the 32-bit MMIO hole
/// (IOAPIC at 0xfec00000, LAPIC at 0xfee00000), in one region at guest address 0.
pub const MAX_MEMORY: u64 = 3 << 30;
/// The command-line limit of a kernel whose header does not say (ELF `vmlinux`, and bzImages
/// of boot protocol before 2.06): x86's `COMMAND_LINE_SIZE`, its terminating NUL included.
const DEFAULT_CMDLINE_MAX: u64 = 2048;
/// `setup_header.xloadflags`: the kernel has a 64-bit entry point at `code32_start + 0x200`.
const XLF_KERNEL_64: u16 = 1;
/// e820 type of usable RAM.
const E820_RAM: u32 = 1;
/// `setup_header.type_of_loader`: a boot loader without an assigned id.
const LOADER_OTHER: u8 = 0xff;
/// The boot protocol's magic: "HdrS" at 0x202.
const HDRS: u32 = 0x5372_6448;

/// Which kind of kernel image was given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelKind {
    /// A bzImage, entered at its 64-bit entry point.
    BzImage,
    /// An ELF `vmlinux`, entered at its ELF entry point through the 64-bit boot protocol.
    Elf,
}

/// A Linux guest's boot, checked against the guest memory it will get: the kernel image, the
/// initramfs and where it goes, the command line. Built by [`BootPlan::check`] before any VM
/// exists, so that bad input is refused before anything is created.
pub struct BootPlan {
    kernel: Vec<u8>,
    kind: KernelKind,
    /// The bzImage's setup header (none for ELF).
    header: Option<setup_header>,
    initrd: Vec<u8>,
    initrd_gpa: u64,
    cmdline: String,
    memory: u64,
}

impl std::fmt::Debug for BootPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BootPlan")
            .field("kind", &self.kind)
            .field("kernel_bytes", &self.kernel.len())
            .field("initrd_bytes", &self.initrd.len())
            .field("initrd_gpa", &self.initrd_gpa)
            .field("cmdline", &self.cmdline)
            .field("memory", &self.memory)
            .finish()
    }
}

fn boot_error(msg: String) -> Error {
    Error::Config(msg)
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / f64::from(1u32 << 20))
}

impl BootPlan {
    /// Reads and checks `kernel`, `initrd` (if any) and `cmdline` against `memory` bytes of
    /// guest RAM. Refuses, naming the file or the limit: a file that is neither a bzImage nor
    /// an ELF image, a bzImage shorter than its header says or without a 64-bit entry point, a
    /// command line longer than the kernel takes, memory over [`MAX_MEMORY`], an initramfs
    /// that does not fit between the kernel's decompression area and the top of memory.
    pub fn check(
        kernel: &Path,
        initrd: Option<&Path>,
        cmdline: &str,
        memory: u64,
    ) -> Result<BootPlan> {
        if memory > MAX_MEMORY {
            return Err(boot_error(format!(
                "a Linux guest gets at most {} of memory here (all below the 32-bit MMIO hole); {} requested",
                mib(MAX_MEMORY),
                mib(memory)
            )));
        }
        let read = |p: &Path, what: &str| {
            std::fs::read(p)
                .map_err(|e| boot_error(format!("cannot read the {what} {}: {e}", p.display())))
        };
        let image = read(kernel, "kernel")?;
        let (kind, header) = inspect_kernel(&image)
            .map_err(|why| boot_error(format!("{} {why}", kernel.display())))?;
        let cmdline_max = match &header {
            Some(h) if h.version >= 0x0206 => u64::from(h.cmdline_size) + 1,
            _ => DEFAULT_CMDLINE_MAX,
        };
        if cmdline.len() as u64 >= cmdline_max {
            return Err(boot_error(format!(
                "the kernel command line is {} bytes; this kernel takes at most {} (boot protocol limit)",
                cmdline.len(),
                cmdline_max - 1
            )));
        }
        if cmdline.as_bytes().contains(&0) {
            return Err(boot_error(
                "the kernel command line contains a NUL byte".into(),
            ));
        }
        // What the kernel occupies from its load address while it decompresses and runs.
        let (load, need) = match &header {
            Some(h) => {
                let payload = image.len() as u64 - setup_bytes(h);
                (
                    u64::from(h.code32_start),
                    u64::from(h.init_size).max(payload),
                )
            }
            None => (HIMEM_GPA, image.len() as u64),
        };
        let kernel_end = (load + need).next_multiple_of(4096);
        if kernel_end > memory {
            return Err(boot_error(format!(
                "the kernel needs guest memory up to {} (its load address plus its init size); --memory is {}",
                mib(kernel_end),
                mib(memory)
            )));
        }
        let initrd_bytes = match initrd {
            Some(p) => read(p, "initramfs")?,
            None => Vec::new(),
        };
        let addr_max = header
            .as_ref()
            .filter(|h| h.version >= 0x0203)
            .map_or(0x37ff_ffff, |h| u64::from(h.initrd_addr_max));
        let top = memory.min(addr_max + 1);
        let size = initrd_bytes.len() as u64;
        let initrd_gpa = top.checked_sub(size).map(|a| a & !0xfff);
        let initrd_gpa = match initrd_gpa {
            Some(a) if a >= kernel_end => a,
            _ => {
                return Err(boot_error(format!(
                "the initramfs {} ({}) does not fit in guest memory ({}) above the kernel, which \
                     needs up to {}: give --memory at least {}",
                initrd.map(|p| p.display().to_string()).unwrap_or_default(),
                mib(size),
                mib(memory),
                mib(kernel_end),
                mib((kernel_end + size).next_multiple_of(1 << 20))
            )))
            }
        };
        Ok(BootPlan {
            kernel: image,
            kind,
            header,
            initrd: initrd_bytes,
            initrd_gpa,
            cmdline: cmdline.to_string(),
            memory,
        })
    }

    /// The kind of kernel image.
    pub fn kind(&self) -> KernelKind {
        self.kind
    }

    /// The guest memory it was checked against.
    pub fn memory(&self) -> u64 {
        self.memory
    }

    /// Where the initramfs goes.
    pub fn initrd_gpa(&self) -> u64 {
        self.initrd_gpa
    }

    /// Writes the kernel, the initramfs, the command line and the zero page into `memory`
    /// (through guestmem's own write path, so every backend takes it, guest_memfd included)
    /// and returns the kernel's 64-bit entry point. `linux-loader` lays the kernel out in a
    /// scratch mapping first (it writes through vm-memory, which guest_memfd memory is not).
    pub fn load(&self, memory: &GuestMemory) -> Result<u64> {
        let scratch = vm_memory::GuestMemoryMmap::<()>::from_ranges(&[(
            GuestAddress(0),
            guestmem_sys::to_usize(self.memory),
        )])
        .map_err(|e| boot_error(format!("cannot map a scratch area to load the kernel: {e}")))?;
        let mut image = Cursor::new(&self.kernel);
        let loaded: KernelLoaderResult = match self.kind {
            KernelKind::BzImage => {
                BzImage::load(&scratch, None, &mut image, Some(GuestAddress(HIMEM_GPA)))
            }
            KernelKind::Elf => Elf::load(&scratch, None, &mut image, Some(GuestAddress(HIMEM_GPA))),
        }
        .map_err(|e| boot_error(format!("linux-loader refused the kernel: {e}")))?;
        let start = loaded.kernel_load.0;
        let end = loaded.kernel_end;
        let mut bytes = vec![0u8; guestmem_sys::to_usize(end - start)];
        vm_memory::Bytes::read_slice(&scratch, &mut bytes, loaded.kernel_load)
            .map_err(|e| boot_error(format!("cannot read the loaded kernel back: {e}")))?;
        drop(scratch);
        memory.write(start, &bytes)?;
        if !self.initrd.is_empty() {
            memory.write(self.initrd_gpa, &self.initrd)?;
        }
        let mut cmdline = self.cmdline.clone().into_bytes();
        cmdline.push(0);
        memory.write(CMDLINE_GPA, &cmdline)?;
        let params = self.boot_params(loaded.setup_header.or(self.header));
        memory.write(ZERO_PAGE_GPA, params.as_slice())?;
        Ok(match self.kind {
            KernelKind::BzImage => start + 0x200,
            KernelKind::Elf => start,
        })
    }

    /// The zero page: the image's setup header (bzImage) or the boot protocol's defaults (ELF),
    /// with the loader's fields, the initramfs, the command line, the e820 map and the ACPI RSDP
    /// (so that the kernel need not scan for it).
    #[allow(clippy::cast_possible_truncation)] // every address and size here is below 3 GiB
    fn boot_params(&self, header: Option<setup_header>) -> boot_params {
        let mut p = boot_params::default();
        match header {
            Some(h) => p.hdr = h,
            None => {
                p.hdr.boot_flag = 0xaa55;
                p.hdr.header = HDRS;
                p.hdr.kernel_alignment = 0x0100_0000;
            }
        }
        p.hdr.type_of_loader = LOADER_OTHER;
        p.hdr.cmd_line_ptr = CMDLINE_GPA as u32;
        p.hdr.cmdline_size = self.cmdline.len() as u32;
        if !self.initrd.is_empty() {
            p.hdr.ramdisk_image = self.initrd_gpa as u32;
            p.hdr.ramdisk_size = self.initrd.len() as u32;
        }
        let ram = [(0, EBDA_GPA), (HIMEM_GPA, self.memory - HIMEM_GPA)];
        for (i, (addr, size)) in ram.into_iter().enumerate() {
            p.e820_table[i] = boot_e820_entry {
                addr,
                size,
                r#type: E820_RAM,
            };
        }
        p.e820_entries = ram.len() as u8;
        p.acpi_rsdp_addr = RSDP_GPA;
        p
    }
}

/// The header of a bzImage's real-mode setup: how many bytes precede the protected-mode kernel.
fn setup_bytes(h: &setup_header) -> u64 {
    let sects = if h.setup_sects == 0 { 4 } else { h.setup_sects };
    (u64::from(sects) + 1) * 512
}

/// What kind of kernel `image` is, with a bzImage's setup header; or why it cannot boot here.
fn inspect_kernel(image: &[u8]) -> std::result::Result<(KernelKind, Option<setup_header>), String> {
    if image.starts_with(b"\x7fELF") {
        if image.get(4) != Some(&2) {
            return Err("is a 32-bit ELF image; a 64-bit kernel is needed".into());
        }
        return Ok((KernelKind::Elf, None));
    }
    let size = std::mem::size_of::<setup_header>();
    let Some(raw) = image.get(0x1f1..0x1f1 + size) else {
        return Err(format!(
            "is not a Linux kernel: {} bytes, too short for a bzImage header, and not an ELF image",
            image.len()
        ));
    };
    let mut h = setup_header::default();
    h.as_mut_slice().copy_from_slice(raw);
    if h.header != HDRS {
        return Err(
            "is not a Linux kernel: no bzImage header ('HdrS' at 0x202) and not an ELF image"
                .into(),
        );
    }
    if h.version < 0x0206 || h.loadflags & 1 == 0 {
        return Err(format!(
            "is an old kernel image (boot protocol {}.{:02}, or not loaded high); 2.06 or later is needed",
            h.version >> 8,
            h.version & 0xff
        ));
    }
    if h.xloadflags & XLF_KERNEL_64 == 0 {
        return Err("is a bzImage without a 64-bit entry point (xloadflags)".into());
    }
    let expected = setup_bytes(&h) + u64::from(h.syssize) * 16;
    if (image.len() as u64) < expected {
        return Err(format!(
            "is a truncated bzImage: its header says {expected} bytes, the file has {}",
            image.len()
        ));
    }
    Ok((KernelKind::BzImage, Some(h)))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A minimal bzImage: a setup header (protocol 2.15, 64-bit entry, loaded high) and
    /// `payload` bytes of protected-mode kernel, `init_size` bytes needed from 1 MiB.
    pub(crate) fn fake_bzimage(payload: usize, init_size: u32) -> Vec<u8> {
        let mut h = setup_header {
            setup_sects: 1,
            header: HDRS,
            version: 0x020f,
            loadflags: 1,
            xloadflags: XLF_KERNEL_64,
            code32_start: u32::try_from(HIMEM_GPA).unwrap(),
            initrd_addr_max: 0x7fff_ffff,
            cmdline_size: 2047,
            init_size,
            ..Default::default()
        };
        h.syssize = u32::try_from(payload.div_ceil(16)).unwrap();
        let mut image = vec![0u8; 1024 + payload];
        image[0x1f1..0x1f1 + std::mem::size_of::<setup_header>()].copy_from_slice(h.as_slice());
        image
    }

    fn file(dir: &Path, name: &str, bytes: &[u8]) -> std::path::PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }

    fn err(r: Result<BootPlan>) -> String {
        r.unwrap_err().to_string()
    }

    /// A good bzImage plans: the initramfs goes page-aligned at the top of memory.
    #[test]
    fn a_bzimage_and_initramfs_that_fit_are_planned_at_the_top_of_memory() {
        let dir = tempdir();
        let k = file(&dir, "bz", &fake_bzimage(64 << 10, 4 << 20));
        let i = file(&dir, "cpio", &[7u8; 5000]);
        let plan = BootPlan::check(&k, Some(&i), "console=ttyS0", 64 << 20).unwrap();
        assert_eq!(plan.kind(), KernelKind::BzImage);
        assert_eq!(plan.initrd_gpa(), ((64 << 20) - 5000) & !0xfff);
        let p = plan.boot_params(plan.header);
        assert_eq!((p.hdr.type_of_loader, p.hdr.cmd_line_ptr), (0xff, 0x2_0000));
        assert_eq!((p.hdr.ramdisk_size, p.e820_entries), (5000, 2));
        assert_eq!({ p.acpi_rsdp_addr }, RSDP_GPA);
        let ram = p.e820_table[1];
        assert_eq!({ ram.size }, (64 << 20) - HIMEM_GPA);
    }

    /// Not a kernel, a truncated bzImage, an initramfs larger than memory and a command line
    /// over the limit are each refused naming what is wrong.
    #[test]
    fn bad_boot_input_is_refused_naming_the_problem() {
        let dir = tempdir();
        let good = file(&dir, "bz", &fake_bzimage(64 << 10, 1 << 20));
        let text = file(&dir, "notes.txt", &[b'x'; 8192]);
        let e = err(BootPlan::check(&text, None, "", 64 << 20));
        assert!(e.contains("notes.txt is not a Linux kernel"), "{e}");
        let tiny = file(&dir, "tiny", b"hello");
        assert!(err(BootPlan::check(&tiny, None, "", 64 << 20)).contains("is not a Linux kernel"));
        let mut cut = fake_bzimage(64 << 10, 1 << 20);
        cut.truncate(cut.len() - 100);
        let cut = file(&dir, "cut", &cut);
        let e = err(BootPlan::check(&cut, None, "", 64 << 20));
        assert!(
            e.contains("truncated bzImage: its header says 66560 bytes, the file has 66460"),
            "{e}"
        );
        let big = file(&dir, "big.cpio", &vec![1u8; 70 << 20]);
        let e = err(BootPlan::check(&good, Some(&big), "", 64 << 20));
        assert!(
            e.contains("big.cpio (70.0 MiB) does not fit in guest memory (64.0 MiB)"),
            "{e}"
        );
        let e = err(BootPlan::check(&good, None, &"a".repeat(2048), 64 << 20));
        assert!(
            e.contains("command line is 2048 bytes; this kernel takes at most 2047"),
            "{e}"
        );
        assert!(BootPlan::check(&good, None, &"a".repeat(2047), 64 << 20).is_ok());
        let e = err(BootPlan::check(&good, None, "", 4 << 30));
        assert!(e.contains("at most 3072.0 MiB"), "{e}");
        let e = err(BootPlan::check(&dir.join("absent"), None, "", 64 << 20));
        assert!(e.contains("cannot read the kernel"), "{e}");
    }

    /// The host's own kernel (when /boot has one) is a bzImage that plans; cut short, it is
    /// refused as truncated.
    #[test]
    fn the_hosts_kernel_plans_and_a_truncated_copy_is_refused() {
        let Some(vmlinuz) = std::fs::read_dir("/boot").ok().and_then(|d| {
            d.flatten().map(|e| e.path()).find(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("vmlinuz"))
            })
        }) else {
            eprintln!("no /boot/vmlinuz*: nothing to check");
            return;
        };
        let plan = BootPlan::check(&vmlinuz, None, "console=ttyS0", 256 << 20).unwrap();
        assert_eq!(plan.kind(), KernelKind::BzImage);
        let dir = tempdir();
        let bytes = std::fs::read(&vmlinuz).unwrap();
        let cut = file(&dir, "cut", &bytes[..bytes.len() / 2]);
        let e = err(BootPlan::check(&cut, None, "", 256 << 20));
        assert!(e.contains("truncated bzImage"), "{e}");
    }

    pub(crate) fn tempdir() -> std::path::PathBuf {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let d = std::env::temp_dir().join(format!(
            "guestmem-boot-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
