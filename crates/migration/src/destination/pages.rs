//! Pre-copy's pages landing: each pages connection's frames applied to guest memory by a
//! reader thread of its own, up to its last EndOfRound, with the chunk digests kept as they
//! land.

use std::sync::Arc;
use std::time::{Duration, Instant};

use guestmem_memory::{GuestMemory, PageBuf, PAGE_SIZE};

use super::*;
use crate::chunk_digests::ChunkDigests;
use crate::landing::{outside_memory, Landing};
use crate::protocol::{block_connection, write_frame, BLOCK};
use crate::stream::{Frame, FrameRef, ZstdStreamDecoder};
use crate::transport::Connection;
use crate::{Error, MigrationError, Result};

pub(super) struct ReaderStats {
    pub(super) pages: u64,
    pub(super) zero_pages: u64,
    pub(super) last_round: u32,
    /// Time spent hashing chunks during the last round and after it.
    pub(super) last_round_hashing: Duration,
    /// What its zstd stream's decoder held at the end (window and buffers).
    pub(super) zstd_stream_bytes: u64,
    /// The decoder, handed back to be freed once the guest runs (see [`Transfer::resume`]).
    pub(super) zstream: Option<ZstdStreamDecoder>,
}

/// A reader's part of the chunk digests: the chunks of the blocks its connection carries.
pub(super) struct ReaderDigests {
    pub(super) chunks: Arc<ChunkDigests>,
    pub(super) reader: usize,
    pub(super) connections: usize,
}

impl ReaderDigests {
    /// Hashes the stale chunks this reader owns.
    fn sweep(&self, memory: &GuestMemory) -> Result<u64> {
        self.chunks.refresh_where(memory, |region, offset| {
            block_connection(region, offset, self.connections) == self.reader
        })
    }
}

/// The 2 MiB block (counted from its region's start, as the source sends them) holding `gpa`.
fn block_of(memory: &GuestMemory, gpa: u64) -> Option<(u64, u64)> {
    let r = memory
        .regions()
        .iter()
        .find(|r| gpa >= r.gpa() && gpa - r.gpa() < r.size())?;
    let start = r.gpa() + (gpa - r.gpa()) / BLOCK * BLOCK;
    Some((start, BLOCK.min(r.gpa() + r.size() - start)))
}

