//! `guestmem run`: one VM, one workload, and what the guest did.

use std::time::Instant;

use guestmem_memory::Backend;
use guestmem_vm::{layout, RunReport, VcpuWork, Vm, Workload};
use serde::Serialize;

use crate::vm_args::VmArgs;

#[derive(Clone, Copy, clap::ValueEnum)]
enum WorkloadArg {
    Touch,
    Dirty,
    /// `dirty` rewriting 2-33 lines of each page with bytes from another page of the range,
    /// as a real guest does (with `--image`: on real memory).
    Rewrite,
    Verify,
}

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    vm: VmArgs,
    #[command(flatten)]
    linux: crate::linux::LinuxArgs,
    /// With --kernel: stop the guest after this many seconds (default: when it resets).
    #[arg(long, value_name = "SECONDS", requires = "kernel")]
    run_for: Option<f64>,
    /// Guest workload.
    #[arg(long, value_enum, default_value = "touch")]
    workload: WorkloadArg,
    /// Seed of the values the guest writes.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// `dirty`, `rewrite`: pages per second per vCPU (default: full speed).
    #[arg(long)]
    rate: Option<u64>,
    /// `dirty`, `rewrite`: how long to keep dirtying, in seconds.
    #[arg(long, default_value_t = 2.0)]
    duration: f64,
    /// A vCPU that makes no progress for this many seconds ends the run with an error.
    #[arg(long, default_value_t = 30.0)]
    stall_timeout: f64,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Output {
    memory_bytes: u64,
    backend: Backend,
    workload: &'static str,
    setup_ms: f64,
    #[serde(flatten)]
    report: RunReport,
    /// `verify`: whether every vCPU's guest digest equals the host's digest of the same range.
    digests_match_host: Option<bool>,
}

pub fn main(args: Args) -> crate::Result<()> {
    let config = args.vm.config()?;
    if let Some(plan) = args.linux.plan(&args.vm)? {
        let run_for = args
            .run_for
            .map(|s| crate::units::seconds(s, "--run-for"))
            .transpose()?;
        return crate::linux::run(&args.vm, &args.linux, plan, run_for);
    }
    if args.rate == Some(0) {
        return Err("--rate must be at least 1 page/s".into());
    }
    let duration = crate::units::seconds(args.duration, "--duration")?;
    let stall = crate::units::seconds(args.stall_timeout, "--stall-timeout")?;
    let t0 = Instant::now();
    let mut vm = Vm::new(&config)?;
    let setup_ms = t0.elapsed().as_secs_f64() * 1e3;
    args.vm.load_image(&vm)?;
    let workload = match args.workload {
        WorkloadArg::Touch => Workload::Touch,
        WorkloadArg::Dirty => Workload::Dirty {
            pages_per_s: args.rate,
            passes: None,
            fill_first: false,
        },
        WorkloadArg::Rewrite => Workload::Rewrite {
            pages_per_s: args.rate,
            passes: None,
        },
        WorkloadArg::Verify => Workload::Verify,
    };
    let work = VcpuWork::split(
        workload,
        layout::RAM_GPA,
        args.vm.memory,
        args.vm.vcpus,
        args.seed,
    );
    if work[0].size == 0 {
        return Err(format!(
            "--memory {} is too small to give each of {} vCPUs a page",
            args.vm.memory, args.vm.vcpus
        )
        .into());
    }
    let report = {
        let running = vm.start(&work)?;
        if let Workload::Dirty { .. } | Workload::Rewrite { .. } = workload {
            std::thread::sleep(duration);
            running.stop();
        }
        running.wait(stall)?
    };
    let digests_match_host = match workload {
        Workload::Verify => Some(
            work.iter()
                .zip(&report.vcpus)
                .map(|(w, v)| vm.memory().digest(w.gpa, w.size).map(|d| d == v.digest))
                .collect::<Result<Vec<_>, _>>()?
                .into_iter()
                .all(|m| m),
        ),
        _ => None,
    };
    let out = Output {
        memory_bytes: args.vm.memory,
        backend: args.vm.backend,
        workload: workload.name(),
        setup_ms,
        report,
        digests_match_host,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print_table(&out);
    }
    if out.digests_match_host == Some(false) {
        return Err("the guest's verify digest differs from the host's".into());
    }
    Ok(())
}

fn print_table(out: &Output) {
    println!(
        "VM: {} MiB on {}, {} vCPUs, workload {} (setup {:.1} ms)",
        out.memory_bytes >> 20,
        out.backend,
        out.report.vcpus.len(),
        out.workload,
        out.setup_ms
    );
    println!(
        "{:>5} {:>12} {:>6} {:>10} {:>14}",
        "vCPU", "pages", "passes", "guest s", "pages/s"
    );
    for v in &out.report.vcpus {
        println!(
            "{:>5} {:>12} {:>6} {:>10.3} {:>14.0}",
            v.vcpu, v.pages, v.generation, v.guest_seconds, v.pages_per_s
        );
    }
    println!(
        "{:>5} {:>12} {:>6} {:>10} {:>14.0}",
        "total", out.report.total_pages, "", "", out.report.total_pages_per_s
    );
    println!("wall time: {:.3} s", out.report.wall_seconds);
    if let Some(m) = out.digests_match_host {
        println!(
            "verify digests match the host's: {}",
            if m { "yes" } else { "NO" }
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> Args {
        let mut all = vec!["run"];
        all.extend_from_slice(extra);
        match crate::tests::parse_for_test(&all).unwrap() {
            crate::Command::Run(a) => a,
            _ => unreachable!("run parses as itself"),
        }
    }

    /// A rate of 0, a duration that is not a positive number of seconds, and a memory too
    /// small to give every vCPU a page are refused naming the flag.
    #[test]
    fn bad_run_flags_are_refused() {
        let e = |extra: &[&str]| main(args(extra)).unwrap_err().to_string();
        assert_eq!(e(&["--rate", "0"]), "--rate must be at least 1 page/s");
        assert!(e(&["--duration", "0"]).starts_with("--duration must be"));
        assert!(e(&["--stall-timeout=-1"]).starts_with("--stall-timeout must be"));
        assert_eq!(
            e(&["--memory", "4K", "--vcpus", "2"]),
            "--memory 4096 is too small to give each of 2 vCPUs a page"
        );
    }
}
