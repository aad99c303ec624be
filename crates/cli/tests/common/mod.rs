//! What the CLI's tests share: where the `guestmem` binary they run is.

use std::ffi::OsString;

/// The `guestmem` binary under test: `$GUESTMEM_BIN` where it is set, else the one cargo built
/// beside these tests (`CARGO_BIN_EXE_guestmem`, the build's absolute path). The kernel lab sets
/// it: its guest holds the binary at a path of its own, since the build's path may not exist
/// there, or be hidden (a checkout under /tmp, which the lab's init mounts a tmpfs over).
pub fn guestmem_bin() -> OsString {
    std::env::var_os("GUESTMEM_BIN").unwrap_or_else(|| env!("CARGO_BIN_EXE_guestmem").into())
}
