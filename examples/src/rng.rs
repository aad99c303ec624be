//! A virtio entropy-style device: its thread fills every buffer the guest posts on its queue
//! (the RX path of a network or entropy device), through `virtio-queue` over guestmem memory
//! (vm-memory's traits, [`guestmem_memory::vmm_compat`]), so every byte it writes is in the
//! next dirty harvest. Its state (the queue's indices and addresses, its counters, which
//! sequence number each buffer holds) is saved and restored through
//! [`guestmem_contract::component::Component`].
//!
//! The payload runs no virtio driver, so the guest's side is emulated from the VMM, in guest
//! memory only (it migrates with it): [`RngDevice::post_buffers`] writes the descriptor table
//! and offers every buffer once; after each batch the device thread plays the driver and puts
//! the buffers it used back on the avail ring, remembering how far it got in a driver page.
//!
//! Buffer `i` (one descriptor, [`BUFFER`] bytes, device-writable) holds the sequence number of
//! its last fill then bytes that follow from it ([`fill`]), so [`RngDevice::verify`] can check
//! that every buffer holds exactly what the device last wrote there.

use guestmem_sys::to_usize;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use guestmem_contract::component::{Component, ComponentError};
use guestmem_memory::vmm_compat::VmGuestMemory;
use guestmem_memory::GuestMemory;
use guestmem_vm::payload::page_value;
use serde::{Deserialize, Serialize};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::desc::RawDescriptor;
use virtio_queue::{Queue, QueueState, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

/// Descriptors in the queue (and buffers posted).
pub const QUEUE_SIZE: u16 = 256;
/// Bytes per buffer.
pub const BUFFER: u64 = 4096;
/// Offsets in the device's region: descriptor table, avail ring, used ring, the emulated
/// driver's page (its last used index seen), then the buffers.
const DESC: u64 = 0;
const AVAIL: u64 = 0x1000;
const USED: u64 = 0x2000;
const DRIVER: u64 = 0x3000;
const BUFFERS: u64 = 0x1_0000;
/// Bytes of guest memory the device uses from its base.
pub const REGION_SIZE: u64 = 2 << 20;
const VIRTQ_DESC_F_WRITE: u16 = 2;

/// What the device did, from its counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    /// Buffers filled so far (the last fill's sequence number).
    pub seq: u64,
    /// Bytes written into buffers.
    pub bytes: u64,
    /// The queue's next avail index.
    pub next_avail: u16,
    /// The queue's next used index.
    pub next_used: u16,
}

/// The device's saved state (JSON).
#[derive(Serialize, Deserialize)]
struct Saved {
    max_size: u16,
    next_avail: u16,
    next_used: u16,
    event_idx_enabled: bool,
    size: u16,
    ready: bool,
    desc_table: u64,
    avail_ring: u64,
    used_ring: u64,
    seq: u64,
    bytes: u64,
    seq_of: Vec<u64>,
}

struct Inner {
    queue: Queue,
    seq: u64,
    bytes: u64,
    /// The sequence number each buffer (by descriptor index) holds; 0: never filled.
    seq_of: Vec<u64>,
}

/// How the device writes its buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Writes {
    /// Through virtio-queue's `Writer` over the vm-memory view: marked dirty as they happen.
    Queue,
    /// Through raw host pointers, which nothing tracks, each buffer then reported by
    /// [`Component::dirty_log`] (as a device whose DMA guestmem does not see must).
    RawReported,
    /// Through raw host pointers, never reported: pages a migration would lose (the check that
    /// the tracking is what makes the other two correct).
    RawUnreported,
}

struct Shared {
    inner: Mutex<Inner>,
    writes: Writes,
    /// The buffers written through raw pointers since the last [`Component::dirty_log`].
    raw_written: Mutex<Vec<(u64, u64)>>,
    paused: AtomicBool,
    stop: AtomicBool,
}

/// The device. Built paused and without memory: [`RngDevice::attach`] gives it the VM's
/// memory, then either [`RngDevice::post_buffers`] (a new device) or
/// [`Component::restore`] (a restored one, before or after attaching), then
/// [`Component::resume`] starts it.
pub struct RngDevice {
    name: String,
    base: u64,
    /// Buffers filled per batch, and the pause between batches.
    batch: usize,
    interval: Duration,
    memory: Option<Arc<VmGuestMemory>>,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for RngDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RngDevice")
            .field("name", &self.name)
            .field("base", &self.base)
            .field("batch", &self.batch)
            .field("interval", &self.interval)
            .finish_non_exhaustive()
    }
}

