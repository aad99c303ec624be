//! PagesZ frames compressed one by one (LZ4 or zstd), and reading any PagesZ frame.

use std::io::Read;

use super::zstd_stream::ZSTD_STREAM_CODEC;
use super::*;

/// How Pages frames are compressed on the wire (see [`compress_pages`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Codec {
    /// Sent as encoded (zero lines elided).
    #[default]
    None,
    /// LZ4 block format: about 2x on real guest memory, at a low CPU cost.
    Lz4,
    /// zstd at the given level: more compression for more CPU.
    Zstd(i32),
}

impl Codec {
    fn id(self) -> u8 {
        match self {
            Codec::None => 0,
            Codec::Lz4 => 1,
            Codec::Zstd(_) => 2,
        }
    }
}

/// Compresses the Pages or PagesD frame in `frame` (as [`Frame::encode_pages_with`] or
/// [`Frame::encode_delta_with`] left it) with
/// `codec`, replacing it by a PagesZ frame when that is smaller; `scratch` is kept between
/// calls. Returns the frame's length on the wire either way.
#[allow(clippy::cast_possible_truncation)] // frame lengths are bounded by MAX_PAYLOAD.
pub fn compress_pages(
    frame: &mut Vec<u8>,
    codec: Codec,
    scratch: &mut Vec<u8>,
) -> Result<usize, StreamError> {
    if codec == Codec::None || frame.len() <= HEADER + 4 + Z_HEADER {
        return Ok(frame.len());
    }
    debug_assert!(frame[4] == kind::PAGES || frame[4] == kind::PAGES_D);
    let bound = match codec {
        Codec::Lz4 => lz4_flex::block::get_maximum_output_size(frame.len()),
        _ => zstd::zstd_safe::compress_bound(frame.len()),
    };
    let at = HEADER + Z_HEADER;
    if scratch.len() < at + bound + 4 {
        scratch.resize(at + bound + 4, 0);
    }
    let n = match codec {
        Codec::Lz4 => lz4_flex::block::compress_into(frame, &mut scratch[at..at + bound])
            .map_err(|e| StreamError::Malformed(format!("lz4: {e}")))?,
        Codec::Zstd(level) => ZSTD_CONTEXTS.with_borrow_mut(|(c, _)| {
            c.set_compression_level(level)?;
            c.compress_to_buffer(frame.as_slice(), &mut scratch[at..at + bound])
        })?,
        Codec::None => unreachable!("returned above"),
    };
    let payload = Z_HEADER + n;
    if at + n + 4 >= frame.len() || payload > MAX_PAYLOAD as usize {
        return Ok(frame.len());
    }
    // Without CRC inside, none outside: the frame crosses a channel that checks its bytes.
    let flags = frame[5] & NO_CRC;
    scratch[..4].copy_from_slice(&MAGIC);
    scratch[4..8].copy_from_slice(&[kind::PAGES_Z, flags, 0, 0]);
    scratch[8..12].copy_from_slice(&(payload as u32).to_le_bytes());
    scratch[12..16].copy_from_slice(&[codec.id(), 0, 0, 0]);
    scratch[16..20].copy_from_slice(&(frame.len() as u32).to_le_bytes());
    let crc = if flags == 0 {
        crc32fast::hash(&scratch[..at + n])
    } else {
        0
    };
    scratch[at + n..at + n + 4].copy_from_slice(&crc.to_le_bytes());
    frame.clear();
    frame.extend_from_slice(&scratch[..at + n + 4]);
    Ok(frame.len())
}

thread_local! {
    /// Each connection thread's zstd contexts, kept between frames: making them per frame
    /// costs an allocation and a table reset each time.
    static ZSTD_CONTEXTS: std::cell::RefCell<(zstd::bulk::Compressor<'static>, zstd::bulk::Decompressor<'static>)> =
        std::cell::RefCell::new((
            zstd::bulk::Compressor::new(1).expect("a zstd compression context"),
            zstd::bulk::Decompressor::new().expect("a zstd decompression context"),
        ));
    /// Each reader thread's buffer for decompressed frames.
    static INFLATED: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
}

