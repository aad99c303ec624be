//! `guestmem bench migrate`: live migration on loopback, per guest memory size, guest
//! dirty rate and mode (pre-copy, post-copy, hybrid), beside QEMU's pre-copy of the same
//! workload in the same invocation ([`qemu_peer::precopy`]).
//!
//! Each run builds fresh credentials in a temporary directory (removed after), binds a
//! [`Listener`] (TCP on 127.0.0.1, port chosen by the kernel, or a Unix socket) and receives in a
//! thread of this process (receive → [`migrate::Transfer::resume`] → the guest runs until
//! [`migrate::Transfer::finish`], i.e. until every page is resident → stop). The source VM runs
//! the `dirty` workload with `fill_first`: a first pass over all of RAM at full speed (every page
//! holds data), then the asked rate; "idle" is [`qemu_peer::IDLE_PAGES_PER_S`] pages per second
//! over all vCPUs (as QEMU's idle peer: the guest still moves, so its counters show it carry on),
//! not a gated guest. Once the fill is done the guest's steady rate is measured over
//! [`STEADY`]; then it migrates (`verify` off: the downtime is the switch-over alone).
//!
//! Guest slowdown: pages the guest wrote while migrating, over the time it ran meanwhile (the
//! source from the migration's start to the switch-over; for post-copy and hybrid, plus the
//! destination from its resume until every page is resident), against its steady rate before
//! the migration. The downtime is not counted in it (it is its own column).
//!
//! `--link 1gbit|10gbit` runs the source and the destination (guestmem's: the destination
//! thread's sockets; QEMU's: each process) in two network namespaces joined by a veth pair
//! shaped by `tc` ([`link::Link`]); loopback stays on 127.0.0.1. The QEMU rows are one per
//! configuration (multifd with `--connections` channels, per `--qemu-compress` and
//! `--qemu-channels`); each guestmem pre-copy row is compared with the best of them (lowest
//! median total time) of its size and rate: `qemu_best_config`, `total_vs_qemu_best_ratio`,
//! `downtime_vs_qemu_best_ratio`.
//!
//! CPU seconds: the threads of the source (the migration's sending side) and of the
//! destination (receiving threads), sampled from `/proc` ([`cpu::Sampler`]), the guests' vCPU
//! threads left out; QEMU's the same, per process.
//!
//! Every figure is the median of `--repeat` runs (QEMU's too).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use guestmem_memory::{Backend, GuestMemory};
use guestmem_migration::compress::{Compress, CompressionReport};
use guestmem_migration::delta::DeltaReport;
use guestmem_migration::migrate::{
    self, DestinationReport, Links, Mode, ReceiveOptions, Report, Round, SendOptions,
};
use guestmem_migration::transport::{generate_credentials, Credentials, Endpoint, Listener, Role};
use guestmem_paging::affinity::CpuSet;
use guestmem_vm::payload::CTL_PAGES_DONE;
use guestmem_vm::{layout, VcpuWork, Vm, VmConfig, Workload};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::link::{self, Link, Side};
use crate::units::parse_size;
use crate::{cpu, qemu_peer, Steal};

/// A guest dirty rate: idle, or MiB/s over all vCPUs.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Rate {
    Idle,
    MibPerS(u64),
}

impl Rate {
    fn label(self) -> String {
        match self {
            Rate::Idle => "idle".into(),
            Rate::MibPerS(m) => format!("{m} MiB/s"),
        }
    }

    fn mib_per_s(self) -> Option<u64> {
        match self {
            Rate::Idle => None,
            Rate::MibPerS(m) => Some(m),
        }
    }

    /// Pages per second over all vCPUs.
    fn pages_per_s(self) -> u64 {
        match self {
            Rate::Idle => qemu_peer::IDLE_PAGES_PER_S,
            Rate::MibPerS(m) => m * 256,
        }
    }
}

fn parse_rate(s: &str) -> Result<Rate, String> {
    match s.trim() {
        "idle" | "0" => Ok(Rate::Idle),
        t => match t.parse::<u64>() {
            Ok(m) => Ok(Rate::MibPerS(m)),
            Err(_) => Err(format!("'{s}' is not a rate: idle, or MiB/s like 64")),
        },
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
enum Transport {
    Tcp,
    Unix,
}

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Guest memory sizes, e.g. 1G,4G.
    #[arg(long, default_value = "1G,4G", value_delimiter = ',', value_parser = parse_size)]
    sizes: Vec<u64>,
    /// Guest dirty rates after the fill, MiB/s over all vCPUs; idle = 16 pages/s.
    #[arg(long, default_value = "idle,64,512", value_delimiter = ',', value_parser = parse_rate)]
    rates: Vec<Rate>,
    /// Migration modes.
    #[arg(long, default_value = "precopy,postcopy,hybrid", value_delimiter = ',')]
    modes: Vec<Mode>,
    /// vCPUs of the guest (all of them dirty; under QEMU only vCPU 0 does).
    #[arg(long, default_value_t = 2)]
    vcpus: usize,
    /// Runs per case; every figure is the median.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Pages connections.
    #[arg(long, default_value_t = guestmem_migration::migrate::DEFAULT_CONNECTIONS)]
    connections: usize,
    /// Pre-copy's downtime target (QEMU's downtime-limit too), ms.
    #[arg(long, default_value_t = 50)]
    downtime_ms: u64,
    /// Run the QEMU peer rows (pre-copy, same size and rate) in the same invocation (default).
    #[arg(long, overrides_with = "no_qemu")]
    qemu: bool,
    /// Skip the QEMU peer rows.
    #[arg(long, overrides_with = "qemu")]
    no_qemu: bool,
    /// The channels of the QEMU rows: tls (both peers verified, as guestmem's channel always
    /// is) and plain TCP (QEMU's default).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "tls,plain")]
    qemu_channels: Vec<qemu_peer::Channel>,
    /// guestmem sends pages whole, zero lines included, as QEMU does (default: only their
    /// non-zero 64-byte lines).
    #[arg(long)]
    whole_pages: bool,
    /// Compression modes to run guestmem with, each a row: none, lz4, zstd, auto (the
    /// default, as `migrate send`'s).
    #[arg(long, default_value = "auto", value_delimiter = ',')]
    compress: Vec<Compress>,
    /// Delta cache sizes to run guestmem with (pre-copy), each a row per compression mode:
    /// MiB, or `auto` (4 % of guest memory); 0, the default, sends no deltas.
    #[arg(long, default_value = "0", value_delimiter = ',')]
    delta_cache_mib: Vec<DeltaCacheArg>,
    /// With zstd (and auto), pre-copy: the zstd stream windows to run guestmem with, each a
    /// row per zstd (or auto) mode: MiB per pages connection (a power of two), or `off` (0:
    /// each frame compressed on its own); see `migrate send --zstd-window-mib`.
    #[arg(
        long = "zstd-window-mib",
        value_name = "MIB",
        default_value = "off",
        value_delimiter = ',',
        value_parser = guestmem_migration::compress::parse_zstd_window_mib
    )]
    zstd_window_bytes: Vec<u64>,
    /// Start guest RAM from this memory image (e.g. a capture of a Linux guest, see
    /// scripts/capture-guest-memory.sh) instead of letting the guest fill it first.
    #[arg(long, value_name = "FILE")]
    image: Option<PathBuf>,
    /// Run the `rewrite` workload (2-33 lines of a page rewritten with another page's) at the
    /// rate instead of `dirty` (one u64 per page).
    #[arg(long)]
    rewrite: bool,
    /// Loopback transport: tcp (127.0.0.1) or unix (a socket in the temporary directory).
    #[arg(long, value_enum, default_value = "tcp")]
    transport: Transport,
    /// Post-copy and hybrid: host CPUs for the fault path of both sides, the source's fault
    /// servers and the destination's pagers (`migrate send/receive --fault-cpus`): on one
    /// host, one CPU keeps each fault's round trip on it. `first`: the first CPU this process
    /// may run on; `none`: wherever the scheduler puts them.
    #[arg(long, default_value = "first", value_parser = parse_fault_cpus)]
    fault_cpus: FaultCpus,
    /// The link: loopback (127.0.0.1), or two network namespaces joined by a veth pair
    /// shaped to 10 or 1 Gbit/s (needs root, ip and tc).
    #[arg(long, value_enum, default_value = "loopback")]
    link: link::Speed,
    /// QEMU's multifd-compression for the QEMU rows, each a configuration (multifd with
    /// `--connections` channels): none, zlib, zstd.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "none,zstd")]
    qemu_compress: Vec<qemu_peer::MultifdCompression>,
    /// With `--image`: runs of the CPU floor of both ends on the image (`bench floor`, each
    /// codec), measured once before the migrations and divided into their CPU
    /// (`dest_cpu_to_floor`, `source_cpu_to_floor`); 0: none.
    #[arg(long, default_value_t = 1)]
    floor_runs: usize,
    /// Make on both ends the progress records and metrics that `migrate send/receive
    /// --progress json=FILE --metrics ADDR` make (encoded, then dropped): what they cost, for
    /// `scripts/bench-ab`.
    #[arg(long)]
    progress: bool,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

/// `--fault-cpus`: a CPU list, or none.
#[derive(Clone, Debug)]
struct FaultCpus(Option<Vec<usize>>);

