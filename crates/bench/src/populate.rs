//! `guestmem bench populate`: the population table (guest_memfd write() and the other methods).
//! Fills a fresh region with an image by plain mmap+memcpy (the baseline), then by each population
//! method, then copies once more into the already-populated memory (the floor: the copy alone).
//! Each method gets a fresh region; every result is checked byte for byte against the image outside
//! the timed part.

use guestmem_sys::to_usize;
use std::time::Instant;

use guestmem_memory::{
    populate_with, Backend, GuestMemory, Method, PopulateFrom, Populated, RegionSpec,
};
use serde::Serialize;

use crate::envelope::Figure;
use crate::units::parse_size;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Image and region size, e.g. 512M.
    #[arg(long, default_value = "512M", value_parser = parse_size)]
    size: u64,
    /// Region backend: gmem, memfd, anon, hugetlb, memfd-hugetlb.
    #[arg(long, default_value = "gmem")]
    backend: Backend,
    /// Share of the image's pages that are all zero (in runs of 64 KiB, or 2 MiB on hugetlb).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=100))]
    zero_percent: u8,
    /// Runs per method; the median is reported.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    runs: u32,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct MethodResult {
    method: Method,
    ms: f64,
    /// Every run of this method, with median (= `ms`), min and max.
    ms_figure: Figure,
    ratio_vs_memcpy: f64,
    pages_copied: u64,
    zero_pages_skipped: u64,
    threads: usize,
}

#[derive(Serialize)]
struct Output {
    size_bytes: u64,
    backend: Backend,
    zero_percent: u8,
    runs: u32,
    memcpy_ms: f64,
    memcpy_ms_figure: Figure,
    methods: Vec<MethodResult>,
    /// Methods that could not run here, with the reason.
    unavailable: Vec<(Method, String)>,
    /// The fastest method and its ratio to memcpy (the target: at most 0.5).
    best_method: Method,
    best_ms: f64,
    ratio_vs_memcpy: f64,
    /// Copying into memory that is already populated.
    floor_ms: f64,
    floor_ratio_vs_memcpy: f64,
}

const GPA: u64 = 1 << 32;

pub fn main(args: Args) -> crate::Result<()> {
    let page = args.backend.page_size();
    if args.size == 0 || !args.size.is_multiple_of(page) {
        return Err(format!(
            "--size {:#x} must be a non-zero multiple of the {} backend's page size ({page:#x})",
            args.size, args.backend
        )
        .into());
    }
    let image = make_image(args.size, args.zero_percent, page.max(64 << 10));
    let kvm = kvm_ioctls::Kvm::new()?;
    let vm = kvm.create_vm()?;
    let fresh = || -> crate::Result<GuestMemory> {
        let spec = RegionSpec::new("image", GPA, args.size, args.backend);
        Ok(GuestMemory::new(&[spec], Some(&vm))?)
    };

    // The runs interleave the baseline and every method (memcpy, floor, method 1, method 2,
    // memcpy, ...), so that the machine's drift weighs on all of them alike.
    let tried: Vec<Method> = Method::candidates(args.backend)
        .iter()
        .copied()
        .filter(|&m| m != Method::Memcpy) // the baseline, without zero skipping
        .collect();
    let mut memcpy_runs = Vec::new();
    let mut floor_runs = Vec::new();
    let mut method_runs = vec![Vec::new(); tried.len()];
    let mut last: Vec<Option<Populated>> = vec![None; tried.len()];
    for _ in 0..args.runs {
        let mem = fresh()?;
        let t = Instant::now();
        mem.write(GPA, &image)?;
        memcpy_runs.push(ms(t));
        let t = Instant::now();
        mem.write(GPA, &image)?;
        floor_runs.push(ms(t));
        check(&mem, &image, "memcpy")?;
        drop(mem);
        for (i, &method) in tried.iter().enumerate() {
            if last[i].as_ref().is_some_and(|done| done.method != method) {
                continue; // fell back: unavailable here
            }
            let mem = fresh()?;
            let region = &mem.regions()[0];
            let t = Instant::now();
            let done = populate_with(
                region,
                0,
                args.size,
                PopulateFrom::Bytes(&image),
                Some(method),
            )?;
            method_runs[i].push(ms(t));
            check(&mem, &image, method.name())?;
            last[i] = Some(done);
        }
    }
    let memcpy = Figure::measured(&memcpy_runs);
    let memcpy_ms = memcpy.median;
    let floor_ms = Figure::measured(&floor_runs).median;

    let (methods, unavailable) = results(tried, method_runs, last, memcpy_ms);
    let best = methods
        .iter()
        .min_by(|a, b| a.ms.total_cmp(&b.ms))
        .ok_or("no population method ran")?;
    let out = Output {
        size_bytes: args.size,
        backend: args.backend,
        zero_percent: args.zero_percent,
        runs: args.runs,
        memcpy_ms,
        memcpy_ms_figure: memcpy,
        best_method: best.method,
        best_ms: best.ms,
        ratio_vs_memcpy: best.ratio_vs_memcpy,
        floor_ms,
        floor_ratio_vs_memcpy: floor_ms / memcpy_ms,
        methods,
        unavailable,
    };
    if args.json {
        crate::envelope::print(&out)?;
        return Ok(());
    }
    print_text(&args, &out);
    Ok(())
}

