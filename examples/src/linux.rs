//! The whole recipe of a VMM that runs a real Linux guest on guestmem, through the component
//! traits: boot it ([`LinuxVm`], its bzImage, initramfs and command line checked first by
//! [`BootPlan::check`]), run it with its serial console streamed, snapshot it paused
//! ([`LinuxMachine`] as the [`Machine`](guestmem_contract::component::Machine), its 16550 as
//! the [`SerialComponent`], through [`driver::snapshot`]), and restore it lazily into a new VM
//! that a [`LinuxBuilder`] builds (the guest runs at once, its memory paged in on first
//! access), where it goes on.
//!
//! A stock kernel needs ordinary KVM (kvm_intel, kvm_amd): on a PVM host ([`pvm_refusal`])
//! the run is refused before anything is built, naming the kernel lab
//! (scripts/kernel-lab.sh --suite linux), where the ignored test of `tests/linux_vmm.rs`
//! runs it. The guest is the busybox initramfs of scripts/linux-guest-initramfs.sh, whose
//! init prints `counter N UPTIME` every 100 ms: the run reports the counter at the pause and
//! after the restore.

use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use guestmem_contract::component::Components;
use guestmem_contract::{LinuxBuilder, LinuxMachine, SerialComponent};
use guestmem_memory::Backend;
use guestmem_migration::driver;
use guestmem_paging::PagerConfig;
use guestmem_snapshot::{RestoreMode, Snapshot};
use guestmem_vm::linux::{linux_config, pvm_refusal, BootPlan, ConsoleOut, LinuxVm};

use crate::vmm::Error;

/// The guest's memory.
pub const MEMORY: u64 = 256 << 20;
/// The guest's vCPUs.
pub const VCPUS: usize = 1;
/// How long the guest may take to print its first counter line in [`run`] (a boot under the
/// lab's TCG takes minutes).
pub const BOOT_LIMIT: Duration = Duration::from_secs(600);
/// How long a guest that counts may take to print [`LINES`] more lines, before its pause or
/// after its restore.
pub const COUNT_LIMIT: Duration = Duration::from_secs(120);

/// The guest printed no counter line within the boot's limit (no snapshot was taken): a
/// caller may boot again, as the lab's tests do (a Linux boot under nested TCG now and then
/// stalls before its init counts).
#[derive(Debug, thiserror::Error)]
#[error("the booting guest printed no counter line within {0:?}; no snapshot was taken")]
pub struct BootStalled(pub Duration);
/// How many counter lines the guest prints before its snapshot, and the restored guest
/// after its first.
pub const LINES: u64 = 10;

/// The guest to boot.
#[derive(Debug, Clone, Copy)]
pub struct Guest<'a> {
    /// A bzImage or an ELF vmlinux.
    pub kernel: &'a Path,
    /// The initramfs (a cpio archive, compressed as the kernel accepts).
    pub initrd: Option<&'a Path>,
    /// The kernel command line.
    pub cmdline: &'a str,
}

/// What a run saw.
#[derive(Debug, Clone, Copy)]
pub struct LinuxOutcome {
    /// Seconds from the vCPU's start to the first counter line.
    pub boot_secs: f64,
    /// The last counter the guest printed before its pause.
    pub at_pause: u64,
    /// The restored guest's first counter, and its last before it was stopped.
    pub restored: (u64, u64),
    /// Milliseconds from the start of the restore to the vCPU being ready.
    pub restore_ms: f64,
}

/// The counters a console showed.
#[derive(Debug, Default)]
struct Seen {
    first: Option<u64>,
    last: Option<u64>,
}

/// A guest's console: each line to stdout after `who`, its `counter N` lines counted.
struct Console {
    who: &'static str,
    line: Vec<u8>,
    seen: Arc<Mutex<Seen>>,
}

impl Write for Console {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        for &b in buf {
            if b != b'\n' {
                self.line.push(b);
                continue;
            }
            let line = String::from_utf8_lossy(&self.line).trim_end().to_string();
            self.line.clear();
            println!("{} | {line}", self.who);
            let n = line
                .strip_prefix("counter ")
                .and_then(|r| r.split_whitespace().next())
                .and_then(|n| n.parse::<u64>().ok());
            if let Some(n) = n {
                let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
                seen.first.get_or_insert(n);
                seen.last = Some(n);
            }
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stdout().flush()
    }
}

fn console(who: &'static str, seen: &Arc<Mutex<Seen>>) -> ConsoleOut {
    Box::new(Console {
        who,
        line: Vec::new(),
        seen: seen.clone(),
    })
}

