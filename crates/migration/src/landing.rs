//! Landing pre-copy's pages in the destination's fresh memory with `UFFDIO_COPY`.
//!
//! A received page written into untouched anonymous or shmem memory costs a page fault and a
//! page clear before the copy (with transparent huge pages, one fault per 2 MiB but a huge-page
//! allocation that stalls on compaction when host memory is fragmented). `UFFDIO_COPY`
//! allocates each page and fills it from the reader's buffer in one call, with neither: the
//! first round, which brings nearly every page, lands at a steady cost. While the rounds land,
//! the regions that travel are registered for missing-page faults; a thread answers any other
//! access to a page not landed yet (a digest sweep reading chunks no page was sent to, a Zero
//! frame's write) with zero pages, so memory reads as it would unregistered. A page already
//! present (landed in an earlier round, or zero-mapped by such an access) is copied by
//! `memcpy`. The registration ends ([`Landing::disarm`]) before the guest runs and before
//! post-copy's pager registers the same memory.

use guestmem_sys::to_usize;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use guestmem_memory::{Backend, GuestMemory};
use userfaultfd::{Event, FeatureFlags, Uffd, UffdBuilder};
use vmm_sys_util::eventfd::EventFd;

use crate::{error_chain, Error, MigrationError, Result};

fn failure(op: &str, e: impl std::error::Error + Send + Sync + 'static) -> Error {
    MigrationError::Landing {
        op: op.to_string(),
        source: Box::new(e),
    }
    .into()
}

/// [`failure`] of a userfaultfd operation (its errno in the text).
fn uffd_failure(op: &str, e: userfaultfd::Error) -> Error {
    failure(op, guestmem_paging::UffdError(e))
}

const PAGE: usize = 4096;
/// A fault on a page not landed yet zero-maps up to this many bytes from it (stopping at the
/// first present page): a digest sweep reads its chunk whole, one fault per piece.
const ZERO_AHEAD: usize = 64 << 10;

/// The landing of one migration's rounds; see the module's documentation.
pub(crate) struct Landing {
    uffd: Arc<Uffd>,
    /// Host ranges registered.
    ranges: Vec<(usize, usize)>,
    stop: Arc<EventFd>,
    answerer: Option<JoinHandle<()>>,
    /// Bytes landed by `UFFDIO_COPY`, and by `memcpy` over present pages.
    copied: AtomicU64,
    overwritten: AtomicU64,
    /// Faults on pages not landed yet that the answerer zero-mapped.
    zero_faults: Arc<AtomicU64>,
}

/// What a landing did, for the logs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct LandingStats {
    pub copied_bytes: u64,
    pub overwritten_bytes: u64,
    pub zero_faults: u64,
}

impl Landing {
    /// Registers the regions of `memory` that travel over the wire (those not in `shared`)
    /// and that `UFFDIO_COPY` can fill page by page (anonymous and memfd memory; not huge
    /// pages, not guest_memfd). `None` when there is no such region.
    pub(crate) fn arm(memory: &GuestMemory, shared: &[String]) -> Result<Option<Landing>> {
        let regions: Vec<_> = memory
            .regions()
            .iter()
            .filter(|r| !shared.iter().any(|n| n == r.name()))
            .filter(|r| matches!(r.backend(), Backend::Anon | Backend::Memfd))
            .collect();
        if regions.is_empty() {
            return Ok(None);
        }
        let mut features = FeatureFlags::empty();
        if regions.iter().any(|r| r.backend() == Backend::Memfd) {
            features |= FeatureFlags::MISSING_SHMEM;
        }
        let failed = uffd_failure;
        let uffd = UffdBuilder::new()
            .close_on_exec(true)
            .non_blocking(true)
            .user_mode_only(false)
            .require_features(features)
            .create()
            .map_err(|e| failed("userfaultfd / UFFDIO_API", e))?;
        let mut ranges = Vec::new();
        for r in &regions {
            let (host, len) = (r.host_addr() as usize, to_usize(r.size()));
            uffd.register(host as *mut libc::c_void, len)
                .map_err(|e| failed(&format!("UFFDIO_REGISTER of region '{}'", r.name()), e))?;
            ranges.push((host, len));
        }
        let uffd = Arc::new(uffd);
        let stop = Arc::new(EventFd::new(libc::EFD_CLOEXEC).map_err(|e| failure("eventfd", e))?);
        let zero_faults = Arc::new(AtomicU64::new(0));
        let mut landing = Landing {
            uffd: uffd.clone(),
            ranges: ranges.clone(),
            stop: stop.clone(),
            answerer: None,
            copied: AtomicU64::new(0),
            overwritten: AtomicU64::new(0),
            zero_faults: zero_faults.clone(),
        };
        let answerer = std::thread::Builder::new()
            .name("migrate-land".into())
            .spawn(move || answer_faults(&uffd, &ranges, &stop, &zero_faults))
            .map_err(|e| failure("spawning a thread", e))?;
        landing.answerer = Some(answerer);
        Ok(Some(landing))
    }

