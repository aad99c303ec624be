//! The Linux guest's vCPU threads: `KVM_RUN` with port I/O dispatched to [`pio`](super::pio),
//! until the host pauses them (a kick, as for the payload VM) or the guest resets.

use std::os::unix::thread::JoinHandleExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use guestmem_memory::GuestMemory;
use guestmem_sys::uapi::KVM_MEMORY_EXIT_FLAG_USERFAULT_CANDIDATE;
use kvm_ioctls::{VcpuExit, VcpuFd};

use super::pio::{pio_in, pio_out, PioAction};
use super::{LinuxVm, SerialDevice};
use crate::{vcpu, Error, Result};

/// How often [`RunningLinux::wait`] looks whether the run was aborted.
const ABORT_POLL: Duration = Duration::from_millis(20);

/// How a Linux guest's run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinuxEnd {
    /// The time limit came; the guest was paused, still running.
    TimeLimit,
    /// The guest asked for a reset (keyboard controller, `reboot=k`, or a panic with `panic=N`).
    Reset,
    /// The guest shut down (a triple fault, or `KVM_EXIT_SYSTEM_EVENT`).
    Shutdown,
}

enum Outcome {
    Kicked,
    Ended(LinuxEnd),
    Failed(Error),
}

/// A Linux VM whose vCPUs are running.
pub struct RunningLinux<'a> {
    vm: &'a mut LinuxVm,
    threads: Vec<JoinHandle<(VcpuFd, Outcome)>>,
    kicked: Arc<AtomicBool>,
    ended: mpsc::Receiver<usize>,
    started: Instant,
}

impl std::fmt::Debug for RunningLinux<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunningLinux")
            .field("vcpus", &self.threads.len())
            .finish_non_exhaustive()
    }
}

pub(super) fn spawn(vm: &mut LinuxVm) -> Result<RunningLinux<'_>> {
    let kicked = Arc::new(AtomicBool::new(false));
    let (tx, ended) = mpsc::channel();
    let mut threads = Vec::new();
    for (id, mut fd) in vm.vcpus.drain(..).enumerate() {
        let kicked = kicked.clone();
        let serial = vm.serial.clone();
        let memory = vm.memory.clone();
        let tx = tx.clone();
        let handle = std::thread::Builder::new()
            .name(format!("linux-vcpu{id}"))
            .spawn(move || {
                let outcome = run_loop(id, &mut fd, &kicked, &serial, &memory);
                let _ = tx.send(id);
                (fd, outcome)
            })
            .map_err(|e| Error::Thread {
                vcpu: id,
                reason: format!("cannot start: {e}"),
            })?;
        threads.push(handle);
    }
    Ok(RunningLinux {
        vm,
        threads,
        kicked,
        ended,
        started: Instant::now(),
    })
}

/// Runs vCPU `id` until a kick, the guest's reset or shutdown, or an exit it cannot serve. A
/// KVM Userfault exit (a lazily restored or post-copied guest_memfd page not yet fetched) is
/// handed to `memory`'s [`UserfaultRouter`](guestmem_memory::UserfaultRouter), whose pager
/// installs the page and clears its bit; the vCPU then runs again.
fn run_loop(
    id: usize,
    fd: &mut VcpuFd,
    kicked: &AtomicBool,
    serial: &Mutex<SerialDevice>,
    memory: &GuestMemory,
) -> Outcome {
    let mut stopping = false;
    loop {
        if !stopping && kicked.load(Ordering::Acquire) {
            // The instruction of the last exit (an `in` or `out` on the UART, an MMIO access)
            // ends only at the next KVM_RUN, which writes its result and moves RIP past it.
            // Paused before that, a saved state would run it again on its own device state:
            // an `in` from the IIR the source's UART already cleared reads "no interrupt", and
            // the guest's console waits forever. KVM_RUN with immediate_exit ends it without
            // entering the guest, then says EINTR.
            stopping = true;
            fd.set_kvm_immediate_exit(1);
        }
        let exit = match fd.run() {
            Ok(VcpuExit::IoIn(port, data)) => {
                pio_in(serial, port, data);
                continue;
            }
            Ok(VcpuExit::IoOut(port, data)) => match pio_out(serial, port, data) {
                PioAction::None => continue,
                PioAction::Reset => return Outcome::Ended(LinuxEnd::Reset),
            },
            Ok(VcpuExit::MmioRead(_, data)) => {
                data.fill(0xff);
                continue;
            }
            Ok(VcpuExit::MmioWrite(..)) => continue,
            Ok(VcpuExit::Shutdown | VcpuExit::SystemEvent(..)) => {
                return Outcome::Ended(LinuxEnd::Shutdown)
            }
            Ok(VcpuExit::MemoryFault { flags, gpa, size })
                if flags & KVM_MEMORY_EXIT_FLAG_USERFAULT_CANDIDATE != 0 =>
            {
                match memory.userfault_router().handle(gpa, size) {
                    Ok(()) => continue,
                    Err(reason) => format!("KVM Userfault at {gpa:#x}: {reason}"),
                }
            }
            Ok(exit) => format!("{exit:?}"),
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                fd.set_kvm_immediate_exit(0);
                if stopping {
                    return Outcome::Kicked;
                }
                continue;
            }
            Err(e) => format!("KVM_RUN error: {e}"),
        };
        return Outcome::Failed(Error::UnexpectedExit {
            vcpu: id,
            exit,
            rip: fd.get_regs().map_or(u64::MAX, |r| r.rip),
        });
    }
}

