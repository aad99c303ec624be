//! An example VMM on guestmem: the payload's `dirty` workload on 2 vCPUs plus a virtio
//! entropy-style device filling the buffers posted on its queue, moved while both run.
//!
//! ```text
//! cargo run --release --example device_vmm -- [precopy|postcopy|hybrid|full|map|lazy]
//! ```
//!
//! The first three migrate the VM live to a destination in another thread (over a Unix socket,
//! TLS with both sides authenticated); the last three write a snapshot and restore it. Either
//! way it prints the device's counters on both sides and the digests of the device's guest
//! region at the switch-over, then lets the guest and the device go on at the destination.
//! The integration code (the component traits implemented, the driver's calls) is
//! `examples/src/rng.rs` and `examples/src/vmm.rs`.

use guestmem_examples::rng::Writes;
use guestmem_examples::vmm::{self, How};
use guestmem_migration::migrate::Mode;

fn main() {
    let arg = std::env::args().nth(1).unwrap_or_else(|| "precopy".into());
    let how = match arg.as_str() {
        "precopy" => How::Migrate(Mode::Precopy),
        "postcopy" => How::Migrate(Mode::Postcopy),
        "hybrid" => How::Migrate(Mode::Hybrid),
        "full" => How::Snapshot("full"),
        "map" => How::Snapshot("map"),
        "lazy" => How::Snapshot("lazy"),
        other => {
            eprintln!("device_vmm: '{other}'? precopy, postcopy, hybrid, full, map or lazy");
            std::process::exit(2);
        }
    };
    let scratch = std::env::temp_dir().join(format!("guestmem-device-vmm-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).expect("a scratch directory");
    let outcome = vmm::run(how, Writes::Queue, &scratch);
    let _ = std::fs::remove_dir_all(&scratch);
    match outcome {
        Ok(o) => {
            println!("{arg}: downtime {:.1} ms", o.downtime_ms);
            println!(
                "device at the source's stop: {} buffers filled ({} bytes); restored: {}",
                o.source.stopped.seq, o.source.stopped.bytes, o.arrived.restored.seq
            );
            println!(
                "device region digest: source {:#018x}, destination {:#018x} ({})",
                o.source.digest,
                o.arrived.digest,
                if o.source.digest == o.arrived.digest {
                    "equal"
                } else {
                    "DIFFERENT"
                }
            );
            println!(
                "then at the destination: {} buffers filled, all {} buffers hold their last \
                 fill; the guest went on from {} to {} pages",
                o.arrived.after.seq,
                o.arrived.verified_buffers,
                o.arrived.guest_pages.0,
                o.arrived.guest_pages.1
            );
        }
        Err(e) => {
            eprintln!("device_vmm: {}", guestmem_migration::error_chain(&*e, ": "));
            std::process::exit(1);
        }
    }
}
