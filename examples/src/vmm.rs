//! The example VMM's integration with guestmem: a VM running the payload's `dirty` workload
//! plus an [`RngDevice`] on its own guest region, moved through the component driver
//! ([`guestmem_migration::driver`]) by live migration (pre-copy, post-copy, hybrid) or by
//! snapshot and restore (full, map, lazy), while the device keeps writing guest memory.
//!
//! Each run reports what the checks need: the digests of the device's region at switch-over
//! on both sides (the destination's taken before anything runs there, faulting missing pages
//! in), the device's counters on both sides, and whether every buffer on the destination
//! holds what the device last wrote there after it ran on.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use guestmem_contract::component::{Component, ComponentError, Components};
use guestmem_contract::{PayloadVm, SharedFiles};
use guestmem_memory::{Backend, GuestMemory, RegionSpec};
use guestmem_migration::compress::Compress;
use guestmem_migration::driver::{self, Restore};
use guestmem_migration::migrate::{self, Links, Mode, ReceiveOptions, SendOptions};
use guestmem_migration::transport::{generate_credentials, Credentials, Endpoint, Listener, Role};
use guestmem_paging::PagerConfig;
use guestmem_snapshot::{PreparedVm, Snapshot};
use guestmem_vm::{layout, RunningVm, VcpuWork, Vm, VmConfig, Workload};

use crate::rng::{self, RngDevice, Stats, Writes};

/// Guest RAM the payload dirties.
pub const RAM: u64 = 32 << 20;
/// The VM's vCPUs.
pub const VCPUS: usize = 2;
/// Where the device's queue and buffers live: a region of their own after RAM.
pub const DEVICE_GPA: u64 = layout::RAM_GPA + RAM;

/// Any failure of the example, with its cause in the message.
pub type Error = ComponentError;

/// How the VM moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum How {
    /// Live migration in this mode, to a destination in another thread over a Unix socket.
    Migrate(Mode),
    /// A snapshot, restored in this way.
    Snapshot(&'static str),
}

/// What a run saw.
#[derive(Debug)]
pub struct Outcome {
    /// At the source.
    pub source: Left,
    /// At the destination (or in the restored VM).
    pub arrived: Arrived,
    /// The migration's downtime (0 for a snapshot).
    pub downtime_ms: f64,
    /// Frames of pages the migration sent compressed (0 for a snapshot).
    pub compressed_frames: u64,
}

/// What the source saw.
#[derive(Debug)]
pub struct Left {
    /// The device's counters when the move began (the migration connected, or the snapshot
    /// was asked for).
    pub moving: Stats,
    /// Its counters when the source stopped it.
    pub stopped: Stats,
    /// Digest of the device's region then.
    pub digest: u64,
}

/// What the destination saw.
#[derive(Debug)]
pub struct Arrived {
    /// The device's counters when it got its state, before it ran.
    pub restored: Stats,
    /// Digest of the device's region then.
    pub digest: u64,
    /// Its counters after it ran on.
    pub after: Stats,
    /// Buffers it checked (each holds its last fill) after running on.
    pub verified_buffers: usize,
    /// Pages the payload's vCPUs had done at the switch-over, and after running on.
    pub guest_pages: (u64, u64),
}

/// The VM: the payload's RAM, and the device's region.
pub fn config() -> VmConfig {
    let mut config = VmConfig::simple(VCPUS, RAM, Backend::Memfd);
    config.regions.push(RegionSpec::new(
        "virtio",
        DEVICE_GPA,
        rng::REGION_SIZE,
        Backend::Memfd,
    ));
    config
}

fn work() -> Vec<VcpuWork> {
    let dirty = Workload::Dirty {
        pages_per_s: Some(4096),
        passes: None,
        fill_first: false,
    };
    VcpuWork::split(dirty, layout::RAM_GPA, RAM, VCPUS, 7)
}

/// A device filling 8 buffers (32 KiB) every millisecond at most.
pub fn device() -> RngDevice {
    RngDevice::new("rng0", DEVICE_GPA, 8, Duration::from_millis(1))
}

