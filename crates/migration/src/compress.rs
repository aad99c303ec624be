//! Which compression a migration's Pages frames get, and, for [`Compress::Auto`], choosing it
//! from what limits the transfer.
//!
//! A writer compresses a frame and queues it on its socket, whose send buffer holds several
//! frames ([`crate::transport::SEND_BUFFER_BYTES`]), so the link carries one frame while the
//! writer compresses the next. Per byte of pages a writer then moves at the pace of the slower
//! of the two: `max(c, w / r)` with a codec (compression time per byte; the wire time per byte
//! `w` of the writer's share of the link, over the ratio `r`), and `w` without one. Compressing
//! pays while the link is the bottleneck, and stops paying once the CPU is (on a slow host, or
//! a fast link). `w` is the link's pace as [`crate::transport::LinkGauge`] reads it from the
//! socket's queue while the link is busy; `c` and `r` are what the writers measure compressing
//! (`c` as wall time, so a CPU shared with the vCPUs and the destination counts as it should).
//! [`Compressor`] keeps running averages of them, shared by all writers of a migration, and
//! picks for each frame the codec with the least time per byte. A codec's `c` is taken from
//! every frame it compressed (the CPU it costs follows the host's load more than the pages);
//! its `r` only from probes: every [`PAIRED_PROBE_EVERY`]-th pre-copy frame is compressed with
//! both codecs (LZ4 on a copy, not sent; the frame goes with zstd), so that the two ratios
//! always come from the same pages. Memory's compressibility changes from one frame to the
//! next: ratios taken from the frames each codec was chosen for compared one codec's pages
//! with the other's, and a probe that met a run of compressible pages kept LZ4 chosen long
//! after. No codec needs no probe: it costs no CPU and sends the frame as it is. Post-copy's
//! answers, which cannot be compressed twice, try LZ4 and zstd in turn every [`PROBE_EVERY`]
//! answers instead. Until the link has been seen busy, nothing says it is slower than the
//! writers: frames go plain.

use std::sync::Mutex;
use std::time::Duration;

use serde::Serialize;

use crate::stream::Codec;
use crate::transport::LinkSample;

/// Every this many answers post-copy tries LZ4 or zstd, in turn (auto mode).
pub const PROBE_EVERY: u64 = 16;
/// Every this many frames a pre-copy writer compresses a frame with both codecs (auto mode): a
/// probe costs both codecs' CPU, which a fast link, where frames go plain, feels; this spends
/// on probes what trying one codec every [`PROBE_EVERY`] frames did.
pub const PAIRED_PROBE_EVERY: u64 = 3 * PROBE_EVERY;
/// The zstd level of [`Compress::Zstd`] and of auto mode: the one that compresses real guest
/// memory about 2.6x at roughly three times LZ4's CPU cost.
pub const ZSTD_LEVEL: i32 = 1;
/// Pre-copy probes every frame until each codec's time rests on this many bytes of pages, or
/// on [`SETTLED_FRAMES`] frames (see `Figures::settled`).
const SETTLED_BYTES: f64 = (3 << 19) as f64;
/// Frames that settle a codec's time whatever their size: frames of memory that is mostly zero
/// lines are a few KiB each once encoded, and would never add up to [`SETTLED_BYTES`].
const SETTLED_FRAMES: f64 = 6.0;
/// How much older measurements fade with each new one (see `Sums`): ratios and the link.
const ALPHA: f64 = 0.2;
/// How much a codec's older compression times fade with each frame it compresses. A frame's
/// wall time swings several times over as the writer is preempted (by the other writers, the
/// receiving end, the vCPUs): averaged over a few frames, one slow frame made the cheaper
/// codec look best, and since a codec's time is only measured again when it compresses, the
/// choice stuck until the next probe.
const TIME_ALPHA: f64 = 0.05;

/// How a migration compresses its Pages frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Compress {
    /// Never (zero pages and zero lines are still left out).
    None,
    /// LZ4, always.
    Lz4,
    /// zstd, always.
    Zstd,
    /// Whichever of none, LZ4 and zstd moves pages fastest, as measured while migrating: the
    /// default, since it follows the link and the memory instead of assuming either.
    #[default]
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

