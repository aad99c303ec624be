//! The VM: guest memory (the sys region plus the caller's RAM regions), vCPUs, and runs of the
//! payload with a watchdog.

use guestmem_sys::to_usize;
use std::os::unix::thread::JoinHandleExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use guestmem_memory::{Backend, GuestMemory, RegionSpec, PAGE_SIZE};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};

use crate::payload::*;
use crate::state::{self, VmState};
use crate::vcpu::{self, Outcome, THROTTLE_PERIOD};
use crate::{layout, DirtyRing, Error, Result, RunReport, VcpuReport, VcpuWork, Workload};

/// What VM to build: vCPU count and guest RAM regions (placed anywhere above the sys region).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct VmConfig {
    /// How many vCPUs.
    pub vcpus: usize,
    /// The guest RAM regions.
    pub regions: Vec<RegionSpec>,
    /// Per-vCPU dirty ring size in bytes (a power of two), enabled before the vCPUs are created
    /// (`KVM_CAP_DIRTY_LOG_RING_ACQ_REL` when offered, else `KVM_CAP_DIRTY_LOG_RING`); `None`: no ring.
    pub dirty_ring_bytes: Option<u32>,
}

impl VmConfig {
    /// `vcpus` vCPUs and one region of `size` bytes on `backend` at [`layout::RAM_GPA`].
    pub fn simple(vcpus: usize, size: u64, backend: Backend) -> VmConfig {
        VmConfig {
            vcpus,
            regions: vec![RegionSpec::new("ram", layout::RAM_GPA, size, backend)],
            dirty_ring_bytes: None,
        }
    }
}

/// A KVM VM with its guest memory and vCPUs, ready to run payload workloads.
#[derive(Debug)]
pub struct Vm {
    config: VmConfig,
    _kvm: Kvm,
    fd: VmFd,
    memory: Arc<GuestMemory>,
    vcpus: Vec<VcpuFd>,
    tsc_khz: u64,
    /// The MSRs saved with the vCPU state: those of the restored state, or probed (once per
    /// process, see [`state::restorable_msrs`]) when the VM is first started or saved.
    msr_indices: OnceLock<Vec<u32>>,
    /// Where [`Vm::new`] spent its time, step by step.
    build_phases: Vec<(&'static str, Duration)>,
    /// What each vCPU was last given to do (kept across pause and resume).
    work: Vec<VcpuWork>,
    dirty_rings: Arc<Vec<DirtyRing>>,
    dirty_ring_full_exits: Arc<AtomicU64>,
    abort: AbortHandle,
    /// Share of each 10 ms the vCPUs spend outside the guest (auto-converge), in percent.
    throttle: Arc<AtomicU64>,
}

/// Lets another thread (e.g. a pager whose page source failed) end the VM's current or next
/// [`RunningVm::wait`] (a Linux guest's [`crate::linux::RunningLinux::wait`] or `pause`) with
/// [`Error::Aborted`] and the reason it gives.
#[derive(Debug, Clone, Default)]
pub struct AbortHandle(Arc<Mutex<Option<String>>>);

impl AbortHandle {
    /// Stops the run; the first reason given is the one reported.
    pub fn abort(&self, reason: impl Into<String>) {
        let mut slot = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        slot.get_or_insert_with(|| reason.into());
    }

    pub(crate) fn take(&self) -> Option<String> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
    }

    /// The reason the run was stopped with, if it was and no run has reported it yet.
    pub fn reason(&self) -> Option<String> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

/// The TSC rate KVM gives a new vCPU here (`KVM_GET_TSC_KHZ` on a scratch VM): the rate of
/// guestmem's guests, and of other VMMs' guests that do not set their own (QEMU without
/// `tsc-frequency`).
pub fn host_tsc_khz() -> Result<u64> {
    let kvm = Kvm::new().map_err(Error::Kvm)?;
    let fd = kvm.create_vm().map_err(Error::ioctl("KVM_CREATE_VM"))?;
    let vcpu = fd.create_vcpu(0).map_err(Error::ioctl("KVM_CREATE_VCPU"))?;
    Ok(u64::from(
        vcpu.get_tsc_khz()
            .map_err(Error::ioctl("KVM_GET_TSC_KHZ"))?,
    ))
}

impl Vm {
    /// Builds the VM of `config`: guest memory registered as memslots, the payload and page tables in place, vCPUs created (not running).
    pub fn new(config: &VmConfig) -> Result<Vm> {
        Vm::new_on(config, Default::default())
    }