/// The VMM's builder for the receiving side (the destination of a migration, a restore):
/// guestmem's VM for the configuration that comes, refused unless it has the device's region
/// where the device expects it (the source is then told why, and keeps its guest).
pub fn build(config: &VmConfig, shared: SharedFiles) -> guestmem_contract::Result<Vm> {
    if !config
        .regions
        .iter()
        .any(|r| r.gpa == DEVICE_GPA && r.size >= rng::REGION_SIZE)
    {
        return Err(guestmem_contract::Error::Machine {
            op: "build",
            source: format!(
                "no region of {} bytes at {DEVICE_GPA:#x} for device 'rng0'",
                rng::REGION_SIZE
            )
            .into(),
        });
    }
    Ok(Vm::new_on(config, shared)?)
}

fn device_digest(memory: &GuestMemory) -> Result<u64, Error> {
    Ok(memory.digest(DEVICE_GPA, rng::REGION_SIZE)?)
}

fn wait(what: &str, mut done: impl FnMut() -> bool) -> Result<(), Error> {
    let started = Instant::now();
    while !done() {
        if started.elapsed() > Duration::from_secs(60) {
            return Err(format!("timed out waiting for {what}").into());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(())
}

/// The source: the VM running its payload, the device filling buffers. Returns once both
/// made progress.
fn start<'v>(vm: &'v mut Vm, dev: &mut RngDevice) -> Result<RunningVm<'v>, Error> {
    dev.attach(vm.memory())?;
    dev.post_buffers()?;
    let running = vm.start(&work())?;
    dev.resume()?;
    wait("the device's first queue", || {
        dev.stats().seq > u64::from(rng::QUEUE_SIZE)
    })?;
    Ok(running)
}

/// Lets the restored VM and its device run on (the device was restored as `restored`, and
/// its region's digest was `digest`; the guest had done `before` pages), then stops both and
/// checks the device's buffers.
fn run_on(
    running: RunningVm<'_>,
    dev: &mut RngDevice,
    (restored, digest, before): (Stats, u64, u64),
) -> Result<Arrived, Error> {
    let pages = |r: &RunningVm<'_>| r.progress().iter().map(|p| p.0).sum::<u64>();
    wait("the device and the guest to go on", || {
        dev.stats().seq > restored.seq + 500 && pages(&running) > before + 1000
    })?;
    dev.pause()?;
    let vm = running.pause()?;
    Ok(Arrived {
        restored,
        digest,
        after: dev.stats(),
        verified_buffers: dev.verify()?,
        guest_pages: (before, vm.pages_done().iter().sum()),
    })
}

/// Runs the example: the VM and device start, move as `how` says, and go on. The source's
/// device writes its buffers as `writes` says.
pub fn run(how: How, writes: Writes, scratch: &Path) -> Result<Outcome, Error> {
    match how {
        How::Migrate(mode) => migrate(mode, writes, scratch),
        How::Snapshot(restore) => snapshot(restore, scratch),
    }
}

