//! Demand paging through KVM Userfault: the region's memslot gets `KVM_MEM_USERFAULT` and a
//! bitmap with every page set, so a vCPU's first access to a page leaves `KVM_RUN` with a
//! userfault exit before KVM maps anything. The vCPU thread hands the exit (through the
//! memory's [`UserfaultRouter`](guestmem_memory::UserfaultRouter)) to this pager, which
//! fetches the chunk around the page from the [`PageSource`], installs its non-zero pages by
//! guest_memfd `write()` (or, where the fd does not take `write()`, by a copy through the host
//! mapping), clears the chunk's bits and returns: the vCPU runs again and KVM maps the
//! installed page. A background thread installs the chunks nobody asked for (a recorded working
//! set first).
//!
//! This is how guestmem demand pages guest_memfd: KVM maps guest_memfd pages for the guest
//! straight from the file, so userfaultfd on the host mapping never sees a vCPU's access, and
//! a guest paged by userfaultfd alone would run on zero pages. A page's bits are cleared only
//! after its bytes are in the file, under the chunk's lock, so no vCPU ever maps a page before
//! its bytes are there; bits are never set again.
//!
//! Accesses through the host mapping (the VMM's own, and KVM's emulated ones) are not vCPU
//! accesses: where the kernel has userfaultfd on guest_memfd, the pager registers the mapping
//! too and serves them the same way ([`host`]); [`UserfaultPager::host_access`] says whether it
//! did. Where the kernel lacks it, such an access to a chunk not yet installed would read
//! zeros: the VMM reads a range only after [`UserfaultPager::make_resident`] or
//! [`UserfaultPager::wait_resident`] (guestmem's does: digests, snapshots, working sets), and
//! its payload's device state lives in the sys region, which a lazy restore copies at once.

use guestmem_sys::to_usize;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use guestmem_memory::{Backend, GuestMemory, Region, UserfaultBitmap, UserfaultHandler, PAGE_SIZE};
use guestmem_vm::AbortHandle;

use crate::{Error, PageSource, PagerConfig, PagerStats, Result};

mod host;

/// [`UserfaultPager::host_access`] where the host mapping is registered with userfaultfd.
pub const HOST_UFFD: &str = "userfaultfd (MISSING) on the guest_memfd mapping, served by the \
                             same pager";
/// [`UserfaultPager::host_access`] where the kernel refused the registration.
pub const HOST_WAIT: &str = "not trapped: the VMM reads a range only once it is resident \
                             (make_resident, wait_resident)";

/// How installed pages get into the region.
const INSTALL_WRITE: u8 = 0;
const INSTALL_COPY: u8 = 1;

/// A region demand paged through KVM Userfault (see the [module](self) documentation).
/// Dropping it stops the background thread; the memory's router keeps serving the vCPUs'
/// exits on demand for as long as the memory lives, so no vCPU is ever left without its page.
pub struct UserfaultPager {
    inner: Arc<Inner>,
    background: Option<JoinHandle<()>>,
    /// The host mapping's userfaultfd registration, where the kernel takes it.
    host: Option<host::HostUffd>,
    /// What serves host accesses (see [`UserfaultPager::host_access`]).
    host_access: String,
}

impl std::fmt::Debug for UserfaultPager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UserfaultPager")
            .field("region", &self.inner.region.name())
            .field("host_access", &self.host_access)
            .finish_non_exhaustive()
    }
}

struct Inner {
    region: Arc<Region>,
    source: Arc<dyn PageSource>,
    bitmap: Arc<UserfaultBitmap>,
    chunk: u64,
    locks: Vec<Mutex<()>>,
    install: AtomicU8,
    fetch_attempts: u32,
    retry_delay: Duration,
    abort: Option<AbortHandle>,
    stop: AtomicBool,
    faults: AtomicU64,
    fault_chunks: AtomicU64,
    background_chunks: AtomicU64,
    prefetch_chunks: AtomicU64,
    prefetch_done: AtomicBool,
    fault_order: Mutex<Vec<u64>>,
    failure: Mutex<Option<String>>,
    resident_at: OnceLock<Instant>,
    /// The userfaultfd the host mapping is registered with (guest_memfd, where the kernel
    /// takes it), and whether it still is.
    host_uffd: OnceLock<Arc<userfaultfd::Uffd>>,
    host_armed: AtomicBool,
    host_stop: AtomicBool,
    host_faults: AtomicU64,
    host_chunks: AtomicU64,
}

