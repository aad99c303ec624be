//! Pages frames: pages with their zero lines squeezed out, encoded straight from where the
//! sender reads them, and read into a reused buffer or straight where they belong.

use std::io::Read;

use super::*;

/// How [`Frame::encode_pages_with`] encodes a Pages frame, besides its pages.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Encoding {
    /// Every line kept, zero or not (for comparison with senders that send whole pages).
    pub whole_pages: bool,
    /// No CRC ([`NO_CRC`]): for a channel that authenticates every byte itself.
    pub no_crc: bool,
}

impl Frame {
    /// Encodes into `out` (its contents replaced) a Pages frame of `len` bytes of pages at
    /// `gpa`, whose pages `fill` writes straight into the frame (no copy in between: senders
    /// read guest memory into it), [`CRC_PIECE`] bytes at a time: `fill(offset, piece)`. Each
    /// piece's zero lines are then squeezed out and what is left checksummed (unless
    /// `encoding` says no CRC), while the piece is still in the cache. Returns the bytes of
    /// lines the frame carries (0: the pages are all zero).
    #[allow(clippy::cast_possible_truncation)] // frame lengths and counts are bounded by MAX_PAYLOAD.
    pub fn encode_pages_with(
        out: &mut Vec<u8>,
        gpa: u64,
        len: usize,
        fresh: bool,
        encoding: Encoding,
        mut fill: impl FnMut(usize, &mut [u8]) -> Result<(), StreamError>,
    ) -> Result<usize, StreamError> {
        let count = len / PAGE;
        if len == 0 || !len.is_multiple_of(PAGE) || count > MAX_FRAME_PAGES {
            return Err(StreamError::Malformed(format!(
                "a Pages frame carries whole pages, at most {MAX_FRAME_PAGES}, not {len} bytes"
            )));
        }
        let lines_at = HEADER + PAGES_HEADER + 8 * count;
        // `out` keeps its bytes from the last frame: only growth is zeroed, `fill` overwrites
        // the rest (a writer sending 2 MiB frames does not clear 2 MiB before each).
        if out.len() < lines_at + len {
            out.resize(lines_at + len, 0);
        }
        let mut masks = [0u64; MAX_FRAME_PAGES];
        let mut lines = crc32fast::Hasher::new();
        let mut w = lines_at;
        for start in (0..len).step_by(CRC_PIECE) {
            let n = CRC_PIECE.min(len - start);
            // The piece lands at the write cursor; its kept lines then move down to it (the
            // cursor never passes the line being read).
            let begin = w;
            fill(start, &mut out[begin..begin + n])?;
            for p in 0..n / PAGE {
                let from = begin + p * PAGE;
                let mask = if encoding.whole_pages {
                    u64::MAX
                } else {
                    line_mask(&out[from..from + PAGE])
                };
                masks[start / PAGE + p] = mask;
                if mask == u64::MAX {
                    if from != w {
                        out.copy_within(from..from + PAGE, w);
                    }
                    w += PAGE;
                    continue;
                }
                for l in (0..LINES).filter(|l| mask >> l & 1 == 1) {
                    out.copy_within(from + l * LINE..from + (l + 1) * LINE, w);
                    w += LINE;
                }
            }
            if !encoding.no_crc {
                lines.update(&out[begin..w]);
            }
        }
        let payload = w - HEADER;
        let flags = if encoding.no_crc { NO_CRC } else { 0 };
        out[..4].copy_from_slice(&MAGIC);
        out[4..8].copy_from_slice(&[kind::PAGES, flags, 0, 0]);
        out[8..12].copy_from_slice(&(payload as u32).to_le_bytes());
        out[12..20].copy_from_slice(&gpa.to_le_bytes());
        out[20..24].copy_from_slice(&(count as u32).to_le_bytes());
        out[24..28].copy_from_slice(&(if fresh { FRESH } else { 0 }).to_le_bytes());
        for (p, mask) in masks[..count].iter().enumerate() {
            let at = HEADER + PAGES_HEADER + 8 * p;
            out[at..at + 8].copy_from_slice(&mask.to_le_bytes());
        }
        let crc = if encoding.no_crc {
            0
        } else {
            let mut hasher = crc32fast::Hasher::new();
            hasher.update(&out[..lines_at]);
            hasher.combine(&lines);
            hasher.finalize()
        };
        out.truncate(w);
        out.extend_from_slice(&crc.to_le_bytes());
        Ok(w - lines_at)
    }

