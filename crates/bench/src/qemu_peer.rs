//! The QEMU peer of `guestmem bench migrate`: the same guest workload under QEMU, live-migrated
//! on loopback with QEMU's own pre-copy, and the figures QEMU reports.
//!
//! [`precopy`] bakes the workload into guestmem's PVH payload (`guestmem payload`), boots it in
//! a source QEMU (`-accel kvm -cpu host,-arch-capabilities -machine pc`), waits until the guest
//! has filled its range once at full speed and is dirtying it at the asked rate (or, with the
//! `rewrite` workload, until it runs), starts a destination QEMU listening on
//! `tcp:127.0.0.1:PORT` (or, over a shaped [`Link`], each QEMU in its own namespace and the
//! destination on the link's address), optionally with multifd (channels and
//! `multifd-compression`), migrates with `downtime-limit` set and the bandwidth
//! unthrottled, over plain TCP or over TLS with both peers verified (QEMU's `tls-creds-x509`
//! with certificates from guestmem's own `generate_credentials`: the channel guestmem always
//! uses), and polls `query-migrate` until it completes; then it checks that the guest
//! carries on in the destination (its pages-done counter grows there). Both QEMUs are killed on
//! every path. It speaks QMP (JSON lines over a Unix socket) and reads the guest's control
//! block with the monitor's `xp` (`human-monitor-command`).
//!
//! `-cpu host` alone does not start on AMD hosts under this KVM: QEMU sets
//! `IA32_ARCH_CAPABILITIES` (MSR 0x10a) there, which KVM refuses (QEMU then aborts in
//! `kvm_buf_set_msrs`); `-arch-capabilities` leaves that MSR out, and the guest, which does not
//! read it, is the same on Intel and AMD.
//!
//! With an image ([`QemuImage`]), the guest's RAM is a private mapping of a file holding the
//! image at the start of the workload's range (8 MiB; the payload area below it is zeros), so
//! the range holds the image's bytes as guestmem's guest RAM does from its start: QEMU does not
//! get to skip pages that guestmem sends. The guest's words at a few addresses are checked
//! against the image before migrating.
//!
//! Only vCPU 0 runs the workload under QEMU (the PVH entry starts the bootstrap processor; the
//! others stay parked in wait-for-SIPI): a multi-vCPU QEMU guest dirties at the same total
//! rate, from one vCPU. Booting costs 5-20 s here before the guest runs (SeaBIOS at CPL0 on
//! kvm_pvm), plus the fill (first touch of every page).

use guestmem_sys::to_usize;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use guestmem_vm::payload::{
    self, PvhParams, PvhWorkload, CTL_PAGES_DONE, CTL_RANGE_PAGES, CTL_STATE, MIN_RANGE_START,
    STATE_BAD_WORKLOAD, STATE_RUNNING, VCPU_BLOCKS_GPA,
};
use serde::Serialize;
use serde_json::{json, Value};

use crate::cpu;
use crate::link::{Link, Side};
use guestmem_migration::transport::{generate_credentials, Role};

/// The QEMU binary, unless `GUESTMEM_QEMU` names another.
const QEMU: &str = "qemu-system-x86_64";
/// The rate at which an "idle" guest (`dirty_pages_per_s: None`) still writes, after filling
/// its range, so that the destination can be seen to carry on: 16 pages (64 KiB) per second.
pub const IDLE_PAGES_PER_S: u64 = 16;
/// QEMU's `max-bandwidth` during the migration, bytes/s: far above loopback, i.e. unthrottled.
const MAX_BANDWIDTH: u64 = 100_000_000_000;

const BOOT_TIMEOUT: Duration = Duration::from_secs(180);
const MIGRATE_TIMEOUT: Duration = Duration::from_secs(900);
const POLL: Duration = Duration::from_millis(100);

/// The channel QEMU migrates over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Channel {
    /// Plain TCP (QEMU's default).
    Plain,
    /// TLS, both peers verified by a CA (QEMU's `tls-creds-x509`, `verify-peer=on`), like
    /// guestmem's channel.
    Tls,
}

impl Channel {
    /// Its name in configuration names.
    pub fn name(self) -> &'static str {
        match self {
            Channel::Plain => "plain",
            Channel::Tls => "tls",
        }
    }
}

/// QEMU's `multifd-compression`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum MultifdCompression {
    /// Uncompressed.
    None,
    /// zlib.
    Zlib,
    /// zstd.
    Zstd,
}

impl MultifdCompression {
    /// Its name, as `--qemu-compress` takes it.
    pub fn name(self) -> &'static str {
        match self {
            MultifdCompression::None => "none",
            MultifdCompression::Zlib => "zlib",
            MultifdCompression::Zstd => "zstd",
        }
    }
}

/// Multifd: pages over `channels` connections, compressed with `compression`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Multifd {
    /// Connections.
    pub channels: usize,
    /// Their compression.
    pub compression: MultifdCompression,
}

/// One QEMU migration to run.
#[derive(Debug)]
pub struct Config<'a> {
    /// Guest RAM without an image; with one, the workload's range (RAM is 8 MiB more).
    pub mem: u64,
    /// The guest's rate after its fill (or from the start with `rewrite`), pages per second
    /// (None: idle, [`IDLE_PAGES_PER_S`]).
    pub dirty_pages_per_s: Option<u64>,
    /// QEMU's `downtime-limit`, ms.
    pub downtime_limit_ms: u64,
    /// vCPUs.
    pub vcpus: usize,
    /// TLS or plain TCP.
    pub channel: Channel,
    /// None: QEMU's single migration stream.
    pub multifd: Option<Multifd>,
    /// Guest RAM starts from this image.
    pub image: Option<&'a QemuImage>,
    /// The `rewrite` workload (no fill first) instead of `dirty`.
    pub rewrite: bool,
    /// None: loopback.
    pub link: Option<&'a Link>,
}

