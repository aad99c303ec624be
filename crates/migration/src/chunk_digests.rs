//! Per-chunk digests of guest memory, kept up to date while a pre-copy migration runs, so that
//! the digest check at switch-over (`verify`) re-hashes only the chunks written since their
//! digest was taken, not all of guest memory.
//!
//! Guest memory is cut into chunks of a fixed power-of-two size, counted from each region's
//! start. Each chunk has a digest ([`GuestMemory::digest`] of its bytes) and a stale bit. The
//! bookkeeping rule, on both sides of a migration:
//! - a chunk starts stale; whoever writes it (the destination applying a frame) or learns that
//!   it was written (the source, from each dirty-log harvest) marks it stale with [`mark`];
//! - [`refresh`] clears a chunk's stale bit *before* reading its bytes, so a mark made while it
//!   hashes leaves the chunk stale and it is hashed again later;
//! - [`summary`] combines the digests into one value per region, only once no chunk is stale.
//!
//! A digest is therefore of the chunk's bytes as they were at some moment after which nothing
//! marked it. On the source, what marks chunks is the dirty log: the incremental digest checks
//! that the destination holds the source's memory *as the dirty log describes it* (a dirty
//! page not sent, a frame lost or misapplied, a page sent from the wrong place all show), but a
//! write the dirty log never reports changes neither the pages sent nor the digest. On the
//! destination, what marks chunks is the frames that land: a chunk written by anything else
//! after its digest was taken goes unseen.
//!
//! [`mark`]: ChunkDigests::mark
//! [`refresh`]: ChunkDigests::refresh
//! [`summary`]: ChunkDigests::summary

use guestmem_sys::to_usize;
use std::sync::atomic::{AtomicU64, Ordering};

use guestmem_memory::{digest_bytes, GuestMemory, DIGEST_SEED, PAGE_SIZE};
use guestmem_tracking::DirtyBitmap;
use serde::{Deserialize, Serialize};

use crate::Result;

/// Bytes per chunk a migration's digest check uses: small enough that the few pages a guest
/// writes in a pre-copy's last round (scattered, in the worst case) take little re-hashing, large
/// enough that the digest table stays a small fraction of guest memory (8 bytes per chunk).
pub const DIGEST_CHUNK: u64 = 64 << 10;

/// The digest of one region: its chunk digests combined, in address order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionDigest {
    /// The region's guest address.
    pub gpa: u64,
    /// Its bytes.
    pub size: u64,
    /// Its chunks' digests, combined.
    pub digest: u64,
}

/// Folds region digests into the one value both sides compare (and print).
pub fn combine(regions: &[RegionDigest]) -> u64 {
    regions.iter().fold(DIGEST_SEED, |h, r| {
        let mut words = [0u8; 24];
        words[..8].copy_from_slice(&r.gpa.to_le_bytes());
        words[8..16].copy_from_slice(&r.size.to_le_bytes());
        words[16..].copy_from_slice(&r.digest.to_le_bytes());
        digest_bytes(h, &words)
    })
}

/// Whether `chunk` can be a digest chunk: a power of two from a page up to `max` (a migration's
/// block, so that one connection carries every byte of a chunk).
pub fn valid_chunk(chunk: u64, max: u64) -> bool {
    chunk.is_power_of_two() && (PAGE_SIZE..=max).contains(&chunk)
}

/// The chunk digests of some regions of guest memory (see the module docs). Every method takes
/// `&self`: the source's writer threads and the destination's reader threads refresh chunks
/// side by side while another thread marks.
#[derive(Debug)]
pub struct ChunkDigests {
    chunk: u64,
    regions: Vec<Chunks>,
}

#[derive(Debug)]
struct Chunks {
    gpa: u64,
    size: u64,
    /// One bit per chunk.
    stale: Vec<AtomicU64>,
    digests: Vec<AtomicU64>,
}

impl Chunks {
    fn count(&self, chunk: u64) -> u64 {
        self.size.div_ceil(chunk)
    }
}