    /// The rest of a Pages frame after its `header` (`len`: its payload length), as
    /// [`Frame::read_into`] reads it.
    pub(super) fn read_pages<'b>(
        r: &mut impl Read,
        header: &[u8; HEADER],
        len: usize,
        buf: &'b mut Vec<u8>,
        place: impl FnOnce(u64, usize, Lend) -> Option<&'b mut [u8]>,
    ) -> Result<FrameRef<'b>, StreamError> {
        let malformed = |what: String| Err(StreamError::Malformed(format!("Pages frame: {what}")));
        if len < PAGES_HEADER {
            return malformed(format!("{len} bytes, shorter than its header"));
        }
        // The hasher of a frame without CRC (`NO_CRC`) is kept but never fed.
        let checked = has_crc(header);
        let mut hasher = crc32fast::Hasher::new();
        let mut hash = |bytes: &[u8]| {
            if checked {
                hasher.update(bytes);
            }
        };
        hash(header);
        let mut head = [0u8; PAGES_HEADER];
        r.read_exact(&mut head)?;
        hash(&head);
        let (gpa, count, fresh) = pages_head(&head, len)?;
        let mut mask_bytes = [0u8; 8 * MAX_FRAME_PAGES];
        let mask_bytes = &mut mask_bytes[..8 * count];
        r.read_exact(mask_bytes)?;
        hash(mask_bytes);
        let masks = masks_of(mask_bytes, len)?;
        let size = count * PAGE;
        let placed = match place(gpa, size, Lend::Pages { fresh }) {
            Some(dst) => {
                assert_eq!(dst.len(), size, "`place` lent a slice of another length");
                read_lines(r, &mut hash, &masks, dst, !fresh)?;
                true
            }
            None => {
                if buf.len() < size {
                    buf.resize(size, 0);
                }
                read_lines(r, &mut hash, &masks, &mut buf[..size], true)?;
                false
            }
        };
        let mut crc = [0u8; 4];
        r.read_exact(&mut crc)?;
        let found = u32::from_le_bytes(crc);
        if checked {
            check_crc(found, hasher.finalize())?;
        } else {
            no_crc_field(found)?;
        }
        Ok(if placed {
            FrameRef::Placed {
                gpa,
                len: size,
                fresh,
            }
        } else {
            FrameRef::Pages {
                gpa,
                pages: &buf[..size],
                fresh,
            }
        })
    }
    /// Lands a Pages frame's payload that is already in memory and checked (its CRC matched):
    /// runs of whole pages go to `land` straight from `payload`; pages with zero lines are
    /// spread into `scratch` (whole pages, zero lines written, so what they land over does not
    /// matter) and landed from there, consecutive ones together.
    pub(super) fn land_pages(
        payload: &[u8],
        scratch: &mut [u8],
        land: &mut Land<'_>,
    ) -> Result<FrameRef<'static>, StreamError> {
        let len = payload.len();
        if len < PAGES_HEADER {
            return Err(StreamError::Malformed(format!(
                "Pages frame: {len} bytes, shorter than its header"
            )));
        }
        let head = payload[..PAGES_HEADER].try_into().expect("16 bytes");
        let (gpa, count, fresh) = pages_head(head, len)?;
        let lines_at = PAGES_HEADER + 8 * count;
        let masks = masks_of(&payload[PAGES_HEADER..lines_at], len)?;
        let batch = (scratch.len() / PAGE).max(1);
        let (mut p, mut at) = (0, lines_at);
        // Spread pages waiting in `scratch`: (first page, how many).
        let mut spread = (0, 0);
        let flush = |spread: &mut (usize, usize), scratch: &[u8], land: &mut Land<'_>| {
            let (first, n) = std::mem::take(spread);
            match n {
                0 => Ok(()),
                n => land(gpa + (first * PAGE) as u64, &scratch[..n * PAGE]),
            }
        };
        while p < count {
            if masks[p] == u64::MAX {
                flush(&mut spread, scratch, land)?;
                let run = masks[p..].iter().take_while(|&&m| m == u64::MAX).count();
                land(gpa + (p * PAGE) as u64, &payload[at..at + run * PAGE])?;
                (p, at) = (p + run, at + run * PAGE);
                continue;
            }
            if spread.1 == batch {
                flush(&mut spread, scratch, land)?;
            }
            if spread.1 == 0 {
                spread.0 = p;
            }
            let page = &mut scratch[spread.1 * PAGE..(spread.1 + 1) * PAGE];
            for (l, line) in page.chunks_exact_mut(LINE).enumerate() {
                if masks[p] >> l & 1 == 1 {
                    line.copy_from_slice(&payload[at..at + LINE]);
                    at += LINE;
                } else {
                    line.fill(0);
                }
            }
            spread.1 += 1;
            p += 1;
        }
        flush(&mut spread, scratch, land)?;
        Ok(FrameRef::Placed {
            gpa,
            len: count * PAGE,
            fresh,
        })
    }
}

