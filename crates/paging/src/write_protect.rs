//! Userfaultfd write-protect: ranges of guest memory made read-only for every writer (the
//! guest through KVM, and host threads), each first write to a protected page reported to a
//! handler thread that decides what to do before the page is let go (copy it, then unprotect
//! it), the writer blocked meanwhile. It is the mechanism under a live snapshot's
//! copy-before-write (see `guestmem_snapshot::live`), as QEMU's background snapshot uses it.
//!
//! How a guest write reaches it: `UFFDIO_WRITEPROTECT` changes the host page tables, and the
//! MMU notifier that change fires makes KVM drop its own mappings (its shadow or TDP entries)
//! of the range; the guest's next write faults into KVM, which asks for the page writable
//! (`get_user_pages` with `FOLL_WRITE`, from the vCPU thread, in kernel mode), and that raises
//! the userfaultfd write-protect fault: the vCPU thread waits in `KVM_RUN` until the handler
//! unprotects the page. Kernel-mode faults are only reported to a userfaultfd opened without
//! `UFFD_USER_MODE_ONLY`, hence [`WriteProtect::register`] opens it so.
//!
//! Features: `PAGEFAULT_FLAG_WP` (write-protect faults), `WP_UNPOPULATED` (pages never touched
//! are protected too: a first write to an unpopulated anonymous page would otherwise slip
//! through) and, for memfd, hugetlb and file mappings (a restore service's clone maps its
//! image privately), `WP_HUGETLBFS_SHMEM`. The synchronous mode is used, not `WP_ASYNC`: the
//! async mode lets the write through unreported, and the old bytes must be copied first.

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use guestmem_sys::uapi;
use userfaultfd::{Event, EventBuffer, FaultKind, FeatureFlags, RegisterMode, Uffd, UffdBuilder};

use crate::{Error, Result, UffdError};

/// One range to protect: a region's host mapping, named for messages.
#[derive(Debug, Clone)]
pub struct WpRange {
    /// The region's name.
    pub name: String,
    /// Host address of its first byte (page aligned).
    pub addr: usize,
    /// Its bytes (a multiple of the page size).
    pub len: usize,
    /// Whether the mapping is file-backed (memfd, hugetlb, a private file mapping), which
    /// needs `WP_HUGETLBFS_SHMEM`.
    pub file_backed: bool,
}

/// The userfaultfd features write-protect needs for `ranges`, by name, with their bits.
fn needed(ranges: &[WpRange]) -> Vec<(&'static str, u64)> {
    let mut features = vec![
        ("PAGEFAULT_FLAG_WP", uapi::UFFD_FEATURE_PAGEFAULT_FLAG_WP),
        ("WP_UNPOPULATED", uapi::UFFD_FEATURE_WP_UNPOPULATED),
    ];
    if ranges.iter().any(|r| r.file_backed) {
        features.push(("WP_HUGETLBFS_SHMEM", uapi::UFFD_FEATURE_WP_HUGETLBFS_SHMEM));
    }
    features
}

/// Why write-protect cannot serve `ranges` on this kernel (a feature it lacks, named), or
/// `None` when it can.
pub fn unsupported(ranges: &[WpRange]) -> Option<String> {
    let probe = match guestmem_sys::probe::userfaultfd() {
        Ok(p) => p,
        Err(e) => return Some(format!("userfaultfd is not available: {e}")),
    };
    let missing: Vec<&str> = needed(ranges)
        .into_iter()
        .filter(|(_, bit)| probe.features.raw & bit == 0)
        .map(|(name, _)| name)
        .collect();
    (!missing.is_empty()).then(|| {
        format!(
            "the kernel's userfaultfd lacks {} (write-protect of guest memory)",
            missing.join(", ")
        )
    })
}

/// What the handler is given for each fault: a handle to unprotect and wake with.
#[derive(Clone)]
pub struct WpHandle {
    uffd: Arc<Uffd>,
}

impl std::fmt::Debug for WpHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WpHandle")
            .field("fd", &self.uffd.as_raw_fd())
            .finish()
    }
}

impl WpHandle {
    /// Removes the protection of `[addr, addr + len)` and wakes the writers waiting there.
    pub fn unprotect(&self, addr: usize, len: usize) -> Result<()> {
        self.uffd
            .remove_write_protection(addr as *mut libc::c_void, len, true)
            .map_err(|e| uffd_err("UFFDIO_WRITEPROTECT (clear)", e))
    }

    /// Wakes the writers waiting on `[addr, addr + len)` (already unprotected).
    pub fn wake(&self, addr: usize, len: usize) -> Result<()> {
        self.uffd
            .wake(addr as *mut libc::c_void, len)
            .map_err(|e| uffd_err("UFFDIO_WAKE", e))
    }
}

fn uffd_err(op: &'static str, e: userfaultfd::Error) -> Error {
    Error::Uffd {
        region: "write-protected guest memory".into(),
        op,
        source: UffdError(e),
    }
}

