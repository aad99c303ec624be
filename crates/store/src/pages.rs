//! Fetching chunks for a restore: from the host's chunk cache when it has them, else from the
//! store (then kept in the cache); each checked against its hash as it is decompressed into
//! place. Chunks that lie side by side in one pack are read with one range read: the store's
//! cost is per request (a remote server spends about as much on a request as on a few hundred
//! KiB of it), and a run of guest memory was packed in order. [`StorePages`] serves one
//! region to a lazy restore's pager this way.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use guestmem_paging::PageSource;
use guestmem_sys::to_usize;
use serde::Serialize;

use crate::cache::ChunkCache;
use crate::chunk::{self, Hash, Loc, Stored};
use crate::ledger::Ledger;
use crate::objects::ObjectStore;
use crate::{Error, Result};

/// How many reads (and decompressions) of one fetch run at once.
pub const IN_FLIGHT: usize = 8;
/// A lazy restore's window: how many chunks one fetch of a run brings in at once.
pub const WINDOW_CHUNKS: usize = 32;
/// The most one range read brings.
pub const MAX_READ_BYTES: u64 = 4 << 20;
/// Bytes between two chunks of one pack that a range read reads past rather than make two
/// reads (chunks that were found stored already sit elsewhere).
const MAX_GAP_BYTES: u64 = 128 << 10;

/// Where the chunks of a restore came from.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct FetchStats {
    /// Reads from the store (whole objects or ranges of packs).
    pub store_gets: u64,
    /// Their bytes.
    pub store_bytes: u64,
    /// Chunks found in the host's chunk cache.
    pub cache_hits: u64,
}

/// One chunk a restore wants: where it is stored, where its bytes go (exactly the chunk's
/// length), and how errors name it (snapshot, region, chunk).
#[derive(Debug)]
pub struct Want<'a> {
    /// The chunk.
    pub chunk: Stored,
    /// Its bytes' place.
    pub out: &'a mut [u8],
    /// Its name in errors.
    pub what: String,
}

/// One read: an object, or a range of a pack holding several wanted chunks.
struct Read<'a> {
    key: String,
    start: u64,
    end: u64,
    /// A pack's range (else a whole chunk object).
    range: bool,
    wants: Vec<Want<'a>>,
}

impl<'a> Read<'a> {
    /// Whether `w` lies within or shortly after this read in the same pack (then [`Read::add`]
    /// takes it).
    fn fits(&self, w: &Want<'_>) -> bool {
        let (Loc::Pack { id: a, .. }, Loc::Pack { id: b, offset }) =
            (self.wants[0].chunk.loc, w.chunk.loc)
        else {
            return false;
        };
        let end = offset + w.chunk.stored;
        a == b
            && offset >= self.start
            && offset <= self.end + MAX_GAP_BYTES
            && end.max(self.end) - self.start <= MAX_READ_BYTES
    }

    fn add(&mut self, w: Want<'a>) {
        self.end = self.end.max(w.chunk.offset() + w.chunk.stored);
        self.wants.push(w);
    }
}

/// Bytes of fetched chunks that may wait for the cache writer; past them a fetching thread
/// writes its chunk into the cache itself.
const CACHE_QUEUE_BYTES: u64 = 256 << 20;