fn lock(inner: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    inner
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The bytes of the fill with sequence number `seq`: the number, then the values the
/// payload's `dirty` workload would write with `seq` as its seed (one per word).
pub fn fill(seq: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 8);
    out.extend_from_slice(&seq.to_le_bytes());
    let mut word = 1;
    while out.len() < len {
        out.extend_from_slice(&page_value(seq, word, 0).to_le_bytes());
        word += 1;
    }
    out.truncate(len);
    out
}

impl RngDevice {
    /// A device named `name` whose queue and buffers lie at guest address `base`
    /// ([`REGION_SIZE`] bytes), filling `batch` buffers every `interval` while it runs.
    pub fn new(name: &str, base: u64, batch: usize, interval: Duration) -> RngDevice {
        let queue = Queue::new(QUEUE_SIZE).expect("a power-of-two queue size");
        RngDevice {
            name: name.into(),
            base,
            batch,
            interval,
            memory: None,
            shared: Arc::new(Shared {
                inner: Mutex::new(Inner {
                    queue,
                    seq: 0,
                    bytes: 0,
                    seq_of: vec![0; QUEUE_SIZE as usize],
                }),
                paused: AtomicBool::new(true),
                stop: AtomicBool::new(false),
                writes: Writes::Queue,
                raw_written: Mutex::new(Vec::new()),
            }),
            thread: None,
        }
    }

    /// The device, writing its buffers as `writes` says (before it first runs).
    pub fn with_writes(mut self, writes: Writes) -> RngDevice {
        Arc::get_mut(&mut self.shared)
            .expect("set before the device runs")
            .writes = writes;
        self
    }

    /// Gives the device the VM's memory (its vm-memory view: every write is marked dirty).
    pub fn attach(&mut self, memory: &GuestMemory) -> Result<(), ComponentError> {
        self.memory = Some(Arc::new(memory.vm_memory()?));
        Ok(())
    }

    fn memory(&self) -> Result<&Arc<VmGuestMemory>, ComponentError> {
        self.memory
            .as_ref()
            .ok_or_else(|| format!("device '{}' has no memory attached", self.name).into())
    }

    /// The guest driver's setup, emulated: the descriptor table (buffer `i` behind descriptor
    /// `i`), every buffer offered on the avail ring, and the queue configured and ready.
    #[allow(clippy::cast_possible_truncation)] // virtqueue fields: buffer sizes and indices are bounded by the queue size.
    pub fn post_buffers(&mut self) -> Result<(), ComponentError> {
        let mem = self.memory()?.clone();
        let base = self.base;
        for i in 0..u64::from(QUEUE_SIZE) {
            let d = Descriptor::new(
                base + BUFFERS + i * BUFFER,
                BUFFER as u32,
                VIRTQ_DESC_F_WRITE,
                0,
            );
            mem.write_obj(RawDescriptor::from(d), GuestAddress(base + DESC + 16 * i))?;
            mem.write_obj(i as u16, GuestAddress(base + AVAIL + 4 + 2 * i))?;
        }
        mem.write_obj(0u16, GuestAddress(base + AVAIL))?; // flags
        mem.write_obj(QUEUE_SIZE, GuestAddress(base + AVAIL + 2))?; // idx: all offered
        mem.write_obj(0u16, GuestAddress(base + DRIVER))?;
        let mut inner = lock(&self.shared.inner);
        let q = &mut inner.queue;
        q.set_size(QUEUE_SIZE);
        q.try_set_desc_table_address(GuestAddress(base + DESC))?;
        q.try_set_avail_ring_address(GuestAddress(base + AVAIL))?;
        q.try_set_used_ring_address(GuestAddress(base + USED))?;
        q.set_ready(true);
        if !q.is_valid(&*mem) {
            return Err("the queue's rings are not in guest memory".into());
        }
        Ok(())
    }

    /// The device's counters now.
    pub fn stats(&self) -> Stats {
        let inner = lock(&self.shared.inner);
        Stats {
            seq: inner.seq,
            bytes: inner.bytes,
            next_avail: inner.queue.next_avail(),
            next_used: inner.queue.next_used(),
        }
    }

