//! Delta encoding of re-dirtied pages against the last version sent (XBZRLE's idea), and the
//! source's bounded cache of those versions.
//!
//! A guest usually re-dirties a page a few lines at a time: most of its bytes are still the
//! ones the destination received last time. When the source still holds that last version,
//! it sends only the 8-byte words that changed, as spans: `skip (varint) | len (varint) |
//! len * 8 new bytes`, repeated; `skip` counts unchanged words since the previous span's end,
//! `len` (at least 1) the changed words that follow, and words after the last span are
//! unchanged. Varints are LEB128 of at most two bytes (a page has 512 words). The spans carry
//! the new bytes rather than their XOR with the old ones: the changed runs are found by
//! XOR-ing the two versions, and new bytes compress as well as the page they came from when
//! the frame is compressed on top. An empty delta means the page did not change.
//!
//! [`check`] validates a delta (spans inside the page, lengths well-formed) without a page,
//! so that a receiver refuses a malformed one before touching memory; [`apply`] rebuilds the
//! page from the receiver's copy, which must be exactly the version the delta was made
//! against (see [`DeltaCache`] for how the source keeps that true).
//!
//! The cache is direct-mapped, as QEMU's XBZRLE cache: one slot per page index modulo the
//! slot count, each tagged with the page's address, so a lookup is one comparison and the
//! memory is fixed up front. A page not found takes its slot only from a page last stored
//! two rounds ago or more: a round's first pages would otherwise evict, slot by slot, the
//! previous round's last ones before they come up again (a scan over a working set larger
//! than the cache would never hit), while pages that keep being re-dirtied keep their slots.
//! It is split into one partition per pages connection: a page
//! always travels on the same connection (its 2 MiB block decides), whose writer thread alone
//! reads and updates its partition, so a delta is never made against a version that another
//! connection's frame, racing with it, carried.

use guestmem_sys::to_usize;
use std::sync::{Mutex, MutexGuard};

use serde::Serialize;

/// Bytes per page.
pub const PAGE: usize = 4096;
const WORD: usize = 8;
const WORDS: usize = PAGE / WORD;

/// Why a delta is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("page delta: {0}")]
pub struct DeltaError(String);

fn word(page: &[u8], i: usize) -> u64 {
    u64::from_ne_bytes(page[i * WORD..(i + 1) * WORD].try_into().expect("8 bytes"))
}

#[allow(clippy::cast_possible_truncation)] // a varint: each byte takes the low bits.
fn put_varint(out: &mut Vec<u8>, v: usize) {
    debug_assert!(v <= WORDS);
    if v < 0x80 {
        out.push(v as u8);
    } else {
        out.push((v & 0x7f) as u8 | 0x80);
        out.push((v >> 7) as u8);
    }
}

/// Appends to `out` the delta that turns `old` into `new` (both one page), unless it would
/// take more than `limit` bytes: then `out` is left as it was and the answer is `false`.
pub fn encode(old: &[u8], new: &[u8], out: &mut Vec<u8>, limit: usize) -> bool {
    assert!(old.len() == PAGE && new.len() == PAGE, "whole pages");
    let start = out.len();
    let mut end = 0; // end of the last span, in words
    let mut i = 0;
    while i < WORDS {
        if word(old, i) == word(new, i) {
            i += 1;
            continue;
        }
        let first = i;
        while i < WORDS && word(old, i) != word(new, i) {
            i += 1;
        }
        put_varint(out, first - end);
        put_varint(out, i - first);
        out.extend_from_slice(&new[first * WORD..i * WORD]);
        end = i;
        if out.len() - start > limit {
            out.truncate(start);
            return false;
        }
    }
    true
}

/// The spans of a delta, as (first byte, bytes) of the page and their new bytes; every error
/// is found before the first span is returned by [`check`].
struct Spans<'d> {
    delta: &'d [u8],
    at: usize,
    end: usize,
}

impl<'d> Spans<'d> {
    fn varint(&mut self) -> Result<usize, DeltaError> {
        let b0 = *self
            .delta
            .get(self.at)
            .ok_or_else(|| DeltaError("truncated span header".into()))?;
        self.at += 1;
        if b0 & 0x80 == 0 {
            return Ok(b0 as usize);
        }
        let b1 = *self
            .delta
            .get(self.at)
            .ok_or_else(|| DeltaError("truncated span header".into()))?;
        self.at += 1;
        if b1 & 0x80 != 0 || b1 == 0 {
            return Err(DeltaError(format!(
                "varint {b0:#04x} {b1:#04x}: at most two bytes, no overlong form"
            )));
        }
        Ok((b0 & 0x7f) as usize | (b1 as usize) << 7)
    }
}

