//! The end-to-end tests' build script: sets the `kvm` and `uffd` cfgs from the kernel
//! devices this machine has, so that tests needing a missing one are reported as ignored. The
//! gate itself is `build.rs`, which the other crates with device tests include as well.
include!("build.rs");
