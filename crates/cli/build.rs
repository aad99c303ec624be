//! The CLI's own tests run the `guestmem` binary on the real /dev/kvm: the same gate as the
//! end-to-end test crate.
include!("../../tests/build.rs");