fn parse_fault_cpus(s: &str) -> Result<FaultCpus, String> {
    match s {
        "none" => return Ok(FaultCpus(None)),
        "first" => {
            let allowed = CpuSet::of_current_thread()
                .map_err(|e| format!("the CPUs this process may run on: {e}"))?;
            return Ok(FaultCpus(allowed.cpus().first().map(|&cpu| vec![cpu])));
        }
        _ => {}
    }
    s.split(',')
        .map(|c| {
            c.trim().parse().map_err(|_| {
                format!("'{c}' is not a CPU number (give a list like 0,1, first or none)")
            })
        })
        .collect::<Result<Vec<usize>, String>>()
        .map(|cpus| FaultCpus(Some(cpus)))
}

impl FaultCpus {
    fn label(&self) -> String {
        match &self.0 {
            None => "not pinned".into(),
            Some(cpus) => format!(
                "on CPU {}",
                cpus.iter()
                    .map(std::string::ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            ),
        }
    }
}

/// How long the guest's steady rate is measured before each migration.
const STEADY: Duration = Duration::from_secs(1);
/// How long the fill (first pass at full speed) may take.
const FILL_TIMEOUT: Duration = Duration::from_secs(300);

/// One guestmem migration.
struct Run {
    report: Report,
    steady_pages_per_s: f64,
    during_pages_per_s: f64,
    /// The host's steal time during the migration.
    steal_percent: Option<f64>,
    /// CPU time of the source's and the destination's migration threads.
    source_cpu_s: f64,
    destination_cpu_s: f64,
    /// The floors of both ends for this run's mix of codecs (see [`Floors::mix`]).
    floor: Option<EndFloors>,
}

/// The CPU floor of both ends per codec on the image, CPU-s per GiB of pages
/// ([`crate::floor`]).
struct Floors(Vec<crate::floor::CodecFloor>);

impl Floors {
    /// The floors of the destination and the source for a migration whose frames went as
    /// `c` says: each codec's floor weighted by its share of the frames.
    fn mix(&self, c: &CompressionReport) -> Option<EndFloors> {
        let of = |codec| self.0.iter().find(|f| f.codec == codec);
        let parts = [
            (c.zstd_frames, of(crate::floor::FloorCodec::Zstd)?),
            (c.lz4_frames, of(crate::floor::FloorCodec::Lz4)?),
            (c.plain_frames, of(crate::floor::FloorCodec::None)?),
        ];
        let frames: u64 = parts.iter().map(|p| p.0).sum();
        (frames > 0).then(|| {
            parts.iter().fold(EndFloors::default(), |sum, (n, f)| {
                let w = *n as f64 / frames as f64;
                EndFloors {
                    dest: sum.dest + w * f.dest_floor_cpu_s_per_gib,
                    source: sum.source + w * f.source_floor_cpu_s_per_gib,
                    tls_receive: sum.tls_receive + w * f.tls_receive_cpu_s_per_gib,
                }
            })
        })
    }
}

/// The floors of a migration's ends, CPU-s per GiB of pages (see [`crate::floor`]): the
/// destination's (decompression and one copy), the source's (compression and one copy), and
/// what receiving the bytes over the transport takes (TLS over loopback TCP).
#[derive(Debug, Clone, Copy, Default)]
struct EndFloors {
    dest: f64,
    source: f64,
    tls_receive: f64,
}

/// A delta cache size for the bench: MiB, or the default share of guest memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum DeltaCacheArg {
    Auto,
    Mib(u64),
}

impl std::str::FromStr for DeltaCacheArg {
    type Err = String;
    fn from_str(s: &str) -> Result<DeltaCacheArg, String> {
        match s {
            "auto" => Ok(DeltaCacheArg::Auto),
            n => n
                .parse::<u64>()
                .ok()
                .filter(|m| m.checked_mul(1 << 20).is_some())
                .map(DeltaCacheArg::Mib)
                .ok_or_else(|| format!("delta cache '{s}': MiB (0 for none) or auto")),
        }
    }
}

impl DeltaCacheArg {
    fn bytes(self) -> Option<u64> {
        match self {
            DeltaCacheArg::Auto => None,
            DeltaCacheArg::Mib(m) => Some(m << 20),
        }
    }
}

#[derive(Serialize)]
struct Row {
    link: link::Speed,
    memory_bytes: u64,
    /// None: idle (16 pages/s).
    dirty_mib_per_s: Option<u64>,
    mode: Mode,
    compress: Compress,
    /// The delta cache asked for (`auto`: 4 % of guest memory).
    delta_cache: DeltaCacheArg,
    /// The zstd stream window per pages connection (0: frames compressed one by one), as
    /// asked for and as used (cut to the guest memory per connection).
    zstd_window_asked_bytes: u64,
    zstd_window_bytes: u64,
    /// What the zstd streams held at their most, all pages connections, on the source (in
    /// `source_extra_bytes`) and on the destination.
    zstd_stream_bytes_source: f64,
    zstd_stream_bytes_destination: f64,
    /// The destination's connections whose TLS records the kernel handled (kernel TLS), in
    /// the first run.
    dest_kernel_tls_connections: usize,
    runs: usize,
    total_ms: f64,
    downtime_ms: f64,
    total_ms_runs: Vec<f64>,
    downtime_ms_runs: Vec<f64>,
    sent_mib: f64,
    /// What the pages took on the wire (non-zero lines and masks), all phases.
    wire_mib: f64,
    /// What the first round's pages took on the wire, per byte of guest memory.
    first_pass_wire_bytes_per_guest_byte: f64,
    /// Bytes on the wire (all phases) per GiB of guest memory.
    wire_bytes_per_guest_gib: f64,
    /// Of the (first run's) frames: how many each codec compressed, and the bytes in and out.
    compression: CompressionReport,
    /// The codec that compressed most of the (first run's) frames: none, lz4, zstd.
    compression_chosen: &'static str,
    /// CPU seconds of the source's and the destination's threads, vCPUs left out.
    source_cpu_s: f64,
    destination_cpu_s: f64,
    /// The same per GiB of pages sent (all rounds; `sent_mib`).
    source_cpu_s_per_gib: f64,
    dest_cpu_s_per_gib: f64,
    /// With `--image`: the floors of both ends on the image for the run's mix of codecs
    /// (decompression and one copy into fresh memory; compression; see `bench floor`), CPU-s
    /// per GiB of pages, and each end's CPU over its floor (medians of the runs').
    dest_floor_cpu_s_per_gib: Option<f64>,
    source_floor_cpu_s_per_gib: Option<f64>,
    dest_cpu_to_floor: Option<f64>,
    source_cpu_to_floor: Option<f64>,
    /// With `--image`: what receiving the run's bytes over the transport alone takes (TLS
    /// over loopback TCP, see `bench floor`), CPU-s per GiB of pages, and the destination's
    /// CPU over its floor and that together.
    dest_tls_receive_cpu_s_per_gib: Option<f64>,
    dest_cpu_to_floor_and_tls_receive: Option<f64>,
    /// What the pages of the rounds after the first took on the wire.
    later_rounds_wire_mib: f64,
    /// The delta cache's size, and its hit rate over the re-sent pages looked up.
    delta_cache_bytes: u64,
    delta_hit_rate: f64,
    /// Page bytes that travelled as deltas instead, less the deltas (before compression).
    delta_saved_mib: f64,
    /// The (first run's) delta cache figures.
    delta: DeltaReport,
    rounds: f64,
    /// Pre-copy rounds that converged (the rest hit the round limit).
    converged_runs: usize,
    max_throttle_percent: f64,
    round1_mib_per_s: f64,
    /// Post-copy (and hybrid): fault fetch latency on the destination.
    fault_p50_us: Option<f64>,
    fault_p99_us: Option<f64>,
    faults: Option<f64>,
    postcopy_resident_ms: Option<f64>,
    source_extra_bytes: f64,
    source_extra_percent: f64,
    guest_steady_pages_per_s: f64,
    guest_during_pages_per_s: f64,
    slowdown_percent: f64,
    /// The host's steal time during the migrations (median of the runs'), and each run's:
    /// the hypervisor under this machine preempting its CPUs.
    host_steal_percent: Option<f64>,
    host_steal_percent_runs: Vec<f64>,
    /// Post-copy (and hybrid): the fault fetches' latencies of the run of median total time,
    /// `(bound, count)` per power-of-two bucket of µs (the destination's report).
    fault_latency_buckets_us: Option<Vec<(u64, u64)>>,
    /// The run of median total time, round by round (the source's report): when each began,
    /// what it sent, what the guest dirtied meanwhile, the throttle. The timeline chart's data.
    timeline: Vec<Round>,
}

#[derive(Serialize)]
struct QemuRow {
    link: link::Speed,
    memory_bytes: u64,
    dirty_mib_per_s: Option<u64>,
    mode: Mode,
    /// E.g. `multifd2-zstd-plain`.
    config: String,
    /// The best (lowest median total time) QEMU configuration of its size and rate.
    best: bool,
    multifd: Option<qemu_peer::Multifd>,
    channel: qemu_peer::Channel,
    qemu_version: String,
    runs: usize,
    total_ms: f64,
    downtime_ms: f64,
    total_ms_runs: Vec<f64>,
    downtime_ms_runs: Vec<f64>,
    sent_mib: f64,
    /// `ram.transferred` per GiB of guest memory (the workload's range, as guestmem's).
    wire_bytes_per_guest_gib: f64,
    /// `ram.transferred` at the end of the first pass (polled), per byte of guest memory.
    first_pass_wire_bytes_per_guest_byte: Option<f64>,
    /// Pages QEMU sent as zero pages (`ram.duplicate`).
    zero_pages: f64,
    /// Sampled words of the image found in the guest before migrating (of how many).
    image_words_matched: Option<(usize, usize)>,
    source_cpu_s: f64,
    destination_cpu_s: f64,
    dirty_syncs: f64,
    boot_ms: f64,
    guest_configured_pages_per_s: u64,
    guest_during_pages_per_s: f64,
    slowdown_percent: f64,
    /// The host's steal time over each run (boot included), median.
    host_steal_percent: Option<f64>,
    /// The run of median total time, as QEMU's `query-migrate` told it every 100 ms.
    timeline: Vec<qemu_peer::Sample>,
}

