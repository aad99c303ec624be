//! Where a live snapshot's chunks go ([`LiveSink`]) and where a round reads them from
//! ([`ChunkSource`]): shared by both strategies of [`crate::live`].

use guestmem_events::{Event, Reporter, Status};
use guestmem_memory::GuestMemory;
use guestmem_tracking::DirtyBitmap;

use crate::Result;

/// Where a live snapshot's chunks go. Chunk `i` of a region covers its bytes
/// `[i * chunk_bytes, (i + 1) * chunk_bytes)` (the last one shorter).
pub trait LiveSink {
    /// The chunk size: a multiple of 64 pages.
    fn chunk_bytes(&self) -> u64;

    /// The bytes that storing `chunks` chunks holding `dirty_bytes` of dirty pages costs
    /// (what decides when to pause): the dirty pages by default, for a sink that writes only
    /// those.
    fn cost(&self, chunks: u64, dirty_bytes: u64) -> u64 {
        let _ = chunks;
        dirty_bytes
    }

    /// How many chunks one [`LiveSink::store`] call should get to keep the sink's writers
    /// busy: copy-before-write stores in batches of this many (the held copies first in each),
    /// so a batch smaller than what the sink writes in parallel leaves its threads idle. 16 MiB
    /// of chunks by default.
    fn batch_chunks(&self) -> usize {
        usize::try_from((16 << 20) / self.chunk_bytes().max(1))
            .unwrap_or(1)
            .max(1)
    }

    /// Stores the chunks `chunks` (region index, chunk index) of `memory`, their bytes read
    /// from `source` (guest memory, which the guest may be writing meanwhile, or the copies
    /// taken during the pause). `dirty` is the round's dirty pages (`None`: every page); a
    /// chunk stored before needs only those updated, a chunk stored for the first time is
    /// stored whole. Returns the bytes written.
    fn store(
        &mut self,
        memory: &GuestMemory,
        source: &dyn ChunkSource,
        chunks: &[(usize, usize)],
        dirty: Option<&[DirtyBitmap]>,
    ) -> Result<u64>;
}

/// A sink that tells a reporter, when a record is due, the bytes its inner sink stored so far
/// (one check of an atomic per store call: a round, or a batch of copy-before-write's).
pub(crate) struct Reporting<'a, S> {
    inner: &'a mut S,
    reporter: Option<&'a Reporter>,
    bytes: u64,
}

impl<'a, S: LiveSink> Reporting<'a, S> {
    pub(crate) fn new(inner: &'a mut S, reporter: Option<&'a Reporter>) -> Self {
        Reporting {
            inner,
            reporter,
            bytes: 0,
        }
    }
}

impl<S: LiveSink> LiveSink for Reporting<'_, S> {
    fn chunk_bytes(&self) -> u64 {
        self.inner.chunk_bytes()
    }

    fn cost(&self, chunks: u64, dirty_bytes: u64) -> u64 {
        self.inner.cost(chunks, dirty_bytes)
    }

    fn batch_chunks(&self) -> usize {
        self.inner.batch_chunks()
    }

    fn store(
        &mut self,
        memory: &GuestMemory,
        source: &dyn ChunkSource,
        chunks: &[(usize, usize)],
        dirty: Option<&[DirtyBitmap]>,
    ) -> Result<u64> {
        let stored = self.inner.store(memory, source, chunks, dirty)?;
        self.bytes += stored;
        if let Some(r) = self.reporter {
            r.tick(|| {
                let mut e = Event::new(r.status().unwrap_or(Status::Precopy));
                e.bytes_transferred = self.bytes;
                e
            });
        }
        Ok(stored)
    }
}

/// Where a round reads its chunks' bytes: guest memory (copied out, never read in place while
/// the guest may write it), or the copies the pause took.
pub trait ChunkSource: Sync {
    /// Puts chunk `index` of region `region`, which starts at `gpa`, into `buf` (its length).
    fn read(&self, region: usize, index: usize, gpa: u64, buf: &mut [u8]) -> Result<()>;
}

impl ChunkSource for GuestMemory {
    fn read(&self, _region: usize, _index: usize, gpa: u64, buf: &mut [u8]) -> Result<()> {
        Ok(GuestMemory::read(self, gpa, buf)?)
    }
}
