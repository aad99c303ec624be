//! `guestmem bench memslots`: the kernel's memslot_perf_test over the memslot manager,
//! the manager's cost over the raw `KVM_SET_USER_MEMORY_REGION2` ioctl, and one device access
//! through a cached handle vs a fresh lookup.
//!
//! Like memslot_perf_test, 512 MiB of one anonymous mapping is split into N slots at 256 MiB.
//! What is simplified (our guest is the CPL3 payload, which cannot sync with the host mid-run
//! nor survive an access to an unmapped gpa):
//! - map: one iteration discards the first 32 MiB (via the manager, slot by slot) and lets the
//!   guest touch it again (a fresh run of the `touch` workload), so every page is mapped anew.
//! - unmap / unmap chunked: one iteration discards the 128 MiB unmap area, slot by slot
//!   (in 2 MiB chunks for "chunked"), after the host wrote one page in each half (instead of
//!   the guest); no guest runs in between.
//! - move active area: the last slot is moved away and back while a device thread writes
//!   through a handle on it (the VMM is the active user, not the guest).
//! - move inactive area: the same move with nobody using the slot.
//! - RW: the guest writes every page of the 512 MiB once (`dirty`, one pass) and the host reads
//!   every page's first word back through the manager and checks it.
//!
//! Each test runs `--runs` times for `--seconds` (memslot_perf_test's `-r` and `-s`): its figure's
//! runs are each run's mean seconds per iteration (what memslot_perf_test reports per run), and
//! `best_s_per_iteration` is the fastest single iteration of them all. Slot setup and each device
//! access are timed `--runs` times too: their figures carry every run, their plain fields the best.

use guestmem_sys::to_usize;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use guestmem_memory::{
    Backend, GuestMemory, Memslot, MemslotManager, RegionSpec, SlotFlags, PAGE_SIZE,
};
use guestmem_sys::uapi::kvm_userspace_memory_region2;
use guestmem_vm::{payload::page_value, VcpuWork, Vm, VmConfig, Workload};
use serde_json::json;

use crate::envelope::Figure;

/// memslot_perf_test's `MEM_GPA` and `MEM_TEST_SIZE`, `MEM_TEST_MAP_SIZE`, `MEM_TEST_UNMAP_SIZE`.
const MEM_GPA: u64 = 256 << 20;
const MEM_SIZE: u64 = 512 << 20;
const MAP_SIZE: u64 = 32 << 20;
const UNMAP_SIZE: u64 = 128 << 20;
const UNMAP_CHUNK: u64 = 2 << 20;
const STALL: Duration = Duration::from_secs(30);

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Slot counts for memslot_perf_test's tests (up to KVM_CAP_NR_MEMSLOTS - 1, e.g. 32763).
    #[arg(long, value_delimiter = ',', default_value = "8192")]
    slots: Vec<u32>,
    /// Seconds each run of a test lasts (memslot_perf_test's default is 5).
    #[arg(long, default_value_t = 1.0)]
    seconds: f64,
    /// Runs of each test, of the slot setup and of each device access measurement.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    runs: u32,
    /// Slot counts for the device access comparison.
    #[arg(long, value_delimiter = ',', default_value = "1,64,8192")]
    access_slots: Vec<u32>,
    /// Device accesses timed per measurement.
    #[arg(long, default_value_t = 1_000_000, value_parser = clap::value_parser!(u64).range(1..))]
    accesses: u64,
    /// Print one JSON object instead of the tables.
    #[arg(long)]
    json: bool,
}

