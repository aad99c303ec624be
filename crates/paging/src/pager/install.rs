//! Putting a chunk in place: fetching it from the source and installing it with `UFFDIO_COPY`,
//! or filling the page cache and mapping it with `UFFDIO_CONTINUE`; the peer's let-go check.

use guestmem_sys::to_usize;
use std::io;
use std::sync::atomic::Ordering;

use guestmem_memory::PageBuf;
use userfaultfd::{FaultKind, Uffd};

use super::{By, Mode, Shared, BACKGROUND_BOUNCE_MAX};
use crate::{Error, Result, UffdError};

impl Shared {
    /// Fetches `chunk` from the source and maps it into the region. `Ok(false)`: the mapping
    /// was changing under us (EAGAIN); try again later.
    pub(super) fn install(
        &self,
        chunks: std::ops::Range<usize>,
        shard: usize,
        bounce: &mut PageBuf,
        by: By,
    ) -> Result<bool> {
        if self.mode == Mode::Shared {
            return self.install_shared(chunks, shard, bounce, by);
        }
        let uffd = &self.uffds[shard];
        let (start, len) = self.byte_range(chunks);
        if self.mode == Mode::Copy
            && self.page == 4096
            && self.source.is_zero(start, len)
            && self.zero_chunk(uffd, start, len)
        {
            return Ok(true);
        }
        match self.mode {
            Mode::Copy if self.source.mapped().is_some() => self.copy_mapped(uffd, start, len),
            Mode::Copy => self.copy_fetched(uffd, start, len, bounce, by),
            Mode::Continue if self.source.mapped().is_some() => {
                self.continue_mapped(uffd, start, len)
            }
            Mode::Shared => unreachable!("served by install_shared"),
            Mode::Continue => self.continue_fetched(uffd, start, len, by),
        }
    }

    /// Maps zero pages over a chunk the source says is all zeros; false when it was partly
    /// populated (EEXIST) or changing: the copy handles those cases.
    fn zero_chunk(&self, uffd: &Uffd, start: u64, len: u64) -> bool {
        // SAFETY: the range is the chunk, inside the registered region.
        let zeroed = unsafe {
            uffd.zeropage(
                (self.host + to_usize(start)) as *mut libc::c_void,
                to_usize(len),
                true,
            )
        };
        matches!(zeroed, Ok(n) if n as u64 == len)
    }

    /// `UFFDIO_COPY` of a chunk straight from a mapped source.
    fn copy_mapped(&self, uffd: &Uffd, start: u64, len: u64) -> Result<bool> {
        let src = self.source.mapped().expect("checked");
        // SAFETY: the pager checked that the source holds at least the region's size.
        let src = unsafe { src.add(to_usize(start)) };
        // Map the chunk's source pages in one call rather than one fault each inside
        // the copy (the source stays lazy: only this chunk is read).
        // SAFETY: advice on the source's own read-only mapping; it changes nothing.
        unsafe {
            libc::madvise(
                src as *mut libc::c_void,
                to_usize(len),
                libc::MADV_POPULATE_READ,
            )
        };
        let copied = self.copy(uffd, src, start, len).map_err(|e| match e {
            e @ Error::Released { .. } => e,
            e => Error::SourceFailed {
                region: self.region.clone(),
                gpa: self.gpa + start,
                len,
                attempts: 1,
                source: io::Error::other(e),
            },
        })?;
        if copied {
            uffd.wake(
                (self.host + to_usize(start)) as *mut libc::c_void,
                to_usize(len),
            )
            .map_err(|e| self.uffd_error("UFFDIO_WAKE", e))?;
        }
        Ok(copied)
    }

    /// `UFFDIO_COPY` of a chunk fetched from the source through the bounce buffer.
    fn copy_fetched(
        &self,
        uffd: &Uffd,
        start: u64,
        len: u64,
        bounce: &mut PageBuf,
        by: By,
    ) -> Result<bool> {
        // A background run is fetched as one request (up to BACKGROUND_BOUNCE_MAX):
        // pieces of the fault-sized bounce would each be a round trip.
        let size = to_usize(match by {
            By::Background => len.min(BACKGROUND_BOUNCE_MAX).max(self.bounce),
            _ => self.bounce,
        });
        bounce.grow_to(size);
        // The chunk is fetched as one range and copied in as its pieces arrive.
        let mut copied = Ok(true);
        self.fetch(start, len, &mut bounce[..size], by, &mut |off, piece| {
            copied = self.copy(uffd, piece.as_ptr(), off, piece.len() as u64);
            matches!(copied, Ok(true))
        })?;
        if !copied? {
            return Ok(false);
        }
        uffd.wake(
            (self.host + to_usize(start)) as *mut libc::c_void,
            to_usize(len),
        )
        .map_err(|e| self.uffd_error("UFFDIO_WAKE", e))?;
        Ok(true)
    }

