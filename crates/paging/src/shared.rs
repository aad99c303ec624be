//! One copy of a snapshot's memory for every clone restored from it on this host.
//!
//! A [`SharedImage`] is a file on tmpfs per snapshot region (`DIR/<snapshot id>-<region>`),
//! holding the region's bytes as the snapshot has them, decompressed and checked, and a small
//! sidecar (`….bits`) with a header and one bit per page: set once the page's bytes in the file
//! are complete and checked ("published"). Each clone maps the file copy-on-write
//! (`MAP_PRIVATE`) as its guest RAM and registers that mapping with userfaultfd `MISSING` and
//! `MINOR`: a fault on a published page is resolved with `UFFDIO_CONTINUE`, which maps the
//! file's page read-only for a private mapping (a guest write still copies it into the clone's
//! own anonymous page); a fault on an unpublished page makes the clone fetch its chunk from the
//! snapshot (the source checks it), write it into the file, publish it, then `CONTINUE`. The
//! page cache holds one copy of every page any clone touched; each clone owns only the pages
//! it writes.
//!
//! Publication is atomic across processes: the bits live in a `MAP_SHARED` mapping of the
//! sidecar and are set (release) only after the bytes are in the file; a clone maps a page only
//! after reading its bit (acquire). Two clones fetching the same chunk at once write the same
//! checked bytes; a chunk that fails its check is never published, so every clone refuses it.
//! The sidecar's header names the snapshot, the region's size and the data file (device and
//! inode): a sidecar of another snapshot, or one whose data file was replaced, is refused
//! instead of trusted. A half-filled image (a clone died mid-write) is safe: what was not
//! published is fetched again.

use guestmem_sys::to_usize;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::{Error, Result};

/// Where clones share their memory: a directory on tmpfs, and the snapshot they restore.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Share {
    /// The directory holding the shared images (created if missing; must be on tmpfs).
    pub dir: PathBuf,
    /// The snapshot's content id (its manifest checksum), set by the restore, never by hand:
    /// it decides which clones share bytes.
    pub snapshot: Option<String>,
}

impl Share {
    /// The default directory, `/dev/shm/guestmem`.
    pub const DEFAULT_DIR: &'static str = "/dev/shm/guestmem";

    /// Sharing through `dir`, for the snapshot the restore names.
    pub fn new(dir: impl Into<PathBuf>) -> Share {
        Share {
            dir: dir.into(),
            snapshot: None,
        }
    }

    /// The same directory, for the snapshot whose content id is `id`.
    pub fn of(&self, id: &str) -> Share {
        Share {
            dir: self.dir.clone(),
            snapshot: Some(id.to_string()),
        }
    }
}

const MAGIC: &[u8; 8] = b"GMSHARE1";
/// The sidecar's header; the bitmap follows.
const HEADER: u64 = 4096;
const PAGE: u64 = 4096;
/// tmpfs's `f_type`.
const TMPFS_MAGIC: i64 = 0x0102_1994;

/// One region's shared image: its data file and publication bits (see the module docs).
pub struct SharedImage {
    data: File,
    path: PathBuf,
    size: u64,
    bits: *mut AtomicU64,
    bits_len: usize,
}

// SAFETY: `bits` is a shared mapping owned by the image (unmapped on drop) and only accessed
// through atomics.
unsafe impl Send for SharedImage {}
// SAFETY: as above.
unsafe impl Sync for SharedImage {}

impl std::fmt::Debug for SharedImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedImage")
            .field("path", &self.path)
            .field("size", &self.size)
            .finish()
    }
}