    /// Like [`Vm::new`], with the RAM regions named in `shared` backed by those files (another
    /// process's memfds, handed over by a local migration) rather than fresh ones.
    pub fn new_on(
        config: &VmConfig,
        mut shared: std::collections::HashMap<String, std::os::fd::OwnedFd>,
    ) -> Result<Vm> {
        if config.vcpus == 0 || config.vcpus > layout::MAX_VCPUS {
            return Err(Error::Config(format!(
                "{} vCPUs requested; 1 to {} are supported",
                config.vcpus,
                layout::MAX_VCPUS
            )));
        }
        let mut phases = Phases::start();
        let kvm = Kvm::new().map_err(Error::Kvm)?;
        let fd = kvm.create_vm().map_err(Error::ioctl("KVM_CREATE_VM"))?;
        state::check_xsave_size(&fd)?;
        if let Some(bytes) = config.dirty_ring_bytes {
            enable_dirty_ring(&fd, bytes)?;
        }
        phases.mark("create VM");

        let mut specs = vec![RegionSpec::new(
            "sys",
            layout::SYS_GPA,
            layout::SYS_SIZE,
            Backend::Anon,
        )];
        specs.extend(config.regions.iter().cloned());
        if let Some(r) = specs
            .iter()
            .find(|r| r.gpa.saturating_add(r.size) > layout::MAX_GUEST_ADDR)
        {
            return Err(Error::Config(format!(
                "region '{}' ends above {:#x}, the highest guest address the payload maps",
                r.name,
                layout::MAX_GUEST_ADDR
            )));
        }
        let memory = GuestMemory::new_on(&specs, Some(&fd), &mut shared)?;
        phases.mark("create regions");
        memory.register(&fd)?;
        phases.mark("register memslots");
        load_payload(&memory)?;
        build_identity_map(&memory)?;
        phases.mark("payload and page tables");

        vcpu::install_kick_handler()?;
        let cpuid = vcpu::supported_cpuid(&kvm)?;
        phases.mark("supported CPUID");
        let mut vcpus = Vec::with_capacity(config.vcpus);
        for id in 0..config.vcpus {
            let v = fd
                .create_vcpu(id as u64)
                .map_err(Error::ioctl("KVM_CREATE_VCPU"))?;
            vcpu::set_cpuid(&v, id, cpuid)?;
            vcpus.push(v);
        }
        phases.mark("create vCPUs");
        let dirty_rings = match config.dirty_ring_bytes {
            Some(bytes) => vcpus
                .iter()
                .enumerate()
                .map(|(id, v)| DirtyRing::map(v, id, bytes))
                .collect::<Result<Vec<_>>>()?,
            None => Vec::new(),
        };
        let tsc_khz = u64::from(
            vcpus[0]
                .get_tsc_khz()
                .map_err(Error::ioctl("KVM_GET_TSC_KHZ"))?,
        );
        phases.mark("dirty rings and TSC");
        Ok(Vm {
            config: config.clone(),
            _kvm: kvm,
            fd,
            memory: Arc::new(memory),
            vcpus,
            tsc_khz,
            msr_indices: OnceLock::new(),
            build_phases: phases.done(),
            work: Vec::new(),
            dirty_rings: Arc::new(dirty_rings),
            dirty_ring_full_exits: Arc::new(AtomicU64::new(0)),
            abort: AbortHandle::default(),
            throttle: Arc::new(AtomicU64::new(0)),
        })
    }

