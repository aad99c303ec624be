//! Which guestmem this is: the release version and the commit it was built from, as
//! `guestmem --version` prints them and as every snapshot records its writer
//! ([`Writer`]).
//!
//! A release is an entry of CHANGELOG.md naming its commit (and a tag `vX.Y.Z` where tags
//! travel). The compatibility policy (README, "Compatibility") is kept by the format constants
//! of each crate, each of which says beside it what a change to it must bump.

use serde::{Deserialize, Serialize};

/// This build's version (the workspace's, semver).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The commit this build is of (12 hex digits), or "unknown" when built outside a git checkout
/// without `$GUESTMEM_COMMIT` (see build.rs).
pub const COMMIT: &str = env!("GUESTMEM_COMMIT");
/// `VERSION (commit COMMIT)`: what `guestmem --version` prints after the program's name.
pub const LONG_VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("GUESTMEM_COMMIT"),
    ")"
);

/// The guestmem that wrote a snapshot (recorded in its manifest; absent from manifests of
/// guestmem 0.1.0, which recorded none). A change here bumps the manifests that hold it
/// (flat snapshot `VERSION`, store manifest `VERSION`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Writer {
    /// Its version ([`VERSION`]).
    pub version: String,
    /// Its commit ([`COMMIT`]).
    pub commit: String,
}

impl Writer {
    /// This build.
    pub fn this() -> Writer {
        Writer {
            version: VERSION.into(),
            commit: COMMIT.into(),
        }
    }

    /// How a snapshot's writer is named: `guestmem 0.2.0 (commit abc)`, or, for a manifest
    /// that records none, `guestmem 0.1.0` (the only release that wrote none).
    pub fn describe(writer: Option<&Writer>) -> String {
        match writer {
            Some(w) => format!("guestmem {} (commit {})", w.version, w.commit),
            None => "guestmem 0.1.0 (it recorded no writer)".into(),
        }
    }
}

/// The minor release line of a semver `version` ("0.2.3" -> (0, 2)), `None` if it is not one.
pub fn minor_of(version: &str) -> Option<(u64, u64)> {
    let mut parts = version.split(['.', '-', '+']);
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_build_names_its_version_and_commit() {
        assert_eq!(minor_of(VERSION).map(|(major, _)| major), Some(0));
        assert!(!COMMIT.is_empty());
        assert!(LONG_VERSION.starts_with(VERSION) && LONG_VERSION.contains(COMMIT));
        let w = Writer::this();
        assert_eq!(
            Writer::describe(Some(&w)),
            format!("guestmem {VERSION} (commit {COMMIT})")
        );
        assert!(Writer::describe(None).contains("0.1.0"));
    }

    #[test]
    fn minor_lines_parse() {
        assert_eq!(minor_of("0.2.3"), Some((0, 2)));
        assert_eq!(minor_of("1.10.0-rc1"), Some((1, 10)));
        assert_eq!(minor_of("x"), None);
    }
}