    /// Checks, while paused, that every buffer holds what the device last wrote into it; returns
    /// how many buffers have been filled at least once.
    pub fn verify(&self) -> Result<usize, ComponentError> {
        let mem = self.memory()?;
        let inner = lock(&self.shared.inner);
        let mut buf = vec![0u8; to_usize(BUFFER)];
        let mut filled = 0;
        for (i, &seq) in inner.seq_of.iter().enumerate() {
            if seq == 0 {
                continue;
            }
            let gpa = self.base + BUFFERS + i as u64 * BUFFER;
            mem.read_slice(&mut buf, GuestAddress(gpa))?;
            if buf != fill(seq, buf.len()) {
                let found = u64::from_le_bytes(buf[..8].try_into().expect("8 bytes"));
                return Err(format!(
                    "buffer {i} at {gpa:#x} holds fill {found}, the device last wrote fill {seq}"
                )
                .into());
            }
            filled += 1;
        }
        Ok(filled)
    }

    fn spawn(&mut self) -> Result<(), ComponentError> {
        let mem = self.memory()?.clone();
        let (shared, base, batch, interval) =
            (self.shared.clone(), self.base, self.batch, self.interval);
        let thread = std::thread::Builder::new()
            .name(format!("{}-dev", self.name))
            .spawn(move || {
                while !shared.stop.load(Ordering::Acquire) {
                    if !shared.paused.load(Ordering::Acquire) {
                        let mut inner = lock(&shared.inner);
                        // A pause waits for this lock: once it has it, nothing is written.
                        if !shared.paused.load(Ordering::Acquire) {
                            if let Err(e) = serve(&mut inner, &shared, &mem, base, batch) {
                                eprintln!(
                                    "rng device: {}",
                                    guestmem_migration::error_chain(&*e, ": ")
                                );
                                shared.paused.store(true, Ordering::Release);
                            }
                        }
                    }
                    std::thread::sleep(interval);
                }
            })?;
        self.thread = Some(thread);
        Ok(())
    }
}

/// Fills up to `batch` posted buffers, then plays the guest driver: every buffer used since
/// its last turn goes back on the avail ring.
#[allow(clippy::cast_possible_truncation)] // virtqueue fields: buffer sizes and indices are bounded by the queue size.
fn serve(
    inner: &mut Inner,
    shared: &Shared,
    mem: &VmGuestMemory,
    base: u64,
    batch: usize,
) -> Result<(), ComponentError> {
    for _ in 0..batch {
        let Some(chain) = inner.queue.pop_descriptor_chain(mem) else {
            break;
        };
        let head = chain.head_index();
        inner.seq += 1;
        let bytes = if shared.writes == Writes::Queue {
            let mut writer = chain.writer(mem)?;
            let bytes = fill(inner.seq, writer.available_bytes());
            writer.write_all(&bytes)?;
            bytes
        } else {
            let desc = chain.clone().next().ok_or("an empty descriptor chain")?;
            let bytes = fill(inner.seq, desc.len() as usize);
            let slice = mem.get_slice(desc.addr(), bytes.len())?;
            let guard = slice.ptr_guard_mut();
            // SAFETY: `get_slice` checked that the buffer's `bytes.len()` bytes lie in one
            // region's live mapping, which `mem` keeps mapped; the guest does not touch a
            // buffer it posted until it is used. This bypasses the slice's dirty bitmap on
            // purpose (see `Writes`).
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), guard.as_ptr(), bytes.len()) };
            if shared.writes == Writes::RawReported {
                let mut log = shared
                    .raw_written
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                log.push((desc.addr().0, bytes.len() as u64));
            }
            bytes
        };
        inner.queue.add_used(mem, head, bytes.len() as u32)?;
        inner.seq_of[head as usize] = inner.seq;
        inner.bytes += bytes.len() as u64;
    }
    // The driver's side, in guest memory only.
    let used_idx: u16 = mem.read_obj(GuestAddress(base + USED + 2))?;
    let mut seen: u16 = mem.read_obj(GuestAddress(base + DRIVER))?;
    let mut avail_idx: u16 = mem.read_obj(GuestAddress(base + AVAIL + 2))?;
    while seen != used_idx {
        let slot = u64::from(seen % QUEUE_SIZE);
        let id: u32 = mem.read_obj(GuestAddress(base + USED + 4 + 8 * slot))?;
        let at = u64::from(avail_idx % QUEUE_SIZE);
        mem.write_obj(id as u16, GuestAddress(base + AVAIL + 4 + 2 * at))?;
        avail_idx = avail_idx.wrapping_add(1);
        seen = seen.wrapping_add(1);
    }
    mem.write_obj(avail_idx, GuestAddress(base + AVAIL + 2))?;
    mem.write_obj(seen, GuestAddress(base + DRIVER))?;
    Ok(())
}

impl Component for RngDevice {
    fn name(&self) -> &str {
        &self.name
    }