/// Where [`Frame::read_into_landing`] lands pages: `land(gpa, pages)` writes whole pages at
/// `gpa` (an error there fails the read).
pub type Land<'a> = dyn FnMut(u64, &[u8]) -> io::Result<()> + 'a;

/// A Pages payload's header (`len`: the payload's length), checked: gpa, page count, fresh.
fn pages_head(head: &[u8; PAGES_HEADER], len: usize) -> Result<(u64, usize, bool), StreamError> {
    let malformed = |what: String| Err(StreamError::Malformed(format!("Pages frame: {what}")));
    let gpa = u64::from_le_bytes(head[..8].try_into().expect("8 bytes"));
    let count = u32::from_le_bytes(head[8..12].try_into().expect("4 bytes")) as usize;
    let flags = u32::from_le_bytes(head[12..].try_into().expect("4 bytes"));
    if !gpa.is_multiple_of(PAGE as u64) {
        return malformed(format!("unaligned gpa {gpa:#x}"));
    }
    if count == 0 || count > MAX_FRAME_PAGES || flags & !FRESH != 0 {
        return malformed(format!(
            "{count} pages (1 to {MAX_FRAME_PAGES}), flags {flags:#x}"
        ));
    }
    if len < PAGES_HEADER + 8 * count {
        return malformed(format!("{len} bytes cannot hold {count} masks"));
    }
    Ok((gpa, count, flags & FRESH != 0))
}

/// A Pages payload's masks (`len`: the payload's length), checked against it: the lines they
/// announce fill the payload exactly.
fn masks_of(mask_bytes: &[u8], len: usize) -> Result<Vec<u64>, StreamError> {
    let masks: Vec<u64> = mask_bytes
        .chunks_exact(8)
        .map(|m| u64::from_le_bytes(m.try_into().expect("8 bytes")))
        .collect();
    let line_bytes = masks.iter().map(|m| m.count_ones() as usize).sum::<usize>() * LINE;
    let head = PAGES_HEADER + mask_bytes.len();
    if head + line_bytes != len {
        return Err(StreamError::Malformed(format!(
            "Pages frame: its masks announce {line_bytes} bytes of lines, its length leaves {}",
            len - head
        )));
    }
    Ok(masks)
}

/// Which 64-byte lines of `page` are not all zero (bit `i`: line `i`).
fn line_mask(page: &[u8]) -> u64 {
    page.chunks_exact(LINE)
        .enumerate()
        .fold(0, |mask, (i, line)| {
            let any = line.chunks_exact(8).fold(0, |acc, w| {
                acc | u64::from_ne_bytes(w.try_into().expect("8 bytes"))
            });
            mask | u64::from(any != 0) << i
        })
}

