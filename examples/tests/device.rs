//! The example VMM's device keeps writing guest memory while the VM moves: every page it wrote
//! arrives (the digest of its region at the switch-over is the same on both sides), and its
//! state goes on at the destination (its counters continue, and every buffer holds its last
//! fill after it ran there). On the real /dev/kvm and userfaultfd.

use guestmem_examples::rng::{Writes, QUEUE_SIZE};
use guestmem_examples::vmm::{self, How, Outcome};
use guestmem_migration::migrate::Mode;

fn try_run(how: How, writes: Writes, name: &str) -> Result<Outcome, String> {
    let scratch =
        std::env::temp_dir().join(format!("guestmem-examples-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).unwrap();
    let outcome = vmm::run(how, writes, &scratch);
    let _ = std::fs::remove_dir_all(&scratch);
    outcome.map_err(|e| guestmem_migration::error_chain(&*e, ": "))
}

fn run(how: How, name: &str) -> Outcome {
    checked(try_run(how, Writes::Queue, name), name)
}

/// The checks every run passes.
fn checked(outcome: Result<Outcome, String>, name: &str) -> Outcome {
    let o = outcome.unwrap_or_else(|e| panic!("{name}: {e}"));
    // Every device-written page arrived.
    assert_eq!(o.source.digest, o.arrived.digest, "{name}: {o:?}");
    // The device's state resumed where the source stopped it, and it went on.
    assert_eq!(o.arrived.restored, o.source.stopped, "{name}");
    assert!(
        o.source.stopped.seq > u64::from(QUEUE_SIZE),
        "{name}: {o:?}"
    );
    assert!(
        o.arrived.after.seq > o.source.stopped.seq + 500,
        "{name}: {o:?}"
    );
    assert_eq!(
        o.arrived.verified_buffers,
        usize::from(QUEUE_SIZE),
        "{name}"
    );
    // So did the guest.
    assert!(
        o.arrived.guest_pages.1 > o.arrived.guest_pages.0,
        "{name}: {o:?}"
    );
    o
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn precopy_with_a_writing_device() {
    let o = run(How::Migrate(Mode::Precopy), "precopy");
    assert!(o.downtime_ms > 0.0);
    // The device wrote while the pages moved.
    assert!(o.source.stopped.seq > o.source.moving.seq, "{o:?}");
}

#[test]
#[cfg_attr(
    any(not(kvm), not(uffd)),
    ignore = "no usable /dev/kvm or /dev/userfaultfd"
)]
fn postcopy_and_hybrid_with_a_writing_device() {
    let o = run(How::Migrate(Mode::Postcopy), "postcopy");
    assert!(o.source.stopped.seq >= o.source.moving.seq, "{o:?}");
    // Its answers came compressed (the example asks for zstd) and landed right.
    assert!(o.compressed_frames > 0, "{o:?}");
    // Hybrid's pre-copy round runs while the device writes.
    let o = run(How::Migrate(Mode::Hybrid), "hybrid");
    assert!(o.source.stopped.seq > o.source.moving.seq, "{o:?}");
}

#[test]
#[cfg_attr(
    any(not(kvm), not(uffd)),
    ignore = "no usable /dev/kvm or /dev/userfaultfd"
)]
fn lazy_snapshot_restore_with_a_writing_device() {
    run(How::Snapshot("lazy"), "lazy");
}

#[test]
#[cfg_attr(
    any(not(kvm), not(uffd)),
    ignore = "no usable /dev/kvm or /dev/userfaultfd"
)]
fn lazy_restore_into_a_prepared_vm_with_a_writing_device() {
    run(How::Snapshot("lazy-prepared"), "lazy-prepared");
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn full_snapshot_restore_with_a_writing_device() {
    run(How::Snapshot("full"), "full");
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn writes_outside_guestmem_arrive_when_the_device_reports_them() {
    // The device writes through raw host pointers and lists what it wrote in dirty_log: the
    // driver marks those pages before each harvest, and the pre-copy's digest check passes.
    let name = "raw-reported";
    let o = checked(
        try_run(How::Migrate(Mode::Precopy), Writes::RawReported, name),
        name,
    );
    assert!(o.source.stopped.seq > o.source.moving.seq, "{o:?}");
    // Unreported, the same writes escape the rounds: the digest check refuses the switch-over.
    let e = try_run(
        How::Migrate(Mode::Precopy),
        Writes::RawUnreported,
        "raw-unreported",
    )
    .expect_err("a migration that lost the device's writes is refused");
    assert!(e.contains("digest"), "{e}");
}
