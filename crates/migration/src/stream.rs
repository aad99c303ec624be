//! The migration stream: frames that carry a VM from one guestmem to another.
//!
//! Every frame is `header | payload | crc32`:
//! - header (12 bytes, little-endian): magic `b"GMf2"`, kind (u8), three reserved zero bytes,
//!   payload length (u32, at most [`MAX_PAYLOAD`] for a PagesZ frame, 2 MiB of pages with
//!   their masks and header for the others);
//! - payload: as the kind says (below);
//! - CRC-32 (u32) of header and payload together.
//!
//! A Pages payload is `gpa (u64) | count (u32) | flags (u32) | count line masks (u64) | lines`:
//! bit `i` of page `p`'s mask says its 64-byte line `i` is not all zero, and only those lines
//! travel, page after page (guest pages are often mostly zeros; a page without a zero line
//! travels whole, plus its 8-byte mask). Flag [`FRESH`]: the receiver's memory at these pages still holds
//! zeros (the destination's RAM in round 1), so it need not write the zero lines.
//!
//! A PagesZ payload carries one whole Pages frame (header, payload and CRC), compressed:
//! `codec (u8) | 3 zero bytes | inner length (u32) | compressed bytes`, codec 1 = LZ4 block,
//! 2 = zstd frame, 3 = zstd stream. The receiver decompresses into a buffer of exactly the
//! announced length (never more) and decodes the inner frame as any Pages frame, its own CRC
//! included: the pages are checked end to end, after decompression. Codecs 1 and 2 compress
//! each frame on its own, and a sender uses them only when that makes the frame smaller
//! ([`compress_pages`]).
//!
//! Codec 3, the zstd stream ([`ZstdStream`], [`compress_pages_stream`]): each pre-copy pages
//! connection carries one zstd frame that never ends, of which every PagesZ frame of codec 3
//! is the next piece, flushed (`ZSTD_e_flush`) so that it decodes whole on arrival; its window
//! (`2^window_log` bytes, long distance matching on) spans the frames sent before on the
//! connection, so pages resembling earlier ones travel as references to them (13 % fewer
//! bytes than codec 2 on a real 2 GiB Linux guest with a 128 MiB window). Sender and receiver
//! keep the stream's history in step: the receiver decodes a connection's codec-3 frames in
//! order with its [`ZstdStreamDecoder`], made when the source announced the stream in its
//! setup and bounding the window to what was announced (`WindowLogMax`); a codec-3 frame on a
//! connection without one is an error ([`StreamError::NoZstdStream`]). A frame fed to the
//! stream is always sent compressed, even when it grew (pages that do not compress are stored
//! raw, a few bytes more; hence [`MAX_PAYLOAD`]'s slack over the largest Pages frame).
//! Post-copy's answers never use it: each must decode on its own.
//!
//! A PagesD payload carries pages as deltas against the receiver's copy of them (see
//! [`crate::delta`]): `gpa (u64) | count (u32) | flags (u32, zero) | count sizes (u16) |
//! bodies`, page after page; a body of 4096 bytes is the page itself, a shorter one a delta
//! against the version of the page the receiver holds (which must be the last one sent). A
//! PagesZ frame may hold a PagesD frame as it holds a Pages frame. The receiver checks the
//! whole frame (CRC, sizes adding up, every delta's spans inside its page) before it writes a
//! byte.
//!
//! A decoder checks all of it — magic, kind, reserved bytes, length bound, checksum, and the
//! payload's own shape — before anything is acted on, and never allocates more than
//! [`MAX_PAYLOAD`] for a frame (and a zstd stream's decoder no more than its bounded window),
//! so a malformed or hostile stream is an error, never a crash.

use std::io::{self, Read, Write};

/// The stream's magic and version: a peer speaking another version is refused by its first frame.
pub const MAGIC: [u8; 4] = *b"GMf2";
/// The most pages one Pages frame carries (2 MiB).
pub const MAX_FRAME_PAGES: usize = 512;
/// The largest payload a frame may carry: 2 MiB of pages with their masks and header, plus
/// [`Z_SLACK`] (what a zstd stream frame may add to pages that do not compress).
pub const MAX_PAYLOAD: u32 = (MAX_PAGES_PAYLOAD + Z_SLACK) as u32;
/// The largest Pages (or PagesD) payload: 2 MiB of pages with their masks and header.
const MAX_PAGES_PAYLOAD: usize = PAGES_HEADER + MAX_FRAME_PAGES * (8 + PAGE);
/// How much larger than the frame it holds a PagesZ frame of the zstd stream codec may be: such
/// a frame goes compressed even when its pages do not compress (the receiver's history must see
/// it), and zstd then stores them raw, 3 bytes of block header per 128 KiB and the stream's own
/// header once (about 70 bytes for 2 MiB).
const Z_SLACK: usize = 4096;
const HEADER: usize = 12;
/// A Pages payload's own header: gpa, count, flags.
const PAGES_HEADER: usize = 16;
/// Pages flag: the receiver's memory at these pages holds zeros; zero lines need no writing.
pub const FRESH: u32 = 1;
/// The unit of zero elision inside a page: one cache line.
const LINE: usize = 64;
const LINES: usize = PAGE / LINE;
/// Pages are checksummed in pieces of this many bytes as they are copied (on both sides), so
/// that each piece is still in the cache when its CRC is taken.
pub const CRC_PIECE: usize = 64 << 10;

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
    scratch[..4].copy_from_slice(&MAGIC);
    scratch[4..8].copy_from_slice(&[kind::PAGES_Z, 0, 0, 0]);
    scratch[8..12].copy_from_slice(&(payload as u32).to_le_bytes());
    scratch[12..16].copy_from_slice(&[codec.id(), 0, 0, 0]);
    scratch[16..20].copy_from_slice(&(frame.len() as u32).to_le_bytes());
    let crc = crc32fast::hash(&scratch[..at + n]);
    scratch[at + n..at + n + 4].copy_from_slice(&crc.to_le_bytes());
    frame.clear();
    frame.extend_from_slice(&scratch[..at + n + 4]);
    Ok(frame.len())
}