pub fn main(args: Args) -> crate::Result<()> {
    let mut perf = Vec::new();
    for &n in &args.slots {
        perf.push(perf_test(n, &args)?);
    }
    let mut access = Vec::new();
    for &n in &args.access_slots {
        access.push(access_test(n, args.accesses, args.runs)?);
    }
    if args.json {
        crate::envelope::print(&json!({ "perf": perf, "access": access }))?;
    } else {
        println!("\none device access (8 bytes): cached handle vs fresh lookup (manager: slot table, indexed) vs GuestMemory (linear over all regions)");
        println!(
            "| slots | op | cached ns | fresh ns | linear ns | cached/fresh | cached/linear |"
        );
        println!("|---|---|---|---|---|---|---|");
        for a in &access {
            for op in ["read", "write"] {
                let f = |k: &str| a[format!("{k}_{op}_ns")].as_f64().unwrap_or(0.0);
                println!(
                    "| {} | {op} | {:.1} | {:.1} | {:.1} | {:.3} | {:.4} |",
                    a["slots"],
                    f("cached"),
                    f("fresh"),
                    f("linear"),
                    f("cached") / f("fresh"),
                    f("cached") / f("linear"),
                );
            }
        }
    }
    Ok(())
}

/// Slot 0 holds the VM's sys region, so the test area can have 1 to `max_slots - 1` slots.
fn check_slot_count(flag: &str, n: u32, max_slots: u32) -> crate::Result<()> {
    if n == 0 || n >= max_slots {
        return Err(format!(
            "{flag} {n}: the test area needs 1 to {} slots (KVM_CAP_NR_MEMSLOTS is {max_slots} \
             and slot 0 holds the VM's sys region)",
            max_slots - 1
        )
        .into());
    }
    Ok(())
}

/// The slots memslot_perf_test makes: `n` windows of the test region, the last one taking the
/// remainder.
fn windows(n: u32) -> Vec<(u64, u64)> {
    let pages = MEM_SIZE / PAGE_SIZE;
    let per = pages / u64::from(n);
    (0..u64::from(n))
        .map(|i| {
            let size = if i == u64::from(n) - 1 {
                pages - i * per
            } else {
                per
            };
            (i * per * PAGE_SIZE, size * PAGE_SIZE)
        })
        .collect()
}

/// A 1-vCPU VM whose 512 MiB test region is registered, then taken out of its memslot, so that
/// the test can split it into its own `n` slots (checked against the kernel's limit, `flag`
/// naming the option that asked for them).
fn test_vm(flag: &str, n: u32) -> crate::Result<(Vm, Arc<MemslotManager>, Memslot)> {
    let vm = Vm::new(&VmConfig {
        vcpus: 1,
        regions: vec![RegionSpec::new("test", MEM_GPA, MEM_SIZE, Backend::Anon)],
        dirty_ring_bytes: None,
    })?;
    let slots = vm
        .memory()
        .memslots()
        .ok_or("memory not registered")?
        .clone();
    check_slot_count(flag, n, slots.max_slots())?;
    let whole = slots
        .slots()
        .into_iter()
        .find(|s| s.gpa == MEM_GPA)
        .ok_or("no test slot")?;
    slots.remove(whole.id)?;
    Ok((vm, slots, whole))
}