/// Waits (at most `limit`) until `seen` has a first counter and a last at least `first + n`;
/// returns (first, last), or `None` when they did not come in time.
fn wait_counters(seen: &Arc<Mutex<Seen>>, n: u64, limit: Duration) -> Option<(u64, u64)> {
    let deadline = Instant::now() + limit;
    loop {
        {
            let s = seen.lock().unwrap_or_else(PoisonError::into_inner);
            if let (Some(first), Some(last)) = (s.first, s.last) {
                if last >= first + n {
                    return Some((first, last));
                }
            }
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Checks the guest and the host, before anything is built: the kernel, the initramfs and
/// the command line against the guest's memory, then a host whose KVM runs only PVM-aware
/// kernels.
pub fn check(guest: &Guest<'_>) -> Result<BootPlan, Error> {
    let plan = BootPlan::check(guest.kernel, guest.initrd, guest.cmdline, MEMORY)?;
    if let Some(why) = pvm_refusal() {
        return Err(why.into());
    }
    Ok(plan)
}

/// Boots `guest`, lets it count [`LINES`] lines, snapshots it into `scratch`, restores it
/// lazily into a new VM and lets it count on; what it saw.
pub fn run(guest: &Guest<'_>, scratch: &Path) -> Result<LinuxOutcome, Error> {
    run_with(guest, scratch, BOOT_LIMIT)
}

/// [`run`], the guest given `boot_limit` to print its first counter line ([`BootStalled`] if
/// it does not).
pub fn run_with(
    guest: &Guest<'_>,
    scratch: &Path,
    boot_limit: Duration,
) -> Result<LinuxOutcome, Error> {
    let plan = check(guest)?;
    let config = linux_config(VCPUS, MEMORY, Backend::Anon);
    let dir = scratch.join("linux-snapshot");

    // Boot: the VM (irqchip, PIT, RAM, UART, vCPUs), the kernel loaded, the vCPU started.
    let seen = Arc::new(Mutex::new(Seen::default()));
    let mut vm = LinuxVm::new(&config, console("source  ", &seen))?;
    vm.boot(&plan)?;
    let mut serial = SerialComponent(vm.serial().clone());
    let t = Instant::now();
    let mut machine = LinuxMachine::running(vm.start()?);
    let booted = wait_counters(&seen, 0, boot_limit);
    let boot_secs = t.elapsed().as_secs_f64();
    let counted = booted.and_then(|_| wait_counters(&seen, LINES, COUNT_LIMIT));
    if counted.is_none() {
        guestmem_contract::component::Machine::pause(&mut machine)?;
        return Err(match booted {
            None => BootStalled(boot_limit).into(),
            Some(_) => {
                format!("the booted guest did not count {LINES} lines in {COUNT_LIMIT:?}").into()
            }
        });
    }

    // Snapshot: the vCPU paused, then the UART; the memory, the machine's state (LAPIC, PIC,
    // IOAPIC, PIT, kvmclock, ...) and the UART's state written.
    driver::snapshot(&mut machine, &mut Components::new(vec![&mut serial])?, &dir)?;
    let at_pause = seen
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .last
        .ok_or("no counter before the pause")?;
    drop(machine);
    drop(vm);

    // Restore lazily: the builder makes the new VM (and its UART) for the snapshot's
    // configuration; the UART's state goes in once it exists, before anything runs.
    let snap = Snapshot::open(&dir)?;
    let after = Arc::new(Mutex::new(Seen::default()));
    let mut builder = LinuxBuilder(|| console("restored", &after));
    let restored = guestmem_snapshot::restore(
        &snap,
        &mut builder,
        RestoreMode::Lazy(PagerConfig::default()),
    )?;
    let restore_ms = restored.ready.as_secs_f64() * 1e3;
    let guestmem_snapshot::Restored {
        pagers,
        userfault_pagers,
        mut vm,
        ..
    } = restored;
    let mut serial = SerialComponent(vm.serial().clone());
    let mut components = Components::new(vec![&mut serial])?;
    components.restore(snap.components())?;
    let running = driver::resume(&mut vm, &mut components)?;
    let counted = wait_counters(&after, LINES, COUNT_LIMIT);
    running.pause()?;
    drop(userfault_pagers);
    drop(pagers);
    let restored = counted.ok_or_else(|| {
        format!("the restored guest did not count {LINES} lines in {COUNT_LIMIT:?} (at the pause it was at {at_pause})")
    })?;
    Ok(LinuxOutcome {
        boot_secs,
        at_pause,
        restored,
        restore_ms,
    })
}