/// Applies one pages connection's frames to guest memory up to its last EndOfRound, Pages
/// frames through `landing` where one is armed (see [`crate::landing`]). With
/// `digests`, it marks the chunks each frame writes stale, and hashes them once the source has
/// moved past their block (a block's frames of one round come together on one connection),
/// and after each round every stale chunk of its blocks (in the first round, those no page was
/// sent to). `corrupt`: see [`ReceiveOptions::corrupt_landing_at`].
pub(super) fn apply_pages(
    mut conn: Connection,
    memory: &GuestMemory,
    landing: Option<&Landing>,
    digests: Option<&ReaderDigests>,
    corrupt: Option<u64>,
    zstd_window_log: Option<u32>,
) -> (Connection, Result<ReaderStats>) {
    // The connection's zstd stream, as the source announced it: every frame of the stream
    // codec on this connection goes through it, in order.
    let mut zstream = match zstd_window_log.map(ZstdStreamDecoder::new).transpose() {
        Ok(z) => z,
        Err(e) => return (conn, Err(Error::Stream(e))),
    };
    let zeros = PageBuf::zeroed(BLOCK as usize);
    // Where a landing is armed, the pages of a frame with zero lines are spread here (whole)
    // and landed from here; whole pages land straight from the frame.
    let mut scratch = PageBuf::zeroed(if landing.is_some() { BLOCK as usize } else { 0 });
    let mut stats = ReaderStats {
        pages: 0,
        zero_pages: 0,
        last_round: 0,
        last_round_hashing: Duration::ZERO,
        zstd_stream_bytes: 0,
        zstream: None,
    };
    // The block the frames are landing in, and the hashing time of the round so far.
    let mut open: Option<(u64, u64)> = None;
    let mut hashing = Duration::ZERO;
    let landed = |gpa: u64, len: u64, open: &mut Option<(u64, u64)>| -> Result<Duration> {
        let Some(d) = digests else {
            return Ok(Duration::ZERO);
        };
        d.chunks.mark(gpa, len);
        let block = block_of(memory, gpa);
        let t = Instant::now();
        if block != *open {
            if let Some((start, len)) = *open {
                d.chunks.refresh(memory, start, len)?;
            }
            *open = block;
        }
        Ok(t.elapsed())
    };
    // Pages are read from the connection straight into guest memory, or landed; the other
    // frames into one buffer kept for all of them.
    let mut buf = Vec::new();
    let result = loop {
        let place = |gpa: u64, len: u64| {
            // SAFETY: the VM does not run before the rounds end, and each 2 MiB block travels
            // on one connection only (a frame never crosses a block), so no other thread
            // touches these bytes while they are read (or patched by a delta); a damaged
            // frame fails the migration, and this memory is thrown away with the VM.
            unsafe { memory.bytes_mut(gpa, len) }.ok()
        };
        // Why a landing failed, when it did (the stream only sees that it did).
        let mut failed: Option<Error> = None;
        let read = match landing {
            Some(l) => {
                let mut land = |gpa: u64, pages: &[u8]| {
                    let landed = memory
                        .find(gpa, pages.len() as u64)
                        .map_err(outside_memory)
                        .and_then(|_| l.land(memory, gpa, pages));
                    landed.map_err(|e| {
                        failed = Some(e);
                        std::io::Error::other("landing pages failed")
                    })
                };
                Frame::read_into_landing(
                    &mut conn,
                    &mut buf,
                    zstream.as_mut(),
                    (&mut scratch[..], &mut land),
                    |gpa, len, _| place(gpa, len as u64),
                )
            }
            None => {
                Frame::read_into_stream(&mut conn, &mut buf, zstream.as_mut(), |gpa, len, _| {
                    place(gpa, len as u64)
                })
            }
        };
        if let Some(e) = failed {
            break Err(e);
        }
        let frame = match read {
            Ok(FrameRef::Placed { gpa, len, .. } | FrameRef::Patched { gpa, len }) => {
                stats.pages += len as u64 / PAGE_SIZE;
                if let Some(at) = corrupt.filter(|&at| at >= gpa && at - gpa < len as u64) {
                    let flipped = memory.read_u64(at).map(|w| w ^ 1);
                    if let Err(e) = flipped.and_then(|w| memory.write_u64(at, w)) {
                        break Err(e.into());
                    }
                }
                match landed(gpa, len as u64, &mut open) {
                    Ok(t) => hashing += t,
                    Err(e) => break Err(e),
                }
                continue;
            }
            Ok(FrameRef::Pages { gpa, pages, .. }) => {
                // `place` declined them: they are not inside this VM's memory.
                break Err(MigrationError::Unsupported {
                    reason: format!(
                        "the source sent {} bytes of pages at {gpa:#x}, outside this VM's memory",
                        pages.len()
                    ),
                }
                .into());
            }
            Ok(FrameRef::Frame(f)) => f,
            Err(e) => break Err(Error::Stream(e)),
        };
        let applied = match frame {
            Frame::Zero { gpa, count } => {
                stats.zero_pages += count;
                let mut done = 0;
                let mut r = Ok(());
                while done < count * PAGE_SIZE && r.is_ok() {
                    let n = (count * PAGE_SIZE - done).min(BLOCK);
                    r = match landing {
                        Some(l) => l.zero(memory, gpa + done, n),
                        None => memory
                            .write(gpa + done, &zeros[..n as usize])
                            .map_err(outside_memory),
                    };
                    done += n;
                }
                if r.is_ok() {
                    match landed(gpa, count * PAGE_SIZE, &mut open) {
                        Ok(t) => hashing += t,
                        Err(e) => break Err(e),
                    }
                }
                r
            }
            Frame::EndOfRound { round, last } => {
                stats.last_round = round;
                // Everything before it is in guest memory: say so (unless it is the last), so
                // that the source times its rounds (and pauses the guest) on what is applied,
                // not what is buffered; then hash what is stale, while the next round comes.
                if !last {
                    if let Err(e) = write_frame(&mut conn, &Frame::EndOfRound { round, last }) {
                        break Err(e);
                    }
                }
                if let Some(d) = digests {
                    let t = Instant::now();
                    let swept = open
                        .take()
                        .map_or(Ok(0), |(start, len)| d.chunks.refresh(memory, start, len))
                        .and_then(|a| d.sweep(memory).map(|b| a + b));
                    let took = t.elapsed();
                    hashing += took;
                    match swept {
                        Ok(bytes) => tracing::debug!(
                            round,
                            reader = d.reader,
                            in_round_ms = (hashing - took).as_secs_f64() * 1e3,
                            after_mib = bytes >> 20,
                            after_ms = took.as_secs_f64() * 1e3,
                            "chunk digests hashed"
                        ),
                        Err(e) => break Err(e),
                    }
                }
                if last {
                    stats.last_round_hashing = hashing;
                    stats.zstd_stream_bytes =
                        zstream.as_ref().map_or(0, |z| z.memory_bytes() as u64);
                    stats.zstream = zstream.take();
                    break Ok(());
                }
                hashing = Duration::ZERO;
                Ok(())
            }
            other => break Err(refused_by_source(&other, "pages")),
        };
        if let Err(e) = applied {
            break Err(e);
        }
    };
    (conn, result.map(|()| stats))
}

#[cfg(test)]
mod tests {
    use super::*;
    use guestmem_memory::{Backend, RegionSpec};

    /// Blocks are counted from each region's start and end with it: a region of 5 MiB at an
    /// address that is not a multiple of 2 MiB has blocks of 2, 2 and 1 MiB from its start.
    #[test]
    fn blocks_start_at_their_region_and_end_with_it() {
        let gpa = (1 << 30) + (1 << 20);
        let memory =
            GuestMemory::new(&[RegionSpec::new("ram", gpa, 5 << 20, Backend::Anon)], None).unwrap();
        assert_eq!(block_of(&memory, gpa), Some((gpa, BLOCK)));
        assert_eq!(
            block_of(&memory, gpa + BLOCK + 7),
            Some((gpa + BLOCK, BLOCK))
        );
        assert_eq!(
            block_of(&memory, gpa + (5 << 20) - 1),
            Some((gpa + 2 * BLOCK, 1 << 20))
        );
        assert_eq!(block_of(&memory, gpa + (5 << 20)), None);
        assert_eq!(block_of(&memory, gpa - 1), None);
    }
}
