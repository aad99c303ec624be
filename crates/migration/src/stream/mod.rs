//! The migration stream: frames that carry a VM from one guestmem to another.
//!
//! Every frame is `header | payload | crc32`:
//! - header (12 bytes, little-endian): magic `b"GMf3"`, kind (u8), flags (u8), two reserved
//!   zero bytes, payload length (u32, at most [`MAX_PAYLOAD`] for a PagesZ frame, 2 MiB of
//!   pages with their masks and header for the others);
//! - payload: as the kind says (below);
//! - CRC-32 (u32) of header and payload together, or zero with flag [`NO_CRC`].
//!
//! Flag [`NO_CRC`], on Pages and PagesZ frames only: the frame carries no CRC (the field is
//! zero and not checked), because the channel it crosses authenticates every byte itself. A
//! migration's channel is TLS 1.3, whose AEAD tag already checks each record: a CRC-32 over the
//! same bytes would be a second pass over every page at both ends for nothing. Frames kept
//! anywhere else (tests, a file) keep their CRC; so do the other kinds, which are small.
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
//! announced length (never more) and decodes the inner frame as any Pages frame. Codecs 1 and
//! 2 compress each frame on its own, and a sender uses them only when that makes the frame
//! smaller ([`compress_pages`]); such a frame decodes from its compressed bytes alone, which
//! the outer CRC covers, so a receiver landing it ([`Frame::read_into_landing`]) does not
//! check the inner CRC again (a second pass over every decompressed page). The inner CRC is
//! checked wherever the inner frame is read as any other ([`Frame::read_into`]) and for codec
//! 3, whose bytes also depend on the stream's history.
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
//!
//! The modules: [`frame`](Frame) (the frames, their header and checksum), `pages_frame`
//! (Pages frames: zero lines squeezed out, pages read where they belong),
//! `codec` (PagesZ frames compressed one by one: [`Codec`], [`compress_pages`]),
//! `zstd_stream` (a connection's zstd stream: [`ZstdStream`], [`ZstdStreamDecoder`]) and
//! `delta_frame` (PagesD frames).

mod codec;
mod delta_frame;
mod frame;
mod pages_frame;
mod zstd_stream;

use std::io;

pub use codec::{compress_pages, Codec};
pub use frame::{Frame, FrameRef, Lend};
pub use pages_frame::{Encoding, Land};
pub(crate) use zstd_stream::free_aside;
pub use zstd_stream::{
    check_window_log, compress_pages_stream, ZstdStream, ZstdStreamDecoder, ZSTD_WINDOW_LOG_MAX,
    ZSTD_WINDOW_LOG_MIN,
};

/// The stream's magic and version: a peer speaking another version is refused by its first frame.
pub const MAGIC: [u8; 4] = *b"GMf3";
/// The most pages one Pages frame carries (2 MiB).
pub const MAX_FRAME_PAGES: usize = 512;
/// The largest payload a frame may carry: 2 MiB of pages with their masks and header, plus
/// `Z_SLACK` (what a zstd stream frame may add to pages that do not compress).
#[allow(clippy::cast_possible_truncation)] // A few MiB.
pub const MAX_PAYLOAD: u32 = (MAX_PAGES_PAYLOAD + Z_SLACK) as u32;
/// The largest Pages (or PagesD) payload: 2 MiB of pages with their masks and header.
const MAX_PAGES_PAYLOAD: usize = PAGES_HEADER + MAX_FRAME_PAGES * (8 + PAGE);
/// How much larger than the frame it holds a PagesZ frame of the zstd stream codec may be: such
/// a frame goes compressed even when its pages do not compress (the receiver's history must see
/// it), and zstd then stores them raw, 3 bytes of block header per 128 KiB and the stream's own
/// header once (about 70 bytes for 2 MiB).
const Z_SLACK: usize = 4096;
const HEADER: usize = 12;
/// A PagesZ payload's own header: codec, reserved, inner length.
const Z_HEADER: usize = 8;
/// A Pages payload's own header: gpa, count, flags.
const PAGES_HEADER: usize = 16;
/// Pages flag: the receiver's memory at these pages holds zeros; zero lines need no writing.
pub const FRESH: u32 = 1;
/// Frame header flag (byte 5): no CRC, the channel authenticates the bytes (see the module's
/// docs). Only on Pages and PagesZ frames.
pub const NO_CRC: u8 = 1;
/// The unit of zero elision inside a page: one cache line.
const LINE: usize = 64;
const LINES: usize = PAGE / LINE;
/// Pages are checksummed in pieces of this many bytes as they are copied (on both sides), so
/// that each piece is still in the cache when its CRC is taken.
pub const CRC_PIECE: usize = 64 << 10;

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

/// Whether a frame with this header carries a CRC ([`NO_CRC`]).
fn has_crc(header: &[u8; HEADER]) -> bool {
    header[5] & NO_CRC == 0
}

/// The CRC field of a frame flagged [`NO_CRC`]: zero, or the frame is malformed.
fn no_crc_field(found: u32) -> Result<(), StreamError> {
    if found == 0 {
        Ok(())
    } else {
        Err(StreamError::Malformed(format!(
            "a frame flagged without CRC has {found:#010x} in its CRC field"
        )))
    }
}

fn check_crc(found: u32, computed: u32) -> Result<(), StreamError> {
    if found == computed {
        Ok(())
    } else {
        Err(StreamError::Checksum { found, computed })
    }
}

#[cfg(test)]
mod test_pages {
    use super::{Encoding, Frame, PAGE};

    /// A Pages frame of `pages` at `gpa`, encoded with its CRC, as frames kept outside a
    /// migration's channel are.
    pub(super) fn pages_frame(pages: &[u8], gpa: u64) -> Vec<u8> {
        let mut out = Vec::new();
        Frame::encode_pages_with(
            &mut out,
            gpa,
            pages.len(),
            false,
            Encoding::default(),
            |at, piece| {
                piece.copy_from_slice(&pages[at..at + piece.len()]);
                Ok(())
            },
        )
        .unwrap();
        out
    }

    /// Text-like pages (every line non-zero, compressible) and a zero page: what compression
    /// is for.
    pub(super) fn dense_pages(count: usize) -> Vec<u8> {
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
}
