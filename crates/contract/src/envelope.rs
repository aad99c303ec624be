//! A versioned envelope for saved machine state: `{"guestmem_state": KIND, "version": N,
//! "writer": {...}, "state": ...}` around whatever state a [`Machine`] saves, so that a reader
//! checks the state's kind and version before it parses the state itself. A state of a version
//! the reader does not know (a field added by a newer guestmem, say) is refused with
//! [`Error::StateVersion`], naming both versions and the writer, never with a parse error.
//!
//! Version 1 of every kind is the state as it was saved before envelopes (guestmem 0.1.0's
//! bare JSON): a reader takes a blob with no envelope as version 1 ([`StateKind::open`]), and
//! a version-1 state travels bare to a peer of that time ([`bare_v1`]).
//!
//! The envelope is generic: guestmem's own VM uses it for its [`VmState`]
//! ([`crate::PayloadVm`]), and any VMM may wrap its own machine blob the same way. A change to
//! the envelope's own fields bumps every kind's version.
//!
//! [`Machine`]: crate::component::Machine
//! [`VmState`]: guestmem_vm::VmState

use guestmem_sys::release::Writer;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The key that marks an envelope (and names the state's kind).
pub const KEY: &str = "guestmem_state";

/// One kind of saved state and the versions of it this build writes and reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateKind {
    /// The kind's name (`guestmem-payload-vm`).
    pub name: &'static str,
    /// The version this build writes (and the newest it reads).
    pub version: u32,
    /// The oldest version it reads (1: the bare state of before envelopes).
    pub min_version: u32,
}

#[derive(Serialize)]
struct SealRef<'a, T> {
    guestmem_state: &'a str,
    version: u32,
    writer: Writer,
    state: &'a T,
}

#[derive(Deserialize)]
struct Head {
    guestmem_state: Option<serde_json::Value>,
    version: Option<serde_json::Value>,
    writer: Option<Writer>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Sealed<T> {
    #[allow(dead_code)] // checked through the head
    guestmem_state: String,
    #[allow(dead_code)]
    version: u32,
    #[allow(dead_code)]
    writer: Writer,
    state: T,
}

impl StateKind {
    /// `state` in its envelope, of this build's version.
    pub fn seal<T: Serialize>(&self, state: &T) -> Vec<u8> {
        serde_json::to_vec(&SealRef {
            guestmem_state: self.name,
            version: self.version,
            writer: Writer::this(),
            state,
        })
        .expect("a saved state serializes")
    }

    /// The envelope's head of `blob`: `Some((kind, version, writer))` for an envelope, `None`
    /// for a bare state (or bytes that are not JSON: the state's own parse says so).
    fn head(blob: &[u8]) -> Option<(String, u64, Option<Writer>)> {
        let head: Head = serde_json::from_slice(blob).ok()?;
        let kind = head.guestmem_state?;
        Some((
            kind.as_str()
                .map_or_else(|| kind.to_string(), str::to_string),
            head.version.and_then(|v| v.as_u64()).unwrap_or(0),
            head.writer,
        ))
    }

    /// The state in `blob` and its version: an envelope of this kind and of a version this
    /// build reads, or a bare state (version 1). Another kind or version is refused naming
    /// both; a state that does not parse is [`Error::Machine`] with its cause.
    pub fn open<T: DeserializeOwned>(&self, blob: &[u8]) -> Result<(T, u32)> {
        let parse_error = |source: serde_json::Error| Error::Machine {
            op: "read the saved state",
            source: Box::new(source),
        };
        let Some((kind, version, writer)) = StateKind::head(blob) else {
            if self.min_version > 1 {
                return Err(self.refusal("none (a bare state)".into(), 1, None));
            }
            return Ok((serde_json::from_slice(blob).map_err(parse_error)?, 1));
        };
        if kind != self.name {
            return Err(Error::StateKind {
                found: kind,
                expected: self.name,
            });
        }
        if !(u64::from(self.min_version)..=u64::from(self.version)).contains(&version) {
            return Err(self.refusal(kind, version, writer.as_ref()));
        }
        let sealed: Sealed<T> = serde_json::from_slice(blob).map_err(parse_error)?;
        Ok((
            sealed.state,
            u32::try_from(version).expect("within this build's versions"),
        ))
    }

