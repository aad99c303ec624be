//! The embedded back end: a directory on this host, no server needed.

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::objects::{ObjectInfo, ObjectStore};
use crate::{Error, Result};
use guestmem_sys::to_usize;

/// A store in a local directory: each object a file under it, put by writing a temporary file
/// beside it, syncing it and renaming it into place (atomic on every local file system).
#[derive(Debug, Clone)]
pub struct LocalObjectStore {
    root: PathBuf,
}

impl LocalObjectStore {
    /// The store in `root` (created when the first object is put).
    pub fn new(root: &Path) -> LocalObjectStore {
        LocalObjectStore {
            root: root.to_path_buf(),
        }
    }

    fn path(&self, key: &str) -> PathBuf {
        self.root.join(key)
    }

    fn err(&self, key: &str, op: &'static str) -> impl FnOnce(io::Error) -> Error {
        let (store, key) = (self.describe(), key.to_string());
        move |source| Error::Io {
            store,
            key,
            op,
            source,
        }
    }
}

/// A name for a temporary file no other writer (thread or process) uses at the same time.
pub(crate) fn temp_name(path: &Path) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(
        ".tmp-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    path.with_file_name(name)
}

/// Writes `bytes` to `path` atomically (temporary file, sync, rename), creating its directory.
pub(crate) fn put_file(path: &Path, bytes: &[u8]) -> io::Result<()> {
    put_file_sync(path, bytes, Durability::Synced)
}

/// [`put_file`] without syncing: for the chunk cache, whose entries are checked when read.
pub(crate) fn put_file_unsynced(path: &Path, bytes: &[u8]) -> io::Result<()> {
    put_file_sync(path, bytes, Durability::None)
}

/// How much of a file [`put_file_sync`] makes durable before its rename.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Durability {
    /// Synced (`fsync`) before the rename.
    Synced,
    /// Writeback started (`sync_file_range`), not waited for: a snapshot's chunks, which its
    /// commit makes durable all at once (`syncfs`) and then finds mostly on disk already, the
    /// disk having written them while the next chunks were compressed.
    Started,
    /// Left to the kernel.
    None,
}

/// [`put_file`], making the file as durable as `durability` says before the rename.
fn put_file_sync(path: &Path, bytes: &[u8], durability: Durability) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = temp_name(path);
    let written = File::create(&tmp).and_then(|mut f| {
        f.write_all(bytes)?;
        match durability {
            Durability::Synced => f.sync_all()?,
            Durability::Started => {
                // SAFETY: sync_file_range on a descriptor this function owns; it only starts
                // writeback of the file's dirty pages. Best effort: the commit's syncfs
                // reports any write error.
                unsafe { libc::sync_file_range(f.as_raw_fd(), 0, 0, libc::SYNC_FILE_RANGE_WRITE) };
            }
            Durability::None => {}
        }
        Ok(())
    });
    let renamed = written.and_then(|()| std::fs::rename(&tmp, path));
    if renamed.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    renamed
}

/// The block size direct writes are aligned to (a multiple of every disk's logical block).
const DIRECT_ALIGN: usize = 4096;

/// [`put_file`] for a snapshot's packs: written with `O_DIRECT` (from an aligned buffer of the
/// thread's, padded to a block, then cut to length), so the write neither copies the pack into
/// the page cache nor leaves it there: on this kind of host, filling fresh page-cache pages
/// cost a quarter of a snapshot write's CPU. Not synced: the snapshot's commit syncs the file
/// system once (`syncfs`), which also makes the cut to length durable. Where the file system
/// has no direct I/O (tmpfs), the write is [`Durability::Started`]'s.
fn put_file_direct(path: &Path, bytes: &[u8]) -> io::Result<()> {
    use std::cell::RefCell;
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    thread_local! {
        static BUF: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = temp_name(path);
    let file = match File::options()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_DIRECT)
        .open(&tmp)
    {
        Ok(f) => f,
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            return put_file_sync(path, bytes, Durability::Started)
        }
        Err(e) => return Err(e),
    };
    let padded = bytes.len().next_multiple_of(DIRECT_ALIGN);
    let written = BUF.with_borrow_mut(|buf| {
        if buf.len() < padded + DIRECT_ALIGN {
            buf.resize(padded + DIRECT_ALIGN, 0);
        }
        let at = buf.as_ptr().align_offset(DIRECT_ALIGN);
        let block = &mut buf[at..at + padded];
        block[..bytes.len()].copy_from_slice(bytes);
        block[bytes.len()..].fill(0);
        file.write_all_at(block, 0)?;
        file.set_len(bytes.len() as u64)
    });
    let renamed = written.and_then(|()| std::fs::rename(&tmp, path));
    if renamed.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    renamed
}

impl ObjectStore for LocalObjectStore {
    fn describe(&self) -> String {
        format!("store:{}", self.root.display())
    }

    fn get(&self, key: &str) -> Result<Vec<u8>> {
        match std::fs::read(self.path(key)) {
            Ok(bytes) => Ok(bytes),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Err(Error::Missing {
                store: self.describe(),
                key: key.to_string(),
            }),
            Err(e) => Err(self.err(key, "read")(e)),
        }
    }

