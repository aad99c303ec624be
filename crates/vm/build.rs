//! Assembles the guest payload (payload/payload.S) with GNU binutils into a flat image, and
//! generates the control-block layout once for both sides: `control.inc` for the assembly and
//! `control.rs` for the host.
use std::path::PathBuf;
use std::process::Command;

/// The one definition of the control block and the payload's constants: (name, value).
const CONTROL: &[(&str, u64)] = &[
    // Host -> guest
    ("CTL_WORKLOAD", 0x00),
    ("CTL_RANGE_GPA", 0x08),
    ("CTL_RANGE_PAGES", 0x10),
    ("CTL_SEED", 0x18),
    ("CTL_TSC_PER_PAGE", 0x20),
    ("CTL_PASSES", 0x28),
    ("CTL_GEN_LIMIT", 0x30),
    ("CTL_STOP", 0x38),
    ("CTL_READ_PERCENT", 0x40),
    ("CTL_WRITES", 0x48),
    ("CTL_LOG_GPA", 0x50),
    ("CTL_THROTTLE_AFTER", 0x58),
    ("CTL_REWRITE", 0x60),
    // Guest -> host
    ("CTL_STATE", 0x80),
    ("CTL_PAGES_DONE", 0x88),
    ("CTL_GENERATION", 0x90),
    ("CTL_DIGEST", 0x98),
    ("CTL_TSC_START", 0xa0),
    ("CTL_TSC_END", 0xa8),
    // Values
    ("WORKLOAD_WRITE", 1),
    ("WORKLOAD_VERIFY", 2),
    ("WORKLOAD_RANDOM", 3),
    ("STATE_IDLE", 0),
    ("STATE_RUNNING", 1),
    ("STATE_DONE", 2),
    ("STATE_BAD_WORKLOAD", 3),
    // An address in the unbacked hole below the sys region: a write there is an MMIO exit.
    ("DONE_GPA", 0x1000),
    // Another: the throttle writes there the TSC ticks it would otherwise spin, and the host
    // sleeps them instead (capped; another VMM just ignores the write and the guest spins).
    ("SLEEP_GPA", 0x2000),
    // The throttle asks the host to sleep only when at least this many ticks ahead.
    ("SLEEP_MIN_TICKS", 0x10000),
    // Guest memory layout (crates/vm/src/layout.rs re-exports these): the PVH entry builds the
    // same page tables and control block at the same places as the host does for KVM.
    ("PAYLOAD_GPA", 0x10_0000),
    ("PML4_GPA", 0x11_0000),
    ("PDPT_GPA", 0x11_1000),
    ("PD_GPA", 0x20_0000),
    ("VCPU_BLOCKS_GPA", 0x40_0000),
    ("VCPU_BLOCK_SIZE", 0x2000),
    ("RAM_GPA", 0x4000_0000),
    // The PVH entry's alias of guest RAM (other VMMs leave holes in guest RAM, e.g. QEMU's
    // below 4 GiB): one contiguous virtual range from PVH_ALIAS_VA, mapped by the PDPT and the
    // page directories below onto the RAM the e820 map lists, in order, skipping the holes.
    ("PVH_ALIAS_VA", 0x80_0000_0000),
    ("PVH_ALIAS_PDPT_GPA", 0x11_2000),
    ("PVH_ALIAS_PD_GPA", 0x20_4000),
    ("PVH_ALIAS_MAX", 508 << 30),
];

fn run(cmd: &mut Command) {
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e} (install binutils: scripts/setup.sh)"));
    assert!(status.success(), "{cmd:?} failed with {status}");
}

fn main() {
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    println!("cargo::rerun-if-changed=payload/payload.S");
    println!("cargo::rerun-if-changed=build.rs");

    let inc: String = CONTROL
        .iter()
        .map(|(n, v)| format!("        .set {n}, {v:#x}\n"))
        .collect();
    std::fs::write(out.join("control.inc"), inc).unwrap();
    let rs: String = CONTROL
        .iter()
        .map(|(n, v)| {
            format!(
                "/// The payload's `{n}` (one definition for host and guest: crates/vm/build.rs).\n\
                 pub const {n}: u64 = {v:#x};\n"
            )
        })
        .collect();
    std::fs::write(out.join("control.rs"), rs).unwrap();

    let obj = out.join("payload.o");
    let elf = out.join("payload.elf");
    let bin = out.join("payload.bin");
    run(Command::new("as")
        .args(["--64", "-I"])
        .arg(&out)
        .arg("-o")
        .arg(&obj)
        .arg("payload/payload.S"));
    // The image is linked at the guest address it is loaded at (PAYLOAD_GPA), the PVH note
    // right behind the code, in one loadable segment.
    let script = out.join("payload.ld");
    std::fs::write(
        &script,
        "ENTRY(_start)\nSECTIONS\n{\n  . = 0x100000;\n  .text : { *(.text) }\n  \
         .note.Xen : { *(.note.Xen) }\n  /DISCARD/ : { *(.note.gnu.property) *(.comment) }\n}\n",
    )
    .unwrap();
    run(Command::new("ld")
        .args([
            "-m",
            "elf_x86_64",
            "-static",
            "-nostdlib",
            "-z",
            "noexecstack",
            "-T",
        ])
        .arg(&script)
        .arg("-o")
        .arg(&elf)
        .arg(&obj));
    // The flat image (what guestmem loads) is .text alone; the ELF, with its PVH note, is what
    // other VMMs boot (`qemu -kernel payload.elf`).
    run(Command::new("objcopy")
        .args(["-O", "binary", "-j", ".text"])
        .arg(&elf)
        .arg(&bin));
}
