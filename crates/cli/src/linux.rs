//! `--kernel/--initrd/--cmdline/--console`: the options that make a command's guest a Linux
//! guest instead of guestmem's payload, and `guestmem run --kernel`, which boots it and streams
//! its serial console.

use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use guestmem_vm::linux::{
    linux_config, pvm_refusal, BootPlan, ConsoleOut, LinuxEnd, LinuxVm, DEFAULT_CMDLINE,
};

use crate::vm_args::VmArgs;

#[derive(clap::Args, Debug, Default)]
pub struct LinuxArgs {
    /// Boot this Linux kernel (a bzImage, or an ELF vmlinux) instead of guestmem's payload; its
    /// serial console (a 16550 on port 0x3f8) is streamed to stdout. Needs ordinary KVM (not PVM).
    #[arg(long, value_name = "BZIMAGE")]
    pub kernel: Option<PathBuf>,
    /// The initramfs (a cpio archive, compressed as the kernel accepts) for --kernel.
    #[arg(long, value_name = "CPIO", requires = "kernel")]
    pub initrd: Option<PathBuf>,
    /// The kernel command line for --kernel.
    #[arg(long, value_name = "TEXT", requires = "kernel", default_value = DEFAULT_CMDLINE)]
    pub cmdline: String,
    /// Write the Linux guest's console to FILE instead of stdout.
    #[arg(long, value_name = "FILE", requires = "kernel")]
    pub console: Option<PathBuf>,
    /// `snapshot` and `migrate send` with --kernel: `--after` counts from the first console
    /// line holding TEXT (default: from the first console line), e.g. a line the guest's init
    /// prints once it runs.
    #[arg(long, value_name = "TEXT", requires = "kernel")]
    pub wait_for: Option<String>,
}

/// Whether the guest's console, on stdout, ended in the middle of a line (the guest stopped
/// while it printed one): a report printed after it starts on a line of its own
/// ([`end_console_line`]).
static STDOUT_MID_LINE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Ends the console's last line on stdout if the guest stopped in the middle of it, so that
/// what guestmem prints next (a `--json` report, the last line) is a line of its own.
pub fn end_console_line() {
    if STDOUT_MID_LINE.swap(false, std::sync::atomic::Ordering::Relaxed) {
        println!();
    }
}

/// Console bytes on their way to stdout or a file; remembers when the first line ended.
struct Console {
    out: Box<dyn Write + Send>,
    /// Whether `out` is stdout (see [`STDOUT_MID_LINE`]).
    to_stdout: bool,
    started: Instant,
    first_line: Arc<Mutex<Option<Duration>>>,
    /// Only a line holding this counts as the first line (none: any line).
    pattern: Option<Vec<u8>>,
    /// The line being written, while a pattern is waited for.
    line: Vec<u8>,
}

impl Console {
    fn saw_line(&self) {
        let mut first = self
            .first_line
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        first.get_or_insert_with(|| self.started.elapsed());
    }

    fn matched(&mut self, buf: &[u8]) -> bool {
        let Some(pattern) = &self.pattern else {
            return buf.contains(&b'\n');
        };
        let mut found = false;
        for &b in buf {
            if b == b'\n' {
                found |= self
                    .line
                    .windows(pattern.len())
                    .any(|w| w == pattern.as_slice());
                self.line.clear();
            } else if self.line.len() < 4096 {
                self.line.push(b);
            }
        }
        if found {
            self.pattern = None;
        }
        found
    }
}

