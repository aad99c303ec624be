//! `guestmem payload`: writes the guest payload out, for other VMMs to boot the same workload.
//!
//! The ELF's PVH entry runs the workload baked into it on vCPU 0 (other vCPUs stay parked),
//! with no VMM writing the control block: see `guestmem_vm::payload::PvhParams`.
//!
//! Guest memory under QEMU (`pc` machine, `-m SIZE`): RAM from 0 to min(SIZE, 3 GiB) (all of it
//! below 4 GiB up to 3.5 GiB; from 3.5 GiB on, QEMU keeps 3 GiB below 4 GiB), the rest from
//! 4 GiB; the e820 map the PVH entry gets says so, and the payload skips the hole. The payload
//! area (page tables, control blocks) is [1 MiB, 8 MiB); vCPU 0's control block is at 0x400000.

use std::path::PathBuf;

use guestmem_vm::payload::{self, PvhParams, PvhWorkload};

use crate::units::parse_size;

#[derive(clap::Args)]
pub struct Args {
    /// Where to write the payload as an ELF with a PVH entry (`qemu-system-x86_64 -kernel FILE`).
    #[arg(long)]
    pvh_elf: PathBuf,
    /// The workload vCPU 0 runs: dirty (rewrite every page until stopped), touch (every page
    /// once) or rewrite (as dirty, 2-33 of each page's 64-byte lines copied from another page).
    #[arg(long, default_value = "dirty")]
    workload: PvhWorkload,
    /// Throttle `dirty` to this many pages of 4 KiB per second (default: full speed).
    #[arg(long)]
    pages_per_s: Option<u64>,
    /// With --pages-per-s: the first pass goes at full speed (fills the range), the throttle
    /// applies from the second.
    #[arg(long)]
    fill_first: bool,
    /// The guest's TSC rate, for the throttle (default: what KVM gives a new vCPU here, which
    /// is what QEMU's guests get without `-cpu ...,tsc-frequency=`).
    #[arg(long)]
    tsc_khz: Option<u64>,
    /// First guest-physical byte of the range (rounded up to 2 MiB; at least 8M, above the
    /// payload area).
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    range_start: u64,
    /// At most this many bytes of RAM from --range-start, holes skipped (default: all RAM).
    #[arg(long, value_parser = parse_size)]
    range_bytes: Option<u64>,
    /// Seed of the values written.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

pub fn main(args: Args) -> crate::Result<()> {
    let tsc_khz = match (args.pages_per_s, args.tsc_khz) {
        (_, Some(khz)) => khz,
        (Some(_), None) => guestmem_vm::host_tsc_khz().map_err(|e| {
            format!(
                "cannot ask KVM for the TSC rate (give --tsc-khz): {}",
                guestmem_migration::error_chain(&e, ": ")
            )
        })?,
        (None, None) => 0,
    };
    if args.fill_first && args.pages_per_s.is_none() {
        return Err("--fill-first goes with --pages-per-s".into());
    }
    let params = PvhParams::for_workload(
        args.workload,
        args.pages_per_s,
        args.fill_first,
        tsc_khz,
        args.range_start,
        args.range_bytes.unwrap_or(0),
        args.seed,
    )?;
    payload::write_pvh_elf(&args.pvh_elf, &params)?;
    println!(
        "{}: {} bytes; boot it with: qemu-system-x86_64 -accel kvm -cpu host -m 2G -kernel {}",
        args.pvh_elf.display(),
        payload::PVH_ELF.len(),
        args.pvh_elf.display()
    );
    println!(
        "vCPU 0's control block is at {:#x}: state at +{:#x}, pages done at +{:#x}, passes at \
         +{:#x} (QEMU monitor: xp /3gx {:#x})",
        payload::VCPU_BLOCKS_GPA,
        payload::CTL_STATE,
        payload::CTL_PAGES_DONE,
        payload::CTL_GENERATION,
        payload::VCPU_BLOCKS_GPA + payload::CTL_STATE
    );
    if tsc_khz != 0 {
        println!(
            "throttle: {} TSC ticks per page at {tsc_khz} kHz",
            params.tsc_per_page
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> Args {
        let mut all = vec!["payload"];
        all.extend_from_slice(extra);
        match crate::tests::parse_for_test(&all).unwrap() {
            crate::Command::Payload(a) => a,
            _ => unreachable!("payload parses as itself"),
        }
    }

    /// The payload is written as the ELF the VMM boots; --fill-first alone is refused.
    #[test]
    fn the_payload_is_written_or_the_flags_refused() {
        let path = std::env::temp_dir().join(format!("guestmem-pvh-{}.elf", std::process::id()));
        let p = path.to_str().unwrap();
        main(args(&["--pvh-elf", p, "--workload", "touch"])).unwrap();
        let elf = std::fs::read(&path).unwrap();
        assert_eq!(&elf[..4], b"\x7fELF");
        assert_eq!(elf.len(), payload::PVH_ELF.len());
        let e = main(args(&["--pvh-elf", p, "--fill-first"]))
            .unwrap_err()
            .to_string();
        assert_eq!(e, "--fill-first goes with --pages-per-s");
        let _ = std::fs::remove_file(&path);
    }
}
