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

#[cfg(test)]
mod tests {
    use super::*;

    /// A meminfo-style value is the number after its key, wherever the line is; a missing key
    /// is named with the file.
    #[test]
    fn meminfo_values_are_found_by_key() {
        let text = "Node 0 MemTotal:  1000 kB\nNode 0 MemFree:    250 kB\nHugePages_Total: 7\n";
        assert_eq!(meminfo_value(text, "MemTotal:", "f").unwrap(), 1000);
        assert_eq!(meminfo_value(text, "MemFree:", "f").unwrap(), 250);
        assert_eq!(meminfo_value(text, "HugePages_Total:", "f").unwrap(), 7);
        assert_eq!(
            meminfo_value(text, "MemUsed:", "/proc/x").unwrap_err(),
            "/proc/x: no MemUsed: line"
        );
        assert!(meminfo_value("MemTotal: lots kB\n", "MemTotal:", "f").is_err());
    }

    /// Errnos go by their names (unknown ones by number); an I/O error without one keeps its
    /// text; a file read or parse that fails names the file.
    #[test]
    fn errors_are_named() {
        assert_eq!(errno_name(libc::ENOENT), "ENOENT");
        assert_eq!(errno_name(libc::EHWPOISON), "EHWPOISON");
        assert_eq!(errno_name(4095), "errno 4095");
        assert_eq!(
            io_error_name(&std::io::Error::from_raw_os_error(libc::EACCES)),
            "EACCES"
        );
        assert_eq!(io_error_name(&std::io::Error::other("plain")), "plain");
        assert_eq!(
            read("/nonexistent/guestmem").unwrap_err(),
            "/nonexistent/guestmem: ENOENT"
        );
        assert_eq!(
            read_u64("/proc/sys/kernel/pid_max").map(|n| n > 0),
            Ok(true)
        );
        let e = read_u64("/proc/sys/kernel/ostype").unwrap_err();
        assert!(
            e.starts_with("/proc/sys/kernel/ostype: \"Linux\\n\": "),
            "{e}"
        );
        // SAFETY: close(-1) only sets errno (EBADF).
        unsafe { libc::close(-1) };
        assert_eq!(last_errno(), libc::EBADF);
    }
}