/// A PagesZ payload's own header: codec, reserved, inner length.
const Z_HEADER: usize = 8;

/// The PagesZ codec id of the zstd stream (see [`ZstdStream`]).
const ZSTD_STREAM_CODEC: u8 = 3;
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
    fn decode(&mut self, src: &[u8], dst: &mut [u8]) -> Result<(), StreamError> {
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
/// at most [`Z_SLACK`]). `scratch` is kept between calls. Returns the frame's length on the
/// wire.
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

/// One frame of the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// First frame each way: who speaks, and (from the source) the VM configuration as JSON.
    Hello {
        /// The JSON.
        config_json: Vec<u8>,
    },
    /// `pages.len() / 4096` guest pages starting at `gpa`; `fresh`: the receiver's memory
    /// there still holds zeros (see [`FRESH`]).
    Pages {
        /// The first page's guest address.
        gpa: u64,
        /// The pages' bytes.
        pages: Vec<u8>,
        /// The receiver's memory there still holds zeros.
        fresh: bool,
    },
    /// `count` guest pages starting at `gpa` are all zero (sent only where the destination may
    /// hold older, non-zero contents).
    Zero {
        /// The first page's guest address.
        gpa: u64,
        /// How many pages.
        count: u64,
    },
    /// The switch-over state (JSON: the machine's and the components' states, the memory
    /// digest, post-copy's stale chunks): the source's vCPUs are stopped.
    State {
        /// The JSON.
        state_json: Vec<u8>,
    },
    /// Destination to source (post-copy): send the `len` bytes (whole pages, at most
    /// [`MAX_REQUEST`]) at `gpa` now; the answer is one Pages or Zero frame for exactly them.
    Request {
        /// The guest address.
        gpa: u64,
        /// The bytes asked for.
        len: u32,
    },
    /// The end of round `round` (counted from 1) on this connection; `last`: no more pages
    /// will come on it before the State.
    EndOfRound {
        /// The round.
        round: u32,
        /// No more pages before the State.
        last: bool,
    },
    /// Destination to source: the destination has everything it needs from the source (pre-copy:
    /// it runs the VM; post-copy: all memory is resident), so the source may let go; with the
    /// destination's own figures (JSON).
    Complete {
        /// The destination's report (JSON).
        report_json: Vec<u8>,
    },
    /// The sender gives up, and says why.
    Abort {
        /// Why.
        reason: String,
    },
    /// Destination to source, after the State: memory and vCPU state are in place (and the
    /// memory digest matched, when the source sent one); waiting for Go.
    Ready,
    /// Source to destination: the source has stopped the VM for good; run it.
    Go,
    /// Destination to source: the vCPUs are running here (the end of the downtime).
    Running,
    /// `count` guest pages at `gpa`, each whole or as a delta against the receiver's copy:
    /// `body` is the PagesD payload after its header (sizes, then bodies; see the module
    /// docs), checked when decoded. Apply it with [`Frame::apply_delta`].
    Delta {
        /// The first page's guest address.
        gpa: u64,
        /// How many pages.
        count: u32,
        /// The PagesD payload after its header.
        body: Vec<u8>,
    },
}

/// The most one Request may ask for.
pub const MAX_REQUEST: u32 = 2 << 20;

const PAGE: usize = 4096;

/// What can be wrong with a stream.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// The peer closed the stream.
    #[error("the peer closed the stream")]
    Closed,
    /// Reading or writing the stream failed.
    #[error("I/O on the migration stream")]
    Io(#[from] io::Error),
    /// Not a stream of this version.
    #[error(
        "not a guestmem migration stream of this version (magic {0:02x?}, expected {MAGIC:02x?})"
    )]
    Magic([u8; 4]),
    /// A frame that does not decode.
    #[error("malformed frame: {0}")]
    Malformed(String),
    /// A PagesZ frame of the zstd stream codec on a connection that has no zstd stream (the
    /// source did not announce one, or it is not a connection of the rounds).
    #[error("a frame of the zstd stream codec on a connection without a zstd stream")]
    NoZstdStream,
    /// A frame whose CRC-32 does not match.
    #[error("frame checksum {found:#010x} does not match its contents ({computed:#010x})")]
    Checksum {
        /// The frame's CRC-32.
        found: u32,
        /// Its contents'.
        computed: u32,
    },
}

