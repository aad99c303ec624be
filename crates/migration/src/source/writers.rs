//! The writer threads: one per pages connection, each encoding and writing its jobs in order.

use guestmem_sys::to_usize;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use guestmem_memory::{GuestMemory, PAGE_SIZE};

use crate::chunk_digests::ChunkDigests;
use crate::compress::Compressor;
use crate::delta::{DeltaCache, Partition};
use crate::protocol::{write_frame, BLOCK};
use crate::stream::{compress_pages, compress_pages_stream, Codec, Frame, StreamError, ZstdStream};
use crate::transport::{Connection, LinkGauge};
use crate::{Error, Result};

use super::thread_failed;

/// What a writer thread sends.
pub(super) enum Job {
    /// Guest pages, read from memory by the writer itself (no copy in between); `fresh`: the
    /// destination's pages there still hold zeros (see [`crate::stream::FRESH`]).
    Pages {
        gpa: u64,
        len: u64,
        fresh: bool,
        delta: DeltaUse,
    },
    Frame(Frame),
    /// Hash the stale chunks of `[gpa, gpa + len)` (a block whose dirty pages were cleared and
    /// queued before), into the writers' [`ChunkDigests`].
    Digest {
        gpa: u64,
        len: u64,
    },
}

/// What a writer does with the delta cache for a Pages job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum DeltaUse {
    /// Nothing.
    Off,
    /// Stores the pages as sent, without looking them up (their first sending).
    Admit,
    /// Sends the pages whose last version is cached as deltas, and stores them all.
    Try,
}

/// Encodes the `len` bytes of pages at `gpa` into `out` through the delta cache: read into
/// `pages`, sent as a PagesD frame if `try_delta` and any of them is cached (else as a Pages
/// frame), and stored in `part` as sent in `round` (unless it is the `last`).
#[allow(clippy::too_many_arguments)]
pub(super) fn encode_cached(
    out: &mut Vec<u8>,
    pages: &mut Vec<u8>,
    memory: &GuestMemory,
    part: &mut Partition,
    gpa: u64,
    len: usize,
    fresh: bool,
    (try_delta, round, last): (bool, u32, bool),
) -> std::result::Result<(), StreamError> {
    if pages.len() < len {
        pages.resize(len, 0);
    }
    let pages = &mut pages[..len];
    memory
        .read(gpa, pages)
        .map_err(|e| StreamError::Malformed(crate::error_chain(&e, ": ")))?;
    let page = to_usize(PAGE_SIZE);
    let at = |p: usize| gpa + (p * page) as u64;
    let cached = try_delta && (0..len / page).any(|p| part.contains(at(p)));
    if cached {
        let (n, delta_bytes) = Frame::encode_delta_with(out, gpa, pages, |p, new, out| {
            part.lookup(at(p))
                .is_some_and(|old| crate::delta::encode(old, new, out, page - 1))
        })?;
        part.sent_deltas(n, delta_bytes);
    } else {
        if try_delta {
            // Counted as misses.
            (0..len / page).for_each(|p| {
                part.lookup(at(p));
            });
        }
        Frame::encode_pages_with(out, gpa, len, fresh, false, |o, piece| {
            piece.copy_from_slice(&pages[o..o + piece.len()]);
            Ok(())
        })?;
    }
    // After the last round nothing is sent again.
    if !last {
        for (p, new) in pages.chunks_exact(page).enumerate() {
            part.store(at(p), new, round);
        }
    }
    Ok(())
}

/// What a writer thread ends with: its connection and zstd stream, how it went, and its time
/// spent hashing chunks.
type WriterEnd = (Connection, Option<ZstdStream>, Result<()>, Duration);

/// What the writers hand back when joined.
pub(super) struct Joined {
    /// The pages connections, in order.
    pub(super) conns: Vec<Connection>,
    /// Their zstd streams (`None`: per-frame compression).
    pub(super) streams: Vec<Option<ZstdStream>>,
    /// Bytes of Pages frames written.
    pub(super) wire_bytes: u64,
    /// The longest time one writer spent hashing chunks.
    pub(super) hashing: Duration,
}