impl Config<'_> {
    /// The configuration's name in tables and JSON, e.g. `multifd4-zstd-plain`.
    pub fn name(&self) -> String {
        config_name(self.multifd, self.channel)
    }
}

/// The name of a QEMU configuration, e.g. `multifd4-zstd-plain` or `single-tls`.
pub fn config_name(multifd: Option<Multifd>, channel: Channel) -> String {
    match multifd {
        Some(m) => format!(
            "multifd{}-{}-{}",
            m.channels,
            m.compression.name(),
            channel.name()
        ),
        None => format!("single-{}", channel.name()),
    }
}

/// What one pre-copy migration under QEMU took, as QEMU reports it (`query-migrate`), plus the
/// costs around it. Field names carry their units.
#[derive(Debug, Clone, Serialize)]
pub struct QemuFigures {
    /// `qemu-system-x86_64 --version`, first line.
    pub qemu_version: String,
    /// Guest RAM (`-m`), bytes.
    pub mem_bytes: u64,
    /// vCPUs.
    pub vcpus: usize,
    /// The guest's dirty rate after its fill, pages of 4 KiB per second (None: idle, i.e.
    /// [`IDLE_PAGES_PER_S`]).
    pub dirty_pages_per_s: Option<u64>,
    /// QEMU's `downtime-limit`, ms.
    pub downtime_limit_ms: u64,
    /// TLS or plain TCP.
    pub channel: Channel,
    /// [`config_name`].
    pub config: String,
    /// Multifd (None: a single migration stream).
    pub multifd: Option<Multifd>,
    /// The guest's words at sampled addresses that matched the image (of how many).
    pub image_words_matched: Option<(usize, usize)>,
    /// CPU time of the source's and the destination's QEMU during the migration, their vCPU
    /// threads left out.
    pub source_cpu_s: f64,
    /// The destination QEMU's CPU time, its vCPU threads left out.
    pub destination_cpu_s: f64,
    /// `ram.transferred` when the first pass ended (the first poll, every 100 ms, that saw a
    /// second dirty sync): approximate.
    pub first_pass_bytes: Option<u64>,
    /// Pages of the workload's range (guest RAM from 8 MiB, holes skipped).
    pub range_pages: u64,
    /// From starting the source QEMU to the guest workload running (firmware and PVH entry).
    pub boot_ms: f64,
    /// The guest's first pass over its range, at full speed (first touch of every page).
    pub fill_ms: f64,
    /// QEMU's `total-time`: from `migrate` to completion.
    pub total_ms: u64,
    /// QEMU's `downtime`: the guest stopped, last round and device state.
    pub downtime_ms: u64,
    /// QEMU's `setup-time`.
    pub setup_ms: u64,
    /// `ram.transferred`: bytes of RAM sent, zero pages as their headers.
    pub bytes: u64,
    /// `ram.total`: guest RAM as QEMU counts it.
    pub ram_total_bytes: u64,
    /// `ram.normal`: pages sent with their contents.
    pub normal_pages: u64,
    /// `ram.duplicate`: pages sent as zero pages.
    pub zero_pages: u64,
    /// `ram.dirty-sync-count`: dirty-bitmap synchronisations, i.e. pre-copy rounds.
    pub dirty_sync_count: u64,
    /// `ram.mbps` at completion.
    pub end_mbit_per_s: f64,
    /// Measured from the guest's counter while migrating: pages written per second.
    pub guest_pages_per_s_during: f64,
    /// Measured on the destination after migration: pages written per second.
    pub dest_pages_per_s: f64,
    /// The migration as the source's `query-migrate` told it at each poll (every 100 ms).
    pub timeline: Vec<Sample>,
}

/// One poll of the source's `query-migrate` during a migration: its timeline, beside
/// guestmem's rounds in `bench migrate`'s chart.
#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    /// From `migrate`, ms.
    pub ms: f64,
    /// `status`: active, device, completed, ...
    pub status: String,
    /// `ram.transferred`.
    pub transferred_bytes: u64,
    /// `ram.remaining`: what is dirty and not sent yet.
    pub remaining_bytes: u64,
    /// `ram.normal`: pages sent with their contents so far.
    pub normal_pages: u64,
    /// `ram.duplicate`: pages sent as zero pages so far.
    pub zero_pages: u64,
    /// `ram.dirty-sync-count`: the pass under way.
    pub dirty_syncs: u64,
    /// `ram.dirty-pages-rate`, pages per second (as of the last pass).
    pub dirty_pages_rate: u64,
    /// `cpu-throttle-percentage` (0 when QEMU throttles nothing).
    pub throttle_percent: u64,
}

impl Sample {
    fn of(info: &Value, ms: f64) -> Sample {
        let ram = &info["ram"];
        let u = |v: &Value| v.as_u64().unwrap_or(0);
        Sample {
            ms,
            status: info["status"].as_str().unwrap_or_default().to_string(),
            transferred_bytes: u(&ram["transferred"]),
            remaining_bytes: u(&ram["remaining"]),
            normal_pages: u(&ram["normal"]),
            zero_pages: u(&ram["duplicate"]),
            dirty_syncs: u(&ram["dirty-sync-count"]),
            dirty_pages_rate: u(&ram["dirty-pages-rate"]),
            throttle_percent: u(&info["cpu-throttle-percentage"]),
        }
    }
}