mod kind {
    pub const HELLO: u8 = 1;
    pub const PAGES: u8 = 2;
    pub const ZERO: u8 = 3;
    pub const STATE: u8 = 4;
    pub const REQUEST: u8 = 5;
    pub const END_OF_ROUND: u8 = 6;
    pub const COMPLETE: u8 = 7;
    pub const ABORT: u8 = 8;
    pub const READY: u8 = 9;
    pub const GO: u8 = 10;
    pub const RUNNING: u8 = 11;
    pub const PAGES_Z: u8 = 12;
    pub const PAGES_D: u8 = 13;
}

/// What a frame does to the slice [`Frame::read_into`]'s `place` lends it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lend {
    /// A Pages frame writes its pages there: every byte, or with `fresh` only the non-zero
    /// lines (the slice must then hold zeros elsewhere).
    Pages {
        /// The frame's FRESH flag: its zero lines are left unwritten.
        fresh: bool,
    },
    /// A PagesD frame patches the versions already there.
    Patch,
}

/// A frame read by [`Frame::read_into`]: Pages borrow the reader's buffer, or were placed.
#[derive(Debug, PartialEq)]
pub enum FrameRef<'b> {
    /// A Pages frame whose pages are in the reader's buffer.
    Pages {
        /// The first page's guest address.
        gpa: u64,
        /// The pages' bytes.
        pages: &'b [u8],
        /// The receiver's memory there still holds zeros.
        fresh: bool,
    },
    /// A Pages frame whose `len` bytes of pages were read into the slice `place` lent (its
    /// zero lines left unwritten when `fresh`).
    Placed {
        /// The first page's guest address.
        gpa: u64,
        /// The pages' bytes.
        len: usize,
        /// The zero lines were left unwritten.
        fresh: bool,
    },
    /// A PagesD frame applied to the slice `place` lent (its `len` bytes of pages at `gpa`).
    Patched {
        /// The first page's guest address.
        gpa: u64,
        /// The pages' bytes.
        len: usize,
    },
    /// Any other frame.
    Frame(Frame),
}

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

fn check_crc(found: u32, computed: u32) -> Result<(), StreamError> {
    if found == computed {
        Ok(())
    } else {
        Err(StreamError::Checksum { found, computed })
    }
}

impl Frame {
    fn kind(&self) -> u8 {
        match self {
            Frame::Hello { .. } => kind::HELLO,
            Frame::Pages { .. } => kind::PAGES,
            Frame::Zero { .. } => kind::ZERO,
            Frame::State { .. } => kind::STATE,
            Frame::Request { .. } => kind::REQUEST,
            Frame::EndOfRound { .. } => kind::END_OF_ROUND,
            Frame::Complete { .. } => kind::COMPLETE,
            Frame::Abort { .. } => kind::ABORT,
            Frame::Ready => kind::READY,
            Frame::Go => kind::GO,
            Frame::Running => kind::RUNNING,
            Frame::Delta { .. } => kind::PAGES_D,
        }
    }

    fn payload(&self) -> Vec<u8> {
        match self {
            Frame::Hello { config_json } => config_json.clone(),
            Frame::Pages { .. } => unreachable!("Pages are encoded by encode_pages_with"),
            Frame::Zero { gpa, count } => [gpa.to_le_bytes(), count.to_le_bytes()].concat(),
            Frame::State { state_json } => state_json.clone(),
            Frame::Request { gpa, len } => [&gpa.to_le_bytes()[..], &len.to_le_bytes()].concat(),
            Frame::EndOfRound { round, last } => {
                [&round.to_le_bytes()[..], &[u8::from(*last)]].concat()
            }
            Frame::Complete { report_json } => report_json.clone(),
            Frame::Ready | Frame::Go | Frame::Running => Vec::new(),
            Frame::Abort { reason } => reason.as_bytes().to_vec(),
            Frame::Delta { gpa, count, body } => {
                [&gpa.to_le_bytes()[..], &count.to_le_bytes(), &[0; 4], body].concat()
            }
        }
    }

    /// Encodes the frame. Fails (without writing) if it would exceed the largest Pages payload
    /// ([`MAX_PAYLOAD`] less the room only PagesZ frames get) or carries
    /// pages that are not whole.
    pub fn encode(&self) -> Result<Vec<u8>, StreamError> {
        let mut out = Vec::new();
        if let Frame::Pages { gpa, pages, fresh } = self {
            Frame::encode_pages_with(&mut out, *gpa, pages.len(), *fresh, false, |at, piece| {
                piece.copy_from_slice(&pages[at..at + piece.len()]);
                Ok(())
            })?;
            return Ok(out);
        }
        let payload = self.payload();
        if payload.len() > MAX_PAGES_PAYLOAD {
            return Err(StreamError::Malformed(format!(
                "payload of {} bytes exceeds {MAX_PAGES_PAYLOAD}",
                payload.len()
            )));
        }
        out.reserve(HEADER + payload.len() + 4);
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&[self.kind(), 0, 0, 0]);
        out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        out.extend_from_slice(&payload);
        let crc = crc32fast::hash(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        Ok(out)
    }

