//! A connection's zstd stream: its frames are pieces of one zstd frame whose window spans
//! the frames sent before (PagesZ codec 3).

use super::*;

/// The PagesZ codec id of the zstd stream (see [`ZstdStream`]).
pub(super) const ZSTD_STREAM_CODEC: u8 = 3;
/// The smallest and largest zstd stream windows (log2 of bytes): 1 KiB (zstd's least) to
/// 1 GiB.
pub const ZSTD_WINDOW_LOG_MIN: u32 = 10;
/// The largest zstd stream window a receiver accepts (log2 of bytes): 1 GiB.
pub const ZSTD_WINDOW_LOG_MAX: u32 = 30;

/// Whether a zstd stream window of `2^window_log` bytes is one this build makes and accepts;
/// if not, what is wrong with it.
pub fn check_window_log(window_log: u32) -> Result<(), String> {
    if (ZSTD_WINDOW_LOG_MIN..=ZSTD_WINDOW_LOG_MAX).contains(&window_log) {
        return Ok(());
    }
    Err(format!(
        "a zstd stream window of 2^{window_log} bytes (2^{ZSTD_WINDOW_LOG_MIN} to \
         2^{ZSTD_WINDOW_LOG_MAX} are accepted)"
    ))
}

fn zstd_error(what: &str, code: usize) -> StreamError {
    StreamError::Malformed(format!("{what}: {}", zstd::zstd_safe::get_error_name(code)))
}

/// One connection's zstd stream, sending side: the Pages frames it compresses are parts of one
/// zstd frame whose window (`2^window_log` bytes, with long distance matching) spans the frames
/// sent before, so a page that resembles one sent earlier on the connection (within the
/// window) travels as a reference to it. Each frame is flushed, so the receiver's
/// [`ZstdStreamDecoder`] decodes it whole on arrival. It lives as long as the connection's
/// rounds: every frame it compressed must reach the receiver, in order.
pub struct ZstdStream {
    cctx: zstd::zstd_safe::CCtx<'static>,
    window_log: u32,
}

impl std::fmt::Debug for ZstdStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZstdStream")
            .field("window_log", &self.window_log)
            .finish_non_exhaustive()
    }
}

impl ZstdStream {
    /// A stream at zstd `level` with a window of `2^window_log` bytes
    /// ([`ZSTD_WINDOW_LOG_MIN`] to [`ZSTD_WINDOW_LOG_MAX`]) and long distance matching.
    pub fn new(level: i32, window_log: u32) -> Result<ZstdStream, StreamError> {
        use zstd::zstd_safe::CParameter;
        check_window_log(window_log).map_err(StreamError::Malformed)?;
        let mut cctx = zstd::zstd_safe::CCtx::try_create()
            .ok_or_else(|| StreamError::Malformed("no zstd compression context".into()))?;
        // Long distance matching finds what the window is for (the pages of frames sent
        // long before); only matches of 256 bytes or more, sampled every 2 KiB, which on real
        // guest memory finds as much as zstd's defaults (64, every 128 bytes) for a third of
        // their CPU (2 GiB image, 128 MiB window: 454 MiB, 2.4 s of CPU against 455 MiB and
        // 3.5 s; frame by frame: 523 MiB, 2.1 s).
        for p in [
            CParameter::CompressionLevel(level),
            CParameter::WindowLog(window_log),
            CParameter::EnableLongDistanceMatching(true),
            CParameter::LdmMinMatch(256),
            CParameter::LdmHashRateLog(11),
        ] {
            cctx.set_parameter(p)
                .map_err(|e| zstd_error("zstd stream parameter", e))?;
        }
        Ok(ZstdStream { cctx, window_log })
    }

    /// The window's log2.
    pub fn window_log(&self) -> u32 {
        self.window_log
    }

    /// The memory it holds now (its window and tables, allocated by the first frame).
    pub fn memory_bytes(&self) -> usize {
        self.cctx.sizeof()
    }
}

/// One connection's zstd stream, receiving side (see [`ZstdStream`]): decodes the connection's
/// PagesZ frames of the stream codec in order, the window bounded by the `window_log` the
/// receiver accepted (a stream asking for more is an error).
pub struct ZstdStreamDecoder {
    dctx: zstd::zstd_safe::DCtx<'static>,
}