/// Runs the workload under QEMU as `config` says (vCPU 0 runs it): a full-speed first pass
/// over all RAM from 8 MiB, then `dirty_pages_per_s` pages per second (None: idle), or the
/// `rewrite` workload at that rate from the start; migrates it with QEMU's pre-copy,
/// `downtime-limit`, bandwidth unthrottled, over the channel, link and multifd setting asked.
/// Returns QEMU's figures; errors name the step that failed, with QEMU's reason or its stderr.
pub fn precopy(config: &Config) -> crate::Result<QemuFigures> {
    let Config {
        mem,
        dirty_pages_per_s,
        downtime_limit_ms,
        vcpus,
        channel,
        multifd,
        image,
        rewrite,
        link,
    } = *config;
    check_config(config)?;
    let qemu = std::env::var("GUESTMEM_QEMU").unwrap_or_else(|_| QEMU.to_string());
    let qemu_version = qemu_version(&qemu)?;
    let dir = TempDir::new()?;
    let elf = dir.path().join("payload.elf");
    let rate = dirty_pages_per_s.unwrap_or(IDLE_PAGES_PER_S);
    write_payload(&elf, rewrite, rate)?;
    let mem_mib = ram_bytes(image, mem)?.div_ceil(1 << 20);
    let common = common_args(mem_mib, vcpus, &elf);
    if channel == Channel::Tls {
        qemu_credentials(dir.path())?;
    }

    let booted = Instant::now();
    let SourceGuest {
        qemu: mut src,
        boot_ms,
        fill_ms,
        range_pages,
        image_words_matched,
    } = start_source(&qemu, config, &common, dir.path(), mem_mib)?;

    let incoming = incoming_uri(link, booted)?;
    let mut dst = start_destination(&qemu, config, &common, dir.path(), mem_mib)?;
    set_parameters(&mut src, &mut dst, config, &incoming)?;
    let before = src.control()?;
    let pids = vec![src.child.id(), dst.child.id()];
    // vCPU threads are "CPU n/KVM" (`debug-threads=on`).
    let sampler = cpu::Sampler::start(pids, 2, |i, name| (!name.starts_with("CPU ")).then_some(i));
    let started = Instant::now();
    src.qmp
        .execute("migrate", Some(json!({ "uri": incoming })))?;
    let (info, first_pass_bytes, timeline) = wait_completed(&mut src, started, downtime_limit_ms)?;
    let migrate_s = started.elapsed().as_secs_f64();
    let cpu_s = sampler.stop();
    let figures = MigrateInfo::parse(&info)?;

    // The destination runs the guest on (QEMU starts it after an incoming migration).
    let after = dst.control()?;
    let guest_pages_per_s_during =
        after.pages_done.saturating_sub(before.pages_done) as f64 / migrate_s.max(1e-9);
    let dest_pages_per_s = destination_rate(&mut dst, &after, rate)?;
    drop(dst);
    drop(src);

    Ok(QemuFigures {
        qemu_version,
        mem_bytes: mem_mib << 20,
        vcpus,
        dirty_pages_per_s,
        downtime_limit_ms,
        channel,
        config: config.name(),
        multifd,
        image_words_matched,
        source_cpu_s: cpu_s[0],
        destination_cpu_s: cpu_s[1],
        first_pass_bytes,
        timeline,
        range_pages,
        boot_ms,
        fill_ms,
        total_ms: figures.total_ms,
        downtime_ms: figures.downtime_ms,
        setup_ms: figures.setup_ms,
        bytes: figures.bytes,
        ram_total_bytes: figures.ram_total_bytes,
        normal_pages: figures.normal_pages,
        zero_pages: figures.zero_pages,
        dirty_sync_count: figures.dirty_sync_count,
        end_mbit_per_s: figures.mbit_per_s,
        guest_pages_per_s_during,
        dest_pages_per_s,
    })
}

/// Starts the destination QEMU of `config` (`binary`, with `common` arguments and its files
/// in `dir`), waiting for an incoming migration (`-incoming defer`).
fn start_destination(
    binary: &str,
    config: &Config,
    common: &[String],
    dir: &Path,
    mem_mib: u64,
) -> crate::Result<Qemu> {
    let mut args = vec!["-incoming".to_string(), "defer".to_string()];
    args.extend(machine_args(config.image, Side::Destination, mem_mib));
    args.extend(tls_args(config.channel, dir, "server"));
    Qemu::start(binary, config.link, Side::Destination, common, &args, dir)
}

/// The source QEMU of a pre-copy, its guest's workload running and its memory filled.
struct SourceGuest {
    qemu: Qemu,
    /// From the start of `qemu` until the workload ran.
    boot_ms: f64,
    /// The fill's first pass.
    fill_ms: f64,
    /// Pages the workload writes.
    range_pages: u64,
    /// With an image: its sampled words found in the guest's memory, of those sampled.
    image_words_matched: Option<(usize, usize)>,
}

/// Starts the source QEMU of `config` (`binary`, with `common` arguments and its files in
/// `dir`) and waits for its workload to run and fill its memory.
fn start_source(
    binary: &str,
    config: &Config,
    common: &[String],
    dir: &Path,
    mem_mib: u64,
) -> crate::Result<SourceGuest> {
    let booted = Instant::now();
    let mut args = machine_args(config.image, Side::Source, mem_mib);
    args.extend(tls_args(config.channel, dir, "client"));
    let mut src = Qemu::start(binary, config.link, Side::Source, common, &args, dir)?;
    src.wait_for(BOOT_TIMEOUT, "the guest workload to start", |c| {
        if c.state == STATE_BAD_WORKLOAD {
            return Err("the payload found no RAM above 8 MiB in QEMU's e820 map".into());
        }
        Ok(c.state == STATE_RUNNING)
    })?;
    let boot_ms = booted.elapsed().as_secs_f64() * 1e3;
    let image_words_matched = match config.image {
        Some(i) => Some(check_image(&mut src, i)?),
        None => None,
    };
    let range_pages = src.read(CTL_RANGE_PAGES, 1)?[0];
    let filled = Instant::now();
    wait_filled(&mut src, config.rewrite, range_pages)?;
    let fill_ms = filled.elapsed().as_secs_f64() * 1e3;
    tracing::info!(boot_ms, fill_ms, range_pages, "QEMU source guest running");
    Ok(SourceGuest {
        qemu: src,
        boot_ms,
        fill_ms,
        range_pages,
        image_words_matched,
    })
}

