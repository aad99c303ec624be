//! Population: filling a region range from a source (a byte slice or an fd) on the critical path
//! of every VM start, by the fastest mechanism the kernel and backend offer.
//!
//! - guest_memfd with `write()`: `pwrite` on the fd, no host page tables at all. Found
//!   by trying it on the region's own fd (an errno means "not here", never a flag number).
//! - memfd: `pwrite`, split across threads (the kernel copies into the page cache; no host page
//!   tables are built).
//! - guest_memfd without `write()`, anon, hugetlb: allocate the pages without faulting
//!   (`fallocate(KEEP_SIZE)` on fd backends), map them in one call (`MADV_POPULATE_WRITE`), then
//!   copy, split across threads.
//!
//! Pages of the source that are all zero are not copied: a fresh region already reads zero
//! there. They are discarded instead (`fallocate(PUNCH_HOLE)`, `MADV_DONTNEED`: nearly free on
//! memory that was never touched), so that a reused range reads zero too.
//!
//! The source is read completely and every argument is checked before the first byte is
//! written: a bad input never leaves a half-written range.

use guestmem_sys::to_usize;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::numa::set_thread_policy;
use crate::{Backend, Error, NumaMode, Region, Result};

/// Where population reads from.
#[derive(Debug, Clone, Copy)]
pub enum PopulateFrom<'a> {
    /// Bytes already in memory.
    Bytes(&'a [u8]),
    /// `len` bytes of a file or any other fd (pipe, memfd, socket) starting at `offset`
    /// (`offset` must be 0 for fds that cannot seek).
    Fd {
        /// The fd.
        fd: BorrowedFd<'a>,
        /// Where its bytes start.
        offset: u64,
    },
}

impl<'a> PopulateFrom<'a> {
    /// A whole file, from its start.
    pub fn file(file: &'a File) -> PopulateFrom<'a> {
        PopulateFrom::Fd {
            fd: file.as_fd(),
            offset: 0,
        }
    }
}

/// How the bytes reached the region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Method {
    /// `pwrite` on a guest_memfd created with write support (guest_memfd write()).
    GmemWrite,
    /// `pwrite` on the region's memfd.
    Pwrite,
    /// `fallocate(KEEP_SIZE)` (fd backends), `MADV_POPULATE_WRITE`, then a copy through the
    /// mapping, split across threads.
    PopulateCopy,
    /// A plain copy through the mapping, faulting page by page: the baseline.
    Memcpy,
}

impl Method {
    /// The method's name (as reported).
    pub fn name(self) -> &'static str {
        match self {
            Method::GmemWrite => "gmem write",
            Method::Pwrite => "pwrite",
            Method::PopulateCopy => "populate+copy",
            Method::Memcpy => "memcpy",
        }
    }

    /// The methods that can write into `backend` (`GmemWrite` only if the fd accepts `write()`).
    pub fn candidates(backend: Backend) -> &'static [Method] {
        match backend {
            Backend::GuestMemfd => &[Method::GmemWrite, Method::PopulateCopy, Method::Memcpy],
            Backend::Memfd => &[Method::Pwrite, Method::PopulateCopy, Method::Memcpy],
            // hugetlbfs has no write().
            Backend::Anon | Backend::MemfdHugetlb | Backend::Hugetlbfs => {
                &[Method::PopulateCopy, Method::Memcpy]
            }
        }
    }
}

