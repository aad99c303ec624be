//! The host's local cache of chunks fetched from a remote store: shared by every restore on
//! the host (a directory; each chunk a file named by its hash, put atomically), bounded (the
//! least recently used chunks go first once it holds more than its limit).
//!
//! An entry is the chunk as the guest sees it (decompressed, `HASH.raw`) followed by the
//! CRC-32 of those bytes: it entered the cache only after its BLAKE3 hash was checked, and a
//! second restore then reads it as a lazy restore reads a flat snapshot's local file (which
//! a CRC-32 per chunk guards the same way), with no decompression and no rehash. An entry
//! whose size or CRC is wrong (a torn write, a damaged disk) is dropped and fetched again.
//! Entries are not synced: losing one to a crash costs a refetch, nothing more.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use crate::chunk::{self, Hash};
use crate::local::put_file_unsynced;
use crate::{Error, Result};

/// `used` before the cache was counted.
const UNKNOWN: u64 = u64::MAX;

/// The default bound: 8 GiB.
pub const DEFAULT_LIMIT: u64 = 8 << 30;

/// The host's cache of checked chunks, decompressed, each with a CRC-32, bounded in bytes
/// (least recently used out first).
#[derive(Debug)]
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

    /// The cache's directory.
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
        self.dir.join(&h[..2]).join(format!("{h}.raw"))
    }

    /// Puts the cached chunk `hash` into `out` (its length is the chunk's) and returns true,
    /// if the cache holds it whole (size and CRC-32 as put); its use time is updated. False
    /// when it is not cached, or its entry is damaged (then [`ChunkCache::remove`] it).
    pub fn get_into(&self, hash: &Hash, out: &mut [u8]) -> bool {
        let Ok(mut f) = File::open(self.path(hash)) else {
            return false;
        };
        if f.metadata().map(|m| m.len()).ok() != Some(out.len() as u64 + 4) {
            return false;
        }
        let mut crc = [0u8; 4];
        if f.read_exact(out).is_err() || f.read_exact(&mut crc).is_err() {
            return false;
        }
        if crc32fast::hash(out) != u32::from_le_bytes(crc) {
            return false;
        }
        let _ = f.set_modified(SystemTime::now());
        true
    }

    /// Drops a damaged entry.
    /// Whether there was one to drop.
    pub fn remove(&self, hash: &Hash) -> bool {
        let path = self.path(hash);
        let Ok(meta) = std::fs::metadata(&path) else {
            return false;
        };
        let removed = std::fs::remove_file(&path).is_ok();
        if removed {
            self.used
                .fetch_sub(meta.len().min(self.used()), Ordering::Relaxed);
        }
        removed
    }

    /// Keeps `chunk`, the checked bytes of chunk `hash`, then evicts the least recently used
    /// entries while the cache holds more than its limit.
    pub fn put(&self, hash: &Hash, chunk: &[u8]) -> Result<()> {
        let path = self.path(hash);
        let mut entry = Vec::with_capacity(chunk.len() + 4);
        entry.extend_from_slice(chunk);
        entry.extend_from_slice(&crc32fast::hash(chunk).to_le_bytes());
        put_file_unsynced(&path, &entry).map_err(|source| Error::Cache {
            path: path.clone(),
            op: "write",
            source,
        })?;
        self.used();
        let n = entry.len() as u64;
        if self.used.fetch_add(n, Ordering::Relaxed) + n > self.limit {
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
        let cache = ChunkCache::open(&dir, 10_100).unwrap();
        let hashes: Vec<Hash> = (0..5u8).map(|i| chunk::hash(&[i])).collect();
        for (i, h) in hashes.iter().enumerate() {
            cache.put(h, &[u8::try_from(i).unwrap(); 3000]).unwrap();
            // Distinct use times, oldest first.
            let t = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1000 + i as u64);
            std::fs::File::options()
                .write(true)
                .open(cache.path(h))
                .unwrap()
                .set_modified(t)
                .unwrap();
        }
        assert!(cache.used() <= 10_100, "{}", cache.used());
        let mut buf = vec![0u8; 3000];
        assert!(
            !cache.get_into(&hashes[0], &mut buf),
            "the oldest went first"
        );
        assert!(cache.get_into(&hashes[4], &mut buf));
        assert_eq!(buf, vec![4u8; 3000]);
        // A second process (or restore) sees what the first cached.
        let again = ChunkCache::open(&dir, 10_100).unwrap();
        assert_eq!(again.used(), cache.used());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A damaged entry (one byte flipped, or cut short) is not served.
    #[test]
    #[allow(clippy::cast_possible_truncation)] // a byte pattern: wraps on purpose.
    fn refuses_a_damaged_or_truncated_entry() {
        let dir = std::env::temp_dir().join(format!("guestmem-cache-crc-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cache = ChunkCache::open(&dir, 1 << 20).unwrap();
        let data: Vec<u8> = (0..8192u32).map(|i| (i * 31) as u8).collect();
        let h = chunk::hash(&data);
        cache.put(&h, &data).unwrap();
        let mut out = vec![0u8; data.len()];
        assert!(cache.get_into(&h, &mut out));
        assert_eq!(out, data);
        let mut bytes = std::fs::read(cache.path(&h)).unwrap();
        bytes[100] ^= 1;
        std::fs::write(cache.path(&h), &bytes).unwrap();
        assert!(!cache.get_into(&h, &mut out), "a flipped byte was served");
        bytes[100] ^= 1;
        std::fs::write(cache.path(&h), &bytes[..bytes.len() - 1]).unwrap();
        assert!(
            !cache.get_into(&h, &mut out),
            "a truncated entry was served"
        );
        // A buffer of another length (another chunk size) does not match either.
        std::fs::write(cache.path(&h), &bytes).unwrap();
        assert!(!cache.get_into(&h, &mut vec![0u8; 4096]));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
