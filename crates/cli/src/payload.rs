//! `guestmem payload`: writes the guest payload out, for other VMMs to boot the same workload.

use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// Where to write the payload as an ELF with a PVH entry (`qemu-system-x86_64 -kernel FILE`).
    #[arg(long)]
    pvh_elf: PathBuf,
}

pub fn main(args: Args) -> crate::Result<()> {
    std::fs::write(&args.pvh_elf, guestmem_vm::payload::PVH_ELF)
        .map_err(|e| format!("{}: cannot write the payload: {e}", args.pvh_elf.display()))?;
    println!(
        "{}: {} bytes; boot it with: qemu-system-x86_64 -accel kvm -m 2G -kernel {}",
        args.pvh_elf.display(),
        guestmem_vm::payload::PVH_ELF.len(),
        args.pvh_elf.display()
    );
    Ok(())
}
