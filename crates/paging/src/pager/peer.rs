//! Serving another process's userfaultfd: a Firecracker-style VMM registers its memory and
//! passes the fd; a [`PeerPager`] answers its faults from a page source.

use guestmem_sys::to_usize;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;

use guestmem_memory::{Backend, PageBuf, Region};
use guestmem_sys::uapi::{
    UFFD_FEATURE_EVENT_REMOVE, UFFD_FEATURE_MISSING_HUGETLBFS, UFFD_FEATURE_MISSING_SHMEM,
};
use userfaultfd::{Event, EventBuffer, FeatureFlags, RegisterMode, Uffd, UffdBuilder};

use super::{
    pager_cpus, spawn_pager_thread, Layout, Mode, OnFailure, PagerConfig, PagerStats, PeerReleased,
    Shared, EVENT_BATCH,
};
use crate::affinity::CpuSet;
use crate::{priority, Error, PageSource, Result, UffdError};

/// One range of another process's memory registered on a userfaultfd that a [`PeerPager`]
/// serves (a Firecracker-style VMM registered it and passed the fd on).
pub struct PeerRange {
    /// Names the range in errors and logs.
    pub name: String,
    /// The range's start in the registering process's address space.
    pub host_addr: u64,
    /// Its bytes.
    pub size: u64,
    /// The page size of the range's mapping (4 KiB, or the huge page size).
    pub page_size: u64,
    /// The range's bytes (offset 0 = `host_addr`).
    pub source: Arc<dyn PageSource>,
}

impl std::fmt::Debug for PeerRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerRange")
            .field("name", &self.name)
            .field("host_addr", &self.host_addr)
            .field("size", &self.size)
            .field("page_size", &self.page_size)
            .finish_non_exhaustive()
    }
}

/// Demand paging over a userfaultfd that someone else created and registered, possibly for
/// several ranges, possibly in another process: the same chunk engine as [`Pager`](super::Pager) (fault-around,
/// readahead, background fetch, `EEXIST`/`EAGAIN` handling, `UFFD_EVENT_REMOVE` making
/// discarded pages read as zero), with one handler thread reading the fd's events and handing
/// each to the range it falls in. Only `MISSING` faults resolved by `UFFDIO_COPY` are served
/// (anonymous and hugetlb memory). Dropping it stops its threads; it does not unregister
/// ranges that are not fully resident.
pub struct PeerPager {
    ranges: Vec<Arc<Shared>>,
    stop: OwnedFd,
    threads: Vec<JoinHandle<()>>,
    cpus: Option<CpuSet>,
}

impl std::fmt::Debug for PeerPager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ranges: Vec<&str> = self.ranges.iter().map(|r| r.region.as_str()).collect();
        f.debug_struct("PeerPager")
            .field("ranges", &ranges)
            .field("threads", &self.threads.len())
            .field("cpus", &self.cpus)
            .finish_non_exhaustive()
    }
}

fn new_eventfd(region: &str) -> Result<OwnedFd> {
    // SAFETY: eventfd returns a new fd (checked) that nobody else owns.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(Error::Os {
            region: region.into(),
            op: "eventfd",
            source: io::Error::last_os_error(),
        });
    }
    // SAFETY: `fd` is the fresh eventfd from above.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Why range `r` cannot be served in chunks of `chunk` bytes, `previous` being the range
