//! The store's VM tests run on the real /dev/kvm and /dev/userfaultfd: the same gate as the
//! end-to-end test crate (without them those tests are reported as ignored, and the build
//! says so loudly).
include!("../../tests/build.rs");