impl CompressionReport {
    /// Counts a frame sent: `codec` made `wire_bytes` of `frame_bytes` (as many: sent plain).
    fn count(&mut self, codec: Codec, frame_bytes: usize, wire_bytes: usize) {
        let compressed = wire_bytes < frame_bytes;
        match (codec, compressed) {
            (Codec::Lz4, true) => self.lz4_frames += 1,
            (Codec::Zstd(_), true) => self.zstd_frames += 1,
            _ => self.plain_frames += 1,
        }
        if compressed {
            self.compressed_in_bytes += frame_bytes as u64;
            self.compressed_out_bytes += wire_bytes as u64;
        }
    }
}

/// What a pre-copy writer does with its next frame ([`Compressor::next`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Compress it with this codec (none: send it plain).
    Use(Codec),
    /// Try LZ4 on a copy of it, then send it compressed with zstd, recording both.
    Probe,
}

/// Sums of what was measured, older measurements fading (each new one scales the sums by
/// `1 - ALPHA` before adding itself): a rate is the ratio of two sums, in which each frame or
/// sample counts by its size. An average of per-frame rates would let a frame of a few bytes,
/// whose compression is all fixed cost, or a burst of acknowledgements after a stall, weigh as
/// much as a full frame.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Sums([f64; 3]);