    fn get_range(&self, key: &str, start: u64, len: u64) -> Result<Vec<u8>> {
        use std::os::unix::fs::FileExt;
        let file = match File::open(self.path(key)) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(Error::Missing {
                    store: self.describe(),
                    key: key.to_string(),
                })
            }
            Err(e) => return Err(self.err(key, "open")(e)),
        };
        let mut buf = vec![0u8; to_usize(len)];
        let mut done = 0;
        while done < buf.len() {
            match file.read_at(&mut buf[done..], start + done as u64) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.err(key, "read")(e)),
            }
        }
        buf.truncate(done);
        Ok(buf)
    }

    fn put(&self, key: &str, bytes: &[u8]) -> Result<()> {
        put_file(&self.path(key), bytes).map_err(self.err(key, "write"))
    }

    fn put_chunk(&self, key: &str, bytes: &[u8]) -> Result<()> {
        put_file_direct(&self.path(key), bytes).map_err(self.err(key, "write"))
    }

    fn sync(&self) -> Result<()> {
        use std::os::fd::AsRawFd;
        let dir = File::open(&self.root).map_err(self.err("", "open"))?;
        // SAFETY: syncfs on a file descriptor this function owns for the call.
        if unsafe { libc::syncfs(dir.as_raw_fd()) } != 0 {
            return Err(self.err("", "sync")(io::Error::last_os_error()));
        }
        Ok(())
    }

    fn exists(&self, key: &str) -> Result<bool> {
        self.path(key).try_exists().map_err(self.err(key, "stat"))
    }

    fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        let mut out = Vec::new();
        let mut stack = vec![prefix.trim_end_matches('/').to_string()];
        while let Some(dir) = stack.pop() {
            let entries = match std::fs::read_dir(self.path(&dir)) {
                Ok(entries) => entries,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(self.err(&dir, "list")(e)),
            };
            for entry in entries {
                let entry = entry.map_err(self.err(&dir, "list"))?;
                let name = entry.file_name().to_string_lossy().into_owned();
                let key = if dir.is_empty() {
                    name.clone()
                } else {
                    format!("{dir}/{name}")
                };
                let meta = match entry.metadata() {
                    Ok(meta) => meta,
                    // Removed meanwhile (a concurrent gc, a rename).
                    Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                    Err(e) => return Err(self.err(&key, "stat")(e)),
                };
                if meta.is_dir() {
                    stack.push(key);
                } else if meta.is_file() && !name.contains(".tmp-") {
                    out.push(ObjectInfo {
                        key,
                        size: meta.len(),
                        modified: meta.modified().map_err(self.err(&dir, "stat"))?,
                    });
                }
            }
        }
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    fn delete(&self, key: &str) -> Result<()> {
        match std::fs::remove_file(self.path(key)) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(self.err(key, "delete")(e)),
            _ => Ok(()),
        }
    }

    fn remove_stale_temporaries(&self, older_than: std::time::Duration) -> Result<usize> {
        let now = std::time::SystemTime::now();
        let mut removed = 0;
        let mut stack = vec![self.root.clone()];
        while let Some(dir) = stack.pop() {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for entry in entries.flatten() {
                let path = entry.path();
                let Ok(meta) = entry.metadata() else { continue };
                if meta.is_dir() {
                    stack.push(path);
                    continue;
                }
                let name = entry.file_name().to_string_lossy().into_owned();
                let Some((_, tail)) = name.rsplit_once(".tmp-") else {
                    continue;
                };
                let pid = tail.split('-').next().and_then(|p| p.parse::<i32>().ok());
                let gone = pid.filter(|&p| p > 0).is_some_and(|pid| {
                    // SAFETY: signal 0 only asks whether the process exists; nothing is sent.
                    let r = unsafe { libc::kill(pid, 0) };
                    r != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
                });
                let old = meta
                    .modified()
                    .ok()
                    .and_then(|m| now.duration_since(m).ok())
                    .is_some_and(|age| age >= older_than);
                if (gone || old) && std::fs::remove_file(&path).is_ok() {
                    removed += 1;
                }
            }
        }
        Ok(removed)
    }

    fn remote(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("guestmem-store-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn put_get_list_delete() {
        let dir = temp_dir("local");
        let b = LocalObjectStore::new(&dir);
        b.put("chunks/ab/abcd", b"one").unwrap();
        b.put("snapshots/x/manifest.json", b"two").unwrap();
        assert_eq!(b.get("chunks/ab/abcd").unwrap(), b"one");
        // A pack put directly: its bytes exactly, whatever its length.
        for n in [1, 4095, 4096, 10_000] {
            let bytes: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
            b.put_chunk("packs/ab/abcd", &bytes).unwrap();
            assert_eq!(b.get("packs/ab/abcd").unwrap(), bytes, "{n} bytes");
        }
        // Ranges: within, running past the end (fewer bytes), past it (none), missing.
        assert_eq!(b.get_range("chunks/ab/abcd", 1, 1).unwrap(), b"n");
        assert_eq!(b.get_range("chunks/ab/abcd", 1, 5).unwrap(), b"ne");
        assert!(b.get_range("chunks/ab/abcd", 9, 5).unwrap().is_empty());
        assert!(b
            .get_range("chunks/ab/none", 0, 1)
            .unwrap_err()
            .is_missing());
        assert!(b.exists("chunks/ab/abcd").unwrap());
        let keys: Vec<_> = b
            .list("chunks/")
            .unwrap()
            .into_iter()
            .map(|o| o.key)
            .collect();
        assert_eq!(keys, ["chunks/ab/abcd"]);
        b.delete("chunks/ab/abcd").unwrap();
        b.delete("chunks/ab/abcd").unwrap();
        let e = b.get("chunks/ab/abcd").unwrap_err();
        assert!(
            e.is_missing() && e.to_string().contains("chunks/ab/abcd"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
