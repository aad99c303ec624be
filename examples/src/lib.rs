//! An example VMM on guestmem's crates: guestmem's payload plus a host-side virtio device
//! ([`rng::RngDevice`], `virtio-queue` over guestmem memory) that keeps writing guest memory,
//! saved, restored and migrated through the component traits ([`vmm`]); and a real Linux
//! guest booted, snapshotted and restored lazily through the same traits ([`linux`]).

pub mod linux;
pub mod rng;
pub mod vmm;
