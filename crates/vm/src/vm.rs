//! The VM: guest memory (the sys region plus the caller's RAM regions), vCPUs, and runs of the
//! payload with a watchdog.

use std::os::unix::thread::JoinHandleExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use guestmem_memory::{Backend, GuestMemory, RegionSpec, PAGE_SIZE};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};

use crate::payload::*;
use crate::vcpu::{self, Outcome};
use crate::{layout, Error, Result, RunReport, VcpuReport, VcpuWork, Workload};

/// What VM to build: vCPU count and guest RAM regions (placed anywhere above the sys region).
#[derive(Debug, Clone)]
pub struct VmConfig {
    pub vcpus: usize,
    pub regions: Vec<RegionSpec>,
}

impl VmConfig {
    /// `vcpus` vCPUs and one region of `size` bytes on `backend` at [`layout::RAM_GPA`].
    pub fn simple(vcpus: usize, size: u64, backend: Backend) -> VmConfig {
        VmConfig {
            vcpus,
            regions: vec![RegionSpec::new("ram", layout::RAM_GPA, size, backend)],
        }
    }
}

/// A KVM VM with its guest memory and vCPUs, ready to run payload workloads.
pub struct Vm {
    _kvm: Kvm,
    fd: VmFd,
    memory: Arc<GuestMemory>,
    vcpus: Vec<VcpuFd>,
    tsc_khz: u64,
    abort: AbortHandle,
}

/// Lets another thread (e.g. a pager whose page source failed) end the VM's current or next
/// [`RunningVm::wait`] with [`Error::Aborted`] and the reason it gives.
#[derive(Debug, Clone, Default)]
pub struct AbortHandle(Arc<Mutex<Option<String>>>);

impl AbortHandle {
    /// Stops the run; the first reason given is the one reported.
    pub fn abort(&self, reason: impl Into<String>) {
        let mut slot = self.0.lock().unwrap_or_else(|e| e.into_inner());
        slot.get_or_insert_with(|| reason.into());
    }

    fn take(&self) -> Option<String> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

impl Vm {
    pub fn new(config: &VmConfig) -> Result<Vm> {
        if config.vcpus == 0 || config.vcpus > layout::MAX_VCPUS {
            return Err(Error::Config(format!(
                "{} vCPUs requested; 1 to {} are supported",
                config.vcpus,
                layout::MAX_VCPUS
            )));
        }
        let kvm = Kvm::new().map_err(Error::Kvm)?;
        let fd = kvm.create_vm().map_err(Error::ioctl("KVM_CREATE_VM"))?;

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
        let memory = GuestMemory::new(&specs, Some(&fd))?;
        memory.register(&fd)?;
        load_payload(&memory)?;
        build_identity_map(&memory)?;

        vcpu::install_kick_handler()?;
        let cpuid = vcpu::supported_cpuid(&kvm)?;
        let mut vcpus = Vec::with_capacity(config.vcpus);
        for id in 0..config.vcpus {
            let v = fd
                .create_vcpu(id as u64)
                .map_err(Error::ioctl("KVM_CREATE_VCPU"))?;
            vcpu::set_cpuid(&v, id, &cpuid)?;
            vcpus.push(v);
        }
        let tsc_khz = vcpus[0]
            .get_tsc_khz()
            .map_err(Error::ioctl("KVM_GET_TSC_KHZ"))? as u64;
        Ok(Vm {
            _kvm: kvm,
            fd,
            memory: Arc::new(memory),
            vcpus,
            tsc_khz,
            abort: AbortHandle::default(),
        })
    }

    pub fn fd(&self) -> &VmFd {
        &self.fd
    }
    pub fn memory(&self) -> &Arc<GuestMemory> {
        &self.memory
    }
    pub fn vcpu_count(&self) -> usize {
        self.vcpus.len()
    }
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
        let (done_tx, done_rx) = mpsc::channel();
        let kicked = Arc::new(AtomicBool::new(false));
        let threads = self
            .vcpus
            .drain(..)
            .enumerate()
            .map(|(id, mut v)| {
                let done = done_tx.clone();
                let kicked = kicked.clone();
                std::thread::Builder::new()
                    .name(format!("vcpu{id}"))
                    .spawn(move || {
                        let outcome = vcpu::run_loop(id, &mut v, &kicked);
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
            vm: self,
            work: work.to_vec(),
            threads,
            done_rx,
            kicked,
            started: Instant::now(),
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
        let ctl = layout::control_gpa(id);
        let (code, passes, tsc_per_page) = match w.workload {
            Workload::Touch => (WORKLOAD_WRITE, 1, 0),
            Workload::Dirty {
                pages_per_s,
                passes,
            } => (
                WORKLOAD_WRITE,
                passes.unwrap_or(0),
                pages_per_s.map_or(0, |r| (self.tsc_khz * 1000) / r.max(1)),
            ),
            Workload::Verify => (WORKLOAD_VERIFY, 0, 0),
        };
        self.memory.write(ctl, &[0u8; PAGE_SIZE as usize])?;
        for (field, value) in [
            (CTL_WORKLOAD, code),
            (CTL_RANGE_GPA, w.gpa),
            (CTL_RANGE_PAGES, w.pages()),
            (CTL_SEED, w.seed),
            (CTL_TSC_PER_PAGE, tsc_per_page),
            (CTL_PASSES, passes),
            (CTL_GEN_LIMIT, u64::MAX),
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
pub struct RunningVm<'a> {
    vm: &'a mut Vm,
    work: Vec<VcpuWork>,
    threads: Vec<JoinHandle<(VcpuFd, Outcome)>>,
    done_rx: mpsc::Receiver<usize>,
    kicked: Arc<AtomicBool>,
    started: Instant,
}

impl RunningVm<'_> {
    pub fn memory(&self) -> &Arc<GuestMemory> {
        &self.vm.memory
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

    /// Kicks every vCPU out of KVM_RUN, joins the threads and gives the vCPUs back to the VM.
    fn join_all(&mut self) -> Vec<Outcome> {
        self.kicked.store(true, Ordering::Release);
        let mut outcomes = Vec::with_capacity(self.threads.len());
        for handle in self.threads.drain(..) {
            while !handle.is_finished() {
                // SAFETY: the thread is still running (not joined), so its pthread_t is valid;
                // the kick signal's handler is installed and does nothing.
                unsafe { libc::pthread_kill(handle.as_pthread_t(), vcpu::kick_signal()) };
                std::thread::sleep(Duration::from_millis(1));
            }
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