/// The chunk size KVM Userfault serves `region` in (`config.fault_around`, at least a page
/// and at most the region); refused when its source of `source_size` bytes is short of the
/// region, its pages are huge, the chunk is not a power of two, or the memory is shared.
fn checked_chunk(region: &Region, source_size: u64, config: &PagerConfig) -> Result<u64> {
    if config.share.is_some() {
        return Err(crate::pager::share_refusal(region));
    }
    let name = region.name().to_string();
    let size = region.size();
    if source_size < size {
        return Err(Error::Config {
            region: name,
            reason: format!("the source holds {source_size:#x} bytes, the region {size:#x}"),
        });
    }
    if region.backend().page_size() != PAGE_SIZE {
        return Err(Error::Unsupported {
            region: name,
            backend: region.backend(),
            reason: "KVM Userfault maps 4 KiB pages; huge page backends are not paged by it".into(),
        });
    }
    let chunk = config.fault_around.clamp(PAGE_SIZE, size.max(PAGE_SIZE));
    if !chunk.is_power_of_two() {
        return Err(Error::Config {
            region: name,
            reason: format!("fault_around {chunk:#x} is not a power of two"),
        });
    }
    Ok(chunk)
}

/// The userfault bitmap of a region of `size` bytes: every page set (missing) except in the
/// chunks of `chunk` bytes for which `resident(offset)` is true.
fn missing_bitmap(size: u64, chunk: u64, resident: &dyn Fn(u64) -> bool) -> UserfaultBitmap {
    let bitmap = UserfaultBitmap::all_set(size);
    let mut offset = 0;
    while offset < size {
        if resident(offset) {
            bitmap.clear(offset / PAGE_SIZE, chunk.min(size - offset) / PAGE_SIZE);
        }
        offset += chunk;
    }
    bitmap
}

/// Starts the thread that fetches `config.prefetch`, then (with `config.background`) every
/// chunk still missing; none when there is neither.
fn spawn_background(inner: &Arc<Inner>, config: &PagerConfig) -> Result<Option<JoinHandle<()>>> {
    if !config.background && config.prefetch.is_empty() {
        return Ok(None);
    }
    let worker = inner.clone();
    let prefetch = config.prefetch.clone();
    let sweep = config.background;
    let thread = std::thread::Builder::new()
        .name(format!("kvm-uf-{}", worker.region.name()))
        .spawn(move || worker.background(&prefetch, sweep))
        .map_err(|e| Error::Os {
            region: inner.region.name().into(),
            op: "spawning the background fetch thread",
            source: e,
        })?;
    Ok(Some(thread))
}

impl UserfaultPager {
    /// Arms KVM Userfault on region `index` of `memory` (registered as memslots, slot `i` =
    /// region `i`, vCPUs not running yet) and serves its pages from `source`. `config` gives
    /// the chunk size (`fault_around`), the fetch retries, the abort handle, whether to fetch
    /// in the background and what to fetch first (`prefetch`); its userfaultfd settings do not
    /// apply. Refused, naming what is missing, when KVM does not take the userfault memslot.
    pub fn start(
        memory: &GuestMemory,
        index: usize,
        source: Arc<dyn PageSource>,
        config: &PagerConfig,
    ) -> Result<UserfaultPager> {
        UserfaultPager::start_partial(memory, index, source, config, &|_| false)
    }

    /// Like [`UserfaultPager::start`] over a region whose contents are already right, except
    /// in the chunks (of `config.fault_around` bytes) for which `resident(offset)` is false:
    /// only those keep their bits set and are fetched (post-copy after a pre-copy round).
    pub fn start_partial(
        memory: &GuestMemory,
        index: usize,
        source: Arc<dyn PageSource>,
        config: &PagerConfig,
        resident: &dyn Fn(u64) -> bool,
    ) -> Result<UserfaultPager> {
        let region = memory
            .regions()
            .get(index)
            .cloned()
            .ok_or_else(|| Error::Config {
                region: format!("#{index}"),
                reason: format!("the memory has {} regions", memory.regions().len()),
            })?;
        let name = region.name().to_string();
        let size = region.size();
        let chunk = checked_chunk(&region, source.size(), config)?;
        let manager = memory.memslots().ok_or_else(|| Error::Config {
            region: name.clone(),
            reason: "the memory is not registered as memslots".into(),
        })?;
        // Asked on a VM of its own first: a guest_memfd slot is deleted before it is created
        // anew with the flag, and a refusal then would leave the VM without it.
        require_kvm_userfault(&region)?;
        let bitmap = Arc::new(missing_bitmap(size, chunk, resident));
        manager
            .set_userfault(
                u32::try_from(index).expect("memslot ids are u32"),
                Some(bitmap.clone()),
            )
            .map_err(|e| Error::Unsupported {
                region: name.clone(),
                backend: region.backend(),
                reason: format!(
                    "KVM Userfault (a KVM_MEM_USERFAULT memslot with a userfault bitmap) was \
                     refused: {e}"
                ),
            })?;
        let inner = Arc::new(Inner::new(region, source, bitmap, chunk, config));
        // The host mapping too, before anything can read it.
        let (host, host_access) = host::arm_if_gmem(&inner);
        memory
            .userfault_router()
            .add(inner.region.gpa(), size, inner.clone());
        let background = spawn_background(&inner, config)?;
        Ok(UserfaultPager {
            inner,
            background,
            host,
            host_access,
        })
    }