/// Refuses a configuration QEMU's guest cannot run.
fn check_config(config: &Config) -> crate::Result<()> {
    if config.vcpus == 0 {
        return Err("a QEMU guest needs at least one vCPU".into());
    }
    if config.mem < MIN_RANGE_START + (2 << 20) {
        return Err(format!(
            "{} bytes of guest RAM leave no room for the workload",
            config.mem
        )
        .into());
    }
    if config
        .multifd
        .is_some_and(|m| m.channels == 0 || m.channels > 255)
    {
        return Err("QEMU's multifd-channels must be 1 to 255".into());
    }
    Ok(())
}

/// Writes the PVH payload that runs the workload (`rewrite` or `dirty`) at `rate` to `elf`.
fn write_payload(elf: &Path, rewrite: bool, rate: u64) -> crate::Result<()> {
    let tsc_khz = guestmem_vm::host_tsc_khz().map_err(|e| {
        format!(
            "cannot ask KVM for the TSC rate: {}",
            guestmem_migration::error_chain(&e, ": ")
        )
    })?;
    let params = PvhParams::for_workload(
        if rewrite {
            PvhWorkload::Rewrite
        } else {
            PvhWorkload::Dirty
        },
        Some(rate),
        !rewrite,
        tsc_khz,
        MIN_RANGE_START,
        0,
        1,
    )?;
    payload::write_pvh_elf(elf, &params)?;
    Ok(())
}

/// The guest's RAM: with an image, the payload area plus the range, the image's size.
fn ram_bytes(image: Option<&QemuImage>, mem: u64) -> crate::Result<u64> {
    Ok(match image {
        Some(i) => {
            if i.range_bytes != mem {
                return Err(format!(
                    "the QEMU image file holds {} bytes of range, not {mem}",
                    i.range_bytes
                )
                .into());
            }
            MIN_RANGE_START + mem
        }
        None => mem,
    })
}

/// QEMU's arguments common to both sides.
fn common_args(mem_mib: u64, vcpus: usize, elf: &Path) -> Vec<String> {
    [
        "-accel",
        "kvm",
        "-cpu",
        "host,-arch-capabilities",
        "-m",
        &format!("{mem_mib}M"),
        "-smp",
        &vcpus.to_string(),
        "-kernel",
        &elf.to_string_lossy(),
        "-display",
        "none",
        "-nodefaults",
        "-serial",
        "none",
        "-monitor",
        "none",
    ]
    .iter()
    .map(std::string::ToString::to_string)
    .collect()
}

/// RAM: the image file mapped privately (the source), or anonymous memory under the same
/// name (the destination: migration matches RAM blocks by name).
fn machine_args(image: Option<&QemuImage>, side: Side, mem_mib: u64) -> Vec<String> {
    match (image, side) {
        (None, _) => vec!["-machine".into(), "pc".into()],
        (Some(i), Side::Source) => vec![
            "-object".into(),
            format!(
                "memory-backend-file,id=ram0,size={mem_mib}M,mem-path={},share=off,\
                 prealloc=on",
                i.path.display()
            ),
            "-machine".into(),
            "pc,memory-backend=ram0".into(),
        ],
        (Some(_), Side::Destination) => vec![
            "-object".into(),
            format!("memory-backend-ram,id=ram0,size={mem_mib}M"),
            "-machine".into(),
            "pc,memory-backend=ram0".into(),
        ],
    }
}

/// TLS: the credentials guestmem uses, laid out in `dir` as QEMU's x509 directories want them.
fn tls_args(channel: Channel, dir: &Path, endpoint: &str) -> Vec<String> {
    match channel {
        Channel::Plain => Vec::new(),
        Channel::Tls => vec![
            "-object".into(),
            format!(
                "tls-creds-x509,id=tls0,dir={},endpoint={endpoint},verify-peer=on",
                dir.join(endpoint).display()
            ),
        ],
    }
}

/// How many of the image's sampled words the source guest holds (of how many); most must.
fn check_image(src: &mut Qemu, i: &QemuImage) -> crate::Result<(usize, usize)> {
    let mut matched = 0;
    for &(gpa, word) in &i.samples {
        let text = src.qmp.hmp(&format!("xp /1gx {gpa:#x}"))?;
        if parse_xp(&text)?.first() == Some(&word) {
            matched += 1;
        }
    }
    // The workload may have rewritten a sampled line since it started; most must
    // still hold the image's words.
    if matched * 2 < i.samples.len() {
        return Err(format!(
            "the QEMU guest does not hold the image: {matched} of {} sampled words match",
            i.samples.len()
        )
        .into());
    }
    Ok((matched, i.samples.len()))
}

/// Waits for the `dirty` workload's first pass over its `range_pages`; `rewrite` has none.
fn wait_filled(src: &mut Qemu, rewrite: bool, range_pages: u64) -> crate::Result<()> {
    if rewrite {
        // No fill: the workload rewrites the image at the rate from the start; let it run.
        std::thread::sleep(Duration::from_secs(1));
    } else {
        let fill_timeout = Duration::from_secs(60) + Duration::from_millis(range_pages / 20);
        src.wait_for(fill_timeout, "the guest to fill its range", |c| {
            Ok(c.pages_done >= range_pages)
        })?;
    }
    Ok(())
}

