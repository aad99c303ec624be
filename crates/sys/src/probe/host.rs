//! Item 7: the host (kernel release, page size, memory).

use std::ffi::CStr;

use libc::c_int;

use super::util::{errno_name, last_errno};
use super::Host;

/// Kernel release, page size and online CPUs.
pub fn host() -> Host {
    Host {
        kernel_release: kernel_release(),
        page_size_bytes: sysconf(libc::_SC_PAGESIZE, "_SC_PAGESIZE"),
        online_cpus: sysconf(libc::_SC_NPROCESSORS_ONLN, "_SC_NPROCESSORS_ONLN"),
    }
}

pub(super) fn kernel_release() -> Result<String, String> {
    // SAFETY: `utsname` is plain old data (arrays of c_char); all-zero is a valid value.
    let mut uts: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: `uts` is a valid, writable `utsname` that lives across the call.
    if unsafe { libc::uname(&raw mut uts) } != 0 {
        return Err(format!("uname: {}", errno_name(last_errno())));
    }
    // SAFETY: on success the kernel filled `release` with a NUL-terminated string that fits in
    // the array (and the array was zeroed, so a NUL is there in any case).
    let release = unsafe { CStr::from_ptr(uts.release.as_ptr()) };
    Ok(release.to_string_lossy().into_owned())
}

pub(super) fn sysconf(name: c_int, what: &str) -> Result<u64, String> {
    // SAFETY: sysconf only reads its integer argument.
    let v = unsafe { libc::sysconf(name) };
    if v <= 0 {
        Err(format!("sysconf({what}) = {v}"))
    } else {
        Ok(v as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The release is the kernel's; the page size is x86-64's; a name sysconf does not know
    /// is an error naming it.
    #[test]
    fn the_host_answers_and_names_a_refusal() {
        let proc_release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
        assert_eq!(kernel_release().unwrap(), proc_release.trim());
        assert_eq!(sysconf(libc::_SC_PAGESIZE, "_SC_PAGESIZE"), Ok(4096));
        assert_eq!(sysconf(-1, "BOGUS"), Err("sysconf(BOGUS) = -1".to_string()));
        assert!(host().online_cpus.unwrap() >= 1);
    }
}