/// below it (in address order), if any.
fn check_range(
    r: &PeerRange,
    previous: Option<&PeerRange>,
    chunk: u64,
) -> std::result::Result<(), String> {
    if !r.page_size.is_power_of_two() || r.page_size < 4096 {
        return Err(format!(
            "page size {:#x} is not a power of two of at least 4 KiB",
            r.page_size
        ));
    }
    if !chunk.is_power_of_two() {
        return Err(format!("fault-around {chunk:#x} is not a power of two"));
    }
    if r.size == 0
        || !r.size.is_multiple_of(r.page_size)
        || !r.host_addr.is_multiple_of(r.page_size)
    {
        return Err(format!(
            "range {:#x}+{:#x} is empty or not aligned to its page size {:#x}",
            r.host_addr, r.size, r.page_size
        ));
    }
    if r.source.size() < r.size {
        return Err(format!(
            "the page source holds {:#x} bytes, less than the range's {:#x}",
            r.source.size(),
            r.size
        ));
    }
    if let Some(p) = previous.filter(|p| p.host_addr + p.size > r.host_addr) {
        return Err(format!(
            "range {:#x}+{:#x} overlaps '{}'",
            r.host_addr, r.size, p.name
        ));
    }
    Ok(())
}

impl PeerPager {
    /// Serves `ranges`, all registered (`MISSING`) on `uffd`, which must already have gone
    /// through `UFFDIO_API`. `config.uffds` and `config.handlers` are ignored (one fd, one
    /// handler); `on_failure` is told when a fetch fails for good; `released` tells a range
    /// the peer let go of (it unmapped it, or is exiting) from a failure (see
    /// [`PeerReleased`]; without it, every failed copy is a failure).
    pub fn start(
        uffd: OwnedFd,
        ranges: Vec<PeerRange>,
        config: &PagerConfig,
        on_failure: Option<OnFailure>,
        released: Option<PeerReleased>,
    ) -> Result<PeerPager> {
        let cpus = pager_cpus(config).map_err(|reason| Error::Config {
            region: "peer pager".into(),
            reason,
        })?;
        let mut shareds: Vec<Arc<Shared>> = Vec::with_capacity(ranges.len());
        let mut sorted = ranges;
        sorted.sort_by_key(|r| r.host_addr);
        for (i, r) in sorted.iter().enumerate() {
            let chunk = config.fault_around.max(r.page_size);
            let previous = i.checked_sub(1).map(|p| &sorted[p]);
            check_range(r, previous, chunk).map_err(|reason| Error::Config {
                region: r.name.clone(),
                reason,
            })?;
            let dup = uffd.try_clone().map_err(|source| Error::Os {
                region: r.name.clone(),
                op: "dup of the userfaultfd",
                source,
            })?;
            // SAFETY: `dup` is a userfaultfd we own; the Uffd takes it over (closes it on drop).
            let uffd = unsafe { Uffd::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(dup)) };
            let chunks = to_usize(r.size.div_ceil(chunk));
            // One handler, which reads ahead itself; a prefetch list names offsets of one
            // region, not of each range.
            let config = PagerConfig {
                handlers: 1,
                readahead_threads: 0,
                prefetch: Vec::new(),
                ..config.clone()
            };
            let mut shared = Shared::new(
                Layout {
                    region: r.name.clone(),
                    gpa: 0,
                    host: to_usize(r.host_addr),
                    size: r.size,
                    page: r.page_size,
                    chunk,
                    mode: Mode::Copy,
                    alias: 0,
                    memfd: -1,
                },
                vec![uffd],
                std::iter::once(0..chunks).collect(),
                r.source.clone(),
                &config,
                new_eventfd(&r.name)?,
                on_failure.clone(),
            );
            shared.peer_released = released.clone();
            shareds.push(Arc::new(shared));
        }
        let mut pager = PeerPager {
            stop: new_eventfd("peer pager")?,
            ranges: shareds,
            threads: Vec::new(),
            cpus,
        };
        // SAFETY: `uffd` is a userfaultfd we own; the handler's Uffd takes it over.
        let reader = unsafe { Uffd::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(uffd)) };
        let ranges = pager.ranges.clone();
        let stop = pager.stop.as_raw_fd();
        pager.spawn("uffd-peer-handler".into(), move || {
            serve_peer_faults(&reader, &ranges, stop);
        })?;
        if config.background {
            for shared in pager.ranges.clone() {
                pager.spawn("uffd-background".into(), move || shared.fetch_everything())?;
            }
        }
        Ok(pager)
    }

    fn spawn(&mut self, name: String, f: impl FnOnce() + Send + 'static) -> Result<()> {
        let ranges = self.ranges.clone();
        let on_panic = move |reason: String| {
            for shared in &ranges {
                let region = shared.region.clone();
                shared.fail(Error::Stopped {
                    region,
                    reason: reason.clone(),
                });
            }
        };
        let handle = spawn_pager_thread("peer pager", name, self.cpus, f, on_panic)?;
        self.threads.push(handle);
        Ok(())
    }

    /// Per range, in address order.
    pub fn stats(&self) -> Vec<PagerStats> {
        self.ranges.iter().map(|s| s.stats()).collect()
    }

    /// Handles on each range's counters (address order), for a progress sampler.
    pub fn probes(&self) -> Vec<crate::StatsProbe> {
        self.ranges
            .iter()
            .map(|s| {
                let s = s.clone();
                crate::StatsProbe::new(move || s.stats())
            })
            .collect()
    }

    /// The first error that stopped a range, if a fetch failed for good.
    pub fn failure(&self) -> Option<String> {
        self.ranges.iter().find_map(|s| s.failure())
    }

    /// Whether the peer let go of every range (see [`PeerReleased`]) before it was resident.
    pub fn released(&self) -> bool {
        self.ranges
            .iter()
            .all(|s| s.released.load(Ordering::Acquire))
    }

    /// Whether every range is resident and retired (only with background fetch).
    pub fn retired(&self) -> bool {
        self.ranges
            .iter()
            .all(|s| s.retired.load(Ordering::Acquire))
    }
}

