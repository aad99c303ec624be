//! userfaultfd on a guest_memfd mapping (the guest_memfd userfaultfd series, not upstream),
//! found by trying to register a mapped guest_memfd in each mode.

use crate::to_usize;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use kvm_ioctls::VmFd;
use userfaultfd::{RegisterMode, UffdBuilder};

use super::gmem_write::GMEM_SIZE_BYTES;
use super::util::{errno_name, last_errno};
use super::GuestMemfdUffd;
use crate::uapi::{self, kvm_create_guest_memfd};

/// Creates a 2 MiB guest_memfd on `vm` with `MMAP|INIT_SHARED`, maps it shared and tries
/// `UFFDIO_REGISTER` on the mapping with `MISSING` and with `MINOR`, each on a fresh
/// userfaultfd (and unregisters again).
pub fn guest_memfd_uffd(vm: &VmFd) -> Result<GuestMemfdUffd, String> {
    let flags = uapi::GUEST_MEMFD_FLAG_MMAP | uapi::GUEST_MEMFD_FLAG_INIT_SHARED;
    let raw = vm
        .create_guest_memfd(kvm_create_guest_memfd {
            size: GMEM_SIZE_BYTES,
            flags,
            ..Default::default()
        })
        .map_err(|e| {
            format!(
                "KVM_CREATE_GUEST_MEMFD(flags {flags:#x}) failed: {}",
                errno_name(e.errno())
            )
        })?;
    // SAFETY: `raw` is a fresh fd returned by KVM_CREATE_GUEST_MEMFD that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let len = to_usize(GMEM_SIZE_BYTES);
    // SAFETY: a fresh shared mapping of the whole guest_memfd at an address the kernel
    // chooses; it aliases nothing in this process and is unmapped below.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if addr == libc::MAP_FAILED {
        return Err(format!(
            "mmap of a guest_memfd failed: {}",
            errno_name(last_errno())
        ));
    }
    let attempt = |mode: RegisterMode| -> Result<(), String> {
        let uffd = UffdBuilder::new()
            .close_on_exec(true)
            .non_blocking(true)
            .user_mode_only(false)
            .create()
            .map_err(|e| format!("userfaultfd could not be opened: {e}"))?;
        uffd.register_with_mode(addr, len, mode)
            .map_err(|e| match e {
                userfaultfd::Error::SystemError(errno) => format!("{errno:?}"),
                other => other.to_string(),
            })?;
        uffd.unregister(addr, len)
            .map_err(|e| format!("UFFDIO_UNREGISTER after registering: {e}"))
    };
    let missing = attempt(RegisterMode::MISSING);
    let minor = attempt(RegisterMode::MINOR);
    // SAFETY: exactly the mapping made above; no reference into it escapes this function.
    unsafe { libc::munmap(addr, len) };
    let word = |r: &Result<(), String>| match r {
        Ok(()) => "accepted".to_string(),
        Err(e) => format!("refused ({e})"),
    };
    Ok(GuestMemfdUffd {
        missing: missing.is_ok(),
        minor: minor.is_ok(),
        detail: format!(
            "UFFDIO_REGISTER of a mapped guest_memfd: MISSING {}, MINOR {}",
            word(&missing),
            word(&minor)
        ),
    })
}
