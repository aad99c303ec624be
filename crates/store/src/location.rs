//! Naming stores and snapshots: `s3://bucket/prefix/NAME` or `store:DIR/NAME`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::local::LocalObjectStore;
use crate::objects::ObjectStore;
use crate::policy::StoreOptions;
use crate::s3::S3ObjectStore;
use crate::{Error, Result};

/// Where a store is: its back end and its root there.
/// A store: a local directory or an S3 bucket and prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreUrl {
    /// A local directory.
    Local(PathBuf),
    /// An S3 bucket and a key prefix in it (empty: the bucket's root).
    S3 {
        /// The bucket.
        bucket: String,
        /// The key prefix.
        prefix: String,
    },
}

/// A snapshot in a store: the store, and the snapshot's name in it (the last path element).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    /// The store.
    pub store: StoreUrl,
    /// The snapshot's name in it.
    pub name: String,
}

/// Whether `text` names a store (`s3://…` or `store:…`) rather than a flat snapshot directory.
pub fn is_store_url(text: &str) -> bool {
    text.starts_with("s3://") || text.starts_with("store:")
}

impl StoreUrl {
    /// Parses a store's URL: `s3://bucket[/prefix]` or `store:DIR`.
    pub fn parse(text: &str) -> Result<StoreUrl> {
        if let Some(rest) = text.strip_prefix("s3://") {
            let rest = rest.trim_end_matches('/');
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            if bucket.is_empty() {
                return Err(Error::Location(format!(
                    "{text}: no bucket (s3://BUCKET/PREFIX)"
                )));
            }
            if prefix
                .split('/')
                .any(|p| p.is_empty() || p == "." || p == "..")
                && !prefix.is_empty()
            {
                return Err(Error::Location(format!(
                    "{text}: an empty, '.' or '..' element in the prefix"
                )));
            }
            Ok(StoreUrl::S3 {
                bucket: bucket.to_string(),
                prefix: prefix.to_string(),
            })
        } else if let Some(dir) = text.strip_prefix("store:") {
            if dir.is_empty() {
                return Err(Error::Location(format!("{text}: no directory (store:DIR)")));
            }
            Ok(StoreUrl::Local(PathBuf::from(dir)))
        } else {
            Err(Error::Location(format!(
                "{text}: not a store (s3://BUCKET/PREFIX or store:DIR)"
            )))
        }
    }

    /// Opens the back end (an S3 client takes its endpoint and credentials from the AWS
    /// environment variables) under the default [`StoreOptions`].
    pub fn open(&self) -> Result<Arc<dyn ObjectStore>> {
        self.open_with(StoreOptions::default())
    }

    /// Opens the back end, its requests under `options` (the store timeout policy of
    /// [`crate::policy`]; a local directory's reads and writes are file system calls, not
    /// bounded by it).
    pub fn open_with(&self, options: StoreOptions) -> Result<Arc<dyn ObjectStore>> {
        Ok(match self {
            StoreUrl::Local(dir) => Arc::new(LocalObjectStore::new(dir)),
            StoreUrl::S3 { bucket, prefix } => {
                Arc::new(S3ObjectStore::from_env_with(bucket, prefix, options)?)
            }
        })
    }
}

impl std::fmt::Display for StoreUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreUrl::Local(dir) => write!(f, "store:{}", dir.display()),
            StoreUrl::S3 { bucket, prefix } if prefix.is_empty() => write!(f, "s3://{bucket}"),
            StoreUrl::S3 { bucket, prefix } => write!(f, "s3://{bucket}/{prefix}"),
        }
    }
}

impl Location {
    /// Parses a snapshot's URL: the store, then the snapshot's name as the last element
    /// (`s3://bucket/fleet/vm1`: snapshot `vm1` of the store `s3://bucket/fleet`).
    pub fn parse(text: &str) -> Result<Location> {
        let trimmed = text.trim_end_matches('/');
        let (store, name) = if let Some(rest) = trimmed.strip_prefix("s3://") {
            match rest.rsplit_once('/') {
                Some((store, name)) => (format!("s3://{store}"), name),
                None => {
                    return Err(Error::Location(format!(
                        "{text}: no snapshot name after the bucket (s3://BUCKET[/PREFIX]/NAME)"
                    )))
                }
            }
        } else if let Some(rest) = trimmed.strip_prefix("store:") {
            let path = Path::new(rest);
            match (path.parent(), path.file_name()) {
                (Some(dir), Some(name)) => (
                    format!(
                        "store:{}",
                        if dir.as_os_str().is_empty() {
                            Path::new(".")
                        } else {
                            dir
                        }
                        .display()
                    ),
                    name.to_str().unwrap_or(""),
                ),
                _ => {
                    return Err(Error::Location(format!(
                        "{text}: no snapshot name (store:DIR/NAME)"
                    )))
                }
            }
        } else {
            return Err(Error::Location(format!(
                "{text}: not a store snapshot (s3://BUCKET[/PREFIX]/NAME or store:DIR/NAME)"
            )));
        };
        if name.is_empty() || name == "." || name == ".." {
            return Err(Error::Location(format!("{text}: no snapshot name")));
        }
        Ok(Location {
            store: StoreUrl::parse(&store)
                .map_err(|e| Error::Location(format!("{text}: the store {e}")))?,
            name: name.to_string(),
        })
    }
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.store, self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_snapshot_urls() {
        let l = Location::parse("s3://b/fleet/x/vm1").unwrap();
        assert_eq!(
            l.store,
            StoreUrl::S3 {
                bucket: "b".into(),
                prefix: "fleet/x".into()
            }
        );
        assert_eq!(l.name, "vm1");
        assert_eq!(l.to_string(), "s3://b/fleet/x/vm1");
        let l = Location::parse("s3://b/vm1").unwrap();
        assert_eq!(l.store.to_string(), "s3://b");
        let l = Location::parse("store:/var/snap/vm1/").unwrap();
        assert_eq!(l.store, StoreUrl::Local("/var/snap".into()));
        assert_eq!(l.name, "vm1");
    }

    #[test]
    fn refuses_bad_urls_naming_them() {
        for bad in ["s3://b", "s3:///x", "store:", "/tmp/x"] {
            let e = Location::parse(bad).unwrap_err().to_string();
            assert!(e.contains(bad), "{bad}: {e}");
        }
    }
}
