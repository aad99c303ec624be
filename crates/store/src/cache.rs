//! The host's local cache of chunks fetched from a remote store: shared by every restore on
//! the host (a directory; each chunk a file named by its hash, put atomically), bounded (the
//! least recently used chunks go first once it holds more than its limit). Entries are stored
//! as fetched (compressed) and checked against their hash like a fetched chunk each time they
//! are used: a damaged entry is dropped and fetched again.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use crate::chunk::{self, Hash};
use crate::local::put_file;
use crate::{Error, Result};

/// `used` before the cache was counted.
const UNKNOWN: u64 = u64::MAX;

/// The default bound: 8 GiB.
pub const DEFAULT_LIMIT: u64 = 8 << 30;

pub struct ChunkCache {
    dir: PathBuf,
    limit: u64,
    used: AtomicU64,
}

impl ChunkCache {
    /// The cache in `dir` (created), holding at most `limit` bytes.
    pub fn open(dir: &Path, limit: u64) -> Result<ChunkCache> {
        std::fs::create_dir_all(dir).map_err(|source| Error::Cache {
            path: dir.to_path_buf(),
            op: "create",
            source,
        })?;
        // What it holds is counted at the first put: a restore served from the cache alone
        // does not pay for a scan of it.
        Ok(ChunkCache {
            dir: dir.to_path_buf(),
            limit,
            used: AtomicU64::new(UNKNOWN),
        })
    }

    /// The host's cache: `$GUESTMEM_CHUNK_CACHE` or `$XDG_CACHE_HOME/guestmem/chunks`
    /// (`~/.cache/guestmem/chunks`), bounded by `$GUESTMEM_CHUNK_CACHE_MIB` (default 8 GiB).
    pub fn host_default() -> Result<ChunkCache> {
        let dir = match std::env::var_os("GUESTMEM_CHUNK_CACHE") {
            Some(d) => PathBuf::from(d),
            None => std::env::var_os("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
                .unwrap_or_else(std::env::temp_dir)
                .join("guestmem/chunks"),
        };
        let limit = std::env::var("GUESTMEM_CHUNK_CACHE_MIB")
            .ok()
            .and_then(|m| m.parse::<u64>().ok())
            .map_or(DEFAULT_LIMIT, |m| m << 20);
        ChunkCache::open(&dir, limit)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Bytes held (as this process counts them).
    pub fn used(&self) -> u64 {
        let used = self.used.load(Ordering::Relaxed);
        if used != UNKNOWN {
            return used;
        }
        let scanned = self.entries().iter().map(|e| e.1).sum();
        match self
            .used
            .compare_exchange(UNKNOWN, scanned, Ordering::Relaxed, Ordering::Relaxed)
        {
            Ok(_) => scanned,
            Err(now) => now,
        }
    }

    fn path(&self, hash: &Hash) -> PathBuf {
        let h = chunk::hex(hash);
        self.dir.join(&h[..2]).join(h)
    }

    /// The cached object of chunk `hash`, if any (its use time is updated).
    pub fn get(&self, hash: &Hash) -> Option<Vec<u8>> {
        let path = self.path(hash);
        let bytes = std::fs::read(&path).ok()?;
        if let Ok(f) = std::fs::File::options().write(true).open(&path) {
            let _ = f.set_modified(SystemTime::now());
        }
        Some(bytes)
    }

    /// Drops a damaged entry.
    pub fn remove(&self, hash: &Hash) {
        let path = self.path(hash);
        if let Ok(meta) = std::fs::metadata(&path) {
            if std::fs::remove_file(&path).is_ok() {
                self.used
                    .fetch_sub(meta.len().min(self.used()), Ordering::Relaxed);
            }
        }
    }

    /// Keeps `bytes` as chunk `hash`'s object, then evicts the least recently used entries
    /// while the cache holds more than its limit.
    pub fn put(&self, hash: &Hash, bytes: &[u8]) -> Result<()> {
        let path = self.path(hash);
        put_file(&path, bytes).map_err(|source| Error::Cache {
            path: path.clone(),
            op: "write",
            source,
        })?;
        self.used();
        if self.used.fetch_add(bytes.len() as u64, Ordering::Relaxed) + bytes.len() as u64
            > self.limit
        {
            self.evict();
        }
        Ok(())
    }

    /// (path, size, last use) of every entry.
    fn entries(&self) -> Vec<(PathBuf, u64, SystemTime)> {
        let mut out = Vec::new();
        let Ok(dirs) = std::fs::read_dir(&self.dir) else {
            return out;
        };
        for d in dirs.flatten() {
            let Ok(files) = std::fs::read_dir(d.path()) else {
                continue;
            };
            for f in files.flatten() {
                if let Ok(meta) = f.metadata() {
                    if meta.is_file() {
                        out.push((
                            f.path(),
                            meta.len(),
                            meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                        ));
                    }
                }
            }
        }
        out
    }

    /// Removes the least recently used entries until the cache holds 90 % of its limit.
    fn evict(&self) {
        let mut entries = self.entries();
        let mut used: u64 = entries.iter().map(|e| e.1).sum();
        entries.sort_by_key(|e| e.2);
        let target = self.limit / 10 * 9;
        for (path, size, _) in entries {
            if used <= target {
                break;
            }
            if std::fs::remove_file(&path).is_ok() {
                used -= size;
            }
        }
        self.used.store(used, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_within_its_limit_dropping_the_least_recently_used() {
        let dir = std::env::temp_dir().join(format!("guestmem-cache-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cache = ChunkCache::open(&dir, 10_000).unwrap();
        let hashes: Vec<Hash> = (0..5u8).map(|i| chunk::hash(&[i])).collect();
        for (i, h) in hashes.iter().enumerate() {
            cache.put(h, &[i as u8; 3000]).unwrap();
            // Distinct use times, oldest first.
            let t = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1000 + i as u64);
            std::fs::File::options()
                .write(true)
                .open(cache.path(h))
                .unwrap()
                .set_modified(t)
                .unwrap();
        }
        assert!(cache.used() <= 10_000, "{}", cache.used());
        assert!(cache.get(&hashes[0]).is_none(), "the oldest went first");
        assert_eq!(cache.get(&hashes[4]).unwrap(), vec![4u8; 3000]);
        // A second process (or restore) sees what the first cached.
        let again = ChunkCache::open(&dir, 10_000).unwrap();
        assert_eq!(again.used(), cache.used());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
