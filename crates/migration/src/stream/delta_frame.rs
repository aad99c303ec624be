//! PagesD frames: pages as deltas against the receiver's copy of them (see [`crate::delta`]).

use std::io::Read;

use super::*;

/// A PagesD payload's own header: gpa, count, flags (none defined).
const DELTA_HEADER: usize = 16;

/// The bodies of a PagesD frame's `count` pages (`body`: sizes, then bodies), each whole
/// ([`PAGE`] bytes) or a delta that [`crate::delta::check`] accepts.
fn delta_parts(body: &[u8], count: usize) -> Result<Vec<&[u8]>, StreamError> {
    let malformed = |what: String| StreamError::Malformed(format!("PagesD frame: {what}"));
    if count == 0 || count > MAX_FRAME_PAGES || body.len() < 2 * count {
        return Err(malformed(format!(
            "{count} pages (1 to {MAX_FRAME_PAGES}) in {} bytes",
            body.len()
        )));
    }
    let (sizes, mut rest) = body.split_at(2 * count);
    let mut parts = Vec::with_capacity(count);
    for (p, size) in sizes.chunks_exact(2).enumerate() {
        let size = u16::from_le_bytes([size[0], size[1]]) as usize;
        if size > PAGE || size > rest.len() {
            return Err(malformed(format!(
                "page {p} of {size} bytes, {} left, at most {PAGE}",
                rest.len()
            )));
        }
        let (part, after) = rest.split_at(size);
        if size < PAGE {
            crate::delta::check(part).map_err(|e| malformed(format!("page {p}: {e}")))?;
        }
        parts.push(part);
        rest = after;
    }
    if !rest.is_empty() {
        return Err(malformed(format!("{} bytes after its pages", rest.len())));
    }
    Ok(parts)
}

fn apply_parts(parts: &[&[u8]], dst: &mut [u8]) -> Result<(), StreamError> {
    for (part, page) in parts.iter().zip(dst.chunks_exact_mut(PAGE)) {
        if part.len() == PAGE {
            page.copy_from_slice(part);
        } else {
            crate::delta::apply(part, page)
                .map_err(|e| StreamError::Malformed(format!("PagesD frame: {e}")))?;
        }
    }
    Ok(())
}

