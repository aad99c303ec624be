//! Kernel interfaces guestmem needs beyond `kvm-bindings` and `libc` ([`uapi`]), and the
//! capability probe ([`probe`]): what the running kernel offers, found by asking it.

#![warn(missing_docs)]

pub mod probe;
pub mod uapi;

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