/// Checks that `mem` holds `image` (after the population `what`).
fn check(mem: &GuestMemory, image: &[u8], what: &str) -> crate::Result<()> {
    let mut buf = vec![0u8; 1 << 20];
    for (i, chunk) in image.chunks(buf.len()).enumerate() {
        let gpa = GPA + (i * buf.len()) as u64;
        mem.read(gpa, &mut buf[..chunk.len()])?;
        if buf[..chunk.len()] != *chunk {
            return Err(format!("{what}: the region differs from the image near {gpa:#x}").into());
        }
    }
    Ok(())
}

/// Each method's figures, or why it was unavailable (the population fell back to another).
fn results(
    tried: Vec<Method>,
    method_runs: Vec<Vec<f64>>,
    last: Vec<Option<Populated>>,
    memcpy_ms: f64,
) -> (Vec<MethodResult>, Vec<(Method, String)>) {
    let mut methods = Vec::new();
    let mut unavailable = Vec::new();
    for ((method, runs), done) in tried.into_iter().zip(method_runs).zip(last) {
        let done = done.expect("at least one run");
        if done.method != method {
            unavailable.push((method, done.fallback_reason.unwrap_or_default()));
            continue;
        }
        let ms_figure = Figure::measured(&runs);
        let ms = ms_figure.median;
        methods.push(MethodResult {
            method,
            ms,
            ms_figure,
            ratio_vs_memcpy: ms / memcpy_ms,
            pages_copied: done.pages_copied,
            zero_pages_skipped: done.zero_pages_skipped,
            threads: done.threads,
        });
    }
    (methods, unavailable)
}

/// The figures as text.
fn print_text(args: &Args, out: &Output) {
    println!(
        "Populating {} MiB of {} ({}% zero pages, median of {} runs):",
        args.size >> 20,
        args.backend,
        args.zero_percent,
        args.runs
    );
    println!("- via memcpy: {:.0} ms", out.memcpy_ms);
    for &method in Method::candidates(args.backend) {
        if let Some(m) = out.methods.iter().find(|m| m.method == method) {
            println!(
                "- via {}: {:.0} ms ({:+.0}%)",
                m.method,
                m.ms,
                (m.ratio_vs_memcpy - 1.0) * 100.0
            );
        } else if let Some((m, why)) = out.unavailable.iter().find(|u| u.0 == method) {
            println!("- via {m}: unavailable ({why})");
        }
    }
    println!(
        "- floor, memcpy into populated memory: {:.0} ms ({:+.0}%)",
        out.floor_ms,
        (out.floor_ratio_vs_memcpy - 1.0) * 100.0
    );
    println!(
        "best: {} at {:.2}x memcpy",
        out.best_method, out.ratio_vs_memcpy
    );
}