/// Where the destination listens.
fn incoming_uri(link: Option<&Link>, booted: Instant) -> crate::Result<String> {
    Ok(match link {
        None => format!("tcp:127.0.0.1:{}", free_port()?),
        // A fresh namespace: any port is free; vary it so that no earlier run's lingering
        // connections can matter.
        Some(_) => format!(
            "tcp:{}:{}",
            Link::ip(Side::Destination),
            20000 + std::process::id() % 20000 + (booted.elapsed().subsec_micros() % 1000)
        ),
    })
}

/// Sets both sides' migration capabilities and parameters (multifd, TLS, downtime limit,
/// bandwidth) and has the destination listen at `incoming`.
fn set_parameters(
    src: &mut Qemu,
    dst: &mut Qemu,
    config: &Config,
    incoming: &str,
) -> crate::Result<()> {
    if let Some(m) = config.multifd {
        for q in [&mut src.qmp, &mut dst.qmp] {
            q.execute(
                "migrate-set-capabilities",
                Some(json!({ "capabilities": [{ "capability": "multifd", "state": true }] })),
            )?;
            q.execute(
                "migrate-set-parameters",
                Some(json!({
                    "multifd-channels": m.channels,
                    "multifd-compression": m.compression.name(),
                })),
            )?;
        }
    }
    let mut src_params =
        json!({ "downtime-limit": config.downtime_limit_ms, "max-bandwidth": MAX_BANDWIDTH });
    if config.channel == Channel::Tls {
        dst.qmp.execute(
            "migrate-set-parameters",
            Some(json!({ "tls-creds": "tls0" })),
        )?;
        src_params["tls-creds"] = json!("tls0");
        // The name in the destination's certificate.
        src_params["tls-hostname"] = json!(Role::Destination.name());
    }
    dst.qmp
        .execute("migrate-incoming", Some(json!({ "uri": incoming })))?;
    src.qmp
        .execute("migrate-set-parameters", Some(src_params))?;
    Ok(())
}

/// Polls the source until its migration completes: QEMU's last `query-migrate`, the bytes
/// sent by the end of the first pass, and every poll's figures.
fn wait_completed(
    src: &mut Qemu,
    started: Instant,
    downtime_limit_ms: u64,
) -> crate::Result<(Value, Option<u64>, Vec<Sample>)> {
    let mut first_pass_bytes = None;
    let mut timeline = Vec::new();
    loop {
        let info = src.qmp.execute("query-migrate", None)?;
        timeline.push(Sample::of(&info, started.elapsed().as_secs_f64() * 1e3));
        if first_pass_bytes.is_none() && info["ram"]["dirty-sync-count"].as_u64() >= Some(2) {
            first_pass_bytes = info["ram"]["transferred"].as_u64();
        }
        match info["status"].as_str() {
            Some("completed") => return Ok((info, first_pass_bytes, timeline)),
            Some("failed" | "cancelled") => {
                return Err(format!(
                    "QEMU's migration {}: {}",
                    info["status"].as_str().unwrap_or_default(),
                    info["error-desc"].as_str().unwrap_or("QEMU gave no reason")
                )
                .into())
            }
            _ => {}
        }
        if started.elapsed() > MIGRATE_TIMEOUT {
            let remaining = info["ram"]["remaining"].as_u64().unwrap_or(0);
            let _ = src.qmp.execute("migrate_cancel", None);
            return Err(format!(
                "QEMU's pre-copy did not complete in {} s ({} dirty syncs, {remaining} bytes \
                 remaining, downtime limit {downtime_limit_ms} ms)",
                MIGRATE_TIMEOUT.as_secs(),
                info["ram"]["dirty-sync-count"]
            )
            .into());
        }
        std::thread::sleep(POLL);
    }
}

/// The destination guest's rate (pages written per second) once it carries on after the
/// migration, from its control page `after` the migration.
fn destination_rate(dst: &mut Qemu, after: &Control, rate: u64) -> crate::Result<f64> {
    let t0 = Instant::now();
    let wait = Duration::from_secs_f64(3.0 + 4.0 / rate as f64);
    let carried_on = dst.wait_for(wait, "the guest to carry on in the destination", |c| {
        Ok(c.pages_done > after.pages_done)
    });
    let status = dst.qmp.execute("query-status", None)?;
    carried_on.map_err(|e| {
        format!(
            "after the migration, the destination guest makes no progress (QEMU status {}): {}",
            status["status"],
            guestmem_migration::error_chain(&*e, ": ")
        )
    })?;
    std::thread::sleep(Duration::from_secs(1));
    let last = dst.control()?;
    Ok(last.pages_done.saturating_sub(after.pages_done) as f64 / t0.elapsed().as_secs_f64())
}

/// A memory image laid out for QEMU's guest RAM: a file of the payload area (8 MiB of zeros)
/// and then the image, padded with zeros to the range's size; removed when dropped. Made once
/// and mapped privately by every source QEMU that runs from it (its writes stay its own).
#[derive(Debug)]
pub struct QemuImage {
    path: PathBuf,
    /// The workload range's size, bytes: the file is 8 MiB more.
    range_bytes: u64,
    /// Guest-physical addresses and the image's (non-zero) words there, to check the guest by.
    samples: Vec<(u64, u64)>,
}

/// How many of the image's words [`QemuImage`] keeps to check a guest by.
const IMAGE_SAMPLES: usize = 8;