    /// Where [`Vm::new`] spent its time, step by step (for restore-latency profiles).
    pub fn build_phases(&self) -> &[(&'static str, Duration)] {
        &self.build_phases
    }

    /// The MSRs saved with the vCPU state; probed on vCPU 0 the first time (in a process,
    /// the probe itself runs once), which must happen before it first runs (see `start`).
    fn msr_indices(&self) -> Result<&[u32]> {
        if let Some(indices) = self.msr_indices.get() {
            return Ok(indices);
        }
        let indices = state::restorable_msrs(&self.vcpus[0])?;
        Ok(self.msr_indices.get_or_init(|| indices))
    }

    /// What this VM was built from (its guest RAM regions; the sys region is implied).
    pub fn config(&self) -> &VmConfig {
        &self.config
    }

    /// The vCPUs' dirty rings, vCPU `i` at index `i` (empty without `dirty_ring_bytes`).
    pub fn dirty_rings(&self) -> &Arc<Vec<DirtyRing>> {
        &self.dirty_rings
    }
    /// How many `KVM_EXIT_DIRTY_RING_FULL` exits the vCPUs have waited out so far.
    pub fn dirty_ring_full_exits(&self) -> u64 {
        self.dirty_ring_full_exits.load(Ordering::Relaxed)
    }

    /// The KVM VM fd.
    pub fn fd(&self) -> &VmFd {
        &self.fd
    }
    /// The guest memory.
    pub fn memory(&self) -> &Arc<GuestMemory> {
        &self.memory
    }
    /// How many vCPUs.
    pub fn vcpu_count(&self) -> usize {
        self.vcpus.len()
    }
    /// Pages each vCPU's workload has done, from its control block (the guest's own counter).
    pub fn pages_done(&self) -> Vec<u64> {
        (0..self.config.vcpus)
            .map(|id| self.control(id, CTL_PAGES_DONE))
            .collect()
    }

    /// What each vCPU's payload was given to do (by [`Vm::start`] or a restored state).
    pub fn work(&self) -> &[VcpuWork] {
        &self.work
    }

    /// Whether guest memory agrees with what the `dirty` workloads' counters say they wrote
    /// (pages before each vCPU's cursor hold this pass's value, those after the last pass's,
    /// or zero before the first pass ended): `None` when a vCPU runs another workload, else
    /// the first page that disagrees, if any. Read with the VM stopped: it is how a migrated
    /// or restored guest's memory is checked by what the guest itself wrote.
    pub fn dirty_pages_disagreeing(&self) -> Option<std::result::Result<(), String>> {
        let pages_done = self.pages_done();
        if self.work.is_empty()
            || !self
                .work
                .iter()
                .all(|w| matches!(w.workload, crate::Workload::Dirty { .. }))
        {
            return None;
        }
        Some(crate::payload::check_dirty_pages(
            &self.memory,
            &self.work,
            &pages_done,
        ))
    }

    /// The vCPUs' TSC rate.
    pub fn tsc_khz(&self) -> u64 {
        self.tsc_khz
    }
    /// A handle that ends this VM's runs with an error (see [`AbortHandle`]).
    pub fn abort_handle(&self) -> AbortHandle {
        self.abort.clone()
    }

    /// Starts every vCPU at the payload's entry with its piece of `work` (one per vCPU).
    pub fn start(&mut self, work: &[VcpuWork]) -> Result<RunningVm<'_>> {
        if work.len() != self.vcpus.len() {
            return Err(Error::Config(format!(
                "{} workloads for {} vCPUs",
                work.len(),
                self.vcpus.len()
            )));
        }
        for (id, w) in work.iter().enumerate() {
            self.write_control(id, w)?;
            vcpu::set_entry_state(&self.vcpus[id], id)?;
        }
        // The MSR probe writes back what it reads: do it while no vCPU has run yet.
        self.msr_indices()?;
        self.work = work.to_vec();
        self.spawn_vcpus()
    }

    /// Lets the vCPUs go on from where they are (after a pause, or after `restore_state`).
    pub fn resume(&mut self) -> Result<RunningVm<'_>> {
        if self.work.len() != self.vcpus.len() {
            return Err(Error::Config(
                "nothing to resume: the vCPUs were never started nor restored".into(),
            ));
        }
        self.spawn_vcpus()
    }

    /// The state of every vCPU and of the VM, for a VM that is not running.
    pub fn save_state(&self) -> Result<VmState> {
        let msr_indices = self.msr_indices()?;
        let vcpus = self
            .vcpus
            .iter()
            .map(|v| state::save_vcpu(v, msr_indices))
            .collect::<Result<Vec<_>>>()?;
        let clock = self.fd.get_clock().map_err(Error::ioctl("KVM_GET_CLOCK"))?;
        Ok(VmState {
            vcpus,
            clock,
            work: self.work.clone(),
        })
    }

