//! `guestmem bench floor` (the migration CPU floor): the least CPU a migration's two ends can spend
//! per GiB of pages, measured outside guestmem's receive and send paths, on a real guest-memory
//! image.
//!
//! The image's pages are cut into frames as a pre-copy source's first round cuts them (runs of
//! non-zero pages inside each 2 MiB block, zero lines squeezed out, [`Frame::encode_pages_with`])
//! and compressed per frame as guestmem sends them ([`compress_pages`]: zstd at
//! [`ZSTD_LEVEL`], LZ4, or none; a frame that does not shrink stays plain). Then, per codec:
//!
//! - the destination's floor: each frame decompressed with the same crate (zstd's bulk
//!   decompressor, `lz4_flex`) into a reused buffer, and its pages copied once into a fresh
//!   anonymous mapping of the image's size, as a receiver must, the cheaper of two ways:
//!   `memcpy` (each page whole, or line by line; a page fault and the kernel's page clear
//!   per page) or `UFFDIO_COPY` (runs of whole pages straight from the buffer, pages with
//!   zero lines spread into a page-sized buffer first; no fault, no clear):
//!   `dest_floor_cpu_s_per_gib`, with each way's figure (`dest_floor_memcpy_cpu_s_per_gib`,
//!   `dest_floor_uffd_cpu_s_per_gib`). Its parts: `decompress_cpu_s_per_gib` (into the
//!   reused buffer only), and the `memcpy` into the fresh mapping alone
//!   (`copy_fresh_cpu_s_per_gib`: on a virtual host this includes the hypervisor backing each
//!   new page) and again into the same, now present, pages (`copy_present_cpu_s_per_gib`:
//!   the copy alone);
//! - the source's floor: each encoded frame compressed with the crate's own call, plus one
//!   copy of the pages out of guest memory (`copy_present_cpu_s_per_gib`):
//!   `source_floor_cpu_s_per_gib`;
//! - beside the floors, what a receiver spends on its transport: the frames' bytes read from
//!   a guestmem connection (TLS 1.3 over loopback TCP, as a migration's pages connections, the
//!   kernel's TLS where it has it: `bench transport`) into a reused buffer, nothing else done
//!   with them (`tls_receive_cpu_s_per_gib`). The
//!   destination's floor leaves it out; `bench migrate` gives its CPU over both as well.
//!
//! CPU time is the measuring thread's (`getrusage(RUSAGE_THREAD)`: user and system, so page
//! faults count), per GiB of pages the frames carry (zero pages of the image are not sent, as
//! in a migration's first round). Each figure is the median of `--runs` (each with a new fresh
//! mapping). `bench migrate --image` measures this too and divides its ends' CPU by it.

use guestmem_sys::to_usize;

use crate::cpu::thread_cpu_s;
use std::path::{Path, PathBuf};

use guestmem_migration::compress::ZSTD_LEVEL;
use guestmem_migration::stream::{compress_pages, Codec, Encoding, Frame};
use serde::Serialize;

const PAGE: usize = 4096;
const LINE: usize = 64;
/// A frame never crosses a 2 MiB block (as the source cuts them).
const BLOCK: usize = 2 << 20;
/// The frame header (magic, kind, length), a Pages payload's own header (gpa, count, flags)
/// and a PagesZ payload's (codec, reserved, inner length): see `guestmem_migration::stream`.
const HEADER: usize = 12;
const PAGES_HEADER: usize = 16;
const Z_HEADER: usize = 8;
/// The PagesZ frame kind.
const PAGES_Z: u8 = 12;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The guest-memory image (raw or zstd-compressed), e.g.
    /// ~/.cache/guestmem/images/linux-2G-load.raw.zst.
    #[arg(long, value_name = "FILE")]
    image: PathBuf,
    /// Codecs to measure: zstd (at guestmem's level), lz4, none.
    #[arg(long, default_value = "zstd,lz4,none", value_delimiter = ',')]
    codecs: Vec<FloorCodec>,
    /// Runs per codec; every figure is the median.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

/// A codec of the floor, as `--compress` names them.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum FloorCodec {
    Zstd,
    Lz4,
    None,
}