fn perf_test(n: u32, args: &Args) -> crate::Result<serde_json::Value> {
    let (mut vm, slots, whole) = test_vm("--slots", n)?;
    let region = whole.region.clone();
    let windows = windows(n);

    let (manager, raw) = slot_setup(&vm, &slots, &region, &windows, args.runs)?;
    let (best_manager, best_raw) = (manager.min, raw.min);
    let overhead = (best_manager / best_raw - 1.0) * 100.0;

    let table: Vec<Memslot> = slots
        .slots()
        .into_iter()
        .filter(|s| s.gpa >= MEM_GPA)
        .collect();
    let (seconds, runs) = (args.seconds, args.runs);
    let mut results = Vec::new();
    let mut report = |name: &str, t: Timed| {
        let (iters, best) = (t.iterations, t.best);
        let figure = Figure::measured(&t.per_run);
        if !args.json {
            println!("Testing {name} performance with {runs} runs, {seconds} seconds each");
            println!("Done {iters} iterations");
            println!(
                "Best runtime result was {best:.9}s per iteration (with {iters} iterations); \
                 the median run took {:.9}s per iteration\n",
                figure.median
            );
        }
        results.push(json!({
            "test": name,
            "iterations": iters,
            "best_s_per_iteration": best,
            "s_per_iteration_figure": figure,
        }));
    };
    if !args.json {
        println!("memslot_perf_test shape, {n} slots over 512 MiB (simplified; see docs/benchmarks.md)\n");
    }

    report(
        "map",
        timed(seconds, runs, || {
            discard_range(&slots, &table, MEM_GPA, MAP_SIZE, MAP_SIZE)?;
            let work = VcpuWork::split(Workload::Touch, MEM_GPA, MAP_SIZE, 1, 1);
            vm.run(&work, STALL)?;
            Ok(())
        })?,
    );
    for (name, chunk) in [("unmap", UNMAP_SIZE), ("unmap chunked", UNMAP_CHUNK)] {
        report(
            name,
            timed(seconds, runs, || {
                slots.write(MEM_GPA, &1u64.to_le_bytes())?;
                slots.write(MEM_GPA + UNMAP_SIZE / 2, &2u64.to_le_bytes())?;
                discard_range(&slots, &table, MEM_GPA, UNMAP_SIZE, chunk)
            })?,
        );
    }
    let last = table.last().ok_or("no slots")?.clone();
    for (name, active) in [("move active area", true), ("move inactive area", false)] {
        let result = move_test(&slots, &last, active, seconds, runs);
        report(name, result?);
    }
    let mut pass = 0u64;
    report(
        "RW",
        timed(seconds, runs, || {
            pass += 1;
            rw_pass(&mut vm, &slots, pass)
        })?,
    );
    if !args.json {
        println!("Best slot setup time for the whole test area was {best_manager:.9}s");
        println!(
            "(raw KVM_SET_USER_MEMORY_REGION2: {best_raw:.9}s; the manager adds {overhead:.1}%)\n"
        );
    }
    Ok(json!({
        "slots": n,
        "best_slot_setup_s": best_manager,
        "raw_slot_setup_s": best_raw,
        "slot_setup_s_figure": manager,
        "raw_slot_setup_s_figure": raw,
        "overhead_vs_raw_percent": overhead,
        "tests": results,
    }))
}

/// Slot setup of the whole test area: the manager vs the raw ioctl, alternately, `runs` times
/// each; the manager's slots are left in place.
fn slot_setup(
    vm: &Vm,
    slots: &MemslotManager,
    region: &Arc<guestmem_memory::Region>,
    windows: &[(u64, u64)],
    runs: u32,
) -> crate::Result<(Figure, Figure)> {
    // Slot setup: the manager vs the raw ioctl, alternately, --runs times each. The raw ioctl
    // uses the ids the manager would (1..=n: slot 0 is the VM's sys region).
    let (mut manager_runs, mut raw_runs) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        let t = Instant::now();
        for (i, &(off, size)) in windows.iter().enumerate() {
            raw_set(
                vm,
                1 + u32::try_from(i).expect("memslot ids are u32"),
                region,
                off,
                size,
            )?;
        }
        raw_runs.push(t.elapsed().as_secs_f64());
        for (i, &(off, _)) in windows.iter().enumerate() {
            raw_set(
                vm,
                1 + u32::try_from(i).expect("memslot ids are u32"),
                region,
                off,
                0,
            )?;
        }
        let t = Instant::now();
        let ids = windows
            .iter()
            .map(|&(off, size)| slots.add(region, off, size, MEM_GPA + off, SlotFlags::default()))
            .collect::<Result<Vec<_>, _>>()?;
        manager_runs.push(t.elapsed().as_secs_f64());
        for &id in &ids {
            slots.remove(id)?;
        }
    }
    for &(off, size) in windows {
        slots.add(region, off, size, MEM_GPA + off, SlotFlags::default())?;
    }
    Ok((Figure::measured(&manager_runs), Figure::measured(&raw_runs)))
}