    /// Puts a saved state into this VM's vCPUs (built with the same configuration); the guest
    /// goes on from there at the next [`Vm::resume`]. Memory is restored separately.
    pub fn restore_state(&mut self, saved: &VmState) -> Result<()> {
        if saved.vcpus.len() != self.vcpus.len() {
            return Err(Error::Config(format!(
                "the saved state has {} vCPUs, this VM {}",
                saved.vcpus.len(),
                self.vcpus.len()
            )));
        }
        if saved.work.len() != self.vcpus.len() {
            return Err(Error::Config(format!(
                "the saved state has the guest work of {} vCPUs, this VM has {} vCPUs \
                 (a state saved before the VM first ran has none)",
                saved.work.len(),
                self.vcpus.len()
            )));
        }
        for (vcpu, s) in self.vcpus.iter().zip(&saved.vcpus) {
            state::restore_vcpu(vcpu, s)?;
        }
        // The restored MSRs are the ones to save next time (no probe needed).
        let _ = self
            .msr_indices
            .set(saved.vcpus[0].msrs.iter().map(|m| m.index).collect());
        let clock = kvm_bindings::kvm_clock_data {
            clock: saved.clock.clock,
            ..Default::default()
        };
        self.fd
            .set_clock(&clock)
            .map_err(Error::ioctl("KVM_SET_CLOCK"))?;
        self.work = saved.work.clone();
        Ok(())
    }

    /// Completes what each vCPU's last exit left pending in KVM (the emulation of an MMIO or
    /// port access the VMM handled, e.g. the payload's "done" write), without entering the
    /// guest (`KVM_RUN` with `immediate_exit`): KVM finishes such an instruction at the next
    /// `KVM_RUN`, writing its registers, so a VM that is to be given a saved state again
    /// (reused for another restore) must have it done first, or the old instruction's end would
    /// land on the new state.
    pub fn complete_pending_exits(&mut self) -> Result<()> {
        for (id, vcpu) in self.vcpus.iter_mut().enumerate() {
            vcpu::complete_pending_exit(id, vcpu)?;
        }
        Ok(())
    }

