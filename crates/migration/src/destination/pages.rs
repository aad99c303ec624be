//! Pre-copy's pages landing: each pages connection's frames applied to guest memory by a
//! reader thread of its own, up to its last EndOfRound, with the chunk digests kept as they
//! land.

use guestmem_sys::to_usize;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use guestmem_memory::{GuestMemory, PageBuf, PAGE_SIZE};

use super::progress::{RoundCounters, RxProgress};
use super::*;
use crate::chunk_digests::ChunkDigests;
use crate::landing::{outside_memory, Landing};
use crate::protocol::{block_connection, write_frame, BLOCK};
use crate::stream::{Frame, FrameRef, ZstdStreamDecoder};
use crate::transport::{Connection, Cutter};
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
    counters: (&RoundCounters, usize),
) -> (Connection, Result<ReaderStats>) {
    // The connection's zstd stream, as the source announced it: every frame of the stream
    // codec on this connection goes through it, in order.
    let zstream = match zstd_window_log.map(ZstdStreamDecoder::new).transpose() {
        Ok(z) => z,
        Err(e) => return (conn, Err(Error::Stream(e))),
    };
    let mut applier = Applier {
        memory,
        counters: counters.0,
        placed: &counters.0.readers[counters.1].0,
        landing,
        digests,
        corrupt,
        zstream,
        zeros: PageBuf::zeroed(to_usize(BLOCK)),
        // Where a landing is armed, the pages of a frame with zero lines are spread here
        // (whole) and landed from here; whole pages land straight from the frame.
        scratch: PageBuf::zeroed(if landing.is_some() {
            to_usize(BLOCK)
        } else {
            0
        }),
        buf: Vec::new(),
        stats: ReaderStats {
            pages: 0,
            zero_pages: 0,
            last_round: 0,
            last_round_hashing: Duration::ZERO,
            zstd_stream_bytes: 0,
            zstream: None,
        },
        open: None,
        hashing: Duration::ZERO,
    };
    let result = applier.run(&mut conn);
    (conn, result.map(|()| applier.stats))
}

/// One pages connection's reader, between frames (see [`apply_pages`]).
struct Applier<'m> {
    memory: &'m GuestMemory,
    /// The progress records' counters: the round, and this reader's page bytes placed.
    counters: &'m RoundCounters,
    placed: &'m AtomicU64,
    landing: Option<&'m Landing>,
    digests: Option<&'m ReaderDigests>,
    corrupt: Option<u64>,
    zstream: Option<ZstdStreamDecoder>,
    /// A block of zeros, for Zero frames written in place.
    zeros: PageBuf,
    /// See [`Frame::read_into_landing`].
    scratch: PageBuf,
    /// The frames other than pages are read into it (pages are read from the connection
    /// straight into guest memory, or landed).
    buf: Vec<u8>,
    stats: ReaderStats,
    /// The block the frames are landing in.
    open: Option<(u64, u64)>,
    /// The hashing time of the round so far.
    hashing: Duration,
}

