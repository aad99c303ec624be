//! Measures what chunk size the store should use on real guest memory: for each candidate size,
//! the stored bytes (zero chunks skipped, the rest zstd-compressed, identical chunks once) of
//! each image, and how much of a second image is already stored by the first (dedup across
//! snapshots). `cargo run --release -p guestmem-store --example chunk_size -- A.raw.zst B.raw.zst`

use std::collections::HashSet;
use std::io::Read;
use std::time::Instant;

fn load(path: &str) -> Vec<u8> {
    let f = std::fs::File::open(path).expect("open image");
    let mut d = zstd::stream::read::Decoder::new(f).expect("zstd");
    let mut v = Vec::new();
    d.read_to_end(&mut v).expect("read image");
    v
}

/// (hash, compressed len) per non-zero chunk, compressed on two threads.
fn chunks(mem: &[u8], size: usize, level: i32) -> Vec<([u8; 32], usize)> {
    let all: Vec<&[u8]> = mem.chunks(size).collect();
    let half = all.len() / 2;
    let work = |part: &[&[u8]]| {
        let mut c = zstd::bulk::Compressor::new(level).unwrap();
        part.iter()
            .filter(|c| c.iter().any(|&b| b != 0))
            .map(|chunk| {
                (
                    *blake3::hash(chunk).as_bytes(),
                    c.compress(chunk).unwrap().len(),
                )
            })
            .collect::<Vec<_>>()
    };
    std::thread::scope(|s| {
        let a = s.spawn(|| work(&all[..half]));
        let mut b = work(&all[half..]);
        let mut a = a.join().unwrap();
        a.append(&mut b);
        a
    })
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let a = load(&args[0]);
    let b = load(&args[1]);
    let level: i32 = std::env::var("LEVEL")
        .ok()
        .and_then(|l| l.parse().ok())
        .unwrap_or(1);
    println!("zstd level {level}; {} and {}", args[0], args[1]);
    let sizes: Vec<usize> = std::env::var("SIZES_KIB").ok().map_or_else(
        || vec![64 << 10, 256 << 10, 1 << 20, 2 << 20],
        |s| {
            s.split(',')
                .map(|k| k.parse::<usize>().expect("KiB") << 10)
                .collect()
        },
    );
    for size in sizes {
        let t = Instant::now();
        let ca = chunks(&a, size, level);
        let secs = t.elapsed().as_secs_f64();
        let cb = chunks(&b, size, level);
        let mut seen = HashSet::new();
        let stored_a: usize = ca
            .iter()
            .filter(|(h, _)| seen.insert(*h))
            .map(|c| c.1)
            .sum();
        let new_b: usize = cb
            .iter()
            .filter(|(h, _)| seen.insert(*h))
            .map(|c| c.1)
            .sum();
        let mut seen_b = HashSet::new();
        let stored_b: usize = cb
            .iter()
            .filter(|(h, _)| seen_b.insert(*h))
            .map(|c| c.1)
            .sum();
        println!(
            "chunk {:>5} KiB: A {} non-zero chunks, stored {:.3}x of memory ({:.0} MiB), {:.2} GiB/s \
             of guest memory on 2 threads; B alone {:.3}x; B after A adds {:.0} MiB ({:.1} % of B \
             shared with A); A+B {:.3}x of one image",
            size >> 10,
            ca.len(),
            stored_a as f64 / a.len() as f64,
            stored_a as f64 / 1048576.0,
            a.len() as f64 / secs / (1u64 << 30) as f64,
            stored_b as f64 / b.len() as f64,
            new_b as f64 / 1048576.0,
            100.0 * (1.0 - new_b as f64 / stored_b as f64),
            (stored_a + new_b) as f64 / stored_a as f64,
        );
    }
}