impl<'d> Iterator for Spans<'d> {
    type Item = Result<(usize, &'d [u8]), DeltaError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.at == self.delta.len() {
            return None;
        }
        let span = (|| {
            let skip = self.varint()?;
            let len = self.varint()?;
            let first = self.end + skip;
            if len == 0 || first + len > WORDS {
                return Err(DeltaError(format!(
                    "span of {len} words at word {first}: not inside the page's {WORDS}"
                )));
            }
            let bytes = self
                .delta
                .get(self.at..self.at + len * WORD)
                .ok_or_else(|| DeltaError(format!("span of {len} words truncated")))?;
            self.at += len * WORD;
            self.end = first + len;
            Ok((first * WORD, bytes))
        })();
        if span.is_err() {
            self.at = self.delta.len();
        }
        Some(span)
    }
}

fn spans(delta: &[u8]) -> Spans<'_> {
    Spans {
        delta,
        at: 0,
        end: 0,
    }
}

/// Checks that `delta` is well-formed: spans in order, inside one page, nothing left over.
pub fn check(delta: &[u8]) -> Result<(), DeltaError> {
    if delta.len() >= PAGE {
        return Err(DeltaError(format!(
            "{} bytes: a delta is smaller than a page",
            delta.len()
        )));
    }
    spans(delta).try_for_each(|s| s.map(|_| ()))
}

/// Applies `delta` (which [`check`] accepted) to `page`, the receiver's copy of the version it
/// was made against.
pub fn apply(delta: &[u8], page: &mut [u8]) -> Result<(), DeltaError> {
    if page.len() != PAGE {
        return Err(DeltaError(format!(
            "applied to {} bytes, not a page",
            page.len()
        )));
    }
    check(delta)?;
    for span in spans(delta) {
        let (at, bytes) = span?;
        page[at..at + bytes.len()].copy_from_slice(bytes);
    }
    Ok(())
}

/// What the delta cache did during one migration.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct DeltaReport {
    /// The cache's size (0: delta encoding was off).
    pub cache_bytes: u64,
    /// Re-sent pages looked up: found with their last version, or not.
    pub hits: u64,
    /// Re-sent pages whose last version was not cached.
    pub misses: u64,
    /// Pages sent as a delta (hits whose delta was smaller than the page), and the bytes of
    /// those deltas before frame compression.
    pub delta_pages: u64,
    /// Bytes of those deltas.
    pub delta_bytes: u64,
}

impl DeltaReport {
    /// Hits over lookups (0 without lookups).
    pub fn hit_rate(&self) -> f64 {
        self.hits as f64 / (self.hits + self.misses).max(1) as f64
    }

    /// Page bytes that travelled as deltas instead, less the deltas.
    pub fn bytes_saved(&self) -> u64 {
        (self.delta_pages * PAGE as u64).saturating_sub(self.delta_bytes)
    }
}

/// One connection's share of the cache.
#[derive(Debug)]
pub struct Partition {
    /// Per slot: the address of the page it holds, plus one (0: empty), and the round that
    /// stored it.
    tags: Vec<u64>,
    rounds: Vec<u32>,
    data: Vec<u8>,
    /// Pages per block and connections: to number this connection's pages consecutively.
    block_pages: u64,
    connections: u64,
    stats: DeltaReport,
}

impl Partition {
    fn slot(&self, gpa: u64) -> usize {
        let page = gpa / PAGE as u64;
        // This connection's pages, numbered consecutively (it carries every n-th block): the
        // last pages sent fill distinct slots.
        let local =
            page / self.block_pages / self.connections * self.block_pages + page % self.block_pages;
        to_usize(local % self.tags.len() as u64)
    }

    /// The last version sent of the page at `gpa`, if it is cached (counted as a hit or a
    /// miss).
    pub fn lookup(&mut self, gpa: u64) -> Option<&[u8]> {
        if self.tags.is_empty() {
            return None;
        }
        let s = self.slot(gpa);
        if self.tags[s] == gpa + 1 {
            self.stats.hits += 1;
            Some(&self.data[s * PAGE..(s + 1) * PAGE])
        } else {
            self.stats.misses += 1;
            None
        }
    }

    /// Whether the page at `gpa` is cached (not counted).
    pub fn contains(&self, gpa: u64) -> bool {
        !self.tags.is_empty() && self.tags[self.slot(gpa)] == gpa + 1
    }