impl QemuImage {
    /// Writes `image` (raw, or zstd-compressed: recognized by its magic) into a file in `dir`
    /// for a range of `range_bytes`; an image larger than the range, or not a whole number
    /// of 4 KiB pages, is refused.
    pub fn prepare(image: &Path, range_bytes: u64, dir: &Path) -> crate::Result<QemuImage> {
        use std::io::Read;
        let bad = |what: String| format!("{}: {what}", image.display());
        let mut file = std::fs::File::open(image).map_err(|e| bad(format!("cannot open: {e}")))?;
        let mut magic = [0u8; 4];
        let compressed = file.read_exact(&mut magic).is_ok() && magic == [0x28, 0xb5, 0x2f, 0xfd];
        drop(file);
        let file = std::fs::File::open(image).map_err(|e| bad(format!("cannot open: {e}")))?;
        let mut reader: Box<dyn Read> = if compressed {
            Box::new(
                zstd::stream::read::Decoder::new(file)
                    .map_err(|e| bad(format!("not a zstd stream: {e}")))?,
            )
        } else {
            Box::new(file)
        };
        let path = dir.join(format!("guestmem-qemu-image-{}.raw", std::process::id()));
        let out = QemuImage {
            path: path.clone(),
            range_bytes,
            samples: Vec::new(),
        };
        let to = std::fs::File::create(&path)
            .map_err(|e| format!("{}: cannot create: {e}", path.display()))?;
        let total = MIN_RANGE_START + range_bytes;
        to.set_len(total)
            .map_err(|e| format!("{}: cannot size to {total} bytes: {e}", path.display()))?;
        let mut out = out;
        let mut buf = vec![0u8; 4 << 20];
        let mut offset = 0u64;
        let every = range_bytes / IMAGE_SAMPLES as u64;
        loop {
            let mut n = 0;
            while n < buf.len() {
                match reader.read(&mut buf[n..]) {
                    Ok(0) => break,
                    Ok(k) => n += k,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        return Err(
                            bad(format!("cannot read at byte {}: {e}", offset + n as u64)).into(),
                        )
                    }
                }
            }
            if n == 0 {
                break;
            }
            if offset + n as u64 > range_bytes {
                return Err(bad(format!(
                    "larger than the guest's {range_bytes} bytes of memory"
                ))
                .into());
            }
            let chunk = &buf[..n];
            // Zero chunks stay holes of the sparse file.
            if chunk.iter().any(|&b| b != 0) {
                use std::os::unix::fs::FileExt;
                to.write_all_at(chunk, MIN_RANGE_START + offset)
                    .map_err(|e| format!("{}: cannot write: {e}", path.display()))?;
            }
            // The first non-zero word at or after each sample point in this chunk.
            while out.samples.len() < IMAGE_SAMPLES {
                let want = out.samples.len() as u64 * every;
                if want >= offset + n as u64 {
                    break;
                }
                let from = to_usize(want.saturating_sub(offset)) & !7;
                let Some(k) = chunk[from..]
                    .chunks_exact(8)
                    .position(|w| w.iter().any(|&b| b != 0))
                else {
                    break;
                };
                let at = from + 8 * k;
                let word = u64::from_le_bytes(chunk[at..at + 8].try_into().expect("8 bytes"));
                out.samples
                    .push((MIN_RANGE_START + offset + at as u64, word));
            }
            offset += n as u64;
        }
        if offset == 0 || !offset.is_multiple_of(4096) {
            return Err(bad(format!(
                "{offset} bytes is not a positive whole number of 4 KiB pages"
            ))
            .into());
        }
        Ok(out)
    }
}

impl Drop for QemuImage {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Generates a CA and both peers' certificates in `dir/keys` and lays them out for QEMU:
/// `dir/server` (the destination) and `dir/client` (the source), each with `ca-cert.pem`, its
/// `*-cert.pem` and `*-key.pem`.
fn qemu_credentials(dir: &Path) -> crate::Result<()> {
    let keys = dir.join("keys");
    generate_credentials(&keys)?;
    for (endpoint, role) in [("server", Role::Destination), ("client", Role::Source)] {
        let to = dir.join(endpoint);
        std::fs::create_dir_all(&to).map_err(|e| format!("{}: {e}", to.display()))?;
        for (from, name) in [
            ("ca.pem".to_string(), "ca-cert.pem".to_string()),
            (
                format!("{}.pem", role.name()),
                format!("{endpoint}-cert.pem"),
            ),
            (
                format!("{}.key", role.name()),
                format!("{endpoint}-key.pem"),
            ),
        ] {
            std::fs::copy(keys.join(&from), to.join(&name))
                .map_err(|e| format!("{}: {e}", to.join(&name).display()))?;
        }
    }
    Ok(())
}

fn qemu_version(qemu: &str) -> crate::Result<String> {
    let out = Command::new(qemu).arg("--version").output().map_err(
        |e| -> Box<dyn std::error::Error + Send + Sync> {
            if e.kind() == std::io::ErrorKind::NotFound {
                format!(
                    "{qemu} not found: install QEMU (Debian/Ubuntu: apt-get install \
                     qemu-system-x86), or name the binary in GUESTMEM_QEMU"
                )
                .into()
            } else {
                format!("cannot run {qemu}: {e}").into()
            }
        },
    )?;
    if !out.status.success() {
        return Err(format!("{qemu} --version failed with {}", out.status).into());
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()
        .unwrap_or_default()
        .to_string())
}

/// A TCP port on loopback that was free a moment ago.
fn free_port() -> crate::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")
        .map_err(|e| format!("cannot find a free TCP port on 127.0.0.1: {e}"))?;
    Ok(l.local_addr()?.port())
}

/// QEMU's `query-migrate` figures of a completed migration.
#[derive(Debug, PartialEq)]
struct MigrateInfo {
    total_ms: u64,
    downtime_ms: u64,
    setup_ms: u64,
    bytes: u64,
    ram_total_bytes: u64,
    normal_pages: u64,
    zero_pages: u64,
    dirty_sync_count: u64,
    mbit_per_s: f64,
}