impl ChunkDigests {
    /// Digests for the regions `(gpa, size)`, every chunk stale. `chunk` must pass
    /// [`valid_chunk`].
    pub fn new(regions: impl IntoIterator<Item = (u64, u64)>, chunk: u64) -> ChunkDigests {
        assert!(
            chunk.is_power_of_two() && chunk >= PAGE_SIZE,
            "chunk {chunk}"
        );
        let mut regions: Vec<Chunks> = regions
            .into_iter()
            .map(|(gpa, size)| {
                let n = size.div_ceil(chunk);
                let mut stale: Vec<AtomicU64> = (0..n.div_ceil(64))
                    .map(|_| AtomicU64::new(u64::MAX))
                    .collect();
                if !n.is_multiple_of(64) {
                    *stale.last_mut().expect("a region has chunks") =
                        AtomicU64::new((1 << (n % 64)) - 1);
                }
                Chunks {
                    gpa,
                    size,
                    stale,
                    digests: (0..n).map(|_| AtomicU64::new(0)).collect(),
                }
            })
            .collect();
        regions.sort_by_key(|r| r.gpa);
        ChunkDigests { chunk, regions }
    }

    /// Bytes per chunk.
    pub fn chunk(&self) -> u64 {
        self.chunk
    }

    /// The region holding `gpa`, and its chunks from the one holding `gpa` to the one holding
    /// `gpa + len - 1` (clipped to the region).
    fn chunks_of(&self, gpa: u64, len: u64) -> Option<(&Chunks, std::ops::Range<u64>)> {
        if len == 0 {
            return None;
        }
        let r = self
            .regions
            .iter()
            .find(|r| gpa >= r.gpa && gpa - r.gpa < r.size)?;
        let first = (gpa - r.gpa) / self.chunk;
        let end = (gpa - r.gpa).saturating_add(len).min(r.size);
        Some((r, first..end.div_ceil(self.chunk)))
    }

    /// Marks stale every chunk that `[gpa, gpa + len)` touches (addresses outside the regions
    /// are ignored; a range is taken to lie in one region).
    pub fn mark(&self, gpa: u64, len: u64) {
        if let Some((r, chunks)) = self.chunks_of(gpa, len) {
            for c in chunks {
                r.stale[(c / 64) as usize].fetch_or(1 << (c % 64), Ordering::SeqCst);
            }
        }
    }

    /// Marks stale every chunk holding a page of `dirty`.
    pub fn mark_dirty(&self, dirty: &[DirtyBitmap]) {
        for b in dirty {
            for (gpa, len) in b.ranges() {
                self.mark(gpa, len);
            }
        }
    }

    /// Hashes, from `memory`, the stale chunks that `[gpa, gpa + len)` touches. Returns the bytes
    /// hashed.
    pub fn refresh(&self, memory: &GuestMemory, gpa: u64, len: u64) -> Result<u64> {
        let Some((r, chunks)) = self.chunks_of(gpa, len) else {
            return Ok(0);
        };
        let mut hashed = 0;
        for c in chunks {
            hashed += self.refresh_chunk(memory, r, c)?;
        }
        Ok(hashed)
    }

    /// Hashes, from `memory`, every stale chunk for which `pick(region gpa, chunk offset in the
    /// region)` holds. Returns the bytes hashed.
    pub fn refresh_where(
        &self,
        memory: &GuestMemory,
        pick: impl Fn(u64, u64) -> bool,
    ) -> Result<u64> {
        let mut hashed = 0;
        for r in &self.regions {
            for (w, word) in r.stale.iter().enumerate() {
                let mut bits = word.load(Ordering::SeqCst);
                while bits != 0 {
                    let c = w as u64 * 64 + u64::from(bits.trailing_zeros());
                    bits &= bits - 1;
                    if pick(r.gpa, c * self.chunk) {
                        hashed += self.refresh_chunk(memory, r, c)?;
                    }
                }
            }
        }
        Ok(hashed)
    }