impl FloorCodec {
    fn codec(self) -> Codec {
        match self {
            FloorCodec::Zstd => Codec::Zstd(ZSTD_LEVEL),
            FloorCodec::Lz4 => Codec::Lz4,
            FloorCodec::None => Codec::None,
        }
    }
}

/// The floor of one codec.
#[derive(Serialize, Clone, Debug)]
pub struct CodecFloor {
    pub codec: FloorCodec,
    /// Frames, the pages they carry, and their bytes on the wire.
    pub frames: usize,
    pub page_bytes: u64,
    pub wire_bytes: u64,
    /// Decompression and one copy into a fresh mapping, per GiB of pages: the cheaper of
    /// the two ways, and each.
    pub dest_floor_cpu_s_per_gib: f64,
    pub dest_floor_memcpy_cpu_s_per_gib: f64,
    pub dest_floor_uffd_cpu_s_per_gib: f64,
    pub decompress_cpu_s_per_gib: f64,
    pub copy_fresh_cpu_s_per_gib: f64,
    pub copy_present_cpu_s_per_gib: f64,
    /// Compression of the encoded frames and one copy of their pages, per GiB of pages.
    pub source_floor_cpu_s_per_gib: f64,
    /// Reading the frames' bytes from a guestmem connection (TLS over loopback TCP, as a
    /// migration's pages connections) and nothing else, per GiB of pages: what a receiver
    /// spends on its transport, outside the floor above.
    pub tls_receive_cpu_s_per_gib: f64,
    /// Each run's destination floors (`memcpy`, `UFFDIO_COPY`).
    pub dest_floor_memcpy_cpu_s_per_gib_runs: Vec<f64>,
    pub dest_floor_uffd_cpu_s_per_gib_runs: Vec<f64>,
}

#[derive(Serialize)]
struct Output {
    image: PathBuf,
    image_bytes: u64,
    zstd_level: i32,
    runs: usize,
    floors: Vec<CodecFloor>,
}

pub fn main(args: Args) -> crate::Result<()> {
    if args.runs == 0 || args.codecs.is_empty() {
        return Err("--runs and --codecs each need at least one".into());
    }
    let image = read_image(&args.image)?;
    let floors = measure(&image, &args.codecs, args.runs)?;
    let out = Output {
        image: args.image.clone(),
        image_bytes: image.len() as u64,
        zstd_level: ZSTD_LEVEL,
        runs: args.runs,
        floors,
    };
    if args.json {
        crate::envelope::print(&out)?;
    } else {
        println!(
            "CPU floor of a migration's ends on {} ({} MiB), CPU-s per GiB of pages sent, \
             median of {} run(s); dest = decompress + one copy into a fresh mapping (the \
             cheaper of memcpy and UFFDIO_COPY)",
            out.image.display(),
            out.image_bytes >> 20,
            out.runs
        );
        println!(
            "{:>6} {:>7} {:>9} {:>9} {:>9} {:>9} {:>11} {:>11} {:>12} {:>11} {:>11} {:>11}",
            "codec",
            "frames",
            "wire MiB",
            "dest",
            "memcpy",
            "uffd",
            "decompress",
            "copy fresh",
            "copy present",
            "source",
            "tls receive",
            "pages MiB"
        );
        for f in &out.floors {
            println!(
                "{:>6} {:>7} {:>9.0} {:>9.3} {:>9.3} {:>9.3} {:>11.3} {:>11.3} {:>12.3} {:>11.3} {:>11.3} {:>11.0}",
                format!("{:?}", f.codec).to_lowercase(),
                f.frames,
                f.wire_bytes as f64 / f64::from(1 << 20),
                f.dest_floor_cpu_s_per_gib,
                f.dest_floor_memcpy_cpu_s_per_gib,
                f.dest_floor_uffd_cpu_s_per_gib,
                f.decompress_cpu_s_per_gib,
                f.copy_fresh_cpu_s_per_gib,
                f.copy_present_cpu_s_per_gib,
                f.source_floor_cpu_s_per_gib,
                f.tls_receive_cpu_s_per_gib,
                f.page_bytes as f64 / f64::from(1 << 20)
            );
        }
    }
    Ok(())
}

