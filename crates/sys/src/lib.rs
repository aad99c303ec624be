//! Kernel interfaces guestmem needs beyond `kvm-bindings` and `libc` ([`uapi`]), and the
//! capability probe ([`probe`]): what the running kernel offers, found by asking it.

#![warn(missing_docs)]

pub mod probe;
pub mod uapi;