fn migrate(mode: Mode, writes: Writes, scratch: &Path) -> Result<Outcome, Error> {
    generate_credentials(scratch)?;
    let endpoint = Endpoint::Unix(scratch.join("sock"));
    let listener = Arc::new(Listener::bind(
        &endpoint,
        &Credentials::load(scratch, Role::Destination)?,
    )?);

    // The destination: its device gets its state before the destination says Ready.
    let destination = std::thread::spawn(move || -> Result<_, Error> {
        let mut dev = device();
        let migrate::Incoming {
            mut vm,
            mut transfer,
        } = driver::receive(
            listener,
            &ReceiveOptions::default(),
            &mut build,
            &mut Components::new(vec![&mut dev as &mut dyn Component])?,
        )?;
        dev.attach(vm.memory())?;
        let restored = dev.stats();
        let before = vm.pages_done().iter().sum();
        // driver::resume_incoming runs the vCPUs then the components; the steps are taken one
        // by one here to digest the device's region between them, before the device writes
        // (in post-copy the pages arrive only once the transfer is resumed).
        let running = transfer.resume(&mut vm)?;
        let digest = device_digest(&running.memory().clone())?;
        Components::new(vec![&mut dev as &mut dyn Component])?.resume()?;
        let arrived = run_on(running, &mut dev, (restored, digest, before))?;
        // Post-copy: every page arrived (the source is told, and ends its send).
        transfer.finish()?;
        Ok(arrived)
    });

    let mut vm = Vm::new(&config())?;
    let memory = vm.memory().clone();
    let mut dev = device().with_writes(writes);
    let running = start(&mut vm, &mut dev)?;
    let moving = dev.stats();
    let links = Links::connect(
        &endpoint,
        &Credentials::load(scratch, Role::Source)?,
        mode,
        2,
    )?;
    let opts = SendOptions {
        mode,
        verify: mode == Mode::Precopy,
        // Post-copy's answers compressed, as a slow link wants them: zstd for the background
        // fetches, LZ4 for the faults'.
        compress: if mode == Mode::Postcopy {
            Compress::Zstd
        } else {
            Compress::default()
        },
        ..Default::default()
    };
    let mut machine = PayloadVm::running(running);
    let sent = driver::send(
        &mut machine,
        &mut Components::new(vec![&mut dev as &mut dyn Component])?,
        links,
        &opts,
    );
    let report = match sent {
        Ok(report) => report,
        Err(failure) => {
            let there = destination.join().map_err(|_| "the destination panicked")?;
            return Err(format!(
                "migration failed: {} (destination: {:?})",
                failure.error,
                there.err()
            )
            .into());
        }
    };
    dev.verify()?;
    let source = Left {
        moving,
        stopped: dev.stats(),
        digest: device_digest(&memory)?,
    };
    let arrived = destination
        .join()
        .map_err(|_| "the destination panicked")??;
    Ok(Outcome {
        source,
        arrived,
        downtime_ms: report.downtime_ms,
        compressed_frames: report.compression.lz4_frames + report.compression.zstd_frames,
    })
}

fn snapshot(restore: &str, scratch: &Path) -> Result<Outcome, Error> {
    let dir: PathBuf = scratch.join("snapshot");
    let source = {
        let mut vm = Vm::new(&config())?;
        let mut dev = device();
        let running = start(&mut vm, &mut dev)?;
        let memory = running.memory().clone();
        let moving = dev.stats();
        let mut machine = PayloadVm::running(running);
        driver::snapshot(
            &mut machine,
            &mut Components::new(vec![&mut dev as &mut dyn Component])?,
            &dir,
        )?;
        Left {
            moving,
            stopped: dev.stats(),
            digest: device_digest(&memory)?,
        }
    };

    // `…-prepared`: into a VM built ahead of time for the configuration (a warm pool).
    let (restore, prepared) = match restore.strip_suffix("-prepared") {
        Some(mode) => (mode, Some(PreparedVm::new(&config())?)),
        None => (restore, None),
    };
    let snap = Snapshot::open(&dir)?;
    let how = match restore {
        "full" => Restore::Full,
        "map" => Restore::Map,
        "lazy" => Restore::Lazy(PagerConfig::default()),
        other => {
            return Err(
                format!("no restore mode '{other}' (full, map, lazy, each with -prepared)").into(),
            )
        }
    };
    let mut dev = device();
    let mut components = Components::new(vec![&mut dev as &mut dyn Component])?;
    let mut restored = match prepared {
        Some(prepared) => driver::restore_into(prepared, &snap, how, &mut components)?,
        None => driver::restore(&snap, how, &mut build, &mut components)?,
    };
    drop(components);
    dev.attach(restored.vm.memory())?;
    let restored_device = dev.stats();
    let digest = device_digest(restored.vm.memory())?;
    let before = restored.vm.pages_done().iter().sum();
    let running = driver::resume(
        &mut restored.vm,
        &mut Components::new(vec![&mut dev as &mut dyn Component])?,
    )?;
    Ok(Outcome {
        source,
        arrived: run_on(running, &mut dev, (restored_device, digest, before))?,
        downtime_ms: 0.0,
        compressed_frames: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_builder_refuses_a_vm_without_the_device_region() {
        let e = build(
            &VmConfig::simple(VCPUS, RAM, Backend::Memfd),
            SharedFiles::new(),
        )
        .expect_err("refused");
        assert_eq!(
            guestmem_migration::error_chain(&e, ": "),
            format!(
                "the VM: build failed: no region of {} bytes at {DEVICE_GPA:#x} for device 'rng0'",
                rng::REGION_SIZE
            )
        );
    }
}