    fn pause(&mut self) -> Result<(), ComponentError> {
        self.shared.paused.store(true, Ordering::Release);
        // Waits out a batch in progress.
        drop(lock(&self.shared.inner));
        Ok(())
    }

    fn resume(&mut self) -> Result<(), ComponentError> {
        if self.thread.is_none() {
            self.spawn()?;
        }
        self.shared.paused.store(false, Ordering::Release);
        Ok(())
    }

    fn save(&mut self) -> Result<Vec<u8>, ComponentError> {
        let inner = lock(&self.shared.inner);
        let q = inner.queue.state();
        Ok(serde_json::to_vec(&Saved {
            max_size: q.max_size,
            next_avail: q.next_avail,
            next_used: q.next_used,
            event_idx_enabled: q.event_idx_enabled,
            size: q.size,
            ready: q.ready,
            desc_table: q.desc_table,
            avail_ring: q.avail_ring,
            used_ring: q.used_ring,
            seq: inner.seq,
            bytes: inner.bytes,
            seq_of: inner.seq_of.clone(),
        })?)
    }

    fn restore(&mut self, state: &[u8]) -> Result<(), ComponentError> {
        let s: Saved = serde_json::from_slice(state)?;
        if s.seq_of.len() != usize::from(s.max_size) {
            return Err(format!(
                "{} buffer sequence numbers for a queue of {}",
                s.seq_of.len(),
                s.max_size
            )
            .into());
        }
        let queue = Queue::try_from(QueueState {
            max_size: s.max_size,
            next_avail: s.next_avail,
            next_used: s.next_used,
            event_idx_enabled: s.event_idx_enabled,
            size: s.size,
            ready: s.ready,
            desc_table: s.desc_table,
            avail_ring: s.avail_ring,
            used_ring: s.used_ring,
        })?;
        *lock(&self.shared.inner) = Inner {
            queue,
            seq: s.seq,
            bytes: s.bytes,
            seq_of: s.seq_of,
        };
        Ok(())
    }

    fn dirty_log(&mut self) -> Result<Vec<(u64, u64)>, ComponentError> {
        let mut log = self
            .shared
            .raw_written
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        Ok(std::mem::take(&mut *log))
    }
}

impl Drop for RngDevice {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use guestmem_memory::{Backend, RegionSpec};

    fn memory() -> GuestMemory {
        GuestMemory::new(
            &[RegionSpec::new(
                "virtio",
                1 << 30,
                REGION_SIZE,
                Backend::Memfd,
            )],
            None,
        )
        .unwrap()
    }

    fn run_until(dev: &RngDevice, seq: u64) {
        while dev.stats().seq < seq {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn buffers_are_filled_recycled_and_the_state_carries_on_elsewhere() {
        let mem = memory();
        let mut dev = RngDevice::new("rng0", 1 << 30, 64, Duration::from_micros(200));
        dev.attach(&mem).unwrap();
        dev.post_buffers().unwrap();
        mem.regions()[0].vmm_dirty().take();
        dev.resume().unwrap();
        // More than a queue's worth: the emulated driver recycles the buffers.
        run_until(&dev, 3 * u64::from(QUEUE_SIZE));
        dev.pause().unwrap();
        let at_pause = dev.stats();
        assert_eq!(dev.verify().unwrap(), QUEUE_SIZE as usize);
        // Every write went through vm-memory: every buffer page is marked for the harvest.
        let marks = mem.regions()[0].vmm_dirty();
        let first = BUFFERS / 4096;
        assert!((first..first + u64::from(QUEUE_SIZE)).all(|p| marks.is_marked(p)));
        assert!(marks.is_marked(USED / 4096) && marks.is_marked(AVAIL / 4096));
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(dev.stats(), at_pause, "a paused device does nothing");

        // A copy of the memory and the state: the new device goes on from there.
        let state = dev.save().unwrap();
        let copy = memory();
        let mut bytes = vec![0u8; to_usize(REGION_SIZE)];
        mem.read(1 << 30, &mut bytes).unwrap();
        copy.write(1 << 30, &bytes).unwrap();
        let mut there = RngDevice::new("rng0", 1 << 30, 64, Duration::from_micros(200));
        there.restore(&state).unwrap();
        there.attach(&copy).unwrap();
        assert_eq!(there.stats(), at_pause);
        there.resume().unwrap();
        run_until(&there, at_pause.seq + 100);
        there.pause().unwrap();
        assert_eq!(there.verify().unwrap(), QUEUE_SIZE as usize);
        assert!(there.save().is_ok() && there.restore(b"{}").is_err());
    }
}