    /// Records `page` as the last version of the page at `gpa`, sent in round `round`. The
    /// page takes its slot if it holds the page already, or nothing, or a page stored two
    /// rounds ago or more; otherwise (another page's recent version) it is forgotten.
    pub fn store(&mut self, gpa: u64, page: &[u8], round: u32) {
        if self.tags.is_empty() {
            return;
        }
        let s = self.slot(gpa);
        let tag = self.tags[s];
        if tag != gpa + 1 && tag != 0 && self.rounds[s].saturating_add(1) >= round {
            return;
        }
        self.tags[s] = gpa + 1;
        self.rounds[s] = round;
        self.data[s * PAGE..(s + 1) * PAGE].copy_from_slice(page);
    }

    /// Forgets the `count` pages from `gpa` on (they were sent another way, e.g. as zero).
    pub fn forget(&mut self, gpa: u64, count: u64) {
        if self.tags.is_empty() {
            return;
        }
        for p in 0..count.min(self.tags.len() as u64 * self.connections) {
            let g = gpa + p * PAGE as u64;
            let s = self.slot(g);
            if self.tags[s] == g + 1 {
                self.tags[s] = 0;
            }
        }
        // More pages than slots: whatever is left of them goes too.
        if count > self.tags.len() as u64 * self.connections {
            let end = gpa + count * PAGE as u64;
            self.tags
                .iter_mut()
                .filter(|t| (gpa + 1..end + 1).contains(&**t))
                .for_each(|t| *t = 0);
        }
    }

    /// Counts `pages` pages sent as deltas of `bytes` in all.
    pub fn sent_deltas(&mut self, pages: usize, bytes: usize) {
        self.stats.delta_pages += pages as u64;
        self.stats.delta_bytes += bytes as u64;
    }
}

/// The last version sent of up to a fixed number of pages, one [`Partition`] per pages
/// connection.
#[derive(Debug)]
pub struct DeltaCache {
    parts: Vec<Mutex<Partition>>,
    bytes: u64,
}

impl DeltaCache {
    /// A cache of at most `bytes` (whole pages, split evenly) for `connections` connections,
    /// whose pages go by blocks of `block` bytes, block `b` on connection `b % connections`.
    pub fn new(bytes: u64, connections: usize, block: u64) -> DeltaCache {
        let connections = connections.max(1);
        let slots = to_usize(bytes / PAGE as u64 / connections as u64);
        let parts = (0..connections)
            .map(|_| {
                Mutex::new(Partition {
                    tags: vec![0; slots],
                    rounds: vec![0; slots],
                    data: vec![0; slots * PAGE],
                    block_pages: (block / PAGE as u64).max(1),
                    connections: connections as u64,
                    stats: DeltaReport::default(),
                })
            })
            .collect();
        DeltaCache {
            parts,
            bytes: (slots * PAGE * connections) as u64,
        }
    }

    /// The size of the cache's page copies.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Pages it holds at most.
    pub fn pages(&self) -> u64 {
        self.bytes / PAGE as u64
    }