impl Applier<'_> {
    /// Applies frames up to the last EndOfRound.
    fn run(&mut self, conn: &mut Connection) -> Result<()> {
        loop {
            let Some(frame) = self.read(conn)? else {
                continue;
            };
            match frame {
                Frame::Zero { gpa, count } => self.zero(gpa, count)?,
                Frame::EndOfRound { round, last } => {
                    if self.end_round(conn, round, last)? {
                        return Ok(());
                    }
                }
                other => return Err(refused_by_source(&other, "pages")),
            }
        }
    }

    /// Reads the next frame: pages (and deltas) land in guest memory here, and `None` says
    /// so; any other frame is handed back.
    fn read(&mut self, conn: &mut Connection) -> Result<Option<Frame>> {
        let memory = self.memory;
        let place = |gpa: u64, len: u64| {
            // SAFETY: the VM does not run before the rounds end, and each 2 MiB block travels
            // on one connection only (a frame never crosses a block), so no other thread
            // touches these bytes while they are read (or patched by a delta); a damaged
            // frame fails the migration, and this memory is thrown away with the VM.
            unsafe { memory.bytes_mut(gpa, len) }.ok()
        };
        // Why a landing failed, when it did (the stream only sees that it did).
        let mut failed: Option<Error> = None;
        let read = match self.landing {
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
                    conn,
                    &mut self.buf,
                    self.zstream.as_mut(),
                    (&mut self.scratch[..], &mut land),
                    |gpa, len, _| place(gpa, len as u64),
                )
            }
            None => Frame::read_into_stream(
                conn,
                &mut self.buf,
                self.zstream.as_mut(),
                |gpa, len, _| place(gpa, len as u64),
            ),
        };
        if let Some(e) = failed {
            return Err(e);
        }
        match read {
            Ok(FrameRef::Placed { gpa, len, .. } | FrameRef::Patched { gpa, len }) => {
                self.placed(gpa, len as u64)?;
                Ok(None)
            }
            // `place` declined them: they are not inside this VM's memory.
            Ok(FrameRef::Pages { gpa, pages, .. }) => Err(MigrationError::Unsupported {
                reason: format!(
                    "the source sent {} bytes of pages at {gpa:#x}, outside this VM's memory",
                    pages.len()
                ),
            }
            .into()),
            Ok(FrameRef::Frame(f)) => Ok(Some(f)),
            Err(e) => Err(Error::Stream(e)),
        }
    }

    /// `len` bytes of pages at `gpa` are in guest memory: counted, corrupted if the test hook
    /// asks, their chunks marked.
    fn placed(&mut self, gpa: u64, len: u64) -> Result<()> {
        self.stats.pages += len / PAGE_SIZE;
        self.placed.fetch_add(len, Ordering::Relaxed);
        if let Some(at) = self.corrupt.filter(|&at| at >= gpa && at - gpa < len) {
            let flipped = self.memory.read_u64(at).map(|w| w ^ 1);
            flipped.and_then(|w| self.memory.write_u64(at, w))?;
        }
        self.landed(gpa, len)
    }

    /// A Zero frame: `count` pages of zeros at `gpa`, a block at a time.
    fn zero(&mut self, gpa: u64, count: u64) -> Result<()> {
        self.stats.zero_pages += count;
        let mut done = 0;
        while done < count * PAGE_SIZE {
            let n = (count * PAGE_SIZE - done).min(BLOCK);
            match self.landing {
                Some(l) => l.zero(self.memory, gpa + done, n),
                None => self
                    .memory
                    .write(gpa + done, &self.zeros[..n as usize])
                    .map_err(outside_memory),
            }?;
            done += n;
        }
        self.landed(gpa, count * PAGE_SIZE)
    }

    /// With digests, marks the chunks of `len` bytes at `gpa` stale, and hashes those of the
    /// block the frames were landing in, once they moved past it.
    fn landed(&mut self, gpa: u64, len: u64) -> Result<()> {
        let Some(d) = self.digests else {
            return Ok(());
        };
        d.chunks.mark(gpa, len);
        let block = block_of(self.memory, gpa);
        let t = Instant::now();
        if block != self.open {
            if let Some((start, len)) = self.open {
                d.chunks.refresh(self.memory, start, len)?;
            }
            self.open = block;
        }
        self.hashing += t.elapsed();
        Ok(())
    }

    /// An EndOfRound: everything before it is in guest memory. Says so (unless it is the
    /// last), so that the source times its rounds (and pauses the guest) on what is applied,
    /// not what is buffered; then hashes what is stale, while the next round comes. True after
    /// the last round.
    fn end_round(&mut self, conn: &mut Connection, round: u32, last: bool) -> Result<bool> {
        self.stats.last_round = round;
        self.counters.round.fetch_max(round, Ordering::Relaxed);
        if last {
            self.counters.stopped.store(true, Ordering::Relaxed);
        }
        if !last {
            write_frame(conn, &Frame::EndOfRound { round, last })?;
        }
        self.hash_round(round)?;
        if last {
            self.stats.last_round_hashing = self.hashing;
            self.stats.zstd_stream_bytes =
                self.zstream.as_ref().map_or(0, |z| z.memory_bytes() as u64);
            self.stats.zstream = self.zstream.take();
            return Ok(true);
        }
        self.hashing = Duration::ZERO;
        Ok(false)
    }

    /// With digests, after a round: hashes the open block's chunks and every stale chunk of
    /// this reader's blocks.
    fn hash_round(&mut self, round: u32) -> Result<()> {
        let Some(d) = self.digests else {
            return Ok(());
        };
        let t = Instant::now();
        let swept = self
            .open
            .take()
            .map_or(Ok(0), |(start, len)| {
                d.chunks.refresh(self.memory, start, len)
            })
            .and_then(|a| d.sweep(self.memory).map(|b| a + b));
        let took = t.elapsed();
        self.hashing += took;
        let bytes = swept?;
        tracing::debug!(
            round,
            reader = d.reader,
            in_round_ms = (self.hashing - took).as_secs_f64() * 1e3,
            after_mib = bytes >> 20,
            after_ms = took.as_secs_f64() * 1e3,
            "chunk digests hashed"
        );
        Ok(())
    }
}

/// What the rounds left, over all pages connections.
pub(super) struct Rounds {
    /// The connections' zstd stream decoders, to be freed once the guest runs.
    pub(super) streams: Vec<ZstdStreamDecoder>,
    /// Each connection's last round.
    pub(super) last_rounds: Vec<u32>,
    /// The longest a reader spent hashing chunks in and after the last round.
    pub(super) last_round_hashing: Duration,
}

/// What a reader thread is handed: its place among the pages connections and what it lands
/// pages with.
struct Reader {
    index: usize,
    memory: Arc<GuestMemory>,
    landing: Option<Arc<Landing>>,
    digests: Option<ReaderDigests>,
    corrupt: Option<u64>,
    zstd_window_log: Option<u32>,
    counters: Arc<RoundCounters>,
}