impl SharedImage {
    /// Opens (or creates) the image of region `region` (`size` bytes) of the snapshot `share`
    /// names. Refused: a share without a snapshot id, a directory not on tmpfs, a data file or
    /// sidecar of another snapshot or size.
    pub fn open(share: &Share, region: &str, size: u64) -> Result<SharedImage> {
        let Some(id) = share.snapshot.as_deref() else {
            return Err(Error::Config {
                region: region.into(),
                reason: "sharing memory needs the snapshot's content id, which a restore sets"
                    .into(),
            });
        };
        let name = file_name(id, region);
        let path = share.dir.join(&name);
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&share.dir)
            .map_err(io_err(region, "creating", &share.dir))?;
        check_tmpfs(&share.dir)
            .and_then(|()| check_owner(&share.dir))
            .map_err(|reason| Error::Share {
                region: region.into(),
                path: share.dir.clone(),
                reason,
            })?;
        let (data, meta) = open_data(region, &path, size)?;
        let header = header(id, region, size, meta.dev(), meta.ino());
        let bits_path = path.with_file_name(format!("{name}.bits"));
        let bits_len = to_usize(HEADER + size.div_ceil(PAGE).div_ceil(64) * 8);
        let map = map_sidecar(region, &bits_path, &header, bits_len)?;
        Ok(SharedImage {
            data,
            path,
            size,
            // SAFETY: the bitmap starts `HEADER` bytes (page aligned) into the mapping.
            bits: unsafe { map.cast::<u8>().add(to_usize(HEADER)) }.cast(),
            bits_len,
        })
    }

    /// The data file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The data file's descriptor (the clones map it; the pager writes into it).
    pub fn fd(&self) -> RawFd {
        self.data.as_raw_fd()
    }

    /// The region's bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    fn word(&self, i: u64) -> &AtomicU64 {
        debug_assert!(to_usize(HEADER + i * 8 + 8) <= self.bits_len);
        // SAFETY: word `i` lies inside the bitmap (the caller's range is inside the region).
        unsafe { &*self.bits.add(to_usize(i)) }
    }

    /// Calls `f` with each bitmap word and the mask of the pages of `[offset, offset + len)`
    /// in it.
    fn for_words(&self, offset: u64, len: u64, mut f: impl FnMut(&AtomicU64, u64) -> bool) -> bool {
        let end = (offset + len).min(self.size);
        if end <= offset {
            return true;
        }
        let (first, last) = (offset / PAGE, (end - 1) / PAGE);
        let mut p = first;
        while p <= last {
            let w = p / 64;
            let hi = last.min(w * 64 + 63);
            let n = hi - p + 1;
            let mask = if n == 64 {
                !0
            } else {
                ((1u64 << n) - 1) << (p % 64)
            };
            if !f(self.word(w), mask) {
                return false;
            }
            p = hi + 1;
        }
        true
    }

    /// Whether every page of `[offset, offset + len)` is published.
    pub fn is_published(&self, offset: u64, len: u64) -> bool {
        self.for_words(offset, len, |w, mask| {
            w.load(Ordering::Acquire) & mask == mask
        })
    }

    /// Marks `[offset, offset + len)` published: its bytes in the data file are complete and
    /// checked (the caller's promise).
    pub fn publish(&self, offset: u64, len: u64) {
        self.for_words(offset, len, |w, mask| {
            w.fetch_or(mask, Ordering::Release);
            true
        });
    }

    /// Writes `bytes` (checked) into the data file at `offset`, not yet published.
    pub fn write(&self, offset: u64, bytes: &[u8]) -> io::Result<()> {
        self.data.write_all_at(bytes, offset)
    }

    /// Bytes of the data file held in memory (one copy, whichever clones map them).
    pub fn resident_bytes(&self) -> u64 {
        self.data.metadata().map_or(0, |m| m.blocks() * 512)
    }

    /// Bytes published so far.
    pub fn published_bytes(&self) -> u64 {
        let words = self.size.div_ceil(PAGE).div_ceil(64);
        (0..words)
            .map(|i| u64::from(self.word(i).load(Ordering::Relaxed).count_ones()) * PAGE)
            .sum()
    }
}

impl Drop for SharedImage {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `open`, `HEADER` bytes before `bits`, unmapped once.
        unsafe {
            libc::munmap(
                self.bits.cast::<u8>().sub(to_usize(HEADER)).cast(),
                self.bits_len,
            )
        };
    }
}

/// The image's file name in the share's directory: the snapshot's content id and the
/// region's name, anything but ASCII letters, digits and '-' made '_'.
fn file_name(id: &str, region: &str) -> String {
    format!("{id}-{region}")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The error of I/O `op` on `path`, for region `region`.
fn io_err(region: &str, op: &'static str, path: &Path) -> impl FnOnce(io::Error) -> Error {
    let (region, path) = (region.to_string(), path.to_path_buf());
    move |source| Error::ShareIo {
        region,
        path,
        op,
        source,
    }
}

/// Opens (or creates) the data file of region `region`'s image at `path`, `size` bytes long;
/// refused when it is someone else's or longer (another snapshot's). Returns it and its
/// metadata (the sidecar's header names its device and inode).
fn open_data(region: &str, path: &Path, size: u64) -> Result<(File, std::fs::Metadata)> {
    let data = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)
        .map_err(io_err(region, "opening", path))?;
    let meta = data.metadata().map_err(io_err(region, "stat", path))?;
    check_owner(path).map_err(|reason| Error::Share {
        region: region.into(),
        path: path.to_path_buf(),
        reason,
    })?;
    if meta.len() > size {
        return Err(Error::Share {
            region: region.into(),
            path: path.to_path_buf(),
            reason: format!(
                "{} bytes, more than the region's {size}: not this snapshot's; delete it",
                meta.len()
            ),
        });
    }
    if meta.len() < size {
        data.set_len(size)
            .map_err(io_err(region, "ftruncate", path))?;
    }
    Ok((data, meta))
}