/// One thread per pages connection, each encoding and writing its jobs in order.
pub(super) struct Writers {
    pub(super) queues: Vec<SyncSender<Job>>,
    /// Each ends with its connection and its zstd stream, how it went, and its time spent
    /// hashing chunks.
    threads: Vec<JoinHandle<WriterEnd>>,
    /// Bytes of Pages frames written.
    wire_bytes: Arc<AtomicU64>,
}

impl Writers {
    /// `streams`: each connection's zstd stream (see [`crate::stream::ZstdStream`]), which
    /// compresses its frames in place of per-frame zstd; they come back with the connections.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn spawn(
        conns: Vec<Connection>,
        streams: Vec<Option<ZstdStream>>,
        memory: &Arc<GuestMemory>,
        whole_pages: bool,
        compressor: Arc<Compressor>,
        chunks: Option<Arc<ChunkDigests>>,
        delta: Option<Arc<DeltaCache>>,
        (round, last): (u32, bool),
    ) -> Writers {
        let wire_bytes = Arc::new(AtomicU64::new(0));
        let mut queues = Vec::new();
        let mut threads = Vec::new();
        let streams = streams.into_iter().chain(std::iter::repeat_with(|| None));
        for (i, (conn, stream)) in conns.into_iter().zip(streams).enumerate() {
            // So that the link carries one frame while the writer compresses the next (see
            // `SEND_BUFFER_BYTES`); a connection that refuses keeps its own (the transfer is
            // the same, the overlap smaller).
            if let Err(e) = conn.enlarge_send_buffer() {
                tracing::debug!("pages connection {i}: SO_SNDBUF: {e}");
            }
            let (tx, rx) = sync_channel::<Job>(8);
            let writer = Writer {
                index: i,
                conn,
                stream,
                memory: memory.clone(),
                whole_pages,
                wire_bytes: wire_bytes.clone(),
                compressor: compressor.clone(),
                chunks: chunks.clone(),
                delta: delta.clone(),
                round,
                last,
                out: Vec::new(),
                scratch: Vec::new(),
                pages: Vec::new(),
                hashing: Duration::ZERO,
                gauge: LinkGauge::default(),
            };
            queues.push(tx);
            threads.push(
                std::thread::Builder::new()
                    .name(format!("migrate-tx{i}"))
                    .spawn(move || writer.run(rx))
                    .expect("spawning a writer thread"),
            );
        }
        Writers {
            queues,
            threads,
            wire_bytes,
        }
    }

    pub(super) fn queue(&mut self, conn: usize, job: Job) -> Result<()> {
        self.queues[conn]
            .send(job)
            .map_err(|_| thread_failed(&format!("pages connection {conn} failed")))
    }

    /// Waits for the writers to send everything queued, and takes the connections (and their
    /// zstd streams) back, with the bytes of pages they wrote and the longest time one of them
    /// spent hashing chunks.
    pub(super) fn join(self) -> Result<Joined> {
        drop(self.queues);
        let mut conns = Vec::new();
        let mut streams = Vec::new();
        let mut failure = None;
        let mut hashing = Duration::ZERO;
        for t in self.threads {
            match t.join() {
                Ok((conn, stream, result, hashed)) => {
                    conns.push(conn);
                    streams.push(stream);
                    hashing = hashing.max(hashed);
                    if let Err(e) = result {
                        failure.get_or_insert(e);
                    }
                }
                Err(_) => {
                    failure.get_or_insert(thread_failed("a writer thread panicked"));
                }
            }
        }
        match failure {
            Some(e) => Err(e),
            None => Ok(Joined {
                conns,
                streams,
                wire_bytes: self.wire_bytes.load(Ordering::Relaxed),
                hashing,
            }),
        }
    }
}

/// One writer thread: its pages connection, what it encodes with, and its buffers.
struct Writer {
    /// Its pages connection's index (and its partition of the delta cache).
    index: usize,
    conn: Connection,
    stream: Option<ZstdStream>,
    memory: Arc<GuestMemory>,
    whole_pages: bool,
    /// Bytes of Pages frames written, by all the writers.
    wire_bytes: Arc<AtomicU64>,
    compressor: Arc<Compressor>,
    chunks: Option<Arc<ChunkDigests>>,
    delta: Option<Arc<DeltaCache>>,
    round: u32,
    last: bool,
    /// The frame being encoded.
    out: Vec<u8>,
    /// The compressor's buffer.
    scratch: Vec<u8>,
    /// The pages read for the delta cache.
    pages: Vec<u8>,
    /// Time spent hashing chunks.
    hashing: Duration,
    gauge: LinkGauge,
}

