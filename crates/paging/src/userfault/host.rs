//! The VMM's own accesses to a guest_memfd region demand paged through KVM Userfault.
//!
//! KVM Userfault traps the vCPUs' accesses only. The VMM (device emulation, a digest, a
//! component reading guest RAM) and KVM's own emulated accesses read through the host mapping,
//! and a page not yet installed would read zeros there. Where the kernel lets userfaultfd
//! register a guest_memfd mapping (the guest_memfd userfaultfd series), the pager registers the
//! region's mapping in `MISSING` mode as well: a host access to a page missing from the file
//! is served by the same pager (the same chunk fetched and checked, the same bits cleared), then
//! the access goes on. A page the chunk left out (all zeros) is placed with `UFFDIO_COPY` of a
//! zero page; one already in the file (`EEXIST`) is only woken.
//!
//! Once every page is installed the registration is dropped: a host access to a page never
//! written then reads zeros from guest_memfd itself, which is what the snapshot holds there.

use guestmem_sys::to_usize;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;

use guestmem_memory::{Backend, PAGE_SIZE};
use userfaultfd::{Event, EventBuffer, RegisterMode, Uffd, UffdBuilder};

use super::Inner;
use crate::{Error, Result, UffdError};

/// How long the serving thread waits for an event before it looks at the stop flag and the
/// bitmap again.
const POLL_MS: i32 = 20;

/// The userfaultfd registration of a guest_memfd region's host mapping and the thread serving
/// it. Dropping it stops the thread and drops the registration.
pub(super) struct HostUffd {
    inner: Arc<Inner>,
    thread: Option<JoinHandle<()>>,
}

/// [`arm`] for a guest_memfd region (any other backend's mapping is what the vCPUs use,
/// installed before the bits clear): the registration, if the kernel took it, and what serves
/// host accesses (see [`super::UserfaultPager::host_access`]).
pub(super) fn arm_if_gmem(inner: &Arc<Inner>) -> (Option<HostUffd>, String) {
    if inner.region.backend() != Backend::GuestMemfd {
        return (None, "the host mapping is the guest's".to_string());
    }
    match arm(inner) {
        Ok(h) => (Some(h), super::HOST_UFFD.to_string()),
        Err(why) => (None, format!("{}: {why}", super::HOST_WAIT)),
    }
}

/// Registers `inner`'s region mapping with a userfaultfd in `MISSING` mode and starts the
/// thread serving it. `Err` says why the kernel refused (no userfaultfd on guest_memfd): the
/// pager then runs without it, the VMM waiting for residency before it reads guest RAM.
fn arm(inner: &Arc<Inner>) -> std::result::Result<HostUffd, String> {
    let uffd = UffdBuilder::new()
        .close_on_exec(true)
        .non_blocking(true)
        .user_mode_only(false)
        .create()
        .map_err(|e| format!("userfaultfd could not be opened: {}", UffdError(e)))?;
    let (host, len) = range(inner);
    uffd.register_with_mode(host, len, RegisterMode::MISSING)
        .map_err(|e| {
            format!(
                "UFFDIO_REGISTER (MISSING) of the guest_memfd mapping was refused ({}): the \
                 kernel lacks userfaultfd on guest_memfd",
                UffdError(e)
            )
        })?;
    let uffd = Arc::new(uffd);
    let _ = inner.host_uffd.set(uffd);
    inner.host_armed.store(true, Ordering::Release);
    let worker = inner.clone();
    let thread = std::thread::Builder::new()
        .name(format!("kvm-uf-host-{}", inner.region.name()))
        .spawn(move || worker.serve_host())
        .map_err(|e| {
            disarm(inner);
            format!("spawning the host-access thread: {e}")
        })?;
    Ok(HostUffd {
        inner: inner.clone(),
        thread: Some(thread),
    })
}

impl Drop for HostUffd {
    fn drop(&mut self) {
        self.inner.host_stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        // Nobody serves the registration any more: drop it, so that no access waits on it.
        disarm(&self.inner);
    }
}

/// The region's host mapping, as userfaultfd takes it.
fn range(inner: &Inner) -> (*mut libc::c_void, usize) {
    (
        inner.region.host_addr().cast(),
        to_usize(inner.region.size()),
    )
}

/// Drops the registration (pending accesses are woken and go to guest_memfd itself).
fn disarm(inner: &Inner) {
    if inner.host_armed.swap(false, Ordering::AcqRel) {
        if let Some(uffd) = inner.host_uffd.get() {
            let (host, len) = range(inner);
            let _ = uffd.unregister(host, len);
        }
    }
}

