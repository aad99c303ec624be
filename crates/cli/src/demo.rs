//! `guestmem demo`: a 1 GiB, 2-vCPU VM dirtying its memory migrates live to a second guestmem
//! process on this host, and both sides show what happened; with `--kernel`, the demo with a
//! Linux guest ([`crate::demo_linux`]).

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use guestmem_memory::Backend;
use guestmem_migration::migrate::Mode;
use guestmem_migration::transport::{generate_credentials, Credentials, Endpoint, Role};
use guestmem_vm::linux::DEFAULT_CMDLINE;

use crate::migrate::{self, HowArgs, Received};
use crate::vm_args::VmArgs;

#[derive(clap::Args)]
pub struct Args {
    /// How to migrate.
    #[arg(long, default_value = "precopy")]
    mode: Mode,
    /// Draw dirty pages and bandwidth per round over time into this SVG file.
    #[arg(long, value_name = "FILE", conflicts_with = "kernel")]
    plot: Option<PathBuf>,
    /// The demo with a Linux guest instead: boot this kernel (a bzImage or an ELF vmlinux)
    /// with --initrd, stream its console, snapshot it, restore it lazily in a second guestmem
    /// process and show its counter going on. Needs a host whose KVM runs ordinary kernels
    /// (not PVM: there, the kernel lab, scripts/kernel-lab.sh --suite linux).
    #[arg(long, value_name = "BZIMAGE")]
    kernel: Option<PathBuf>,
    /// With --kernel: the initramfs; the demo's is scripts/linux-guest-initramfs.sh's (its
    /// init prints `counter N UPTIME` every 100 ms).
    #[arg(long, value_name = "CPIO", requires = "kernel")]
    initrd: Option<PathBuf>,
    /// With --kernel: the kernel command line.
    #[arg(long, value_name = "TEXT", requires = "kernel", default_value = DEFAULT_CMDLINE)]
    cmdline: String,
    /// With --kernel: the guest's memory, e.g. 256M.
    #[arg(long, default_value = "256M", value_parser = crate::units::parse_size, requires = "kernel")]
    memory: u64,
    /// With --kernel: the console line after which the guest runs `--after` seconds before
    /// its snapshot (the demo's init prints `counter N ...` lines).
    #[arg(
        long,
        value_name = "TEXT",
        requires = "kernel",
        default_value = "counter "
    )]
    wait_for: String,
    /// With --kernel: seconds the guest runs before the pause, and after the restore.
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 3.0,
        requires = "kernel"
    )]
    after: f64,
}

pub fn main(args: Args) -> crate::Result<()> {
    if let Some(kernel) = &args.kernel {
        crate::units::seconds(args.after, "--after")?;
        return crate::demo_linux::main(&crate::demo_linux::Guest {
            kernel,
            initrd: args.initrd.as_deref(),
            cmdline: &args.cmdline,
            memory: args.memory,
            wait_for: &args.wait_for,
            after: args.after,
        });
    }
    let dir = std::env::temp_dir().join(format!("guestmem-demo-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    generate_credentials(&dir)?;
    let result = run(&args, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn run(args: &Args, dir: &std::path::Path) -> crate::Result<()> {
    let vm = VmArgs {
        memory: 1 << 30,
        vcpus: 2,
        backend: Backend::Anon,
        image: None,
    };
    let rate = 64;
    let socket = dir.join("migrate.sock");
    let endpoint = Endpoint::Unix(socket.clone());
    let exe = std::env::current_exe()?;
    let mut child = Command::new(exe)
        .args(["migrate", "receive", "--run-for", "2", "--json", "--keys"])
        .arg(dir)
        .arg("--listen")
        .arg(endpoint.to_string())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start the destination guestmem: {e}"))?;
    let started = Instant::now();
    while !socket.exists() {
        if let Some(status) = child.try_wait()? {
            return Err(
                format!("the destination guestmem exited before listening ({status})").into(),
            );
        }
        if started.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            return Err("the destination guestmem did not start listening within 20 s".into());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    println!(
        "guestmem demo: a {} MiB, {}-vCPU VM rewrites its memory at {rate} MiB/s; it migrates \
         live ({}) to a second guestmem process (pid {}) over mutually authenticated TLS",
        vm.memory >> 20,
        vm.vcpus,
        args.mode,
        child.id()
    );
    let how = HowArgs {
        mode: args.mode,
        downtime_ms: 50,
        connections: guestmem_migration::migrate::DEFAULT_CONNECTIONS,
        max_bandwidth_mib_per_s: None,
        no_auto_converge: false,
        verify: args.mode == Mode::Precopy,
        share_memory: false,
        whole_pages: false,
        compress: Default::default(),
        delta_cache_mib: None,
        zstd_window_bytes: guestmem_migration::migrate::DEFAULT_ZSTD_WINDOW_BYTES,
        fault_cpus: None,
        dead_after: guestmem_migration::migrate::DEAD_PEER_TIMEOUT.as_secs_f64(),
    };
    let report = match migrate::run_source(
        &vm,
        &migrate::dirty_work(&vm, rate),
        Duration::from_secs(1),
        &endpoint,
        Credentials::load(dir, Role::Source)?,
        &how,
        None,
        &crate::progress::Progress::bar(),
    ) {
        Ok(r) => r,
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            return Err(e);
        }
    };
    migrate::print_report(&report, false, args.plot.as_deref())?;
    let output = child.wait_with_output()?;
    if !output.status.success() {
        return Err(format!("the destination guestmem failed ({})", output.status).into());
    }
    let received: Received = serde_json::from_slice(&output.stdout)
        .map_err(|e| format!("the destination's report is not understood: {e}"))?;
    migrate::print_received(&received);
    match (report.digest, received.report.digest) {
        (Some(s), Some(d)) if s == d => {
            println!("memory digest at switch-over: source {s:#018x} = destination {d:#018x}");
        }
        (Some(s), Some(d)) => {
            return Err(
                format!("memory digests differ: source {s:#018x}, destination {d:#018x}").into(),
            )
        }
        _ => println!(
            "memory: every page arrived under its frame's CRC-32 (post-copy: the digest cannot be \
             compared once the guest runs on the destination)"
        ),
    }
    if !received.guest_continued {
        return Err("the guest did not go on counting on the destination".into());
    }
    println!("the workload continued on the destination: migration complete");
    Ok(())
}
