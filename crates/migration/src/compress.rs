//! Which compression a migration's Pages frames get, and, for [`Compress::Auto`], choosing it
//! from what limits the transfer.
//!
//! Compressing a frame costs the writer thread CPU time and saves it wire time. Per byte of
//! pages, a writer spends `c + w / r` with a codec (compression time per byte, plus the wire
//! time of what is left at ratio `r`) and `w` without: a codec pays when `c < w (1 - 1/r)`. The
//! wire time `w` is what the writers measure around their socket writes (their sockets stay
//! full on a link that is the bottleneck, so a write lasts as long as the link takes; on a fast
//! link the encryption and copy dominate and `w` is small), `c` and `r` what they measure
//! compressing. [`Compressor`] keeps running averages of the three, shared by all writers of a
//! migration, and picks for each frame the codec with the least time per byte; every
//! [`PROBE_EVERY`]-th frame tries another codec so that its figures stay current.

use std::sync::Mutex;
use std::time::Duration;

use serde::Serialize;

use crate::stream::Codec;

/// Every this many frames a writer tries a codec other than the chosen one (auto mode).
pub const PROBE_EVERY: u64 = 16;
/// The zstd level of [`Compress::Zstd`] and of auto mode: the one that compresses real guest
/// memory about 2.6x at roughly three times LZ4's CPU cost.
pub const ZSTD_LEVEL: i32 = 1;
/// Weight of the newest sample in the running averages.
const ALPHA: f64 = 0.2;

/// How a migration compresses its Pages frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Compress {
    /// Never (zero pages and zero lines are still left out).
    #[default]
    None,
    /// LZ4, always.
    Lz4,
    /// zstd, always.
    Zstd,
    /// Whichever of none, LZ4 and zstd moves pages fastest, as measured while migrating.
    Auto,
}

impl std::str::FromStr for Compress {
    type Err = String;
    fn from_str(s: &str) -> Result<Compress, String> {
        match s {
            "none" => Ok(Compress::None),
            "lz4" => Ok(Compress::Lz4),
            "zstd" => Ok(Compress::Zstd),
            "auto" => Ok(Compress::Auto),
            _ => Err(format!(
                "unknown compression '{s}' (none, lz4, zstd or auto)"
            )),
        }
    }
}

/// Parses a zstd stream window in MiB as the command lines take it (`--zstd-window-mib`):
/// `off` or `0` (frames compressed one by one) or a number of MiB; returns bytes (whether it
/// is a power of two is checked with the other options, see
/// [`crate::migrate::SendOptions::zstd_window_bytes`]).
pub fn parse_zstd_window_mib(s: &str) -> Result<u64, String> {
    if s == "off" {
        return Ok(0);
    }
    let mib: u64 = s
        .parse()
        .map_err(|_| format!("zstd window '{s}': a number of MiB, or off"))?;
    mib.checked_mul(1 << 20)
        .filter(|&b| b <= 1 << crate::stream::ZSTD_WINDOW_LOG_MAX)
        .ok_or_else(|| format!("zstd window of {mib} MiB: at most 1024"))
}

/// The codecs auto mode chooses from, in probe order.
const CANDIDATES: [Codec; 3] = [Codec::None, Codec::Lz4, Codec::Zstd(ZSTD_LEVEL)];

/// What the frames of one migration got, for its report.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CompressionReport {
    /// The mode asked for.
    pub mode: Compress,
    /// Pages frames sent plain, with LZ4, with zstd.
    pub plain_frames: u64,
    /// Frames sent LZ4-compressed.
    pub lz4_frames: u64,
    /// Frames sent zstd-compressed.
    pub zstd_frames: u64,
    /// Frame bytes before compression, and on the wire, over the compressed frames.
    pub compressed_in_bytes: u64,
    /// What the compressed frames took.
    pub compressed_out_bytes: u64,
}

#[derive(Debug, Clone, Copy, Default)]
struct Figures {
    /// Nanoseconds per byte of pages to compress, and the ratio, per candidate (None: 0, 1).
    compress_ns: [Option<f64>; 3],
    ratio: [Option<f64>; 3],
    /// Nanoseconds per byte on the wire.
    wire_ns: Option<f64>,
}

/// One migration's compression: the mode, the figures auto mode decides on, the counts.
#[derive(Debug)]
pub struct Compressor {
    mode: Compress,
    state: Mutex<(Figures, CompressionReport, u64)>,
}

fn average(old: Option<f64>, new: f64) -> Option<f64> {
    Some(old.map_or(new, |o| o + ALPHA * (new - o)))
}

impl Compressor {
    /// A compressor for `mode`, with nothing measured yet.
    pub fn new(mode: Compress) -> Compressor {
        Compressor {
            mode,
            state: Mutex::new((
                Figures::default(),
                CompressionReport {
                    mode,
                    ..Default::default()
                },
                0,
            )),
        }
    }

    /// The codec for the next frame.
    pub fn choose(&self) -> Codec {
        match self.mode {
            Compress::None => Codec::None,
            Compress::Lz4 => Codec::Lz4,
            Compress::Zstd => Codec::Zstd(ZSTD_LEVEL),
            Compress::Auto => {
                let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
                state.2 += 1;
                let n = state.2;
                let figures = state.0;
                // Until a codec has figures, or when its probe comes up, it is tried.
                if let Some(i) = (1..3).find(|&i| figures.compress_ns[i].is_none()) {
                    return CANDIDATES[i];
                }
                if n.is_multiple_of(PROBE_EVERY) {
                    return CANDIDATES[((n / PROBE_EVERY) % 3) as usize];
                }
                best(&figures)
            }
        }
    }