    /// What it has done so far (`faults`: userfault exits handed to it).
    pub fn stats(&self) -> PagerStats {
        inner_stats(&self.inner)
    }

    /// A handle on its counters for a progress sampler on another thread.
    pub fn probe(&self) -> crate::StatsProbe {
        let inner = self.inner.clone();
        crate::StatsProbe::new(move || inner_stats(&inner))
    }

    /// Waits until every page is installed (true), the timeout passes (false) or the pager
    /// failed (the error).
    pub fn wait_resident(&self, timeout: Duration) -> Result<bool> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(reason) = self.failure() {
                return Err(Error::Stopped {
                    region: self.inner.region.name().into(),
                    reason,
                });
            }
            if self.inner.bitmap.count_set() == 0 {
                return Ok(true);
            }
            if Instant::now() >= deadline {
                return Ok(false);
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// When the last page was installed, if it was.
    pub fn resident_at(&self) -> Option<Instant> {
        self.inner.resident_at.get().copied()
    }

    /// The region's bytes.
    pub fn size(&self) -> u64 {
        self.inner.region.size()
    }

    /// Region offsets of the chunks the vCPUs faulted on, in order (a working set).
    pub fn fault_order(&self) -> Vec<u64> {
        self.inner
            .fault_order
            .lock()
            .expect("fault order lock")
            .clone()
    }

    /// Why the pager stopped, if it did.
    pub fn failure(&self) -> Option<String> {
        self.inner.failure.lock().expect("failure lock").clone()
    }

    /// The chunk size.
    pub fn chunk_bytes(&self) -> u64 {
        self.inner.chunk
    }

    /// What serves the VMM's own accesses through the host mapping (and KVM's emulated ones)
    /// to pages not yet installed: [`HOST_UFFD`] where the mapping is registered with
    /// userfaultfd, else [`HOST_WAIT`] and the kernel's refusal.
    pub fn host_access(&self) -> &str {
        &self.host_access
    }

    /// Whether host accesses are served by the pager (the mapping registered with
    /// userfaultfd, see [`UserfaultPager::host_access`]) until every page is installed.
    pub fn serves_host_access(&self) -> bool {
        self.host.is_some()
    }

    /// Host accesses to pages not yet installed, served through the mapping's userfaultfd,
    /// and the chunks they installed.
    pub fn host_faults(&self) -> (u64, u64) {
        (
            self.inner.host_faults.load(Ordering::Relaxed),
            self.inner.host_chunks.load(Ordering::Relaxed),
        )
    }

    /// Installs every chunk of region offsets `[offset, offset + len)` not installed yet
    /// (fetched and checked, as a vCPU's exit would): for a VMM about to read that range
    /// through the host mapping where the mapping is not registered with userfaultfd.
    pub fn make_resident(&self, offset: u64, len: u64) -> Result<()> {
        let size = self.inner.region.size();
        let end = offset.saturating_add(len).min(size);
        let mut chunk = offset / self.inner.chunk;
        while chunk * self.inner.chunk < end {
            if let Err(e) = self.inner.install_chunk(chunk, || ()) {
                let reason = self.inner.fail(e);
                return Err(Error::Stopped {
                    region: self.inner.region.name().into(),
                    reason,
                });
            }
            chunk += 1;
        }
        Ok(())
    }

    /// How pages are installed: `"write"` (guest_memfd `write()`) or `"copy"` (through the
    /// host mapping, where the fd does not take `write()`).
    pub fn install_method(&self) -> &'static str {
        match self.inner.install.load(Ordering::Relaxed) {
            INSTALL_WRITE => "write",
            _ => "copy",
        }
    }
}

