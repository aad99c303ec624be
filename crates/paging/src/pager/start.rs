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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ZeroSource;
    use guestmem_memory::{Region, RegionSpec};

    /// Each backend gets its fault mode (a shared image overrides it); guest_memfd is refused
    /// naming the region and KVM Userfault.
    #[test]
    fn each_backend_gets_its_mode() {
        assert_eq!(mode("r", Backend::Anon, false).unwrap(), Mode::Copy);
        assert_eq!(mode("r", Backend::Hugetlbfs, false).unwrap(), Mode::Copy);
        assert_eq!(mode("r", Backend::MemfdHugetlb, false).unwrap(), Mode::Copy);
        assert_eq!(mode("r", Backend::Memfd, false).unwrap(), Mode::Continue);
        assert_eq!(mode("r", Backend::Anon, true).unwrap(), Mode::Shared);
        match mode("gm", Backend::GuestMemfd, false) {
            Err(Error::Unsupported { region, reason, .. }) => {
                assert_eq!(region, "gm");
                assert!(reason.contains("KVM Userfault"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
    }

    /// Every bad configuration is refused naming the value and its bounds.
    #[test]
    fn bad_configs_name_the_value_and_bounds() {
        let source = ZeroSource { size: 8 << 20 };
        let check = |config: PagerConfig, size| {
            check_config("ram", Backend::Anon, size, &config, &source)
                .err()
                .map(|e| e.to_string())
        };
        assert_eq!(check(PagerConfig::default(), 8 << 20), None);
        let e = check(
            PagerConfig {
                fault_around: 3 << 12,
                ..Default::default()
            },
            8 << 20,
        )
        .unwrap();
        assert!(
            e.contains("fault-around 0x3000 must be a power of two of at least the anon backend's page size (0x1000)"),
            "{e}"
        );
        assert!(check(
            PagerConfig {
                fault_around: 2048,
                ..Default::default()
            },
            8 << 20
        )
        .is_some());
        let e = check(
            PagerConfig {
                uffds: 5,
                ..Default::default()
            },
            8 << 20,
        )
        .unwrap();
        assert!(
            e.contains(
                "5 userfaultfds requested; 1 to 4 (one per 0x200000-byte chunk) are possible"
            ),
            "{e}"
        );
        let e = check(
            PagerConfig {
                handlers: 0,
                ..Default::default()
            },
            8 << 20,
        )
        .unwrap();
        assert!(e.contains("0 handler threads requested"), "{e}");
        let e = check(
            PagerConfig {
                fetch_attempts: 0,
                ..Default::default()
            },
            8 << 20,
        )
        .unwrap();
        assert!(e.contains("0 fetch attempts requested"), "{e}");
        let e = check(PagerConfig::default(), 16 << 20).unwrap();
        assert!(
            e.contains("the page source holds 0x800000 bytes, less than the region's 0x1000000"),
            "{e}"
        );
    }

    /// The region is split between the userfaultfds by whole chunks, as evenly as they go, the
    /// last one ending at the region's end; each range is registered on its own fd.
    #[test]
    fn shards_split_the_chunks_evenly() {
        let size = 9 * (1 << 20) + 4096;
        let region = Region::create(RegionSpec::new("ram", 0, size, Backend::Anon), None).unwrap();
        let config = PagerConfig {
            uffds: 3,
            fault_around: 1 << 20,
            ..Default::default()
        };
        let host = region.host_addr() as usize;
        let (uffds, shards) =
            register("ram", Backend::Anon, Mode::Copy, host, size, &config).unwrap();
        assert_eq!(shards, vec![0..3, 3..6, 6..10]);
        assert_eq!(uffds.len(), 3);
        // The last fd's range ends at the region's end: unregistering exactly it works.
        let last = (host + (6 << 20)) as *mut libc::c_void;
        uffds[2]
            .unregister(last, to_usize(size) - (6 << 20))
            .unwrap();
        // Registered already, a range cannot be registered on another fd.
        let again = register(
            "ram",
            Backend::Anon,
            Mode::Copy,
            host,
            1 << 20,
            &PagerConfig {
                fault_around: 1 << 20,
                ..Default::default()
            },
        );
        match again {
            Err(e) => assert!(e.to_string().contains("UFFDIO_REGISTER"), "{e}"),
            Ok(_) => panic!("the range belongs to another userfaultfd"),
        }
    }
}