/// `size` bytes where every 8-byte word is non-zero, except runs of `run` bytes chosen (by a
/// fixed hash) to make up `zero_percent` of the image.
fn make_image(size: u64, zero_percent: u8, run: u64) -> Vec<u8> {
    let mut image = vec![0u8; to_usize(size)];
    for (i, chunk) in image.chunks_mut(to_usize(run)).enumerate() {
        let h = (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        if (h >> 32) % 100 < u64::from(zero_percent) {
            continue;
        }
        for (j, word) in chunk.chunks_exact_mut(8).enumerate() {
            let v = (h ^ (j as u64)).wrapping_mul(0xbf58_476d_1ce4_e5b9) | 1;
            word.copy_from_slice(&v.to_le_bytes());
        }
    }
    image
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// The image holds about the share of zero runs asked for (each run all zero or without a
    /// zero word), and the same image for the same arguments.
    #[test]
    fn images_have_the_zero_share_asked_for() {
        let (size, run) = (4u64 << 20, 4096u64);
        let image = make_image(size, 30, run);
        assert_eq!(image.len() as u64, size);
        assert!(image == make_image(size, 30, run));
        let mut zero = 0;
        for chunk in image.chunks(to_usize(run)) {
            if chunk.iter().all(|&b| b == 0) {
                zero += 1;
            } else {
                assert!(chunk.chunks(8).all(|w| w.iter().any(|&b| b != 0)));
            }
        }
        let runs = size / run;
        assert!(
            (runs * 25 / 100..=runs * 35 / 100).contains(&zero),
            "{zero} of {runs}"
        );
        assert!(make_image(size, 0, run).chunks(8).all(|w| w != [0; 8]));
        assert!(make_image(size, 100, run).iter().all(|&b| b == 0));
    }

    /// The check finds a differing byte and names where; an equal region passes.
    #[test]
    fn the_check_names_where_the_region_differs() {
        let image = make_image(3 << 20, 10, 4096);
        let spec = RegionSpec::new("ram", GPA, 3 << 20, Backend::Anon);
        let mem = GuestMemory::new(&[spec], None).unwrap();
        mem.write(GPA, &image).unwrap();
        check(&mem, &image, "memcpy").unwrap();
        mem.write(GPA + (2 << 20) + 5, &[!image[(2 << 20) + 5]])
            .unwrap();
        assert_eq!(
            check(&mem, &image, "pwrite").unwrap_err().to_string(),
            "pwrite: the region differs from the image near 0x100200000"
        );
    }

    /// A method whose population fell back to another is reported unavailable with the
    /// reason; the others get their median time against memcpy's.
    #[test]
    fn fallbacks_are_reported_unavailable() {
        let done = |method, reason: Option<&str>| Populated {
            method,
            fallback_reason: reason.map(String::from),
            bytes: 8192,
            pages_copied: 2,
            zero_pages_skipped: 0,
            threads: 1,
            elapsed: Duration::ZERO,
        };
        let (methods, unavailable) = results(
            vec![Method::Pwrite, Method::PopulateCopy],
            vec![vec![9.0, 10.0, 30.0], vec![4.0, 5.0, 6.0]],
            vec![
                Some(done(Method::PopulateCopy, Some("no pwrite here"))),
                Some(done(Method::PopulateCopy, None)),
            ],
            10.0,
        );
        assert_eq!(
            unavailable,
            vec![(Method::Pwrite, "no pwrite here".to_string())]
        );
        assert_eq!(methods.len(), 1);
        assert_eq!(methods[0].method, Method::PopulateCopy);
        assert_eq!((methods[0].ms, methods[0].ratio_vs_memcpy), (5.0, 0.5));
    }
}
