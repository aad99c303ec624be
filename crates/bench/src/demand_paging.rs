//! `guestmem bench demand-paging`: the kernel's demand_paging_test on guestmem's pager (seed
//! 001). Each vCPU touches only its own `-b` bytes, once. In the same run, for every vCPU
//! count: the pre-populated baseline (memory filled before the guest starts), the kernel's
//! first-touch rate (fresh memory, no pager), and demand paging from a local file source (or,
//! with `-d`, a remote peer answering each fetch after that delay). With `--vcpu-cpus` and
//! `--pager-cpus` the vCPU threads of every run and the pager's (and the peer's) threads are
//! pinned to separate host CPUs, as a VMM places them.

use guestmem_sys::to_usize;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use guestmem_memory::{Backend, PAGE_SIZE};
use guestmem_paging::affinity::CpuSet;
use guestmem_paging::{
    FileSource, PageSource, Pager, PagerConfig, PagerStats, RemoteSource, UserfaultPager,
};
use guestmem_vm::{layout, VcpuWork, Vm, VmConfig, Workload};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::envelope::Figure;
use crate::units::parse_size;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
enum Mode {
    /// userfaultfd MISSING faults on anonymous memory, resolved with UFFDIO_COPY.
    #[value(name = "MISSING", alias = "missing")]
    Missing,
    /// userfaultfd MINOR faults on memfd memory: fill the page cache, then UFFDIO_CONTINUE.
    #[value(name = "MINOR", alias = "minor")]
    Minor,
    /// KVM Userfault on guest_memfd memory: the memslot's userfault bitmap makes each vCPU's
    /// first access exit; the pager writes the chunk into the guest_memfd and clears its bits.
    #[value(name = "KVM_USERFAULT", alias = "kvm-userfault")]
    KvmUserfault,
}

/// The pager of a demand-paging run.
enum Paging {
    Uffd(Pager),
    Kvm(UserfaultPager),
}

impl Paging {
    fn stats(&self) -> PagerStats {
        match self {
            Paging::Uffd(p) => p.stats(),
            Paging::Kvm(p) => p.stats(),
        }
    }

    /// The pager's own memory: the userfaultfd pager's, or the userfault bitmap.
    fn memory_bytes(&self, size: u64) -> u64 {
        match self {
            Paging::Uffd(p) => p.memory_bytes(),
            Paging::Kvm(_) => size.div_ceil(PAGE_SIZE).div_ceil(64) * 8,
        }
    }
}

