//! Reading and writing sparse memory files: only data extents are read, zero pages are holes,
//! and CRC-32s over holes are combined instead of computed.

use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::OnceLock;

use guestmem_memory::PAGE_SIZE;
use guestmem_sys::to_usize;

/// Reads `buf.len()` bytes of `file` at `at`, but only its data extents (`SEEK_DATA` /
/// `SEEK_HOLE`, rounded out to whole pages), into `buf` at their offsets; returns the CRC-32 of
/// the whole range (holes count as zeros, without hashing them) and the ranges of `buf` read.
/// On file systems without hole reporting the whole range is one extent.
pub(crate) fn read_sparse(
    file: &File,
    at: u64,
    buf: &mut [u8],
) -> io::Result<(u32, Vec<Range<usize>>)> {
    let end = at + buf.len() as u64;
    let page = PAGE_SIZE;
    let mut ranges: Vec<Range<usize>> = Vec::new();
    let mut pos = at;
    while pos < end {
        // SAFETY: lseek on an fd we hold; it only reports offsets (reads use pread).
        let data = unsafe { libc::lseek(file.as_raw_fd(), pos as libc::off_t, libc::SEEK_DATA) };
        if data < 0 {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::ENXIO) => break, // only a hole from `pos` on
                Some(libc::EINVAL) => {
                    // No hole reporting here: read everything.
                    ranges.clear();
                    ranges.push(0..buf.len());
                    break;
                }
                _ => return Err(e),
            }
        }
        let data = data as u64;
        if data >= end {
            break;
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(file.as_raw_fd(), data as libc::off_t, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(io::Error::last_os_error());
        }
        let lo = to_usize((data - at) / page * page);
        let hi = to_usize(
            ((hole as u64).min(end) - at)
                .next_multiple_of(page)
                .min(buf.len() as u64),
        );
        match ranges.last_mut() {
            Some(last) if last.end >= lo => last.end = last.end.max(hi),
            _ => ranges.push(lo..hi),
        }
        pos = hole as u64;
    }
    let mut hasher = crc32fast::Hasher::new();
    let mut done = 0usize;
    for r in &ranges {
        file.read_exact_at(&mut buf[r.clone()], at + r.start as u64)?;
        hasher.combine(&zeros_hasher((r.start - done) as u64));
        hasher.update(&buf[r.clone()]);
        done = r.end;
    }
    hasher.combine(&zeros_hasher((buf.len() - done) as u64));
    Ok((hasher.finalize(), ranges))
}

/// A CRC-32 state over `len` zero bytes, combined from powers of two (O(log len)) instead of
/// hashing the zeros.
pub(crate) fn zeros_hasher(len: u64) -> crc32fast::Hasher {
    static POWERS: OnceLock<Vec<crc32fast::Hasher>> = OnceLock::new();
    let powers = POWERS.get_or_init(|| {
        let mut page = crc32fast::Hasher::new();
        page.update(&[0u8; to_usize(PAGE_SIZE)]);
        let mut powers = vec![page];
        for _ in 1..40 {
            let mut next = powers.last().expect("one").clone();
            next.combine(&next.clone());
            powers.push(next);
        }
        powers
    });
    let mut h = crc32fast::Hasher::new();
    let pages = len / PAGE_SIZE;
    for (k, power) in powers.iter().enumerate() {
        if pages >> k & 1 == 1 {
            h.combine(power);
        }
    }
    let rest = (len % PAGE_SIZE) as usize;
    if rest > 0 {
        let mut tail = crc32fast::Hasher::new();
        tail.update(&[0u8; to_usize(PAGE_SIZE)][..rest]);
        h.combine(&tail);
    }
    h
}

/// Whether `bytes` are all zero (16 bytes at a time, which the compiler vectorizes).
pub(crate) fn is_zero(bytes: &[u8]) -> bool {
    let mut words = bytes.chunks_exact(16);
    let mut acc = 0u128;
    for w in &mut words {
        acc |= u128::from_ne_bytes(w.try_into().expect("16 bytes"));
    }
    acc == 0 && words.remainder().iter().all(|&b| b == 0)
}

/// The runs of consecutive non-zero pages in `bytes`, as (offset, bytes).
pub(crate) fn nonzero_page_runs(bytes: &[u8]) -> impl Iterator<Item = (usize, &[u8])> {
    let page = to_usize(PAGE_SIZE);
    let pages = bytes.len().div_ceil(page);
    let is_zero = move |p: usize| is_zero(&bytes[p * page..((p + 1) * page).min(bytes.len())]);
    let mut p = 0;
    std::iter::from_fn(move || {
        while p < pages && is_zero(p) {
            p += 1;
        }
        if p == pages {
            return None;
        }
        let start = p;
        while p < pages && !is_zero(p) {
            p += 1;
        }
        let end = (p * page).min(bytes.len());
        Some((start * page, &bytes[start * page..end]))
    })
}

#[cfg(test)]
mod tests {
    use super::{nonzero_page_runs, read_sparse, to_usize, zeros_hasher};
    use std::os::unix::fs::FileExt;

    #[test]
    fn zero_runs_hash_like_zeros() {
        for len in [0u64, 4096, 3 * 4096, 2 << 20, (2 << 20) + 4096 + 100] {
            assert_eq!(
                zeros_hasher(len).finalize(),
                crc32fast::hash(&vec![0u8; to_usize(len)]),
                "{len} zero bytes"
            );
        }
    }

    /// A sparse file read by extents gives the bytes and the CRC-32 of a plain read.
    #[test]
    fn sparse_reads_match_plain_reads() {
        let path = std::env::temp_dir().join(format!("guestmem-sparse-{}", std::process::id()));
        let file = std::fs::File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        let _ = std::fs::remove_file(&path);
        let len = 4u64 << 20;
        file.set_len(len + (1 << 20)).unwrap();
        file.write_all_at(&[7u8; 5000], 4096 * 3).unwrap();
        file.write_all_at(&[9u8; 4096], (2 << 20) + 4096 * 100)
            .unwrap();
        file.write_all_at(&[1u8; 10], len - 10).unwrap();
        let mut plain = vec![0u8; to_usize(len)];
        file.read_exact_at(&mut plain, 0).unwrap();
        let mut sparse = vec![0u8; to_usize(len)];
        let (crc, ranges) = read_sparse(&file, 0, &mut sparse).unwrap();
        assert_eq!(crc, crc32fast::hash(&plain));
        assert_eq!(sparse, plain);
        assert!(
            ranges
                .iter()
                .map(std::iter::ExactSizeIterator::len)
                .sum::<usize>()
                < (1 << 20),
            "holes are not read: {ranges:?}"
        );
        // From an offset inside a hole, to the end of the file (a hole).
        let mut tail = vec![0u8; 1 << 20];
        let (crc, _) = read_sparse(&file, len, &mut tail).unwrap();
        assert_eq!(crc, crc32fast::hash(&[0u8; 1 << 20]));
    }

    #[test]
    fn runs_skip_zero_pages() {
        let mut b = vec![0u8; 5 * 4096];
        b[4096] = 1;
        b[2 * 4096 + 17] = 2;
        b[4 * 4096 + 4095] = 3;
        let runs: Vec<(usize, usize)> = nonzero_page_runs(&b).map(|(o, r)| (o, r.len())).collect();
        assert_eq!(runs, vec![(4096, 2 * 4096), (4 * 4096, 4096)]);
        assert_eq!(nonzero_page_runs(&[0u8; 8192]).count(), 0);
    }
}