impl Drop for UserfaultPager {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::Release);
        if let Some(t) = self.background.take() {
            let _ = t.join();
        }
        // The host mapping's registration goes with it (nobody would serve it).
        self.host.take();
    }
}

impl UserfaultHandler for Inner {
    fn handle(&self, gpa: u64, _size: u64) -> std::result::Result<(), String> {
        self.faults.fetch_add(1, Ordering::Relaxed);
        let offset = gpa
            .checked_sub(self.region.gpa())
            .filter(|o| *o < self.region.size())
            .ok_or_else(|| {
                format!(
                    "guest address {gpa:#x} is outside region '{}'",
                    self.region.name()
                )
            })?;
        let chunk = offset / self.chunk;
        let installed = self.install_chunk(chunk, || {
            self.fault_chunks.fetch_add(1, Ordering::Relaxed);
            self.fault_order
                .lock()
                .expect("fault order lock")
                .push(chunk * self.chunk);
        });
        match installed {
            Ok(_) => Ok(()),
            Err(e) => Err(self.fail(e)),
        }
    }
}

/// Refuses, naming what is missing, unless a fresh VM takes a KVM Userfault memslot.
fn require_kvm_userfault(region: &Region) -> Result<()> {
    let reason = match guestmem_sys::probe::kvm_userfault_on_a_new_vm() {
        Ok(u) if u.present => return Ok(()),
        Ok(u) => format!(
            "KVM Userfault (a KVM_MEM_USERFAULT memslot with a userfault bitmap) is absent: {}",
            u.detail
        ),
        Err(e) => format!("KVM Userfault could not be asked: {e}"),
    };
    Err(Error::Unsupported {
        region: region.name().to_string(),
        backend: region.backend(),
        reason,
    })
}

impl Inner {
    fn new(
        region: Arc<Region>,
        source: Arc<dyn PageSource>,
        bitmap: Arc<UserfaultBitmap>,
        chunk: u64,
        config: &PagerConfig,
    ) -> Inner {
        let chunks = to_usize(region.size().div_ceil(chunk));
        Inner {
            install: AtomicU8::new(if region.backend() == Backend::GuestMemfd {
                INSTALL_WRITE
            } else {
                INSTALL_COPY
            }),
            region,
            source,
            bitmap,
            chunk,
            locks: (0..chunks).map(|_| Mutex::new(())).collect(),
            fetch_attempts: config.fetch_attempts.max(1),
            retry_delay: config.retry_delay,
            abort: config.abort.clone(),
            stop: AtomicBool::new(false),
            faults: AtomicU64::new(0),
            fault_chunks: AtomicU64::new(0),
            background_chunks: AtomicU64::new(0),
            prefetch_chunks: AtomicU64::new(0),
            prefetch_done: AtomicBool::new(config.prefetch.is_empty()),
            fault_order: Mutex::new(Vec::new()),
            failure: Mutex::new(None),
            resident_at: OnceLock::new(),
            host_uffd: OnceLock::new(),
            host_armed: AtomicBool::new(false),
            host_stop: AtomicBool::new(false),
            host_faults: AtomicU64::new(0),
            host_chunks: AtomicU64::new(0),
        }
    }

    /// Installs chunk `chunk` unless it is installed already: fetch, write the non-zero pages,
    /// run `account`, then clear the chunk's bits, all under the chunk's lock. `account` counts
    /// the install before its pages read resident, so that whoever sees the region resident
    /// also sees every install counted.
    fn install_chunk(&self, chunk: u64, account: impl FnOnce()) -> Result<()> {
        let _guard = self.locks[to_usize(chunk)].lock().expect("chunk lock");
        let offset = chunk * self.chunk;
        let len = self.chunk.min(self.region.size() - offset);
        let first = offset / PAGE_SIZE;
        let pages = len / PAGE_SIZE;
        if !self.bitmap.any_set(first, pages) {
            return Ok(());
        }
        let mut buf = vec![0u8; to_usize(len)];
        self.fetch(offset, &mut buf)?;
        let mut at = 0usize;
        let page = to_usize(PAGE_SIZE);
        while at < buf.len() {
            // A run of non-zero pages goes in with one call; zero pages are left out (a
            // guest_memfd page never written reads zero).
            if buf[at..at + page].iter().all(|b| *b == 0) {
                at += page;
                continue;
            }
            let mut end = at + page;
            while end < buf.len() && buf[end..end + page].iter().any(|b| *b != 0) {
                end += page;
            }
            self.put(offset + at as u64, &buf[at..end])?;
            at = end;
        }
        account();
        self.bitmap.clear(first, pages);
        if self.bitmap.count_set() == 0 {
            let _ = self.resident_at.set(Instant::now());
        }
        Ok(())
    }