#[derive(Debug, clap::Args)]
pub struct Args {
    /// vCPU counts to measure, e.g. 1,8,32,64 (one column each).
    #[arg(short = 'v', long, default_value = "1", value_delimiter = ',')]
    vcpus: Vec<usize>,
    /// Bytes each vCPU touches (its own range).
    #[arg(short = 'b', long, default_value = "64M", value_parser = parse_size)]
    bytes: u64,
    /// userfaultfd mode: MISSING (anon memory) or MINOR (memfd memory).
    #[arg(short = 'u', long, value_enum, default_value = "MISSING")]
    mode: Mode,
    /// One userfaultfd for all vCPUs (default: one per vCPU range).
    #[arg(short = 'a', long)]
    one_uffd: bool,
    /// Handler threads reading userfaultfd events (in total).
    #[arg(short = 'r', long, default_value_t = 2)]
    handlers: usize,
    /// Readahead threads: fetch the chunks after a sequential fault concurrently (0: the
    /// handler that saw the fault installs them itself). Default: 4 with `-d` (fetches in
    /// flight hide the link's latency), 0 for the local file (nothing to hide).
    #[arg(long)]
    readahead_threads: Option<usize>,
    /// Per-fetch delay of the page source in microseconds (a remote peer; 0: the local file).
    #[arg(short = 'd', long, default_value_t = 0)]
    delay_us: u64,
    /// Bytes installed per fault (fault-around).
    #[arg(long, default_value = "2M", value_parser = parse_size)]
    fault_around: u64,
    /// Do not fetch untouched pages in the background.
    #[arg(long)]
    no_background: bool,
    /// Runs of each mode per vCPU count, interleaved; the best rate of each mode is kept
    /// (the host is shared: the best run is the one least disturbed).
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Host CPUs for the vCPU threads of every run, the pre-populated baseline included, e.g.
    /// 0 or 0,1 (default: wherever the scheduler puts them).
    #[arg(long, value_delimiter = ',')]
    vcpu_cpus: Option<Vec<usize>>,
    /// Host CPUs for the pager's threads and, with `-d`, the remote peer's, e.g. 1 (default:
    /// wherever the scheduler puts them). May overlap `--vcpu-cpus`.
    #[arg(long, value_delimiter = ',')]
    pager_cpus: Option<Vec<usize>>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Column {
    vcpus: usize,
    prepopulated_pages_per_s: f64,
    first_touch_pages_per_s: f64,
    demand_paging_pages_per_s: f64,
    ratio_vs_prepopulated: f64,
    /// Every run of the three rates (the columns above are each the best run, as the kernel's
    /// demand_paging_test reports), with median, min and max.
    prepopulated_pages_per_s_figure: Figure,
    first_touch_pages_per_s_figure: Figure,
    demand_paging_pages_per_s_figure: Figure,
    /// With `-d`: the mean delay the peer really waited per request (a sleep overshoots).
    observed_delay_us: Option<f64>,
    pager_memory_bytes: u64,
    pager_memory_ratio_vs_guest: f64,
    faults: u64,
    fault_chunks: u64,
    readahead_chunks: u64,
    background_chunks: u64,
}

#[derive(Serialize)]
struct Output {
    mode: Mode,
    backend: Backend,
    bytes_per_vcpu: u64,
    one_uffd: bool,
    handlers: usize,
    readahead_threads: usize,
    delay_us: u64,
    fault_around_bytes: u64,
    background: bool,
    /// `--vcpu-cpus` (`null`: not pinned).
    vcpu_cpus: Option<Vec<usize>>,
    /// `--pager-cpus` (`null`: not pinned).
    pager_cpus: Option<Vec<usize>>,
    columns: Vec<Column>,
}

const STALL: Duration = Duration::from_secs(60);

pub fn main(args: Args) -> crate::Result<()> {
    if args.repeat == 0 {
        return Err("--repeat: at least 1 run is needed".into());
    }
    if args.vcpus.is_empty() || args.vcpus.contains(&0) {
        return Err("-v: every vCPU count must be at least 1".into());
    }
    if args.bytes == 0 || !args.bytes.is_multiple_of(args.fault_around.max(PAGE_SIZE)) {
        return Err(format!(
            "-b {}: bytes per vCPU must be a non-zero multiple of the fault-around size ({})",
            args.bytes, args.fault_around
        )
        .into());
    }
    let vcpu_cpus = cpu_set("--vcpu-cpus", &args.vcpu_cpus)?;
    let pager_cpus = cpu_set("--pager-cpus", &args.pager_cpus)?;
    let backend = match args.mode {
        Mode::Missing => Backend::Anon,
        Mode::Minor => Backend::Memfd,
        Mode::KvmUserfault => Backend::GuestMemfd,
    };
    let max_vcpus = *args.vcpus.iter().max().expect("not empty");
    let file = source_file(max_vcpus as u64 * args.bytes, !args.json)?;
    let mut columns = Vec::new();
    for &vcpus in &args.vcpus {
        let column = column(&args, vcpus, backend, &file, (vcpu_cpus, pager_cpus))?;
        if !args.json {
            print_column(&args, &column);
        }
        columns.push(column);
    }
    let out = Output {
        mode: args.mode,
        backend,
        bytes_per_vcpu: args.bytes,
        one_uffd: args.one_uffd,
        handlers: args.handlers,
        readahead_threads: readahead_threads(&args),
        delay_us: args.delay_us,
        fault_around_bytes: args.fault_around,
        background: !args.no_background,
        vcpu_cpus: args.vcpu_cpus.clone(),
        pager_cpus: args.pager_cpus.clone(),
        columns,
    };
    if args.json {
        crate::envelope::print(&out)?;
    } else {
        print_table(&out);
    }
    Ok(())
}

/// One column: `--repeat` runs of `vcpus` vCPUs touching their memory pre-populated, on first
/// touch and demand-paged from `file`; the best rates, and the demand-paging run's pager figures.
fn column(
    args: &Args,
    vcpus: usize,
    backend: Backend,
    file: &File,
    (vcpu_cpus, pager_cpus): (Option<CpuSet>, Option<CpuSet>),
) -> crate::Result<Column> {
    let size = vcpus as u64 * args.bytes;
    let mut best = (0.0f64, 0.0f64, 0.0f64);
    let mut stats = PagerStats::default();
    let mut pager_memory = 0;
    let mut observed_delay = None;
    let mut rates = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..args.repeat {
        let (prepopulated, _) = touch_rate(vcpus, size, backend, vcpu_cpus, |vm| {
            populate(vm, file, size)?;
            Ok(None)
        })?;
        let (first_touch, _) = touch_rate(vcpus, size, backend, vcpu_cpus, |_| Ok(None))?;
        let mut remote = None;
        let (demand, pager) = touch_rate(vcpus, size, backend, vcpu_cpus, |vm| {
            start_paging(args, vm, vcpus, file, pager_cpus, &mut remote)
        })?;
        if demand > best.2 {
            (stats, pager_memory) = pager.expect("the demand-paging run has a pager");
            observed_delay = remote.and_then(|r| r.observed_delay());
        }
        rates.0.push(prepopulated);
        rates.1.push(first_touch);
        rates.2.push(demand);
        best = (
            best.0.max(prepopulated),
            best.1.max(first_touch),
            best.2.max(demand),
        );
    }
    let (prepopulated, first_touch, demand) = best;
    let figure = |v: &[f64]| Figure::of(v).expect("--repeat is at least 1, rates are not NaN");
    Ok(Column {
        vcpus,
        prepopulated_pages_per_s_figure: figure(&rates.0),
        first_touch_pages_per_s_figure: figure(&rates.1),
        demand_paging_pages_per_s_figure: figure(&rates.2),
        prepopulated_pages_per_s: prepopulated,
        first_touch_pages_per_s: first_touch,
        demand_paging_pages_per_s: demand,
        ratio_vs_prepopulated: demand / prepopulated,
        observed_delay_us: observed_delay.map(|d| d.as_secs_f64() * 1e6),
        pager_memory_bytes: pager_memory,
        pager_memory_ratio_vs_guest: pager_memory as f64 / size as f64,
        faults: stats.faults,
        fault_chunks: stats.fault_chunks,
        readahead_chunks: stats.readahead_chunks,
        background_chunks: stats.background_chunks,
    })
}

/// Starts the pager of a demand-paging run over `vm`'s `ram` region: a userfaultfd pager, or
/// with KVM Userfault a userfault pager; `remote` gets the remote source, if there is one.
fn start_paging(
    args: &Args,
    vm: &Vm,
    vcpus: usize,
    file: &File,
    pager_cpus: Option<CpuSet>,
    remote: &mut Option<Arc<RemoteSource>>,
) -> crate::Result<Option<Paging>> {
    let ram = vm.memory().region("ram").expect("the VM has a ram region");
    let source = source(args, file, pager_cpus)?;
    *remote = source.remote;
    let config = pager_config(args, vm, vcpus);
    if args.mode == Mode::KvmUserfault {
        let index = vm
            .memory()
            .regions()
            .iter()
            .position(|r| r.name() == "ram")
            .expect("the VM has a ram region");
        let pager = UserfaultPager::start(vm.memory(), index, source.pages, &config)?;
        return Ok(Some(Paging::Kvm(pager)));
    }
    let pager = Pager::start(ram, source.pages, &config)?;
    Ok(Some(Paging::Uffd(pager)))
}

/// One column as text.
fn print_column(args: &Args, column: &Column) {
    println!("{} vCPUs x {} MiB:", column.vcpus, args.bytes >> 20);
    println!(
        "  Pre-populated baseline: {:.0} pgs/sec",
        column.prepopulated_pages_per_s
    );
    println!(
        "  Kernel first-touch rate: {:.0} pgs/sec",
        column.first_touch_pages_per_s
    );
    println!(
        "  Overall demand paging rate: {:.0} pgs/sec",
        column.demand_paging_pages_per_s
    );
    println!(
        "  ratio_vs_prepopulated: {:.2}; faults {}, chunks by fault {}, by readahead {}, \
         by background {}; pager memory {} KiB ({:.3}% of guest memory)",
        column.ratio_vs_prepopulated,
        column.faults,
        column.fault_chunks,
        column.readahead_chunks,
        column.background_chunks,
        column.pager_memory_bytes >> 10,
        column.pager_memory_ratio_vs_guest * 100.0
    );
    if let Some(us) = column.observed_delay_us {
        println!(
            "  remote delay: {} us asked, {us:.0} us waited per request",
            args.delay_us
        );
    }
}

fn pager_config(args: &Args, vm: &Vm, vcpus: usize) -> PagerConfig {
    PagerConfig {
        uffds: if args.one_uffd { 1 } else { vcpus },
        handlers: args.handlers,
        readahead_threads: readahead_threads(args),
        fault_around: args.fault_around,
        background: !args.no_background,
        abort: Some(vm.abort_handle()),
        cpus: args.pager_cpus.clone(),
        ..PagerConfig::default()
    }
}

/// `--vcpu-cpus` / `--pager-cpus`, checked against the CPUs this process may run on.
fn cpu_set(option: &str, cpus: &Option<Vec<usize>>) -> crate::Result<Option<CpuSet>> {
    let Some(cpus) = cpus else {
        return Ok(None);
    };
    Ok(Some(
        CpuSet::new(cpus).map_err(|e| format!("{option} {cpus:?}: {e}"))?,
    ))
}

/// Runs `spawn` with the calling thread pinned to `cpus` (if any), so that the threads it
/// starts inherit them, then gives the calling thread back the CPUs it had.
fn spawned_on<T>(cpus: Option<CpuSet>, spawn: impl FnOnce() -> T) -> crate::Result<T> {
    let Some(cpus) = cpus else {
        return Ok(spawn());
    };
    let own = CpuSet::of_current_thread()
        .map_err(|e| format!("sched_getaffinity of the bench thread: {e}"))?;
    cpus.pin_current_thread()
        .map_err(|e| format!("pinning the bench thread to {cpus:?}: {e}"))?;
    let spawned = spawn();
    own.pin_current_thread()
        .map_err(|e| format!("giving the bench thread back its CPUs {own:?}: {e}"))?;
    Ok(spawned)
}

fn readahead_threads(args: &Args) -> usize {
    args.readahead_threads
        .unwrap_or(if args.delay_us > 0 { 4 } else { 0 })
}

/// The pages of a demand-paging run, and the remote peer serving them with `-d` (for the delay
/// it really waited).
struct Source {
    pages: Arc<dyn PageSource>,
    remote: Option<Arc<RemoteSource>>,
}

/// The local file, or with `-d` a remote peer serving it after that delay per request, its
/// threads on `cpus`.
fn source(args: &Args, file: &File, cpus: Option<CpuSet>) -> crate::Result<Source> {
    let local: Arc<dyn PageSource> = Arc::new(FileSource::new(file.try_clone()?)?);
    if args.delay_us == 0 {
        return Ok(Source {
            pages: local,
            remote: None,
        });
    }
    let delay = Duration::from_micros(args.delay_us);
    // One connection for each thread that fetches: handlers, readahead, background.
    let connections = args.handlers + readahead_threads(args) + 1;
    let remote = Arc::new(spawned_on(cpus, || {
        RemoteSource::spawn(local, delay, connections)
    })??);
    Ok(Source {
        pages: remote.clone(),
        remote: Some(remote),
    })
}

/// Runs `touch` on a fresh VM prepared by `prepare` (which may return the pager it started),
/// its vCPU threads on `vcpu_cpus`, and returns total pages / seconds (and the pager's stats
/// and own memory) from the start of `prepare`'s pager (or of the vCPUs) to the last vCPU's
/// end, as the kernel's test measures.
fn touch_rate(
    vcpus: usize,
    size: u64,
    backend: Backend,
    vcpu_cpus: Option<CpuSet>,
    prepare: impl FnOnce(&Vm) -> crate::Result<Option<Paging>>,
) -> crate::Result<(f64, Option<(PagerStats, u64)>)> {
    let mut vm = Vm::new(&VmConfig::simple(vcpus, size, backend))?;
    let work = VcpuWork::split(Workload::Touch, layout::RAM_GPA, size, vcpus, 1);
    // The pager is started (and its clock with it) only for the demand-paging run, so that
    // the background fetcher gets no head start over the vCPUs.
    let mut started = Instant::now();
    let pager = prepare(&vm)?;
    if pager.is_none() {
        started = Instant::now();
    }
    let report = spawned_on(vcpu_cpus, || vm.start(&work))??.wait(STALL)?;
    let seconds = started.elapsed().as_secs_f64();
    // The pager goes before the VM (and its memory).
    let pager = pager.map(|p| (p.stats(), p.memory_bytes(size)));
    Ok((report.total_pages as f64 / seconds, pager))
}

/// Copies the source file into the VM's RAM (the pre-populated baseline).
fn populate(vm: &Vm, file: &File, size: u64) -> crate::Result<()> {
    let mut buf = vec![0u8; 1 << 20];
    let mut off = 0;
    while off < size {
        let n = buf.len().min(to_usize(size - off));
        file.read_exact_at(&mut buf[..n], off)?;
        vm.memory().write(layout::RAM_GPA + off, &buf[..n])?;
        off += n as u64;
    }
    Ok(())
}

/// The snapshot file the pager reads: `size` bytes of a position-dependent pattern, in the
/// temporary directory, unlinked once open.
fn source_file(size: u64, progress: bool) -> crate::Result<File> {
    let path = std::env::temp_dir().join(format!("guestmem-demand-paging-{}", std::process::id()));
    let mut file = File::options()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)
        .map_err(|e| format!("creating the source file {}: {e}", path.display()))?;
    let _ = std::fs::remove_file(&path);
    let bar = if progress {
        ProgressBar::new(size)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("writing the source file {bar:40} {bytes}/{total_bytes}")
            .expect("valid template"),
    );
    let mut block = vec![0u8; 1 << 20];
    let mut off = 0u64;
    while off < size {
        let n = block.len().min(to_usize(size - off));
        for (i, word) in block[..n].chunks_exact_mut(8).enumerate() {
            let at = off + i as u64 * 8;
            word.copy_from_slice(
                &(at ^ 0x5eed)
                    .wrapping_mul(0x9e37_79b9_7f4a_7c15)
                    .to_le_bytes(),
            );
        }
        file.write_all(&block[..n])?;
        off += n as u64;
        bar.set_position(off);
    }
    bar.finish_and_clear();
    Ok(file)
}