/// The image's bytes (a zstd-compressed image decompressed).
pub fn read_image(path: &Path) -> crate::Result<Vec<u8>> {
    let bytes = std::fs::read(path).map_err(|e| format!("--image {}: {e}", path.display()))?;
    let image = if bytes.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        let mut out = Vec::new();
        let mut d = zstd::stream::read::Decoder::new(&bytes[..])?;
        std::io::copy(&mut d, &mut out)?;
        out
    } else {
        bytes
    };
    if image.is_empty() || !image.len().is_multiple_of(PAGE) {
        return Err(format!("{}: not a whole number of pages", path.display()).into());
    }
    Ok(image)
}

/// The floor of each of `codecs` on `image`, medians of `runs`.
pub fn measure(image: &[u8], codecs: &[FloorCodec], runs: usize) -> crate::Result<Vec<CodecFloor>> {
    let mut floors = Vec::new();
    for &codec in codecs {
        let (frames, page_bytes, source_s) = encode(image, codec.codec())?;
        let gib = page_bytes as f64 / (1u64 << 30) as f64;
        let mut dest = Vec::new();
        let mut uffd = Vec::new();
        let mut decompress = Vec::new();
        let mut fresh = Vec::new();
        let mut present = Vec::new();
        let mut tls = Vec::new();
        for _ in 0..runs {
            tls.push(crate::transport::receive(&frames, true)?.receive_s / gib);
            dest.push(receive(&frames, image.len(), Pass::Both)? / gib);
            uffd.push(receive(&frames, image.len(), Pass::Uffd)? / gib);
            decompress.push(receive(&frames, image.len(), Pass::Decompress)? / gib);
            let (f, p) = copy_only(&frames, image.len())?;
            fresh.push(f / gib);
            present.push(p / gib);
        }
        floors.push(CodecFloor {
            codec,
            frames: frames.len(),
            page_bytes,
            wire_bytes: frames.iter().map(|f| f.len() as u64).sum(),
            dest_floor_cpu_s_per_gib: median(dest.clone()).min(median(uffd.clone())),
            dest_floor_memcpy_cpu_s_per_gib: median(dest.clone()),
            dest_floor_uffd_cpu_s_per_gib: median(uffd.clone()),
            decompress_cpu_s_per_gib: median(decompress),
            copy_fresh_cpu_s_per_gib: median(fresh),
            copy_present_cpu_s_per_gib: median(present.clone()),
            source_floor_cpu_s_per_gib: source_s / gib + median(present.clone()),
            tls_receive_cpu_s_per_gib: median(tls),
            dest_floor_memcpy_cpu_s_per_gib_runs: dest,
            dest_floor_uffd_cpu_s_per_gib_runs: uffd,
        });
    }
    Ok(floors)
}

/// The image cut into frames and compressed with `codec`; the pages they carry, and the CPU
/// seconds the compression calls alone took.
fn encode(image: &[u8], codec: Codec) -> crate::Result<(Vec<Vec<u8>>, u64, f64)> {
    let mut frames = Vec::new();
    let mut page_bytes = 0u64;
    let mut out = Vec::new();
    let mut scratch = Vec::new();
    let mut compress_s = 0.0;
    let mut zstd = zstd::bulk::Compressor::new(ZSTD_LEVEL)?;
    for (b, block) in image.chunks(BLOCK).enumerate() {
        let zero: Vec<bool> = block
            .chunks_exact(PAGE)
            .map(|p| p.iter().all(|&x| x == 0))
            .collect();
        let mut p = 0;
        while p < zero.len() {
            let run = zero[p..].iter().take_while(|&&z| z == zero[p]).count();
            if !zero[p] {
                let bytes = &block[p * PAGE..(p + run) * PAGE];
                let gpa = (b * BLOCK + p * PAGE) as u64;
                // As a migration's writers encode them: no CRC, the channel checks the bytes.
                let encoding = Encoding {
                    whole_pages: false,
                    no_crc: true,
                };
                Frame::encode_pages_with(
                    &mut out,
                    gpa,
                    bytes.len(),
                    true,
                    encoding,
                    |at, piece| {
                        piece.copy_from_slice(&bytes[at..at + piece.len()]);
                        Ok(())
                    },
                )?;
                // The compression call alone, as the source makes it (into a buffer of the
                // bound), for the source's floor.
                let t = thread_cpu_s();
                match codec {
                    Codec::Zstd(_) => {
                        let bound = zstd::zstd_safe::compress_bound(out.len());
                        scratch.resize(bound.max(scratch.len()), 0);
                        zstd.compress_to_buffer(&out[..], &mut scratch[..bound])?;
                    }
                    Codec::Lz4 => {
                        let bound = lz4_flex::block::get_maximum_output_size(out.len());
                        scratch.resize(bound.max(scratch.len()), 0);
                        lz4_flex::block::compress_into(&out, &mut scratch[..bound])?;
                    }
                    Codec::None => {}
                }
                compress_s += thread_cpu_s() - t;
                compress_pages(&mut out, codec, &mut scratch)?;
                frames.push(out.clone());
                page_bytes += bytes.len() as u64;
            }
            p += run;
        }
    }
    Ok((frames, page_bytes, compress_s))
}