    /// Writes the frame (header, body, CRC-32) to `w`.
    pub fn write_to(&self, w: &mut impl Write) -> Result<(), StreamError> {
        w.write_all(&self.encode()?)?;
        Ok(())
    }

    /// Encodes into `out` (its contents replaced) a Pages frame of `len` bytes of pages at
    /// `gpa`, whose pages `fill` writes straight into the frame (no copy in between: senders
    /// read guest memory into it), [`CRC_PIECE`] bytes at a time: `fill(offset, piece)`. Each
    /// piece's zero lines are then squeezed out and what is left checksummed, while the piece
    /// is still in the cache. `whole_pages` keeps every line (for comparison with senders that
    /// send whole pages). Returns the bytes of lines the frame carries (0: the pages are all
    /// zero).
    pub fn encode_pages_with(
        out: &mut Vec<u8>,
        gpa: u64,
        len: usize,
        fresh: bool,
        whole_pages: bool,
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
                let mask = if whole_pages {
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
            lines.update(&out[begin..w]);
        }
        let payload = w - HEADER;
        out[..4].copy_from_slice(&MAGIC);
        out[4..8].copy_from_slice(&[kind::PAGES, 0, 0, 0]);
        out[8..12].copy_from_slice(&(payload as u32).to_le_bytes());
        out[12..20].copy_from_slice(&gpa.to_le_bytes());
        out[20..24].copy_from_slice(&(count as u32).to_le_bytes());
        out[24..28].copy_from_slice(&(if fresh { FRESH } else { 0 }).to_le_bytes());
        for (p, mask) in masks[..count].iter().enumerate() {
            let at = HEADER + PAGES_HEADER + 8 * p;
            out[at..at + 8].copy_from_slice(&mask.to_le_bytes());
        }
        let mut hasher = crc32fast::Hasher::new();
        hasher.update(&out[..lines_at]);
        hasher.combine(&lines);
        out.truncate(w);
        out.extend_from_slice(&hasher.finalize().to_le_bytes());
        Ok(w - lines_at)
    }

    /// Encodes into `out` (its contents replaced) a PagesD frame of the pages in `pages` (whole
    /// pages, at most [`MAX_FRAME_PAGES`]) at `gpa`: page `p` travels as the delta that
    /// `delta(p, page, out)` appends to `out` when it returns true and the delta is smaller
    /// than a page, else whole. Returns the pages sent as deltas and their bytes.
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

    /// Reads and checks one frame. A clean end of stream before a frame starts is
    /// [`StreamError::Closed`]; one in the middle of a frame is an I/O error.
    pub fn read_from(r: &mut impl Read) -> Result<Frame, StreamError> {
        let mut buf = Vec::new();
        Ok(match Frame::read_into(r, &mut buf, |_, _, _| None)? {
            FrameRef::Pages { gpa, pages, fresh } => Frame::Pages {
                gpa,
                pages: pages.to_vec(),
                fresh,
            },
            FrameRef::Placed { .. } | FrameRef::Patched { .. } => {
                unreachable!("nothing was lent to place pages in")
            }
            FrameRef::Frame(f) => f,
        })
    }