/// Writes fetched chunks into the host's chunk cache on a thread of its own, at the lowest
/// priority: a cold restore is bound by CPU on a small host, and the cache's writes (a file
/// per chunk) are for the next restore, not this one. Dropping it waits for the queue to be
/// written.
struct CacheWriter {
    cache: Arc<ChunkCache>,
    queue: Option<std::sync::mpsc::Sender<(Hash, Vec<u8>)>>,
    queued: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl CacheWriter {
    fn new(cache: ChunkCache) -> CacheWriter {
        let cache = Arc::new(cache);
        let queued = Arc::new(AtomicU64::new(0));
        let (tx, rx) = std::sync::mpsc::channel::<(Hash, Vec<u8>)>();
        let thread = {
            let (cache, queued) = (cache.clone(), queued.clone());
            std::thread::Builder::new()
                .name("chunk-cache".into())
                .spawn(move || {
                    // SAFETY: sched_setscheduler on this thread only (pid 0) with a valid
                    // parameter block; SCHED_IDLE (run only on a CPU nothing else wants)
                    // needs no privilege. Best effort.
                    unsafe {
                        let param = libc::sched_param { sched_priority: 0 };
                        libc::sched_setscheduler(0, libc::SCHED_IDLE, &raw const param)
                    };
                    for (hash, chunk) in rx {
                        if let Err(e) = cache.put(&hash, &chunk) {
                            tracing::warn!("chunk cache: {}", crate::chain_text(&e));
                        }
                        queued.fetch_sub(chunk.len() as u64, Ordering::Relaxed);
                    }
                })
                .ok()
        };
        CacheWriter {
            cache,
            queue: thread.is_some().then_some(tx),
            queued,
            thread,
        }
    }

    /// Keeps `chunk` (checked) in the cache, soon.
    fn put(&self, hash: &Hash, chunk: &[u8]) {
        let n = chunk.len() as u64;
        if let Some(queue) = &self.queue {
            if self.queued.fetch_add(n, Ordering::Relaxed) + n <= CACHE_QUEUE_BYTES
                && queue.send((*hash, chunk.to_vec())).is_ok()
            {
                return;
            }
            self.queued.fetch_sub(n, Ordering::Relaxed);
        }
        if let Err(e) = self.cache.put(hash, chunk) {
            tracing::warn!("chunk cache: {}", crate::chain_text(&e));
        }
    }
}

impl Drop for CacheWriter {
    fn drop(&mut self) {
        self.queue.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Gets chunks of one store for the restore paths.
pub struct Fetcher {
    objects: Arc<dyn ObjectStore>,
    cache: Option<CacheWriter>,
    store_gets: AtomicU64,
    store_bytes: AtomicU64,
    cache_hits: AtomicU64,
}

// By hand: a back end need not implement `Debug`.
impl std::fmt::Debug for Fetcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fetcher")
            .field("cached", &self.cache.is_some())
            .field("store_gets", &self.store_gets)
            .field("store_bytes", &self.store_bytes)
            .field("cache_hits", &self.cache_hits)
            .finish_non_exhaustive()
    }
}

impl Fetcher {
    /// A fetcher of the chunks in `objects`, through `cache` if any.
    pub fn new(objects: Arc<dyn ObjectStore>, cache: Option<ChunkCache>) -> Fetcher {
        Fetcher {
            objects,
            cache: cache.map(CacheWriter::new),
            store_gets: AtomicU64::new(0),
            store_bytes: AtomicU64::new(0),
            cache_hits: AtomicU64::new(0),
        }
    }

    /// The store.
    pub fn object_store(&self) -> &Arc<dyn ObjectStore> {
        &self.objects
    }

    /// Where the chunks came from so far.
    pub fn stats(&self) -> FetchStats {
        FetchStats {
            store_gets: self.store_gets.load(Ordering::Relaxed),
            store_bytes: self.store_bytes.load(Ordering::Relaxed),
            cache_hits: self.cache_hits.load(Ordering::Relaxed),
        }
    }

    /// Puts `chunk` into `out`, checked; `what` names it (snapshot, region, chunk) in errors.
    pub fn chunk_into(&self, chunk: &Stored, out: &mut [u8], what: &str) -> Result<()> {
        self.fetch(
            vec![Want {
                chunk: *chunk,
                out,
                what: what.to_string(),
            }],
            1,
        )
    }

    /// Whether the host's cache had `w` (then in place).
    fn cached(&self, w: &mut Want<'_>) -> bool {
        let Some(cache) = self.cache.as_ref().map(|c| &c.cache) else {
            return false;
        };
        if cache.get_into(&w.chunk.hash, w.out) {
            self.cache_hits.fetch_add(1, Ordering::Relaxed);
            return true;
        }
        if cache.remove(&w.chunk.hash) {
            tracing::warn!(
                "chunk cache: entry {} is damaged; fetching it again",
                chunk::hex(&w.chunk.hash)
            );
        }
        false
    }

