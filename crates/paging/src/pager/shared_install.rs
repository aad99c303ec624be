//! A clone's side of a shared image (see [`SharedImage`]): mapping the image copy-on-write
//! over the region, and installing a chunk by publishing it (fetched, checked by the source,
//! written into the image) if no clone has yet, then mapping the image's pages.

use guestmem_sys::to_usize;
use std::sync::Arc;

use guestmem_memory::{Backend, PageBuf, Region};
use userfaultfd::Uffd;

use super::{By, Shared, BOUNCE_MAX};
use crate::{Error, PagerConfig, Result, SharedImage};

/// The shared image `config` asks `region` to map, mapped over it copy-on-write; `None`
/// without [`PagerConfig::share`]. Only anonymous RAM is shared: the private mapping of the
/// image replaces the region's own, which a memfd's or guest_memfd's file cannot be.
pub(super) fn shared_image(
    region: &Region,
    config: &PagerConfig,
) -> Result<Option<Arc<SharedImage>>> {
    let Some(share) = &config.share else {
        return Ok(None);
    };
    if region.backend() != Backend::Anon {
        return Err(share_refusal(region));
    }
    let image = SharedImage::open(share, region.name(), region.size())?;
    // SAFETY: the range is exactly the region's own anonymous mapping, which the region owns
    // and unmaps on drop; no vCPU has run on it yet (the pager starts before the guest).
    // MAP_FIXED replaces it with a mapping of the same length and protection; the image file
    // is the region's size (checked on open). KVM's memslot keeps the host address.
    let addr = unsafe {
        libc::mmap(
            region.host_addr().cast(),
            to_usize(region.size()),
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_FIXED | libc::MAP_NORESERVE,
            image.fd(),
            0,
        )
    };
    if addr == libc::MAP_FAILED {
        return Err(Error::ShareIo {
            region: region.name().into(),
            path: image.path().to_path_buf(),
            op: "mmap (copy-on-write over the region)",
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(Some(Arc::new(image)))
}

/// Why `region` (not anonymous RAM) cannot be shared between clones.
pub(crate) fn share_refusal(region: &Region) -> Error {
    let backend = region.backend();
    let reason = match backend {
        Backend::GuestMemfd => {
            "clones share memory through a copy-on-write mapping of the snapshot's image, and \
             KVM maps guest_memfd pages for the guest without any host mapping: restore \
             guest_memfd clones without sharing"
        }
        _ => {
            "clones share memory through a copy-on-write mapping of the snapshot's image, which \
             replaces anonymous RAM only (this backend's memory is a file of its own): restore \
             with the anon backend, or without sharing"
        }
    };
    Error::Unsupported {
        region: region.name().into(),
        backend,
        reason: reason.into(),
    }
}

impl Shared {
    fn image(&self) -> &SharedImage {
        self.image.as_deref().expect("shared mode has an image")
    }

    /// Installs `chunks` of a clone: zero chunks map the zero page (copied on a write, as
    /// anonymous memory); the others are published into the image unless a clone did already,
    /// then mapped from it (`UFFDIO_CONTINUE`: read-only pages of the image, copied on a
    /// write). `Ok(false)`: the mapping was changing (EAGAIN); try again later.
    pub(super) fn install_shared(
        &self,
        chunks: std::ops::Range<usize>,
        shard: usize,
        bounce: &mut PageBuf,
        by: By,
    ) -> Result<bool> {
        let uffd = &self.uffds[shard];
        for c in chunks {
            let (start, len) = self.byte_range(c..c + 1);
            let done = if self.source.is_zero(start, len) {
                self.zero_pages(uffd, start, len)?
            } else {
                if !self.image().is_published(start, len) {
                    self.publish(start, len, bounce, by)?;
                }
                self.map_page_cache(uffd, start, len)?
            };
            if !done {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Fetches `[start, start + len)` from the source (which checks every chunk before it
    /// hands any of it over), writes it into the image and publishes it. Another clone doing
    /// the same at once writes the same bytes.
    fn publish(&self, start: u64, len: u64, bounce: &mut PageBuf, by: By) -> Result<()> {
        let size = len.min(BOUNCE_MAX) as usize;
        bounce.grow_to(size);
        let image = self.image();
        let mut written = Ok(());
        self.fetch(start, len, &mut bounce[..size], by, &mut |at, piece| {
            written = image.write(at, piece);
            written.is_ok()
        })?;
        written.map_err(|source| Error::ShareIo {
            region: self.region.clone(),
            path: image.path().to_path_buf(),
            op: "pwrite",
            source,
        })?;
        image.publish(start, len);
        Ok(())
    }

    /// `UFFDIO_ZEROPAGE` over `[start, start + len)`, page by page where some are mapped
    /// already. `Ok(false)`: the mapping was changing.
    fn zero_pages(&self, uffd: &Uffd, start: u64, len: u64) -> Result<bool> {
        let zero = |off: u64, n: u64| {
            // SAFETY: the range lies inside the registered region.
            unsafe {
                uffd.zeropage(
                    (self.host + to_usize(off)) as *mut libc::c_void,
                    to_usize(n),
                    true,
                )
            }
        };
        match zero(start, len) {
            Ok(n) if n as u64 == len => return Ok(true),
            Err(userfaultfd::Error::ZeropageFailed(e)) if e as i32 == libc::EAGAIN => {
                return Ok(false)
            }
            _ => {}
        }
        let mut off = start;
        while off < start + len {
            match zero(off, self.page) {
                Ok(_) => {}
                Err(userfaultfd::Error::ZeropageFailed(e)) if e as i32 == libc::EEXIST => {}
                Err(userfaultfd::Error::ZeropageFailed(e)) if e as i32 == libc::EAGAIN => {
                    return Ok(false)
                }
                Err(e) => return Err(self.uffd_error("UFFDIO_ZEROPAGE", e)),
            }
            off += self.page;
        }
        Ok(true)
    }

    /// A page of an installed chunk faulted again (the VMM discarded it): mapped from the
    /// image again, or the zero page for a zero chunk.
    pub(super) fn refill_shared(&self, uffd: &Uffd, off: u64) -> Result<bool> {
        if self.image().is_published(off, self.page) {
            self.map_page_cache(uffd, off, self.page)
        } else {
            self.zero_pages(uffd, off, self.page)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{PageSource, Pager, Share};
    use guestmem_memory::RegionSpec;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::{Duration, Instant};

    const MIB: u64 = 1 << 20;

    /// Pages of `fill`, counting its fetches.
    struct Counting(u8, AtomicU64);

    impl PageSource for Counting {
        fn fetch(&self, _offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
            self.1.fetch_add(1, Ordering::Relaxed);
            buf.fill(self.0);
            Ok(())
        }
        fn size(&self) -> u64 {
            4 * MIB
        }
    }

    fn read(region: &Region, offset: u64) -> u8 {
        // SAFETY: one byte inside the region's live mapping; the pager serves its fault.
        unsafe { region.host_addr().add(to_usize(offset)).read_volatile() }
    }

    fn settled(pager: &Pager, chunks: u64) {
        let t = Instant::now();
        while pager.stats().fault_chunks < chunks && t.elapsed() < Duration::from_secs(1) {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Two clones of one snapshot share its image: the chunk the first one fetched is mapped
    /// for the second without a fetch from its own source; a chunk nobody published is fetched
    /// by whoever faults first. A region that is not anonymous memory is refused, naming why.
    #[test]
    fn clones_fetch_each_chunk_once() {
        let dir = std::path::PathBuf::from(format!(
            "/dev/shm/guestmem-unit-{}-clones",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let share = Share::new(&dir).of("snap");
        let config = PagerConfig {
            background: false,
            readahead_chunks: 0,
            share: Some(share),
            ..Default::default()
        };
        let spec = || RegionSpec::new("ram", 0, 4 * MIB, Backend::Anon);
        let (a, b) = (
            Region::create(spec(), None).unwrap(),
            Region::create(spec(), None).unwrap(),
        );
        let (src_a, src_b) = (
            Arc::new(Counting(0xaa, AtomicU64::new(0))),
            Arc::new(Counting(0xbb, AtomicU64::new(0))),
        );
        let pager_a = Pager::start(&a, src_a.clone(), &config).unwrap();
        let pager_b = Pager::start(&b, src_b.clone(), &config).unwrap();
        assert_eq!(read(&a, 2 * MIB + 5), 0xaa);
        settled(&pager_a, 1);
        let fetched_a = src_a.1.load(Ordering::Relaxed);
        assert!(fetched_a >= 1);
        // Clone b sees a's bytes for the chunk a published, without fetching it.
        assert_eq!(read(&b, 2 * MIB + 9), 0xaa);
        assert_eq!(src_b.1.load(Ordering::Relaxed), 0);
        // The chunk nobody fetched yet comes from b's own source.
        assert_eq!(read(&b, 100), 0xbb);
        assert!(src_b.1.load(Ordering::Relaxed) >= 1);
        assert_eq!(src_a.1.load(Ordering::Relaxed), fetched_a);
        drop((pager_a, pager_b));

        let memfd =
            Region::create(RegionSpec::new("ram", 0, 4 * MIB, Backend::Memfd), None).unwrap();
        match shared_image(&memfd, &config) {
            Err(Error::Unsupported { reason, .. }) => {
                assert!(reason.contains("replaces anonymous RAM only"), "{reason}");
            }
            other => panic!("{:?}", other.err()),
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