/// A guestmem pre-copy row against the best QEMU configuration of the same size and rate,
/// and the targets for the link.
#[derive(Serialize)]
struct Comparison {
    link: link::Speed,
    memory_bytes: u64,
    dirty_mib_per_s: Option<u64>,
    guestmem_compress: Compress,
    /// The zstd stream window of the guestmem row (0: frames compressed one by one).
    guestmem_zstd_window_bytes: u64,
    qemu_best_config: String,
    guestmem_downtime_ms: f64,
    qemu_best_downtime_ms: f64,
    guestmem_total_ms: f64,
    qemu_best_total_ms: f64,
    downtime_vs_qemu_best_ratio: f64,
    total_vs_qemu_best_ratio: f64,
    /// The pre-copy target: total time at most this ratio of QEMU's best (1 Gbit/s: 0.6, else 0.8).
    total_ratio_target: f64,
    total_target_met: bool,
    /// Downtime within 50 ms.
    downtime_target_met: bool,
    first_pass_wire_bytes_per_guest_byte: f64,
    /// First pass on the wire at most 0.3 of guest memory.
    first_pass_target_met: bool,
}

/// The pre-copy target: a 4 GiB guest dirtying 64 MiB/s, against each QEMU row of
/// that case.
#[derive(Serialize)]
struct PrecopyTarget {
    downtime_median_ms: f64,
    downtime_target_ms: f64,
    total_median_ms: f64,
    vs_qemu: Vec<TargetComparison>,
}

#[derive(Serialize)]
struct TargetComparison {
    qemu_config: String,
    qemu_downtime_median_ms: f64,
    qemu_total_median_ms: f64,
    downtime_vs_qemu_ratio: f64,
    total_vs_qemu_ratio: f64,
    /// Downtime within 50 ms, and both ratios under 1.
    met: bool,
}

#[derive(Serialize)]
struct Output {
    vcpus: usize,
    connections: usize,
    /// guestmem sent pages whole (`--whole-pages`), not just their non-zero lines.
    whole_pages: bool,
    /// `--fault-cpus` (None: not pinned).
    fault_cpus: Option<Vec<usize>>,
    transport: String,
    repeat: usize,
    link: link::Speed,
    /// What one TCP connection moved through the link before the runs, MiB/s (None: loopback).
    link_measured_mib_per_s: Option<f64>,
    /// The delay each end of the link adds (0: none; the kernel may lack netem).
    link_delay_ms_each_way: f64,
    image: Option<PathBuf>,
    rewrite: bool,
    downtime_target_ms: u64,
    idle_pages_per_s: u64,
    load_average_before: Option<String>,
    load_average_after: Option<String>,
    rows: Vec<Row>,
    qemu_rows: Vec<QemuRow>,
    /// Why there are no QEMU rows, if there are none.
    qemu_note: Option<String>,
    /// With `--image`: the floors of both ends per codec (`bench floor`).
    floors: Vec<crate::floor::CodecFloor>,
    comparisons: Vec<Comparison>,
    /// 4 GiB, 64 MiB/s, pre-copy (None when that case was not run).
    target_4g_64mib_precopy: Option<PrecopyTarget>,
    /// Highest p99 fault latency of the post-copy and hybrid rows (target: under 1000 µs).
    postcopy_fault_p99_us_max: Option<f64>,
    postcopy_fault_p99_target_met: Option<bool>,
    /// Highest source extra memory, % of guest memory (target: under 2), over the rows
    /// without a zstd stream window (which costs what it was asked for).
    source_extra_percent_max: Option<f64>,
    source_extra_target_met: Option<bool>,
    /// With `--progress`: the progress records the runs made (both ends, all runs).
    progress_records: Option<u64>,
}

pub fn main(args: Args) -> crate::Result<()> {
    check_args(&args)?;
    let modes = &args.modes;
    let (qemu_ok, qemu_note) = qemu_peer_rows(&args)?;
    let cases = args.sizes.len() * args.rates.len();
    if let Some(image) = &args.image {
        std::fs::metadata(image).map_err(|e| format!("--image {}: {e}", image.display()))?;
    }
    // The link, for the whole invocation (and its namespaces deleted at its end).
    let link = match args.link {
        link::Speed::Loopback => None,
        speed => Some(Link::create(speed)?),
    };
    let link_measured_mib_per_s = measure_link(&args, link.as_ref())?;
    let qemu_configs = qemu_configs(&args);
    let qemu_cases = if qemu_ok { qemu_configs.len() } else { 0 };
    let total = cases * (modes.len() * variants(&args).len() + qemu_cases) * args.repeat;
    let bar = progress_bar(args.json, total);
    let load_before = crate::envelope::load_average();
    let mut rows = Vec::new();
    let mut qemu_rows = Vec::new();
    for &size in &args.sizes {
        for &rate in &args.rates {
            for &mode in modes {
                rows.extend(guestmem_rows(&args, link.as_ref(), size, rate, mode, &bar)?);
            }
            if qemu_ok {
                let configs = &qemu_configs;
                qemu_rows.extend(qemu_rows_of(
                    &args,
                    link.as_ref(),
                    size,
                    rate,
                    configs,
                    &bar,
                )?);
            }
        }
    }
    // The floor after the migrations, so that the memory it frees is not what their
    // destinations land in (on a virtual host, recently freed memory is cheaper to touch).
    let floors = measure_floors(&args, &bar)?;
    let rows = rows
        .into_iter()
        .map(|(size, rate, mode, variant, mut runs)| {
            for run in &mut runs {
                run.floor = floors.as_ref().and_then(|f| f.mix(&run.report.compression));
            }
            median_row(args.link, size, rate, mode, variant, &runs)
        })
        .collect();
    bar.finish_and_clear();
    let delay = link.as_ref().map_or(0.0, Link::delay_ms_each_way);
    drop(link);
    mark_best(&mut qemu_rows);
    let mut out = output(&args, rows, qemu_rows, qemu_note, load_before);
    out.floors = floors.map(|f| f.0).unwrap_or_default();
    out.link_measured_mib_per_s = link_measured_mib_per_s;
    out.link_delay_ms_each_way = delay;
    if args.json {
        crate::envelope::print(&out)?;
    } else {
        print_table(&out);
    }
    Ok(())
}

/// The progress bar of `total` runs (hidden when the output is JSON).
fn progress_bar(json: bool, total: usize) -> ProgressBar {
    let bar = if json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(total as u64)
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {elapsed_precise} {msg}")
            .expect("valid template"),
    );
    bar
}

/// QEMU's rows of one size and rate: `--repeat` pre-copies of each of `configs`, on the image
/// laid out for QEMU (once per call).
fn qemu_rows_of(
    args: &Args,
    link: Option<&Link>,
    size: u64,
    rate: Rate,
    configs: &[(qemu_peer::Channel, Option<qemu_peer::Multifd>)],
    bar: &ProgressBar,
) -> crate::Result<Vec<QemuRow>> {
    let qemu_image = match &args.image {
        Some(image) => Some(qemu_peer::QemuImage::prepare(
            image,
            size,
            &qemu_image_dir(),
        )?),
        None => None,
    };
    let mut rows = Vec::new();
    for &(channel, multifd) in configs {
        let config = qemu_peer::Config {
            mem: size,
            dirty_pages_per_s: rate.mib_per_s().map(|m| m * 256),
            downtime_limit_ms: args.downtime_ms,
            vcpus: args.vcpus,
            channel,
            multifd,
            image: qemu_image.as_ref(),
            rewrite: args.rewrite,
            link,
        };
        let mut runs = Vec::new();
        for i in 0..args.repeat {
            bar.set_message(format!(
                "{} MiB, {}, QEMU pre-copy ({}): run {}",
                size >> 20,
                rate.label(),
                config.name(),
                i + 1
            ));
            let steal = Steal::start();
            let figures = qemu_precopy(&config)?;
            runs.push((figures, steal.percent()));
            bar.inc(1);
        }
        rows.push(qemu_row(args.link, size, rate, &config, &runs));
    }
    Ok(rows)
}

/// Refuses arguments no run can be made of.
fn check_args(args: &Args) -> crate::Result<()> {
    if args.sizes.is_empty() || args.rates.is_empty() || args.modes.is_empty() {
        return Err("--sizes, --rates and --modes each need at least one value".into());
    }
    if args.repeat == 0 {
        return Err("--repeat: at least 1 run is needed".into());
    }
    if args.vcpus == 0 || args.vcpus > layout::MAX_VCPUS {
        return Err(format!("--vcpus: 1 to {} are supported", layout::MAX_VCPUS).into());
    }
    if args.connections == 0 || args.connections > 64 {
        return Err("--connections must be 1 to 64".into());
    }
    if let Some(cpus) = &args.fault_cpus.0 {
        CpuSet::new(cpus).map_err(|e| format!("--fault-cpus: {e}"))?;
    }
    if let Some(&s) = args
        .sizes
        .iter()
        .find(|&&s| s < (64 << 20) || !s.is_multiple_of(2 << 20))
    {
        return Err(format!("--sizes: {s} is not a multiple of 2 MiB of at least 64 MiB").into());
    }
    Ok(())
}