    /// Puts every chunk of `wants` in place, checked: those the host's chunk cache has from
    /// it, the others from the store, chunks side by side in one pack with one range read
    /// (up to [`MAX_READ_BYTES`]), `threads` reads at a time; then each is decompressed and
    /// checked (`threads` at a time) and kept in the cache. The first error wins.
    pub fn fetch(&self, wants: Vec<Want<'_>>, threads: usize) -> Result<()> {
        let mut missing: Vec<Want<'_>> = Vec::with_capacity(wants.len());
        for mut w in wants {
            if !self.cached(&mut w) {
                missing.push(w);
            }
        }
        if missing.is_empty() {
            return Ok(());
        }
        missing.sort_by_key(|w| w.chunk.loc);
        let mut reads: Vec<Read<'_>> = Vec::new();
        for w in missing {
            if let Some(r) = reads.last_mut().filter(|r| r.fits(&w)) {
                r.add(w);
                continue;
            }
            reads.push(Read {
                key: w.chunk.object_key(),
                start: w.chunk.offset(),
                end: w.chunk.offset() + w.chunk.stored,
                range: matches!(w.chunk.loc, Loc::Pack { .. }),
                wants: vec![w],
            });
        }
        // Reads first (a remote store's round trips overlap), then the decompressions: a read
        // of many chunks is spread over the threads.
        let bytes: Vec<OnceLock<Vec<u8>>> = reads.iter().map(|_| OnceLock::new()).collect();
        parallel(
            reads.iter().zip(&bytes).collect(),
            threads,
            |(read, slot)| {
                let got = self.read(read)?;
                slot.set(got).expect("each read once");
                Ok(())
            },
        )?;
        let mut chunks = Vec::new();
        for (read, got) in reads.into_iter().zip(&bytes) {
            let got = got.get().expect("read");
            for w in read.wants {
                let from = to_usize(w.chunk.offset() - read.start);
                chunks.push((&got[from..from + to_usize(w.chunk.stored)], w));
            }
        }
        parallel(chunks, threads, |(stored, w)| {
            chunk::decode_into(stored, &w.chunk.hash, w.out, &w.what)?;
            if let Some(cache) = &self.cache {
                cache.put(&w.chunk.hash, w.out);
            }
            Ok(())
        })
    }

