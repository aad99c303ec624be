//! Guest memory that starts from an image: a raw dump of a guest's RAM (captured from a Linux
//! guest with QEMU's `pmemsave`, see `scripts/capture-guest-memory.sh`), plain or
//! zstd-compressed, put into a region by the population engine. Workloads then run on top of
//! real memory contents instead of an empty guest.

use guestmem_sys::to_usize;
use std::fs::File;
use std::io::{self, Read};
use std::path::Path;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::populate::{populate, PopulateFrom};
use crate::{Error, Region, Result, PAGE_SIZE};

/// The zstd frame magic (little-endian 0xFD2FB528).
const ZSTD_MAGIC: [u8; 4] = [0x28, 0xb5, 0x2f, 0xfd];
/// How much of a compressed image is decompressed and populated at a time (bounds the memory
/// a load needs besides the region itself).
const PIECE: usize = 64 << 20;

/// What loading an image did.
#[derive(Debug, Clone, Serialize)]
pub struct ImageLoad {
    /// Bytes of the image (decompressed), now the region's first bytes.
    pub image_bytes: u64,
    /// Whether the file was zstd-compressed.
    pub compressed: bool,
    /// Pages copied, and pages skipped because they were all zero.
    pub pages_copied: u64,
    /// Pages skipped because they were all zero.
    pub zero_pages_skipped: u64,
    #[serde(skip)]
    /// How long it took.
    pub elapsed: Duration,
}

/// Fills `region` from offset 0 with the image at `path` (raw, or zstd-compressed: recognized
/// by its magic). The image may be smaller than the region (the rest stays zero), not larger,
/// and must be a whole number of pages. When its size is known up front (a raw file, a zstd
/// frame that records it) nothing is written to a refused image; a compressed image that turns
/// out too large or damaged midway fails naming the offset, leaving the region partly written
/// (the VM it was meant for must not run).
pub fn load_image(region: &Region, path: &Path) -> Result<ImageLoad> {
    let start = Instant::now();
    let bad = |reason: String| Error::Image {
        path: path.to_path_buf(),
        reason,
    };
    let io = |what: String| {
        move |source: std::io::Error| Error::ImageIo {
            path: path.to_path_buf(),
            what,
            source,
        }
    };
    let mut file = File::open(path).map_err(io("cannot open".into()))?;
    let meta = file.metadata().map_err(io("cannot stat".into()))?;
    if !meta.is_file() {
        return Err(bad("not a regular file".into()));
    }
    let mut magic = [0u8; 4];
    let compressed = meta.len() >= 4 && file.read_exact(&mut magic).is_ok() && magic == ZSTD_MAGIC;
    // A compressed image's size is in its frame header when the compressor knew it (the zstd
    // command on a file); otherwise it is found while decompressing.
    let known = if compressed {
        let mut head = vec![0u8; 18.min(to_usize(meta.len()))];
        read_at(&file, &mut head, 0).map_err(io("cannot read".into()))?;
        zstd::zstd_safe::get_frame_content_size(&head)
            .ok()
            .flatten()
    } else {
        Some(meta.len())
    };
    if let Some(n) = known {
        check_size(n, region).map_err(bad)?;
    }
    let mut load = ImageLoad {
        image_bytes: 0,
        compressed,
        pages_copied: 0,
        zero_pages_skipped: 0,
        elapsed: Duration::ZERO,
    };
    if compressed {
        let file = File::open(path).map_err(io("cannot open".into()))?;
        let mut decoder =
            zstd::Decoder::new(file).map_err(io("starting the zstd decoder".into()))?;
        let mut piece = vec![0u8; PIECE];
        loop {
            let offset = load.image_bytes;
            let len = read_full(&mut decoder, &mut piece)
                .map_err(io(format!("decompressing at offset {offset:#x}")))?;
            if len == 0 {
                break;
            }
            check_size(offset + len as u64, region).map_err(bad)?;
            let done = populate(
                region,
                offset,
                len as u64,
                PopulateFrom::Bytes(&piece[..len]),
            )?;
            load.pages_copied += done.pages_copied;
            load.zero_pages_skipped += done.zero_pages_skipped;
            load.image_bytes += len as u64;
        }
        check_size(load.image_bytes, region).map_err(bad)?;
    } else {
        let file = File::open(path).map_err(io("cannot open".into()))?;
        let size = meta.len();
        let done = populate(region, 0, size, PopulateFrom::file(&file))?;
        load.image_bytes = size;
        load.pages_copied = done.pages_copied;
        load.zero_pages_skipped = done.zero_pages_skipped;
    }
    load.elapsed = start.elapsed();
    Ok(load)
}

/// Whether an image of `n` bytes can start `region`: whole pages, at least one, and no more
/// than the region holds.
fn check_size(n: u64, region: &Region) -> std::result::Result<(), String> {
    if n == 0 || !n.is_multiple_of(PAGE_SIZE) {
        return Err(format!(
            "{n} bytes is not a positive whole number of {PAGE_SIZE}-byte pages"
        ));
    }
    if n > region.size() {
        return Err(format!(
            "{n:#x} bytes do not fit region '{}' of {:#x} bytes",
            region.name(),
            region.size()
        ));
    }
    Ok(())
}