/// Whether QEMU peer rows are run (pre-copy is asked for, `--no-qemu` is not, and QEMU is
/// there), and why not when they are not; refuses QEMU options that name nothing.
fn qemu_peer_rows(args: &Args) -> crate::Result<(bool, Option<String>)> {
    let modes = &args.modes;
    let run_qemu = !args.no_qemu && modes.contains(&Mode::Precopy);
    let mut qemu_note = None;
    let qemu_ok = run_qemu && {
        match qemu_available() {
            Ok(()) => true,
            Err(why) => {
                eprintln!("guestmem: no QEMU peer rows: {why}");
                qemu_note = Some(why);
                false
            }
        }
    };
    if args.no_qemu {
        qemu_note = Some("--no-qemu".into());
    }
    if qemu_ok && args.qemu_channels.is_empty() {
        return Err("--qemu-channels: name at least one of tls, plain (or pass --no-qemu)".into());
    }
    if qemu_ok && args.qemu_compress.is_empty() {
        return Err(
            "--qemu-compress: name at least one of none, zlib, zstd (or pass --no-qemu)".into(),
        );
    }
    Ok((qemu_ok, qemu_note))
}

/// What one TCP connection moves over the shaped link, MiB/s (none on loopback).
fn measure_link(args: &Args, link: Option<&Link>) -> crate::Result<Option<f64>> {
    Ok(match link {
        Some(l) => {
            let rate = l.measure(Duration::from_millis(1500))? / f64::from(1 << 20);
            if !args.json {
                eprintln!(
                    "{} link: one TCP connection moves {rate:.0} MiB/s",
                    args.link.name()
                );
            }
            Some(rate)
        }
        None => None,
    })
}

/// QEMU's configurations: each channel with each multifd compression.
fn qemu_configs(args: &Args) -> Vec<(qemu_peer::Channel, Option<qemu_peer::Multifd>)> {
    args.qemu_channels
        .iter()
        .flat_map(|&channel| {
            args.qemu_compress.iter().map(move |&compression| {
                (
                    channel,
                    Some(qemu_peer::Multifd {
                        channels: args.connections,
                        compression,
                    }),
                )
            })
        })
        .collect()
}

/// The zstd windows of compression `c`: they make rows only with zstd (and auto).
fn zstd_windows(args: &Args, c: Compress) -> Vec<u64> {
    match c {
        Compress::Zstd | Compress::Auto => args.zstd_window_bytes.clone(),
        _ => args.zstd_window_bytes.iter().take(1).copied().collect(),
    }
}

/// One row's case and variant, with its runs.
type RowRuns = (u64, Rate, Mode, (Compress, DeltaCacheArg, u64), Vec<Run>);

/// The variants guestmem runs each size, rate and mode with: each compression, zstd window
/// (several for zstd and auto only) and delta cache.
fn variants(args: &Args) -> Vec<(Compress, DeltaCacheArg, u64)> {
    let mut variants = Vec::new();
    for &c in &args.compress {
        for w in zstd_windows(args, c) {
            for &d in &args.delta_cache_mib {
                variants.push((c, d, w));
            }
        }
    }
    variants
}

/// guestmem's runs of one size, rate and mode: `--repeat` runs of each compression, zstd
/// window and delta cache.
fn guestmem_rows(
    args: &Args,
    link: Option<&Link>,
    size: u64,
    rate: Rate,
    mode: Mode,
    bar: &ProgressBar,
) -> crate::Result<Vec<RowRuns>> {
    let mut rows = Vec::new();
    for (compress, delta, window) in variants(args) {
        let mut runs = Vec::new();
        for i in 0..args.repeat {
            bar.set_message(format!(
                "{} MiB, {}, {mode}, compress {compress:?}, zstd window {} MiB, delta \
                 {delta:?}: run {}",
                size >> 20,
                rate.label(),
                window >> 20,
                i + 1
            ));
            runs.push(run_once(
                args,
                link,
                size,
                rate,
                mode,
                (compress, delta, window),
            )?);
            bar.inc(1);
        }
        rows.push((size, rate, mode, (compress, delta, window), runs));
    }
    Ok(rows)
}

/// QEMU's pre-copy of `config`, taken again (twice at most) when QEMU reports a total time of
/// 0.
fn qemu_precopy(config: &qemu_peer::Config) -> crate::Result<qemu_peer::QemuFigures> {
    let mut figures = qemu_peer::precopy(config)?;
    // QEMU 7.2 has said "completed" with a total time and downtime of 0 (one
    // run in about a hundred): no figure of a migration, so the run is taken
    // again (twice at most).
    for _ in 0..2 {
        if figures.total_ms > 0 {
            break;
        }
        tracing::warn!(
            config = config.name(),
            "QEMU reported a total time of 0: run again"
        );
        figures = qemu_peer::precopy(config)?;
    }
    if figures.total_ms == 0 {
        return Err(format!(
            "QEMU ({}) reported a total time of 0 three times in a row",
            config.name()
        )
        .into());
    }
    Ok(figures)
}

/// The CPU floor on the image, when there is one and `--floor-runs` asks for it.
fn measure_floors(args: &Args, bar: &ProgressBar) -> crate::Result<Option<Floors>> {
    Ok(match (&args.image, args.floor_runs) {
        (Some(image), n) if n > 0 => {
            bar.set_message("the CPU floor on the image");
            let image = crate::floor::read_image(image)?;
            let codecs = [
                crate::floor::FloorCodec::Zstd,
                crate::floor::FloorCodec::Lz4,
                crate::floor::FloorCodec::None,
            ];
            Some(Floors(crate::floor::measure(&image, &codecs, n)?))
        }
        _ => None,
    })
}

fn output(
    args: &Args,
    rows: Vec<Row>,
    qemu_rows: Vec<QemuRow>,
    qemu_note: Option<String>,
    load_before: Option<String>,
) -> Output {
    let comparisons = comparisons(args.link, &rows, &qemu_rows);
    let target = precopy_target(&rows, &comparisons);
    let p99 = max_of(rows.iter().filter_map(|r| r.fault_p99_us));
    // A zstd stream window is memory asked for (about its size per connection), not the
    // source's own bookkeeping: its rows are left out of the target.
    let extra = max_of(
        rows.iter()
            .filter(|r| r.zstd_window_bytes == 0)
            .map(|r| r.source_extra_percent),
    );
    Output {
        vcpus: args.vcpus,
        connections: args.connections,
        whole_pages: args.whole_pages,
        fault_cpus: args.fault_cpus.0.clone(),
        transport: transport_name(args.transport, args.link),
        repeat: args.repeat,
        link: args.link,
        link_measured_mib_per_s: None,
        link_delay_ms_each_way: 0.0,
        image: args.image.clone(),
        rewrite: args.rewrite,
        downtime_target_ms: args.downtime_ms,
        idle_pages_per_s: qemu_peer::IDLE_PAGES_PER_S,
        load_average_before: load_before,
        load_average_after: crate::envelope::load_average(),
        rows,
        qemu_rows,
        qemu_note,
        floors: Vec::new(),
        comparisons,
        target_4g_64mib_precopy: target,
        postcopy_fault_p99_us_max: p99,
        postcopy_fault_p99_target_met: p99.map(|p| p < 1000.0),
        source_extra_percent_max: extra,
        source_extra_target_met: extra.map(|e| e < 2.0),
        progress_records: crate::observe::records(args.progress),
    }
}

/// guestmem's pre-copy rows beside QEMU's best configuration of the same size and rate.
fn comparisons(link: link::Speed, rows: &[Row], qemu_rows: &[QemuRow]) -> Vec<Comparison> {
    rows.iter()
        .filter(|r| r.mode == Mode::Precopy)
        .filter_map(|r| {
            let q = qemu_rows.iter().find(|q| {
                q.best && q.memory_bytes == r.memory_bytes && q.dirty_mib_per_s == r.dirty_mib_per_s
            })?;
            let target = match link {
                link::Speed::OneGbit => 0.6,
                _ => 0.8,
            };
            let total = r.total_ms / q.total_ms.max(1e-3);
            Some(Comparison {
                link,
                memory_bytes: r.memory_bytes,
                dirty_mib_per_s: r.dirty_mib_per_s,
                guestmem_compress: r.compress,
                guestmem_zstd_window_bytes: r.zstd_window_bytes,
                qemu_best_config: q.config.clone(),
                guestmem_downtime_ms: r.downtime_ms,
                qemu_best_downtime_ms: q.downtime_ms,
                guestmem_total_ms: r.total_ms,
                qemu_best_total_ms: q.total_ms,
                downtime_vs_qemu_best_ratio: r.downtime_ms / q.downtime_ms.max(1e-3),
                total_vs_qemu_best_ratio: total,
                total_ratio_target: target,
                total_target_met: total <= target,
                downtime_target_met: r.downtime_ms <= 50.0,
                first_pass_wire_bytes_per_guest_byte: r.first_pass_wire_bytes_per_guest_byte,
                first_pass_target_met: r.first_pass_wire_bytes_per_guest_byte <= 0.3,
            })
        })
        .collect()
}

/// The 4 GiB, 64 MiB/s pre-copy target (None when that case was not run).
fn precopy_target(rows: &[Row], comparisons: &[Comparison]) -> Option<PrecopyTarget> {
    rows.iter()
        .find(|r| {
            r.mode == Mode::Precopy && r.memory_bytes == 4 << 30 && r.dirty_mib_per_s == Some(64)
        })
        .map(|r| PrecopyTarget {
            downtime_median_ms: r.downtime_ms,
            downtime_target_ms: 50.0,
            total_median_ms: r.total_ms,
            vs_qemu: comparisons
                .iter()
                .filter(|c| {
                    c.memory_bytes == r.memory_bytes
                        && c.dirty_mib_per_s == Some(64)
                        && c.guestmem_compress == r.compress
                        && c.guestmem_zstd_window_bytes == r.zstd_window_bytes
                })
                .map(|c| TargetComparison {
                    qemu_config: c.qemu_best_config.clone(),
                    qemu_downtime_median_ms: c.qemu_best_downtime_ms,
                    qemu_total_median_ms: c.qemu_best_total_ms,
                    downtime_vs_qemu_ratio: c.downtime_vs_qemu_best_ratio,
                    total_vs_qemu_ratio: c.total_vs_qemu_best_ratio,
                    met: r.downtime_ms <= 50.0
                        && c.downtime_vs_qemu_best_ratio < 1.0
                        && c.total_vs_qemu_best_ratio < 1.0,
                })
                .collect(),
        })
}