    /// The bytes of one read, as long as its chunks need.
    fn read(&self, read: &Read<'_>) -> Result<Vec<u8>> {
        let what = &read.wants[0].what;
        let others = match read.wants.len() {
            1 => String::new(),
            n => format!(" and {} more", n - 1),
        };
        let got = if read.range {
            self.objects
                .get_range(&read.key, read.start, read.end - read.start)
        } else {
            self.objects.get(&read.key)
        }
        .map_err(|e| match e {
            Error::Missing { store, key } => Error::Missing {
                store,
                key: format!("{key} ({what}{others})"),
            },
            e => e,
        })?;
        self.store_gets.fetch_add(1, Ordering::Relaxed);
        self.store_bytes
            .fetch_add(got.len() as u64, Ordering::Relaxed);
        let want = read.end - read.start;
        if got.len() as u64 != want {
            // The first chunk whose bytes are not all there (a whole object: the one).
            let held = read.start + got.len() as u64;
            let w = read
                .wants
                .iter()
                .find(|w| w.chunk.offset() + w.chunk.stored > held)
                .unwrap_or(&read.wants[0]);
            return Err(Error::Corrupt(format!(
                "{}: chunk {} is {} bytes from byte {} of {} in the store {}, which holds {} \
                 bytes of them: truncated or replaced",
                w.what,
                chunk::hex(&w.chunk.hash),
                w.chunk.stored,
                w.chunk.offset(),
                read.key,
                self.objects.describe(),
                if read.range {
                    held.saturating_sub(w.chunk.offset()).min(w.chunk.stored)
                } else {
                    got.len() as u64
                },
            )));
        }
        Ok(got)
    }
}

/// Runs `work` on every item, `threads` at a time; the first error wins.
pub(crate) fn parallel<T: Send>(
    items: Vec<T>,
    threads: usize,
    work: impl Fn(T) -> Result<()> + Sync,
) -> Result<()> {
    if items.len() <= 1 || threads <= 1 {
        return items.into_iter().try_for_each(work);
    }
    let queue = Mutex::new(items.into_iter());
    let error: Mutex<Option<Error>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                if error.lock().expect("not poisoned").is_some() {
                    return;
                }
                let Some(item) = queue.lock().expect("not poisoned").next() else {
                    return;
                };
                if let Err(e) = work(item) {
                    error.lock().expect("not poisoned").get_or_insert(e);
                    return;
                }
            });
        }
    });
    match error.into_inner().expect("not poisoned") {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// One region of a store snapshot, for a pager: each chunk fetched (several at once when a
/// fetch spans several), checked and decompressed into the pager's buffer.
#[derive(Debug)]
pub struct StorePages {
    fetcher: Arc<Fetcher>,
    /// Per chunk: `None` for zeros, else where it is stored.
    chunks: Vec<Option<Stored>>,
    chunk_bytes: u64,
    size: u64,
    /// "STORE/NAME region 'R'", for errors.
    label: String,
    /// The chunks fetched so far (of this region: `region`), for a failure to name those
    /// never fetched.
    ledger: Arc<Ledger>,
    region: usize,
}

impl StorePages {
    /// The source of one region's `chunks` (`None`: a zero chunk), fetched by `fetcher`.
    pub fn new(
        fetcher: Arc<Fetcher>,
        chunks: Vec<Option<Stored>>,
        chunk_bytes: u64,
        size: u64,
        label: String,
    ) -> StorePages {
        let data = chunks.iter().map(Option::is_some).collect();
        let ledger = Arc::new(Ledger::new(vec![(label.clone(), data)]));
        StorePages::in_ledger(fetcher, chunks, chunk_bytes, size, label, ledger, 0)
    }

    /// [`StorePages::new`] for region `region` of a snapshot whose fetched chunks `ledger`
    /// keeps (shared by its regions' sources).
    pub(crate) fn in_ledger(
        fetcher: Arc<Fetcher>,
        chunks: Vec<Option<Stored>>,
        chunk_bytes: u64,
        size: u64,
        label: String,
        ledger: Arc<Ledger>,
        region: usize,
    ) -> StorePages {
        ledger.use_region(region);
        StorePages {
            fetcher,
            chunks,
            chunk_bytes,
            size,
            label,
            ledger,
            region,
        }
    }

    /// Fetches `wants` (chunks `indices` of the region) and notes them fetched; a store that
    /// stalled or cannot be reached fails naming the chunks never fetched.
    fn fetch_noted(&self, wants: Vec<Want<'_>>, indices: &[u64]) -> Result<()> {
        match self.fetcher.fetch(wants, IN_FLIGHT) {
            Ok(()) => {
                for &i in indices {
                    self.ledger.mark(self.region, i);
                }
                Ok(())
            }
            Err(e @ (Error::Stalled { .. } | Error::Unreachable { .. })) => {
                Err(Error::NeverFetched {
                    unfetched: self.ledger.unfetched(),
                    source: Box::new(e),
                })
            }
            Err(e) => Err(e),
        }
    }

    fn fill(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let end = offset + buf.len() as u64;
        if buf.is_empty() || end > self.size {
            return Err(Error::Layout(format!(
                "{}: fetch {offset:#x}+{:#x} outside the region",
                self.label,
                buf.len()
            )));
        }
        let cb = self.chunk_bytes;
        // Split `buf` at chunk boundaries.
        let mut pieces = Vec::new();
        let mut rest = buf;
        let mut at = offset;
        while at < end {
            let index = to_usize(at / cb);
            let piece_end = ((index as u64 + 1) * cb).min(self.size).min(end);
            let (piece, tail) = rest.split_at_mut(to_usize(piece_end - at));
            match self.chunks[index] {
                None => piece.fill(0),
                Some(c) => pieces.push((index, at, piece, c)),
            }
            rest = tail;
            at = piece_end;
        }
        // Whole chunks go straight into `buf`; a piece of one through a buffer of its own.
        let mut wants = Vec::new();
        let mut partial: Vec<(usize, &mut [u8], Stored, u64)> = Vec::new();
        let indices: Vec<u64> = pieces.iter().map(|p| p.0 as u64).collect();
        for (index, at, piece, chunk) in pieces {
            let start = index as u64 * cb;
            if at == start && piece.len() as u64 == cb.min(self.size - start) {
                wants.push(Want {
                    chunk,
                    out: piece,
                    what: self.what(index as u64),
                });
            } else {
                partial.push((to_usize(at - start), piece, chunk, index as u64));
            }
        }
        let mut wholes: Vec<Vec<u8>> = partial
            .iter()
            .map(|&(_, _, _, i)| vec![0u8; to_usize(cb.min(self.size - i * cb))])
            .collect();
        wants.extend(
            partial
                .iter()
                .zip(wholes.iter_mut())
                .map(|(&(_, _, chunk, i), out)| Want {
                    chunk,
                    out,
                    what: self.what(i),
                }),
        );
        self.fetch_noted(wants, &indices)?;
        for ((from, piece, _, _), whole) in partial.into_iter().zip(&wholes) {
            piece.copy_from_slice(&whole[from..from + piece.len()]);
        }
        Ok(())
    }

    /// Chunk `index`, in errors.
    fn what(&self, index: u64) -> String {
        format!(
            "{} chunk {index} (offset {:#x})",
            self.label,
            index * self.chunk_bytes
        )
    }
}

/// The store's error as the page source's: kept whole (its causes stay its sources).
fn io_error(e: Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

impl PageSource for StorePages {
    fn fetch(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.fill(offset, buf).map_err(io_error)
    }

    /// A range is fetched [`WINDOW_CHUNKS`] chunks at a time (neighbours in a pack with one
    /// read), each chunk fetched and decoded once (however small the pager's pieces), and
    /// handed over in order.
    fn fetch_pieces(
        &self,
        offset: u64,
        len: u64,
        buf: &mut [u8],
        _urgent: bool,
        sink: &mut dyn FnMut(u64, &[u8]) -> bool,
    ) -> io::Result<()> {
        let end = offset + len;
        if len == 0 || end > self.size || buf.is_empty() {
            return Err(io_error(Error::Layout(format!(
                "{}: fetch {offset:#x}+{len:#x} outside the region",
                self.label
            ))));
        }
        let cb = self.chunk_bytes;
        let max_piece = buf.len();
        let mut at = offset;
        while at < end {
            // The next window of chunks, fetched at once.
            let first = at / cb;
            let last = ((end - 1) / cb).min(first + WINDOW_CHUNKS as u64 - 1);
            let window_end = ((last + 1) * cb).min(self.size).min(end);
            let mut chunks: Vec<Vec<u8>> = (first..=last)
                .map(|i| vec![0u8; to_usize(cb.min(self.size - i * cb))])
                .collect();
            let wants: Vec<Want<'_>> = (first..=last)
                .zip(chunks.iter_mut())
                .filter_map(|(i, out)| {
                    Some(Want {
                        chunk: self.chunks[to_usize(i)]?,
                        out,
                        what: self.what(i),
                    })
                })
                .collect();
            let indices: Vec<u64> = (first..=last).collect();
            self.fetch_noted(wants, &indices).map_err(io_error)?;
            while at < window_end {
                let i = at / cb;
                let chunk = &chunks[to_usize(i - first)];
                let from = to_usize(at - i * cb);
                let n = (chunk.len() - from)
                    .min(max_piece)
                    .min(to_usize(window_end - at));
                if !sink(at, &chunk[from..from + n]) {
                    return Ok(());
                }
                at += n as u64;
            }
        }
        Ok(())
    }

    fn size(&self) -> u64 {
        self.size
    }

    /// A window of [`WINDOW_CHUNKS`] chunks, fetched at once (see `fetch_pieces`).
    fn background_bytes(&self) -> Option<u64> {
        Some(WINDOW_CHUNKS as u64 * self.chunk_bytes)
    }

    /// An object store serves many requests at once (each on its own connection).
    fn concurrent_requests(&self) -> bool {
        true
    }

    fn is_zero(&self, offset: u64, len: u64) -> bool {
        let end = (offset + len).min(self.size);
        end > offset
            && (offset / self.chunk_bytes..=(end - 1) / self.chunk_bytes)
                .all(|c| self.chunks[to_usize(c)].is_none())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::local::LocalObjectStore;

    /// Chunks side by side in a pack come with one read (a gap and a duplicate included), a
    /// chunk object and a chunk of another pack with reads of their own; every chunk lands
    /// in its place, checked.
    #[test]
    fn neighbours_in_a_pack_come_with_one_read() {
        let dir = std::env::temp_dir().join(format!("guestmem-fetch-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let b: Arc<dyn ObjectStore> = Arc::new(LocalObjectStore::new(&dir));
        let mut z = zstd::bulk::Compressor::new(1).unwrap();
        let data: Vec<Vec<u8>> = (0..5u8).map(|i| vec![i + 1; 64 << 10]).collect();
        let frames: Vec<Vec<u8>> = data.iter().map(|d| chunk::encode(&mut z, d)).collect();
        // Pack A: chunk 0, 100 bytes of something else, chunks 1 and 2. Pack B: chunk 3.
        // Chunk 4: an object of its own.
        let (a, bb) = ([1u8; 32], [2u8; 32]);
        let mut pack = frames[0].clone();
        pack.extend_from_slice(&[0u8; 100]);
        let mut offsets = vec![0u64];
        for f in &frames[1..3] {
            offsets.push(pack.len() as u64);
            pack.extend_from_slice(f);
        }
        b.put(&chunk::pack_key(&a), &pack).unwrap();
        b.put(&chunk::pack_key(&bb), &frames[3]).unwrap();
        b.put(&chunk::key(&chunk::hash(&data[4])), &frames[4])
            .unwrap();
        let stored = |i: usize, loc: Loc| Stored {
            hash: chunk::hash(&data[i]),
            stored: frames[i].len() as u64,
            loc,
        };
        let chunks = [
            stored(0, Loc::Pack { id: a, offset: 0 }),
            stored(
                1,
                Loc::Pack {
                    id: a,
                    offset: offsets[1],
                },
            ),
            stored(
                2,
                Loc::Pack {
                    id: a,
                    offset: offsets[2],
                },
            ),
            stored(3, Loc::Pack { id: bb, offset: 0 }),
            stored(4, Loc::Object),
            // Chunk 1 again (a guest's two identical chunks).
            stored(
                1,
                Loc::Pack {
                    id: a,
                    offset: offsets[1],
                },
            ),
        ];
        let mut outs: Vec<Vec<u8>> = chunks.iter().map(|_| vec![0u8; 64 << 10]).collect();
        let f = Fetcher::new(b.clone(), None);
        let wants = chunks
            .iter()
            .zip(outs.iter_mut())
            .enumerate()
            .map(|(i, (c, out))| Want {
                chunk: *c,
                out,
                what: format!("chunk {i}"),
            })
            .collect();
        f.fetch(wants, 4).unwrap();
        for (i, out) in outs.iter().enumerate() {
            assert_eq!(out, &data[[0, 1, 2, 3, 4, 1][i]], "chunk {i}");
        }
        assert_eq!(f.stats().store_gets, 3, "{:?}", f.stats());

        // A chunk whose recorded length runs past its pack's end: named, truncated.
        let past = Stored {
            stored: frames[3].len() as u64 + 10,
            ..chunks[3]
        };
        let e = f
            .chunk_into(&past, &mut outs[0], "snap ram chunk 3")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("snap ram chunk 3") && e.contains("truncated"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