impl Reader {
    /// Applies `conn`'s pages on a thread of its own ([`apply_pages`]). A reader that fails
    /// records itself in `first_failed` (if it is the first) and ends the others' reads at
    /// once (their connections may be cut silently): the migration fails now, not after an
    /// idle timeout.
    fn spawn(
        self,
        conn: Connection,
        cutters: Arc<Vec<Cutter>>,
        first_failed: Arc<AtomicUsize>,
    ) -> std::thread::JoinHandle<(Connection, Result<ReaderStats>)> {
        std::thread::Builder::new()
            .name(format!("migrate-rx{}", self.index))
            .spawn(move || {
                let (conn, result) = apply_pages(
                    conn,
                    &self.memory,
                    self.landing.as_deref(),
                    self.digests.as_ref(),
                    self.corrupt,
                    self.zstd_window_log,
                    (&self.counters, self.index),
                );
                if result.is_err() {
                    let _ = first_failed.compare_exchange(
                        usize::MAX,
                        self.index,
                        Ordering::SeqCst,
                        Ordering::SeqCst,
                    );
                    cutters.iter().for_each(Cutter::cut_reads);
                }
                (conn, result)
            })
            .expect("spawning a reader thread")
    }
}

impl Receiving {
    /// The rounds: each pages connection is applied by its own thread, up to its last
    /// EndOfRound; then the landing is disarmed. The first reader to fail gives the
    /// migration's error (the others' follow from it), told to the source.
    pub(super) fn receive_rounds(
        &mut self,
        memory: &Arc<GuestMemory>,
        chunks: Option<&Arc<ChunkDigests>>,
        landing: Option<Arc<Landing>>,
        (opts, progress): (&ReceiveOptions, Option<&RxProgress>),
        report: &mut DestinationReport,
    ) -> Result<Rounds> {
        let cutters = Arc::new(self.links.cutters()?);
        let first_failed = Arc::new(AtomicUsize::new(usize::MAX));
        let connections = self.links.pages.len();
        let counters = Arc::new(RoundCounters::new(connections));
        let ticker = progress.map(|p| p.rounds_ticker(&counters));
        let zstd_window_log = self.setup.zstd_window_log;
        let readers: Vec<_> = std::mem::take(&mut self.links.pages)
            .into_iter()
            .enumerate()
            .map(|(i, conn)| {
                let reader = Reader {
                    index: i,
                    memory: memory.clone(),
                    landing: landing.clone(),
                    digests: chunks.cloned().map(|chunks| ReaderDigests {
                        chunks,
                        reader: i,
                        connections,
                    }),
                    corrupt: opts.corrupt_landing_at,
                    zstd_window_log,
                    counters: counters.clone(),
                };
                reader.spawn(conn, cutters.clone(), first_failed.clone())
            })
            .collect();
        let mut rounds = Rounds {
            streams: Vec::new(),
            last_rounds: Vec::new(),
            last_round_hashing: Duration::ZERO,
        };
        let mut failures = Vec::new();
        for (i, r) in readers.into_iter().enumerate() {
            let (conn, result) = r.join().expect("a reader thread panicked");
            self.links.pages.push(conn);
            match result {
                Ok(stats) => rounds.add(stats, report),
                Err(e) => failures.push((i, e)),
            }
        }
        drop(ticker);
        let first = first_failed.load(Ordering::SeqCst);
        let failure = match failures.iter().position(|(i, _)| *i == first) {
            Some(at) => Some(failures.swap_remove(at).1),
            None => failures.into_iter().next().map(|(_, e)| e),
        };
        if let Some(e) = failure {
            return Err(self.refuse(MigrationError::Receiving {
                source: Box::new(e),
            }));
        }
        self.disarm(landing)?;
        Ok(rounds)
    }

    /// Every reader is done with it: the memory goes back to behaving as unregistered.
    fn disarm(&mut self, landing: Option<Arc<Landing>>) -> Result<()> {
        let Some(landing) = landing.and_then(Arc::into_inner) else {
            return Ok(());
        };
        let t = Instant::now();
        match landing.disarm() {
            Ok(stats) => {
                tracing::debug!(
                    ?stats,
                    disarm_ms = t.elapsed().as_secs_f64() * 1e3,
                    "pages landed"
                );
                Ok(())
            }
            Err(e) => Err(self.refuse(MigrationError::Receiving {
                source: Box::new(e),
            })),
        }
    }
}

impl Rounds {
    /// A reader's stats, added to the rounds' and the report's.
    fn add(&mut self, mut stats: ReaderStats, report: &mut DestinationReport) {
        self.streams.extend(stats.zstream.take());
        report.pages_received += stats.pages;
        report.zero_pages_received += stats.zero_pages;
        self.last_rounds.push(stats.last_round);
        self.last_round_hashing = self.last_round_hashing.max(stats.last_round_hashing);
        report.zstd_stream_bytes += stats.zstd_stream_bytes;
    }
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