/// The highest of `values` (None when there is none).
fn max_of(values: impl Iterator<Item = f64>) -> Option<f64> {
    values.fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))))
}

/// How the pages travel, as the output names it.
fn transport_name(transport: Transport, link: link::Speed) -> String {
    match (transport, link) {
        (Transport::Tcp, link::Speed::Loopback) => "tcp:127.0.0.1".into(),
        (Transport::Tcp, _) => format!("tcp:{}", Link::ip(Side::Destination)),
        (Transport::Unix, _) => "unix".into(),
    }
}

/// Marks, per size and rate, the QEMU row with the lowest median total time as the best.
fn mark_best(rows: &mut [QemuRow]) {
    for i in 0..rows.len() {
        let best = rows
            .iter()
            .filter(|q| {
                q.memory_bytes == rows[i].memory_bytes
                    && q.dirty_mib_per_s == rows[i].dirty_mib_per_s
            })
            .all(|q| q.total_ms >= rows[i].total_ms);
        rows[i].best = best;
    }
    // Ties: only the first of them.
    for i in 0..rows.len() {
        if rows[i].best
            && rows[..i].iter().any(|q| {
                q.best
                    && q.memory_bytes == rows[i].memory_bytes
                    && q.dirty_mib_per_s == rows[i].dirty_mib_per_s
            })
        {
            rows[i].best = false;
        }
    }
}

/// Where the QEMU image file goes: memory (`/dev/shm`) where there is one, so that QEMU's
/// RAM reads do not wait on a disk.
fn qemu_image_dir() -> PathBuf {
    let shm = PathBuf::from("/dev/shm");
    if shm.is_dir() {
        shm
    } else {
        std::env::temp_dir()
    }
}

/// `qemu-system-x86_64 --version` (or `GUESTMEM_QEMU`'s) runs.
fn qemu_available() -> Result<(), String> {
    let qemu = std::env::var("GUESTMEM_QEMU").unwrap_or_else(|_| "qemu-system-x86_64".into());
    match std::process::Command::new(&qemu)
        .arg("--version")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
    {
        Ok(s) if s.success() => Ok(()),
        Ok(s) => Err(format!("{qemu} --version failed ({s})")),
        Err(e) => Err(format!(
            "{qemu} cannot run ({e}); install qemu-system-x86 or name it in GUESTMEM_QEMU"
        )),
    }
}

/// A directory removed (with what it holds) when dropped.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The `dirty` workload: a first pass at full speed, then `rate` over all vCPUs; or `rewrite`
/// at `rate` from the start.
fn work(size: u64, vcpus: usize, rate: Rate, rewrite: bool) -> Vec<VcpuWork> {
    let per_vcpu = (rate.pages_per_s() / vcpus as u64).max(1);
    VcpuWork::split(
        if rewrite {
            Workload::Rewrite {
                pages_per_s: Some(per_vcpu),
                passes: None,
            }
        } else {
            Workload::Dirty {
                pages_per_s: Some(per_vcpu),
                passes: None,
                fill_first: true,
            }
        },
        layout::RAM_GPA,
        size,
        vcpus,
        1,
    )
}

/// Pages the guest has written, all vCPUs (from their control blocks).
fn pages_done(memory: &GuestMemory, vcpus: usize) -> crate::Result<u64> {
    let mut sum = 0;
    for i in 0..vcpus {
        sum += memory.read_u64(layout::control_gpa(i) + CTL_PAGES_DONE)?;
    }
    Ok(sum)
}

/// What the destination thread saw.
struct Received {
    report: DestinationReport,
    /// Post-copy: pages the guest wrote from the resume until every page was resident, and
    /// that time.
    pages: u64,
    secs: f64,
}

/// The destination: receive, resume, let the guest run until every page is resident, stop.
fn destination(
    listener: Arc<Listener>,
    vcpus: usize,
    (fault_cpus, progress): (Option<Vec<usize>>, bool),
) -> crate::Result<Received> {
    let opts = ReceiveOptions {
        fault_cpus,
        events: crate::observe::sink(progress),
        ..Default::default()
    };
    let migrate::Incoming {
        mut vm,
        mut transfer,
    } = migrate::receive(listener, &opts)?;
    let memory = vm.memory().clone();
    let before = pages_done(&memory, vcpus)?;
    let postcopy = transfer.mode() != Mode::Precopy;
    let running = transfer.resume(&mut vm)?;
    let t = Instant::now();
    let report = transfer.finish();
    let secs = t.elapsed().as_secs_f64();
    let after = pages_done(&memory, vcpus)?;
    running.stop();
    let run = running.wait(Duration::from_secs(60));
    let report = report?;
    run?;
    Ok(Received {
        report,
        pages: if postcopy { after - before } else { 0 },
        secs: if postcopy { secs } else { 0.0 },
    })
}

static RUN_ID: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// One migration of a fresh `size`-byte VM dirtying at `rate`, in `mode`.
fn run_once(
    args: &Args,
    link: Option<&Link>,
    size: u64,
    rate: Rate,
    mode: Mode,
    (compress, delta, zstd_window_bytes): (Compress, DeltaCacheArg, u64),
) -> crate::Result<Run> {
    let n = RUN_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = TempDir(
        std::env::temp_dir().join(format!("guestmem-bench-migrate-{}-{n}", std::process::id())),
    );
    let _ = std::fs::remove_dir_all(&dir.0);
    generate_credentials(&dir.0)?;
    let (listener, to) = listen(args, link, &dir.0)?;
    let vcpus = args.vcpus;
    let fault_cpus = args.fault_cpus.0.clone();
    let progress = args.progress;
    let dest = std::thread::Builder::new()
        .name("bench-destination".into())
        .spawn(move || destination(listener, vcpus, (fault_cpus, progress)))?;

    let mut vm = Vm::new(&VmConfig::simple(vcpus, size, Backend::Anon))?;
    if let Some(image) = &args.image {
        let ram = vm
            .memory()
            .region("ram")
            .ok_or("the VM has no region 'ram'")?;
        guestmem_memory::load_image(ram, image)?;
    }
    let memory = vm.memory().clone();
    let running = vm.start(&work(size, vcpus, rate, args.rewrite))?;
    let (running, steady_pages_per_s) = steady_rate(args, running, &memory, vcpus)?;

    let opts = send_options(args, mode, (compress, delta, zstd_window_bytes));
    let creds = Credentials::load(&dir.0, Role::Source)?;
    let sampler = cpu::Sampler::start(vec![std::process::id()], 2, classify_thread);
    let connected = match link {
        // The connections' sockets live in the source's namespace.
        Some(l) => l.run_in(Side::Source, || {
            Ok(Links::connect(&to, &creds, mode, args.connections)?)
        }),
        None => Links::connect(&to, &creds, mode, args.connections).map_err(Into::into),
    };
    let links = match connected {
        Ok(l) => l,
        Err(e) => {
            running.stop();
            let _ = running.wait(Duration::from_secs(10));
            return Err(format!(
                "cannot reach the destination: {}",
                guestmem_migration::error_chain(&*e, ": ")
            )
            .into());
        }
    };
    let start_pages = pages_done(&memory, vcpus)?;
    let steal = Steal::start();
    let report = match migrate::send(running, links, &opts) {
        Ok(r) => r,
        Err(failure) => {
            if let Some(running) = failure.vm {
                running.stop();
                let _ = running.wait(Duration::from_secs(10));
            }
            return Err(format!(
                "{mode} migration failed: {}",
                guestmem_migration::error_chain(&failure.error, ": ")
            )
            .into());
        }
    };
    // The source is paused: its control blocks hold the counts at switch-over.
    let source_pages = pages_done(&memory, vcpus)? - start_pages;
    let switch_secs = report.rounds.last().map_or(report.total_ms, |r| r.start_ms) / 1e3;
    let received = dest
        .join()
        .map_err(|_| "the destination thread panicked")??;
    let steal_percent = steal.percent();
    let cpu_s = sampler.stop();
    drop(vm);
    let mut report = report;
    if report.destination.is_none() {
        report.destination = Some(received.report.clone());
    }
    let during_pages_per_s =
        (source_pages + received.pages) as f64 / (switch_secs + received.secs).max(1e-6);
    Ok(Run {
        report,
        steady_pages_per_s,
        during_pages_per_s,
        steal_percent,
        source_cpu_s: cpu_s[0],
        destination_cpu_s: cpu_s[1],
        floor: None,
    })
}