    /// Hashes chunk `c` of `r` if it is stale (clearing the bit first: see the module docs).
    fn refresh_chunk(&self, memory: &GuestMemory, r: &Chunks, c: u64) -> Result<u64> {
        let bit = 1 << (c % 64);
        if r.stale[(c / 64) as usize].fetch_and(!bit, Ordering::SeqCst) & bit == 0 {
            return Ok(0);
        }
        let offset = c * self.chunk;
        let len = self.chunk.min(r.size - offset);
        match memory.digest(r.gpa + offset, len) {
            Ok(d) => {
                r.digests[to_usize(c)].store(d, Ordering::SeqCst);
                Ok(len)
            }
            Err(e) => {
                r.stale[(c / 64) as usize].fetch_or(bit, Ordering::SeqCst);
                Err(e.into())
            }
        }
    }

    /// Host memory the bookkeeping takes.
    pub fn bytes(&self) -> u64 {
        self.regions
            .iter()
            .map(|r| 8 * (r.stale.len() + r.digests.len()) as u64)
            .sum()
    }

    /// Chunks still stale.
    pub fn stale(&self) -> u64 {
        self.regions
            .iter()
            .flat_map(|r| &r.stale)
            .map(|w| u64::from(w.load(Ordering::SeqCst).count_ones()))
            .sum()
    }

    /// Each region's digest (its chunk digests folded in order), or `None` while a chunk is
    /// stale.
    pub fn summary(&self) -> Option<Vec<RegionDigest>> {
        if self.stale() > 0 {
            return None;
        }
        Some(
            self.regions
                .iter()
                .map(|r| {
                    let h = (0..r.count(self.chunk)).fold(DIGEST_SEED, |h, c| {
                        let d = r.digests[to_usize(c)].load(Ordering::SeqCst);
                        digest_bytes(h, &d.to_le_bytes())
                    });
                    RegionDigest {
                        gpa: r.gpa,
                        size: r.size,
                        digest: h,
                    }
                })
                .collect(),
        )
    }
}

/// One digest per region, in order (see [`GuestMemory::digest`]): the digest check of a source
/// that predates chunk digests (see `Setup::verify_chunk` on the destination).
pub(crate) fn memory_digest(memory: &GuestMemory) -> Result<u64> {
    let mut h = guestmem_memory::DIGEST_SEED;
    for r in memory.regions() {
        h = guestmem_memory::digest_bytes(h, &memory.digest(r.gpa(), r.size())?.to_le_bytes());
    }
    Ok(h)
}

#[cfg(test)]
mod tests {
    use super::*;
    use guestmem_memory::{Backend, RegionSpec};

    const CHUNK: u64 = 16 << 10;

    /// Two regions, the second not a whole number of chunks.
    fn memory() -> GuestMemory {
        GuestMemory::new(
            &[
                RegionSpec::new("a", 0x10_0000, 4 * CHUNK, Backend::Anon),
                RegionSpec::new("b", 0x100_0000, 2 * CHUNK + PAGE_SIZE, Backend::Anon),
            ],
            None,
        )
        .unwrap()
    }

    fn digests(mem: &GuestMemory) -> ChunkDigests {
        ChunkDigests::new(mem.regions().iter().map(|r| (r.gpa(), r.size())), CHUNK)
    }

    /// The summary of memory hashed from scratch.
    fn fresh(mem: &GuestMemory) -> Vec<RegionDigest> {
        let d = digests(mem);
        d.refresh_where(mem, |_, _| true).unwrap();
        d.summary().unwrap()
    }

    #[test]
    fn every_chunk_starts_stale_and_a_summary_waits_for_all() {
        let mem = memory();
        let d = digests(&mem);
        assert_eq!(d.stale(), 4 + 3);
        assert_eq!(d.summary(), None);
        // Only the chunks the range touches: the first two of 'a'.
        assert_eq!(d.refresh(&mem, 0x10_0000 + 100, CHUNK).unwrap(), 2 * CHUNK);
        assert_eq!(d.stale(), 5);
        // A fresh chunk is not hashed again.
        assert_eq!(d.refresh(&mem, 0x10_0000, CHUNK).unwrap(), 0);
        // The last chunk of 'b' is one page.
        let last = 0x100_0000 + 2 * CHUNK;
        assert_eq!(d.refresh(&mem, last, PAGE_SIZE).unwrap(), PAGE_SIZE);
        assert_eq!(d.refresh_where(&mem, |_, _| true).unwrap(), 4 * CHUNK);
        assert_eq!(d.stale(), 0);
        assert_eq!(d.summary().unwrap().len(), 2);
    }

