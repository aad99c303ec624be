//! The example VMM's tests run on the real /dev/kvm: the same gate as the end-to-end test crate
//! (without it those tests are reported as ignored, and the build says so loudly).
include!("../tests/build.rs");
