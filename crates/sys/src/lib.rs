//! Kernel interfaces guestmem needs beyond `kvm-bindings` and `libc` ([`uapi`]), and the
//! capability probe ([`probe`]): what the running kernel offers, found by asking it.

#[cfg(not(target_pointer_width = "64"))]
compile_error!("guestmem builds only for 64-bit targets: guest addresses, offsets and page counts are `u64` and index memory as `usize`");

pub mod probe;
pub mod release;
pub mod uapi;

use std::io;
use std::path::{Path, PathBuf};

/// A file operation that failed: the file, the operation, and the operating system's error.
/// The errors of the crates that work on files wrap it, so that each says it the same way.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {op} failed")]
pub struct FileError {
    /// The file.
    pub path: PathBuf,
    /// The operation.
    pub op: &'static str,
    /// The operating system's error.
    #[source]
    pub source: io::Error,
}

impl FileError {
    /// `op` on the file `path` failed with the error given: for `map_err`.
    pub fn at(path: &Path, op: &'static str) -> impl FnOnce(io::Error) -> FileError {
        let path = path.to_path_buf();
        move |source| FileError { path, op, source }
    }
}

/// `v` as a `usize`: a guest address, offset, length or page count, which guestmem keeps as
/// `u64`, used to index or size host memory. Never truncates: this crate, and so every guestmem
/// crate, refuses to build for targets whose pointers are narrower than 64 bits.
#[inline]
#[must_use]
#[allow(clippy::cast_possible_truncation)] // `usize` is 64 bits wide (the `compile_error!` above).
pub const fn to_usize(v: u64) -> usize {
    v as usize
}

/// `e` and its chain of causes, each once: a cause whose text is already there (an error that
/// also prints its source, as some other crates' errors do) is left out, the others follow after
/// `separator`. guestmem's own errors keep a cause in `source()` and out of their message, so
/// that text made of one of them must come from here (or keep it as the source of another):
/// what a side tells its peer when it refuses (`": "`), a reason kept as text, a log line, and
/// how the CLI prints an error.
pub fn error_chain(e: &(dyn std::error::Error + 'static), separator: &str) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let cause = s.to_string();
        if !text.contains(&cause) {
            text.push_str(separator);
            text.push_str(&cause);
        }
        source = s.source();
    }
    text
}

/// Drops the pages of `len` bytes of the file `fd` at `offset`, keeping its size
/// (`fallocate(PUNCH_HOLE | KEEP_SIZE)`): the range reads zero afterwards and holds no memory.
pub fn punch_hole(fd: std::os::fd::BorrowedFd<'_>, offset: u64, len: u64) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let too_large = || io::Error::new(io::ErrorKind::InvalidInput, "range beyond off_t");
    let offset = libc::off_t::try_from(offset).map_err(|_| too_large())?;
    let len = libc::off_t::try_from(len).map_err(|_| too_large())?;
    // SAFETY: fallocate on a descriptor the caller lends; it changes only that file's pages.
    let r = unsafe {
        libc::fallocate(
            fd.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            offset,
            len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `setsockopt(fd, level, name, v)` with `v`'s bytes (an integer, a uapi struct, a name):
/// the socket options the std library does not set (kernel TLS, `SO_SNDBUF` beyond its API).
#[allow(clippy::cast_possible_truncation)] // option values are a few dozen bytes.
pub fn setsockopt<T: ?Sized>(
    fd: std::os::fd::BorrowedFd<'_>,
    level: libc::c_int,
    name: libc::c_int,
    v: &T,
) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: setsockopt reads size_of_val(v) bytes from `v`, a live value of plain old data
    // (integers, bytes, a uapi struct); the fd is the open socket the caller lends.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            std::ptr::from_ref(v).cast(),
            std::mem::size_of_val(v) as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A socket option is set (and reads back as the kernel keeps it); one the kernel does not
    /// know is an error with its errno, not a panic.
    #[test]
    fn socket_options_are_set_or_refused() {
        use std::os::fd::{AsFd, AsRawFd};
        let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        setsockopt(
            s.as_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            &(1 << 20) as &libc::c_int,
        )
        .unwrap();
        let mut v: libc::c_int = 0;
        let mut len: libc::socklen_t = 4;
        // SAFETY: getsockopt writes at most `len` bytes into `v`, a live c_int.
        let r = unsafe {
            libc::getsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_SNDBUF,
                (&raw mut v).cast(),
                &raw mut len,
            )
        };
        assert_eq!(r, 0);
        assert!(v >= 1 << 20, "{v}");
        let e = setsockopt(s.as_fd(), libc::SOL_SOCKET, -1, &0 as &libc::c_int).unwrap_err();
        assert!(e.raw_os_error().is_some(), "{e}");
    }

    #[derive(Debug, thiserror::Error)]
    #[error("outer ({inner})")]
    struct Repeats {
        #[source]
        inner: FileError,
    }

    /// Each cause follows once: one whose text an earlier one already carries is left out,
    /// the others come after the separator, in order.
    #[test]
    fn an_error_chain_names_each_cause_once() {
        let file = || FileError::at(Path::new("/x/mem"), "read")(io::Error::other("disk gone"));
        assert_eq!(file().to_string(), "/x/mem: read failed");
        assert_eq!(error_chain(&file(), ": "), "/x/mem: read failed: disk gone");
        let e = Repeats { inner: file() };
        assert_eq!(
            error_chain(&e, " / "),
            "outer (/x/mem: read failed) / disk gone"
        );
        assert_eq!(to_usize(u64::MAX), usize::MAX);
    }

    /// A punched range reads zero and the file keeps its size; the bytes around it stay.
    #[test]
    fn a_punched_hole_reads_zero_and_keeps_the_size() {
        use std::io::{Read, Seek, Write};
        use std::os::fd::AsFd;
        let mut f = std::fs::File::from(new_memfd().expect("memfd_create"));
        f.write_all(&[7u8; 3 * 4096]).unwrap();
        punch_hole(f.as_fd(), 4096, 4096).unwrap();
        assert_eq!(f.metadata().unwrap().len(), 3 * 4096);
        let mut back = vec![0u8; 3 * 4096];
        f.rewind().unwrap();
        f.read_exact(&mut back).unwrap();
        assert!(back[..4096].iter().all(|b| *b == 7));
        assert!(back[4096..8192].iter().all(|b| *b == 0));
        assert!(back[8192..].iter().all(|b| *b == 7));
        assert_eq!(
            punch_hole(f.as_fd(), u64::MAX, 1).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
    }

    fn new_memfd() -> io::Result<std::os::fd::OwnedFd> {
        use std::os::fd::FromRawFd;
        // SAFETY: memfd_create with a NUL-terminated name; a non-negative result is a new
        // descriptor we own.
        let fd = unsafe { libc::memfd_create(c"punch-test".as_ptr(), 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just created and is owned by nobody else.
        Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
    }
}