    /// Fills a memfd chunk's page cache from a mapped source with `pwrite`, then maps it.
    fn continue_mapped(&self, uffd: &Uffd, start: u64, len: u64) -> Result<bool> {
        let src = self.source.mapped().expect("checked");
        let mut done = 0u64;
        while done < len {
            // SAFETY: the pager checked that the source holds at least the region's
            // size; `pwrite` reads `len - done` bytes of it into the memfd's page cache
            // at the chunk's offset (whole pages: nothing is zeroed first). No one else
            // writes the chunk while we hold it in FETCHING.
            let n = unsafe {
                libc::pwrite(
                    self.memfd,
                    src.add(to_usize(start + done)).cast(),
                    to_usize(len - done),
                    (start + done) as libc::off_t,
                )
            };
            if n <= 0 {
                let e = io::Error::last_os_error();
                if n < 0 && e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(Error::SourceFailed {
                    region: self.region.clone(),
                    gpa: self.gpa + start + done,
                    len: len - done,
                    attempts: 1,
                    source: e,
                });
            }
            done += n as u64;
        }
        self.map_page_cache(uffd, start, len)
    }

    /// Fills a memfd chunk's page cache from the source through the alias, then maps it.
    fn continue_fetched(&self, uffd: &Uffd, start: u64, len: u64, by: By) -> Result<bool> {
        // SAFETY: the chunk lies inside the alias mapping, and no one else writes it
        // while we hold it in FETCHING (the guest's mapping of it is not populated yet,
        // so the guest cannot reach these pages).
        let dst = unsafe {
            std::slice::from_raw_parts_mut((self.alias + to_usize(start)) as *mut u8, to_usize(len))
        };
        // Allocate the chunk's page-cache pages in one call rather than one fault each.
        // SAFETY: advice on our own alias mapping; it changes no contents.
        unsafe {
            libc::madvise(
                dst.as_mut_ptr().cast(),
                dst.len(),
                libc::MADV_POPULATE_WRITE,
            )
        };
        // A source may hand its pieces from its own buffers (the chunk store does):
        // each piece lands at its place in the alias unless it is already there.
        let alias = dst.as_mut_ptr();
        self.fetch(start, len, dst, by, &mut |at, piece| {
            // SAFETY: the source hands pieces inside `[start, start + len)`, so
            // `at - start + piece.len() <= len` bytes fit the chunk's alias range;
            // `copy` allows the piece to overlap it (a source filling `dst` itself).
            unsafe {
                let to = alias.add(to_usize(at - start));
                if !std::ptr::eq(to, piece.as_ptr()) {
                    std::ptr::copy(piece.as_ptr(), to, piece.len());
                }
            }
            true
        })?;
        self.map_page_cache(uffd, start, len)
    }

    /// A page of an installed chunk faulted again (see `on_fault`).
    pub(super) fn refill_page(
        &self,
        shard: usize,
        off: u64,
        kind: FaultKind,
        bounce: &mut PageBuf,
    ) {
        let uffd = &self.uffds[shard];
        let result = match self.mode {
            Mode::Shared => self.refill_shared(uffd, off),
            Mode::Copy => {
                bounce.grow_to(to_usize(self.page));
                bounce[..to_usize(self.page)].fill(0);
                self.copy(uffd, bounce.as_ptr(), off, self.page)
            }
            Mode::Continue => {
                if kind == FaultKind::Missing {
                    // A hole in the file (MADV_REMOVE): a read through the alias allocates a
                    // zeroed page-cache page without overwriting anything.
                    // SAFETY: `off` is inside the alias mapping.
                    unsafe { std::ptr::read_volatile((self.alias + to_usize(off)) as *const u8) };
                }
                self.map_page_cache(uffd, off, self.page)
            }
        };
        let _ = uffd.wake(
            (self.host + to_usize(off)) as *mut libc::c_void,
            to_usize(self.page),
        );
        // After retirement the range is unregistered (which woke the vCPU): nothing to refill.
        if self.retired.load(Ordering::Acquire) {
            return;
        }
        if let Err(e) = result {
            tracing::warn!(region = %self.region, "refilling a discarded page: {}", guestmem_sys::error_chain(&e, ": "));
        }
    }