impl Write for Console {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.matched(buf) {
            self.saw_line();
        }
        self.out.write_all(buf)?;
        if buf.contains(&b'\n') {
            self.out.flush()?;
        }
        if let (true, Some(&last)) = (self.to_stdout, buf.last()) {
            STDOUT_MID_LINE.store(last != b'\n', std::sync::atomic::Ordering::Relaxed);
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

impl LinuxArgs {
    /// The boot these options describe, checked against `vm`'s memory, or `None` without
    /// --kernel. Every refusal of bad input happens here, before a VM, a console file or a
    /// snapshot directory exists: the files and the command line first (so that they are
    /// named wherever the command runs), then a host whose KVM cannot run a stock kernel
    /// (PVM), naming the kernel lab.
    pub fn plan(&self, vm: &VmArgs) -> crate::Result<Option<BootPlan>> {
        let Some(kernel) = &self.kernel else {
            return Ok(None);
        };
        if vm.image.is_some() {
            return Err("--image fills the payload's memory; it cannot go with --kernel".into());
        }
        let plan = BootPlan::check(kernel, self.initrd.as_deref(), &self.cmdline, vm.memory)?;
        if let Some(why) = pvm_refusal() {
            return Err(format!("--kernel: {why}").into());
        }
        Ok(Some(plan))
    }

    /// The console writer, and where it will record when the first line ended.
    pub fn console(&self) -> crate::Result<(ConsoleOut, FirstLine)> {
        console_to(self.console.as_deref(), self.wait_for.as_deref())
    }
}

/// When the console's first line ended, counted from when the console was made.
pub type FirstLine = Arc<Mutex<Option<Duration>>>;

/// A console writer to `path` (created) or stdout, and where it records when its first line
/// (holding `pattern`, if given) ended.
pub fn console_to(
    path: Option<&std::path::Path>,
    pattern: Option<&str>,
) -> crate::Result<(ConsoleOut, FirstLine)> {
    let out: Box<dyn Write + Send> = match path {
        Some(path) => Box::new(
            std::fs::File::create(path)
                .map_err(|e| format!("cannot create the console file {}: {e}", path.display()))?,
        ),
        None => Box::new(std::io::stdout()),
    };
    let first_line = Arc::new(Mutex::new(None));
    let console = Console {
        out,
        to_stdout: path.is_none(),
        started: Instant::now(),
        first_line: first_line.clone(),
        pattern: pattern.map(|p| p.as_bytes().to_vec()),
        line: Vec::new(),
    };
    Ok((Box::new(console), first_line))
}

/// How long a Linux guest may take to print its first console line (or the `--wait-for` one)
/// before `snapshot` or `migrate send` gives up.
pub const FIRST_LINE_LIMIT: Duration = Duration::from_secs(600);

/// Waits until the running guest printed its first console line (holding the `--wait-for`
/// text, if given); an error if it ended first (a reset: a panic, say) or printed none within
/// [`FIRST_LINE_LIMIT`]. `not_done` says what was then not done.
pub fn wait_first_line(
    running: &guestmem_vm::linux::RunningLinux<'_>,
    first: &FirstLine,
    not_done: &str,
) -> crate::Result<()> {
    let limit = Instant::now() + FIRST_LINE_LIMIT;
    while first_line_secs(first).is_none() {
        if running.ended() {
            return Err(format!(
                "the Linux guest ended (a reset, a shutdown or a failed vCPU) before the console \
                 line awaited; {not_done}"
            )
            .into());
        }
        if Instant::now() >= limit {
            return Err(format!(
                "the Linux guest printed no awaited console line in {} s; {not_done}",
                FIRST_LINE_LIMIT.as_secs()
            )
            .into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// The console of a VM being built for a restore or a migration: `path` (or stdout), its first
/// line recorded in `first`; stdout, said so, if `path` cannot be created.
pub fn console_or_stdout(
    path: Option<&std::path::Path>,
    first: &mut Option<FirstLine>,
) -> ConsoleOut {
    match console_to(path, None) {
        Ok((out, line)) => {
            *first = Some(line);
            out
        }
        Err(e) => {
            eprintln!("guestmem: {e}; the console goes to stdout");
            Box::new(std::io::stdout())
        }
    }
}

/// When the first console line ended, in seconds, if it did.
pub fn first_line_secs(first: &FirstLine) -> Option<f64> {
    first
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .map(|d| d.as_secs_f64())
}

/// `guestmem run --kernel ...`: checks the boot, builds the Linux VM, boots it and runs it
/// until it resets or shuts down, or for `run_for`; says how it ended on stderr.
pub fn run(
    vm: &VmArgs,
    linux: &LinuxArgs,
    plan: BootPlan,
    run_for: Option<Duration>,
) -> crate::Result<()> {
    let config = linux_config(vm.vcpus, vm.memory, vm.backend);
    let (console, first_line) = linux.console()?;
    let t0 = Instant::now();
    let mut machine = LinuxVm::new(&config, console)?;
    machine.boot(&plan)?;
    eprintln!(
        "guestmem: booting {} ({:?}) with {} MiB on {}, {} vCPUs, set up in {:.1} ms",
        linux
            .kernel
            .as_deref()
            .unwrap_or_else(|| std::path::Path::new("?"))
            .display(),
        plan.kind(),
        vm.memory >> 20,
        vm.backend,
        vm.vcpus,
        t0.elapsed().as_secs_f64() * 1e3
    );
    // Without --run-for the guest runs until it resets or shuts down (a VMM's ordinary run).
    let limit = run_for.unwrap_or(Duration::from_secs(u64::from(u32::MAX)));
    let end = machine.run_for(limit)?;
    if let Some(first) = first_line_secs(&first_line) {
        eprintln!("guestmem: first console line after {first:.2} s");
    }
    let how = match end {
        LinuxEnd::TimeLimit => "ran for --run-for and was stopped",
        LinuxEnd::Reset => "reset itself",
        LinuxEnd::Shutdown => "shut down",
    };
    eprintln!(
        "guestmem: the guest {how} after {:.2} s",
        t0.elapsed().as_secs_f64()
    );
    for line in machine.vcpu_report() {
        eprintln!("guestmem: {line}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    /// A console on stdout that ends in the middle of a line is ended before a report; one that
    /// ended its line, or writes to a file, is not (its report would start with a blank line).
    #[test]
    fn a_report_after_a_cut_console_line_starts_on_its_own_line() {
        let (mut out, _) = console_to(None, None).unwrap();
        out.write_all(b"counter 380 61").unwrap();
        assert!(STDOUT_MID_LINE.load(Ordering::Relaxed));
        out.write_all(b".2\n").unwrap();
        assert!(!STDOUT_MID_LINE.load(Ordering::Relaxed));
        out.write_all(b"counter 381").unwrap();
        end_console_line();
        assert!(!STDOUT_MID_LINE.load(Ordering::Relaxed), "ended once");
        let file = std::env::temp_dir().join(format!("guestmem-console-{}", std::process::id()));
        let (mut to_file, _) = console_to(Some(&file), None).unwrap();
        to_file.write_all(b"counter 1").unwrap();
        assert!(
            !STDOUT_MID_LINE.load(Ordering::Relaxed),
            "a file's console says nothing"
        );
        std::fs::remove_file(&file).unwrap();
    }
}