impl std::fmt::Display for Method {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What one population did.
#[derive(Debug, Clone, Serialize)]
pub struct Populated {
    /// How the region was filled.
    pub method: Method,
    /// Why a faster method was not used (e.g. guest_memfd `write()` absent), if one was passed.
    pub fallback_reason: Option<String>,
    /// Bytes filled.
    pub bytes: u64,
    /// Pages (of the backend's page size) copied, and skipped because they were all zero.
    pub pages_copied: u64,
    /// Pages skipped because they were all zero.
    pub zero_pages_skipped: u64,
    /// Threads that copied.
    pub threads: usize,
    #[serde(skip)]
    /// How long it took.
    pub elapsed: Duration,
}

/// Fills `[offset, offset + len)` of `region` from `source`, choosing the fastest method (see
/// the module documentation), and marks the range in the region's VMM dirty marks.
pub fn populate(region: &Region, offset: u64, len: u64, source: PopulateFrom) -> Result<Populated> {
    populate_with(region, offset, len, source, None)
}

/// [`populate`] with a chosen method (`None`: the fastest available). A method the backend
/// cannot use is an error; `GmemWrite` on a guest_memfd without `write()` falls back to
/// `PopulateCopy` and says why in [`Populated::fallback_reason`].
pub fn populate_with(
    region: &Region,
    offset: u64,
    len: u64,
    source: PopulateFrom,
    method: Option<Method>,
) -> Result<Populated> {
    let start = Instant::now();
    check_range(region, offset, len)?;
    let candidates = Method::candidates(region.backend());
    // The fastest measured here (docs/benchmarks.md, guest_memfd write()).
    let mut method = method.unwrap_or(match region.backend() {
        Backend::GuestMemfd => Method::GmemWrite,
        Backend::Memfd => Method::Pwrite,
        Backend::Anon | Backend::MemfdHugetlb | Backend::Hugetlbfs => Method::PopulateCopy,
    });
    if !candidates.contains(&method) {
        return Err(Error::Populate {
            region: region.name().to_string(),
            reason: format!(
                "method '{method}' cannot write into the {} backend",
                region.backend()
            ),
        });
    }
    let source = LoadedBytes::load(region, len, source)?;
    let bytes = source.as_slice();
    let page = to_usize(region.backend().page_size());
    region.vmm_dirty().mark(offset, len);

    // Try guest_memfd write() on the first page to be copied (the threads write it again).
    let mut fallback_reason = None;
    if method == Method::GmemWrite {
        let first = bytes
            .chunks(page)
            .position(|p| !is_zero(p))
            .map(|i| i * page);
        let tried = first.map(|at| pwrite_all(region, offset + at as u64, &bytes[at..at + page]));
        match tried {
            Some(Ok(())) => {}
            Some(Err(e)) => {
                fallback_reason = Some(format!("guest_memfd write() unavailable: {e}"));
                method = Method::PopulateCopy;
            }
            None => method = Method::PopulateCopy, // all zero: nothing to write
        }
    }

    // Two threads per core: building the host page tables waits on the hypervisor here
    // (kvm_pvm), and a second thread per core overlaps those waits (512 MiB of guest_memfd:
    // 0.39-0.44x memcpy with 4 threads against 0.45-0.51x with 2, side by side).
    let threads = match method {
        Method::Memcpy => 1,
        _ => 2 * std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
    };
    // Each thread gets an equal share of whole pages.
    let pages = bytes.len() / page;
    let per_thread = pages.div_ceil(threads).max(1);
    let results: Vec<Result<(u64, u64)>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let lo = (t * per_thread * page).min(bytes.len());
                let hi = ((t + 1) * per_thread * page).min(bytes.len());
                s.spawn(move || fill(region, offset, bytes, lo, hi, method))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("population thread panicked"))
            .collect()
    });
    let (mut copied, mut skipped) = (0, 0);
    for r in results {
        let (c, z) = r?;
        copied += c;
        skipped += z;
    }
    Ok(Populated {
        method,
        fallback_reason,
        bytes: len,
        pages_copied: copied,
        zero_pages_skipped: skipped,
        threads,
        elapsed: start.elapsed(),
    })
}