    /// Fetches `[off, off + len)` through `buf` into `sink` (see [`PageSource::fetch_pieces`]),
    /// retrying a failed fetch from the first byte `sink` has not had yet.
    pub(super) fn fetch(
        &self,
        off: u64,
        len: u64,
        buf: &mut [u8],
        by: By,
        sink: &mut dyn FnMut(u64, &[u8]) -> bool,
    ) -> Result<()> {
        let urgent = matches!(by, By::Fault | By::Readahead);
        let end = off + len;
        let mut next = off;
        let mut last = None;
        for attempt in 1..=self.fetch_attempts {
            let fetched =
                self.source
                    .fetch_pieces(next, end - next, buf, urgent, &mut |at, piece| {
                        next = at + piece.len() as u64;
                        sink(at, piece)
                    });
            match fetched {
                Ok(()) => return Ok(()),
                Err(e) => {
                    tracing::warn!(region = %self.region, gpa = self.gpa + next, attempt, "page source: {}", guestmem_sys::error_chain(&e, ": "));
                    last = Some(e);
                    if attempt < self.fetch_attempts {
                        std::thread::sleep(self.retry_delay);
                    }
                }
            }
        }
        Err(Error::SourceFailed {
            region: self.region.clone(),
            gpa: self.gpa + next,
            len: end - next,
            attempts: self.fetch_attempts,
            source: last.expect("at least one attempt"),
        })
    }

    /// `UFFDIO_COPY` of `len` bytes from `src` to region offset `off`, without waking.
    /// Pages already present (`EEXIST`) are skipped; a partial copy (`EAGAIN`) continues with
    /// the rest. `Ok(false)` when the mapping is changing (nothing could be copied).
    pub(super) fn copy(&self, uffd: &Uffd, src: *const u8, off: u64, len: u64) -> Result<bool> {
        let mut done = 0u64;
        let mut page_by_page = false;
        while done < len {
            let n = if page_by_page { self.page } else { len - done };
            // SAFETY: `src + done` has `n` readable bytes (the caller's buffer of `len`), and
            // the destination lies inside the registered region.
            let r = unsafe {
                uffd.copy(
                    src.add(to_usize(done)).cast(),
                    (self.host + to_usize(off + done)) as *mut libc::c_void,
                    to_usize(n),
                    false,
                )
            };
            match r {
                Ok(copied) => done += copied as u64,
                Err(userfaultfd::Error::PartiallyCopied(copied)) if (copied as isize) > 0 => {
                    done += copied as u64;
                }
                Err(userfaultfd::Error::PartiallyCopied(_)) => return Ok(false),
                Err(userfaultfd::Error::CopyFailed(errno)) if errno as i32 == libc::EEXIST => {
                    if page_by_page {
                        done += self.page;
                    } else {
                        page_by_page = true;
                    }
                }
                Err(userfaultfd::Error::CopyFailed(errno))
                    if matches!(errno as i32, libc::ENOENT | libc::ESRCH)
                        && self.peer_let_go(off + done, n) =>
                {
                    return Err(Error::Released {
                        region: self.region.clone(),
                    })
                }
                Err(e) => return Err(self.uffd_error("UFFDIO_COPY", e)),
            }
        }
        Ok(true)
    }

    /// Whether the peer let go of region offset `[off, off + len)` (see [`PeerReleased`]).
    pub(super) fn peer_let_go(&self, off: u64, len: u64) -> bool {
        self.peer_released
            .as_ref()
            .is_some_and(|released| released(self.host as u64 + off, len))
    }

    /// The peer let go of the range: serving it ends (the background fetch stops), without a
    /// failure.
    pub(super) fn release(&self) {
        if self.released.swap(true, Ordering::AcqRel) {
            return;
        }
        tracing::info!(region = %self.region, "the peer no longer maps the range: serving it ends");
        self.signal_stop();
        let _guard = self
            .failure
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.changed.notify_all();
    }

    /// `UFFDIO_CONTINUE` over region offset `[off, off + len)` (waking the faulting threads),
    /// skipping pages already mapped.
    pub(super) fn map_page_cache(&self, uffd: &Uffd, off: u64, len: u64) -> Result<bool> {
        let mut done = 0u64;
        let mut page_by_page = false;
        while done < len {
            let n = if page_by_page { self.page } else { len - done };
            let addr = (self.host + to_usize(off + done)) as *mut libc::c_void;
            match uffd.r#continue(addr, to_usize(n), true) {
                Ok(mapped) if mapped > 0 => done += mapped,
                Ok(_) => return Ok(false),
                Err(userfaultfd::Error::SystemError(errno)) if errno as i32 == libc::EEXIST => {
                    if page_by_page {
                        done += self.page;
                    } else {
                        page_by_page = true;
                    }
                }
                Err(userfaultfd::Error::SystemError(errno)) if errno as i32 == libc::EAGAIN => {
                    return Ok(false)
                }
                Err(e) => return Err(self.uffd_error("UFFDIO_CONTINUE", e)),
            }
        }
        if page_by_page {
            let _ = uffd.wake(
                (self.host + to_usize(off)) as *mut libc::c_void,
                to_usize(len),
            );
        }
        Ok(true)
    }

    pub(super) fn uffd_error(&self, op: &'static str, source: userfaultfd::Error) -> Error {
        Error::Uffd {
            region: self.region.clone(),
            op,
            source: UffdError(source),
        }
    }
}