impl MigrateInfo {
    fn parse(info: &Value) -> crate::Result<MigrateInfo> {
        let u = |v: &Value, name: &str| {
            v.as_u64()
                .ok_or_else(|| format!("query-migrate gave no {name}: {info}"))
        };
        let ram = &info["ram"];
        Ok(MigrateInfo {
            total_ms: u(&info["total-time"], "total-time")?,
            downtime_ms: u(&info["downtime"], "downtime")?,
            setup_ms: u(&info["setup-time"], "setup-time")?,
            bytes: u(&ram["transferred"], "ram.transferred")?,
            ram_total_bytes: u(&ram["total"], "ram.total")?,
            normal_pages: u(&ram["normal"], "ram.normal")?,
            zero_pages: u(&ram["duplicate"], "ram.duplicate")?,
            dirty_sync_count: u(&ram["dirty-sync-count"], "ram.dirty-sync-count")?,
            mbit_per_s: ram["mbps"].as_f64().unwrap_or(0.0),
        })
    }
}

// `control` reads state and pages done with one `xp`.
const _: () = assert!(CTL_PAGES_DONE == CTL_STATE + 8);

/// What the guest reports in vCPU 0's control block.
#[derive(Debug, Clone, Copy)]
struct Control {
    state: u64,
    pages_done: u64,
}

/// One QEMU process and its QMP connection; killed when dropped.
struct Qemu {
    name: &'static str,
    child: Child,
    stderr: PathBuf,
    qmp: Qmp,
}