    fn fetch(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let mut last = None;
        for attempt in 0..self.fetch_attempts {
            if attempt > 0 {
                std::thread::sleep(self.retry_delay);
            }
            match self.source.fetch(offset, buf) {
                Ok(()) => return Ok(()),
                Err(e) => last = Some(e),
            }
        }
        Err(Error::SourceFailed {
            region: self.region.name().into(),
            gpa: self.region.gpa() + offset,
            len: buf.len() as u64,
            attempts: self.fetch_attempts,
            source: last.expect("at least one attempt"),
        })
    }

    /// Puts `data` at region offset `offset`: guest_memfd `write()`, else (or once the fd
    /// refused `write()`) a copy through the host mapping.
    fn put(&self, offset: u64, data: &[u8]) -> Result<()> {
        if self.install.load(Ordering::Relaxed) == INSTALL_WRITE {
            match self.pwrite_all(offset, data) {
                Ok(()) => return Ok(()),
                // The fd does not take write() (created without the flag, or a kernel
                // without it): the mapping does the same, one fault per page.
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::ENODEV | libc::EINVAL | libc::ESPIPE | libc::EBADF)
                    ) =>
                {
                    self.install.store(INSTALL_COPY, Ordering::Relaxed);
                }
                Err(e) => {
                    return Err(Error::Os {
                        region: self.region.name().into(),
                        op: "pwrite into guest_memfd",
                        source: e,
                    })
                }
            }
        }
        if self.put_registered(offset, data)? {
            return Ok(());
        }
        // SAFETY: `offset + data.len()` lies inside the region's mapping (a chunk of it); the
        // range belongs to a chunk whose bits are still set, so no vCPU maps it yet, and the
        // chunk's lock keeps every other installer out.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.region.host_addr().add(to_usize(offset)),
                data.len(),
            );
        };
        Ok(())
    }

    fn pwrite_all(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        let fd = self
            .region
            .fd()
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EBADF))?;
        let mut done = 0usize;
        while done < data.len() {
            // SAFETY: `data[done..]` is a live buffer of that many readable bytes; `fd` is the
            // region's open file.
            let n = unsafe {
                libc::pwrite(
                    fd.as_raw_fd(),
                    data[done..].as_ptr().cast(),
                    data.len() - done,
                    (offset + done as u64) as libc::off_t,
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "pwrite wrote nothing",
                ));
            }
            done += n as usize;
        }
        Ok(())
    }

    /// Records the first failure, stops the VM with it and returns its text.
    fn fail(&self, e: Error) -> String {
        let text = guestmem_sys::error_chain(&e, ": ");
        let mut slot = self.failure.lock().expect("failure lock");
        slot.get_or_insert_with(|| text.clone());
        if let Some(abort) = &self.abort {
            abort.abort(text.clone());
        }
        text
    }

    /// Installs the `prefetch` chunks first, then (with `sweep`) every other chunk, in order.
    fn background(&self, prefetch: &[u64], sweep: bool) {
        for &offset in prefetch {
            if self.stop.load(Ordering::Acquire) {
                return;
            }
            if offset >= self.region.size() {
                continue;
            }
            let account = || {
                self.prefetch_chunks.fetch_add(1, Ordering::Relaxed);
            };
            match self.install_chunk(offset / self.chunk, account) {
                Ok(_) => {}
                Err(e) => {
                    self.fail(e);
                    return;
                }
            }
        }
        self.prefetch_done.store(true, Ordering::Relaxed);
        if !sweep {
            return;
        }
        for chunk in 0..self.locks.len() as u64 {
            if self.stop.load(Ordering::Acquire) {
                return;
            }
            let account = || {
                self.background_chunks.fetch_add(1, Ordering::Relaxed);
            };
            match self.install_chunk(chunk, account) {
                Ok(_) => {}
                Err(e) => {
                    self.fail(e);
                    return;
                }
            }
        }
    }
}

