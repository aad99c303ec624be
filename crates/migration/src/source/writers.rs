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
use crate::compress::{Compressor, Next};
use crate::delta::{DeltaCache, Partition};
use crate::protocol::{write_frame, BLOCK};
use crate::stream::{
    compress_pages, compress_pages_stream, Codec, Encoding, Frame, StreamError, ZstdStream,
};
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
        Frame::encode_pages_with(out, gpa, len, fresh, Encoding::default(), |o, piece| {
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
                trial: Vec::new(),
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
    /// A probe's copy of the frame, for the codec tried on it and not sent.
    trial: Vec<u8>,
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
        let (sent, encoded, compress_time) = self
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
        let (t, probe) = compress_time;
        if probe {
            self.compressor
                .record(sent, encoded, self.out.len(), t, link);
        } else {
            self.compressor
                .record_sent(sent, (encoded, self.out.len()), t, link);
        }
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
                    Encoding {
                        whole_pages: self.whole_pages,
                        // The channel (TLS) authenticates the frame's bytes; a zstd stream's
                        // frames keep their CRC, which checks the stream's history too.
                        no_crc: self.stream.is_none(),
                    },
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

    /// Compresses the frame in `out` as the compressor says (through the connection's zstd
    /// stream, if it has one): the codec sent, the frame's size before, the compression time
    /// and whether the frame was a probe (LZ4 tried on a copy, recorded here; the frame goes
    /// with zstd).
    fn compress(&mut self) -> std::result::Result<(Codec, usize, (Duration, bool)), StreamError> {
        let encoded = self.out.len();
        let codec = match self.compressor.next() {
            Next::Use(codec) => {
                let t = Instant::now();
                self.compress_with(codec)?;
                return Ok((codec, encoded, (t.elapsed(), false)));
            }
            Next::Probe => {
                self.trial.clear();
                self.trial.extend_from_slice(&self.out);
                let t = Instant::now();
                let n = compress_pages(&mut self.trial, Codec::Lz4, &mut self.scratch)?;
                self.compressor
                    .record_trial(Codec::Lz4, encoded, n, t.elapsed());
                Codec::Zstd(crate::compress::ZSTD_LEVEL)
            }
        };
        let t = Instant::now();
        self.compress_with(codec)?;
        Ok((codec, encoded, (t.elapsed(), true)))
    }

    fn compress_with(&mut self, codec: Codec) -> std::result::Result<(), StreamError> {
        match (codec, self.stream.as_mut()) {
            (Codec::Zstd(_), Some(s)) => {
                compress_pages_stream(&mut self.out, s, &mut self.scratch)?
            }
            _ => compress_pages(&mut self.out, codec, &mut self.scratch)?,
        };
        Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compress::Compress;
    use crate::transport::{connect, generate_credentials, Credentials, Endpoint, Listener, Role};
    use guestmem_memory::{Backend, RegionSpec};
    use std::io::Read;

    const PAGE: usize = 4096;

    fn memory() -> Arc<GuestMemory> {
        let spec = RegionSpec::new("ram", 0, 1 << 20, Backend::Anon);
        Arc::new(GuestMemory::new(&[spec], None).unwrap())
    }

    /// Text-like (compressible) pages, different for each seed.
    #[allow(clippy::cast_possible_truncation)] // the low byte of a small counter.
    fn pages(count: usize, seed: u8) -> Vec<u8> {
        let words: [&[u8]; 4] = [b"guest ", b"memory ", b"page ", b"dirty\n"];
        let mut out = Vec::with_capacity(count * PAGE);
        let mut i = usize::from(seed);
        while out.len() < count * PAGE {
            out.extend_from_slice(words[i % 4]);
            out.push(b'a' + (i % 26) as u8);
            i = i.wrapping_mul(7).wrapping_add(3);
        }
        out.truncate(count * PAGE);
        out
    }

    /// One encoding, read back as the frame it is.
    fn encode(
        memory: &GuestMemory,
        part: &mut Partition,
        gpa: u64,
        len: usize,
        (try_delta, round, last): (bool, u32, bool),
    ) -> Frame {
        let (mut out, mut buf) = (Vec::new(), Vec::new());
        encode_cached(
            &mut out,
            &mut buf,
            memory,
            part,
            gpa,
            len,
            false,
            (try_delta, round, last),
        )
        .unwrap();
        Frame::read_from(&mut &out[..]).unwrap()
    }

    /// Pages sent for the first time go whole and are remembered; sent again after a few bytes
    /// changed, they go as deltas that rebuild exactly the new bytes; pages never sent go
    /// whole (counted as misses); after the last round nothing is remembered.
    #[test]
    fn the_delta_cache_decides_between_whole_pages_and_deltas() {
        let memory = memory();
        let cache = DeltaCache::new(64 * PAGE as u64, 1, BLOCK);
        let mut part = cache.part(0);
        let old = pages(4, 1);
        memory.write(0x4000, &old).unwrap();
        let first = encode(&memory, &mut part, 0x4000, 4 * PAGE, (false, 1, false));
        assert_eq!(
            first,
            Frame::Pages {
                gpa: 0x4000,
                pages: old.clone(),
                fresh: false
            }
        );
        assert!((0..4).all(|p| part.contains(0x4000 + p * PAGE as u64)));
        drop(part);
        assert_eq!((cache.report().hits, cache.report().misses), (0, 0));

        let mut new = old.clone();
        new[PAGE + 100..PAGE + 110].fill(0xee);
        new[3 * PAGE + 4000] ^= 0xff;
        memory.write(0x4000, &new).unwrap();
        let mut part = cache.part(0);
        let second = encode(&memory, &mut part, 0x4000, 4 * PAGE, (true, 2, false));
        let Frame::Delta {
            gpa: 0x4000,
            count: 4,
            ..
        } = &second
        else {
            panic!("{second:?}");
        };
        let mut rebuilt = old.clone();
        second.apply_delta(&mut rebuilt).unwrap();
        assert!(rebuilt == new, "the deltas rebuild the new pages");
        drop(part);
        let r = cache.report();
        assert_eq!((r.hits, r.misses, r.delta_pages), (4, 0, 4));
        assert!(r.delta_bytes < PAGE as u64, "{} delta bytes", r.delta_bytes);

        // Not cached: whole pages, two misses; the last round stores nothing.
        let mut part = cache.part(0);
        let third = encode(&memory, &mut part, 0x10000, 2 * PAGE, (true, 3, true));
        assert!(
            matches!(third, Frame::Pages { gpa: 0x10000, .. }),
            "{third:?}"
        );
        assert!(!part.contains(0x10000) && !part.contains(0x11000));
        drop(part);
        assert_eq!(cache.report().misses, 2);
    }

    /// A guest range outside memory is refused naming it, and nothing is cached.
    #[test]
    fn encoding_pages_outside_memory_is_an_error() {
        let memory = memory();
        let cache = DeltaCache::new(8 * PAGE as u64, 1, BLOCK);
        let (mut out, mut buf) = (Vec::new(), Vec::new());
        let e = encode_cached(
            &mut out,
            &mut buf,
            &memory,
            &mut cache.part(0),
            (1 << 20) - PAGE as u64,
            2 * PAGE,
            false,
            (false, 1, false),
        )
        .unwrap_err();
        assert!(matches!(e, StreamError::Malformed(_)), "{e:?}");
        assert!(out.is_empty());
        assert!(!cache.part(0).contains((1 << 20) - PAGE as u64));
    }

    /// A connected TLS pair over a Unix socket: (the source's end, the destination's end).
    fn pair(name: &str) -> (Connection, Connection) {
        let dir =
            std::env::temp_dir().join(format!("guestmem-writers-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        generate_credentials(&dir).unwrap();
        let endpoint = Endpoint::Unix(dir.join("sock"));
        let dest = Credentials::load(&dir, Role::Destination).unwrap();
        let listener = Listener::bind(&endpoint, &dest).unwrap();
        let server = std::thread::spawn(move || listener.accept().unwrap());
        let src = connect(&endpoint, &Credentials::load(&dir, Role::Source).unwrap()).unwrap();
        let dst = server.join().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        (src, dst)
    }

    /// Reads everything the peer sends until it hangs up.
    struct Counted<R>(R, u64);
    impl<R: Read> Read for Counted<R> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let n = self.0.read(buf)?;
            self.1 += n as u64;
            Ok(n)
        }
    }

    /// A writer sends its jobs in order over its connection, its pages compressed with the
    /// codec chosen (LZ4 here) and counted as written; a Zero frame makes the delta cache
    /// forget those pages; joined, it hands its connection back.
    #[test]
    fn a_writer_sends_its_jobs_in_order_and_counts_its_pages() {
        let memory = memory();
        let data = pages(8, 3);
        memory.write(0x2000, &data).unwrap();
        let (src, dst) = pair("send");
        let compressor = Arc::new(Compressor::new(Compress::Lz4));
        let cache = Arc::new(DeltaCache::new(64 * PAGE as u64, 1, BLOCK));
        let mut writers = Writers::spawn(
            vec![src],
            Vec::new(),
            &memory,
            false,
            compressor.clone(),
            None,
            Some(cache.clone()),
            (1, false),
        );
        let reader = std::thread::spawn(move || {
            let mut r = Counted(dst, 0);
            let frames: Vec<Frame> = (0..3).map(|_| Frame::read_from(&mut r).unwrap()).collect();
            (frames, r.1)
        });
        writers
            .queue(
                0,
                Job::Pages {
                    gpa: 0x2000,
                    len: 8 * PAGE as u64,
                    fresh: false,
                    delta: DeltaUse::Admit,
                },
            )
            .unwrap();
        writers
            .queue(
                0,
                Job::Frame(Frame::Zero {
                    gpa: 0x2000,
                    count: 2,
                }),
            )
            .unwrap();
        writers
            .queue(
                0,
                Job::Frame(Frame::EndOfRound {
                    round: 1,
                    last: true,
                }),
            )
            .unwrap();
        let joined = writers.join().unwrap();
        let (frames, total) = reader.join().unwrap();
        assert_eq!(
            frames,
            vec![
                Frame::Pages {
                    gpa: 0x2000,
                    pages: data,
                    fresh: false
                },
                Frame::Zero {
                    gpa: 0x2000,
                    count: 2
                },
                Frame::EndOfRound {
                    round: 1,
                    last: true
                },
            ]
        );
        let others = Frame::Zero {
            gpa: 0x2000,
            count: 2,
        }
        .encode()
        .unwrap()
        .len()
            + Frame::EndOfRound {
                round: 1,
                last: true,
            }
            .encode()
            .unwrap()
            .len();
        assert_eq!(joined.wire_bytes, total - others as u64);
        assert!(
            joined.wire_bytes < 4 * PAGE as u64,
            "compressed: {}",
            joined.wire_bytes
        );
        assert_eq!((joined.conns.len(), joined.streams.len()), (1, 1));
        assert_eq!(compressor.report().lz4_frames, 1);
        let part = cache.part(0);
        assert!(!part.contains(0x2000) && !part.contains(0x3000));
        assert!((2..8).all(|p| part.contains(0x2000 + p * PAGE as u64)));
    }

    /// A writer whose job fails stops there and its join names the failure.
    #[test]
    fn a_failed_job_fails_the_join() {
        let memory = memory();
        let (src, _dst) = pair("fail");
        let mut writers = Writers::spawn(
            vec![src],
            Vec::new(),
            &memory,
            false,
            Arc::new(Compressor::new(Compress::None)),
            None,
            None,
            (1, false),
        );
        writers
            .queue(
                0,
                Job::Pages {
                    gpa: 1 << 20,
                    len: PAGE as u64,
                    fresh: false,
                    delta: DeltaUse::Off,
                },
            )
            .unwrap();
        let e = writers.join().err().expect("pages outside memory");
        assert!(
            matches!(e, Error::Stream(StreamError::Malformed(_))),
            "{e:?}"
        );
    }
}