impl Sums {
    fn add(&mut self, new: [f64; 3], alpha: f64) {
        for (s, n) in self.0.iter_mut().zip(new) {
            *s = *s * (1.0 - alpha) + n;
        }
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Figures {
    /// Per candidate (None's unused): compression nanoseconds, bytes in and frames, over every frame
    /// the codec compressed.
    time: [Option<Sums>; 3],
    /// Per candidate (None's unused): bytes in and out, over the frames both codecs compressed
    /// (probes) where a writer can try both, else over every frame (post-copy's answers).
    ratio: [Option<Sums>; 3],
    /// The link: nanoseconds, bytes carried.
    wire: Option<Sums>,
}

impl Figures {
    /// Adds what `codec` did to a frame to its figures (none for no codec): its time, and
    /// its ratio if `ratio`.
    fn add_codec(
        &mut self,
        codec: Codec,
        (frame_bytes, out_bytes): (usize, usize),
        time: Duration,
        ratio: bool,
    ) {
        let i = CANDIDATES
            .iter()
            .position(|c| std::mem::discriminant(c) == std::mem::discriminant(&codec))
            .unwrap_or(0);
        if frame_bytes > 0 && out_bytes > 0 && i > 0 {
            let new = [time.as_nanos() as f64, frame_bytes as f64, 1.0];
            self.time[i].get_or_insert_default().add(new, TIME_ALPHA);
            if ratio {
                let new = [frame_bytes as f64, out_bytes as f64, 0.0];
                self.ratio[i].get_or_insert_default().add(new, ALPHA);
            }
        }
    }

    /// Adds a sample of the link, if the writer saw it busy.
    fn add_wire(&mut self, link: Option<LinkSample>) {
        if let Some(LinkSample { elapsed, bytes }) = link.filter(|l| l.bytes > 0) {
            let new = [elapsed.as_nanos() as f64, bytes as f64, 0.0];
            self.wire.get_or_insert_default().add(new, ALPHA);
        }
    }

    /// Nanoseconds per byte on the wire, once the link was seen busy.
    fn wire_ns(&self) -> Option<f64> {
        self.wire.map(|Sums([ns, bytes, _])| ns / bytes)
    }

    /// Whether candidate `i` has figures of both kinds.
    fn measured(&self, i: usize) -> bool {
        self.time[i].is_some() && self.ratio[i].is_some()
    }

    /// Whether candidate `i`'s time rests on at least [`SETTLED_BYTES`] of pages or
    /// [`SETTLED_FRAMES`] frames (as faded): a first frame, often small and paying for the
    /// codec's setup, says little, and a codec that looks slow is not timed again until the
    /// next probe.
    fn settled(&self, i: usize) -> bool {
        self.measured(i)
            && self.time[i].is_some_and(|Sums([_, bytes, frames])| {
                bytes >= SETTLED_BYTES || frames >= SETTLED_FRAMES
            })
    }

    /// Candidate `i`'s nanoseconds per byte of pages and ratio, once it compressed a frame.
    fn compression(&self, i: usize) -> Option<(f64, f64)> {
        let Sums([ns, bytes_in, _]) = self.time[i]?;
        let Sums([ratio_in, ratio_out, _]) = self.ratio[i]?;
        Some((ns / bytes_in, ratio_in / ratio_out))
    }
}

/// One migration's compression: the mode, the figures auto mode decides on, the counts.
#[derive(Debug)]
pub struct Compressor {
    mode: Compress,
    state: Mutex<(Figures, CompressionReport, u64)>,
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

    /// What to do with the next pre-copy frame: compress it with one codec, or (auto mode,
    /// every [`PAIRED_PROBE_EVERY`]-th frame and until both codecs' figures have settled) try both
    /// codecs on it ([`Next::Probe`]), so that their ratios come from the same pages.
    pub fn next(&self) -> Next {
        match self.mode {
            Compress::Auto => {
                let mut state = self.lock();
                state.2 += 1;
                let (n, figures) = (state.2, state.0);
                if n.is_multiple_of(PAIRED_PROBE_EVERY)
                    || !(figures.settled(1) && figures.settled(2))
                {
                    Next::Probe
                } else {
                    Next::Use(best(&figures))
                }
            }
            _ => Next::Use(self.choose()),
        }
    }

    /// The codec for the next frame where frames cannot be tried twice (post-copy's
    /// answers): in auto mode, a codec without figures, every [`PROBE_EVERY`]-th frame LZ4 and
    /// zstd in turn, else the best.
    pub fn choose(&self) -> Codec {
        match self.mode {
            Compress::None => Codec::None,
            Compress::Lz4 => Codec::Lz4,
            Compress::Zstd => Codec::Zstd(ZSTD_LEVEL),
            Compress::Auto => {
                let mut state = self.lock();
                state.2 += 1;
                let (n, figures) = (state.2, state.0);
                if let Some(i) = (1..3).find(|&i| !figures.measured(i)) {
                    return CANDIDATES[i];
                }
                if n.is_multiple_of(PROBE_EVERY) {
                    return CANDIDATES[1 + ((n / PROBE_EVERY) % 2) as usize];
                }
                best(&figures)
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (Figures, CompressionReport, u64)> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records a trial that is not sent: `codec` turned a frame of `frame_bytes` into
    /// `out_bytes` in `compress_time` (a probe's other codec, on the same pages as the frame
    /// sent).
    pub fn record_trial(
        &self,
        codec: Codec,
        frame_bytes: usize,
        out_bytes: usize,
        compress_time: Duration,
    ) {
        let mut state = self.lock();
        state
            .0
            .add_codec(codec, (frame_bytes, out_bytes), compress_time, true);
    }

    /// Records a frame sent with the codec [`Compressor::next`] chose: its compression time
    /// goes into the codec's figures (the CPU a codec costs follows the host's load more than
    /// the pages), its ratio does not. Ratios come from probes only, where both codecs saw the
    /// same pages: memory's compressibility changes from one frame to the next, and a codec's
    /// ratio taken from the frames it was chosen for would be compared with the other's from
    /// other memory.
    pub fn record_sent(
        &self,
        codec: Codec,
        (frame_bytes, wire_bytes): (usize, usize),
        compress_time: Duration,
        link: Option<LinkSample>,
    ) {
        self.record_frame(codec, (frame_bytes, wire_bytes), compress_time, link, false);
    }

    /// Records a frame of `frame_bytes` (as encoded) that `codec` turned into `wire_bytes` in
    /// `compress_time`; `link`: what the writer's link carried since its last write, if it was
    /// busy (see [`crate::transport::LinkGauge`]).
    pub fn record(
        &self,
        codec: Codec,
        frame_bytes: usize,
        wire_bytes: usize,
        compress_time: Duration,
        link: Option<LinkSample>,
    ) {
        self.record_frame(codec, (frame_bytes, wire_bytes), compress_time, link, true);
    }

    /// A frame sent: its codec's time, and its ratio if `ratio`; the link; the counts.
    fn record_frame(
        &self,
        codec: Codec,
        sizes: (usize, usize),
        compress_time: Duration,
        link: Option<LinkSample>,
        ratio: bool,
    ) {
        let mut state = self.lock();
        let (figures, report, _) = &mut *state;
        figures.add_codec(codec, sizes, compress_time, ratio);
        figures.add_wire(link);
        report.count(codec, sizes.0, sizes.1);
    }

    /// What it did so far.
    pub fn report(&self) -> CompressionReport {
        self.lock().1.clone()
    }
}

/// The candidate with the least time per byte of pages: `max(c, w / r)`, `w` for no codec
/// (see the module's docs).
fn best(f: &Figures) -> Codec {
    let Some(w) = f.wire_ns() else {
        return Codec::None;
    };
    let cost = |i: usize| match f.compression(i) {
        _ if i == 0 => w,
        Some((c, r)) if r > 0.0 => c.max(w / r),
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

    #[allow(clippy::cast_possible_truncation)] // estimates: a float to integer cast saturates.
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
                    Some(LinkSample {
                        elapsed: Duration::from_nanos((wire_ns * out as f64) as u64),
                        bytes: out as u64,
                    }),
                );
            }
        }
    }

    fn chosen(c: &Compressor) -> Codec {
        best(&c.state.lock().unwrap().0)
    }

    /// On a slow link the better ratio wins; on a fast one, compressing costs more than it
    /// saves and frames go plain; in between, the codec whose compression keeps up with the
    /// link; and a host whose CPU is slow moves to the cheaper codec on the same link.
    #[test]
    fn auto_compresses_when_the_link_is_the_bottleneck() {
        let lz4 = (1.0, 2.0);
        let zstd = (3.0, 2.6);
        // 100 Mbit/s: 80 ns per byte; zstd (max(3, 30.8)) beats LZ4 (max(1, 40)).
        let c = Compressor::new(Compress::Auto);
        feed(&c, 80.0, lz4, zstd);
        assert_eq!(chosen(&c), Codec::Zstd(1));
        // A writer's share of 1 Gbit/s, 16 ns per byte: zstd (max(3, 6.2)) beats LZ4 (8).
        let c = Compressor::new(Compress::Auto);
        feed(&c, 16.0, lz4, zstd);
        assert_eq!(chosen(&c), Codec::Zstd(1));
        // The same link on a host where zstd takes 9 ns per byte: LZ4 (8) beats it.
        let c = Compressor::new(Compress::Auto);
        feed(&c, 16.0, lz4, (9.0, 2.6));
        assert_eq!(chosen(&c), Codec::Lz4);
        // 4 ns per byte: LZ4 (max(1, 2)) beats zstd (3) and plain (4).
        let c = Compressor::new(Compress::Auto);
        feed(&c, 4.0, lz4, zstd);
        assert_eq!(chosen(&c), Codec::Lz4);
        // 10 Gbit/s: 0.8 ns per byte, less than compressing costs.
        let c = Compressor::new(Compress::Auto);
        feed(&c, 0.8, lz4, zstd);
        assert_eq!(chosen(&c), Codec::None);
    }

    /// Before the link has been seen busy, frames go plain; after, the probes' figures decide.
    #[test]
    fn auto_sends_plain_until_the_link_is_seen_busy() {
        let c = Compressor::new(Compress::Auto);
        // The first frames try each codec once, to have their figures.
        assert_eq!(c.choose(), Codec::Lz4);
        c.record(Codec::Lz4, 1 << 20, 1 << 19, Duration::from_millis(1), None);
        assert_eq!(c.choose(), Codec::Zstd(1));
        c.record(
            Codec::Zstd(1),
            1 << 20,
            1 << 18,
            Duration::from_millis(3),
            None,
        );
        assert_eq!(chosen(&c), Codec::None);
        // A busy link at 100 ns per byte: zstd's quarter of the bytes wins.
        let busy = |ms: u64| {
            Some(LinkSample {
                elapsed: Duration::from_millis(ms),
                bytes: 1 << 20,
            })
        };
        c.record(Codec::None, 1 << 20, 1 << 20, Duration::ZERO, busy(100));
        assert_eq!(chosen(&c), Codec::Zstd(1));
        // A burst of acknowledgements (a whole MiB in 10 us) hardly moves the link's pace.
        c.record(
            Codec::None,
            1 << 20,
            1 << 20,
            Duration::ZERO,
            Some(LinkSample {
                elapsed: Duration::from_micros(10),
                bytes: 1 << 20,
            }),
        );
        assert_eq!(chosen(&c), Codec::Zstd(1));
    }

    /// Pre-copy: the first frames and every `PAIRED_PROBE_EVERY`-th are probes, and the frames sent
    /// with the codec chosen leave the codecs' ratios alone, so that LZ4 and zstd are only
    /// compared on the same pages. (Taken from the frames sent, zstd's figures would fall on
    /// memory that hardly compresses while LZ4's stayed those of the compressible probe, and
    /// LZ4 would be chosen.)
    #[test]
    fn precopy_codecs_are_compared_on_the_same_pages() {
        let mb = 1 << 20;
        // A writer's share of 1 Gbit/s: 16 ns per byte.
        let busy = Some(LinkSample {
            elapsed: Duration::from_nanos(16 * mb as u64),
            bytes: mb as u64,
        });
        let c = Compressor::new(Compress::Auto);
        // A probe: LZ4's trial and the frame sent with zstd, each (bytes out, time).
        let probe = |lz4: (usize, Duration), zstd: (usize, Duration)| {
            assert_eq!(c.next(), Next::Probe);
            c.record_trial(Codec::Lz4, mb, lz4.0, lz4.1);
            c.record(Codec::Zstd(1), mb, zstd.0, zstd.1, busy);
        };
        // The first two (one MiB each is not enough to settle on): LZ4 halves the pages in
        // 1 ms, zstd makes them 2.8x smaller in 3 ms.
        for _ in 0..2 {
            probe(
                (mb / 2, Duration::from_millis(1)),
                (mb * 10 / 28, Duration::from_millis(3)),
            );
        }
        for _ in 3..PAIRED_PROBE_EVERY {
            assert_eq!(c.next(), Next::Use(Codec::Zstd(1)));
            c.record_sent(
                Codec::Zstd(1),
                (mb, mb * 9 / 10),
                Duration::from_millis(3),
                busy,
            );
        }
        // The next probe's pages hardly compress with either: zstd still sends fewer bytes.
        probe(
            (mb * 19 / 20, Duration::from_micros(400)),
            (mb * 9 / 10, Duration::from_millis(2)),
        );
        assert_eq!(c.next(), Next::Use(Codec::Zstd(1)));
        let r = c.report();
        assert_eq!((r.zstd_frames, r.lz4_frames, r.plain_frames), (48, 0, 0));
        // The frames sent do count by their compression time: zstd slowed down to 300 ms per
        // MiB on a busy host loses to LZ4.
        for _ in 0..8 {
            c.record_sent(
                Codec::Zstd(1),
                (mb, mb * 9 / 10),
                Duration::from_millis(300),
                busy,
            );
        }
        assert_eq!(chosen(&c), Codec::Lz4);
        // Fixed modes never probe.
        assert_eq!(Compressor::new(Compress::Lz4).next(), Next::Use(Codec::Lz4));
        assert_eq!(
            Compressor::new(Compress::None).next(),
            Next::Use(Codec::None)
        );
    }

    /// Pre-copy probes until each codec was timed on enough pages: a small first frame, all
    /// setup, does not decide.
    #[test]
    fn probes_go_on_until_the_times_settle() {
        let c = Compressor::new(Compress::Auto);
        let mb = 1 << 20;
        let busy = Some(LinkSample {
            elapsed: Duration::from_nanos(16 * mb as u64),
            bytes: mb as u64,
        });
        // One page, which zstd took 1 ms to set up for.
        assert_eq!(c.next(), Next::Probe);
        c.record_trial(Codec::Lz4, 4096, 4000, Duration::from_micros(20));
        c.record(Codec::Zstd(1), 4096, 3900, Duration::from_millis(1), busy);
        for _ in 0..2 {
            assert_eq!(c.next(), Next::Probe);
            c.record_trial(Codec::Lz4, mb, mb / 2, Duration::from_millis(1));
            c.record(Codec::Zstd(1), mb, mb / 3, Duration::from_millis(3), busy);
        }
        assert_eq!(c.next(), Next::Use(Codec::Zstd(1)));
    }

    /// Frames of a few KiB (memory of mostly zero lines) settle the times by their number:
    /// probing does not go on for the whole migration.
    #[test]
    fn small_frames_settle_by_their_number() {
        let c = Compressor::new(Compress::Auto);
        let busy = Some(LinkSample {
            elapsed: Duration::from_micros(50),
            bytes: 4096,
        });
        let mut probes = 0;
        for _ in 0..20 {
            if c.next() == Next::Probe {
                probes += 1;
                c.record_trial(Codec::Lz4, 32 << 10, 2048, Duration::from_micros(10));
                c.record(
                    Codec::Zstd(1),
                    32 << 10,
                    1024,
                    Duration::from_micros(30),
                    busy,
                );
            } else {
                c.record_sent(Codec::None, (32 << 10, 32 << 10), Duration::ZERO, busy);
            }
        }
        assert!((6..=7).contains(&probes), "{probes} probes");
    }

    /// A codec's time is averaged over many frames: one frame slowed down tenfold (the writer
    /// preempted) does not turn auto mode to the cheaper codec.
    #[test]
    fn one_slow_frame_does_not_turn_the_choice() {
        let c = Compressor::new(Compress::Auto);
        // A writer's share of 1 Gbit/s: zstd (max(3, 6.2)) beats LZ4 (8).
        feed(&c, 16.0, (1.0, 2.0), (3.0, 2.6));
        assert_eq!(chosen(&c), Codec::Zstd(1));
        let mb = 1 << 20;
        c.record_sent(
            Codec::Zstd(1),
            (mb, mb * 10 / 26),
            Duration::from_nanos(40 * mb as u64),
            None,
        );
        assert_eq!(chosen(&c), Codec::Zstd(1));
    }

    /// Post-copy's answers take turns between LZ4 and zstd for their probes, never plain: no
    /// codec needs no measuring.
    #[test]
    fn answers_probe_each_codec_never_plain() {
        let c = Compressor::new(Compress::Auto);
        let mb = 1 << 20;
        let busy = Some(LinkSample {
            elapsed: Duration::from_nanos(mb as u64),
            bytes: mb as u64,
        });
        let mut probed = std::collections::BTreeSet::new();
        for n in 1..=6 * PROBE_EVERY {
            let codec = c.choose();
            c.record(codec, mb, mb / 2, Duration::from_millis(2), busy);
            if n % PROBE_EVERY == 0 {
                probed.insert(format!("{codec:?}"));
            }
        }
        // At 1 ns per byte, 2 ms per MiB of compression is too slow: frames go plain, probes
        // do not.
        assert_eq!(c.choose(), Codec::None);
        assert_eq!(probed.into_iter().collect::<Vec<_>>(), ["Lz4", "Zstd(1)"]);
    }

    #[test]
    fn fixed_modes_and_counts() {
        let c = Compressor::new(Compress::Lz4);
        assert_eq!(c.choose(), Codec::Lz4);
        c.record(Codec::Lz4, 100, 50, Duration::ZERO, None);
        c.record(Codec::Lz4, 100, 100, Duration::ZERO, None);
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