fn print_table(out: &Output) {
    let mode = match out.mode {
        Mode::Missing => "MISSING",
        Mode::Minor => "MINOR",
        Mode::KvmUserfault => "KVM_USERFAULT",
    };
    let source = if out.delay_us > 0 {
        format!("remote, {} us per request", out.delay_us)
    } else {
        "local file".to_string()
    };
    println!();
    let on = |cpus: &Option<Vec<usize>>| match cpus {
        Some(cpus) => {
            let list: Vec<String> = cpus.iter().map(std::string::ToString::to_string).collect();
            format!("on CPUs {}", list.join(","))
        }
        None => "not pinned".to_string(),
    };
    println!(
        "{} per vCPU, {} backend, {}, {} handler threads, {} readahead threads, {} KiB \
         fault-around, background fetch {}, {source}; vCPU threads {}, {} threads {}",
        format_args!("{} MiB", out.bytes_per_vcpu >> 20),
        out.backend,
        if out.one_uffd {
            "one userfaultfd"
        } else {
            "one userfaultfd per vCPU"
        },
        out.handlers,
        out.readahead_threads,
        out.fault_around_bytes >> 10,
        if out.background { "on" } else { "off" },
        on(&out.vcpu_cpus),
        if out.delay_us > 0 {
            "pager and peer"
        } else {
            "pager"
        },
        on(&out.pager_cpus),
    );
    let cols: Vec<String> = out.columns.iter().map(|c| c.vcpus.to_string()).collect();
    println!("| pages/s \\ vCPUs | {} |", cols.join(" | "));
    println!("|---|{}", "---|".repeat(cols.len()));
    let row = |name: &str, f: &dyn Fn(&Column) -> String| {
        let cells: Vec<String> = out.columns.iter().map(f).collect();
        println!("| {name} | {} |", cells.join(" | "));
    };
    row("pre-populated", &|c| {
        format!("{:.0}", c.prepopulated_pages_per_s)
    });
    row("kernel first-touch", &|c| {
        format!("{:.0}", c.first_touch_pages_per_s)
    });
    row(&format!("uffd {mode} (guestmem pager)"), &|c| {
        format!("{:.0}", c.demand_paging_pages_per_s)
    });
    row("ratio vs pre-populated", &|c| {
        format!("{:.2}", c.ratio_vs_prepopulated)
    });
    if out.delay_us > 0 {
        row("remote delay waited per request (us)", &|c| {
            c.observed_delay_us
                .map_or("-".into(), |us| format!("{us:.0}"))
        });
    }
    row("pager memory / guest memory", &|c| {
        format!("{:.3}%", c.pager_memory_ratio_vs_guest * 100.0)
    });
}

#[cfg(test)]
mod tests {
    fn error_of(argv: &[&str]) -> String {
        crate::refusal(argv, super::main)
    }

    #[test]
    fn bad_arguments_are_refused_before_any_work() {
        assert!(error_of(&["-v", "1,0"]).contains("-v: every vCPU count must be at least 1"));
        assert!(error_of(&["--repeat", "0"]).contains("--repeat"));
        let e = error_of(&["-b", "3M"]);
        assert!(
            e.contains("-b 3145728") && e.contains("fault-around"),
            "{e}"
        );
        assert!(crate::parse::<super::Args>(&["-u", "WP"]).is_err());
        let e = error_of(&["--vcpu-cpus", "0,4096"]);
        assert!(e.contains("--vcpu-cpus [0, 4096]: CPU 4096 "), "{e}");
        let e = error_of(&["--vcpu-cpus", "0", "--pager-cpus", "1023"]);
        assert!(e.contains("--pager-cpus [1023]: CPU 1023 "), "{e}");
        assert!(crate::parse::<super::Args>(&["--pager-cpus", ""]).is_err());
    }
}