impl<'a> RunningLinux<'a> {
    /// The VM these vCPUs belong to.
    pub fn vm(&self) -> &LinuxVm {
        self.vm
    }

    /// Whether a vCPU has stopped by itself (the guest reset or shut down, or a vCPU failed):
    /// [`RunningLinux::wait`] then says how.
    pub fn ended(&self) -> bool {
        self.threads.iter().any(JoinHandle::is_finished)
    }

    /// How long the vCPUs have been running.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// Waits until the guest ends (reset, shutdown, a vCPU failing), `limit` passes or the run
    /// is aborted ([`LinuxVm::abort_handle`]), then stops every vCPU; says which (an error if a
    /// vCPU failed, [`Error::Aborted`] with its reason if the run was aborted).
    pub fn wait(self, limit: Duration) -> Result<LinuxEnd> {
        let deadline = Instant::now() + limit;
        let abort = self.vm.abort.clone();
        let ended = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.ended.recv_timeout(left.min(ABORT_POLL)) {
                Ok(_) | Err(mpsc::RecvTimeoutError::Disconnected) => break true,
                Err(mpsc::RecvTimeoutError::Timeout) => {}
            }
            if abort.reason().is_some() || Instant::now() >= deadline {
                break false;
            }
        };
        let stopped = self.stop();
        if let Some(reason) = abort.take() {
            return Err(Error::Aborted(reason));
        }
        let (_, end) = stopped?;
        Ok(if ended { end } else { LinuxEnd::TimeLimit })
    }

    /// Stops every vCPU where it is (its state intact, to be saved or resumed) and hands the VM
    /// back. Fails if a vCPU had failed, or with [`Error::Aborted`] if the run was aborted.
    pub fn pause(self) -> Result<&'a mut LinuxVm> {
        let abort = self.vm.abort.clone();
        let stopped = self.stop();
        if let Some(reason) = abort.take() {
            return Err(Error::Aborted(reason));
        }
        Ok(stopped?.0)
    }

    fn stop(mut self) -> Result<(&'a mut LinuxVm, LinuxEnd)> {
        self.kicked.store(true, Ordering::Release);
        let mut end = LinuxEnd::TimeLimit;
        let mut failure = None;
        for handle in std::mem::take(&mut self.threads) {
            while !handle.is_finished() {
                // SAFETY: the thread is not joined yet, so its pthread_t is valid; the kick
                // signal's handler is installed (LinuxVm::new) and does nothing.
                unsafe { libc::pthread_kill(handle.as_pthread_t(), vcpu::kick_signal()) };
                std::thread::sleep(Duration::from_millis(1));
            }
            match handle.join() {
                Ok((fd, outcome)) => {
                    self.vm.vcpus.push(fd);
                    match outcome {
                        Outcome::Kicked => {}
                        Outcome::Ended(e) => end = e,
                        Outcome::Failed(e) => failure = failure.or(Some(e)),
                    }
                }
                Err(_) => {
                    failure = failure.or(Some(Error::Thread {
                        vcpu: self.vm.vcpus.len(),
                        reason: "the vCPU thread panicked".into(),
                    }));
                }
            }
        }
        self.vm
            .serial
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .flush();
        let vm: *mut LinuxVm = self.vm;
        drop(self);
        // SAFETY: `self` held the only borrow of the VM for 'a and is gone (its drop had no
        // threads left to stop), so handing that borrow on is sound.
        let vm = unsafe { &mut *vm };
        match failure {
            Some(e) => Err(e),
            None => Ok((vm, end)),
        }
    }
}

impl Drop for RunningLinux<'_> {
    fn drop(&mut self) {
        if self.threads.is_empty() {
            return;
        }
        self.kicked.store(true, Ordering::Release);
        for handle in self.threads.drain(..) {
            while !handle.is_finished() {
                // SAFETY: as in `stop`: not joined yet, handler installed.
                unsafe { libc::pthread_kill(handle.as_pthread_t(), vcpu::kick_signal()) };
                std::thread::sleep(Duration::from_millis(1));
            }
            if let Ok((fd, _)) = handle.join() {
                self.vm.vcpus.push(fd);
            }
        }
    }
}
