//! A page-aligned, zeroed heap buffer, for the bytes on their way into or out of guest memory.
//!
//! Copies between such a buffer and guest memory (or the page cache, or a userfaultfd install)
//! run with source and destination page-aligned. `Vec<u8>`'s start is only 16-byte aligned, and
//! where in a cache line it falls depends on the heap's history: the kernel's and libc's
//! `rep movsb` copies run slower when it is not 64-byte aligned on some CPUs, so a snapshot
//! restore's speed depended on unrelated allocations made before it (measured:
//! docs/benchmarks.md, restore).

use guestmem_sys::to_usize;
use std::alloc::{self, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use crate::PAGE_SIZE;

/// A zeroed buffer of a fixed length whose first byte is page-aligned (when it has one).
pub struct PageBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a `PageBuf` owns its allocation exclusively, as a `Vec<u8>` does; `&PageBuf` only
// gives shared access to plain bytes.
unsafe impl Send for PageBuf {}
// SAFETY: as above: shared references only read the bytes.
unsafe impl Sync for PageBuf {}

/// From this length on, a buffer is its own anonymous mapping: its pages are zero until first
/// written, at no cost up front (an aligned heap allocation is zeroed byte by byte, which for
/// a chunk-sized buffer taken per read costs as much as the read).
const MAP_FROM: usize = 64 << 10;

impl PageBuf {
    /// `len` zero bytes, page-aligned.
    pub fn zeroed(len: usize) -> PageBuf {
        if len == 0 {
            return PageBuf {
                ptr: NonNull::dangling(),
                len,
            };
        }
        if len >= MAP_FROM {
            // SAFETY: a fresh private anonymous mapping; nothing else refers to the range.
            let addr = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if addr == libc::MAP_FAILED {
                alloc::handle_alloc_error(Self::layout(len))
            }
            return PageBuf {
                ptr: NonNull::new(addr.cast()).expect("mmap does not return null on success"),
                len,
            };
        }
        let layout = Self::layout(len);
        // SAFETY: `layout` has a non-zero size (checked above).
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(ptr) else {
            alloc::handle_alloc_error(layout)
        };
        PageBuf { ptr, len }
    }

    /// Makes it at least `len` bytes long: a shorter buffer is replaced by a zeroed one of
    /// `len` bytes (what it held is not kept: it is a bounce buffer, refilled for each use).
    pub fn grow_to(&mut self, len: usize) {
        if self.len < len {
            *self = PageBuf::zeroed(len);
        }
    }

    fn layout(len: usize) -> Layout {
        Layout::from_size_align(len, to_usize(PAGE_SIZE)).expect("a buffer length below isize::MAX")
    }
}

impl Deref for PageBuf {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialized (zeroed, then written through `&mut`) bytes
        // this buffer owns (or is dangling with `len` 0, which a slice allows).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for PageBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for PageBuf {
    fn drop(&mut self) {
        if self.len >= MAP_FROM {
            // SAFETY: mapped in `zeroed` with this very length, unmapped only here; no slice
            // into it outlives `self`.
            unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
        } else if self.len != 0 {
            // SAFETY: allocated in `zeroed` with this very layout, and freed only here.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) }
        }
    }
}

impl std::fmt::Debug for PageBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageBuf").field("len", &self.len).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_aligned_zeroed_and_writable() {
        for len in [0usize, 1, 4096, 5000, MAP_FROM - 1, MAP_FROM, 2 << 20] {
            let mut b = PageBuf::zeroed(len);
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|&x| x == 0));
            if len > 0 {
                let mut g = PageBuf::zeroed(1);
                g.grow_to(len);
                assert!(
                    g.len() >= len && (g.as_ptr() as usize).is_multiple_of(to_usize(PAGE_SIZE))
                );
                assert!(
                    (b.as_ptr() as usize).is_multiple_of(to_usize(PAGE_SIZE)),
                    "len {len}"
                );
                b[len - 1] = 7;
                assert_eq!(b[len - 1], 7);
            }
        }
    }
}