/// Moves the last slot away and back, while a device thread writes to it (`active`) or not.
fn move_test(
    slots: &Arc<MemslotManager>,
    last: &Memslot,
    active: bool,
    seconds: f64,
    runs: u32,
) -> crate::Result<Timed> {
    let away = MEM_GPA + MEM_SIZE + (1 << 30);
    let stop = Arc::new(AtomicBool::new(false));
    let device = active
        .then(|| -> crate::Result<_> {
            let h = slots.map(last.gpa, PAGE_SIZE)?;
            let stop = stop.clone();
            Ok(std::thread::spawn(move || {
                let mut writes = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    writes += u64::from(h.write_u64(0, writes).is_ok());
                }
                writes
            }))
        })
        .transpose()?;
    let result = timed(seconds, runs, || {
        slots.move_to(last.id, away)?;
        slots.move_to(last.id, last.gpa)?;
        Ok(())
    });
    stop.store(true, Ordering::Relaxed);
    if let Some(d) = device {
        d.join().map_err(|_| "device thread panicked")?;
    }
    result
}

/// One pass of the guest's `dirty` workload over the test area, each page's word then read
/// back through the slots and checked.
fn rw_pass(vm: &mut Vm, slots: &MemslotManager, pass: u64) -> crate::Result<()> {
    let work = VcpuWork::split(
        Workload::Dirty {
            pages_per_s: None,
            passes: Some(1),
            fill_first: false,
        },
        MEM_GPA,
        MEM_SIZE,
        1,
        pass,
    );
    let r = vm.run(&work, STALL)?;
    let generation = r.vcpus[0].generation;
    let mut word = [0u8; 8];
    for gpa in (MEM_GPA..MEM_GPA + MEM_SIZE).step_by(to_usize(PAGE_SIZE)) {
        slots.read(gpa, &mut word)?;
        let want = page_value(pass, gpa, generation - 1);
        if u64::from_le_bytes(word) != want {
            return Err(format!(
                "RW: gpa {gpa:#x} holds {:#x}, the guest wrote {want:#x}",
                u64::from_le_bytes(word)
            )
            .into());
        }
    }
    Ok(())
}

/// What [`timed`] measured of one test.
struct Timed {
    /// Over all runs.
    iterations: u64,
    /// The fastest single iteration, seconds.
    best: f64,
    /// Each run's mean seconds per iteration.
    per_run: Vec<f64>,
}

/// Runs `iteration` for about `seconds` (at least twice), `runs` times.
fn timed(
    seconds: f64,
    runs: u32,
    mut iteration: impl FnMut() -> crate::Result<()>,
) -> crate::Result<Timed> {
    let mut timed = Timed {
        iterations: 0,
        best: f64::MAX,
        per_run: Vec::new(),
    };
    for _ in 0..runs {
        let start = Instant::now();
        let mut n = 0u64;
        while n < 2 || start.elapsed().as_secs_f64() < seconds {
            let t = Instant::now();
            iteration()?;
            timed.best = timed.best.min(t.elapsed().as_secs_f64());
            n += 1;
        }
        timed.per_run.push(start.elapsed().as_secs_f64() / n as f64);
        timed.iterations += n;
    }
    Ok(timed)
}

/// Discards `[gpa, gpa + len)` through the manager, one call per slot and `chunk`.
fn discard_range(
    slots: &MemslotManager,
    table: &[Memslot],
    gpa: u64,
    len: u64,
    chunk: u64,
) -> crate::Result<()> {
    for s in table.iter().filter(|s| s.gpa < gpa + len && s.end() > gpa) {
        let (mut at, end) = (s.gpa.max(gpa), s.end().min(gpa + len));
        while at < end {
            let n = chunk.min(end - at);
            slots.discard(at, n)?;
            at += n;
        }
    }
    Ok(())
}

/// The raw ioctl, bypassing the manager (size 0 deletes).
fn raw_set(
    vm: &Vm,
    slot: u32,
    region: &guestmem_memory::Region,
    offset: u64,
    size: u64,
) -> crate::Result<()> {
    let mr = kvm_userspace_memory_region2 {
        slot,
        guest_phys_addr: MEM_GPA + offset,
        memory_size: size,
        // SAFETY: offset < the region's size, so the address is inside its mapping.
        userspace_addr: unsafe { region.host_addr().add(to_usize(offset)) } as u64,
        ..Default::default()
    };
    // SAFETY: `mr` describes memory of `region`, which outlives the VM's use of the slot (the
    // bench deletes the slot before the region goes away).
    unsafe { vm.fd().set_user_memory_region2(mr) }
        .map_err(|e| format!("raw KVM_SET_USER_MEMORY_REGION2 slot {slot}: {e}"))?;
    Ok(())
}