impl Frame {
    /// Encodes into `out` (its contents replaced) a PagesD frame of the pages in `pages` (whole
    /// pages, at most [`MAX_FRAME_PAGES`]) at `gpa`: page `p` travels as the delta that
    /// `delta(p, page, out)` appends to `out` when it returns true and the delta is smaller
    /// than a page, else whole. Returns the pages sent as deltas and their bytes.
    #[allow(clippy::cast_possible_truncation)] // frame lengths and counts are bounded by MAX_PAYLOAD.
    pub fn encode_delta_with(
        out: &mut Vec<u8>,
        gpa: u64,
        pages: &[u8],
        mut delta: impl FnMut(usize, &[u8], &mut Vec<u8>) -> bool,
    ) -> Result<(usize, usize), StreamError> {
        let count = pages.len() / PAGE;
        if pages.is_empty() || !pages.len().is_multiple_of(PAGE) || count > MAX_FRAME_PAGES {
            return Err(StreamError::Malformed(format!(
                "a PagesD frame carries whole pages, at most {MAX_FRAME_PAGES}, not {} bytes",
                pages.len()
            )));
        }
        let sizes_at = HEADER + DELTA_HEADER;
        out.clear();
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&[kind::PAGES_D, 0, 0, 0, 0, 0, 0, 0]);
        out.extend_from_slice(&gpa.to_le_bytes());
        out.extend_from_slice(&(count as u32).to_le_bytes());
        out.extend_from_slice(&[0; 4]);
        out.resize(sizes_at + 2 * count, 0);
        let (mut deltas, mut delta_bytes) = (0, 0);
        for (p, page) in pages.chunks_exact(PAGE).enumerate() {
            let at = out.len();
            let size = if delta(p, page, out) && out.len() - at < PAGE {
                deltas += 1;
                delta_bytes += out.len() - at;
                out.len() - at
            } else {
                out.truncate(at);
                out.extend_from_slice(page);
                PAGE
            };
            out[sizes_at + 2 * p..sizes_at + 2 * p + 2]
                .copy_from_slice(&(size as u16).to_le_bytes());
        }
        let payload = out.len() - HEADER;
        out[8..12].copy_from_slice(&(payload as u32).to_le_bytes());
        let crc = crc32fast::hash(out);
        out.extend_from_slice(&crc.to_le_bytes());
        Ok((deltas, delta_bytes))
    }

    /// Applies a [`Frame::Delta`] to `dst`, the receiver's copy of its pages (exactly its
    /// `count` pages).
    pub fn apply_delta(&self, dst: &mut [u8]) -> Result<(), StreamError> {
        let Frame::Delta { count, body, .. } = self else {
            return Err(StreamError::Malformed("not a PagesD frame".into()));
        };
        if dst.len() != *count as usize * PAGE {
            return Err(StreamError::Malformed(format!(
                "PagesD frame of {count} pages applied to {} bytes",
                dst.len()
            )));
        }
        apply_parts(&delta_parts(body, *count as usize)?, dst)
    }

    /// The rest of a PagesD frame (see the module docs): checked whole, then applied where
    /// `place` says, or returned.
    pub(super) fn read_delta<'b>(
        r: &mut impl Read,
        header: &[u8; HEADER],
        len: usize,
        buf: &'b mut Vec<u8>,
        place: impl FnOnce(u64, usize, Lend) -> Option<&'b mut [u8]>,
    ) -> Result<FrameRef<'b>, StreamError> {
        if len < DELTA_HEADER {
            return Err(StreamError::Malformed(format!(
                "PagesD frame: {len} bytes, shorter than its header"
            )));
        }
        Frame::read_payload(r, header, len, buf)?;
        let p = &buf[..len];
        let gpa = u64::from_le_bytes(p[..8].try_into().expect("8 bytes"));
        let count = u32::from_le_bytes(p[8..12].try_into().expect("4 bytes"));
        let flags = u32::from_le_bytes(p[12..16].try_into().expect("4 bytes"));
        if !gpa.is_multiple_of(PAGE as u64) || flags != 0 {
            return Err(StreamError::Malformed(format!(
                "PagesD frame: gpa {gpa:#x} (page-aligned), flags {flags:#x} (none)"
            )));
        }
        let parts = delta_parts(&p[DELTA_HEADER..], count as usize)?;
        let size = count as usize * PAGE;
        match place(gpa, size, Lend::Patch) {
            Some(dst) => {
                assert_eq!(dst.len(), size, "`place` lent a slice of another length");
                apply_parts(&parts, dst)?;
                Ok(FrameRef::Patched { gpa, len: size })
            }
            None => Ok(FrameRef::Frame(Frame::Delta {
                gpa,
                count,
                body: p[DELTA_HEADER..].to_vec(),
            })),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::test_pages::dense_pages;

    /// `count` pages of real-looking content, and the same pages re-dirtied a few lines at a
    /// time (page 1 not at all, page 2 rewritten whole).
    fn redirtied_pages(count: usize) -> (Vec<u8>, Vec<u8>) {
        let old = dense_pages(count);
        let mut new = old.clone();
        let other = dense_pages(count + 7);
        for (p, page) in new.chunks_mut(PAGE).enumerate() {
            match p % 4 {
                1 => {}
                2 => page.copy_from_slice(&other[(count + 6) * PAGE..(count + 7) * PAGE]),
                _ => {
                    for l in [p % 64, (p + 1) % 64, (p * 7 + 30) % 64] {
                        let from = ((p + 3) % count) * PAGE + l * LINE;
                        page[l * LINE..(l + 1) * LINE].copy_from_slice(&old[from..from + LINE]);
                        page[l * LINE] ^= 0x5a;
                    }
                }
            }
        }
        (old, new)
    }

    /// A PagesD frame of `new` against `old` (every page a delta when it is worth one).
    fn delta_frame(old: &[u8], new: &[u8], gpa: u64) -> (Vec<u8>, usize) {
        let mut out = vec![0xcc; 3];
        let (deltas, _) = Frame::encode_delta_with(&mut out, gpa, new, |p, page, out| {
            crate::delta::encode(&old[p * PAGE..(p + 1) * PAGE], page, out, PAGE - 1)
        })
        .unwrap();
        (out, deltas)
    }

    /// A PagesD frame rebuilds the new pages from the old ones, applied in place or returned
    /// and applied; it re-encodes to the same bytes; compressed (LZ4 or zstd) it does the
    /// same, smaller still; re-dirtied pages cost a fraction of themselves.
    #[test]
    fn delta_frames_round_trip_plain_and_compressed() {
        let count = 64;
        let (old, new) = redirtied_pages(count);
        let (bytes, deltas) = delta_frame(&old, &new, 0x20_0000);
        assert_eq!(bytes[4], kind::PAGES_D);
        // Pages re-dirtied a few lines at a time, or not at all, go as deltas (a page
        // rewritten whole may too, when some of its words happen to be unchanged).
        assert!(deltas >= count - count / 4, "{deltas} deltas");
        assert!(bytes.len() < new.len() / 2, "{} bytes", bytes.len());
        let mut plain = Vec::new();
        Frame::encode_pages_with(
            &mut plain,
            0x20_0000,
            new.len(),
            false,
            Encoding::default(),
            |at, p| {
                p.copy_from_slice(&new[at..at + p.len()]);
                Ok(())
            },
        )
        .unwrap();
        let mut scratch = Vec::new();
        for codec in [Codec::None, Codec::Lz4, Codec::Zstd(1)] {
            let mut frame = bytes.clone();
            compress_pages(&mut frame, codec, &mut scratch).unwrap();
            if codec != Codec::None {
                assert_eq!(frame[4], kind::PAGES_Z, "{codec:?}");
                let mut z = plain.clone();
                compress_pages(&mut z, codec, &mut scratch).unwrap();
                assert!(
                    frame.len() * 2 < z.len(),
                    "{codec:?}: {} vs {}",
                    frame.len(),
                    z.len()
                );
            }
            let mut memory = old.clone();
            let mut buf = Vec::new();
            let got = Frame::read_into(&mut &frame[..], &mut buf, |gpa, len, _| {
                assert_eq!((gpa, len), (0x20_0000, new.len()));
                Some(&mut memory[..])
            });
            assert_eq!(
                got.unwrap(),
                FrameRef::Patched {
                    gpa: 0x20_0000,
                    len: new.len()
                }
            );
            assert!(memory == new, "{codec:?}: patched pages");
            let decoded = Frame::read_from(&mut &frame[..]).unwrap();
            let mut memory = old.clone();
            decoded.apply_delta(&mut memory).unwrap();
            assert!(memory == new, "{codec:?}: applied pages");
            assert_eq!(decoded.encode().unwrap(), bytes, "{codec:?}: re-encoded");
            assert!(decoded.apply_delta(&mut memory[..PAGE]).is_err());
        }
        assert!(Frame::Go.apply_delta(&mut []).is_err());
        for len in [0, 100, 513 * PAGE] {
            let pages = vec![0u8; len];
            assert!(Frame::encode_delta_with(&mut Vec::new(), 0, &pages, |_, _, _| false).is_err());
        }
        // A delta the size of a page or more goes whole instead.
        let (mut out, page) = (Vec::new(), vec![1u8; PAGE]);
        let (n, _) = Frame::encode_delta_with(&mut out, 0, &page, |_, _, out| {
            out.resize(out.len() + PAGE, 0);
            true
        })
        .unwrap();
        assert_eq!(n, 0);
        assert_eq!(
            Frame::read_from(&mut &out[..]).unwrap().encode().unwrap(),
            out
        );
    }

    /// Damage anywhere in a PagesD frame, plain or compressed, is an error; so are frames
    /// whose sizes do not add up, whose pages are larger than a page, whose deltas leave the
    /// page, and ill-shaped headers. Memory lent for a refused frame is left as it was.
    #[test]
    #[allow(clippy::cast_possible_truncation)] // frame lengths are bounded by MAX_PAYLOAD.
    fn damaged_delta_frames_are_refused() {
        let (old, new) = redirtied_pages(8);
        let (bytes, _) = delta_frame(&old, &new, 0x4000);
        let refused = |bad: &[u8]| {
            let mut memory = old.clone();
            let slot = &mut memory[..];
            let e = Frame::read_into(&mut &bad[..], &mut Vec::new(), move |_, len, _| {
                (len == slot.len()).then_some(slot)
            })
            .unwrap_err();
            assert!(memory == old, "memory written by a refused frame: {e}");
            e.to_string()
        };
        for bit in (0..bytes.len() * 8).step_by(61) {
            let mut bad = bytes.clone();
            bad[bit / 8] ^= 1 << (bit % 8);
            refused(&bad);
        }
        for len in (1..bytes.len()).step_by(7) {
            refused(&bytes[..len]);
        }
        let mut z = bytes.clone();
        compress_pages(&mut z, Codec::Lz4, &mut Vec::new()).unwrap();
        assert_eq!(z[4], kind::PAGES_Z);
        for at in [13, 17, 30, z.len() / 2, z.len() - 1] {
            let mut bad = z.clone();
            bad[at] ^= 0x20;
            assert!(Frame::read_from(&mut &bad[..]).is_err(), "byte {at}");
        }
        // Well-checksummed PagesD frames of the wrong shape.
        let forge = |gpa: u64, count: u32, flags: u32, sizes: &[u16], bodies: &[u8]| {
            let mut f = MAGIC.to_vec();
            f.extend_from_slice(&[kind::PAGES_D, 0, 0, 0, 0, 0, 0, 0]);
            f.extend_from_slice(&gpa.to_le_bytes());
            f.extend_from_slice(&count.to_le_bytes());
            f.extend_from_slice(&flags.to_le_bytes());
            sizes
                .iter()
                .for_each(|s| f.extend_from_slice(&s.to_le_bytes()));
            f.extend_from_slice(bodies);
            let len = (f.len() - HEADER) as u32;
            f[8..12].copy_from_slice(&len.to_le_bytes());
            let crc = crc32fast::hash(&f);
            f.extend_from_slice(&crc.to_le_bytes());
            f
        };
        let span = [0u8, 1, 1, 2, 3, 4, 5, 6, 7, 8]; // word 0 := 1..=8
        assert!(Frame::read_from(&mut &forge(0x1000, 1, 0, &[10], &span)[..]).is_ok());
        for (bad, why) in [
            (forge(0x1000, 1, 0, &[10], &span[..9]), "page 0 of 10 bytes"),
            (
                forge(0x1000, 1, 0, &[10], &[&span[..], &[0]].concat()),
                "after its pages",
            ),
            (forge(0x1000, 1, 0, &[9], &span), "truncated"),
            (forge(0x1000, 2, 0, &[10], &span), "page 0"),
            (forge(0x1000, 1, 0, &[4097], &[0; 4097]), "at most"),
            (forge(0x1000, 0, 0, &[], &[]), "1 to 512"),
            (forge(0x1001, 1, 0, &[10], &span), "page-aligned"),
            (forge(0x1000, 1, 1, &[10], &span), "flags"),
            (
                forge(0x1000, 1, 0, &[10], &[0x80, 0x04, 1, 1, 2, 3, 4, 5, 6, 7]),
                "not inside the page",
            ),
            (forge(0x1000, 1, 0, &[2], &[0, 0]), "not inside the page"),
            (forge(0, 513, 0, &[0; 513], &[]), "1 to 512"),
        ] {
            let e = refused(&bad);
            assert!(e.contains(why), "{why}: {e}");
            assert!(Frame::read_from(&mut &bad[..]).is_err());
        }
        // A short header.
        let mut short = MAGIC.to_vec();
        short.extend_from_slice(&[kind::PAGES_D, 0, 0, 0, 8, 0, 0, 0]);
        short.extend_from_slice(&[0; 8]);
        let crc = crc32fast::hash(&short);
        short.extend_from_slice(&crc.to_le_bytes());
        assert!(refused(&short).contains("shorter than its header"));
    }
}