    /// Like [`Frame::read_from`], but reads into `buf` (kept for the next frame) and lends a
    /// Pages frame's pages from it: a receiver applying rounds of 2 MiB frames allocates, zeroes
    /// and frees nothing per frame.
    ///
    /// `place` may take a Pages frame's pages where they belong: asked with the frame's gpa,
    /// length and what the frame does there ([`Lend`]), it lends a slice of exactly that length (guest memory) or declines (`None`).
    /// Taken pages are written straight into it (runs of whole pages read there from `r`,
    /// saving a copy; a fresh frame's zero lines left unwritten), and come back as
    /// [`FrameRef::Placed`] once the CRC matched. A frame whose CRC does not match has already
    /// written its bytes there: only a receiver that throws that memory away on an error may
    /// place (a migration's destination before it runs the VM).
    ///
    /// A PagesD frame is checked whole first, then applied to the slice `place` lends
    /// ([`FrameRef::Patched`]), which must hold the versions its deltas were made against;
    /// declined, it comes back as a [`Frame::Delta`].
    pub fn read_into<'b>(
        r: &mut impl Read,
        buf: &'b mut Vec<u8>,
        place: impl FnOnce(u64, usize, Lend) -> Option<&'b mut [u8]>,
    ) -> Result<FrameRef<'b>, StreamError> {
        Frame::read_into_stream(r, buf, None, place)
    }

    /// [`Frame::read_into`] on a connection that may carry a zstd stream: PagesZ frames of the
    /// stream codec are decoded by `stream`, which must have seen every earlier one of the
    /// connection (without it, such a frame is [`StreamError::NoZstdStream`]).
    pub fn read_into_stream<'b>(
        r: &mut impl Read,
        buf: &'b mut Vec<u8>,
        stream: Option<&mut ZstdStreamDecoder>,
        place: impl FnOnce(u64, usize, Lend) -> Option<&'b mut [u8]>,
    ) -> Result<FrameRef<'b>, StreamError> {
        let (header, len) = Frame::read_header(r)?;
        if header[4] == kind::PAGES_Z {
            return Frame::read_compressed(r, &header, len, buf, stream, place);
        }

        if header[4] == kind::PAGES_D {
            return Frame::read_delta(r, &header, len, buf, place);
        }
        if header[4] != kind::PAGES {
            Frame::read_payload(r, &header, len, buf)?;
            return Frame::decode(header[4], &buf[..len]).map(FrameRef::Frame);
        }
        let malformed = |what: String| Err(StreamError::Malformed(format!("Pages frame: {what}")));
        if len < PAGES_HEADER {
            return malformed(format!("{len} bytes, shorter than its header"));
        }
        let mut hasher = crc32fast::Hasher::new();
        hasher.update(&header);
        let mut head = [0u8; PAGES_HEADER];
        r.read_exact(&mut head)?;
        hasher.update(&head);
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
        let mut mask_bytes = [0u8; 8 * MAX_FRAME_PAGES];
        let mask_bytes = &mut mask_bytes[..8 * count];
        r.read_exact(mask_bytes)?;
        hasher.update(mask_bytes);
        let masks: Vec<u64> = mask_bytes
            .chunks_exact(8)
            .map(|m| u64::from_le_bytes(m.try_into().expect("8 bytes")))
            .collect();
        let line_bytes = masks.iter().map(|m| m.count_ones() as usize).sum::<usize>() * LINE;
        if PAGES_HEADER + 8 * count + line_bytes != len {
            return malformed(format!(
                "its masks announce {line_bytes} bytes of lines, its length leaves {}",
                len - PAGES_HEADER - 8 * count
            ));
        }
        let fresh = flags & FRESH != 0;
        let size = count * PAGE;
        let placed = match place(gpa, size, Lend::Pages { fresh }) {
            Some(dst) => {
                assert_eq!(dst.len(), size, "`place` lent a slice of another length");
                read_lines(r, &mut hasher, &masks, dst, !fresh)?;
                true
            }
            None => {
                if buf.len() < size {
                    buf.resize(size, 0);
                }
                read_lines(r, &mut hasher, &masks, &mut buf[..size], true)?;
                false
            }
        };
        let mut crc = [0u8; 4];
        r.read_exact(&mut crc)?;
        check_crc(u32::from_le_bytes(crc), hasher.finalize())?;
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

    /// The rest of a PagesD frame (see the module docs): checked whole, then applied where
    /// `place` says, or returned.
    fn read_delta<'b>(
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

    /// The rest of a PagesZ frame (see the module docs): its payload is checked and
    /// decompressed into a buffer of exactly the announced inner length, which must hold one
    /// whole Pages frame; that frame is then read as any other.
    fn read_compressed<'b>(
        r: &mut impl Read,
        header: &[u8; HEADER],
        len: usize,
        buf: &'b mut Vec<u8>,
        stream: Option<&mut ZstdStreamDecoder>,
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

    /// Reads and checks a frame's header; returns it and the payload length.
    fn read_header(r: &mut impl Read) -> Result<([u8; HEADER], usize), StreamError> {
        let mut header = [0u8; HEADER];
        let mut got = 0;
        while got < HEADER {
            match r.read(&mut header[got..]) {
                Ok(0) if got == 0 => return Err(StreamError::Closed),
                Ok(0) => return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into()),
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
        let magic: [u8; 4] = header[..4].try_into().expect("4 bytes");
        if magic != MAGIC {
            return Err(StreamError::Magic(magic));
        }
        if header[5..8] != [0, 0, 0] {
            return Err(StreamError::Malformed(
                "reserved header bytes are not zero".into(),
            ));
        }
        let len = u32::from_le_bytes(header[8..12].try_into().expect("4 bytes"));
        // Only a PagesZ frame may exceed the largest Pages payload (see Z_SLACK).
        let max = if header[4] == kind::PAGES_Z {
            MAX_PAYLOAD
        } else {
            MAX_PAGES_PAYLOAD as u32
        };
        if len > max {
            return Err(StreamError::Malformed(format!(
                "payload length {len} exceeds {max}"
            )));
        }
        Ok((header, len as usize))
    }

    /// Reads the rest of a frame after its header: the payload lands at the start of `buf`
    /// (which only grows: its bytes are overwritten, not zeroed again), and the CRC over
    /// header and payload is checked.
    fn read_payload(
        r: &mut impl Read,
        header: &[u8; HEADER],
        len: usize,
        buf: &mut Vec<u8>,
    ) -> Result<(), StreamError> {
        if buf.len() < len + 4 {
            buf.resize(len + 4, 0);
        }
        r.read_exact(&mut buf[..len + 4])?;
        let found = u32::from_le_bytes(buf[len..len + 4].try_into().expect("4 bytes"));
        let mut hasher = crc32fast::Hasher::new();
        hasher.update(header);
        hasher.update(&buf[..len]);
        check_crc(found, hasher.finalize())
    }

    fn decode(kind: u8, p: &[u8]) -> Result<Frame, StreamError> {
        let malformed = |what: &str| StreamError::Malformed(format!("{what} ({} bytes)", p.len()));
        let u64_at = |at: usize| u64::from_le_bytes(p[at..at + 8].try_into().expect("8 bytes"));
        Ok(match kind {
            kind::HELLO => Frame::Hello {
                config_json: p.to_vec(),
            },
            kind::PAGES | kind::PAGES_D => unreachable!("read_into reads page frames itself"),
            kind::ZERO => {
                if p.len() != 16 {
                    return Err(malformed("a Zero frame holds a gpa and a count"));
                }
                let (gpa, count) = (u64_at(0), u64_at(8));
                if !gpa.is_multiple_of(PAGE as u64) || count == 0 {
                    return Err(StreamError::Malformed(format!(
                        "Zero frame {gpa:#x} x {count}"
                    )));
                }
                Frame::Zero { gpa, count }
            }
            kind::STATE => Frame::State {
                state_json: p.to_vec(),
            },
            kind::REQUEST => {
                if p.len() != 12 {
                    return Err(malformed("a Request frame holds a gpa and a length"));
                }
                let gpa = u64_at(0);
                let len = u32::from_le_bytes(p[8..12].try_into().expect("4 bytes"));
                if !gpa.is_multiple_of(PAGE as u64)
                    || len == 0
                    || !len.is_multiple_of(PAGE as u32)
                    || len > MAX_REQUEST
                {
                    return Err(StreamError::Malformed(format!(
                        "Request {gpa:#x}+{len:#x}: whole pages, at most {MAX_REQUEST:#x} bytes"
                    )));
                }
                Frame::Request { gpa, len }
            }
            kind::END_OF_ROUND => {
                if p.len() != 5 || p[4] > 1 {
                    return Err(malformed(
                        "an EndOfRound frame holds a round number and a last flag",
                    ));
                }
                Frame::EndOfRound {
                    round: u32::from_le_bytes(p[..4].try_into().expect("4 bytes")),
                    last: p[4] == 1,
                }
            }
            kind::COMPLETE => Frame::Complete {
                report_json: p.to_vec(),
            },
            kind::READY | kind::GO | kind::RUNNING => {
                if !p.is_empty() {
                    return Err(malformed("Ready, Go and Running frames are empty"));
                }
                match kind {
                    kind::READY => Frame::Ready,
                    kind::GO => Frame::Go,
                    _ => Frame::Running,
                }
            }
            kind::ABORT => Frame::Abort {
                reason: String::from_utf8_lossy(p).into_owned(),
            },
            other => {
                return Err(StreamError::Malformed(format!(
                    "unknown frame kind {other}"
                )))
            }
        })
    }
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
/// hashes them in stream order. Runs of whole pages are read straight into `dst`; a page with
/// zero lines is read into a page-sized scratch first and spread, writing the zero lines only if
/// `write_zeros`.
fn read_lines(
    r: &mut impl Read,
    hasher: &mut crc32fast::Hasher,
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
                hasher.update(piece);
            }
            p += run;
            continue;
        }
        let kept = &mut scratch[..masks[p].count_ones() as usize * LINE];
        r.read_exact(kept)?;
        hasher.update(kept);
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

    /// `count` pages of which page 1 is all zero and the others hold a few non-zero bytes
    /// (page 0 in its first and last lines, page 2 in one middle line).
    fn sparse_pages(count: usize) -> Vec<u8> {
        let mut pages = vec![0u8; count * PAGE];
        for p in (0..count).filter(|p| p % 3 != 1) {
            let page = &mut pages[p * PAGE..(p + 1) * PAGE];
            if p % 3 == 0 {
                page[0] = 1 + p as u8;
                page[PAGE - 1] = 2;
            } else {
                page[33 * LINE + 5] = 9;
            }
        }
        pages
    }

    fn samples() -> Vec<Frame> {
        vec![
            Frame::Hello {
                config_json: b"{}".to_vec(),
            },
            Frame::Pages {
                gpa: 0x4000_0000,
                pages: vec![7u8; 2 * PAGE],
                fresh: false,
            },
            Frame::Pages {
                gpa: 0x8000,
                pages: sparse_pages(3),
                fresh: true,
            },
            Frame::Zero {
                gpa: 0x1000,
                count: 3,
            },
            Frame::State {
                state_json: b"{\"vcpus\":[]}".to_vec(),
            },
            Frame::Request {
                gpa: 0x2000,
                len: 0x1000,
            },
            Frame::EndOfRound {
                round: 4,
                last: true,
            },
            Frame::Complete {
                report_json: b"{}".to_vec(),
            },
            Frame::Abort {
                reason: "source stopped".into(),
            },
            Frame::Ready,
            Frame::Go,
            Frame::Running,
            // One page whole, one as a delta (word 3 changed), one unchanged.
            Frame::Delta {
                gpa: 0x5000,
                count: 3,
                body: [
                    &(PAGE as u16).to_le_bytes()[..],
                    &10u16.to_le_bytes(),
                    &0u16.to_le_bytes(),
                    &[6u8; PAGE],
                    &[3, 1],
                    &[9u8; 8],
                ]
                .concat(),
            },
        ]
    }

    #[test]
    fn every_frame_round_trips() {
        let mut bytes = Vec::new();
        for f in samples() {
            f.write_to(&mut bytes).unwrap();
        }
        let mut r = &bytes[..];
        for f in samples() {
            assert_eq!(Frame::read_from(&mut r).unwrap(), f);
        }
        assert!(matches!(Frame::read_from(&mut r), Err(StreamError::Closed)));
    }

    /// `read_into` and `encode_pages_with` reuse their buffers across frames of different
    /// sizes and kinds, and read the same frames as `read_from`; a damaged frame read into a
    /// reused buffer is still an error.
    #[test]
    fn reused_buffers_give_the_same_frames() {
        let mut bytes = Vec::new();
        let mut out = Vec::new();
        for (i, pages) in [3, 1, 2].into_iter().enumerate() {
            Frame::encode_pages_with(
                &mut out,
                0x1000 * i as u64,
                pages * PAGE,
                false,
                false,
                |_, buf| {
                    buf.fill(i as u8 + 1);
                    Ok(())
                },
            )
            .unwrap();
            bytes.extend_from_slice(&out);
        }
        for f in samples() {
            f.write_to(&mut bytes).unwrap();
        }
        let mut r = &bytes[..];
        let mut buf = Vec::new();
        for (i, pages) in [3, 1, 2].into_iter().enumerate() {
            match Frame::read_into(&mut r, &mut buf, |_, _, _| None).unwrap() {
                FrameRef::Pages { gpa, pages: p, .. } => {
                    assert_eq!(gpa, 0x1000 * i as u64);
                    assert_eq!(p, vec![i as u8 + 1; pages * PAGE]);
                }
                other => panic!("expected Pages, got {other:?}"),
            }
        }
        for f in samples() {
            let got = match Frame::read_into(&mut r, &mut buf, |_, _, _| None).unwrap() {
                FrameRef::Pages { gpa, pages, fresh } => Frame::Pages {
                    gpa,
                    pages: pages.to_vec(),
                    fresh,
                },
                FrameRef::Frame(f) => f,
                placed => panic!("nothing was placed, got {placed:?}"),
            };
            assert_eq!(got, f);
        }
        assert!(matches!(
            Frame::read_into(&mut r, &mut buf, |_, _, _| None),
            Err(StreamError::Closed)
        ));
        let mut bad = out.clone();
        bad[HEADER + 100] ^= 1;
        assert!(matches!(
            Frame::read_into(&mut &bad[..], &mut buf, |_, _, _| None),
            Err(StreamError::Checksum { .. })
        ));
    }

    /// Pages that `place` takes land in its slice, whole and checked; declined ones come back
    /// in the buffer; a damaged placed frame is still an error.
    #[test]
    fn placed_pages_are_read_where_they_belong() {
        let mut bytes = Vec::new();
        let mut out = Vec::new();
        for (gpa, fill) in [(0x3000u64, 7u8), (0x9000, 9)] {
            Frame::encode_pages_with(&mut out, gpa, 2 * PAGE, false, false, |_, buf| {
                buf.fill(fill);
                Ok(())
            })
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

    #[test]
    fn damaged_frames_are_errors() {
        let good = Frame::Pages {
            gpa: 0x1000,
            pages: vec![1u8; PAGE],
            fresh: false,
        }
        .encode()
        .unwrap();
        // Any single flipped bit is caught (by the magic, the header checks or the CRC).
        for bit in (0..good.len() * 8).step_by(97) {
            let mut bad = good.clone();
            bad[bit / 8] ^= 1 << (bit % 8);
            assert!(Frame::read_from(&mut &bad[..]).is_err(), "bit {bit}");
        }
        // Every truncation is an error, not a short frame.
        for len in 1..good.len() {
            assert!(Frame::read_from(&mut &good[..len]).is_err(), "length {len}");
        }
        let mut wrong_version = good.clone();
        wrong_version[3] = b'9';
        let e = Frame::read_from(&mut &wrong_version[..]).unwrap_err();
        assert!(
            e.to_string()
                .contains("not a guestmem migration stream of this version"),
            "{e}"
        );
    }

    #[test]
    fn oversized_and_ill_shaped_frames_are_refused() {
        // A header announcing 4 GiB is refused before anything is allocated.
        let mut huge = MAGIC.to_vec();
        huge.extend_from_slice(&[kind::PAGES, 0, 0, 0]);
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        let e = Frame::read_from(&mut &huge[..]).unwrap_err();
        assert!(e.to_string().contains("exceeds"), "{e}");
        // Well-checksummed frames of the wrong shape.
        let pages_payload = |gpa: u64, count: u32, flags: u32, masks: &[u64], lines: usize| {
            let mut p = [
                &gpa.to_le_bytes()[..],
                &count.to_le_bytes(),
                &flags.to_le_bytes(),
            ]
            .concat();
            masks
                .iter()
                .for_each(|m| p.extend_from_slice(&m.to_le_bytes()));
            p.resize(p.len() + lines, 3);
            p
        };
        let forge = |kind: u8, payload: &[u8]| {
            let mut f = MAGIC.to_vec();
            f.extend_from_slice(&[kind, 0, 0, 0]);
            f.extend_from_slice(&(payload.len() as u32).to_le_bytes());
            f.extend_from_slice(payload);
            let crc = crc32fast::hash(&f);
            f.extend_from_slice(&crc.to_le_bytes());
            f
        };
        for (kind, payload) in [
            (kind::PAGES, vec![0u8; 8 + 100]),
            (kind::PAGES, pages_payload(0x1001, 1, 0, &[u64::MAX], PAGE)),
            (kind::PAGES, pages_payload(0x1000, 0, 0, &[], 0)),
            (kind::PAGES, pages_payload(0x1000, 1, 2, &[u64::MAX], PAGE)),
            (
                kind::PAGES,
                pages_payload(0, 513, 0, &[u64::MAX; 513], 513 * PAGE),
            ),
            // Masks announcing more (or fewer) lines than the frame carries.
            (kind::PAGES, pages_payload(0x1000, 1, 0, &[0b11], LINE)),
            (kind::PAGES, pages_payload(0x1000, 1, 0, &[0b1], 2 * LINE)),
            (kind::PAGES, pages_payload(0x1000, 2, 0, &[u64::MAX], PAGE)),
            (kind::ZERO, vec![0u8; 15]),
            (
                kind::ZERO,
                [0u64.to_le_bytes(), 0u64.to_le_bytes()].concat(),
            ),
            (kind::REQUEST, vec![]),
            (
                kind::REQUEST,
                [
                    &0x1000u64.to_le_bytes()[..],
                    &(MAX_REQUEST + 4096).to_le_bytes(),
                ]
                .concat(),
            ),
            (kind::GO, vec![0]),
            (kind::END_OF_ROUND, vec![1]),
            (kind::READY, vec![1]),
            (99, vec![]),
        ] {
            let e = Frame::read_from(&mut &forge(kind, &payload)[..]).unwrap_err();
            assert!(matches!(e, StreamError::Malformed(_)), "kind {kind}: {e}");
        }
        assert!(Frame::Pages {
            gpa: 0,
            pages: vec![0; 100],
            fresh: false,
        }
        .encode()
        .is_err());
        let mut out = Vec::new();
        Frame::encode_pages_with(&mut out, 0x3000, 2 * PAGE, false, false, |_, b| {
            b.fill(5);
            Ok(())
        })
        .unwrap();
        assert_eq!(
            out,
            Frame::Pages {
                gpa: 0x3000,
                pages: vec![5u8; 2 * PAGE],
                fresh: false,
            }
            .encode()
            .unwrap()
        );
        for len in [100, 513 * PAGE] {
            assert!(
                Frame::encode_pages_with(&mut out, 0, len, false, false, |_, _| Ok(())).is_err()
            );
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
                whole,
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

    /// Random bytes never panic the decoder (the fuzz target in fuzz/ does this at scale).
    /// Text-like pages (every line non-zero, compressible) and a zero page: what compression
    /// is for.
    fn dense_pages(count: usize) -> Vec<u8> {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut pages = vec![0u8; count * PAGE];
        for (p, page) in pages.chunks_mut(PAGE).enumerate() {
            if p % 5 == 4 {
                continue;
            }
            const WORDS: [&[u8]; 8] = [
                b"guest ", b"memory ", b"page ", b"kvm ", b"dirty ", b"log\n", b"0x7f3a ", b"ok ",
            ];
            let mut at = 0;
            while at < PAGE {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let word = WORDS[(x % 8) as usize];
                let n = word.len().min(PAGE - at);
                page[at..at + n].copy_from_slice(&word[..n]);
                at += n;
            }
        }
        pages
    }

    fn compressed_frame(codec: Codec, pages: &[u8], gpa: u64) -> (Vec<u8>, usize) {
        let mut out = Vec::new();
        Frame::encode_pages_with(&mut out, gpa, pages.len(), false, false, |at, piece| {
            piece.copy_from_slice(&pages[at..at + piece.len()]);
            Ok(())
        })
        .unwrap();
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
        Frame::encode_pages_with(&mut plain, 0x20_0000, new.len(), false, false, |at, p| {
            p.copy_from_slice(&new[at..at + p.len()]);
            Ok(())
        })
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

    fn pages_frame(pages: &[u8], gpa: u64) -> Vec<u8> {
        let mut out = Vec::new();
        Frame::encode_pages_with(&mut out, gpa, pages.len(), false, false, |at, piece| {
            piece.copy_from_slice(&pages[at..at + piece.len()]);
            Ok(())
        })
        .unwrap();
        out
    }

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

    #[test]
    fn random_bytes_never_panic() {
        let mut x = 0x1234_5678_9abc_def0u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..2000 {
            let len = (next() % 64) as usize;
            let mut bytes: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            if next() % 2 == 0 && bytes.len() >= 4 {
                bytes[..4].copy_from_slice(&MAGIC);
            }
            let _ = Frame::read_from(&mut &bytes[..]);
        }
    }
}