#[derive(Clone, Copy, PartialEq)]
enum Pass {
    /// Decompress each frame and copy its pages into the fresh mapping.
    Both,
    /// The same, the pages copied by `UFFDIO_COPY`.
    Uffd,
    /// Decompress only.
    Decompress,
}

/// CPU seconds to decompress `frames` (and, for [`Pass::Both`], copy their pages once into a
/// fresh mapping of `size` bytes).
fn receive(frames: &[Vec<u8>], size: usize, pass: Pass) -> crate::Result<f64> {
    let mut map = Fresh::new(size)?;
    let mut inflated = vec![0u8; HEADER + PAGES_HEADER + 8 * (BLOCK / PAGE) + BLOCK + 4];
    let mut zstd = zstd::bulk::Decompressor::new()?;
    let uffd = match pass {
        Pass::Uffd => Some(Registered::new(&mut map)?),
        _ => None,
    };
    let mut page = vec![0u8; PAGE];
    let t = thread_cpu_s();
    for f in frames {
        let inner: &[u8] = if f[4] == PAGES_Z {
            let codec = f[HEADER];
            let len = u32::from_le_bytes(f[HEADER + 4..HEADER + 8].try_into().expect("4")) as usize;
            let z = &f[HEADER + Z_HEADER..f.len() - 4];
            let got = match codec {
                1 => lz4_flex::block::decompress_into(z, &mut inflated[..len])?,
                _ => zstd.decompress_to_buffer(z, &mut inflated[..len])?,
            };
            if got != len {
                return Err(format!("{got} bytes decompressed, {len} announced").into());
            }
            &inflated[..len]
        } else {
            f
        };
        match &uffd {
            Some(u) => u.spread(inner, &mut page)?,
            None if pass == Pass::Both => spread(inner, map.bytes()),
            None => {}
        }
    }
    let secs = thread_cpu_s() - t;
    drop(uffd);
    std::hint::black_box(map.bytes());
    Ok(secs)
}

/// A fresh mapping registered with userfaultfd (missing pages), so that `UFFDIO_COPY` fills it.
struct Registered {
    uffd: userfaultfd::Uffd,
    base: usize,
    len: usize,
}

impl Registered {
    fn new(map: &mut Fresh) -> crate::Result<Registered> {
        let uffd = userfaultfd::UffdBuilder::new()
            .close_on_exec(true)
            .non_blocking(true)
            .user_mode_only(true)
            .create()
            .map_err(|e| format!("userfaultfd: {e}"))?;
        let (base, len) = (map.ptr as usize, map.len);
        uffd.register(map.ptr.cast(), len)
            .map_err(|e| format!("UFFDIO_REGISTER: {e}"))?;
        Ok(Registered { uffd, base, len })
    }