    /// Lands `src` at `gpa` (whole pages, inside one region of `memory`).
    pub(crate) fn land(&self, memory: &GuestMemory, gpa: u64, src: &[u8]) -> Result<()> {
        let (_, host) = memory.find(gpa, src.len() as u64)?;
        let host = host as usize;
        if !self.registered(host, src.len()) {
            // A region not registered: plain memcpy.
            // SAFETY: `find` checked that the range lies inside a live mapping of `memory`;
            // the caller (a round's reader) is the only thread writing this block.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), host as *mut u8, src.len()) };
            self.overwritten
                .fetch_add(src.len() as u64, Ordering::Relaxed);
            return Ok(());
        }
        let mut done = 0;
        while done < src.len() {
            let (dst, len) = (host + done, src.len() - done);
            // SAFETY: the destination range lies inside a registered region (checked above);
            // UFFDIO_COPY only fills pages that are missing, from `src`, which we borrow.
            let r = unsafe {
                self.uffd.copy(
                    src[done..].as_ptr().cast::<libc::c_void>(),
                    dst as *mut libc::c_void,
                    len,
                    true,
                )
            };
            match r {
                Ok(n) => {
                    self.copied.fetch_add(n as u64, Ordering::Relaxed);
                    done += n;
                }
                // EAGAIN: the mappings changed under the copy; what it did (if it says) counts
                // and the rest is tried again.
                Err(userfaultfd::Error::PartiallyCopied(n)) => {
                    if n <= len && n.is_multiple_of(PAGE) {
                        self.copied.fetch_add(n as u64, Ordering::Relaxed);
                        done += n;
                    }
                }
                Err(userfaultfd::Error::CopyFailed(e)) if e as i32 == libc::EEXIST => {
                    // The first page is present (a later round re-sends landed pages): the
                    // present run from it is copied by hand, found with one mincore.
                    let run = present_run(dst, len);
                    if run == 0 {
                        self.land_page(dst, &src[done..done + PAGE])?;
                        done += PAGE;
                        continue;
                    }
                    // SAFETY: `find` checked that the range lies in a live mapping; these pages
                    // are present, and only this reader writes its block while rounds land.
                    unsafe {
                        std::ptr::copy_nonoverlapping(src[done..].as_ptr(), dst as *mut u8, run);
                    };
                    self.overwritten.fetch_add(run as u64, Ordering::Relaxed);
                    done += run;
                }
                Err(e) => {
                    return Err(uffd_failure(
                        &format!("UFFDIO_COPY at {:#x}", gpa + done as u64),
                        e,
                    ))
                }
            }
        }
        Ok(())
    }

    /// Makes `len` bytes at `gpa` (whole pages, inside one region of `memory`) read zero:
    /// zero pages mapped where pages are missing, zeros written where present.
    pub(crate) fn zero(&self, memory: &GuestMemory, gpa: u64, len: u64) -> Result<()> {
        let (_, host) = memory.find(gpa, len).map_err(outside_memory)?;
        let (host, len) = (host as usize, to_usize(len));
        if !self.registered(host, len) {
            // SAFETY: `find` checked the range; only this reader writes its block.
            unsafe { std::ptr::write_bytes(host as *mut u8, 0, len) };
            return Ok(());
        }
        let mut done = 0;
        while done < len {
            let dst = host + done;
            // SAFETY: inside a registered region; UFFDIO_ZEROPAGE fills only missing pages.
            match unsafe {
                self.uffd
                    .zeropage(dst as *mut libc::c_void, len - done, true)
            } {
                Ok(n) if n > 0 && n.is_multiple_of(PAGE) && n <= len - done => done += n,
                // A present page (or a partial answer): that page by hand, then go on.
                _ => {
                    // SAFETY: one page inside a registered region: zero-mapped if missing,
                    // else written (only this reader writes its block).
                    if unsafe { self.uffd.zeropage(dst as *mut libc::c_void, PAGE, true) }.is_err()
                    {
                        // SAFETY: the page is present, inside a live mapping, and only this
                        // reader writes its block.
                        unsafe { std::ptr::write_bytes(dst as *mut u8, 0, PAGE) };
                    }
                    done += PAGE;
                }
            }
        }
        Ok(())
    }