/// Ranges registered for write-protect (not yet protected: see [`WriteProtect::protect`]),
/// and the thread that serves their faults once [`WriteProtect::serve`] starts it. Dropping
/// it unprotects everything, stops the thread and unregisters, so no writer is left waiting.
pub struct WriteProtect {
    handle: WpHandle,
    ranges: Vec<WpRange>,
    stop: Arc<AtomicBool>,
    faults: Arc<AtomicU64>,
    failure: Arc<Mutex<Option<String>>>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for WriteProtect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteProtect")
            .field("ranges", &self.ranges)
            .field("faults", &self.faults())
            .finish()
    }
}

impl WriteProtect {
    /// Opens a userfaultfd with the features `ranges` need and registers them in
    /// write-protect mode. Refused, naming the reason, when the kernel lacks a feature or a
    /// range cannot be registered (e.g. guest_memfd, or another userfaultfd has it).
    pub fn register(ranges: Vec<WpRange>) -> Result<WriteProtect> {
        if let Some(why) = unsupported(&ranges) {
            return Err(Error::WriteProtect {
                regions: names(&ranges),
                reason: why,
            });
        }
        // Also WP_HUGETLBFS_SHMEM where offered: an anonymous region may have been mapped
        // over a file since (a restore service's clone maps its image privately).
        let offered = guestmem_sys::probe::userfaultfd().map_or(0, |p| p.features.raw);
        let features = needed(&ranges).iter().fold(0, |a, (_, bit)| a | bit)
            | (offered & uapi::UFFD_FEATURE_WP_HUGETLBFS_SHMEM);
        let uffd = UffdBuilder::new()
            .close_on_exec(true)
            .non_blocking(true)
            // The guest's writes fault in kernel mode (KVM's get_user_pages): see the module
            // docs.
            .user_mode_only(false)
            .require_features(FeatureFlags::from_bits_retain(features))
            .create()
            .map_err(|e| uffd_err("userfaultfd / UFFDIO_API (write-protect features)", e))?;
        for r in &ranges {
            uffd.register_with_mode(
                r.addr as *mut libc::c_void,
                r.len,
                RegisterMode::WRITE_PROTECT,
            )
            .map_err(|e| Error::Uffd {
                region: r.name.clone(),
                op: "UFFDIO_REGISTER (write-protect)",
                source: UffdError(e),
            })?;
        }
        Ok(WriteProtect {
            handle: WpHandle {
                uffd: Arc::new(uffd),
            },
            ranges,
            stop: Arc::new(AtomicBool::new(false)),
            faults: Arc::new(AtomicU64::new(0)),
            failure: Arc::new(Mutex::new(None)),
            thread: None,
        })
    }

    /// A handle to unprotect ranges with.
    pub fn handle(&self) -> WpHandle {
        self.handle.clone()
    }

    /// Protects `[addr, addr + len)` (inside the registered ranges): from now on each write
    /// there waits for the handler.
    pub fn protect(&self, addr: usize, len: usize) -> Result<()> {
        self.handle
            .uffd
            .write_protect(addr as *mut libc::c_void, len)
            .map_err(|e| uffd_err("UFFDIO_WRITEPROTECT (set)", e))
    }

    /// Starts the thread that reads the faults and calls `on_fault` with each faulting
    /// address (any page of a protected range); `on_fault` must unprotect that page (or wake
    /// its writer) before it returns, or fail: a failure is kept ([`WriteProtect::failure`]),
    /// everything is unprotected and the thread ends, so no writer waits for it.
    pub fn serve<F>(&mut self, mut on_fault: F) -> Result<()>
    where
        F: FnMut(&WpHandle, usize) -> std::result::Result<(), String> + Send + 'static,
    {
        let handle = self.handle.clone();
        let (stop, faults, failure) =
            (self.stop.clone(), self.faults.clone(), self.failure.clone());
        let ranges = self.ranges.clone();
        let thread = std::thread::Builder::new()
            .name("uffd-wp".into())
            .spawn(move || {
                if let Err(why) = serve(&handle, &stop, &faults, &mut on_fault) {
                    *failure.lock().expect("not poisoned") = Some(why);
                    unprotect_all(&handle, &ranges);
                }
            })
            .map_err(|e| Error::Os {
                region: names(&self.ranges),
                op: "spawning the write-protect thread",
                source: e,
            })?;
        self.thread = Some(thread);
        Ok(())
    }

    /// Write-protect faults served so far.
    pub fn faults(&self) -> u64 {
        self.faults.load(Ordering::Relaxed)
    }

    /// Why the handler stopped, if it failed.
    pub fn failure(&self) -> Option<String> {
        self.failure.lock().expect("not poisoned").clone()
    }

    /// Unprotects everything, stops the thread and unregisters (what dropping it does),
    /// returning the handler's failure if it had one.
    pub fn finish(mut self) -> Result<()> {
        self.release();
        match self.failure() {
            Some(reason) => Err(Error::WriteProtect {
                regions: names(&self.ranges),
                reason,
            }),
            None => Ok(()),
        }
    }

    fn release(&mut self) {
        unprotect_all(&self.handle, &self.ranges);
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        for r in &self.ranges {
            let _ = self
                .handle
                .uffd
                .unregister(r.addr as *mut libc::c_void, r.len);
        }
    }
}