    /// Copies `len` bytes from `src` to `offset` of the mapping (missing pages).
    fn copy(&self, src: &[u8], offset: usize) -> crate::Result<()> {
        if offset + src.len() > self.len {
            return Err(format!("a frame's pages at {offset:#x} lie outside the image").into());
        }
        let mut done = 0;
        while done < src.len() {
            // SAFETY: the destination lies inside the registered mapping (checked above), whose
            // pages are missing (each is copied once); `src` is borrowed for the call.
            let r = unsafe {
                self.uffd.copy(
                    src[done..].as_ptr().cast(),
                    (self.base + offset + done) as *mut libc::c_void,
                    src.len() - done,
                    true,
                )
            };
            match r {
                Ok(n) | Err(userfaultfd::Error::PartiallyCopied(n)) if n > 0 => done += n,
                Ok(_) | Err(userfaultfd::Error::PartiallyCopied(_)) => {}
                Err(e) => return Err(format!("UFFDIO_COPY: {e}").into()),
            }
        }
        Ok(())
    }

    /// [`spread`] by `UFFDIO_COPY`: runs of whole pages straight from `frame`, a page with zero
    /// lines through `page`.
    fn spread(&self, frame: &[u8], page: &mut [u8]) -> crate::Result<()> {
        let gpa = to_usize(u64::from_le_bytes(
            frame[HEADER..HEADER + 8].try_into().expect("8"),
        ));
        let count =
            u32::from_le_bytes(frame[HEADER + 8..HEADER + 12].try_into().expect("4")) as usize;
        let masks: Vec<u64> = frame[HEADER + PAGES_HEADER..HEADER + PAGES_HEADER + 8 * count]
            .chunks_exact(8)
            .map(|m| u64::from_le_bytes(m.try_into().expect("8")))
            .collect();
        let mut at = HEADER + PAGES_HEADER + 8 * count;
        let mut p = 0;
        while p < count {
            if masks[p] == u64::MAX {
                let run = masks[p..].iter().take_while(|&&m| m == u64::MAX).count();
                self.copy(&frame[at..at + run * PAGE], gpa + p * PAGE)?;
                (p, at) = (p + run, at + run * PAGE);
                continue;
            }
            for (l, line) in page.chunks_exact_mut(LINE).enumerate() {
                if masks[p] >> l & 1 == 1 {
                    line.copy_from_slice(&frame[at..at + LINE]);
                    at += LINE;
                } else {
                    line.fill(0);
                }
            }
            self.copy(page, gpa + p * PAGE)?;
            p += 1;
        }
        Ok(())
    }
}

/// CPU seconds to copy the (plain) pages of `frames` into a fresh mapping, then again into the
/// same pages, now present.
fn copy_only(frames: &[Vec<u8>], size: usize) -> crate::Result<(f64, f64)> {
    // The frames' inner Pages frames, decompressed beforehand (outside the clock).
    let mut zstd = zstd::bulk::Decompressor::new()?;
    let inner: Vec<Vec<u8>> = frames
        .iter()
        .map(|f| -> crate::Result<Vec<u8>> {
            if f[4] != PAGES_Z {
                return Ok(f.clone());
            }
            let len = u32::from_le_bytes(f[HEADER + 4..HEADER + 8].try_into().expect("4")) as usize;
            let z = &f[HEADER + Z_HEADER..f.len() - 4];
            Ok(match f[HEADER] {
                1 => lz4_flex::block::decompress(z, len)?,
                _ => zstd.decompress(z, len)?,
            })
        })
        .collect::<crate::Result<_>>()?;
    let mut map = Fresh::new(size)?;
    let t = thread_cpu_s();
    inner.iter().for_each(|f| spread(f, map.bytes()));
    let fresh = thread_cpu_s() - t;
    let t = thread_cpu_s();
    inner.iter().for_each(|f| spread(f, map.bytes()));
    let present = thread_cpu_s() - t;
    std::hint::black_box(map.bytes());
    Ok((fresh, present))
}