fn check_range(region: &Region, offset: u64, len: u64) -> Result<()> {
    let page = region.backend().page_size();
    let bad = |reason: String| Error::Populate {
        region: region.name().to_string(),
        reason,
    };
    if len == 0 {
        return Err(bad("the length is zero".into()));
    }
    if !offset.is_multiple_of(page) || !len.is_multiple_of(page) {
        return Err(bad(format!(
            "offset {offset:#x} and length {len:#x} must be multiples of the {} backend's page size ({page:#x})",
            region.backend()
        )));
    }
    if offset
        .checked_add(len)
        .is_none_or(|end| end > region.size())
    {
        return Err(bad(format!(
            "range {offset:#x}+{len:#x} runs past the region's end ({:#x})",
            region.size()
        )));
    }
    Ok(())
}

/// Writes pages `[lo, hi)` of `bytes` (byte offsets, page-aligned) to the region at `offset`,
/// skipping all-zero pages. Returns (pages copied, zero pages skipped).
fn fill(
    region: &Region,
    offset: u64,
    bytes: &[u8],
    lo: usize,
    hi: usize,
    method: Method,
) -> Result<(u64, u64)> {
    let page = to_usize(region.backend().page_size());
    let policy = &region.spec().numa;
    if region.backend() == Backend::GuestMemfd && policy.mode != NumaMode::Default {
        // guest_memfd pages follow the allocating thread's policy (see `numa`).
        set_thread_policy(policy).map_err(|e| Error::os(region.spec(), "set_mempolicy", e))?;
    }
    let (mut copied, mut skipped) = (0u64, 0u64);
    let mut at = lo;
    while at < hi {
        // One run of pages that are all zero, or all not.
        let zero = is_zero(&bytes[at..at + page]);
        let mut end = at + page;
        while end < hi && is_zero(&bytes[end..end + page]) == zero {
            end += page;
        }
        let run = &bytes[at..end];
        let dst = offset + at as u64;
        let pages = (run.len() / page) as u64;
        if zero {
            discard(region, dst, run.len() as u64)?;
            skipped += pages;
        } else {
            match method {
                Method::GmemWrite | Method::Pwrite => pwrite_all(region, dst, run)
                    .map_err(|e| Error::os(region.spec(), "pwrite", e))?,
                Method::PopulateCopy => {
                    prefault(region, dst, run.len() as u64)?;
                    copy(region, dst, run);
                }
                Method::Memcpy => copy(region, dst, run),
            }
            copied += pages;
        }
        at = end;
    }
    Ok((copied, skipped))
}

/// Whether a page is all zero (word-wise OR, which the compiler vectorises).
fn is_zero(page: &[u8]) -> bool {
    let (head, words, tail) = {
        // SAFETY: reinterpreting initialised bytes as u64 words is valid for any bit pattern;
        // `align_to` puts only whole, aligned words in the middle slice.
        unsafe { page.align_to::<u64>() }
    };
    head.iter().all(|&b| b == 0)
        && tail.iter().all(|&b| b == 0)
        && words.iter().fold(0, |acc, &w| acc | w) == 0
}

fn copy(region: &Region, dst: u64, src: &[u8]) {
    // SAFETY: `check_range` put `dst + src.len()` inside the region's live mapping, and `src` is
    // a host buffer distinct from it; threads write disjoint ranges.
    unsafe {
        std::ptr::copy_nonoverlapping(
            src.as_ptr(),
            region.host_addr().add(to_usize(dst)),
            src.len(),
        );
    };
}