/// Opens (or creates) the sidecar at `bits_path` of region `region`'s image, `bits_len` bytes
/// starting with `header`, and maps it shared; refused when its header or length is another
/// image's (a stale one).
fn map_sidecar(
    region: &str,
    bits_path: &Path,
    header: &[u8],
    bits_len: usize,
) -> Result<*mut libc::c_void> {
    let sidecar = open_sidecar(bits_path, header, bits_len as u64).map_err(io_err(
        region,
        "creating the sidecar",
        bits_path,
    ))?;
    let mut found = vec![0u8; header.len()];
    sidecar.read_exact_at(&mut found, 0).map_err(io_err(
        region,
        "reading the sidecar",
        bits_path,
    ))?;
    let sidecar_len = sidecar
        .metadata()
        .map_err(io_err(region, "stat", bits_path))?
        .len();
    if found != header || sidecar_len != bits_len as u64 {
        return Err(Error::Share {
            region: region.into(),
            path: bits_path.to_path_buf(),
            reason: "its header names another snapshot, region size or data file (a \
                     stale image): delete it and its data file"
                .into(),
        });
    }
    // SAFETY: a fresh shared mapping of the whole sidecar, which is `bits_len` bytes long
    // (checked above); it is only accessed through atomics.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            bits_len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            sidecar.as_raw_fd(),
            0,
        )
    };
    if map == libc::MAP_FAILED {
        return Err(io_err(region, "mmap", bits_path)(io::Error::last_os_error()));
    }
    Ok(map)
}

/// The sidecar's header: magic, the snapshot id and region, the region's size, the data file.
fn header(id: &str, region: &str, size: u64, dev: u64, ino: u64) -> Vec<u8> {
    let mut h = MAGIC.to_vec();
    for v in [size, PAGE, dev, ino] {
        h.extend_from_slice(&v.to_le_bytes());
    }
    let names = format!("{id}\0{region}\0");
    h.extend_from_slice(&(names.len() as u64).to_le_bytes());
    h.extend_from_slice(names.as_bytes());
    h.truncate(to_usize(HEADER));
    h
}

/// Opens the sidecar at `path`, creating it with `header` and `len` bytes if it does not exist:
/// written under a temporary name of its own and linked into place, so that any sidecar seen
/// has its whole header (two clones creating it at once: one link wins, the other opens its
/// file).
fn open_sidecar(path: &Path, header: &[u8], len: u64) -> io::Result<File> {
    let open = || OpenOptions::new().read(true).write(true).open(path);
    match open() {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        other => return other,
    }
    let tmp = temporary_path(path);
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all_at(header, 0)?;
    f.set_len(len)?;
    let linked = std::fs::hard_link(&tmp, path);
    let _ = std::fs::remove_file(&tmp);
    match linked {
        Ok(()) => Ok(f),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => open(),
        Err(e) => Err(e),
    }
}

/// A name beside `path` that no other creation uses, in this process (clones restored by
/// several threads at once) or another: named by the process alone, a second thread's
/// creation truncated the first one's file before it was linked into place, and a clone read
/// a sidecar without its header.
fn temporary_path(path: &Path) -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    path.with_extension(format!("tmp{}-{n}", std::process::id()))
}

/// `Err` when `path` belongs to another user or others may write it: its bytes reach the
/// guests, so only this user may have put them there.
fn check_owner(path: &Path) -> std::result::Result<(), String> {
    let meta = std::fs::symlink_metadata(path).map_err(|e| format!("stat: {e}"))?;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me || meta.mode() & 0o022 != 0 || meta.file_type().is_symlink() {
        return Err(format!(
            "owned by uid {} with mode {:o} (a symlink: {}): only this user (uid {me}) may \
             write what clones map",
            meta.uid(),
            meta.mode() & 0o7777,
            meta.file_type().is_symlink()
        ));
    }
    Ok(())
}