impl Drop for PeerPager {
    fn drop(&mut self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer to our eventfd.
        unsafe { libc::write(self.stop.as_raw_fd(), one.as_ptr().cast(), 8) };
        for s in &self.ranges {
            s.signal_stop();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The [`PeerPager`]'s handler: reads events in batches and hands each to its range.
fn serve_peer_faults(uffd: &Uffd, ranges: &[Arc<Shared>], stop: i32) {
    priority::raise();
    let mut events = EventBuffer::new(EVENT_BATCH);
    let mut bounce = PageBuf::zeroed(0);
    let find = |addr: usize| {
        ranges
            .iter()
            .find(|s| addr >= s.host && addr < s.host + to_usize(s.size))
    };
    loop {
        let mut fds = [stop, uffd.as_raw_fd()].map(|fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        });
        // SAFETY: `fds` is a live array of 2 pollfds.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if n < 0 {
            continue; // EINTR
        }
        if fds[0].revents != 0 {
            return;
        }
        if fds[1].revents & (libc::POLLERR | libc::POLLHUP) != 0 {
            tracing::debug!("userfaultfd hung up: the peer's memory is gone");
            return;
        }
        let batch: Vec<Event> = match uffd.read_events(&mut events) {
            Ok(iter) => iter.filter_map(std::result::Result::ok).collect(),
            Err(e) => {
                tracing::warn!("reading the peer's userfaultfd events: {}", UffdError(e));
                continue;
            }
        };
        for s in ranges {
            s.handler_busy();
        }
        let mut sequential: Option<(&Arc<Shared>, usize)> = None;
        for event in batch {
            match event {
                Event::Pagefault { kind, addr, .. } => match find(addr as usize) {
                    Some(s) => {
                        if let Some(chunk) = s.on_fault(0, addr as usize, kind, &mut bounce) {
                            sequential = Some((s, chunk));
                        }
                    }
                    // The peer registered memory it did not describe: nobody can serve it,
                    // so serving has failed for good (the faulting thread would wait forever).
                    None => {
                        if let Some(first) = ranges.first() {
                            first.fail(Error::Config {
                                region: first.region.clone(),
                                reason: format!(
                                    "fault at {addr:?}, outside every range the peer described"
                                ),
                            });
                        }
                    }
                },
                Event::Remove { start, end } => {
                    for s in ranges {
                        s.on_remove(start as usize, end as usize);
                    }
                }
                _ => {}
            }
        }
        if let Some((s, chunk)) = sequential {
            s.read_ahead(0, chunk, &mut bounce);
        }
        for s in ranges {
            s.handler_idle();
        }
    }
}

/// The VMM's side of a [`PeerPager`]: creates a userfaultfd with `UFFD_EVENT_REMOVE` and
/// registers every one of `regions` on it in `MISSING` mode, for a page server to serve (the fd
/// is to be sent to it). A guest_memfd region is refused, as by
/// [`Pager::start`](super::Pager::start): userfaultfd never sees a vCPU's accesses to it.
pub fn register_for_peer(regions: &[&Region]) -> Result<OwnedFd> {
    let mut features = UFFD_FEATURE_EVENT_REMOVE;
    for r in regions {
        features |= match r.backend() {
            Backend::Anon => 0,
            Backend::Memfd => UFFD_FEATURE_MISSING_SHMEM,
            Backend::MemfdHugetlb | Backend::Hugetlbfs => UFFD_FEATURE_MISSING_HUGETLBFS,
            backend @ Backend::GuestMemfd => {
                return Err(Error::Unsupported {
                    region: r.name().into(),
                    backend,
                    reason: super::guest_memfd_refusal().1,
                })
            }
        };
    }
    let name = regions.first().map_or("none", |r| r.name());
    let uffd = UffdBuilder::new()
        .close_on_exec(true)
        .non_blocking(true)
        .user_mode_only(false)
        .require_features(FeatureFlags::from_bits_retain(features))
        .create()
        .map_err(|source| Error::Uffd {
            region: name.into(),
            op: "userfaultfd / UFFDIO_API",
            source: UffdError(source),
        })?;
    for r in regions {
        uffd.register_with_mode(
            r.host_addr().cast::<libc::c_void>(),
            to_usize(r.size()),
            RegisterMode::MISSING,
        )
        .map_err(|source| Error::Uffd {
            region: r.name().into(),
            op: "UFFDIO_REGISTER",
            source: UffdError(source),
        })?;
    }
    // `Uffd::into_raw_fd` (userfaultfd 0.9) still closes the fd on drop: forget the Uffd.
    let fd = uffd.as_raw_fd();
    std::mem::forget(uffd);
    // SAFETY: the forgotten Uffd's fd, which we now own alone.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ZeroSource;

    fn range(name: &str, host_addr: u64, size: u64, source_size: u64) -> PeerRange {
        PeerRange {
            name: name.into(),
            host_addr,
            size,
            page_size: 4096,
            source: Arc::new(ZeroSource { size: source_size }),
        }
    }

    #[test]
    fn a_range_that_cannot_be_served_is_refused_with_its_reason() {
        let a = range("a", 0x10_0000, 0x4000, 0x4000);
        assert_eq!(check_range(&a, None, 0x1000), Ok(()));
        let err = |r: &PeerRange, prev, chunk| check_range(r, prev, chunk).unwrap_err();
        assert!(err(&a, None, 0x3000).contains("fault-around 0x3000"));
        let unaligned = range("u", 0x10_0800, 0x4000, 0x4000);
        assert!(err(&unaligned, None, 0x1000).contains("not aligned"));
        let short = range("s", 0x20_0000, 0x4000, 0x1000);
        assert!(err(&short, None, 0x1000).contains("page source holds 0x1000"));
        let overlapping = range("o", 0x10_2000, 0x4000, 0x4000);
        assert!(err(&overlapping, Some(&a), 0x1000).contains("overlaps 'a'"));
        let after = range("n", 0x10_4000, 0x4000, 0x4000);
        assert_eq!(check_range(&after, Some(&a), 0x1000), Ok(()));
        let huge_page = PeerRange {
            page_size: 0x3000,
            ..range("h", 0, 0x6000, 0x6000)
        };
        assert!(err(&huge_page, None, 0x3000).contains("page size 0x3000"));
    }
}