/// The destination's listener (its socket in the destination's namespace, over a link) and the
/// endpoint the source connects to.
fn listen(
    args: &Args,
    link: Option<&Link>,
    dir: &std::path::Path,
) -> crate::Result<(Arc<Listener>, Endpoint)> {
    let host = match link {
        Some(_) => Link::ip(Side::Destination),
        None => "127.0.0.1",
    };
    let bind = match (args.transport, link) {
        (Transport::Tcp, _) => Endpoint::Tcp(format!("{host}:0")),
        (Transport::Unix, None) => Endpoint::Unix(dir.join("migrate.sock")),
        (Transport::Unix, Some(_)) => {
            return Err(
                "--transport unix goes with --link loopback (a socket file crosses no \
                        link)"
                    .into(),
            )
        }
    };
    let dest_creds = Credentials::load(dir, Role::Destination)?;
    // The listener's socket (and so every connection it accepts) lives in the destination's
    // namespace.
    let listener = Arc::new(match link {
        Some(l) => l.run_in(Side::Destination, || {
            Ok(Listener::bind(&bind, &dest_creds)?)
        })?,
        None => Listener::bind(&bind, &dest_creds)?,
    });
    let to = match args.transport {
        Transport::Tcp => Endpoint::Tcp(format!(
            "{host}:{}",
            listener.port().ok_or("the TCP listener has no port")?
        )),
        Transport::Unix => bind,
    };
    Ok((listener, to))
}