impl std::fmt::Debug for ZstdStreamDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZstdStreamDecoder").finish_non_exhaustive()
    }
}

impl ZstdStreamDecoder {
    /// A decoder for a stream whose window is at most `2^window_log` bytes.
    pub fn new(window_log: u32) -> Result<ZstdStreamDecoder, StreamError> {
        check_window_log(window_log).map_err(StreamError::Malformed)?;
        let mut dctx = zstd::zstd_safe::DCtx::try_create()
            .ok_or_else(|| StreamError::Malformed("no zstd decompression context".into()))?;
        dctx.set_parameter(zstd::zstd_safe::DParameter::WindowLogMax(window_log))
            .map_err(|e| zstd_error("zstd stream parameter", e))?;
        Ok(ZstdStreamDecoder { dctx })
    }

    /// The memory it holds now (its window, allocated by the first frame).
    pub fn memory_bytes(&self) -> usize {
        self.dctx.sizeof()
    }

    /// Decodes one frame's compressed bytes `src` into exactly `dst`: all of `src` must be
    /// used and fill all of `dst`.
    pub(super) fn decode(&mut self, src: &[u8], dst: &mut [u8]) -> Result<(), StreamError> {
        use zstd::zstd_safe::{InBuffer, OutBuffer};
        let mut input = InBuffer::around(src);
        let mut output = OutBuffer::around(dst);
        loop {
            let before = (input.pos(), output.pos());
            self.dctx
                .decompress_stream(&mut output, &mut input)
                .map_err(|e| zstd_error("PagesZ frame: zstd stream", e))?;
            let (read, written) = (input.pos(), output.pos());
            if read == src.len() && written == output.capacity() {
                return Ok(());
            }
            if (read, written) == before {
                return Err(StreamError::Malformed(format!(
                    "PagesZ frame: zstd stream: {written} bytes decompressed from {read} of {} \
                     ({} announced)",
                    src.len(),
                    output.capacity()
                )));
            }
        }
    }
}

/// Drops `value` on a thread of its own: freeing a zstd stream's window (about its size of
/// touched memory) takes tens of milliseconds for 128 MiB, which a migration's switch-over
/// should not wait for.
pub(crate) fn free_aside<T: Send + 'static>(value: T) {
    if let Err(e) = std::thread::Builder::new()
        .name("free-stream".into())
        .spawn(move || drop(value))
    {
        tracing::debug!("freeing on this thread (no thread for it: {e})");
    }
}

