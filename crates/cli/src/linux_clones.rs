//! `guestmem restore --clones N` of a Linux guest's snapshot: N clones restored lazily one after
//! another through a restore service (the snapshot held open and checked once, a VM built and
//! armed ahead in its pool), each running `--run-for` with its console on stdout (or its own
//! `--console` file), then taken back into the pool, wiped and armed again, for the next
//! clone: the restore service's cycle, on a Linux guest.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use guestmem_contract::component::Components;
use guestmem_contract::SerialComponent;
use guestmem_events::Sink;
use guestmem_paging::PagerConfig;
use guestmem_snapshot::service::{RestoreService, ServiceRestore};
use guestmem_snapshot::SnapshotImage;
use guestmem_vm::linux::LinuxVm;

use crate::linux::{console_or_stdout, first_line_secs};

/// What `--console` becomes for clone `n`: its `{n}` replaced by the number; refused without
/// one (every clone would overwrite the file of the one before).
pub fn console_of(console: Option<&Path>, n: usize) -> crate::Result<Option<PathBuf>> {
    let Some(path) = console else {
        return Ok(None);
    };
    let text = path.to_string_lossy();
    if !text.contains("{n}") {
        return Err(format!(
            "--console {text} with --clones: the file name needs {{n}}, replaced by each \
             clone's number (one file per clone)"
        )
        .into());
    }
    Ok(Some(PathBuf::from(text.replace("{n}", &n.to_string()))))
}

/// How `restore --clones` runs its clones.
pub struct Clones<'a> {
    /// How many.
    pub count: usize,
    /// How long each runs.
    pub run_for: Duration,
    /// `--console` (its `{n}` replaced by each clone's number), or stdout.
    pub console: Option<&'a Path>,
    /// The lazy restores' pager configuration.
    pub pagers: PagerConfig,
    /// Where each restore's progress records go (`--progress`).
    pub events: Option<Sink>,
}

/// Restores `how.count` clones of the Linux guest's snapshot `snap` through a restore service,
/// one after another, each run for `how.run_for` and recycled into the pool for the next (see
/// the module docs). Before each clone's console, stdout gets the line `guestmem: clone N of M
/// (into ...)` saying which VM it was restored into.
pub fn restore<I: SnapshotImage>(snap: I, how: Clones<'_>) -> crate::Result<()> {
    console_of(how.console, 1)?;
    let clones = how.count;
    let t = Instant::now();
    let mut service = RestoreService::<I, LinuxVm>::for_machine(snap, how.pagers.clone())?;
    if let Some(sink) = &how.events {
        service = service.with_events(sink.clone());
    }
    let opened_ms = t.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    service.fill(1)?;
    eprintln!(
        "guestmem: restore service of {}: opened in {opened_ms:.1} ms; a Linux VM built and \
         armed ahead in {:.1} ms",
        service.image().describe(),
        t.elapsed().as_secs_f64() * 1e3
    );
    let mut recycled_from = None;
    for n in 1..=clones {
        let restored = service.restore()?;
        let into = match (restored.phases.first(), recycled_from) {
            (Some(("prepare (pool empty)", _)), _) => "a VM built now (the pool was empty)".into(),
            (_, Some(k)) => format!("the VM of clone {k}, recycled"),
            (_, None) => "a VM built ahead".to_string(),
        };
        crate::linux::end_console_line();
        println!("guestmem: clone {n} of {clones} (into {into})");
        let clone = run_clone(&service, restored, (n, clones), &how)?;
        recycled_from = None;
        if n == clones {
            break;
        }
        let t = Instant::now();
        match service.recycle(clone) {
            Ok(()) => {
                recycled_from = Some(n);
                eprintln!(
                    "guestmem: clone {n}'s VM recycled into the pool in {:.1} ms",
                    t.elapsed().as_secs_f64() * 1e3
                );
            }
            Err(e) => eprintln!("guestmem: clone {n}'s VM was not recycled: {e}"),
        }
    }
    Ok(())
}

/// Runs the clone `restored` (number `n` of `clones`) for `run_for` with its console on stdout
/// or its `--console` file, waits until its memory is resident and says what it took; returns
/// it paused, its console going nowhere again.
fn run_clone<I: SnapshotImage>(
    service: &RestoreService<I, LinuxVm>,
    restored: ServiceRestore<LinuxVm>,
    (n, clones): (usize, usize),
    how: &Clones<'_>,
) -> crate::Result<guestmem_snapshot::Restored<LinuxVm>> {
    let ServiceRestore {
        progress,
        mut lazy,
        phases,
        ..
    } = restored;
    let mut first = None;
    let console = console_or_stdout(console_of(how.console, n)?.as_deref(), &mut first);
    let serial = lazy.vm.serial().clone();
    let set_out = |out| {
        serial
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .set_out(out);
    };
    set_out(console);
    let ran = run_resident(service, &mut lazy, how.run_for);
    set_out(Box::new(std::io::sink()));
    match (progress, &ran) {
        (Some(mut p), Ok(_)) => p.finish(),
        (Some(mut p), Err(e)) => p.failed(&**e),
        (None, _) => {}
    }
    let end = ran?;
    let steps: Vec<String> = phases
        .iter()
        .map(|(name, d)| format!("{name} {:.1} ms", d.as_secs_f64() * 1e3))
        .collect();
    eprintln!(
        "guestmem: clone {n} of {clones}: ready in {:.1} ms ({}); first console line after {}; \
         ran until {end:?}",
        lazy.ready.as_secs_f64() * 1e3,
        steps.join(", "),
        first
            .as_ref()
            .and_then(first_line_secs)
            .map_or("none".into(), |s| format!("{s:.2} s")),
    );
    Ok(lazy)
}

/// Restores the clone's "serial" component, runs it for `run_for` and waits until its memory
/// is resident; how its run ended.
fn run_resident<I: SnapshotImage>(
    service: &RestoreService<I, LinuxVm>,
    lazy: &mut guestmem_snapshot::Restored<LinuxVm>,
    run_for: Duration,
) -> crate::Result<guestmem_vm::linux::LinuxEnd> {
    let mut component = SerialComponent(lazy.vm.serial().clone());
    Components::new(vec![&mut component])?.restore(service.image().components())?;
    let end = lazy.vm.start()?.wait(run_for)?;
    crate::linux_snapshot::wait_resident(&lazy.pagers, &lazy.userfault_pagers)?;
    Ok(end)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_clone_gets_its_console_file_and_a_file_without_n_is_refused() {
        assert_eq!(console_of(None, 3).unwrap(), None);
        assert_eq!(
            console_of(Some(Path::new("/tmp/c-{n}.log")), 3).unwrap(),
            Some(PathBuf::from("/tmp/c-3.log"))
        );
        let e = console_of(Some(Path::new("/tmp/c.log")), 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("needs {n}"), "{e}");
    }
}