/// Reads a Pages frame's lines into `dst` (its pages, whole), page by page as `masks` say, and
/// hands them to `hash` in stream order. Runs of whole pages are read straight into `dst`; a
/// page with zero lines is read into a page-sized scratch first and spread, writing the zero
/// lines only if `write_zeros`.
fn read_lines(
    r: &mut impl Read,
    hash: &mut impl FnMut(&[u8]),
    masks: &[u64],
    dst: &mut [u8],
    write_zeros: bool,
) -> Result<(), StreamError> {
    let mut scratch = [0u8; PAGE];
    let mut p = 0;
    while p < masks.len() {
        if masks[p] == u64::MAX {
            let run = masks[p..].iter().take_while(|&&m| m == u64::MAX).count();
            for piece in dst[p * PAGE..(p + run) * PAGE].chunks_mut(CRC_PIECE) {
                r.read_exact(piece)?;
                hash(piece);
            }
            p += run;
            continue;
        }
        let kept = &mut scratch[..masks[p].count_ones() as usize * LINE];
        r.read_exact(kept)?;
        hash(kept);
        let mut lines = kept.chunks_exact(LINE);
        for (l, line) in dst[p * PAGE..(p + 1) * PAGE]
            .chunks_exact_mut(LINE)
            .enumerate()
        {
            if masks[p] >> l & 1 == 1 {
                line.copy_from_slice(lines.next().expect("one kept line per mask bit"));
            } else if write_zeros {
                line.fill(0);
            }
        }
        p += 1;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::frame::tests::sparse_pages;
    use guestmem_sys::to_usize;

    /// Pages that `place` takes land in its slice, whole and checked; declined ones come back
    /// in the buffer; a damaged placed frame is still an error.
    #[test]
    fn placed_pages_are_read_where_they_belong() {
        let mut bytes = Vec::new();
        let mut out = Vec::new();
        for (gpa, fill) in [(0x3000u64, 7u8), (0x9000, 9)] {
            Frame::encode_pages_with(
                &mut out,
                gpa,
                2 * PAGE,
                false,
                Encoding::default(),
                |_, buf| {
                    buf.fill(fill);
                    Ok(())
                },
            )
            .unwrap();
            bytes.extend_from_slice(&out);
        }
        Frame::Go.write_to(&mut bytes).unwrap();
        let mut target = vec![0u8; 2 * PAGE];
        let mut r = &bytes[..];
        let mut buf = Vec::new();
        let mut asked = None;
        let got = Frame::read_into(&mut r, &mut buf, |gpa, len, _| {
            asked = Some((gpa, len));
            Some(&mut target[..])
        })
        .unwrap();
        assert_eq!(
            got,
            FrameRef::Placed {
                gpa: 0x3000,
                len: 2 * PAGE,
                fresh: false
            }
        );
        assert_eq!(asked, Some((0x3000, 2 * PAGE)));
        assert_eq!(target, vec![7u8; 2 * PAGE]);
        match Frame::read_into(&mut r, &mut buf, |_, _, _| None).unwrap() {
            FrameRef::Pages { gpa, pages, .. } => {
                assert_eq!(gpa, 0x9000);
                assert_eq!(pages, vec![9u8; 2 * PAGE]);
            }
            other => panic!("expected Pages, got {other:?}"),
        }
        let mut never = vec![0u8; 2 * PAGE];
        assert_eq!(
            Frame::read_into(&mut r, &mut buf, |_, _, _| Some(&mut never[..])).unwrap(),
            FrameRef::Frame(Frame::Go)
        );
        assert_eq!(never, vec![0u8; 2 * PAGE], "only Pages are placed");
        let mut bad = out.clone();
        bad[HEADER + PAGES_HEADER + 16 + 100] ^= 1;
        assert!(matches!(
            Frame::read_into(&mut &bad[..], &mut buf, |_, _, _| Some(&mut target[..])),
            Err(StreamError::Checksum { .. })
        ));
    }

    /// Landed frames (plain and compressed, fresh or not, scratch smaller than the frame's
    /// spread pages) rebuild the pages exactly over any older contents, each call whole pages
    /// inside the frame; a damaged frame lands nothing.
    #[test]
    fn landed_pages_come_out_whole_and_only_once_checked() {
        // Sparse pages (zero lines, a zero page) then dense ones, so that runs alternate.
        let mut pages = sparse_pages(5);
        pages.extend(crate::stream::test_pages::dense_pages(4));
        pages.extend(sparse_pages(3));
        let gpa = 0x40_0000u64;
        for (fresh, codec) in [
            (true, Codec::None),
            (false, Codec::None),
            (true, Codec::Lz4),
            (false, Codec::Zstd(1)),
        ] {
            let mut out = Vec::new();
            Frame::encode_pages_with(
                &mut out,
                gpa,
                pages.len(),
                fresh,
                Encoding::default(),
                |at, piece| {
                    piece.copy_from_slice(&pages[at..at + piece.len()]);
                    Ok(())
                },
            )
            .unwrap();
            compress_pages(&mut out, codec, &mut Vec::new()).unwrap();
            for scratch_pages in [1, 2, 512] {
                let mut memory = vec![0xaau8; pages.len()];
                let mut calls = 0;
                let mut land = |at: u64, bytes: &[u8]| {
                    assert!(at >= gpa && bytes.len().is_multiple_of(PAGE) && !bytes.is_empty());
                    let o = to_usize(at - gpa);
                    memory[o..o + bytes.len()].copy_from_slice(bytes);
                    calls += 1;
                    Ok(())
                };
                let mut scratch = vec![0x55u8; scratch_pages * PAGE];
                let mut buf = Vec::new();
                let got = Frame::read_into_landing(
                    &mut &out[..],
                    &mut buf,
                    None,
                    (&mut scratch[..], &mut land),
                    |_, _, _| None,
                )
                .unwrap();
                assert_eq!(
                    got,
                    FrameRef::Placed {
                        gpa,
                        len: pages.len(),
                        fresh
                    }
                );
                assert!(calls >= 3, "{calls} landings");
                assert!(memory == pages, "{codec:?}, fresh {fresh}, {scratch_pages}");
            }
            // A flipped bit anywhere after the header: an error, and nothing landed.
            for at in [HEADER + 3, out.len() / 2, out.len() - 2] {
                let mut bad = out.clone();
                bad[at] ^= 1;
                let mut land = |_: u64, _: &[u8]| -> io::Result<()> { panic!("landed") };
                let mut buf = Vec::new();
                let got = Frame::read_into_landing(
                    &mut &bad[..],
                    &mut buf,
                    None,
                    (&mut [0u8; PAGE][..], &mut land),
                    |_, _, _| None,
                );
                assert!(got.is_err(), "{codec:?}, byte {at}");
            }
        }
    }

    /// Only the non-zero lines of each page travel; the receiver rebuilds the pages exactly,
    /// writing the zero lines over older contents unless the frame is fresh; `whole_pages`
    /// sends every line.
    #[test]
    fn zero_lines_stay_behind_and_come_back_as_zeros() {
        let pages = sparse_pages(5);
        let mut buf = Vec::new();
        let encode = |fresh: bool, whole: bool| {
            let mut out = Vec::new();
            let lines = Frame::encode_pages_with(
                &mut out,
                0x10000,
                pages.len(),
                fresh,
                Encoding {
                    whole_pages: whole,
                    no_crc: false,
                },
                |at, piece| {
                    piece.copy_from_slice(&pages[at..at + piece.len()]);
                    Ok(())
                },
            )
            .unwrap();
            (out, lines)
        };
        // Pages 0 and 3 keep their first and last lines, page 2 one line; 1 and 4 are zero.
        let (sparse, lines) = encode(false, false);
        assert_eq!(lines, (2 + 1 + 2) * LINE);
        assert_eq!(sparse.len(), HEADER + PAGES_HEADER + 5 * 8 + lines + 4);
        let (whole, lines) = encode(false, true);
        assert_eq!(lines, 5 * PAGE);
        assert_eq!(whole.len(), HEADER + PAGES_HEADER + 5 * 8 + 5 * PAGE + 4);
        for bytes in [&sparse, &whole] {
            assert_eq!(
                Frame::read_from(&mut &bytes[..]).unwrap(),
                Frame::Pages {
                    gpa: 0x10000,
                    pages: pages.clone(),
                    fresh: false
                }
            );
            // Over older contents, every byte comes out as sent.
            let mut old = vec![0xaau8; pages.len()];
            let got = Frame::read_into(&mut &bytes[..], &mut buf, |_, _, _| Some(&mut old[..]));
            assert!(matches!(got, Ok(FrameRef::Placed { fresh: false, .. })));
            assert_eq!(old, pages);
        }
        // A fresh frame leaves the zero lines alone: over zeros the pages come out exact, and
        // (to show what it skipped) over older contents those stay.
        let (fresh, _) = encode(true, false);
        let mut zeros = vec![0u8; pages.len()];
        let got = Frame::read_into(&mut &fresh[..], &mut buf, |_, _, _| Some(&mut zeros[..]));
        assert!(matches!(got, Ok(FrameRef::Placed { fresh: true, .. })));
        assert_eq!(zeros, pages);
        let mut old = vec![0xaau8; pages.len()];
        Frame::read_into(&mut &fresh[..], &mut buf, |_, _, _| Some(&mut old[..])).unwrap();
        assert_eq!(old[0], pages[0]);
        assert_eq!(
            old[LINE], 0xaa,
            "a zero line of a fresh frame is not written"
        );
        // Declined, a fresh frame still comes back whole (the reader's buffer is not fresh).
        let mut buf = vec![0xaau8; 8 * PAGE];
        match Frame::read_into(&mut &fresh[..], &mut buf, |_, _, _| None).unwrap() {
            FrameRef::Pages {
                pages: got, fresh, ..
            } => {
                assert!(fresh);
                assert_eq!(got, &pages[..]);
            }
            other => panic!("expected Pages, got {other:?}"),
        }
        // A flipped bit in a kept line is caught.
        let mut bad = sparse.clone();
        bad[HEADER + PAGES_HEADER + 5 * 8] ^= 1;
        assert!(matches!(
            Frame::read_from(&mut &bad[..]),
            Err(StreamError::Checksum { .. })
        ));
    }

    /// A frame encoded without CRC (for a channel that authenticates its bytes) says so in
    /// its header, carries zero in the CRC field, and decodes, lands and compresses to the
    /// same pages, its PagesZ frame without CRC too; a CRC field that is not zero in such a
    /// frame, or the flag on another kind of frame, is refused.
    #[test]
    fn frames_without_crc_are_flagged_and_still_decode() {
        let pages = sparse_pages(9);
        let encode = |out: &mut Vec<u8>| {
            let no_crc = Encoding {
                whole_pages: false,
                no_crc: true,
            };
            Frame::encode_pages_with(out, 0x8000, pages.len(), false, no_crc, |at, piece| {
                piece.copy_from_slice(&pages[at..at + piece.len()]);
                Ok(())
            })
            .unwrap();
        };
        let mut out = Vec::new();
        encode(&mut out);
        assert_eq!(out[5], NO_CRC);
        assert_eq!(out[out.len() - 4..], [0, 0, 0, 0]);
        let want = Frame::Pages {
            gpa: 0x8000,
            pages: pages.clone(),
            fresh: false,
        };
        assert_eq!(Frame::read_from(&mut &out[..]).unwrap(), want);
        for codec in [Codec::None, Codec::Lz4, Codec::Zstd(1)] {
            let mut frame = Vec::new();
            encode(&mut frame);
            compress_pages(&mut frame, codec, &mut Vec::new()).unwrap();
            assert_eq!(frame[5], NO_CRC, "{codec:?}");
            assert_eq!(frame[frame.len() - 4..], [0, 0, 0, 0], "{codec:?}");
            assert_eq!(
                Frame::read_from(&mut &frame[..]).unwrap(),
                want,
                "{codec:?}"
            );
            let mut memory = vec![0x77u8; pages.len()];
            let mut land = |at: u64, bytes: &[u8]| {
                let o = to_usize(at - 0x8000);
                memory[o..o + bytes.len()].copy_from_slice(bytes);
                Ok(())
            };
            let mut buf = Vec::new();
            let got = Frame::read_into_landing(
                &mut &frame[..],
                &mut buf,
                None,
                (&mut [0u8; 2 * PAGE][..], &mut land),
                |_, _, _| None,
            )
            .map(|_| ());
            assert!(got.is_ok(), "{codec:?}: {got:?}");
            assert!(memory == pages, "{codec:?}: landed pages");
        }
        let mut bad = out.clone();
        let last = bad.len() - 1;
        bad[last] = 1;
        let e = Frame::read_from(&mut &bad[..]).unwrap_err().to_string();
        assert!(e.contains("without CRC"), "{e}");
        let mut control = Frame::Go.encode().unwrap();
        control[5] = NO_CRC;
        let e = Frame::read_from(&mut &control[..]).unwrap_err().to_string();
        assert!(e.contains("flags"), "{e}");
    }
}