/// Compresses the Pages or PagesD frame in `frame` into the connection's zstd `stream`
/// (replacing it by a PagesZ frame of codec 3), always: once fed to the stream it must reach
/// the receiver compressed, whatever its size (pages that do not compress grow by a few bytes,
/// at most `Z_SLACK`). `scratch` is kept between calls. Returns the frame's length on the
/// wire.
#[allow(clippy::cast_possible_truncation)] // frame lengths are bounded by MAX_PAYLOAD.
pub fn compress_pages_stream(
    frame: &mut Vec<u8>,
    stream: &mut ZstdStream,
    scratch: &mut Vec<u8>,
) -> Result<usize, StreamError> {
    use zstd::zstd_safe::{zstd_sys::ZSTD_EndDirective, InBuffer, OutBuffer};
    if frame.len() <= HEADER + 4 + Z_HEADER {
        return Ok(frame.len());
    }
    debug_assert!(frame[4] == kind::PAGES || frame[4] == kind::PAGES_D);
    let at = HEADER + Z_HEADER;
    let room = at + zstd::zstd_safe::compress_bound(frame.len()) + 64;
    if scratch.len() < room {
        scratch.resize(room, 0);
    }
    let mut input = InBuffer::around(frame.as_slice());
    let mut n = at;
    loop {
        let mut output = OutBuffer::around_pos(&mut scratch[..], n);
        let left = stream
            .cctx
            .compress_stream2(&mut output, &mut input, ZSTD_EndDirective::ZSTD_e_flush)
            .map_err(|e| zstd_error("zstd stream", e))?;
        n = output.pos();
        if left == 0 && input.pos() == frame.len() {
            break;
        }
        // Never for a frame of pages (see compress_bound); grown rather than lost.
        if scratch.len() > 2 * MAX_PAYLOAD as usize {
            return Err(StreamError::Malformed(format!(
                "zstd stream: {n} bytes and still {left} to flush"
            )));
        }
        let grown = scratch.len() + (64 << 10);
        scratch.resize(grown, 0);
    }
    let payload = n - HEADER;
    if payload > MAX_PAYLOAD as usize {
        return Err(StreamError::Malformed(format!(
            "a zstd stream frame of {payload} bytes exceeds {MAX_PAYLOAD}"
        )));
    }
    scratch[..4].copy_from_slice(&MAGIC);
    scratch[4..8].copy_from_slice(&[kind::PAGES_Z, 0, 0, 0]);
    scratch[8..12].copy_from_slice(&(payload as u32).to_le_bytes());
    scratch[12..16].copy_from_slice(&[ZSTD_STREAM_CODEC, 0, 0, 0]);
    scratch[16..20].copy_from_slice(&(frame.len() as u32).to_le_bytes());
    let crc = crc32fast::hash(&scratch[..n]);
    frame.clear();
    frame.extend_from_slice(&scratch[..n]);
    frame.extend_from_slice(&crc.to_le_bytes());
    Ok(frame.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::test_pages::{dense_pages, pages_frame};

    fn random_pages(count: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..count * PAGE)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (x >> 56) as u8
            })
            .collect()
    }

    /// Frames of one connection's zstd stream decode in order, each whole on arrival, to the
    /// pages sent; a frame repeating earlier pages costs a fraction of the first (the window
    /// spans frames); incompressible pages still go compressed, a little larger, within
    /// MAX_PAYLOAD.
    #[test]
    fn zstd_stream_frames_round_trip_and_reach_back_over_earlier_frames() {
        let mut tx = ZstdStream::new(1, 23).unwrap();
        let mut rx = ZstdStreamDecoder::new(23).unwrap();
        let text = dense_pages(256);
        let random = random_pages(MAX_FRAME_PAGES, 7);
        let frames: Vec<(Vec<u8>, u64)> = vec![
            (random_pages(128, 3), 0x10_0000),
            (text.clone(), 0x20_0000),
            (dense_pages(64), 0x40_0000),
            // The same pages again, elsewhere: the stream has them in its window.
            (text.clone(), 0x60_0000),
            (random.clone(), 0x80_0000),
            (random_pages(128, 3), 0xa0_0000),
        ];
        let mut scratch = Vec::new();
        let mut wire = Vec::new();
        let mut sizes = Vec::new();
        for (pages, gpa) in &frames {
            let mut frame = pages_frame(pages, *gpa);
            let plain = frame.len();
            let n = compress_pages_stream(&mut frame, &mut tx, &mut scratch).unwrap();
            assert_eq!((n, frame[4], frame[12]), (frame.len(), kind::PAGES_Z, 3));
            assert!(frame.len() <= HEADER + MAX_PAYLOAD as usize + 4);
            sizes.push((plain, n));
            wire.extend_from_slice(&frame);
        }
        // Repeated text: a small fraction of its first sending.
        assert!(sizes[3].1 * 20 < sizes[1].1, "{sizes:?}");
        // Repeated random pages (four frames and 4.3 MiB back, in the 8 MiB window): the same.
        assert!(sizes[5].1 * 20 < sizes[0].1, "{sizes:?}");
        // Random pages (only their masks compress), and the first random frame (which grew
        // by the stream's header): sent compressed all the same, barely larger at worst.
        assert!(
            sizes[4].1 * 100 > sizes[4].0 * 99 && sizes[4].1 < sizes[4].0 + 256,
            "{sizes:?}"
        );
        assert!(
            sizes[0].1 >= sizes[0].0 && sizes[0].1 < sizes[0].0 + 256,
            "{sizes:?}"
        );
        assert!(tx.memory_bytes() >= 1 << 22);
        let mut r = &wire[..];
        let mut buf = Vec::new();
        for (pages, gpa) in &frames {
            match Frame::read_into_stream(&mut r, &mut buf, Some(&mut rx), |_, _, _| None).unwrap()
            {
                FrameRef::Pages {
                    gpa: got, pages: p, ..
                } => assert!(got == *gpa && p == &pages[..]),
                other => panic!("{other:?}"),
            }
        }
        assert!(r.is_empty());
        // Placed where they belong, as any Pages frame.
        let mut tx = ZstdStream::new(1, 22).unwrap();
        let mut rx = ZstdStreamDecoder::new(22).unwrap();
        let mut frame = pages_frame(&text, 0);
        compress_pages_stream(&mut frame, &mut tx, &mut scratch).unwrap();
        let mut memory = vec![0xffu8; text.len()];
        let got = Frame::read_into_stream(&mut &frame[..], &mut buf, Some(&mut rx), |_, _, _| {
            Some(&mut memory[..])
        });
        assert!(matches!(got, Ok(FrameRef::Placed { .. })));
        assert!(memory == text);
    }

    /// A stream frame where there is no stream is refused by name; damage is an error (the
    /// zstd stream's own or the inner frame's CRC), and so is a stream whose window exceeds
    /// what the receiver accepted.
    #[test]
    fn damaged_or_unexpected_zstd_stream_frames_are_errors() {
        let text = dense_pages(64);
        let encode = |window_log: u32, count: usize| {
            let mut tx = ZstdStream::new(1, window_log).unwrap();
            let mut scratch = Vec::new();
            (0..count)
                .map(|i| {
                    let mut frame = pages_frame(&text, i as u64 * 0x20_0000);
                    compress_pages_stream(&mut frame, &mut tx, &mut scratch).unwrap();
                    frame
                })
                .collect::<Vec<_>>()
        };
        let frames = encode(20, 2);
        let e = Frame::read_from(&mut &frames[0][..]).unwrap_err();
        assert!(matches!(e, StreamError::NoZstdStream), "{e}");
        assert!(e.to_string().contains("without a zstd stream"), "{e}");
        // Damage in the compressed bytes, re-sealed with a valid outer CRC.
        for at in [
            HEADER + Z_HEADER + 3,
            frames[0].len() / 2,
            frames[0].len() - 6,
        ] {
            let mut bad = frames[0][..frames[0].len() - 4].to_vec();
            bad[at] ^= 0x24;
            let crc = crc32fast::hash(&bad);
            bad.extend_from_slice(&crc.to_le_bytes());
            let mut rx = ZstdStreamDecoder::new(20).unwrap();
            let mut buf = Vec::new();
            let got =
                Frame::read_into_stream(&mut &bad[..], &mut buf, Some(&mut rx), |_, _, _| None);
            assert!(got.is_err(), "byte {at} flipped: {got:?}");
        }
        // The second frame alone (its history missing): an error, not other pages.
        let mut rx = ZstdStreamDecoder::new(20).unwrap();
        let mut buf = Vec::new();
        let got =
            Frame::read_into_stream(&mut &frames[1][..], &mut buf, Some(&mut rx), |_, _, _| None);
        assert!(got.is_err(), "{got:?}");
        // A window larger than the receiver's bound.
        let big = encode(24, 1);
        let mut rx = ZstdStreamDecoder::new(20).unwrap();
        let e = Frame::read_into_stream(
            &mut &big[0][..],
            &mut Vec::new(),
            Some(&mut rx),
            |_, _, _| None,
        )
        .unwrap_err();
        assert!(e.to_string().contains("zstd stream"), "{e}");
        assert!(ZstdStream::new(1, 31).is_err() && ZstdStreamDecoder::new(9).is_err());
        // The bounds both sides and the destination's setup check share.
        assert!(check_window_log(ZSTD_WINDOW_LOG_MIN).is_ok());
        assert!(check_window_log(ZSTD_WINDOW_LOG_MAX).is_ok());
        let e = check_window_log(ZSTD_WINDOW_LOG_MAX + 1).unwrap_err();
        assert!(e.contains("2^31 bytes"), "{e}");
    }
}