    fn refusal(&self, kind: String, found: u64, writer: Option<&Writer>) -> Error {
        Error::StateVersion {
            kind,
            found,
            writer: writer.map_or_else(
                || "a guestmem that named none".into(),
                |w| Writer::describe(Some(w)),
            ),
            reader: format!("this guestmem ({})", guestmem_sys::release::LONG_VERSION),
            min: self.min_version,
            max: self.version,
        }
    }
}

/// `blob` as a reader from before envelopes (guestmem 0.1.0) takes it: a version-1 state (of
/// any kind) out of its envelope, a blob without one as it is. A later version is refused
/// naming both versions (that reader would misread it).
pub fn bare_v1(blob: &[u8]) -> Result<Vec<u8>> {
    let Some((kind, version, writer)) = StateKind::head(blob) else {
        return Ok(blob.to_vec());
    };
    if version != 1 {
        return Err(Error::StateVersion {
            kind,
            found: version,
            writer: Writer::describe(writer.as_ref()),
            reader: "guestmem 0.1.0".into(),
            min: 1,
            max: 1,
        });
    }
    let sealed: Sealed<serde_json::Value> =
        serde_json::from_slice(blob).map_err(|source| Error::Machine {
            op: "read the saved state",
            source: Box::new(source),
        })?;
    Ok(serde_json::to_vec(&sealed.state).expect("a JSON value serializes"))
}

/// What `blob` is, in words: `'KIND' state version N (sealed by WRITER)`, or a bare state
/// (version 1 of its kind, as guestmem 0.1.0 saved it).
pub fn describe(blob: &[u8]) -> String {
    match StateKind::head(blob) {
        Some((kind, version, writer)) => format!(
            "'{kind}' state version {version} (sealed by {})",
            Writer::describe(writer.as_ref())
        ),
        None => {
            "a state without envelope (version 1 of its kind, as guestmem 0.1.0 saved it)".into()
        }
    }
}

/// The kind named by `blob`'s envelope (`None`: no envelope).
pub fn kind_of(blob: &[u8]) -> Option<String> {
    StateKind::head(blob).map(|(kind, _, _)| kind)
}

/// Whether `blob` is a state in an envelope (of any kind).
pub fn is_sealed(blob: &[u8]) -> bool {
    StateKind::head(blob).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct V1 {
        a: u32,
    }

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct V2 {
        a: u32,
        b: u32,
    }

    const ONE: StateKind = StateKind {
        name: "test-vm",
        version: 1,
        min_version: 1,
    };
    const TWO: StateKind = StateKind {
        name: "test-vm",
        version: 2,
        min_version: 1,
    };

    #[test]
    fn a_sealed_state_opens_and_a_bare_one_is_version_1() {
        let blob = ONE.seal(&V1 { a: 7 });
        assert!(is_sealed(&blob));
        assert!(describe(&blob).starts_with("'test-vm' state version 1 (sealed by guestmem "));
        assert!(describe(br#"{"a":3}"#).contains("without envelope"));
        assert!(String::from_utf8_lossy(&blob).starts_with(&format!("{{\"{KEY}\":\"test-vm\"")));
        assert_eq!(ONE.open::<V1>(&blob).unwrap(), (V1 { a: 7 }, 1));
        assert_eq!(ONE.open::<V1>(br#"{"a":3}"#).unwrap(), (V1 { a: 3 }, 1));
        assert_eq!(bare_v1(&blob).unwrap(), br#"{"a":7}"#);
        assert_eq!(bare_v1(br#"{"a":3}"#).unwrap(), br#"{"a":3}"#);
    }

    /// A newer version (a field added) read by an older reader: a version error naming both
    /// versions and the writer, not serde's "unknown field".
    #[test]
    fn a_newer_version_is_refused_by_version_not_by_serde() {
        let blob = TWO.seal(&V2 { a: 1, b: 2 });
        let e = ONE.open::<V1>(&blob).unwrap_err();
        assert!(
            matches!(
                e,
                Error::StateVersion {
                    found: 2,
                    max: 1,
                    ..
                }
            ),
            "{e:?}"
        );
        let text = e.to_string();
        assert!(
            text.contains("'test-vm' state of version 2")
                && text.contains(&format!("guestmem {}", guestmem_sys::release::VERSION))
                && text.contains("reads versions 1 to 1"),
            "{text}"
        );
        let e = bare_v1(&blob).unwrap_err().to_string();
        assert!(
            e.contains("guestmem 0.1.0") && e.contains("version 2"),
            "{e}"
        );
        // The newer reader takes both.
        assert_eq!(TWO.open::<V2>(&blob).unwrap().1, 2);
        let e = ONE
            .open::<V1>(
                &StateKind {
                    name: "other",
                    ..ONE
                }
                .seal(&V1 { a: 1 }),
            )
            .unwrap_err();
        assert!(matches!(e, Error::StateKind { .. }), "{e:?}");
    }

    #[test]
    fn a_damaged_state_is_a_parse_error_of_the_step() {
        let e = ONE.open::<V1>(b"{\"a\": \"x\"}").unwrap_err();
        assert!(
            matches!(
                e,
                Error::Machine {
                    op: "read the saved state",
                    ..
                }
            ),
            "{e:?}"
        );
        let e = ONE.open::<V1>(b"not json").unwrap_err();
        assert!(matches!(e, Error::Machine { .. }), "{e:?}");
    }
}
