//! An example VMM on guestmem's crates: guestmem's payload plus a host-side virtio device
//! ([`rng::RngDevice`], `virtio-queue` over guestmem memory) that keeps writing guest memory,
//! saved, restored and migrated through the component traits ([`vmm`]).

pub mod rng;
pub mod vmm;
