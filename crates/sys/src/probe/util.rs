//! Reading sysfs and procfs, naming errnos.

use std::fs;

pub(super) fn read(path: &str) -> Result<String, String> {
    fs::read_to_string(path).map_err(|e| format!("{path}: {}", io_error_name(&e)))
}

pub(super) fn read_u64(path: &str) -> Result<u64, String> {
    let text = read(path)?;
    text.trim()
        .parse()
        .map_err(|e| format!("{path}: {text:?}: {e}"))
}

/// The number after `key` in a meminfo-style text (`Key:   123 kB`, or `Node 0 Key: 123 kB`).
pub(super) fn meminfo_value(text: &str, key: &str, path: &str) -> Result<u64, String> {
    text.lines()
        .find_map(|line| {
            let mut words = line.split_whitespace();
            words.by_ref().find(|w| *w == key)?;
            words.next()?.parse().ok()
        })
        .ok_or_else(|| format!("{path}: no {key} line"))
}

pub(super) fn last_errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

pub(super) fn io_error_name(e: &std::io::Error) -> String {
    match e.raw_os_error() {
        Some(errno) => errno_name(errno),
        None => e.to_string(),
    }
}

/// The kernel's name of an errno value (`EINVAL`), or `errno N` for one not listed here.
pub(super) fn errno_name(errno: i32) -> String {
    let name = match errno {
        libc::EPERM => "EPERM",
        libc::ENOENT => "ENOENT",
        libc::ESRCH => "ESRCH",
        libc::EINTR => "EINTR",
        libc::EIO => "EIO",
        libc::ENXIO => "ENXIO",
        libc::E2BIG => "E2BIG",
        libc::EBADF => "EBADF",
        libc::EAGAIN => "EAGAIN",
        libc::ENOMEM => "ENOMEM",
        libc::EACCES => "EACCES",
        libc::EFAULT => "EFAULT",
        libc::EBUSY => "EBUSY",
        libc::EEXIST => "EEXIST",
        libc::ENODEV => "ENODEV",
        libc::ENOTDIR => "ENOTDIR",
        libc::EISDIR => "EISDIR",
        libc::EINVAL => "EINVAL",
        libc::ENFILE => "ENFILE",
        libc::EMFILE => "EMFILE",
        libc::ENOTTY => "ENOTTY",
        libc::EFBIG => "EFBIG",
        libc::ENOSPC => "ENOSPC",
        libc::ESPIPE => "ESPIPE",
        libc::EROFS => "EROFS",
        libc::ERANGE => "ERANGE",
        libc::ENOSYS => "ENOSYS",
        libc::EOPNOTSUPP => "EOPNOTSUPP",
        libc::EHWPOISON => "EHWPOISON",
        _ => return format!("errno {errno}"),
    };
    name.to_string()
}
