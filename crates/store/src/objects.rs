//! The one interface both back ends offer: whole objects by key, put atomically.

use std::time::SystemTime;

use crate::Result;

/// An object as a listing shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectInfo {
    /// The key relative to the store's root.
    pub key: String,
    /// Its bytes.
    pub size: u64,
    /// When it was last written.
    pub modified: SystemTime,
}

/// Where a store keeps its objects: keys are `/`-separated paths relative to the store's root.
/// Shared by the threads that write and fetch chunks.
pub trait ObjectStore: Send + Sync {
    /// The store as a user names it (`s3://bucket/prefix`, `store:DIR`), for messages.
    fn describe(&self) -> String;
    /// The whole object `key`; [`crate::Error::Missing`] when there is none.
    fn get(&self, key: &str) -> Result<Vec<u8>>;
    /// Bytes `start..start + len` of object `key` (fewer when the object ends first: the
    /// caller checks the length); [`crate::Error::Missing`] when there is no such object.
    fn get_range(&self, key: &str, start: u64, len: u64) -> Result<Vec<u8>>;
    /// Stores `bytes` as `key`, replacing any object there. Atomic: a reader sees the old
    /// object, or none, or the whole new one — never part of it.
    fn put(&self, key: &str, bytes: &[u8]) -> Result<()>;
    /// Stores a chunk object: like [`ObjectStore::put`] (atomic), but it need not be durable until
    /// [`ObjectStore::sync`] returns (a local store syncs its file system once instead of once per
    /// chunk).
    fn put_chunk(&self, key: &str, bytes: &[u8]) -> Result<()> {
        self.put(key, bytes)
    }
    /// Makes every object put so far durable.
    fn sync(&self) -> Result<()> {
        Ok(())
    }
    /// Whether `key` exists.
    fn exists(&self, key: &str) -> Result<bool>;
    /// Every object whose key starts with `prefix` (a directory-like prefix ending in `/`).
    fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>>;
    /// Removes `key`; removing an object that is not there is no error.
    fn delete(&self, key: &str) -> Result<()>;
    /// Removes what interrupted puts left behind (a local store's temporary files of writers
    /// that are gone, or older than `older_than`); returns how many. Object stores leave
    /// nothing (a put is whole or absent).
    fn remove_stale_temporaries(&self, _older_than: std::time::Duration) -> Result<usize> {
        Ok(0)
    }
    /// Whether reading is slow enough to be worth a local chunk cache (a remote store).
    fn remote(&self) -> bool;
}
