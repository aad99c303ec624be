//! `guestmem migrate send --kernel ...` and `guestmem migrate receive --linux`: a Linux guest
//! migrated live between two guestmem processes by the same driver as the payload VM
//! ([`send_machine`], [`receive_into`]): its machine a [`LinuxMachine`], its console the
//! component "serial"; the console streams on the source until the switch-over and on the
//! destination after it.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use guestmem_contract::component::{ComponentError, Components};
use guestmem_contract::{Component, LinuxBuilder, LinuxMachine, SerialComponent, SERIAL_COMPONENT};
use guestmem_migration::migrate::{self, Links, ReceiveOptions, Report, SendOptions};
use guestmem_migration::transport::{Credentials, Endpoint, Listener};
use guestmem_vm::linux::{linux_config, BootPlan, LinuxVm};

use crate::linux::{console_or_stdout, first_line_secs, wait_first_line, LinuxArgs};
use crate::vm_args::VmArgs;

/// Boots the guest, lets it run `after` from its first console line, and migrates it to `to`.
#[allow(clippy::too_many_arguments)]
pub fn send(
    vm: &VmArgs,
    linux: &LinuxArgs,
    plan: BootPlan,
    after: Duration,
    to: &Endpoint,
    creds: Credentials,
    opts: &SendOptions,
    connections: usize,
) -> crate::Result<Report> {
    let (console, first_line) = linux.console()?;
    let mut config = linux_config(vm.vcpus, vm.memory, vm.backend);
    config.dirty_ring_bytes = None;
    let mut machine = LinuxVm::new(&config, console)?;
    machine.boot(&plan)?;
    let running = machine.start()?;
    if let Err(e) = wait_first_line(&running, &first_line, "nothing was migrated") {
        let _ = running.pause();
        return Err(e);
    }
    std::thread::sleep(after);
    let links = match Links::connect(to, &creds, opts.mode, connections) {
        Ok(l) => l,
        Err(e) => {
            running.pause()?;
            let e = guestmem_migration::error_chain(&e, ": ");
            return Err(format!(
                "the migration to {to} did not start ({e}); the VM was not migrated"
            )
            .into());
        }
    };
    let mut serial = SerialComponent(running.vm().serial().clone());
    let mut source = LinuxMachine::running(running);
    let mut components = Components::new(vec![&mut serial])?;
    let result = migrate::send_machine(&mut source, &mut components, links, opts);
    match result {
        Ok(report) => Ok(report),
        Err(failure) => {
            let error = guestmem_migration::error_chain(&failure.error, ": ");
            if failure.kept {
                eprintln!("guestmem: migration failed: {error}; the source kept the guest");
            }
            Err(format!("the migration failed: {error}").into())
        }
    }
}

/// The serial console's state as it arrives, before the destination's VM (and its UART)
/// exists: put into the UART once the VM is built, before it runs.
#[derive(Debug, Default)]
struct ArrivingSerial(Arc<Mutex<Option<Vec<u8>>>>);

impl Component for ArrivingSerial {
    fn name(&self) -> &str {
        SERIAL_COMPONENT
    }
    fn pause(&mut self) -> Result<(), ComponentError> {
        Ok(())
    }
    fn resume(&mut self) -> Result<(), ComponentError> {
        Ok(())
    }
    fn save(&mut self) -> Result<Vec<u8>, ComponentError> {
        Err("the arriving serial state is only restored".into())
    }
    fn restore(&mut self, state: &[u8]) -> Result<(), ComponentError> {
        // Checked now, so that a state this guestmem cannot read refuses the migration.
        serde_json::from_slice::<guestmem_vm::linux::SerialDeviceState>(state)?;
        *self.0.lock().map_err(|_| "poisoned")? = Some(state.to_vec());
        Ok(())
    }
}

/// Receives a Linux guest on `listener`, runs it `run_for` with its console on stdout (or
/// `console`), and says when its first console line came after the switch-over.
pub fn receive(
    listener: Arc<Listener>,
    opts: &ReceiveOptions,
    console: Option<&std::path::Path>,
    run_for: Duration,
) -> crate::Result<()> {
    let mut first = None;
    let mut builder = LinuxBuilder(|| console_or_stdout(console, &mut first));
    let mut arriving = ArrivingSerial::default();
    let stash = arriving.0.clone();
    let migrate::Incoming {
        mut vm,
        mut transfer,
    } = {
        let mut components = Components::new(vec![&mut arriving])?;
        migrate::receive_into(listener, opts, &mut builder, &mut components)?
    };
    if let Some(state) = stash.lock().map_err(|_| "poisoned")?.take() {
        SerialComponent(vm.serial().clone()).restore(&state)?;
    }
    let resumed = Instant::now();
    let running = transfer.resume(&mut vm)?;
    eprintln!(
        "guestmem: the Linux guest runs here now ({})",
        transfer.mode()
    );
    let end = running.wait(run_for);
    let report = transfer.finish()?;
    let end = end?;
    if let Some(secs) = first.as_ref().and_then(first_line_secs) {
        eprintln!("guestmem: first console line {secs:.2} s after the destination's VM was built");
    }
    eprintln!(
        "guestmem: the migrated guest ran {:.1} s until {end:?}; {} pages received in {} rounds, digest verified: {}",
        resumed.elapsed().as_secs_f64(),
        report.pages_received,
        report.rounds,
        report.digest.is_some()
    );
    for line in vm.vcpu_report() {
        eprintln!("guestmem: {line}");
    }
    Ok(())
}