    fn registered(&self, host: usize, len: usize) -> bool {
        self.ranges
            .iter()
            .any(|&(s, l)| host >= s && host + len <= s + l)
    }

    /// Lands one page at host address `dst`: `UFFDIO_COPY` if it is missing, else `memcpy`.
    fn land_page(&self, dst: usize, src: &[u8]) -> Result<()> {
        // SAFETY: as in `land`: one page inside a registered region.
        let r = unsafe {
            self.uffd.copy(
                src.as_ptr().cast::<libc::c_void>(),
                dst as *mut libc::c_void,
                PAGE,
                true,
            )
        };
        match r {
            Ok(_) => {
                self.copied.fetch_add(PAGE as u64, Ordering::Relaxed);
                Ok(())
            }
            Err(userfaultfd::Error::CopyFailed(e)) if e as i32 == libc::EEXIST => {
                // SAFETY: the page is present and inside a live mapping; only this reader
                // writes its block while the rounds land.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, PAGE) };
                self.overwritten.fetch_add(PAGE as u64, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => Err(uffd_failure(
                &format!("UFFDIO_COPY of one page at host {dst:#x}"),
                e,
            )),
        }
    }

    /// Ends the registration: the memory behaves as it did before [`Landing::arm`] (pages
    /// never landed read as zero).
    pub(crate) fn disarm(mut self) -> Result<LandingStats> {
        self.stop_answering();
        for &(host, len) in &self.ranges {
            self.uffd
                .unregister(host as *mut libc::c_void, len)
                .map_err(|e| uffd_failure("UFFDIO_UNREGISTER", e))?;
        }
        self.ranges.clear();
        Ok(self.stats())
    }

    pub(crate) fn stats(&self) -> LandingStats {
        LandingStats {
            copied_bytes: self.copied.load(Ordering::Relaxed),
            overwritten_bytes: self.overwritten.load(Ordering::Relaxed),
            zero_faults: self.zero_faults.load(Ordering::Relaxed),
        }
    }

    fn stop_answering(&mut self) {
        if let Some(answerer) = self.answerer.take() {
            // A failed write leaves the thread waiting; it then ends with the uffd's close.
            let _ = self.stop.write(1);
            let _ = answerer.join();
        }
    }
}

impl Drop for Landing {
    fn drop(&mut self) {
        self.stop_answering();
        for &(host, len) in &self.ranges {
            let _ = self.uffd.unregister(host as *mut libc::c_void, len);
        }
    }
}

/// How many bytes from `host` (page-aligned, `len` whole pages) are present, counted until the
/// first missing page (at most 2 MiB looked at); 0 if mincore cannot say.
fn present_run(host: usize, len: usize) -> usize {
    const MAX: usize = 512;
    let pages = (len / PAGE).min(MAX);
    let mut resident = [0u8; MAX];
    // SAFETY: `host` is page-aligned and the range lies in a live mapping; mincore writes one
    // byte per page into `resident`, which holds `pages` of them.
    let r = unsafe {
        libc::mincore(
            host as *mut libc::c_void,
            pages * PAGE,
            resident.as_mut_ptr().cast(),
        )
    };
    if r != 0 {
        return 0;
    }
    resident[..pages]
        .iter()
        .take_while(|&&b| b & 1 == 1)
        .count()
        * PAGE
}

/// Answers faults on pages not landed yet with zero pages, until `stop` is written.
fn answer_faults(uffd: &Uffd, ranges: &[(usize, usize)], stop: &EventFd, zero_faults: &AtomicU64) {
    let mut fds = [
        libc::pollfd {
            fd: uffd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: stop.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    loop {
        // SAFETY: two valid pollfds that live across the call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if n < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            tracing::error!("landing pages: poll: {}", std::io::Error::last_os_error());
            return;
        }
        if fds[1].revents != 0 {
            return;
        }
        loop {
            let event = match uffd.read_event() {
                Ok(Some(e)) => e,
                Ok(None) => break,
                Err(e) => {
                    tracing::error!(
                        "landing pages: reading a userfaultfd event: {}",
                        guestmem_paging::UffdError(e)
                    );
                    return;
                }
            };
            let Event::Pagefault { addr, .. } = event else {
                continue;
            };
            let page = addr as usize & !(PAGE - 1);
            let end = ranges
                .iter()
                .find(|&&(s, l)| page >= s && page < s + l)
                .map_or(page + PAGE, |&(s, l)| {
                    ((page + ZERO_AHEAD) & !(ZERO_AHEAD - 1)).min(s + l)
                });
            zero_faults.fetch_add(1, Ordering::Relaxed);
            // SAFETY: the range lies in a registered region; UFFDIO_ZEROPAGE maps zero pages
            // only where pages are missing.
            let r = unsafe { uffd.zeropage(page as *mut libc::c_void, end - page, true) };
            if r.is_err() {
                // Some page after the first is present (or the first was landed meanwhile):
                // the faulting page alone, then wake its thread whatever happened.
                // SAFETY: as above, one page.
                let _ = unsafe { uffd.zeropage(page as *mut libc::c_void, PAGE, true) };
                let _ = uffd.wake(page as *mut libc::c_void, PAGE);
            }
        }
    }
}

/// The error of a frame whose pages fall outside this VM's memory.
pub(crate) fn outside_memory(e: guestmem_memory::Error) -> Error {
    MigrationError::Unsupported {
        reason: format!(
            "the source sent pages outside this VM's memory: {}",
            error_chain(&e, ": ")
        ),
    }
    .into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use guestmem_memory::RegionSpec;

    fn memory(backend: Backend) -> GuestMemory {
        GuestMemory::new(&[RegionSpec::new("ram", 0, 8 << 20, backend)], None).unwrap()
    }

    #[allow(clippy::cast_possible_truncation)] // test data: the low byte of a pattern.
    fn pattern(seed: u8, len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31) ^ seed)
            .collect()
    }

    fn read(memory: &GuestMemory, gpa: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0; len];
        memory.read(gpa, &mut out).unwrap();
        out
    }