/// Reads until `buf` is full or the stream ends; returns how much it read.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

fn read_at(file: &File, buf: &mut [u8], at: u64) -> io::Result<()> {
    use std::os::unix::fs::FileExt;
    file.read_exact_at(buf, at)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Backend, RegionSpec};
    use std::path::PathBuf;

    fn temp(name: &str, bytes: &[u8]) -> PathBuf {
        let p = std::env::temp_dir().join(format!("guestmem-image-{}-{name}", std::process::id()));
        std::fs::write(&p, bytes).unwrap();
        p
    }

    fn region(pages: u64) -> Region {
        let spec = RegionSpec::new("ram", 0, pages * PAGE_SIZE, Backend::Anon);
        Region::create(spec, None).unwrap()
    }

    fn page(fill: u8) -> Vec<u8> {
        vec![fill; to_usize(PAGE_SIZE)]
    }

    /// A zstd stream that does not record its size (as a streaming compressor writes it) is
    /// still loaded byte for byte, its zero pages skipped; one that turns out larger than the
    /// region is refused naming the sizes.
    #[test]
    fn a_compressed_image_of_unknown_size_loads_or_is_refused() {
        let image = [page(7), page(0), page(9)].concat();
        let mut enc = zstd::Encoder::new(Vec::new(), 1).unwrap();
        std::io::Write::write_all(&mut enc, &image).unwrap();
        let zst = enc.finish().unwrap();
        assert_eq!(
            zstd::zstd_safe::get_frame_content_size(&zst[..18]).unwrap(),
            None,
            "the frame records no size"
        );
        let path = temp("stream.zst", &zst);
        let r = region(4);
        let load = load_image(&r, &path).unwrap();
        assert_eq!(
            (
                load.image_bytes,
                load.compressed,
                load.pages_copied,
                load.zero_pages_skipped
            ),
            (3 * PAGE_SIZE, true, 2, 1)
        );
        let mut back = vec![0u8; to_usize(4 * PAGE_SIZE)];
        // SAFETY: the region's mapping is live and 4 pages long; nothing else uses it.
        unsafe { std::ptr::copy_nonoverlapping(r.host_addr(), back.as_mut_ptr(), back.len()) };
        assert!(back[..image.len()] == image[..]);
        assert!(back[image.len()..].iter().all(|&b| b == 0));

        let e = load_image(&region(2), &path).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "memory image {}: 0x3000 bytes do not fit region 'ram' of 0x2000 bytes",
                path.display()
            )
        );
        let _ = std::fs::remove_file(&path);
    }

    /// A damaged compressed image fails naming the offset it was decompressing; an empty file,
    /// a directory and a missing file are each refused saying which.
    #[test]
    fn bad_images_name_the_problem() {
        let mut zst = zstd::encode_all(&page(5)[..], 1).unwrap();
        let n = zst.len();
        zst[n - 8..].fill(0xff);
        let path = temp("damaged.zst", &zst);
        match load_image(&region(2), &path) {
            Err(Error::ImageIo { what, .. }) => assert_eq!(what, "decompressing at offset 0x0"),
            other => panic!("{other:?}"),
        }
        let empty = temp("empty.raw", &[]);
        let e = load_image(&region(2), &empty).unwrap_err().to_string();
        assert!(
            e.ends_with("0 bytes is not a positive whole number of 4096-byte pages"),
            "{e}"
        );
        let e = load_image(&region(2), &std::env::temp_dir()).unwrap_err();
        assert!(
            matches!(&e, Error::Image { reason, .. } if reason == "not a regular file"),
            "{e}"
        );
        let missing = std::env::temp_dir().join("guestmem-image-none");
        match load_image(&region(2), &missing) {
            Err(Error::ImageIo { what, source, .. }) => {
                assert_eq!(what, "cannot open");
                assert_eq!(source.kind(), io::ErrorKind::NotFound);
            }
            other => panic!("{other:?}"),
        }
        for p in [path, empty] {
            let _ = std::fs::remove_file(p);
        }
    }

    /// `read_full` gathers short reads until the buffer is full, and stops at the end.
    #[test]
    fn read_full_gathers_short_reads() {
        struct Dribble(Vec<u8>);
        impl Read for Dribble {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                let n = buf.len().min(3).min(self.0.len());
                buf[..n].copy_from_slice(&self.0[..n]);
                self.0.drain(..n);
                Ok(n)
            }
        }
        let mut src = Dribble((0..10).collect());
        let mut buf = [0u8; 8];
        assert_eq!(read_full(&mut src, &mut buf).unwrap(), 8);
        assert_eq!(buf, [0, 1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(read_full(&mut src, &mut buf).unwrap(), 2);
        assert_eq!(buf[..2], [8, 9]);
        assert_eq!(read_full(&mut src, &mut buf).unwrap(), 0);
    }
}