/// Copies a (plain) Pages frame's lines to their pages in `memory`: whole pages with one copy,
/// the others line by line (their zero lines left as the fresh mapping has them).
fn spread(frame: &[u8], memory: &mut [u8]) {
    let gpa = to_usize(u64::from_le_bytes(
        frame[HEADER..HEADER + 8].try_into().expect("8"),
    ));
    let count = u32::from_le_bytes(frame[HEADER + 8..HEADER + 12].try_into().expect("4")) as usize;
    let masks = &frame[HEADER + PAGES_HEADER..HEADER + PAGES_HEADER + 8 * count];
    let mut at = HEADER + PAGES_HEADER + 8 * count;
    for (p, m) in masks.chunks_exact(8).enumerate() {
        let mask = u64::from_le_bytes(m.try_into().expect("8"));
        let page = &mut memory[gpa + p * PAGE..gpa + (p + 1) * PAGE];
        if mask == u64::MAX {
            page.copy_from_slice(&frame[at..at + PAGE]);
            at += PAGE;
            continue;
        }
        for l in (0..PAGE / LINE).filter(|l| mask >> l & 1 == 1) {
            page[l * LINE..(l + 1) * LINE].copy_from_slice(&frame[at..at + LINE]);
            at += LINE;
        }
    }
}

/// A fresh anonymous mapping (no page touched), unmapped when dropped.
struct Fresh {
    ptr: *mut u8,
    len: usize,
}

impl Fresh {
    fn new(len: usize) -> crate::Result<Fresh> {
        // SAFETY: a new private anonymous mapping; nothing else refers to it.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(format!("mmap of {len} bytes: {}", std::io::Error::last_os_error()).into());
        }
        Ok(Fresh {
            ptr: ptr.cast(),
            len,
        })
    }

    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: the mapping is live for `self`'s life, `len` bytes, and only borrowed
        // through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Fresh {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, no longer borrowed.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The frames the floor decodes put the image's bytes back where they were.
    #[test]
    #[allow(clippy::cast_possible_truncation)] // test data: the low byte of a pattern.
    fn frames_spread_back_to_the_image() {
        let mut image = vec![0u8; 2 * BLOCK];
        for (i, b) in image.iter_mut().enumerate() {
            // Whole pages, pages with a few lines, zero pages.
            let page = i / PAGE;
            if page.is_multiple_of(3) || (page % 3 == 1 && (i % PAGE) < 2 * LINE) {
                *b = (i % 251) as u8;
            }
        }
        for codec in [Codec::Zstd(ZSTD_LEVEL), Codec::Lz4, Codec::None] {
            let (frames, page_bytes, _) = encode(&image, codec).unwrap();
            assert!(page_bytes < image.len() as u64);
            let mut zstd = zstd::bulk::Decompressor::new().unwrap();
            let mut memory = vec![0u8; image.len()];
            for f in &frames {
                let inner = if f[4] == PAGES_Z {
                    let len = u32::from_le_bytes(f[16..20].try_into().unwrap()) as usize;
                    let z = &f[HEADER + Z_HEADER..f.len() - 4];
                    match f[HEADER] {
                        1 => lz4_flex::block::decompress(z, len).unwrap(),
                        _ => zstd.decompress(z, len).unwrap(),
                    }
                } else {
                    f.clone()
                };
                spread(&inner, &mut memory);
            }
            assert!(memory == image, "{codec:?}");
            assert!(receive(&frames, image.len(), Pass::Both).unwrap() >= 0.0);
            // UFFDIO_COPY lands the same bytes.
            let mut map = Fresh::new(image.len()).unwrap();
            let uffd = Registered::new(&mut map).unwrap();
            let mut page = vec![0u8; PAGE];
            for f in &frames {
                let inner = if f[4] == PAGES_Z {
                    let len = u32::from_le_bytes(f[16..20].try_into().unwrap()) as usize;
                    let z = &f[HEADER + Z_HEADER..f.len() - 4];
                    match f[HEADER] {
                        1 => lz4_flex::block::decompress(z, len).unwrap(),
                        _ => zstd.decompress(z, len).unwrap(),
                    }
                } else {
                    f.clone()
                };
                uffd.spread(&inner, &mut page).unwrap();
            }
            drop(uffd);
            // Pages never copied (the zero ones) read as zero once unregistered.
            assert!(map.bytes() == &image[..], "{codec:?} by UFFDIO_COPY");
        }
    }
}
