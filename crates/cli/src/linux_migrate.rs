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
use guestmem_vm::linux::{linux_config, BootPlan, LinuxEnd, LinuxVm};

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

/// What `migrate receive --linux` reports (one JSON line with `--json`, after the guest's
/// run). Format: crate::report::MIGRATE_RECEIVE_LINUX (a change bumps it).
#[derive(Debug, serde::Serialize)]
pub struct LinuxReceived {
    /// What the destination's engine saw (the payload VM's receive reports the same).
    pub report: migrate::DestinationReport,
    /// Seconds from the destination's VM being built to the guest's first console line here
    /// (`None`: the guest printed nothing).
    pub first_console_line_s: Option<f64>,
    /// How long the guest ran here, from its resume to the end of the run.
    pub run_ms: f64,
    /// How the run ended: "time-limit" (`--run-for` came, the guest still running), "reset"
    /// or "shutdown" (the guest's own doing).
    pub ended: &'static str,
    /// Where each vCPU stopped (RIP, halted or runnable, IF, LAPIC IRR/ISR, TSC deadline).
    pub vcpus: Vec<String>,
}

/// The name a [`LinuxEnd`] has in the report.
fn end_name(end: LinuxEnd) -> &'static str {
    match end {
        LinuxEnd::TimeLimit => "time-limit",
        LinuxEnd::Reset => "reset",
        LinuxEnd::Shutdown => "shutdown",
    }
}

/// Receives a Linux guest on `listener`, runs it `run_for` with its console on stdout (or
/// `console`), and reports what came and how the guest went on.
pub fn receive(
    listener: Arc<Listener>,
    opts: &ReceiveOptions,
    console: Option<&std::path::Path>,
    run_for: Duration,
) -> crate::Result<LinuxReceived> {
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
    Ok(LinuxReceived {
        report,
        first_console_line_s: first.as_ref().and_then(first_line_secs),
        run_ms: resumed.elapsed().as_secs_f64() * 1e3,
        ended: end_name(end),
        vcpus: vm.vcpu_report(),
    })
}

/// `r` as text on stderr (stdout is the guest's console).
pub fn print_received(r: &LinuxReceived) {
    if let Some(secs) = r.first_console_line_s {
        eprintln!("guestmem: first console line {secs:.2} s after the destination's VM was built");
    }
    eprintln!(
        "guestmem: the migrated guest ran {:.1} s until {}; {} pages received in {} rounds, digest verified: {}",
        r.run_ms / 1e3,
        r.ended,
        r.report.pages_received,
        r.report.rounds,
        r.report.digest.is_some()
    );
    for line in &r.vcpus {
        eprintln!("guestmem: {line}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The report is valid against its schema file and names each end as the file lists it.
    #[test]
    fn a_linux_receive_report_names_how_the_run_ended() {
        let r = LinuxReceived {
            report: Default::default(),
            first_console_line_s: Some(0.5),
            run_ms: 1.0,
            ended: end_name(LinuxEnd::Reset),
            vcpus: vec!["vcpu 0: halted".into()],
        };
        let text = crate::report::json(crate::report::MIGRATE_RECEIVE_LINUX, &r, false).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["schema"], "guestmem.migrate-receive-linux/1");
        assert_eq!(v["ended"], "reset");
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/schemas");
        let schema: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("migrate-receive-linux-v1.schema.json")).unwrap(),
        )
        .unwrap();
        let validator = jsonschema::validator_for(&schema).unwrap();
        let errors: Vec<String> = validator.iter_errors(&v).map(|e| e.to_string()).collect();
        assert!(errors.is_empty(), "{errors:?}");
        let mut broken = v.clone();
        broken.as_object_mut().unwrap().remove("ended");
        assert!(!validator.is_valid(&broken), "the schema requires `ended`");
        let ends = schema["properties"]["ended"]["enum"].as_array().unwrap();
        for end in [LinuxEnd::TimeLimit, LinuxEnd::Reset, LinuxEnd::Shutdown] {
            assert!(ends.contains(&end_name(end).into()), "{end:?}");
        }
    }
}