/// `Err` naming the file system when `dir` is not on tmpfs (userfaultfd `MINOR` faults, which
/// map the shared pages, exist for shmem and hugetlbfs only).
fn check_tmpfs(dir: &Path) -> std::result::Result<(), String> {
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())
        .map_err(|_| "a path with a NUL byte".to_string())?;
    // SAFETY: statfs fills the zeroed struct; `c` is a valid C string.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::statfs(c.as_ptr(), &raw mut st) } != 0 {
        return Err(format!("statfs: {}", io::Error::last_os_error()));
    }
    if st.f_type as i64 != TMPFS_MAGIC {
        return Err(format!(
            "not on tmpfs (file system type {:#x}): clones map shared pages with userfaultfd \
             MINOR faults, which only shmem has; use /dev/shm",
            st.f_type
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = PathBuf::from(format!(
            "/dev/shm/guestmem-unit-{}-{name}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn bits_publish_exact_pages_and_are_seen_by_a_second_opener() {
        let d = dir("bits");
        let share = Share::new(&d).of("abc");
        let a = SharedImage::open(&share, "ram", 1 << 20).unwrap();
        let b = SharedImage::open(&share, "ram", 1 << 20).unwrap();
        assert!(!a.is_published(0, 4096));
        a.publish(4096 * 63, 4096 * 3);
        assert!(b.is_published(4096 * 63, 4096 * 3));
        assert!(!b.is_published(4096 * 62, 4096 * 2));
        assert!(!b.is_published(4096 * 65, 4096 * 2));
        assert_eq!(b.published_bytes(), 3 * 4096);
        a.write(0, &[7u8; 4096]).unwrap();
        assert_eq!(b.resident_bytes(), 4096);
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// Threads creating the same sidecar at once each get it whole: its header and length,
    /// whichever creation won.
    #[test]
    fn sidecars_created_at_once_by_threads_are_whole() {
        let d = dir("sidecar-race");
        std::fs::create_dir_all(&d).unwrap();
        let header = vec![0x5a; 4096];
        for round in 0..50 {
            let path = d.join(format!("{round}.bits"));
            let start = std::sync::Barrier::new(8);
            std::thread::scope(|s| {
                for _ in 0..8 {
                    let (path, header, start) = (&path, &header, &start);
                    s.spawn(move || {
                        start.wait();
                        let f = open_sidecar(path, header, 1 << 16).unwrap();
                        let mut found = vec![0u8; header.len()];
                        f.read_exact_at(&mut found, 0).unwrap();
                        assert!(found == *header, "round {round}: a torn header");
                        assert_eq!(f.metadata().unwrap().len(), 1 << 16);
                    });
                }
            });
        }
        assert_ne!(temporary_path(&d), temporary_path(&d));
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn the_file_name_keeps_only_letters_digits_and_dashes() {
        assert_eq!(file_name("ab12-cd", "ram"), "ab12-cd-ram");
        assert_eq!(file_name("id", "../dev/x y"), "id-___dev_x_y");
    }

    #[test]
    fn a_stale_or_foreign_image_is_refused() {
        let d = dir("stale");
        let share = Share::new(&d).of("abc");
        drop(SharedImage::open(&share, "ram", 1 << 20).unwrap());
        // Another size under the same name.
        let e = SharedImage::open(&share, "ram", 1 << 19).unwrap_err();
        assert!(e.to_string().contains("delete it"), "{e}");
        // The data file replaced: the sidecar names the old one.
        let path = d.join("abc-ram");
        std::fs::remove_file(&path).unwrap();
        let e = SharedImage::open(&share, "ram", 1 << 20).unwrap_err();
        assert!(e.to_string().contains("stale image"), "{e}");
        // No snapshot id.
        let e = SharedImage::open(&Share::new(&d), "ram", 1 << 20).unwrap_err();
        assert!(e.to_string().contains("content id"), "{e}");
        // A directory others may write into.
        std::fs::set_permissions(&d, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
        let e = SharedImage::open(&share, "ram", 1 << 20).unwrap_err();
        assert!(e.to_string().contains("only this user"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_directory_off_tmpfs_is_refused() {
        let d = std::env::current_dir().unwrap().join("target-share-test");
        if check_tmpfs(&std::env::current_dir().unwrap()).is_ok() {
            return;
        }
        let e = SharedImage::open(&Share::new(&d).of("x"), "ram", 4096).unwrap_err();
        let _ = std::fs::remove_dir_all(&d);
        assert!(e.to_string().contains("not on tmpfs"), "{e}");
    }
}