/// Waits for `dirty`'s full first pass (not for `rewrite`, which runs at the rate from the
/// start), then measures the guest's steady rate, pages written per second. A guest that does
/// not fill its memory in time is stopped.
fn steady_rate<'a>(
    args: &Args,
    running: guestmem_vm::RunningVm<'a>,
    memory: &GuestMemory,
    vcpus: usize,
) -> crate::Result<(guestmem_vm::RunningVm<'a>, f64)> {
    let deadline = Instant::now() + FILL_TIMEOUT;
    // `dirty` fills the memory with a first pass at full speed; `rewrite` runs on the image
    // (or zeros) at the rate from the start.
    while !args.rewrite && running.progress().iter().any(|&(_, g)| g < 1) {
        if Instant::now() > deadline {
            running.stop();
            let _ = running.wait(Duration::from_secs(10));
            return Err("the guest did not fill its memory in 300 s".into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    // The fill is done; the throttle paces from its end. Let it settle, then measure.
    std::thread::sleep(Duration::from_millis(200));
    let p0 = pages_done(memory, vcpus)?;
    let t0 = Instant::now();
    std::thread::sleep(STEADY);
    let rate = (pages_done(memory, vcpus)? - p0) as f64 / t0.elapsed().as_secs_f64();
    Ok((running, rate))
}

/// The source's options for a run in `mode` with compression, delta cache and zstd window.
fn send_options(
    args: &Args,
    mode: Mode,
    (compress, delta, zstd_window_bytes): (Compress, DeltaCacheArg, u64),
) -> SendOptions {
    SendOptions {
        mode,
        downtime: Duration::from_millis(args.downtime_ms),
        verify: false,
        whole_pages: args.whole_pages,
        compress,
        delta_cache_bytes: delta.bytes(),
        zstd_window_bytes,
        fault_cpus: args.fault_cpus.0.clone(),
        events: crate::observe::sink(args.progress),
        ..Default::default()
    }
}

/// Whose a thread of this process is during a migration, by its name: 0 the source, 1 the
/// destination (its receiving threads and the bench's destination thread, whose unnamed
/// children inherit its name), None for vCPUs and the sampler.
fn classify_thread(_: usize, name: &str) -> Option<usize> {
    const DESTINATION: [&str; 5] = [
        "migrate-rx",
        "migrate-accept",
        "migrate-admit",
        "postcopy-keep",
        "bench-destinat",
    ];
    if name.starts_with("vcpu") || name == "cpu-sampler" {
        None
    } else if DESTINATION.iter().any(|d| name.starts_with(d)) {
        Some(1)
    } else {
        Some(0)
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn slowdown(steady: f64, during: f64) -> f64 {
    if steady <= 0.0 {
        return 0.0;
    }
    ((1.0 - during / steady) * 100.0).max(0.0)
}

/// The codec that compressed the most frames.
fn compression_chosen(compression: &CompressionReport) -> &'static str {
    [
        (compression.plain_frames, "none"),
        (compression.lz4_frames, "lz4"),
        (compression.zstd_frames, "zstd"),
    ]
    .iter()
    .max_by_key(|(n, _)| *n)
    .map_or("none", |(_, name)| name)
}

/// The median of a figure every run has; `None` when there are no runs or one lacks it.
fn median_if_all(figures: impl Iterator<Item = Option<f64>>) -> Option<f64> {
    let v: Option<Vec<f64>> = figures.collect();
    v.filter(|v| !v.is_empty()).map(median)
}

/// The median of a figure of the destinations' reports of the runs that have one; `None` for
/// pre-copy (the destination has no faults to report) or when no run has a report.
fn destination_median(
    runs: &[Run],
    mode: Mode,
    f: &dyn Fn(&DestinationReport) -> f64,
) -> Option<f64> {
    if mode == Mode::Precopy {
        return None;
    }
    let v: Vec<f64> = runs
        .iter()
        .filter_map(|r| r.report.destination.as_ref().map(f))
        .collect();
    (!v.is_empty()).then(|| median(v))
}

/// The per-run figures of a row that take more than a field of the report.
impl Run {
    /// GiB of pages the run sent (never 0: the figures per GiB divide by it).
    fn sent_gib(&self) -> f64 {
        (self.report.bytes as f64 / (1u64 << 30) as f64).max(1e-9)
    }

    /// What the destination's zstd streams held at their most (0 without its report).
    fn destination_zstd_stream_bytes(&self) -> f64 {
        self.report
            .destination
            .as_ref()
            .map_or(0.0, |d| d.zstd_stream_bytes as f64)
    }

    /// Wire bytes of the first round per byte of guest memory.
    fn first_pass_wire_bytes_per_guest_byte(&self) -> f64 {
        let first = self.report.rounds.first().map_or(0, |x| x.wire_bytes);
        first as f64 / self.report.guest_bytes.max(1) as f64
    }

    /// MiB the rounds after the first put on the wire.
    fn later_rounds_wire_mib(&self) -> f64 {
        let bytes: u64 = self
            .report
            .rounds
            .iter()
            .skip(1)
            .map(|x| x.wire_bytes)
            .sum();
        bytes as f64 / f64::from(1 << 20)
    }

    /// The first round's bandwidth.
    fn round1_mib_per_s(&self) -> f64 {
        self.report
            .rounds
            .first()
            .map_or(0.0, |x| x.bandwidth_mib_per_s)
    }
}

/// One row of the table: the medians of `runs` (a table: one field per column).
fn median_row(
    link: link::Speed,
    size: u64,
    rate: Rate,
    mode: Mode,
    (compress, delta, zstd_window_asked_bytes): (Compress, DeltaCacheArg, u64),
    runs: &[Run],
) -> Row {
    let m = |f: &dyn Fn(&Run) -> f64| median(runs.iter().map(f).collect());
    let opt = |f: &dyn Fn(&DestinationReport) -> f64| destination_median(runs, mode, f);
    let middle = median_run(runs.iter().map(|r| r.report.total_ms)).map(|i| &runs[i]);
    let steady = m(&|r| r.steady_pages_per_s);
    let during = m(&|r| r.during_pages_per_s);
    let extra = m(&|r| r.report.source_extra_bytes as f64);
    // A figure of the runs' floors: None unless every run has them.
    let floor = |f: &dyn Fn(&Run, EndFloors) -> f64| {
        median_if_all(runs.iter().map(|r| r.floor.map(|x| f(r, x))))
    };
    let gib = Run::sent_gib;
    let compression = runs
        .first()
        .map(|r| r.report.compression.clone())
        .unwrap_or_default();
    let compression_chosen = compression_chosen(&compression);
    Row {
        link,
        memory_bytes: size,
        dirty_mib_per_s: rate.mib_per_s(),
        mode,
        compress,
        delta_cache: delta,
        zstd_window_asked_bytes,
        zstd_window_bytes: runs.first().map_or(0, |r| r.report.zstd_window_bytes),
        zstd_stream_bytes_source: m(&|r| r.report.zstd_stream_bytes as f64),
        zstd_stream_bytes_destination: m(&Run::destination_zstd_stream_bytes),
        dest_kernel_tls_connections: runs
            .first()
            .and_then(|r| r.report.destination.as_ref())
            .map_or(0, |d| d.kernel_tls_connections),
        runs: runs.len(),
        total_ms: m(&|r| r.report.total_ms),
        downtime_ms: m(&|r| r.report.downtime_ms),
        total_ms_runs: runs.iter().map(|r| r.report.total_ms).collect(),
        downtime_ms_runs: runs.iter().map(|r| r.report.downtime_ms).collect(),
        sent_mib: m(&|r| r.report.bytes as f64 / f64::from(1 << 20)),
        wire_mib: m(&|r| r.report.wire_bytes as f64 / f64::from(1 << 20)),
        first_pass_wire_bytes_per_guest_byte: m(&Run::first_pass_wire_bytes_per_guest_byte),
        wire_bytes_per_guest_gib: m(&|r| {
            r.report.wire_bytes as f64 * (1u64 << 30) as f64 / size as f64
        }),
        compression,
        compression_chosen,
        source_cpu_s: m(&|r| r.source_cpu_s),
        destination_cpu_s: m(&|r| r.destination_cpu_s),
        source_cpu_s_per_gib: m(&|r| r.source_cpu_s / gib(r)),
        dest_cpu_s_per_gib: m(&|r| r.destination_cpu_s / gib(r)),
        dest_floor_cpu_s_per_gib: floor(&|_, f| f.dest),
        source_floor_cpu_s_per_gib: floor(&|_, f| f.source),
        dest_cpu_to_floor: floor(&|r, f| r.destination_cpu_s / gib(r) / f.dest),
        source_cpu_to_floor: floor(&|r, f| r.source_cpu_s / gib(r) / f.source),
        dest_tls_receive_cpu_s_per_gib: floor(&|_, f| f.tls_receive),
        dest_cpu_to_floor_and_tls_receive: floor(&|r, f| {
            r.destination_cpu_s / gib(r) / (f.dest + f.tls_receive)
        }),
        later_rounds_wire_mib: m(&Run::later_rounds_wire_mib),
        delta_cache_bytes: runs.first().map_or(0, |r| r.report.delta.cache_bytes),
        delta_hit_rate: m(&|r| r.report.delta.hit_rate()),
        delta_saved_mib: m(&|r| r.report.delta.bytes_saved() as f64 / f64::from(1 << 20)),
        delta: runs
            .first()
            .map(|r| r.report.delta.clone())
            .unwrap_or_default(),
        rounds: m(&|r| r.report.rounds.len() as f64),
        converged_runs: runs.iter().filter(|r| r.report.converged).count(),
        max_throttle_percent: m(&|r| r.report.max_throttle_percent as f64),
        round1_mib_per_s: m(&Run::round1_mib_per_s),
        fault_p50_us: opt(&|d| d.fault_latency_p50_us),
        fault_p99_us: opt(&|d| d.fault_latency_p99_us),
        faults: opt(&|d| d.faults as f64),
        postcopy_resident_ms: opt(&|d| d.resident_ms),
        source_extra_bytes: extra,
        source_extra_percent: extra * 100.0 / size as f64,
        guest_steady_pages_per_s: steady,
        guest_during_pages_per_s: during,
        slowdown_percent: median(
            runs.iter()
                .map(|r| slowdown(r.steady_pages_per_s, r.during_pages_per_s))
                .collect(),
        ),
        host_steal_percent: runs
            .iter()
            .all(|r| r.steal_percent.is_some())
            .then(|| m(&|r| r.steal_percent.unwrap_or_default())),
        host_steal_percent_runs: runs.iter().filter_map(|r| r.steal_percent).collect(),
        fault_latency_buckets_us: mode
            .ne(&Mode::Precopy)
            .then(|| middle.and_then(|r| r.report.destination.as_ref()))
            .flatten()
            .map(|d| d.fault_latency_buckets_us.clone()),
        timeline: middle.map(|r| r.report.rounds.clone()).unwrap_or_default(),
    }
}

/// The index of the run whose total time is the median (of an even count, the lower middle).
fn median_run(totals: impl Iterator<Item = f64>) -> Option<usize> {
    let mut order: Vec<(usize, f64)> = totals.enumerate().collect();
    order.sort_by(|a, b| a.1.total_cmp(&b.1));
    order
        .get(order.len().saturating_sub(1) / 2)
        .map(|&(i, _)| i)
}

fn qemu_row(
    link: link::Speed,
    size: u64,
    rate: Rate,
    config: &qemu_peer::Config,
    runs: &[(qemu_peer::QemuFigures, Option<f64>)],
) -> QemuRow {
    let m =
        |f: &dyn Fn(&qemu_peer::QemuFigures) -> f64| median(runs.iter().map(|r| f(&r.0)).collect());
    let configured = rate.pages_per_s();
    let during = m(&|q| q.guest_pages_per_s_during);
    let first_pass: Vec<f64> = runs
        .iter()
        .filter_map(|r| r.0.first_pass_bytes)
        .map(|b| b as f64 / size as f64)
        .collect();
    QemuRow {
        link,
        memory_bytes: size,
        dirty_mib_per_s: rate.mib_per_s(),
        mode: Mode::Precopy,
        config: config.name(),
        best: false,
        multifd: config.multifd,
        channel: config.channel,
        qemu_version: runs
            .first()
            .map(|q| q.0.qemu_version.clone())
            .unwrap_or_default(),
        runs: runs.len(),
        total_ms: m(&|q| q.total_ms as f64),
        downtime_ms: m(&|q| q.downtime_ms as f64),
        total_ms_runs: runs.iter().map(|q| q.0.total_ms as f64).collect(),
        downtime_ms_runs: runs.iter().map(|q| q.0.downtime_ms as f64).collect(),
        sent_mib: m(&|q| q.bytes as f64 / f64::from(1 << 20)),
        wire_bytes_per_guest_gib: m(&|q| q.bytes as f64 * (1u64 << 30) as f64 / size as f64),
        first_pass_wire_bytes_per_guest_byte: (!first_pass.is_empty()).then(|| median(first_pass)),
        zero_pages: m(&|q| q.zero_pages as f64),
        image_words_matched: runs.first().and_then(|q| q.0.image_words_matched),
        source_cpu_s: m(&|q| q.source_cpu_s),
        destination_cpu_s: m(&|q| q.destination_cpu_s),
        dirty_syncs: m(&|q| q.dirty_sync_count as f64),
        boot_ms: m(&|q| q.boot_ms),
        guest_configured_pages_per_s: configured,
        guest_during_pages_per_s: during,
        slowdown_percent: median(
            runs.iter()
                .map(|q| slowdown(configured as f64, q.0.guest_pages_per_s_during))
                .collect(),
        ),
        host_steal_percent: runs
            .iter()
            .all(|r| r.1.is_some())
            .then(|| median(runs.iter().map(|r| r.1.unwrap_or_default()).collect())),
        timeline: median_run(runs.iter().map(|r| r.0.total_ms as f64))
            .map(|i| runs[i].0.timeline.clone())
            .unwrap_or_default(),
    }
}

fn print_table(out: &Output) {
    print_heading(out);
    print_rows(out);
    print_cpu_per_gib(out);
    print_targets(out);
}

/// What the table is of: the link, transport, guest, workload, runs and load.
fn print_heading(out: &Output) {
    let link = match (out.link, out.link_measured_mib_per_s) {
        (link::Speed::Loopback, _) => "loopback (127.0.0.1)".to_string(),
        (l, rate) => format!(
            "{} veth pair between two namespaces, tc-shaped ({} MiB/s measured over one TCP \
             connection, {} ms delay each way)",
            l.name(),
            rate.map_or("?".into(), |r| format!("{r:.0}")),
            out.link_delay_ms_each_way
        ),
    };
    println!(
        "live migration over {link} ({}, {} pages connection(s), TLS, {}, post-copy fault path \
         {}), {}-vCPU anon guest {} (idle: {} pages/s), downtime target {} ms, median of {} \
         run(s); load average {} before, {} after; steal: the host's CPUs taken by the \
         hypervisor under it during the migration; CPU s: the source's and destination's \
         migration threads (vCPUs left out); QEMU rows: multifd configurations, * the best",
        out.transport,
        out.connections,
        if out.whole_pages {
            "pages sent whole"
        } else {
            "non-zero lines of pages"
        },
        FaultCpus(out.fault_cpus.clone()).label(),
        out.vcpus,
        match (&out.image, out.rewrite) {
            (Some(i), true) => format!("started from {}, rewriting lines of pages", i.display()),
            (Some(i), false) => format!("started from {}, dirtying", i.display()),
            (None, true) => "rewriting lines of pages".into(),
            (None, false) => "dirtying after a full first pass".into(),
        },
        out.idle_pages_per_s,
        out.downtime_target_ms,
        out.repeat,
        out.load_average_before.as_deref().unwrap_or("?"),
        out.load_average_after.as_deref().unwrap_or("?"),
    );
}

/// The table: guestmem's rows, each size and rate's QEMU rows after them (a table: one line per
/// row, one argument per column).
fn print_rows(out: &Output) {
    println!(
        "{:>8} {:>9} {:>26} {:>9} {:>9} {:>8} {:>9} {:>7} {:>6} {:>11} {:>6} {:>11} {:>15} {:>9} {:>8} {:>6}",
        "memory",
        "rate",
        "row",
        "total ms",
        "downtime",
        "wire MiB",
        "MiB/GiB",
        "1st/mem",
        "rounds",
        "CPU s s/d",
        "codec",
        "delta cache",
        "fault p50/p99µs",
        "src extra",
        "slowdown",
        "steal"
    );
    let mut printed_qemu = vec![false; out.qemu_rows.len()];
    for (i, r) in out.rows.iter().enumerate() {
        println!(
            "{:>8} {:>9} {:>26} {:>9.1} {:>9.1} {:>8.1} {:>9.0} {:>7.2} {:>6.0} {:>11} {:>6} {:>11} {:>15} {:>9} {:>7.1}% {:>6}",
            format!("{} MiB", r.memory_bytes >> 20),
            rate_label(r.dirty_mib_per_s),
            format!("guestmem {} {:?}", r.mode.name(), r.compress) + if r.delta_cache_bytes > 0 { " +d" } else { "" },
            r.total_ms,
            r.downtime_ms,
            r.wire_mib,
            r.wire_bytes_per_guest_gib / f64::from(1 << 20),
            r.first_pass_wire_bytes_per_guest_byte,
            r.rounds,
            format!("{:.1}/{:.1}", r.source_cpu_s, r.destination_cpu_s),
            r.compression_chosen,
            if r.delta_cache_bytes > 0 {
                format!("{}M {:.1}%", r.delta_cache_bytes >> 20, r.delta_hit_rate * 100.0)
            } else {
                "-".into()
            },
            match (r.fault_p50_us, r.fault_p99_us) {
                (Some(a), Some(b)) => format!("{a:.0}/{b:.0}"),
                _ => "-".into(),
            },
            format!("{:.2}%", r.source_extra_percent),
            r.slowdown_percent,
            steal_label(r.host_steal_percent)
        );
        // The QEMU rows after the last guestmem row of their size and rate.
        let next_differs = out.rows.get(i + 1).is_none_or(|n| {
            n.memory_bytes != r.memory_bytes || n.dirty_mib_per_s != r.dirty_mib_per_s
        });
        if next_differs {
            for (j, q) in out.qemu_rows.iter().enumerate() {
                if q.memory_bytes == r.memory_bytes && q.dirty_mib_per_s == r.dirty_mib_per_s {
                    print_qemu_row(q);
                    printed_qemu[j] = true;
                }
            }
        }
    }
    for (j, q) in out.qemu_rows.iter().enumerate() {
        if !printed_qemu[j] {
            print_qemu_row(q);
        }
    }
}

/// A dirty rate's label.
fn rate_label(m: Option<u64>) -> String {
    m.map_or("idle".to_string(), |m| format!("{m} MiB/s"))
}

/// A steal percentage's label.
fn steal_label(s: Option<f64>) -> String {
    s.map_or("-".into(), |s| format!("{s:.1}%"))
}

/// One QEMU row of the table.
fn print_qemu_row(q: &QemuRow) {
    println!(
        "{:>8} {:>9} {:>26} {:>9.0} {:>9.0} {:>8.0} {:>9.0} {:>7} {:>6.0} {:>11} {:>6} {:>11} {:>15} {:>9} {:>7.1}% {:>6}",
        format!("{} MiB", q.memory_bytes >> 20),
        rate_label(q.dirty_mib_per_s),
        format!("QEMU {}{}", q.config, if q.best { " *" } else { "" }),
        q.total_ms,
        q.downtime_ms,
        q.sent_mib,
        q.wire_bytes_per_guest_gib / f64::from(1 << 20),
        q.first_pass_wire_bytes_per_guest_byte
            .map_or("-".into(), |f| format!("{f:.2}")),
        q.dirty_syncs,
        format!("{:.1}/{:.1}", q.source_cpu_s, q.destination_cpu_s),
        q.multifd.map_or("none", |m| m.compression.name()),
        "-",
        "-",
        "-",
        q.slowdown_percent,
        steal_label(q.host_steal_percent)
    );
}

/// Why there are no QEMU rows, then each row's CPU per GiB of pages sent, beside the floor.
fn print_cpu_per_gib(out: &Output) {
    if let Some(note) = &out.qemu_note {
        println!("no QEMU rows: {note}");
    }
    for r in &out.rows {
        let floor = |f: Option<f64>, ratio: Option<f64>| match (f, ratio) {
            (Some(f), Some(x)) => format!(" (floor {f:.2}, {x:.2}x)"),
            _ => String::new(),
        };
        let tls = match (
            r.dest_tls_receive_cpu_s_per_gib,
            r.dest_cpu_to_floor_and_tls_receive,
        ) {
            (Some(t), Some(x)) => format!(" (with the TLS receive's {t:.2}: {x:.2}x)"),
            _ => String::new(),
        };
        println!(
            "{} MiB, {}, {} {:?}: CPU-s per GiB of pages sent: destination {:.2}{}{}, source \
             {:.2}{}",
            r.memory_bytes >> 20,
            rate_label(r.dirty_mib_per_s),
            r.mode.name(),
            r.compress,
            r.dest_cpu_s_per_gib,
            floor(r.dest_floor_cpu_s_per_gib, r.dest_cpu_to_floor),
            tls,
            r.source_cpu_s_per_gib,
            floor(r.source_floor_cpu_s_per_gib, r.source_cpu_to_floor),
        );
    }
}

/// The comparisons with QEMU and the targets, met or missed.
fn print_targets(out: &Output) {
    let met = |m: bool| if m { "met" } else { "MISSED" };
    for c in &out.comparisons {
        println!(
            "{} MiB, {}, {}: pre-copy {:?} vs QEMU's best ({}): total_vs_qemu_best_ratio {:.2} \
             (target <= {}: {}), downtime_vs_qemu_best_ratio {:.2}, downtime {:.1} ms (target \
             <= 50: {}), first pass {:.2} of memory on the wire (target <= 0.3: {})",
            c.memory_bytes >> 20,
            rate_label(c.dirty_mib_per_s),
            c.link.name(),
            c.guestmem_compress,
            c.qemu_best_config,
            c.total_vs_qemu_best_ratio,
            c.total_ratio_target,
            met(c.total_target_met),
            c.downtime_vs_qemu_best_ratio,
            c.guestmem_downtime_ms,
            met(c.downtime_target_met),
            c.first_pass_wire_bytes_per_guest_byte,
            met(c.first_pass_target_met)
        );
    }
    if let Some(t) = &out.target_4g_64mib_precopy {
        let downtime = format!(
            "target, 4 GiB at 64 MiB/s pre-copy: median downtime {:.1} ms (target <= 50)",
            t.downtime_median_ms
        );
        if t.vs_qemu.is_empty() {
            println!("{downtime}; no QEMU row to compare");
        }
        for c in &t.vs_qemu {
            println!(
                "{downtime}, vs QEMU's best ({}): downtime_vs_qemu_ratio {:.2}, \
                 total_vs_qemu_ratio {:.2} (targets < 1): {}",
                c.qemu_config,
                c.downtime_vs_qemu_ratio,
                c.total_vs_qemu_ratio,
                if c.met { "met" } else { "MISSED" }
            );
        }
    }
    if let Some(p) = out.postcopy_fault_p99_us_max {
        println!(
            "target, post-copy p99 fault latency < 1000 µs: worst row {p:.0} µs: {}",
            if p < 1000.0 { "met" } else { "MISSED" }
        );
    }
    if let Some(e) = out.source_extra_percent_max {
        println!(
            "target, source extra memory < 2% of guest memory: worst row {e:.2}%: {}",
            if e < 2.0 { "met" } else { "MISSED" }
        );
    }
}

#[cfg(test)]
mod tests {
    fn error_of(argv: &[&str]) -> String {
        crate::refusal(argv, super::main)
    }

    #[test]
    fn only_zstd_and_auto_run_each_zstd_window() {
        let args: super::Args = crate::parse(&[
            "--compress",
            "none,zstd",
            "--zstd-window-mib",
            "0,8",
            "--delta-cache-mib",
            "0,64",
        ])
        .expect("the arguments parse");
        let variants = super::variants(&args);
        // none: the first window only; zstd: both; each with both delta caches.
        assert_eq!(variants.len(), (1 + 2) * 2);
        let none = variants.iter().filter(|v| v.0 == super::Compress::None);
        assert!(none.clone().all(|v| v.2 == 0));
        assert_eq!(none.count(), 2);
        assert!(variants
            .iter()
            .any(|v| v.0 == super::Compress::Zstd && v.2 == 8 << 20));
    }

    #[test]
    fn the_median_run_is_the_middle_total() {
        assert_eq!(super::median_run([5.0, 1.0, 3.0].into_iter()), Some(2));
        assert_eq!(super::median_run([4.0, 2.0].into_iter()), Some(1));
        assert_eq!(super::median_run(std::iter::empty()), None);
    }

    #[test]
    fn the_highest_of_no_figures_is_none() {
        assert_eq!(super::max_of([2.0, 7.5, 1.0].into_iter()), Some(7.5));
        assert_eq!(super::max_of(std::iter::empty()), None);
    }

    #[test]
    fn the_transport_names_the_destination_address() {
        use super::{link::Speed, transport_name, Transport};
        assert_eq!(
            transport_name(Transport::Tcp, Speed::Loopback),
            "tcp:127.0.0.1"
        );
        assert_eq!(transport_name(Transport::Unix, Speed::OneGbit), "unix");
        assert!(transport_name(Transport::Tcp, Speed::OneGbit).starts_with("tcp:"));
    }

    #[test]
    fn a_floor_figure_needs_every_run() {
        assert_eq!(
            super::median_if_all([Some(3.0), Some(1.0), Some(2.0)].into_iter()),
            Some(2.0)
        );
        assert_eq!(super::median_if_all([Some(3.0), None].into_iter()), None);
        assert_eq!(super::median_if_all(std::iter::empty()), None);
    }

    #[test]
    fn rates_parse() {
        assert_eq!(super::parse_rate("idle"), Ok(super::Rate::Idle));
        assert_eq!(super::parse_rate("64"), Ok(super::Rate::MibPerS(64)));
        assert!(super::parse_rate("fast").is_err());
    }

    #[test]
    fn bad_arguments_are_refused_before_any_work() {
        assert!(error_of(&["--vcpus", "0"]).contains("--vcpus"));
        assert!(error_of(&["--sizes", "3M"]).contains("2 MiB"));
        assert!(error_of(&["--repeat", "0"]).contains("--repeat"));
        assert!(error_of(&["--connections", "0"]).contains("--connections"));
        assert!(crate::parse::<super::Args>(&["--modes", "lazy"]).is_err());
        assert!(crate::parse::<super::Args>(&["--rates", "fast"]).is_err());
        assert!(crate::parse::<super::Args>(&["--fault-cpus", "third"]).is_err());
        assert!(error_of(&["--fault-cpus", "4096"]).contains("--fault-cpus: CPU 4096"));
    }

    #[test]
    fn fault_cpus_parse() {
        assert_eq!(super::parse_fault_cpus("none").unwrap().0, None);
        let first = super::parse_fault_cpus("first").unwrap().0.unwrap();
        assert_eq!(first.len(), 1);
        assert!(super::CpuSet::new(&first).is_ok(), "{first:?} is allowed");
        assert_eq!(super::parse_fault_cpus("0,1").unwrap().0, Some(vec![0, 1]));
        assert!(super::parse_fault_cpus("0,x")
            .unwrap_err()
            .contains("'x' is not a CPU number"));
    }
}
