//! KVM Userfault (the KVM Userfault series, not upstream): a memslot with `KVM_MEM_USERFAULT`
//! and a userfault bitmap makes every vCPU access to a page whose bit is set leave `KVM_RUN`
//! with `KVM_EXIT_MEMORY_FAULT` and `KVM_MEMORY_EXIT_FLAG_USERFAULT`, before KVM maps the page.
//! The VMM installs the page (guest_memfd `write()`, a copy through the host mapping), clears
//! the bit and runs the vCPU again.
//!
//! It is the one way to demand page a guest_memfd region: KVM maps guest_memfd pages for the
//! guest straight from the file, never through the host mapping, so userfaultfd on that mapping
//! sees only the VMM's own accesses. It catches only vCPU accesses: KVM's and the VMM's own
//! accesses to the host mapping are not trapped by it (the pager registers the mapping with
//! userfaultfd for those where the kernel lets it, else serves them before the VMM reads).
//!
//! [`UserfaultBitmap`] is the bitmap KVM reads; [`UserfaultRouter`] (one per
//! [`crate::GuestMemory`]) hands each exit to the handler of the range it falls in.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use crate::PAGE_SIZE;

/// One bit per 4 KiB page of a memslot, as KVM reads it (`unsigned long` words, bit `p % 64`
/// of word `p / 64` for page `p`): set means a vCPU access to the page exits to the VMM.
/// Bits are only cleared (a page, once installed, stays); KVM reads the words while vCPUs run.
#[derive(Debug)]
pub struct UserfaultBitmap {
    words: Box<[AtomicU64]>,
    pages: u64,
}

impl UserfaultBitmap {
    /// A bitmap for `bytes` of guest memory with every page's bit set.
    pub fn all_set(bytes: u64) -> UserfaultBitmap {
        let pages = bytes.div_ceil(PAGE_SIZE);
        let words = (0..pages.div_ceil(64))
            .map(|w| {
                let left = pages - w * 64;
                AtomicU64::new(if left >= 64 {
                    u64::MAX
                } else {
                    (1u64 << left) - 1
                })
            })
            .collect();
        UserfaultBitmap { words, pages }
    }

    /// The pages it covers.
    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// The address KVM reads the bitmap from (`kvm_userspace_memory_region2.userfault_bitmap`).
    pub fn addr(&self) -> u64 {
        self.words.as_ptr() as u64
    }

    /// Whether page `page`'s bit is set (a vCPU access to it still exits).
    pub fn is_set(&self, page: u64) -> bool {
        page < self.pages
            && self.words[(page / 64) as usize].load(Ordering::Acquire) & (1 << (page % 64)) != 0
    }

    /// Whether any bit of pages `[first, first + count)` is set.
    pub fn any_set(&self, first: u64, count: u64) -> bool {
        (first..(first + count).min(self.pages)).any(|p| self.is_set(p))
    }

    /// Clears the bits of pages `[first, first + count)`: vCPU accesses to them no longer exit.
    /// Release ordering: the page's bytes, installed before, are visible to whoever sees the bit
    /// clear.
    pub fn clear(&self, first: u64, count: u64) {
        let end = (first + count).min(self.pages);
        let mut page = first;
        while page < end {
            let word = page / 64;
            let lo = page % 64;
            let hi = (end - word * 64).min(64);
            let mask = if hi - lo == 64 {
                u64::MAX
            } else {
                ((1u64 << (hi - lo)) - 1) << lo
            };
            self.words[word as usize].fetch_and(!mask, Ordering::Release);
            page = word * 64 + hi;
        }
    }

    /// How many bits are still set.
    pub fn count_set(&self) -> u64 {
        self.words
            .iter()
            .map(|w| u64::from(w.load(Ordering::Acquire).count_ones()))
            .sum()
    }
}

/// What a KVM Userfault exit is handed to: makes the page at `gpa` present and clears its
/// bit before returning, so that the vCPU can run again.
pub trait UserfaultHandler: Send + Sync {
    /// Serves a vCPU's access to `[gpa, gpa + size)`; an error stops that vCPU.
    fn handle(&self, gpa: u64, size: u64) -> std::result::Result<(), String>;
}

/// One route: guest address, bytes, and the handler of that range.
type Route = (u64, u64, Arc<dyn UserfaultHandler>);

/// The handlers of one VM's userfault memslots, by guest range.
#[derive(Default)]
pub struct UserfaultRouter {
    routes: RwLock<Vec<Route>>,
}

impl std::fmt::Debug for UserfaultRouter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let routes = self.routes.read().expect("userfault routes lock");
        f.debug_list()
            .entries(routes.iter().map(|(gpa, size, _)| (gpa, size)))
            .finish()
    }
}

impl UserfaultRouter {
    /// Hands exits in `[gpa, gpa + size)` to `handler` from now on.
    pub fn add(&self, gpa: u64, size: u64, handler: Arc<dyn UserfaultHandler>) {
        let mut routes = self.routes.write().expect("userfault routes lock");
        routes.retain(|(g, _, _)| *g != gpa);
        routes.push((gpa, size, handler));
    }

    /// Stops handing exits at `gpa`'s range to its handler.
    pub fn remove(&self, gpa: u64) {
        let mut routes = self.routes.write().expect("userfault routes lock");
        routes.retain(|(g, _, _)| *g != gpa);
    }

    /// Serves a KVM Userfault exit at `gpa`: the handler of the range holding it, or an error
    /// naming the address when no handler covers it (a bit set with nobody to clear it).
    pub fn handle(&self, gpa: u64, size: u64) -> std::result::Result<(), String> {
        let handler = {
            let routes = self.routes.read().expect("userfault routes lock");
            routes
                .iter()
                .find(|(g, s, _)| gpa >= *g && gpa < g + s)
                .map(|(_, _, h)| h.clone())
        };
        match handler {
            Some(h) => h.handle(gpa, size),
            None => Err(format!(
                "KVM Userfault exit at guest address {gpa:#x} (+{size:#x}), which no pager serves"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Clearing ranges that start and end inside words, and span several, clears exactly
    /// those bits and leaves the others set.
    #[test]
    fn clear_touches_exactly_the_range() {
        let b = UserfaultBitmap::all_set(200 * PAGE_SIZE);
        assert_eq!(b.count_set(), 200);
        b.clear(3, 5);
        b.clear(60, 70);
        assert_eq!(b.count_set(), 200 - 5 - 70);
        for p in 0..200 {
            let cleared = (3..8).contains(&p) || (60..130).contains(&p);
            assert_eq!(b.is_set(p), !cleared, "page {p}");
        }
        assert!(!b.any_set(60, 70));
        assert!(b.any_set(59, 2));
        b.clear(0, 1000);
        assert_eq!(b.count_set(), 0);
    }
}
