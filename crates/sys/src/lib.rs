//! Kernel interfaces guestmem needs beyond `kvm-bindings` and `libc` ([`uapi`]), and the
//! capability probe ([`probe`]): what the running kernel offers, found by asking it.

#[cfg(not(target_pointer_width = "64"))]
compile_error!("guestmem builds only for 64-bit targets: guest addresses, offsets and page counts are `u64` and index memory as `usize`");

pub mod probe;
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