impl Qemu {
    /// Starts QEMU as the `side` of a migration, in `link`'s namespace of that side if any.
    fn start(
        qemu: &str,
        link: Option<&Link>,
        side: Side,
        common: &[String],
        extra: &[String],
        dir: &Path,
    ) -> crate::Result<Qemu> {
        let name = match side {
            Side::Source => "source",
            Side::Destination => "destination",
        };
        let socket = dir.join(format!("{name}.qmp"));
        let stderr = dir.join(format!("{name}.stderr"));
        let log = std::fs::File::create(&stderr)
            .map_err(|e| format!("{}: cannot create: {e}", stderr.display()))?;
        let mut command = match link {
            Some(l) => l.command(side, qemu),
            None => Command::new(qemu),
        };
        let child = command
            .args(["-name", &format!("guestmem-{name},debug-threads=on")])
            .args(common)
            .args(extra)
            .arg("-qmp")
            .arg(format!("unix:{},server=on,wait=off", socket.display()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("cannot start {qemu} ({name}): {e}"))?;
        let mut guard = Qemu {
            name,
            child,
            stderr,
            qmp: Qmp::disconnected(),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = guard.child.try_wait()? {
                return Err(guard.died(status).into());
            }
            match UnixStream::connect(&socket) {
                Ok(stream) => {
                    guard.qmp = Qmp::handshake(stream).map_err(|e| {
                        format!(
                            "QMP of the {name} QEMU: {}",
                            guestmem_migration::error_chain(&*e, ": ")
                        )
                    })?;
                    return Ok(guard);
                }
                Err(e) if Instant::now() > deadline => {
                    return Err(format!(
                        "the {name} QEMU's QMP socket {} does not answer: {e}",
                        socket.display()
                    )
                    .into())
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    fn died(&self, status: std::process::ExitStatus) -> String {
        let err = std::fs::read_to_string(&self.stderr).unwrap_or_default();
        format!(
            "the {} QEMU exited ({status}): {}",
            self.name,
            err.trim().lines().last().unwrap_or("no message")
        )
    }

    /// `n` u64 words of vCPU 0's control block from `field`.
    fn read(&mut self, field: u64, n: usize) -> crate::Result<Vec<u64>> {
        let gpa = VCPU_BLOCKS_GPA + field;
        let text = self.qmp.hmp(&format!("xp /{n}gx {gpa:#x}")).map_err(|e| {
            format!(
                "{} QEMU: {}",
                self.name,
                guestmem_migration::error_chain(&*e, ": ")
            )
        })?;
        let words = parse_xp(&text)?;
        if words.len() != n {
            return Err(
                format!("xp at {gpa:#x} gave {} words, not {n}: {text}", words.len()).into(),
            );
        }
        Ok(words)
    }

    fn control(&mut self) -> crate::Result<Control> {
        let w = self.read(CTL_STATE, 2)?;
        Ok(Control {
            state: w[0],
            pages_done: w[1],
        })
    }

    /// Polls the control block until `done` says so (or errs), at most `timeout`.
    fn wait_for(
        &mut self,
        timeout: Duration,
        what: &str,
        mut done: impl FnMut(Control) -> crate::Result<bool>,
    ) -> crate::Result<Control> {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Err(self.died(status).into());
            }
            let c = self.control()?;
            if done(c)? {
                return Ok(c);
            }
            if start.elapsed() > timeout {
                return Err(format!(
                    "{} QEMU: waited {} s for {what} (guest state {}, {} pages done)",
                    self.name,
                    timeout.as_secs(),
                    c.state,
                    c.pages_done
                )
                .into());
            }
            std::thread::sleep(POLL);
        }
    }
}

impl Drop for Qemu {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A QMP connection: one JSON object per line each way.
struct Qmp {
    stream: Option<(BufReader<UnixStream>, UnixStream)>,
}

impl Qmp {
    fn disconnected() -> Qmp {
        Qmp { stream: None }
    }

    /// Reads the greeting and leaves capabilities negotiation.
    fn handshake(stream: UnixStream) -> crate::Result<Qmp> {
        stream.set_read_timeout(Some(Duration::from_secs(60)))?;
        let mut qmp = Qmp {
            stream: Some((BufReader::new(stream.try_clone()?), stream)),
        };
        let greeting = qmp.read_message()?;
        if greeting.get("QMP").is_none() {
            return Err(format!("no QMP greeting: {greeting}").into());
        }
        qmp.execute("qmp_capabilities", None)?;
        Ok(qmp)
    }

    fn read_message(&mut self) -> crate::Result<Value> {
        let (reader, _) = self.stream.as_mut().ok_or("QMP is not connected")?;
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 {
            return Err("QEMU closed its QMP socket".into());
        }
        serde_json::from_str(&line)
            .map_err(|e| format!("QEMU sent a QMP line that is not JSON ({e}): {line}").into())
    }

    /// Runs `command` and returns its `return` value; QEMU's error, if any, is the error.
    fn execute(&mut self, command: &str, arguments: Option<Value>) -> crate::Result<Value> {
        let mut request = json!({ "execute": command });
        if let Some(a) = arguments {
            request["arguments"] = a;
        }
        let (_, writer) = self.stream.as_mut().ok_or("QMP is not connected")?;
        writer.write_all(format!("{request}\n").as_bytes())?;
        loop {
            let message = self.read_message()?;
            if let Some(reply) = parse_reply(&message).map_err(|e| {
                format!(
                    "QMP {command}: {}",
                    guestmem_migration::error_chain(&*e, ": ")
                )
            })? {
                return Ok(reply);
            }
        }
    }

    /// A human monitor command's output.
    fn hmp(&mut self, line: &str) -> crate::Result<String> {
        let reply = self.execute(
            "human-monitor-command",
            Some(json!({ "command-line": line })),
        )?;
        reply
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| format!("{line}: the monitor's answer is not text: {reply}").into())
    }
}

/// A QMP message as the reply to a command: `Ok(Some(return value))`, `Err(QEMU's error)`, or
/// `Ok(None)` for an asynchronous event (to be skipped).
fn parse_reply(message: &Value) -> crate::Result<Option<Value>> {
    if let Some(r) = message.get("return") {
        return Ok(Some(r.clone()));
    }
    if let Some(e) = message.get("error") {
        return Err(format!(
            "QEMU says {}: {}",
            e["class"].as_str().unwrap_or("error"),
            e["desc"].as_str().unwrap_or("no description")
        )
        .into());
    }
    if message.get("event").is_some() {
        return Ok(None);
    }
    Err(format!("unexpected QMP message: {message}").into())
}

/// The words of the monitor's `xp /Ngx ADDR` output (`ADDR: 0x... 0x...` lines).
fn parse_xp(text: &str) -> crate::Result<Vec<u64>> {
    let mut words = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let (_, values) = line
            .split_once(':')
            .ok_or_else(|| format!("not an xp line: {line}"))?;
        for v in values.split_whitespace() {
            let hex = v
                .strip_prefix("0x")
                .ok_or_else(|| format!("not a hex word in xp output: {line}"))?;
            words.push(u64::from_str_radix(hex, 16).map_err(|e| format!("{v} in xp output: {e}"))?);
        }
    }
    Ok(words)
}

/// A private directory for the ELF and the QMP sockets, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> crate::Result<TempDir> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .subsec_nanos();
        let path =
            std::env::temp_dir().join(format!("guestmem-qemu-{}-{nanos}", std::process::id()));
        std::fs::create_dir(&path)
            .map_err(|e| format!("{}: cannot create: {e}", path.display()))?;
        Ok(TempDir(path))
    }
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qmp_replies() {
        let ok: Value = serde_json::from_str(r#"{"return": {"status": "active"}}"#).unwrap();
        assert_eq!(parse_reply(&ok).unwrap().unwrap()["status"], "active");
        let event: Value = serde_json::from_str(
            r#"{"timestamp": {"seconds": 1, "microseconds": 2}, "event": "MIGRATION", "data": {}}"#,
        )
        .unwrap();
        assert!(parse_reply(&event).unwrap().is_none());
        let err: Value = serde_json::from_str(
            r#"{"error": {"class": "GenericError", "desc": "Migration is disabled"}}"#,
        )
        .unwrap();
        let e = parse_reply(&err).unwrap_err().to_string();
        assert!(
            e.contains("GenericError") && e.contains("Migration is disabled"),
            "{e}"
        );
    }

    #[test]
    fn xp_output() {
        let text = "0000000000400080: 0x0000000000000001 0x0000000010e0f2a1\r\n\
                    0000000000400090: 0x00000000000004b2\r\n";
        assert_eq!(parse_xp(text).unwrap(), vec![1, 0x10e0f2a1, 0x4b2]);
        assert!(parse_xp("Cannot access memory\r\n").is_err());
    }

    #[test]
    fn migrate_figures() {
        let info: Value = serde_json::from_str(
            r#"{"status": "completed", "total-time": 5321, "downtime": 42, "setup-time": 3,
                "ram": {"transferred": 1100000000, "total": 1074331648, "normal": 262000,
                        "duplicate": 1500, "dirty-sync-count": 4, "mbps": 1650.5,
                        "remaining": 0}}"#,
        )
        .unwrap();
        let f = MigrateInfo::parse(&info).unwrap();
        assert_eq!(f.total_ms, 5321);
        assert_eq!(f.downtime_ms, 42);
        assert_eq!(f.dirty_sync_count, 4);
        assert_eq!(f.zero_pages, 1500);
        let partial: Value = serde_json::from_str(r#"{"status": "completed"}"#).unwrap();
        assert!(MigrateInfo::parse(&partial)
            .unwrap_err()
            .to_string()
            .contains("total-time"));
    }
}
