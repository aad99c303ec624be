//! Pages the VMM itself wrote into guest memory (population, device emulation). KVM's dirty log
//! sees only the guest's writes; a dirty tracker merges these marks in so nothing is missed.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::PAGE_SIZE;

/// One bit per guest page of a region, set by any thread, taken (read and cleared) by the tracker.
#[derive(Debug)]
pub struct DirtyMarks {
    words: Vec<AtomicU64>,
    /// Bit `i` of summary word `s`: word `64 * s + i` may have marks (so that taking the marks
    /// of a huge, mostly clean region costs little).
    summary: Vec<AtomicU64>,
    pages: u64,
}

impl DirtyMarks {
    /// No marks, for a region of `bytes`.
    pub fn new(bytes: u64) -> DirtyMarks {
        let pages = bytes.div_ceil(PAGE_SIZE);
        let words = pages.div_ceil(64);
        DirtyMarks {
            words: (0..words).map(|_| AtomicU64::new(0)).collect(),
            summary: (0..words.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
            pages,
        }
    }

    /// Marks every page overlapping `[offset, offset + len)` of the region.
    pub fn mark(&self, offset: u64, len: u64) {
        if len == 0 {
            return;
        }
        let first = offset / PAGE_SIZE;
        let last = ((offset + len - 1) / PAGE_SIZE).min(self.pages - 1);
        let mut page = first;
        while page <= last {
            let bit = page % 64;
            let n = (64 - bit).min(last - page + 1);
            let mask = if n == 64 {
                u64::MAX
            } else {
                ((1u64 << n) - 1) << bit
            };
            let word = page / 64;
            self.words[word as usize].fetch_or(mask, Ordering::Release);
            self.summary[(word / 64) as usize].fetch_or(1 << (word % 64), Ordering::Release);
            page += n;
        }
    }

    /// Takes the marks: returns the bitmap (bit `i` of word `w` = page `64 * w + i`) and clears it.
    pub fn take(&self) -> Vec<u64> {
        let mut bits = vec![0; self.words.len()];
        self.take_each(|w, b| bits[w] = b);
        bits
    }

    /// Takes the marks word by word: calls `f(w, bits)` for each non-zero word `w` (bit `i` =
    /// page `64 * w + i`) and clears it. Costs in proportion to the marked words, not the region.
    pub fn take_each(&self, mut f: impl FnMut(usize, u64)) {
        for (s, summary) in self.summary.iter().enumerate() {
            let mut group = summary.swap(0, Ordering::AcqRel);
            while group != 0 {
                let w = s * 64 + group.trailing_zeros() as usize;
                group &= group - 1;
                let bits = self.words[w].swap(0, Ordering::AcqRel);
                if bits != 0 {
                    f(w, bits);
                }
            }
        }
    }

    /// Whether a page is marked, without clearing it.
    pub fn is_marked(&self, page: u64) -> bool {
        page < self.pages
            && self.words[(page / 64) as usize].load(Ordering::Acquire) & (1 << (page % 64)) != 0
    }

    /// Pages the marks cover.
    pub fn pages(&self) -> u64 {
        self.pages
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_cover_partial_pages_and_take_clears() {
        let m = DirtyMarks::new(200 * PAGE_SIZE);
        m.mark(PAGE_SIZE - 1, 2); // pages 0 and 1
        m.mark(63 * PAGE_SIZE, 70 * PAGE_SIZE); // pages 63..=132
        assert!(m.is_marked(0) && m.is_marked(1) && !m.is_marked(2));
        let bits = m.take();
        let pages: Vec<u64> = (0..200)
            .filter(|p| bits[(p / 64) as usize] & (1 << (p % 64)) != 0)
            .collect();
        let expected: Vec<u64> = [0, 1].into_iter().chain(63..=132).collect();
        assert_eq!(pages, expected);
        assert!(m.take().iter().all(|&w| w == 0));
        m.mark(199 * PAGE_SIZE, 1);
        let mut seen = vec![];
        m.take_each(|w, b| seen.push((w, b)));
        assert_eq!(seen, [(3, 1 << 7)]);
    }
}