    #[test]
    fn a_marked_chunk_is_hashed_again_and_the_summary_follows_memory() {
        let mem = memory();
        let d = digests(&mem);
        d.refresh_where(&mem, |_, _| true).unwrap();
        let before = d.summary().unwrap();
        assert_eq!(before, fresh(&mem));

        // A write that nobody marks leaves the digests as they were: the bookkeeping trusts
        // its marks (see the module docs).
        let gpa = 0x10_0000 + 2 * CHUNK + 8;
        mem.write_u64(gpa, 0xdead_beef).unwrap();
        assert_eq!(d.summary().unwrap(), before);

        // Marked: stale until refreshed, then equal to a digest from scratch.
        d.mark(gpa, 8);
        assert_eq!(d.stale(), 1);
        assert_eq!(d.summary(), None);
        assert_eq!(d.refresh(&mem, gpa, 8).unwrap(), CHUNK);
        let after = d.summary().unwrap();
        assert_eq!(after, fresh(&mem));
        assert_ne!(after[0], before[0]);
        assert_eq!(after[1], before[1]);
        assert_ne!(combine(&after), combine(&before));
    }

    #[test]
    fn marks_cover_every_touched_chunk_and_ignore_other_addresses() {
        let mem = memory();
        let d = digests(&mem);
        d.refresh_where(&mem, |_, _| true).unwrap();
        // From the last page of chunk 0 into chunk 2 of 'a'.
        d.mark(0x10_0000 + CHUNK - PAGE_SIZE, CHUNK + 2 * PAGE_SIZE);
        assert_eq!(d.stale(), 3);
        // Past a region's end: clipped; outside every region: nothing.
        d.mark(0x100_0000 + 2 * CHUNK, 1 << 30);
        d.mark(0x4000_0000, PAGE_SIZE);
        d.mark(0x10_0000, 0);
        assert_eq!(d.stale(), 4);
        let mut dirty = DirtyBitmap {
            slot: 1,
            gpa: 0x100_0000,
            pages: (2 * CHUNK + PAGE_SIZE) / PAGE_SIZE,
            bits: vec![0],
        };
        dirty.bits[0] = 1 | 1 << (CHUNK / PAGE_SIZE);
        d.mark_dirty(&[dirty]);
        assert_eq!(d.stale(), 6);
        // `pick` sees each stale chunk's region and offset.
        let mut seen = std::sync::Mutex::new(Vec::new());
        d.refresh_where(&mem, |gpa, offset| {
            seen.lock().unwrap().push((gpa, offset));
            gpa == 0x100_0000
        })
        .unwrap();
        seen.get_mut().unwrap().sort();
        assert_eq!(
            *seen.get_mut().unwrap(),
            [
                (0x10_0000, 0),
                (0x10_0000, CHUNK),
                (0x10_0000, 2 * CHUNK),
                (0x100_0000, 0),
                (0x100_0000, CHUNK),
                (0x100_0000, 2 * CHUNK)
            ]
        );
        assert_eq!(d.stale(), 3);
    }

    #[test]
    fn the_combined_digest_names_regions_and_their_order() {
        let r = |gpa, digest| RegionDigest {
            gpa,
            size: CHUNK,
            digest,
        };
        assert_ne!(
            combine(&[r(0, 1), r(CHUNK, 2)]),
            combine(&[r(0, 2), r(CHUNK, 1)])
        );
        assert_ne!(combine(&[r(0, 1)]), combine(&[r(CHUNK, 1)]));
        assert_eq!(combine(&[]), DIGEST_SEED);
        assert!(valid_chunk(DIGEST_CHUNK, 2 << 20));
        assert!(!valid_chunk(PAGE_SIZE / 2, 2 << 20));
        assert!(!valid_chunk(3 * PAGE_SIZE, 2 << 20));
        assert!(!valid_chunk(4 << 20, 2 << 20));
    }
}