impl Frame {
    /// The rest of a PagesZ frame (see the module docs): its payload is checked and
    /// decompressed into a buffer of exactly the announced inner length, which must hold one
    /// whole Pages frame; that frame is then read as any other.
    pub(super) fn read_compressed<'b>(
        r: &mut impl Read,
        header: &[u8; HEADER],
        len: usize,
        buf: &'b mut Vec<u8>,
        stream: Option<&mut ZstdStreamDecoder>,
        landing: Option<(&mut [u8], &mut Land<'_>)>,
        place: impl FnOnce(u64, usize, Lend) -> Option<&'b mut [u8]>,
    ) -> Result<FrameRef<'b>, StreamError> {
        let malformed = |what: String| Err(StreamError::Malformed(format!("PagesZ frame: {what}")));
        if len <= Z_HEADER {
            return malformed(format!("{len} bytes, no room for compressed pages"));
        }
        let mut compressed = std::mem::take(buf);
        Frame::read_payload(r, header, len, &mut compressed)?;
        let z = &compressed[..len];
        let codec = z[0];
        let inner_len = u32::from_le_bytes(z[4..8].try_into().expect("4 bytes")) as usize;
        if z[1..4] != [0, 0, 0] || !(1..=ZSTD_STREAM_CODEC).contains(&codec) {
            return malformed(format!("codec {codec}, reserved bytes {:?}", &z[1..4]));
        }
        if codec == ZSTD_STREAM_CODEC && stream.is_none() {
            return Err(StreamError::NoZstdStream);
        }
        let max = HEADER + MAX_PAGES_PAYLOAD + 4;
        if inner_len <= HEADER + 4 || inner_len > max {
            return malformed(format!("inner frame of {inner_len} bytes (at most {max})"));
        }
        // The thread's buffer for decompressed frames, taken while this one is read (an inner
        // frame is never compressed again, so nothing below asks for it).
        let mut inner = INFLATED.take();
        inner.resize(inner_len, 0);
        let got = match codec {
            1 => lz4_flex::block::decompress_into(&z[Z_HEADER..], &mut inner)
                .map_err(|e| StreamError::Malformed(format!("PagesZ frame: lz4: {e}")))?,
            ZSTD_STREAM_CODEC => {
                let stream = stream.expect("checked above");
                stream.decode(&z[Z_HEADER..], &mut inner)?;
                inner_len
            }
            _ => ZSTD_CONTEXTS
                .with_borrow_mut(|(_, d)| d.decompress_to_buffer(&z[Z_HEADER..], &mut inner[..]))
                .map_err(|e| StreamError::Malformed(format!("PagesZ frame: zstd: {e}")))?,
        };
        if got != inner_len {
            return malformed(format!("{got} bytes decompressed, {inner_len} announced"));
        }
        if inner[4] != kind::PAGES && inner[4] != kind::PAGES_D {
            return malformed(format!(
                "it holds a frame of kind {}, not Pages or PagesD",
                inner[4]
            ));
        }
        *buf = compressed;
        if let (Some((scratch, land)), kind::PAGES) = (landing, inner[4]) {
            // Landed from where it was decompressed. A codec-3 frame's inner CRC is checked
            // first: its bytes depend on the stream's history, which the outer CRC does not
            // cover. A frame of codec 1 or 2 decodes from its compressed bytes alone, which
            // the outer CRC covered: checking the inner CRC too would be a second pass over
            // every decompressed page that catches nothing the first did not.
            let frame = Frame::land_inner(&inner, codec == ZSTD_STREAM_CODEC, scratch, land);
            INFLATED.set(inner);
            return frame;
        }
        let mut rest = &inner[..];
        let frame = Frame::read_into(&mut rest, buf, place);
        let left = rest.len();
        INFLATED.set(inner);
        let frame = frame?;
        if left != 0 {
            return malformed(format!("{left} bytes after its inner frame"));
        }
        Ok(frame)
    }
}

impl Frame {
    /// A decompressed inner Pages frame (header, payload, CRC: exactly `inner`), checked as
    /// [`Frame::read_into`] checks one (its CRC only if `check_crc`), then landed
    /// ([`Frame::land_pages`]).
    fn land_inner(
        inner: &[u8],
        check_crc: bool,
        scratch: &mut [u8],
        land: &mut Land<'_>,
    ) -> Result<FrameRef<'static>, StreamError> {
        let mut rest = inner;
        let (header, len) = Frame::read_header(&mut rest)?;
        if rest.len() != len + 4 {
            return Err(StreamError::Malformed(format!(
                "PagesZ frame: its inner frame announces {len} bytes of payload, {} follow \
                 its header",
                rest.len().saturating_sub(4)
            )));
        }
        let found = u32::from_le_bytes(rest[len..].try_into().expect("4 bytes"));
        if !has_crc(&header) {
            no_crc_field(found)?;
        } else if check_crc {
            let mut hasher = crc32fast::Hasher::new();
            hasher.update(&header);
            hasher.update(&rest[..len]);
            super::check_crc(found, hasher.finalize())?;
        }
        Frame::land_pages(&rest[..len], scratch, land)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::test_pages::{dense_pages, pages_frame};

    fn compressed_frame(codec: Codec, pages: &[u8], gpa: u64) -> (Vec<u8>, usize) {
        let mut out = pages_frame(pages, gpa);
        let plain = out.len();
        let wire = compress_pages(&mut out, codec, &mut Vec::new()).unwrap();
        assert_eq!(wire, out.len());
        (out, plain)
    }

