//! Item 4: userfaultfd: the syscall, `/dev/userfaultfd`, features and ioctls.

use std::fs;
use std::os::fd::{FromRawFd, OwnedFd};

use libc::{c_int, c_ulong};
use vmm_sys_util::ioctl::{ioctl_with_mut_ref, ioctl_with_val};

use super::util::{errno_name, io_error_name, last_errno};
use super::{BitFlags, Userfaultfd};
use crate::uapi::{self};

pub(super) const UFFD_FEATURE_NAMES: &[(u64, &str)] = &[
    (uapi::UFFD_FEATURE_PAGEFAULT_FLAG_WP, "PAGEFAULT_FLAG_WP"),
    (uapi::UFFD_FEATURE_EVENT_FORK, "EVENT_FORK"),
    (uapi::UFFD_FEATURE_EVENT_REMAP, "EVENT_REMAP"),
    (uapi::UFFD_FEATURE_EVENT_REMOVE, "EVENT_REMOVE"),
    (uapi::UFFD_FEATURE_MISSING_HUGETLBFS, "MISSING_HUGETLBFS"),
    (uapi::UFFD_FEATURE_MISSING_SHMEM, "MISSING_SHMEM"),
    (uapi::UFFD_FEATURE_EVENT_UNMAP, "EVENT_UNMAP"),
    (uapi::UFFD_FEATURE_SIGBUS, "SIGBUS"),
    (uapi::UFFD_FEATURE_THREAD_ID, "THREAD_ID"),
    (uapi::UFFD_FEATURE_MINOR_HUGETLBFS, "MINOR_HUGETLBFS"),
    (uapi::UFFD_FEATURE_MINOR_SHMEM, "MINOR_SHMEM"),
    (uapi::UFFD_FEATURE_EXACT_ADDRESS, "EXACT_ADDRESS"),
    (uapi::UFFD_FEATURE_WP_HUGETLBFS_SHMEM, "WP_HUGETLBFS_SHMEM"),
    (uapi::UFFD_FEATURE_WP_UNPOPULATED, "WP_UNPOPULATED"),
    (uapi::UFFD_FEATURE_POISON, "POISON"),
    (uapi::UFFD_FEATURE_WP_ASYNC, "WP_ASYNC"),
    (uapi::UFFD_FEATURE_MOVE, "MOVE"),
    (uapi::UFFD_FEATURE_RWP, "RWP"),
    (uapi::UFFD_FEATURE_RWP_ASYNC, "RWP_ASYNC"),
];

pub(super) const UFFD_IOCTL_NAMES: &[(u64, &str)] = &[
    (1 << uapi::_UFFDIO_REGISTER, "REGISTER"),
    (1 << uapi::_UFFDIO_UNREGISTER, "UNREGISTER"),
    (1 << uapi::_UFFDIO_WAKE, "WAKE"),
    (1 << uapi::_UFFDIO_COPY, "COPY"),
    (1 << uapi::_UFFDIO_ZEROPAGE, "ZEROPAGE"),
    (1 << uapi::_UFFDIO_MOVE, "MOVE"),
    (1 << uapi::_UFFDIO_WRITEPROTECT, "WRITEPROTECT"),
    (1 << uapi::_UFFDIO_CONTINUE, "CONTINUE"),
    (1 << uapi::_UFFDIO_POISON, "POISON"),
    (1 << uapi::_UFFDIO_RWPROTECT, "RWPROTECT"),
    (1 << uapi::_UFFDIO_SET_MODE, "SET_MODE"),
    (1 << uapi::_UFFDIO_API, "API"),
];

/// Opens a userfaultfd (`/dev/userfaultfd`, else the syscall) and does `UFFDIO_API` with
/// `features = 0`, which returns every feature the kernel offers.
pub fn userfaultfd() -> Result<Userfaultfd, String> {
    let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
    let (fd, opened_via, dev_userfaultfd_error) = match open_dev_userfaultfd(flags) {
        Ok(fd) => (fd, "/dev/userfaultfd", None),
        Err(dev_err) => {
            // SAFETY: the userfaultfd syscall takes only an int of flags.
            let raw = unsafe { libc::syscall(libc::SYS_userfaultfd, flags) };
            if raw < 0 {
                return Err(format!(
                    "/dev/userfaultfd: {dev_err}; userfaultfd(2): {}",
                    errno_name(last_errno())
                ));
            }
            // SAFETY: `raw` is a fresh fd returned by userfaultfd(2) that nothing else owns.
            let fd = unsafe {
                OwnedFd::from_raw_fd(c_int::try_from(raw).expect("an fd fits in a c_int"))
            };
            (fd, "userfaultfd(2)", Some(dev_err))
        }
    };
    let mut api = uapi::uffdio_api {
        api: uapi::UFFD_API,
        features: 0,
        ioctls: 0,
    };
    // SAFETY: `fd` is a userfaultfd; `api` is a valid `uffdio_api` the kernel reads and writes
    // back, and it lives across the call.
    let ret = unsafe { ioctl_with_mut_ref(&fd, uapi::UFFDIO_API(), &mut api) };
    if ret < 0 {
        return Err(format!("UFFDIO_API failed: {}", errno_name(last_errno())));
    }
    Ok(Userfaultfd {
        opened_via: opened_via.to_string(),
        dev_userfaultfd_error,
        features: BitFlags::decode(api.features, UFFD_FEATURE_NAMES),
        ioctls: BitFlags::decode(api.ioctls, UFFD_IOCTL_NAMES),
    })
}

pub(super) fn open_dev_userfaultfd(flags: c_int) -> Result<OwnedFd, String> {
    let dev = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/userfaultfd")
        .map_err(|e| format!("open: {}", io_error_name(&e)))?;
    // SAFETY: `dev` is /dev/userfaultfd; USERFAULTFD_IOC_NEW takes its flags by value and
    // returns a new fd.
    let raw = unsafe { ioctl_with_val(&dev, uapi::USERFAULTFD_IOC_NEW(), flags as c_ulong) };
    if raw < 0 {
        return Err(format!("USERFAULTFD_IOC_NEW: {}", errno_name(last_errno())));
    }
    // SAFETY: `raw` is a fresh fd returned by USERFAULTFD_IOC_NEW that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}