impl Writer {
    /// Sends the jobs of `rx` in order, up to the first that fails.
    fn run(mut self, rx: Receiver<Job>) -> WriterEnd {
        self.out = Vec::with_capacity(to_usize(BLOCK + 64));
        let mut result = Ok(());
        for job in rx {
            let sent = match job {
                Job::Pages {
                    gpa,
                    len,
                    fresh,
                    delta,
                } => self.send_pages(gpa, len, fresh, delta),
                Job::Frame(f) => self.send_frame(&f),
                Job::Digest { gpa, len } => {
                    let t = Instant::now();
                    let hashed = self
                        .chunks
                        .as_ref()
                        .map_or(Ok(0), |c| c.refresh(&self.memory, gpa, len));
                    self.hashing += t.elapsed();
                    hashed.map(|_| ())
                }
            };
            if let Err(e) = sent {
                result = Err(e);
                break;
            }
        }
        (self.conn, self.stream, result, self.hashing)
    }

    /// A Pages job: the pages encoded (through the delta cache, unless `delta` is off),
    /// compressed, and written.
    fn send_pages(&mut self, gpa: u64, len: u64, fresh: bool, delta: DeltaUse) -> Result<()> {
        let (codec, encoded, compress_time) = self
            .encode(gpa, to_usize(len), fresh, delta)
            .and_then(|()| self.compress())
            .map_err(Error::Stream)?;
        self.wire_bytes
            .fetch_add(self.out.len() as u64, Ordering::Relaxed);
        self.gauge.before_write(&self.conn);
        self.conn
            .write_all(&self.out)
            .map_err(|e| Error::Stream(e.into()))?;
        let link = self.gauge.after_write(&self.conn, self.out.len() as u64);
        self.compressor
            .record(codec, encoded, self.out.len(), compress_time, link);
        Ok(())
    }

    /// Encodes the `len` bytes of pages at `gpa` into `out`, read from guest memory.
    fn encode(
        &mut self,
        gpa: u64,
        len: usize,
        fresh: bool,
        delta: DeltaUse,
    ) -> std::result::Result<(), StreamError> {
        match self.delta.as_ref().filter(|_| delta != DeltaUse::Off) {
            Some(cache) => encode_cached(
                &mut self.out,
                &mut self.pages,
                &self.memory,
                &mut cache.part(self.index),
                gpa,
                len,
                fresh,
                (delta == DeltaUse::Try, self.round, self.last),
            ),
            None => {
                let memory = &self.memory;
                Frame::encode_pages_with(
                    &mut self.out,
                    gpa,
                    len,
                    fresh,
                    self.whole_pages,
                    |at, piece| {
                        memory
                            .read(gpa + at as u64, piece)
                            .map_err(|e| StreamError::Malformed(crate::error_chain(&e, ": ")))
                    },
                )
                .map(|_| ())
            }
        }
    }

    /// Compresses the frame in `out` with the codec the compressor chooses (through the
    /// connection's zstd stream, if it has one): the codec, the frame's size before and the
    /// time it took.
    fn compress(&mut self) -> std::result::Result<(Codec, usize, Duration), StreamError> {
        let codec = self.compressor.choose();
        let (encoded, t) = (self.out.len(), Instant::now());
        match (codec, self.stream.as_mut()) {
            (Codec::Zstd(_), Some(s)) => {
                compress_pages_stream(&mut self.out, s, &mut self.scratch)?
            }
            _ => compress_pages(&mut self.out, codec, &mut self.scratch)?,
        };
        Ok((codec, encoded, t.elapsed()))
    }

    /// Any other frame, written as it is.
    fn send_frame(&mut self, f: &Frame) -> Result<()> {
        // A page sent another way is no longer the version a delta could be made against.
        if let (Some(cache), Frame::Zero { gpa, count }) = (&self.delta, f) {
            cache.part(self.index).forget(*gpa, *count);
        }
        // Written between two gauge readings, its bytes would count as drained by the link: no
        // sample.
        self.gauge = LinkGauge::default();
        write_frame(&mut self.conn, f)
    }
}
