//! `guestmem bench qemu-migrate`: one run of [`qemu_peer::precopy`], its figures as text or as
//! one JSON object.

use crate::qemu_peer;
use crate::units::parse_size;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Guest RAM (QEMU's -m), e.g. 1G.
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    size: u64,
    /// The guest's dirty rate after its fill, MiB/s (default: idle).
    #[arg(long)]
    dirty_mib_per_s: Option<u64>,
    /// QEMU's downtime-limit, ms.
    #[arg(long, default_value_t = 300)]
    downtime_limit_ms: u64,
    /// vCPUs (-smp); vCPU 0 runs the workload.
    #[arg(long, default_value_t = 1)]
    vcpus: usize,
    /// The migration channel: plain TCP, or TLS with both peers verified.
    #[arg(long, value_enum, default_value = "tls")]
    channel: qemu_peer::Channel,
    /// Migrate with multifd over this many channels (default: QEMU's single stream).
    #[arg(long)]
    multifd_channels: Option<usize>,
    /// With --multifd-channels: QEMU's multifd-compression.
    #[arg(long, value_enum, default_value = "none")]
    multifd_compression: qemu_peer::MultifdCompression,
    /// Print one JSON object instead of the text.
    #[arg(long)]
    json: bool,
}

pub fn main(args: Args) -> crate::Result<()> {
    let pages_per_s = args.dirty_mib_per_s.map(|m| m * 256);
    if pages_per_s == Some(0) {
        return Err("--dirty-mib-per-s must be at least 1 (leave it out for an idle guest)".into());
    }
    if !args.json {
        eprintln!(
            "booting QEMU with {} MiB (firmware and PVH entry: 5-20 s here), then migrating it...",
            args.size >> 20
        );
    }
    let f = qemu_peer::precopy(&qemu_peer::Config {
        mem: args.size,
        dirty_pages_per_s: pages_per_s,
        downtime_limit_ms: args.downtime_limit_ms,
        vcpus: args.vcpus,
        channel: args.channel,
        multifd: args.multifd_channels.map(|channels| qemu_peer::Multifd {
            channels,
            compression: args.multifd_compression,
        }),
        image: None,
        rewrite: false,
        link: None,
    })?;
    if args.json {
        println!("{}", serde_json::to_string(&f)?);
        return Ok(());
    }
    let rate = match f.dirty_pages_per_s {
        Some(p) => format!("{} MiB/s", p as f64 / 256.0),
        None => format!("idle ({} pages/s)", qemu_peer::IDLE_PAGES_PER_S),
    };
    println!(
        "{}: {} MiB, {} vCPU(s), dirtying {rate}, downtime limit {} ms, {}",
        f.qemu_version,
        f.mem_bytes >> 20,
        f.vcpus,
        f.downtime_limit_ms,
        f.config
    );
    println!(
        "boot {:.0} ms, fill of {} pages {:.0} ms",
        f.boot_ms, f.range_pages, f.fill_ms
    );
    println!(
        "pre-copy: total {} ms, downtime {} ms, setup {} ms, {} dirty syncs",
        f.total_ms, f.downtime_ms, f.setup_ms, f.dirty_sync_count
    );
    println!(
        "ram: {} bytes transferred ({:.1} MiB) of {} MiB; {} pages sent whole, {} as zero pages; \
         {:.0} Mbit/s at the end",
        f.bytes,
        f.bytes as f64 / f64::from(1 << 20),
        f.ram_total_bytes >> 20,
        f.normal_pages,
        f.zero_pages,
        f.end_mbit_per_s
    );
    println!(
        "guest: {:.0} pages/s while migrating, {:.0} pages/s on the destination after it",
        f.guest_pages_per_s_during, f.dest_pages_per_s
    );
    Ok(())
}
