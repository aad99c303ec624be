//! Fetching chunks for a restore: from the host's chunk cache when it has them, else from the
//! store (then kept in the cache); each checked against its hash as it is decompressed into
//! place. [`StoreSource`] serves one region to a lazy restore's pager this way.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use guestmem_paging::PageSource;
use serde::Serialize;

use crate::backend::Backend;
use crate::cache::ChunkCache;
use crate::chunk::{self, Hash};
use crate::{Error, Result};

/// How many chunks one fetch brings in at once.
pub const IN_FLIGHT: usize = 8;

/// Where the chunks of a restore came from.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct FetchStats {
    /// Objects read from the store, and their bytes.
    pub store_gets: u64,
    /// Their bytes.
    pub store_bytes: u64,
    /// Chunks found in the host's chunk cache.
    pub cache_hits: u64,
}

/// Gets chunks of one store for the restore paths.
pub struct Fetcher {
    backend: Arc<dyn Backend>,
    cache: Option<ChunkCache>,
    store_gets: AtomicU64,
    store_bytes: AtomicU64,
    cache_hits: AtomicU64,
}

impl Fetcher {
    /// A fetcher of `backend`'s chunks, through `cache` if any.
    pub fn new(backend: Arc<dyn Backend>, cache: Option<ChunkCache>) -> Fetcher {
        Fetcher {
            backend,
            cache,
            store_gets: AtomicU64::new(0),
            store_bytes: AtomicU64::new(0),
            cache_hits: AtomicU64::new(0),
        }
    }

    /// The store.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// Where the chunks came from so far.
    pub fn stats(&self) -> FetchStats {
        FetchStats {
            store_gets: self.store_gets.load(Ordering::Relaxed),
            store_bytes: self.store_bytes.load(Ordering::Relaxed),
            cache_hits: self.cache_hits.load(Ordering::Relaxed),
        }
    }

    /// Puts chunk `hash` (stored in `stored` bytes) into `out`, checked; `what` names it
    /// (snapshot, region, chunk) in errors.
    pub fn chunk_into(&self, hash: &Hash, stored: u64, out: &mut [u8], what: &str) -> Result<()> {
        if let Some(cache) = &self.cache {
            if cache.get_into(hash, out) {
                self.cache_hits.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            }
            if cache.remove(hash) {
                tracing::warn!(
                    "chunk cache: entry {} is damaged; fetching it again",
                    chunk::hex(hash)
                );
            }
        }
        let key = chunk::key(hash);
        let bytes = self.backend.get(&key).map_err(|e| match e {
            Error::Missing { store, key } => Error::Missing {
                store,
                key: format!("{key} ({what})"),
            },
            e => e,
        })?;
        self.store_gets.fetch_add(1, Ordering::Relaxed);
        self.store_bytes
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        if bytes.len() as u64 != stored {
            return Err(Error::Corrupt(format!(
                "{what}: chunk {} is {} bytes in the store {}, the manifest says {stored}: \
                 truncated or replaced",
                chunk::hex(hash),
                bytes.len(),
                self.backend.describe()
            )));
        }
        chunk::decode_into(&bytes, hash, out, what)?;
        if let Some(cache) = &self.cache {
            if let Err(e) = cache.put(hash, out) {
                tracing::warn!("chunk cache: {}", crate::chain_text(&e));
            }
        }
        Ok(())
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
pub struct StoreSource {
    fetcher: Arc<Fetcher>,
    /// Per chunk: `None` for zeros, else its hash and stored length.
    chunks: Vec<Option<(Hash, u64)>>,
    chunk_bytes: u64,
    size: u64,
    /// "STORE/NAME region 'R'", for errors.
    label: String,
}

impl StoreSource {
    /// The source of one region's `chunks` (`None`: a zero chunk), fetched by `fetcher`.
    pub fn new(
        fetcher: Arc<Fetcher>,
        chunks: Vec<Option<(Hash, u64)>>,
        chunk_bytes: u64,
        size: u64,
        label: String,
    ) -> StoreSource {
        StoreSource {
            fetcher,
            chunks,
            chunk_bytes,
            size,
            label,
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
            let index = (at / cb) as usize;
            let piece_end = ((index as u64 + 1) * cb).min(self.size).min(end);
            let (piece, tail) = rest.split_at_mut((piece_end - at) as usize);
            match self.chunks[index] {
                None => piece.fill(0),
                Some(c) => pieces.push((index, at, piece, c)),
            }
            rest = tail;
            at = piece_end;
        }
        parallel(pieces, IN_FLIGHT, |(index, at, piece, (hash, stored))| {
            let what = format!(
                "{} chunk {index} (offset {:#x})",
                self.label,
                index as u64 * cb
            );
            let start = index as u64 * cb;
            let len = cb.min(self.size - start) as usize;
            if at == start && piece.len() == len {
                self.fetcher.chunk_into(&hash, stored, piece, &what)
            } else {
                let mut whole = vec![0u8; len];
                self.fetcher.chunk_into(&hash, stored, &mut whole, &what)?;
                let from = (at - start) as usize;
                piece.copy_from_slice(&whole[from..from + piece.len()]);
                Ok(())
            }
        })
    }
}

/// The store's error as the page source's: kept whole (its causes stay its sources).
fn io_error(e: Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

impl PageSource for StoreSource {
    fn fetch(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.fill(offset, buf).map_err(io_error)
    }

    /// A range is fetched [`IN_FLIGHT`] chunks at a time, each chunk fetched and decoded once
    /// (however small the pager's pieces), and handed over in order.
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
            let last = ((end - 1) / cb).min(first + IN_FLIGHT as u64 - 1);
            let window_end = ((last + 1) * cb).min(self.size).min(end);
            let mut chunks: Vec<Vec<u8>> = (first..=last)
                .map(|i| vec![0u8; cb.min(self.size - i * cb) as usize])
                .collect();
            let jobs: Vec<(u64, &mut Vec<u8>)> = (first..=last)
                .zip(chunks.iter_mut())
                .filter(|(i, _)| self.chunks[*i as usize].is_some())
                .collect();
            parallel(jobs, IN_FLIGHT, |(i, out)| {
                let (hash, stored) = self.chunks[i as usize].expect("filtered");
                let what = format!("{} chunk {i} (offset {:#x})", self.label, i * cb);
                self.fetcher.chunk_into(&hash, stored, out, &what)
            })
            .map_err(io_error)?;
            while at < window_end {
                let i = at / cb;
                let chunk = &chunks[(i - first) as usize];
                let from = (at - i * cb) as usize;
                let n = (chunk.len() - from)
                    .min(max_piece)
                    .min((window_end - at) as usize);
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

    /// A window of [`IN_FLIGHT`] chunks, fetched at once (see `fetch_pieces`).
    fn background_bytes(&self) -> Option<u64> {
        Some(IN_FLIGHT as u64 * self.chunk_bytes)
    }

    fn is_zero(&self, offset: u64, len: u64) -> bool {
        let end = (offset + len).min(self.size);
        end > offset
            && (offset / self.chunk_bytes..=(end - 1) / self.chunk_bytes)
                .all(|c| self.chunks[c as usize].is_none())
    }
}