    /// Pages land with UFFDIO_COPY where missing and by memcpy where present, a page never
    /// landed reads zero (through the answerer) and still takes a landing afterwards, and
    /// after disarm the memory reads and writes as usual.
    fn lands_the_bytes_sent(backend: Backend) {
        let memory = memory(backend);
        let landing = Landing::arm(&memory, &[])
            .unwrap()
            .expect("a region to land in");
        let first = pattern(1, 2 << 20);
        landing.land(&memory, 0, &first).unwrap();
        assert_eq!(read(&memory, 0, 2 << 20), first);
        // A page of the next block read before it lands: zero, through the answerer.
        assert_eq!(read(&memory, (2 << 20) + 8192, 4096), vec![0; 4096]);
        // The block lands over the zero-mapped pages by memcpy, around them by UFFDIO_COPY.
        let second = pattern(2, 2 << 20);
        landing.land(&memory, 2 << 20, &second).unwrap();
        assert_eq!(read(&memory, 2 << 20, 2 << 20), second);
        // A later round overwrites landed pages.
        let again = pattern(3, 16384);
        landing.land(&memory, 4096, &again).unwrap();
        let stats = landing.disarm().unwrap();
        assert_eq!(read(&memory, 4096, 16384), again);
        assert_eq!(read(&memory, 0, 4096), first[..4096]);
        assert!(
            stats.copied_bytes >= (4 << 20) - (ZERO_AHEAD as u64),
            "{stats:?}"
        );
        assert!(stats.overwritten_bytes >= 16384, "{stats:?}");
        assert!(stats.zero_faults >= 1, "{stats:?}");
        // Unregistered: a write and read anywhere, no answerer needed.
        memory.write(6 << 20, &[7; 64]).unwrap();
        assert_eq!(read(&memory, 6 << 20, 64), vec![7; 64]);
        assert_eq!(read(&memory, 7 << 20, 64), vec![0; 64]);
    }

    #[test]
    fn lands_in_anonymous_memory() {
        lands_the_bytes_sent(Backend::Anon);
    }

    #[test]
    fn lands_in_memfd_memory() {
        lands_the_bytes_sent(Backend::Memfd);
    }

    #[test]
    fn leaves_out_shared_and_huge_page_regions() {
        let memory = memory(Backend::Anon);
        assert!(Landing::arm(&memory, &["ram".to_string()])
            .unwrap()
            .is_none());
    }

    #[test]
    fn dropping_an_armed_landing_unregisters() {
        let memory = memory(Backend::Anon);
        drop(Landing::arm(&memory, &[]).unwrap());
        // Registered again by a second landing: UFFDIO_REGISTER would say EBUSY otherwise.
        let again = Landing::arm(&memory, &[]).unwrap().unwrap();
        again.land(&memory, 0, &pattern(4, 4096)).unwrap();
        assert_eq!(read(&memory, 0, 4096), pattern(4, 4096));
    }
}