/// Allocates `[dst, dst + len)` without faulting (fd backends) and maps it in one call.
fn prefault(region: &Region, dst: u64, len: u64) -> Result<()> {
    if let Some(fd) = region.fd() {
        // SAFETY: fallocate on an fd we own, inside the file's size; KEEP_SIZE changes no size.
        let ret = unsafe {
            libc::fallocate(
                fd.as_raw_fd(),
                libc::FALLOC_FL_KEEP_SIZE,
                dst as libc::off_t,
                len as libc::off_t,
            )
        };
        if ret != 0 {
            return Err(Error::os(
                region.spec(),
                "fallocate(KEEP_SIZE)",
                io::Error::last_os_error(),
            ));
        }
    }
    // SAFETY: the range lies inside the region's mapping; MADV_POPULATE_WRITE only faults its
    // pages in, as the copy that follows would.
    let ret = unsafe {
        libc::madvise(
            region.host_addr().add(to_usize(dst)).cast(),
            to_usize(len),
            libc::MADV_POPULATE_WRITE,
        )
    };
    if ret != 0 {
        return Err(Error::os(
            region.spec(),
            "madvise(MADV_POPULATE_WRITE)",
            io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// Makes `[dst, dst + len)` read zero and hold no memory.
fn discard(region: &Region, dst: u64, len: u64) -> Result<()> {
    if let Some(fd) = region.fd() {
        return guestmem_sys::punch_hole(fd.as_fd(), dst, len)
            .map_err(|e| Error::os(region.spec(), "fallocate(PUNCH_HOLE)", e));
    }
    // SAFETY: the range lies inside the region's private anonymous mapping; DONTNEED makes it
    // read zero, which is what population wants there.
    let ret = unsafe {
        libc::madvise(
            region.host_addr().add(to_usize(dst)).cast(),
            to_usize(len),
            libc::MADV_DONTNEED,
        )
    };
    if ret != 0 {
        let e = io::Error::last_os_error();
        return Err(Error::os(region.spec(), "madvise(MADV_DONTNEED)", e));
    }
    Ok(())
}

/// `pwrite` of all of `data` at `dst` on the region's fd; a short write continues, zero bytes
/// written is an error.
pub(crate) fn pwrite_all(region: &Region, dst: u64, data: &[u8]) -> io::Result<()> {
    let fd = region
        .fd()
        .ok_or_else(|| io::Error::new(io::ErrorKind::Unsupported, "the region has no fd"))?;
    let mut done = 0usize;
    while done < data.len() {
        // SAFETY: `data[done..]` is a live buffer of that many readable bytes; `fd` is open.
        let n = unsafe {
            libc::pwrite(
                fd.as_raw_fd(),
                data[done..].as_ptr().cast(),
                data.len() - done,
                (dst + done as u64) as libc::off_t,
            )
        };
        match n {
            n if n > 0 => done += n as usize,
            0 => {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "pwrite wrote 0 bytes",
                ))
            }
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}

/// The source's `len` bytes: borrowed, a read-only mapping of a file, or read from a stream.
enum LoadedBytes<'a> {
    Borrowed(&'a [u8]),
    Mapped {
        addr: *mut libc::c_void,
        map_len: usize,
        skip: usize,
        len: usize,
    },
    Read(Vec<u8>),
}

impl<'a> LoadedBytes<'a> {
    fn load(region: &Region, len: u64, source: PopulateFrom<'a>) -> Result<LoadedBytes<'a>> {
        let short = |have: u64| Error::Populate {
            region: region.name().to_string(),
            reason: format!(
                "the source is short: it has {have:#x} bytes, the range needs {len:#x}"
            ),
        };
        match source {
            PopulateFrom::Bytes(b) if (b.len() as u64) < len => Err(short(b.len() as u64)),
            PopulateFrom::Bytes(b) => Ok(LoadedBytes::Borrowed(&b[..to_usize(len)])),
            PopulateFrom::Fd { fd, offset } => {
                let os = |op, e| Error::os(region.spec(), op, e);
                // SAFETY: fstat fills a zeroed stat of an fd the caller keeps open.
                let mut st: libc::stat = unsafe { std::mem::zeroed() };
                // SAFETY: as above.
                if unsafe { libc::fstat(fd.as_raw_fd(), &raw mut st) } != 0 {
                    return Err(os("fstat of the source", io::Error::last_os_error()));
                }
                if st.st_mode & libc::S_IFMT == libc::S_IFREG {
                    let have = (st.st_size as u64).saturating_sub(offset);
                    if have < len {
                        return Err(short(have));
                    }
                    let skip = (offset % crate::PAGE_SIZE) as usize;
                    let map_len = skip + to_usize(len);
                    // SAFETY: a fresh read-only private mapping of a regular file the caller
                    // keeps open, at a page-aligned offset inside it.
                    let addr = unsafe {
                        libc::mmap(
                            std::ptr::null_mut(),
                            map_len,
                            libc::PROT_READ,
                            libc::MAP_PRIVATE | libc::MAP_POPULATE,
                            fd.as_raw_fd(),
                            (offset - skip as u64) as libc::off_t,
                        )
                    };
                    if addr == libc::MAP_FAILED {
                        return Err(os("mmap of the source", io::Error::last_os_error()));
                    }
                    return Ok(LoadedBytes::Mapped {
                        addr,
                        map_len,
                        skip,
                        len: to_usize(len),
                    });
                }
                if offset != 0 {
                    return Err(Error::Populate {
                        region: region.name().to_string(),
                        reason: format!(
                            "the source fd is not a regular file, so it cannot start at offset {offset:#x}"
                        ),
                    });
                }
                let mut buf = vec![0u8; to_usize(len)];
                let mut done = 0usize;
                while done < buf.len() {
                    // SAFETY: `buf[done..]` is a live writable buffer of that many bytes.
                    let n = unsafe {
                        libc::read(
                            fd.as_raw_fd(),
                            buf[done..].as_mut_ptr().cast(),
                            buf.len() - done,
                        )
                    };
                    match n {
                        n if n > 0 => done += n as usize,
                        0 => return Err(short(done as u64)),
                        _ => {
                            let e = io::Error::last_os_error();
                            if e.kind() != io::ErrorKind::Interrupted {
                                return Err(os("read of the source", e));
                            }
                        }
                    }
                }
                Ok(LoadedBytes::Read(buf))
            }
        }
    }

    fn as_slice(&self) -> &[u8] {
        match self {
            LoadedBytes::Borrowed(b) => b,
            LoadedBytes::Mapped {
                addr, skip, len, ..
            } => {
                // SAFETY: the mapping is `map_len = skip + len` readable bytes, alive until drop.
                unsafe { std::slice::from_raw_parts((*addr as *const u8).add(*skip), *len) }
            }
            LoadedBytes::Read(v) => v,
        }
    }
}

impl Drop for LoadedBytes<'_> {
    fn drop(&mut self) {
        if let LoadedBytes::Mapped { addr, map_len, .. } = *self {
            // SAFETY: exactly the mapping made in `load`, unmapped once.
            unsafe { libc::munmap(addr, map_len) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn is_zero_sees_a_non_zero_byte_anywhere() {
        let mut page = vec![0u8; 4096 + 3];
        assert!(is_zero(&page));
        // Unaligned slices put bytes in the head and the tail as well as in the words.
        for at in [0, 1, 7, 8, 2048, 4095, 4096 + 2] {
            page[at] = 1;
            assert!(!is_zero(&page), "byte {at}");
            assert!(!is_zero(&page[at.min(1)..]), "byte {at}, unaligned");
            page[at] = 0;
        }
        assert!(is_zero(&page[1..]));
    }

    #[test]
    fn only_fd_backends_with_write_get_a_write_method() {
        assert_eq!(Method::candidates(Backend::Memfd)[0], Method::Pwrite);
        assert_eq!(
            Method::candidates(Backend::GuestMemfd)[0],
            Method::GmemWrite
        );
        for backend in [Backend::Anon, Backend::MemfdHugetlb, Backend::Hugetlbfs] {
            let methods = Method::candidates(backend);
            assert!(!methods.contains(&Method::Pwrite), "{backend:?}");
            assert!(!methods.contains(&Method::GmemWrite), "{backend:?}");
            assert_eq!(methods.last(), Some(&Method::Memcpy), "{backend:?}");
        }
    }
}