    /// Records a frame of `frame_bytes` (as encoded) that `codec` turned into `wire_bytes` in
    /// `compress_time`, and whose write took `write_time`.
    pub fn record(
        &self,
        codec: Codec,
        frame_bytes: usize,
        wire_bytes: usize,
        compress_time: Duration,
        write_time: Duration,
    ) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let (figures, report, _) = &mut *state;
        let i = CANDIDATES
            .iter()
            .position(|c| std::mem::discriminant(c) == std::mem::discriminant(&codec))
            .unwrap_or(0);
        if frame_bytes > 0 && wire_bytes > 0 {
            if i > 0 {
                let ns = compress_time.as_nanos() as f64 / frame_bytes as f64;
                figures.compress_ns[i] = average(figures.compress_ns[i], ns);
                let ratio = frame_bytes as f64 / wire_bytes as f64;
                figures.ratio[i] = average(figures.ratio[i], ratio);
            }
            let wire = write_time.as_nanos() as f64 / wire_bytes as f64;
            figures.wire_ns = average(figures.wire_ns, wire);
        }
        let compressed = wire_bytes < frame_bytes;
        match (codec, compressed) {
            (Codec::Lz4, true) => report.lz4_frames += 1,
            (Codec::Zstd(_), true) => report.zstd_frames += 1,
            _ => report.plain_frames += 1,
        }
        if compressed {
            report.compressed_in_bytes += frame_bytes as u64;
            report.compressed_out_bytes += wire_bytes as u64;
        }
    }

    /// What it did so far.
    pub fn report(&self) -> CompressionReport {
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .1
            .clone()
    }
}

/// The candidate with the least time per byte of pages: `c + w / r`, `w` for no codec.
fn best(f: &Figures) -> Codec {
    let Some(w) = f.wire_ns else {
        return Codec::None;
    };
    let cost = |i: usize| match (f.compress_ns[i], f.ratio[i]) {
        _ if i == 0 => w,
        (Some(c), Some(r)) if r > 0.0 => c + w / r,
        _ => f64::INFINITY,
    };
    let i = (0..3)
        .min_by(|&a, &b| cost(a).total_cmp(&cost(b)))
        .unwrap_or(0);
    CANDIDATES[i]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(c: &Compressor, wire_ns: f64, lz4: (f64, f64), zstd: (f64, f64)) {
        let mb = 1 << 20;
        for _ in 0..40 {
            for (codec, (ns, ratio)) in [(Codec::Lz4, lz4), (Codec::Zstd(1), zstd)] {
                let out = (mb as f64 / ratio) as usize;
                c.record(
                    codec,
                    mb,
                    out,
                    Duration::from_nanos((ns * mb as f64) as u64),
                    Duration::from_nanos((wire_ns * out as f64) as u64),
                );
            }
        }
    }

    /// On a slow link the better ratio wins; on a fast one, compressing costs more than it
    /// saves and frames go plain; in between, the cheap codec.
    #[test]
    fn auto_compresses_when_the_link_is_the_bottleneck() {
        let lz4 = (1.0, 2.0);
        let zstd = (3.0, 2.6);
        // 100 Mbit/s: 80 ns per byte; zstd (3 + 30.8) beats LZ4 (1 + 40).
        let c = Compressor::new(Compress::Auto);
        feed(&c, 80.0, lz4, zstd);
        assert_eq!(best(&c.state.lock().unwrap().0), Codec::Zstd(1));
        // 1 Gbit/s: 8 ns per byte; LZ4 (1 + 4) beats zstd (3 + 3.1) and plain (8).
        let c = Compressor::new(Compress::Auto);
        feed(&c, 8.0, lz4, zstd);
        assert_eq!(best(&c.state.lock().unwrap().0), Codec::Lz4);
        // 10 Gbit/s: 0.8 ns per byte, less than compressing costs.
        let c = Compressor::new(Compress::Auto);
        feed(&c, 0.8, lz4, zstd);
        assert_eq!(best(&c.state.lock().unwrap().0), Codec::None);
        // 4 ns per byte: LZ4 (1 + 2) beats zstd (3 + 1.54) and plain (4).
        let c = Compressor::new(Compress::Auto);
        feed(&c, 4.0, lz4, zstd);
        assert_eq!(best(&c.state.lock().unwrap().0), Codec::Lz4);
    }

    #[test]
    fn fixed_modes_and_counts() {
        let c = Compressor::new(Compress::Lz4);
        assert_eq!(c.choose(), Codec::Lz4);
        c.record(Codec::Lz4, 100, 50, Duration::ZERO, Duration::ZERO);
        c.record(Codec::Lz4, 100, 100, Duration::ZERO, Duration::ZERO);
        let r = c.report();
        assert_eq!((r.lz4_frames, r.plain_frames), (1, 1));
        assert_eq!((r.compressed_in_bytes, r.compressed_out_bytes), (100, 50));
        assert_eq!(Compressor::new(Compress::None).choose(), Codec::None);
        assert_eq!("auto".parse::<Compress>(), Ok(Compress::Auto));
        assert!("gzip".parse::<Compress>().unwrap_err().contains("gzip"));
        assert_eq!(parse_zstd_window_mib("off"), Ok(0));
        assert_eq!(parse_zstd_window_mib("128"), Ok(128 << 20));
        assert!(parse_zstd_window_mib("2048").is_err());
        assert!(parse_zstd_window_mib("big").is_err());
    }
}