impl Inner {
    /// The serving thread: each host fault gets its chunk installed, then the page placed or
    /// woken; stops when told to, when every page is installed, or on the first failure.
    fn serve_host(&self) {
        let uffd = self
            .host_uffd
            .get()
            .expect("armed before the thread starts");
        let mut events = EventBuffer::new(16);
        let zero = vec![0u8; to_usize(PAGE_SIZE)];
        loop {
            if self.host_stop.load(Ordering::Acquire) {
                return;
            }
            if self.bitmap.count_set() == 0 || self.failure.lock().expect("lock").is_some() {
                // Everything is in the file (or the pager stopped the VM with its error):
                // the registration has nothing left to serve.
                disarm(self);
                return;
            }
            let mut fd = libc::pollfd {
                fd: uffd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one live pollfd.
            if unsafe { libc::poll(&raw mut fd, 1, POLL_MS) } <= 0 {
                continue;
            }
            let batch: Vec<Event> = match uffd.read_events(&mut events) {
                Ok(iter) => iter.filter_map(std::result::Result::ok).collect(),
                Err(_) => continue,
            };
            for event in batch {
                if let Event::Pagefault { addr, .. } = event {
                    if let Err(e) = self.serve_host_fault(uffd, addr as usize, &zero) {
                        // The VM is stopped with the error; the access goes on without the
                        // registration, and the VMM finds the failure in the pager.
                        self.fail(e);
                        disarm(self);
                        return;
                    }
                }
            }
        }
    }

    /// Serves a host access to `addr`: installs its chunk (fetched and checked), then places
    /// the page if the chunk left it out (zeros) or wakes the access if it is in the file.
    fn serve_host_fault(&self, uffd: &Uffd, addr: usize, zero: &[u8]) -> Result<()> {
        let host = self.region.host_addr() as usize;
        let page = addr & !(to_usize(PAGE_SIZE) - 1);
        let offset = (page - host) as u64;
        self.host_faults.fetch_add(1, Ordering::Relaxed);
        self.install_chunk(offset / self.chunk, || {
            self.host_chunks.fetch_add(1, Ordering::Relaxed);
        })?;
        // SAFETY: `zero` holds a page of zeros; the destination page lies in the registered
        // mapping, and a page already in the file is left alone (EEXIST).
        let placed = unsafe { uffd.copy(zero.as_ptr().cast(), page as *mut _, zero.len(), true) };
        match placed {
            Ok(_) => Ok(()),
            Err(userfaultfd::Error::CopyFailed(errno)) if errno as i32 == libc::EEXIST => uffd
                .wake(page as *mut _, to_usize(PAGE_SIZE))
                .map_err(|e| self.host_error("UFFDIO_WAKE", e)),
            Err(e) => Err(self.host_error("UFFDIO_COPY of a zero page", e)),
        }
    }

    /// Copies `data` to region offset `offset` with `UFFDIO_COPY` while the host mapping is
    /// registered (a copy through the mapping would fault into the registration itself).
    /// `Ok(false)`: not registered (any more); the caller copies through the mapping.
    pub(super) fn put_registered(&self, offset: u64, data: &[u8]) -> Result<bool> {
        if !self.host_armed.load(Ordering::Acquire) {
            return Ok(false);
        }
        let Some(uffd) = self.host_uffd.get() else {
            return Ok(false);
        };
        let host = self.region.host_addr() as usize + to_usize(offset);
        let page = to_usize(PAGE_SIZE);
        let mut done = 0;
        while done < data.len() {
            // Page by page: one already in the file (EEXIST) does not stop the others.
            // SAFETY: `data[done..done + page]` is readable; the destination page lies in the
            // registered mapping, in a chunk whose bits are still set (no vCPU maps it).
            let r = unsafe {
                uffd.copy(
                    data[done..].as_ptr().cast(),
                    (host + done) as *mut _,
                    page,
                    true,
                )
            };
            match r {
                Ok(_) => {}
                Err(userfaultfd::Error::CopyFailed(errno)) if errno as i32 == libc::EEXIST => {}
                Err(userfaultfd::Error::CopyFailed(errno))
                    if matches!(errno as i32, libc::ENOENT | libc::EINVAL) =>
                {
                    // Unregistered meanwhile.
                    return Ok(false);
                }
                Err(e) => return Err(self.host_error("UFFDIO_COPY", e)),
            }
            done += page;
        }
        Ok(true)
    }

    fn host_error(&self, op: &'static str, e: userfaultfd::Error) -> Error {
        Error::Uffd {
            region: self.region.name().into(),
            op,
            source: UffdError(e),
        }
    }
}