    /// A compressed Pages frame is smaller and decodes to the same pages, read into the
    /// reader's buffer or placed; incompressible pages stay a plain Pages frame.
    #[test]
    fn compressed_pages_round_trip_and_shrink() {
        let pages = dense_pages(MAX_FRAME_PAGES);
        for codec in [Codec::Lz4, Codec::Zstd(1), Codec::Zstd(3)] {
            let (bytes, plain) = compressed_frame(codec, &pages, 0x4000_0000);
            assert_eq!(bytes[4], kind::PAGES_Z, "{codec:?}");
            assert!(
                bytes.len() * 3 < plain * 2,
                "{codec:?}: {} of {plain}",
                bytes.len()
            );
            let frame = Frame::read_from(&mut &bytes[..]).unwrap();
            assert_eq!(
                frame,
                Frame::Pages {
                    gpa: 0x4000_0000,
                    pages: pages.clone(),
                    fresh: false
                }
            );
            let mut memory = vec![0xffu8; pages.len()];
            let mut buf = Vec::new();
            let got = Frame::read_into(&mut &bytes[..], &mut buf, |_, _, _| Some(&mut memory[..]));
            assert!(matches!(got, Ok(FrameRef::Placed { .. })), "{codec:?}");
            assert!(memory == pages, "{codec:?}: placed pages");
        }
        let mut x = 1u64;
        let random: Vec<u8> = (0..64 * PAGE)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (x >> 56) as u8
            })
            .collect();
        let (bytes, plain) = compressed_frame(Codec::Lz4, &random, 0);
        assert_eq!((bytes[4], bytes.len()), (kind::PAGES, plain));
    }

    /// Damage anywhere in a compressed frame is an error, and so are frames that lie about
    /// their inner length, name an unknown codec, or nest a compressed frame.
    #[test]
    #[allow(clippy::cast_possible_truncation)] // frame lengths are bounded by MAX_PAYLOAD.
    fn damaged_compressed_frames_are_refused() {
        let pages = dense_pages(64);
        let (bytes, _) = compressed_frame(Codec::Lz4, &pages, 0);
        for at in [5, 13, 17, 40, bytes.len() / 2, bytes.len() - 2] {
            let mut bad = bytes.clone();
            bad[at] ^= 0x10;
            assert!(
                Frame::read_from(&mut &bad[..]).is_err(),
                "byte {at} flipped"
            );
        }
        // Re-sealed with a valid outer CRC: the lie is found inside.
        let reseal = |edit: &dyn Fn(&mut Vec<u8>)| {
            let mut bad = bytes[..bytes.len() - 4].to_vec();
            edit(&mut bad);
            let crc = crc32fast::hash(&bad);
            bad.extend_from_slice(&crc.to_le_bytes());
            Frame::read_from(&mut &bad[..]).unwrap_err().to_string()
        };
        let e = reseal(&|b| b[12] = 9);
        assert!(e.contains("codec 9"), "{e}");
        let e = reseal(&|b| b[16..20].copy_from_slice(&u32::MAX.to_le_bytes()));
        assert!(e.contains("inner frame"), "{e}");
        let e = reseal(&|b| {
            let n = u32::from_le_bytes(b[16..20].try_into().unwrap()) + 4096;
            b[16..20].copy_from_slice(&n.to_le_bytes());
        });
        assert!(e.contains("announced") || e.contains("lz4"), "{e}");
        let e = reseal(&|b| {
            let last = b.len() - 1;
            b[last] ^= 1;
        });
        assert!(e.contains("PagesZ") || e.contains("checksum"), "{e}");
        // A compressed frame inside a compressed frame.
        let mut nested = bytes.clone();
        let mut scratch = Vec::new();
        let inner_len = nested.len();
        let mut body = vec![0u8; lz4_flex::block::get_maximum_output_size(inner_len)];
        let n = lz4_flex::block::compress_into(&nested, &mut body).unwrap();
        scratch.extend_from_slice(&MAGIC);
        scratch.extend_from_slice(&[kind::PAGES_Z, 0, 0, 0]);
        scratch.extend_from_slice(&((Z_HEADER + n) as u32).to_le_bytes());
        scratch.extend_from_slice(&[1, 0, 0, 0]);
        scratch.extend_from_slice(&(inner_len as u32).to_le_bytes());
        scratch.extend_from_slice(&body[..n]);
        let crc = crc32fast::hash(&scratch);
        scratch.extend_from_slice(&crc.to_le_bytes());
        nested = scratch;
        let e = Frame::read_from(&mut &nested[..]).unwrap_err().to_string();
        assert!(e.contains("not Pages"), "{e}");
    }
}