/// A KVM Userfault pager's counters (see [`UserfaultPager::stats`]).
fn inner_stats(i: &Inner) -> PagerStats {
    let left = i.bitmap.count_set();
    PagerStats {
        faults: i.faults.load(Ordering::Relaxed),
        fault_chunks: i.fault_chunks.load(Ordering::Relaxed),
        readahead_chunks: 0,
        background_chunks: i.background_chunks.load(Ordering::Relaxed),
        prefetch_chunks: i.prefetch_chunks.load(Ordering::Relaxed),
        prefetch_done: i.prefetch_done.load(Ordering::Relaxed),
        discarded_chunks: 0,
        resident_bytes: ((i.bitmap.pages() - left) * PAGE_SIZE).min(i.region.size()),
        retired: left == 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Share, ZeroSource};
    use guestmem_memory::{Backend, RegionSpec};

    fn refusal(r: Result<UserfaultPager>) -> String {
        match r {
            Ok(_) => panic!("started"),
            Err(e) => e.to_string(),
        }
    }

    /// Each start that cannot work is refused naming the region and what is wrong, before
    /// any memslot changes: an unknown region, sharing, a short source, memory not registered
    /// as memslots, and (on a kernel without it) KVM Userfault itself.
    #[test]
    fn bad_starts_name_what_is_missing() {
        let spec = RegionSpec::new("ram", 0x1_0000_0000, 4 << 20, Backend::Anon);
        let loose = GuestMemory::new(&[spec], None).unwrap();
        let zero = |size| -> Arc<dyn PageSource> { Arc::new(ZeroSource { size }) };
        let config = PagerConfig::default();
        assert_eq!(
            refusal(UserfaultPager::start(&loose, 3, zero(4 << 20), &config)),
            "region '#3': invalid pager configuration: the memory has 1 regions"
        );
        let shared = PagerConfig {
            share: Some(Share::new("/dev/shm/x")),
            ..Default::default()
        };
        assert!(
            refusal(UserfaultPager::start(&loose, 0, zero(4 << 20), &shared))
                .contains("copy-on-write mapping of the snapshot's image")
        );
        let e = refusal(UserfaultPager::start(&loose, 0, zero(1 << 20), &config));
        assert!(
            e.contains("the source holds 0x100000 bytes, the region 0x400000"),
            "{e}"
        );
        let e = refusal(UserfaultPager::start(&loose, 0, zero(4 << 20), &config));
        assert!(
            e.contains("the memory is not registered as memslots"),
            "{e}"
        );

        let vm = guestmem_vm::Vm::new(&guestmem_vm::VmConfig::simple(1, 4 << 20, Backend::Anon))
            .unwrap();
        let memory = vm.memory();
        let ram = memory
            .regions()
            .iter()
            .position(|r| r.name() == "ram")
            .unwrap();
        let present = guestmem_sys::probe::kvm_userfault_on_a_new_vm().is_ok_and(|u| u.present);
        let started = UserfaultPager::start(memory, ram, zero(4 << 20), &config);
        if present {
            assert!(started.is_ok(), "{:?}", started.err());
        } else {
            let e = refusal(started);
            assert!(
                e.contains(
                    "KVM Userfault (a KVM_MEM_USERFAULT memslot with a userfault bitmap) is absent"
                ),
                "{e}"
            );
            let slot = memory
                .memslots()
                .unwrap()
                .slot(u32::try_from(ram).unwrap())
                .unwrap();
            assert!(slot.userfault.is_none(), "the memslot was left as it was");
        }
    }

    #[test]
    fn only_the_chunks_not_resident_stay_missing() {
        // 10 pages in chunks of 4: chunk 1 (pages 4..8) resident, the short last chunk
        // (pages 8..10) too.
        let bitmap = missing_bitmap(10 * PAGE_SIZE, 4 * PAGE_SIZE, &|offset| {
            offset == 4 * PAGE_SIZE || offset == 8 * PAGE_SIZE
        });
        let missing: Vec<u64> = (0..10).filter(|&p| bitmap.is_set(p)).collect();
        assert_eq!(missing, [0, 1, 2, 3]);
        assert_eq!(bitmap.count_set(), 4);
        let none_resident = missing_bitmap(10 * PAGE_SIZE, 4 * PAGE_SIZE, &|_| false);
        assert_eq!(none_resident.count_set(), 10);
    }
}