    fn spawn_vcpus(&mut self) -> Result<RunningVm<'_>> {
        let (done_tx, done_rx) = mpsc::channel();
        let kicked = Arc::new(AtomicBool::new(false));
        let threads = self
            .vcpus
            .drain(..)
            .enumerate()
            .map(|(id, mut v)| {
                let done = done_tx.clone();
                let kicked = kicked.clone();
                let ring_full = self.dirty_ring_full_exits.clone();
                let throttle = self.throttle.clone();
                let tsc_khz = self.tsc_khz;
                let memory = self.memory.clone();
                std::thread::Builder::new()
                    .name(format!("vcpu{id}"))
                    .spawn(move || {
                        let outcome = vcpu::run_loop(
                            id, &mut v, &kicked, &ring_full, &throttle, tsc_khz, &memory,
                        );
                        let _ = done.send(id);
                        (v, outcome)
                    })
                    .map_err(|e| Error::Thread {
                        vcpu: id,
                        reason: e.to_string(),
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(RunningVm {
            work: self.work.clone(),
            vm: self,
            threads,
            done_rx,
            kicked,
            started: Instant::now(),
            ticker: None,
        })
    }

    /// Runs `work` to completion (see [`RunningVm::wait`]).
    pub fn run(&mut self, work: &[VcpuWork], stall_timeout: Duration) -> Result<RunReport> {
        self.start(work)?.wait(stall_timeout)
    }

    fn write_control(&self, id: usize, w: &VcpuWork) -> Result<()> {
        if !w.size.is_multiple_of(PAGE_SIZE) || !w.gpa.is_multiple_of(PAGE_SIZE) {
            return Err(Error::Config(format!(
                "vCPU {id}: workload range {:#x}+{:#x} is not page-aligned",
                w.gpa, w.size
            )));
        }
        if w.size > 0 {
            self.memory.find(w.gpa, w.size).map_err(|_| {
                Error::Config(format!(
                    "vCPU {id}: workload range {:#x}+{:#x} is not inside one guest RAM region",
                    w.gpa, w.size
                ))
            })?;
        }
        if let Workload::Random { writes, log_gpa } = w.workload {
            let log_end = log_gpa.saturating_add(writes.saturating_mul(8));
            if self.memory.find(log_gpa, log_end - log_gpa).is_err()
                || (log_gpa < w.gpa + w.size && w.gpa < log_end)
            {
                return Err(Error::Config(format!(
                    "vCPU {id}: random workload log {log_gpa:#x}+{:#x} must lie inside one guest \
                     region and outside the written range {:#x}+{:#x}",
                    writes * 8,
                    w.gpa,
                    w.size
                )));
            }
        }
        if let Workload::Mixed { write_percent, .. } = w.workload {
            if write_percent > 100 {
                return Err(Error::Config(format!(
                    "vCPU {id}: write percentage {write_percent} is above 100"
                )));
            }
        }
        let ctl = layout::control_gpa(id);
        let (mut read_percent, mut writes, mut log_gpa, mut throttle_after) = (0, 0, 0, 0);
        let rewrite = u64::from(matches!(w.workload, Workload::Rewrite { .. }));
        let (code, passes, tsc_per_page) = match w.workload {
            Workload::Touch => (WORKLOAD_WRITE, 1, 0),
            Workload::Dirty {
                pages_per_s,
                passes,
                fill_first,
            } => {
                if fill_first {
                    throttle_after = w.pages();
                }
                (
                    WORKLOAD_WRITE,
                    passes.unwrap_or(0),
                    pages_per_s.map_or(0, |r| (self.tsc_khz * 1000) / r.max(1)),
                )
            }
            Workload::Rewrite {
                pages_per_s,
                passes,
            } => (
                WORKLOAD_WRITE,
                passes.unwrap_or(0),
                pages_per_s.map_or(0, |r| (self.tsc_khz * 1000) / r.max(1)),
            ),
            Workload::Verify => (WORKLOAD_VERIFY, 0, 0),
            Workload::Mixed {
                write_percent,
                passes,
            } => {
                read_percent = 100 - write_percent;
                (WORKLOAD_WRITE, passes.unwrap_or(0), 0)
            }
            Workload::Random {
                writes: n,
                log_gpa: log,
            } => {
                (writes, log_gpa) = (n, log);
                (WORKLOAD_RANDOM, 0, 0)
            }
        };
        self.memory.write(ctl, &[0u8; to_usize(PAGE_SIZE)])?;
        for (field, value) in [
            (CTL_WORKLOAD, code),
            (CTL_RANGE_GPA, w.gpa),
            (CTL_RANGE_PAGES, w.pages()),
            (CTL_SEED, w.seed),
            (CTL_TSC_PER_PAGE, tsc_per_page),
            (CTL_PASSES, passes),
            (CTL_GEN_LIMIT, u64::MAX),
            (CTL_READ_PERCENT, read_percent),
            (CTL_WRITES, writes),
            (CTL_LOG_GPA, log_gpa),
            (CTL_THROTTLE_AFTER, throttle_after),
            (CTL_REWRITE, rewrite),
        ] {
            self.memory.write_u64(ctl + field, value)?;
        }
        Ok(())
    }

    fn control(&self, id: usize, field: u64) -> u64 {
        self.memory
            .read_u64(layout::control_gpa(id) + field)
            .expect("control blocks lie in the sys region")
    }
}

/// A VM whose vCPU threads are running. Dropping it stops them.
#[derive(Debug)]
pub struct RunningVm<'a> {
    vm: &'a mut Vm,
    work: Vec<VcpuWork>,
    threads: Vec<JoinHandle<(VcpuFd, Outcome)>>,
    done_rx: mpsc::Receiver<usize>,
    kicked: Arc<AtomicBool>,
    started: Instant,
    /// The thread that kicks the vCPUs every [`THROTTLE_PERIOD`] while they are throttled.
    ticker: Option<(Arc<AtomicBool>, JoinHandle<()>)>,
}

impl<'a> RunningVm<'a> {
    /// The VM's guest memory.
    pub fn memory(&self) -> &Arc<GuestMemory> {
        &self.vm.memory
    }

    /// The VM these vCPUs belong to (to start a dirty tracker on it, say).
    pub fn vm(&self) -> &Vm {
        self.vm
    }

    /// Throttles the vCPUs (auto-converge): each spends `percent` % (at most 99) of every
    /// `THROTTLE_PERIOD` out of the guest; 0 lets them run freely again.
    pub fn set_throttle(&mut self, percent: u64) -> Result<()> {
        self.vm.throttle.store(percent.min(99), Ordering::Release);
        if percent == 0 || self.ticker.is_some() {
            return Ok(());
        }
        let stop = Arc::new(AtomicBool::new(false));
        let threads: Vec<libc::pthread_t> = self
            .threads
            .iter()
            .map(std::os::unix::thread::JoinHandleExt::as_pthread_t)
            .collect();
        let throttle = self.vm.throttle.clone();
        let done = stop.clone();
        let ticker = std::thread::Builder::new()
            .name("vcpu-throttle".into())
            .spawn(move || {
                while !done.load(Ordering::Acquire) {
                    std::thread::sleep(THROTTLE_PERIOD);
                    if throttle.load(Ordering::Acquire) == 0 {
                        continue;
                    }
                    for &t in &threads {
                        // SAFETY: the vCPU threads outlive the ticker (it is stopped and joined
                        // before they are), so each pthread_t is valid; the kick signal's
                        // handler is installed and does nothing.
                        unsafe { libc::pthread_kill(t, vcpu::kick_signal()) };
                    }
                }
            })
            .map_err(|e| Error::Thread {
                vcpu: 0,
                reason: format!("cannot start the throttle thread: {e}"),
            })?;
        self.ticker = Some((stop, ticker));
        Ok(())
    }

    /// The vCPUs' current throttle, in percent.
    pub fn throttle(&self) -> u64 {
        self.vm.throttle.load(Ordering::Acquire)
    }

    /// Pages done and passes completed, per vCPU, as the guest reports them.
    pub fn progress(&self) -> Vec<(u64, u64)> {
        (0..self.work.len())
            .map(|id| {
                (
                    self.vm.control(id, CTL_PAGES_DONE),
                    self.vm.control(id, CTL_GENERATION),
                )
            })
            .collect()
    }

    /// Lets the `dirty` workload start passes only while its generation is below `limit`.
    pub fn set_generation_limit(&self, limit: u64) {
        for id in 0..self.work.len() {
            let _ = self
                .vm
                .memory
                .write_u64(layout::control_gpa(id) + CTL_GEN_LIMIT, limit);
        }
    }

    /// Asks the payload to finish (it stops writing at the next page and signals done).
    pub fn stop(&self) {
        for id in 0..self.work.len() {
            let _ = self
                .vm
                .memory
                .write_u64(layout::control_gpa(id) + CTL_STOP, 1);
        }
    }

    /// Waits until every vCPU has signalled done. A vCPU that makes no progress for
    /// `stall_timeout` (while not held at the generation gate), exits unexpectedly, or fails
    /// ends the run with an error naming it; the other vCPUs are then stopped too.
    pub fn wait(mut self, stall_timeout: Duration) -> Result<RunReport> {
        let n = self.work.len();
        let mut finished = vec![false; n];
        let mut last = self.progress();
        let mut last_change = vec![Instant::now(); n];
        let mut failure: Option<Error> = None;
        while failure.is_none() && finished.iter().any(|f| !f) {
            match self.done_rx.recv_timeout(Duration::from_millis(20)) {
                Ok(id) => {
                    finished[id] = true;
                    continue;
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
            if let Some(reason) = self.vm.abort.take() {
                failure = Some(Error::Aborted(reason));
                break;
            }
            let now = self.progress();
            for id in (0..n).filter(|&id| !finished[id]) {
                let gated = now[id].1 >= self.vm.control(id, CTL_GEN_LIMIT);
                if now[id] != last[id] || gated {
                    last_change[id] = Instant::now();
                } else if last_change[id].elapsed() >= stall_timeout {
                    failure = Some(Error::Stalled {
                        vcpu: id,
                        secs: last_change[id].elapsed().as_secs_f64(),
                        rip: 0,
                        pages: now[id].0,
                    });
                }
            }
            last = now;
        }
        let wall = self.started.elapsed().as_secs_f64();
        let outcomes = self.join_all();
        if let Some(Error::Stalled {
            vcpu, secs, pages, ..
        }) = failure
        {
            let rip = match outcomes[vcpu] {
                Outcome::Kicked { rip } => rip,
                _ => u64::MAX,
            };
            return Err(Error::Stalled {
                vcpu,
                secs,
                rip,
                pages,
            });
        }
        if let Some(e @ Error::Aborted(_)) = failure {
            return Err(e);
        }
        for outcome in outcomes {
            if let Outcome::Failed(e) = outcome {
                return Err(e);
            }
        }
        self.report(wall)
    }

    /// Stops every vCPU where it is (out of KVM_RUN, state intact) and gives them back to the
    /// VM, which is handed back to be saved or resumed. Fails if a vCPU had already failed.
    pub fn pause(mut self) -> Result<&'a mut Vm> {
        let outcomes = self.join_all();
        let vm: *mut Vm = self.vm;
        drop(self);
        // SAFETY: `self` held the only borrow of the VM for 'a and is gone (its drop did
        // nothing: the vCPU threads are joined), so handing that borrow on is sound.
        let vm = unsafe { &mut *vm };
        for outcome in outcomes {
            if let Outcome::Failed(e) = outcome {
                return Err(e);
            }
        }
        Ok(vm)
    }

    /// Kicks every vCPU out of KVM_RUN, joins the threads and gives the vCPUs back to the VM.
    fn join_all(&mut self) -> Vec<Outcome> {
        if let Some((stop, ticker)) = self.ticker.take() {
            stop.store(true, Ordering::Release);
            let _ = ticker.join();
        }
        self.vm.throttle.store(0, Ordering::Release);
        self.kicked.store(true, Ordering::Release);
        let mut outcomes = Vec::with_capacity(self.threads.len());
        // Every vCPU kicked at once, again every 100 us until each has left KVM_RUN: a
        // pause (a live snapshot's included) lasts as long as the slowest vCPU takes to stop,
        // not the sum of 1 ms waits per vCPU.
        while self.threads.iter().any(|h| !h.is_finished()) {
            for handle in self.threads.iter().filter(|h| !h.is_finished()) {
                // SAFETY: the thread is still running (not joined), so its pthread_t is valid;
                // the kick signal's handler is installed and does nothing.
                unsafe { libc::pthread_kill(handle.as_pthread_t(), vcpu::kick_signal()) };
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        for handle in self.threads.drain(..) {
            match handle.join() {
                Ok((fd, outcome)) => {
                    self.vm.vcpus.push(fd);
                    outcomes.push(outcome);
                }
                Err(_) => outcomes.push(Outcome::Failed(Error::Thread {
                    vcpu: outcomes.len(),
                    reason: "the vCPU thread panicked".into(),
                })),
            }
        }
        outcomes
    }

    fn report(&self, wall_seconds: f64) -> Result<RunReport> {
        let tsc_hz = (self.vm.tsc_khz * 1000) as f64;
        let mut vcpus = Vec::with_capacity(self.work.len());
        for (id, w) in self.work.iter().enumerate() {
            let state = self.vm.control(id, CTL_STATE);
            if state == STATE_BAD_WORKLOAD {
                return Err(Error::BadWorkload { vcpu: id, state });
            }
            let pages = self.vm.control(id, CTL_PAGES_DONE);
            let ticks = self
                .vm
                .control(id, CTL_TSC_END)
                .saturating_sub(self.vm.control(id, CTL_TSC_START));
            let guest_seconds = ticks as f64 / tsc_hz;
            vcpus.push(VcpuReport {
                vcpu: id,
                workload: w.workload.name(),
                pages,
                generation: self.vm.control(id, CTL_GENERATION),
                digest: self.vm.control(id, CTL_DIGEST),
                guest_seconds,
                pages_per_s: if guest_seconds > 0.0 {
                    pages as f64 / guest_seconds
                } else {
                    0.0
                },
            });
        }
        Ok(RunReport {
            total_pages: vcpus.iter().map(|v| v.pages).sum(),
            total_pages_per_s: vcpus.iter().map(|v| v.pages_per_s).sum(),
            wall_seconds,
            vcpus,
        })
    }
}

impl Drop for RunningVm<'_> {
    fn drop(&mut self) {
        if !self.threads.is_empty() {
            self.join_all();
        }
    }
}

/// Times the steps of a multi-step operation.
pub(crate) struct Phases {
    last: Instant,
    done: Vec<(&'static str, Duration)>,
}

impl Phases {
    pub(crate) fn start() -> Phases {
        Phases {
            last: Instant::now(),
            done: Vec::new(),
        }
    }

    /// The step `name` ended now.
    pub(crate) fn mark(&mut self, name: &'static str) {
        let now = Instant::now();
        self.done.push((name, now - self.last));
        self.last = now;
    }

    pub(crate) fn done(self) -> Vec<(&'static str, Duration)> {
        self.done
    }
}

/// Enables a dirty ring of `bytes` per vCPU (acquire/release flavour when offered).
pub(crate) fn enable_dirty_ring(fd: &VmFd, bytes: u32) -> Result<()> {
    use guestmem_sys::uapi::{KVM_CAP_DIRTY_LOG_RING, KVM_CAP_DIRTY_LOG_RING_ACQ_REL};
    let acq_rel = fd.check_extension_raw(KVM_CAP_DIRTY_LOG_RING_ACQ_REL.into()) > 0;
    let cap = if acq_rel {
        KVM_CAP_DIRTY_LOG_RING_ACQ_REL
    } else {
        KVM_CAP_DIRTY_LOG_RING
    };
    let max = fd.check_extension_raw(cap.into());
    let mut enable = kvm_bindings::kvm_enable_cap {
        cap,
        ..Default::default()
    };
    enable.args[0] = bytes.into();
    fd.enable_cap(&enable).map_err(|e| {
        Error::Config(format!(
            "dirty ring of {bytes} bytes per vCPU refused ({e}): it must be a power of two \
             from 4096 to {max} bytes (0 = the kernel has no dirty ring)"
        ))
    })
}

fn load_payload(memory: &GuestMemory) -> Result<()> {
    if IMAGE.len() as u64 > layout::PAYLOAD_MAX {
        return Err(Error::Config(format!(
            "payload image is {} bytes, more than its slot",
            IMAGE.len()
        )));
    }
    Ok(memory.write(layout::PAYLOAD_GPA, IMAGE)?)
}

/// Identity-maps [0, end of guest memory) with 2 MiB pages, user-accessible at every level.
fn build_identity_map(memory: &GuestMemory) -> Result<()> {
    const P_RW_US: u64 = 0x7;
    const PS: u64 = 0x80;
    let gibs = memory.end().div_ceil(1 << 30);
    memory.write_u64(layout::PML4_GPA, layout::PDPT_GPA | P_RW_US)?;
    for g in 0..gibs {
        let pd = layout::PD_GPA + g * 0x1000;
        memory.write_u64(layout::PDPT_GPA + g * 8, pd | P_RW_US)?;
        let entries: Vec<u8> = (0..512u64)
            .flat_map(|i| (((g << 30) + (i << 21)) | PS | P_RW_US).to_le_bytes())
            .collect();
        memory.write(pd, &entries)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The page tables map every GiB up to the end of guest memory with 2 MiB pages, identity
    /// (GVA = GPA), present, writable and user at every level; nothing past the last GiB.
    #[test]
    fn the_identity_map_covers_guest_memory_exactly() {
        let memory = GuestMemory::new(
            &[
                RegionSpec::new("sys", layout::SYS_GPA, layout::SYS_SIZE, Backend::Anon),
                RegionSpec::new("ram", layout::RAM_GPA, (1 << 30) + (2 << 20), Backend::Anon),
            ],
            None,
        )
        .unwrap();
        build_identity_map(&memory).unwrap();
        let u64_at = |gpa| memory.read_u64(gpa).unwrap();
        assert_eq!(u64_at(layout::PML4_GPA), layout::PDPT_GPA | 7);
        // RAM ends 2 MiB into the third GiB: three page directories.
        for g in 0..3 {
            let pd = layout::PD_GPA + g * 0x1000;
            assert_eq!(u64_at(layout::PDPT_GPA + g * 8), pd | 7);
            for i in [0, 1, 511] {
                assert_eq!(
                    u64_at(pd + i * 8),
                    ((g << 30) + (i << 21)) | 0x87,
                    "GiB {g}, 2 MiB {i}"
                );
            }
        }
        assert_eq!(u64_at(layout::PDPT_GPA + 3 * 8), 0);
    }

    /// The first reason given wins; taking it clears it, for every clone.
    #[test]
    fn an_abort_keeps_its_first_reason() {
        let a = AbortHandle::default();
        let b = a.clone();
        assert_eq!(a.take(), None);
        b.abort("the page source failed");
        a.abort("a later reason");
        assert_eq!(b.take().as_deref(), Some("the page source failed"));
        assert_eq!(a.take(), None);
    }

    /// A dirty ring size KVM refuses is named with the rule it must follow.
    #[test]
    fn a_bad_dirty_ring_size_is_refused_naming_the_rule() {
        let vm = Kvm::new().unwrap().create_vm().unwrap();
        let e = enable_dirty_ring(&vm, 1000).unwrap_err().to_string();
        assert!(
            e.contains("dirty ring of 1000 bytes per vCPU refused")
                && e.contains("it must be a power of two from 4096 to"),
            "{e}"
        );
    }

    /// The phases are timed in order, each from the end of the one before.
    #[test]
    fn phases_are_timed_in_order() {
        let mut p = Phases::start();
        std::thread::sleep(Duration::from_millis(5));
        p.mark("first");
        p.mark("second");
        let done = p.done();
        assert_eq!(
            done.iter().map(|d| d.0).collect::<Vec<_>>(),
            ["first", "second"]
        );
        assert!(done[0].1 >= Duration::from_millis(5) && done[1].1 < Duration::from_millis(5));
        let c = VmConfig::simple(3, 1 << 30, Backend::Memfd);
        assert_eq!((c.vcpus, c.dirty_ring_bytes), (3, None));
        assert_eq!(c.regions[0].gpa, layout::RAM_GPA);
    }
}
