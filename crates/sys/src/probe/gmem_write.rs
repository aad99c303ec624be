//! Item 2: guest_memfd `write()`, found by trying it (its flag numbers moved between patch versions).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use kvm_ioctls::VmFd;
use libc::c_void;

use super::util::{errno_name, last_errno};
use super::GuestMemfdWrite;
use crate::uapi::{self, kvm_create_guest_memfd};

pub(super) const GMEM_SIZE_BYTES: u64 = 2 << 20;
pub(super) const PAGE_4K: usize = 4096;

/// Tries `pwrite` of one 4 KiB page at offset 0 of a 2 MiB guest_memfd created on `vm` with the
/// `MMAP`/`INIT_SHARED` bits of `valid_flags` (the answer of `KVM_CAP_GUEST_MEMFD_FLAGS`).
/// `ENODEV` means write() exists but needs a flag: each further bit of `valid_flags` is tried.
pub fn guest_memfd_write(vm: &VmFd, valid_flags: u64) -> Result<GuestMemfdWrite, String> {
    let known = uapi::GUEST_MEMFD_FLAG_MMAP | uapi::GUEST_MEMFD_FLAG_INIT_SHARED;
    let base = valid_flags & known;
    let first = try_gmem_pwrite(vm, base)?;
    let errno = match first {
        Ok(()) => {
            return Ok(GuestMemfdWrite {
                present: true,
                flag: None,
                detail: format!("pwrite of 4 KiB succeeded with flags {base:#x}"),
            })
        }
        Err(errno) => errno,
    };
    if errno != libc::ENODEV {
        return Ok(GuestMemfdWrite {
            present: false,
            flag: None,
            detail: format!("pwrite gave {} (flags {base:#x})", errno_name(errno)),
        });
    }
    let mut tried = Vec::new();
    for bit in (0..64)
        .map(|i| 1u64 << i)
        .filter(|b| valid_flags & !known & b != 0)
    {
        match try_gmem_pwrite(vm, base | bit) {
            Ok(Ok(())) => {
                return Ok(GuestMemfdWrite {
                    present: true,
                    flag: Some(bit),
                    detail: format!(
                        "pwrite gave ENODEV without a flag, succeeded with flag {bit:#x}"
                    ),
                })
            }
            Ok(Err(e)) => tried.push(format!("{bit:#x}: pwrite {}", errno_name(e))),
            Err(e) => tried.push(format!("{bit:#x}: {e}")),
        }
    }
    Ok(GuestMemfdWrite {
        present: false,
        flag: None,
        detail: format!(
            "pwrite gave ENODEV (write exists, needs a flag) but no reported flag enabled it; tried: [{}]",
            tried.join(", ")
        ),
    })
}

/// Creates a guest_memfd with `flags` and pwrites one page at offset 0. The outer `Err` is a
/// failed creation; the inner one is the errno of `pwrite`.
pub(super) fn try_gmem_pwrite(vm: &VmFd, flags: u64) -> Result<Result<(), i32>, String> {
    let gmem = kvm_create_guest_memfd {
        size: GMEM_SIZE_BYTES,
        flags,
        ..Default::default()
    };
    let raw = vm.create_guest_memfd(gmem).map_err(|e| {
        format!(
            "KVM_CREATE_GUEST_MEMFD(flags {flags:#x}) failed: {}",
            errno_name(e.errno())
        )
    })?;
    // SAFETY: `raw` is a fresh fd returned by KVM_CREATE_GUEST_MEMFD that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let page = [0x5au8; PAGE_4K];
    // SAFETY: `page` is a live buffer of exactly `page.len()` readable bytes; `fd` is open.
    let n = unsafe {
        libc::pwrite(
            fd.as_raw_fd(),
            page.as_ptr().cast::<c_void>(),
            page.len(),
            0,
        )
    };
    if n < 0 {
        Ok(Err(last_errno()))
    } else {
        Ok(Ok(()))
    }
}
