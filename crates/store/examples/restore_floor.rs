//! The CPU a restore from the chunk store cannot avoid on a given image: every non-zero chunk
//! stored as the store stores it (256 KiB, zstd level 1), then decompressed and checked against
//! its BLAKE3 hash, as a restore does before a byte reaches the guest, on one thread and timed
//! per step. What it prints is a floor for `bench snapshot`'s store restores on this host (the
//! server, the S3 client and installing the pages come on top), beside the same for LZ4, which
//! decompresses faster but stores more.
//! `cargo run --release -p guestmem-store --example restore_floor -- IMAGE.raw.zst`

use std::io::Read;
use std::time::Instant;

use guestmem_store::chunk::{CHUNK_BYTES, ZSTD_LEVEL};
use guestmem_sys::to_usize;

fn load(path: &str) -> Vec<u8> {
    let f = std::fs::File::open(path).expect("open image");
    let mut d = zstd::stream::read::Decoder::new(f).expect("zstd");
    let mut v = Vec::new();
    d.read_to_end(&mut v).expect("read image");
    v
}

fn main() {
    let path = std::env::args()
        .nth(1)
        .expect("usage: restore_floor IMAGE.raw.zst");
    let image = load(&path);
    let size = to_usize(CHUNK_BYTES);
    let chunks: Vec<&[u8]> = image
        .chunks(size)
        .filter(|c| c.iter().any(|&b| b != 0))
        .collect();
    let mut zc = zstd::bulk::Compressor::new(ZSTD_LEVEL).expect("zstd compressor");
    let zstd: Vec<Vec<u8>> = chunks.iter().map(|c| zc.compress(c).unwrap()).collect();
    let lz4: Vec<Vec<u8>> = chunks
        .iter()
        .map(|c| lz4_flex::block::compress(c))
        .collect();
    let hashes: Vec<blake3::Hash> = chunks.iter().map(|c| blake3::hash(c)).collect();
    let gib = image.len() as f64 / (1u64 << 30) as f64;
    let stored = |v: &[Vec<u8>]| v.iter().map(Vec::len).sum::<usize>() as f64 / image.len() as f64;
    println!(
        "{path}: {:.2} GiB, {} non-zero chunks of {} KiB; stored zstd {:.3}x, lz4 {:.3}x of memory",
        gib,
        chunks.len(),
        size >> 10,
        stored(&zstd),
        stored(&lz4)
    );

    let mut out = vec![0u8; size];
    let mut zd = zstd::bulk::Decompressor::new().expect("zstd decompressor");
    let best = |f: &mut dyn FnMut()| {
        (0..3)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min)
    };
    let t_zstd = best(&mut || {
        for (z, c) in zstd.iter().zip(&chunks) {
            let n = zd.decompress_to_buffer(z, &mut out).unwrap();
            assert_eq!(n, c.len());
        }
    });
    let t_lz4 = best(&mut || {
        for (z, c) in lz4.iter().zip(&chunks) {
            let n = lz4_flex::block::decompress_into(z, &mut out).unwrap();
            assert_eq!(n, c.len());
        }
    });
    let t_hash = best(&mut || {
        for (c, h) in chunks.iter().zip(&hashes) {
            assert_eq!(&blake3::hash(c), h);
        }
    });
    let t_hash_stored = best(&mut || {
        for z in &zstd {
            std::hint::black_box(blake3::hash(z));
        }
    });
    let per_gib = |t: f64| t / gib;
    println!(
        "one thread, CPU s per GiB of guest memory (best of 3): zstd decompress {:.3}, lz4 \
         decompress {:.3}, BLAKE3 of the chunks {:.3}, BLAKE3 of the zstd bytes {:.3}",
        per_gib(t_zstd),
        per_gib(t_lz4),
        per_gib(t_hash),
        per_gib(t_hash_stored)
    );
    println!(
        "floor of a zstd store restore's checks on 2 cores: {:.3} s per GiB (decompress + hash, \
         perfectly split, nothing else running)",
        per_gib(t_zstd + t_hash) / 2.0
    );
}