impl Drop for WriteProtect {
    fn drop(&mut self) {
        self.release();
    }
}

fn names(ranges: &[WpRange]) -> String {
    let names: Vec<&str> = ranges.iter().map(|r| r.name.as_str()).collect();
    names.join(", ")
}

/// Every range unprotected (and its waiting writers woken), errors ignored: the last resort
/// that lets the guest run on.
fn unprotect_all(handle: &WpHandle, ranges: &[WpRange]) {
    for r in ranges {
        let _ = handle.unprotect(r.addr, r.len);
    }
}

/// The thread's loop: poll (bounded, to see `stop`), read the faults in batches, hand each to
/// `on_fault`.
fn serve<F>(
    handle: &WpHandle,
    stop: &AtomicBool,
    faults: &AtomicU64,
    on_fault: &mut F,
) -> std::result::Result<(), String>
where
    F: FnMut(&WpHandle, usize) -> std::result::Result<(), String>,
{
    let mut events = EventBuffer::new(64);
    while !stop.load(Ordering::Acquire) {
        let mut fd = libc::pollfd {
            fd: handle.uffd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // Bounded, so that `stop` is seen.
        const TIMEOUT_MS: libc::c_int = 20;
        // SAFETY: one valid pollfd, living across the call.
        let n = unsafe { libc::poll(&raw mut fd, 1, TIMEOUT_MS) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(format!("poll on the userfaultfd: {e}"));
        }
        if n == 0 {
            continue;
        }
        let read = handle
            .uffd
            .read_events(&mut events)
            .map_err(|e| format!("reading userfaultfd events: {}", UffdError(e)))?;
        for event in read {
            match event.map_err(|e| format!("a userfaultfd event: {}", UffdError(e)))? {
                Event::Pagefault {
                    kind: FaultKind::WriteProtected,
                    addr,
                    ..
                } => {
                    faults.fetch_add(1, Ordering::Relaxed);
                    on_fault(handle, addr as usize)?;
                }
                Event::Pagefault { kind, addr, .. } => {
                    return Err(format!(
                        "an unexpected {kind:?} fault at {addr:?} (only write-protect is \
                         registered)"
                    ))
                }
                other => return Err(format!("an unexpected userfaultfd event: {other:?}")),
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: usize = 4096;

    fn map(len: usize, shared: bool) -> usize {
        let (flags, fd) = if shared {
            // SAFETY: a fresh memfd, owned here (closed after the mapping holds it).
            let fd = unsafe { libc::memfd_create(c"wp-test".as_ptr(), 0) };
            assert!(fd >= 0);
            // SAFETY: `fd` is the memfd just created.
            assert_eq!(unsafe { libc::ftruncate(fd, len as i64) }, 0);
            (libc::MAP_SHARED, fd)
        } else {
            (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1)
        };
        // SAFETY: a fresh mapping of `len` bytes, unmapped by the test.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                fd,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        if fd >= 0 {
            // SAFETY: the mapping holds the file; the fd is ours.
            unsafe { libc::close(fd) };
        }
        p as usize
    }

    /// A writer to a protected page (populated or never touched, anonymous or memfd) waits
    /// until the handler has seen the old bytes and unprotected it; a page the handler let
    /// go is written freely.
    #[test]
    fn the_handler_sees_the_old_bytes_before_each_first_write() {
        for shared in [false, true] {
            let len = 8 * PAGE;
            let addr = map(len, shared);
            // Page 0..4 populated with 1s, 4..8 never touched.
            // SAFETY: the first half of the test's own mapping.
            unsafe { std::ptr::write_bytes(addr as *mut u8, 1, 4 * PAGE) };
            let ranges = vec![WpRange {
                name: "test".into(),
                addr,
                len,
                file_backed: shared,
            }];
            if unsupported(&ranges).is_some() {
                return;
            }
            let mut wp = WriteProtect::register(ranges).unwrap();
            wp.protect(addr, len).unwrap();
            let seen = Arc::new(Mutex::new(Vec::new()));
            let s = seen.clone();
            wp.serve(move |h, at| {
                let page = at & !(PAGE - 1);
                // SAFETY: `page` is inside the test's mapping, protected: nobody writes it.
                let old = unsafe { *(page as *const u8) };
                s.lock().unwrap().push(((page - addr) / PAGE, old));
                h.unprotect(page, PAGE).map_err(|e| e.to_string())
            })
            .unwrap();
            for p in [1usize, 6, 1] {
                // SAFETY: inside the test's mapping; a protected page waits for the handler.
                unsafe { std::ptr::write_volatile((addr + p * PAGE) as *mut u8, 9) };
            }
            assert_eq!(
                *seen.lock().unwrap(),
                vec![(1, 1), (6, 0)],
                "shared {shared}"
            );
            assert_eq!(wp.faults(), 2);
            wp.finish().unwrap();
            // Unregistered: writes go through without faults.
            // SAFETY: inside the test's mapping.
            unsafe { *((addr + 3 * PAGE) as *mut u8) = 9 };
            // SAFETY: the test's own mapping, unmapped once.
            unsafe { libc::munmap(addr as *mut libc::c_void, len) };
        }
    }
}