    /// Connection `i`'s partition.
    pub fn part(&self, i: usize) -> MutexGuard<'_, Partition> {
        self.parts[i % self.parts.len()]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// What the cache did so far.
    pub fn report(&self) -> DeltaReport {
        let mut r = DeltaReport {
            cache_bytes: self.bytes,
            ..Default::default()
        };
        for i in 0..self.parts.len() {
            let s = &self.part(i).stats;
            r.hits += s.hits;
            r.misses += s.misses;
            r.delta_pages += s.delta_pages;
            r.delta_bytes += s.delta_bytes;
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[allow(clippy::cast_possible_truncation)] // test data: the low byte of a pattern.
    fn page(seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..PAGE)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    /// A page re-dirtied a few lines at a time comes back exact from a small delta; an
    /// unchanged page from an empty one; a page rewritten whole is not worth a delta.
    #[test]
    fn deltas_round_trip_and_stay_small() {
        let old = page(1);
        let mut new = old.clone();
        let other = page(2);
        for line in [0usize, 5, 6, 7, 63] {
            new[line * 64..(line + 1) * 64].copy_from_slice(&other[line * 64..(line + 1) * 64]);
        }
        new[4095] ^= 1;
        let mut d = vec![0xee]; // `encode` appends
        assert!(encode(&old, &new, &mut d, PAGE - 1));
        let d = &d[1..];
        assert!(d.len() < 5 * 64 + 16, "{} bytes", d.len());
        check(d).unwrap();
        let mut got = old.clone();
        apply(d, &mut got).unwrap();
        assert_eq!(got, new);

        let mut empty = Vec::new();
        assert!(encode(&old, &old, &mut empty, PAGE - 1));
        assert!(empty.is_empty());
        let mut same = old.clone();
        apply(&empty, &mut same).unwrap();
        assert_eq!(same, old);

        let mut whole = vec![1, 2, 3];
        assert!(!encode(&old, &other, &mut whole, PAGE - 1));
        assert_eq!(whole, [1, 2, 3], "a refused delta leaves `out` alone");
        // Spans far into the page need two-byte varints.
        let mut far = old.clone();
        far[300 * 8] ^= 0xff;
        far[511 * 8 + 7] ^= 0xff;
        let mut d = Vec::new();
        assert!(encode(&old, &far, &mut d, PAGE - 1));
        assert_eq!(d.len(), 2 + 1 + 8 + 2 + 1 + 8);
        let mut got = old.clone();
        apply(&d, &mut got).unwrap();
        assert_eq!(got, far);
    }

    /// Spans outside the page, empty spans, overlong or truncated varints, truncated bytes,
    /// deltas as large as a page, and pages of the wrong size are refused, the page untouched.
    #[test]
    fn malformed_deltas_are_refused() {
        let span =
            |skip: &[u8], len: &[u8], bytes: usize| [skip, len, &vec![7u8; bytes][..]].concat();
        for bad in [
            span(&[0], &[0], 0),                                               // empty span
            span(&[0x80, 0x04], &[1], 8),       // word 512: past the end
            span(&[0xff, 0x03], &[2], 16),      // words 511-512
            span(&[0], &[0x81, 0x04], 8),       // 513 words
            span(&[0x80, 0x00], &[1], 8),       // overlong varint
            span(&[0x80, 0x80, 0x01], &[1], 8), // three-byte varint
            span(&[0], &[2], 15),               // truncated bytes
            vec![0x80],                         // truncated varint
            [span(&[0], &[1], 8), vec![0]].concat(), // a header cut short
            [span(&[10], &[0xf4, 0x03], 4000), span(&[0], &[3], 24)].concat(), // second one past the end
        ] {
            assert!(check(&bad).is_err(), "{:?}", &bad[..bad.len().min(6)]);
            let mut p = page(3);
            assert!(apply(&bad, &mut p).is_err());
            assert_eq!(p, page(3));
        }
        assert!(check(&span(&[0], &[1], 8)).is_ok());
        assert!(check(&vec![0u8; PAGE]).is_err());
        assert!(apply(&[], &mut [0u8; 100]).is_err());
    }

    /// The cache gives back the version stored for exactly that page, counts hits and misses,
    /// forgets pages sent another way, and keeps the last pages of a connection in distinct
    /// slots.
    #[test]
    fn cache_keeps_last_versions() {
        let block = 2 << 20;
        let cache = DeltaCache::new(64 * PAGE as u64, 2, block);
        assert_eq!((cache.bytes(), cache.pages()), (64 * PAGE as u64, 64));
        let mut part = cache.part(1);
        // Connection 1 carries blocks 1, 3, 5...: pages 512-1023, 1536-2047...
        let pages: Vec<u64> = (0..32).map(|p| block + p * PAGE as u64).collect();
        for (i, &gpa) in pages.iter().enumerate() {
            assert!(part.lookup(gpa).is_none());
            part.store(gpa, &page(i as u64), 1);
        }
        for (i, &gpa) in pages.iter().enumerate() {
            assert_eq!(part.lookup(gpa), Some(&page(i as u64)[..]), "page {i}");
        }
        // The same slot's other page (32 slots later, in this connection's numbering) takes
        // it only from a version two rounds old; the page itself refreshes it any time.
        let aliased = block + 32 * PAGE as u64;
        assert!(part.lookup(aliased).is_none());
        part.store(aliased, &page(99), 2);
        assert!(part.contains(pages[0]) && !part.contains(aliased));
        part.store(pages[0], &page(98), 2);
        assert_eq!(part.lookup(pages[0]), Some(&page(98)[..]));
        part.store(aliased, &page(99), 3);
        assert!(part.contains(pages[0]) && !part.contains(aliased));
        part.store(aliased, &page(99), 4);
        assert!(!part.contains(pages[0]) && part.contains(aliased));
        part.forget(block, 3);
        assert!(!part.contains(pages[1]) && !part.contains(pages[2]) && part.contains(pages[3]));
        part.forget(0, 1 << 20);
        assert!((0..32).all(|i| !part.contains(block + i * PAGE as u64)));
        part.sent_deltas(1, 100);
        drop(part);
        let r = cache.report();
        assert_eq!((r.hits, r.misses, r.delta_pages), (33, 33, 1));
        assert_eq!(r.bytes_saved(), PAGE as u64 - 100);
        assert!((r.hit_rate() - 0.5).abs() < 1e-9);
        // A cache of no pages holds nothing.
        let none = DeltaCache::new(0, 4, block);
        none.part(0).store(0, &page(1), 1);
        assert!(none.part(0).lookup(0).is_none());
        assert_eq!(none.report().misses, 0);
    }
}
