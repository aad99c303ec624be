//! The parts of starting a pager: the fault mode a backend gets, the checks on its
//! configuration, the userfaultfds registered over the region, the memfd's second mapping and
//! the stop eventfd.

use guestmem_sys::to_usize;
use std::io;
use std::ops::Range;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

use guestmem_memory::Backend;
use guestmem_sys::uapi::{
    UFFD_FEATURE_EVENT_REMOVE, UFFD_FEATURE_MINOR_SHMEM, UFFD_FEATURE_MISSING_HUGETLBFS,
    UFFD_FEATURE_MISSING_SHMEM,
};
use userfaultfd::{FeatureFlags, RegisterMode, Uffd, UffdBuilder};

use super::{guest_memfd_refusal, Mode, PagerConfig};
use crate::{Error, PageSource, Result, UffdError};

/// How faults are resolved for `backend` (a shared image, when there is one, decides).
pub(super) fn mode(region: &str, backend: Backend, shared_image: bool) -> Result<Mode> {
    Ok(match backend {
        _ if shared_image => Mode::Shared,
        Backend::Anon | Backend::MemfdHugetlb | Backend::Hugetlbfs => Mode::Copy,
        Backend::Memfd => Mode::Continue,
        Backend::GuestMemfd => {
            return Err(Error::Unsupported {
                region: region.to_string(),
                backend,
                reason: guest_memfd_refusal().1,
            })
        }
    })
}

/// Refuses a configuration the pager cannot run (chunk size, userfaultfd, handler and attempt
/// counts, a source smaller than the region).
pub(super) fn check_config(
    region: &str,
    backend: Backend,
    size: u64,
    config: &PagerConfig,
    source: &dyn PageSource,
) -> Result<()> {
    let bad = |reason: String| Error::Config {
        region: region.to_string(),
        reason,
    };
    let page = backend.page_size();
    let chunk = config.fault_around;
    if !chunk.is_power_of_two() || chunk < page {
        return Err(bad(format!(
            "fault-around {chunk:#x} must be a power of two of at least the {backend} \
             backend's page size ({page:#x})"
        )));
    }
    let chunks = to_usize(size.div_ceil(chunk));
    if config.uffds == 0 || config.uffds > chunks {
        return Err(bad(format!(
            "{} userfaultfds requested; 1 to {chunks} (one per {chunk:#x}-byte chunk) are \
             possible",
            config.uffds
        )));
    }
    if config.handlers == 0 {
        return Err(bad(
            "0 handler threads requested; at least 1 is needed".into()
        ));
    }
    if config.fetch_attempts == 0 {
        return Err(bad(
            "0 fetch attempts requested; at least 1 is needed".into()
        ));
    }
    if source.size() < size {
        return Err(bad(format!(
            "the page source holds {:#x} bytes, less than the region's {size:#x}",
            source.size()
        )));
    }
    Ok(())
}

/// Creates `config.uffds` userfaultfds, each registered over its shard (a run of whole chunks)
/// of the region at `host`; returns them with their shards, in chunk indices.
pub(super) fn register(
    region: &str,
    backend: Backend,
    mode: Mode,
    host: usize,
    size: u64,
    config: &PagerConfig,
) -> Result<(Vec<Uffd>, Vec<Range<usize>>)> {
    let mut features = UFFD_FEATURE_EVENT_REMOVE;
    features |= match backend {
        _ if mode == Mode::Shared => UFFD_FEATURE_MISSING_SHMEM | UFFD_FEATURE_MINOR_SHMEM,
        Backend::Memfd => UFFD_FEATURE_MISSING_SHMEM | UFFD_FEATURE_MINOR_SHMEM,
        Backend::MemfdHugetlb | Backend::Hugetlbfs => UFFD_FEATURE_MISSING_HUGETLBFS,
        _ => 0,
    };
    let register_mode = match mode {
        Mode::Copy => RegisterMode::MISSING,
        Mode::Continue | Mode::Shared => RegisterMode::MISSING | RegisterMode::MINOR,
    };
    let uffd_err = |op, source| Error::Uffd {
        region: region.to_string(),
        op,
        source: UffdError(source),
    };
    let chunk = config.fault_around;
    let chunks = to_usize(size.div_ceil(chunk));
    let shards: Vec<Range<usize>> = (0..config.uffds)
        .map(|i| i * chunks / config.uffds..(i + 1) * chunks / config.uffds)
        .collect();
    let mut uffds = Vec::with_capacity(shards.len());
    for shard in &shards {
        let uffd = UffdBuilder::new()
            .close_on_exec(true)
            .non_blocking(true)
            .user_mode_only(false)
            .require_features(FeatureFlags::from_bits_retain(features))
            .create()
            .map_err(|e| uffd_err("userfaultfd / UFFDIO_API", e))?;
        let start = shard.start as u64 * chunk;
        let end = (shard.end as u64 * chunk).min(size);
        uffd.register_with_mode(
            (host + to_usize(start)) as *mut libc::c_void,
            to_usize(end - start),
            register_mode,
        )
        .map_err(|e| uffd_err("UFFDIO_REGISTER", e))?;
        uffds.push(uffd);
    }
    Ok((uffds, shards))
}

/// A second shared mapping of the memfd `fd` (its `size` bytes), through which the pager fills
/// the page cache before `UFFDIO_CONTINUE`; returns its address.
pub(super) fn alias(region: &str, fd: RawFd, size: u64) -> Result<usize> {
    // SAFETY: a fresh shared mapping of the region's own fd and size; it aliases
    // the region's memory only through the page cache, which is what we want.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            to_usize(size),
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if addr == libc::MAP_FAILED {
        return Err(Error::Os {
            region: region.to_string(),
            op: "mmap of the memfd's second mapping",
            source: io::Error::last_os_error(),
        });
    }
    Ok(addr as usize)
}

/// The eventfd that tells the pager's threads to stop.
pub(super) fn eventfd(region: &str) -> Result<OwnedFd> {
    // SAFETY: eventfd returns a new fd (checked below) that nobody else owns.
    let stop = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    if stop < 0 {
        return Err(Error::Os {
            region: region.to_string(),
            op: "eventfd",
            source: io::Error::last_os_error(),
        });
    }
    // SAFETY: `stop` is the fresh eventfd from above.
    Ok(unsafe { OwnedFd::from_raw_fd(stop) })
}