/// One device access (a read_u64 or a write_u64 of one word) through a cached handle, the
/// manager's fresh lookup, and GuestMemory's lookup over all regions, with `n` slots: each
/// timed `runs` times over `accesses` accesses (ns per access; the plain figures are the best).
fn access_test(n: u32, accesses: u64, runs: u32) -> crate::Result<serde_json::Value> {
    let (_vm, slots, whole) = test_vm("--access-slots", n)?;
    for (off, size) in windows(n) {
        slots.add(
            &whole.region,
            off,
            size,
            MEM_GPA + off,
            SlotFlags::default(),
        )?;
    }
    // The device's word: in the middle slot.
    let gpa = MEM_GPA + MEM_SIZE / 2 + 64;
    let specs: Vec<RegionSpec> = windows(n)
        .into_iter()
        .enumerate()
        .map(|(i, (off, size))| {
            RegionSpec::new(format!("r{i}"), MEM_GPA + off, size, Backend::Anon)
        })
        .collect();
    let linear = GuestMemory::new(&specs, None)?;

    let h = slots.map(gpa, 8)?;
    let time = |f: &mut dyn FnMut(u64) -> crate::Result<()>| -> crate::Result<Figure> {
        let mut ns = Vec::new();
        for _ in 0..runs {
            let t = Instant::now();
            for i in 0..accesses {
                f(i)?;
            }
            ns.push(t.elapsed().as_secs_f64() * 1e9 / accesses as f64);
        }
        Ok(Figure::measured(&ns))
    };
    let mut word = [0u8; 8];
    let figures = [
        time(&mut |_| h.read_u64(0).map(|_| ()).map_err(Into::into))?,
        time(&mut |i| Ok(h.write_u64(0, i)?))?,
        time(&mut |_| Ok(slots.read(gpa, &mut word)?))?,
        time(&mut |i| Ok(slots.write(gpa, &i.to_le_bytes())?))?,
        time(&mut |_| linear.read_u64(gpa).map(|_| ()).map_err(Into::into))?,
        time(&mut |i| Ok(linear.write_u64(gpa, i)?))?,
    ];
    let [cached_read, cached_write, fresh_read, fresh_write, linear_read, linear_write] =
        figures.clone().map(|f| f.min);
    let [cached_read_f, cached_write_f, fresh_read_f, fresh_write_f, linear_read_f, linear_write_f] =
        figures;
    Ok(json!({
        "slots": n,
        "cached_read_ns": cached_read,
        "cached_write_ns": cached_write,
        "fresh_read_ns": fresh_read,
        "fresh_write_ns": fresh_write,
        "linear_read_ns": linear_read,
        "linear_write_ns": linear_write,
        // The target's figure: the worse of read and write.
        "ratio_cached_vs_fresh": (cached_read / fresh_read).max(cached_write / fresh_write),
        "ratio_cached_vs_fresh_read": cached_read / fresh_read,
        "ratio_cached_vs_fresh_write": cached_write / fresh_write,
        "ratio_cached_vs_linear_read": cached_read / linear_read,
        "ratio_cached_vs_linear_write": cached_write / linear_write,
        "cached_read_ns_figure": cached_read_f,
        "cached_write_ns_figure": cached_write_f,
        "fresh_read_ns_figure": fresh_read_f,
        "fresh_write_ns_figure": fresh_write_f,
        "linear_read_ns_figure": linear_read_f,
        "linear_write_ns_figure": linear_write_f,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_counts_outside_the_kvm_limit_are_refused() {
        for n in [0, 32764, 40000] {
            let e = check_slot_count("--slots", n, 32764)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(&format!("--slots {n}")) && e.contains("1 to 32763"),
                "{e}"
            );
        }
        check_slot_count("--slots", 32763, 32764).unwrap();
        check_slot_count("--access-slots", 1, 32764).unwrap();
        assert_eq!(windows(3).iter().map(|w| w.1).sum::<u64>(), MEM_SIZE);
    }
}
