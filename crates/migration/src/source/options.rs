//! How to migrate ([`SendOptions`]) and what a migration did ([`Report`]).

use std::sync::Arc;
use std::time::Duration;

use guestmem_vm::RunningVm;
use serde::Serialize;

use crate::compress::{Compress, CompressionReport};
use crate::delta::DeltaReport;
use crate::destination::DestinationReport;
use crate::negotiate::{self, Negotiated};
use crate::protocol::{Links, Mode, Resume};
use crate::{Error, MigrationError, Result};

/// Re-establishes a broken post-copy link (given why it broke): new connections to the same
/// destination.
pub type Reconnect = Arc<dyn Fn(&Resume) -> Result<Links> + Send + Sync>;

/// How to migrate.
#[derive(Clone)]
pub struct SendOptions {
    /// Pre-copy, post-copy or hybrid.
    pub mode: Mode,
    /// Pre-copy stops the guest once the rest fits in this (the estimated downtime).
    pub downtime: Duration,
    /// Pre-copy rounds before stopping the guest whatever the estimate.
    pub max_rounds: u32,
    /// Throttle the guest's vCPUs when its dirty rate outruns the link (QEMU's rule: pages
    /// dirtied during a round above half of those sent, twice in a row; 20 %, then +10 % per
    /// round, up to 99 %).
    pub auto_converge: bool,
    /// Bytes per second the transfer may use (`None`: as fast as it goes).
    pub max_bandwidth: Option<u64>,
    /// Check at switch-over that the destination's memory digest equals the source's. Both
    /// sides keep a digest per chunk of guest memory as the rounds go
    /// ([`crate::chunk_digests`]): the downtime grows by the re-hashing of the chunks the last
    /// round writes, not of all guest memory.
    pub verify: bool,
    /// Local migration over a Unix socket: hand the memfd / hugetlbfs files of the RAM regions
    /// to the destination instead of copying them (guest_memfd and anonymous regions are
    /// still copied).
    pub share_memory: bool,
    /// Dirty tracking mode (`None`: [`guestmem_tracking::Mode::best`]).
    pub tracking: Option<guestmem_tracking::Mode>,
    /// Send every 64-byte line of every page, zero or not (as QEMU does), instead of only the
    /// non-zero ones: for comparisons.
    pub whole_pages: bool,
    /// How Pages frames are compressed (see [`crate::compress`]); zero pages and zero lines
    /// are left out in every mode.
    pub compress: Compress,
    /// Pre-copy: bytes of the cache of pages' last versions sent, against which re-dirtied
    /// pages travel as deltas (see [`crate::delta`]); `None`: `DEFAULT_DELTA_CACHE_PERCENT`
    /// of guest memory less a 2 MiB page buffer per pages connection (none for a guest too
    /// small for that); `Some(0)`, the default: no delta encoding (the cache costs source
    /// memory and pays only when the guest re-dirties the same pages between rounds, which a
    /// guest sweeping its memory does not). Post-copy and hybrid never send deltas (their
    /// destination's pages also come from fault answers, which the cache does not see).
    pub delta_cache_bytes: Option<u64>,
    /// With zstd (`compress` zstd, or auto when it picks zstd) on the pre-copy rounds: each
    /// pages connection compresses its frames as one zstd stream whose window, of this many
    /// bytes (a power of two, 1 KiB to 1 GiB), reaches back over the frames sent before on it
    /// (see [`crate::stream::ZstdStream`]): pages resembling earlier ones travel as references
    /// to them. 0: each frame compressed on its own. The window costs about its size in memory
    /// per pages connection on each side (in [`Report::zstd_stream_bytes`] and
    /// `source_extra_bytes`); it is cut to the guest memory per connection when that is
    /// smaller. Default [`DEFAULT_ZSTD_WINDOW_BYTES`]. Post-copy's answers never go through a
    /// stream: each is compressed on its own.
    pub zstd_window_bytes: u64,
    /// Post-copy and hybrid: host CPUs for the threads that answer the destination's faults
    /// (the urgent connections' servers). When source and destination share a host, giving
    /// these and the destination's fault handlers ([`ReceiveOptions::fault_cpus`]) the same
    /// CPU keeps a fault's round trip on one CPU: no cross-CPU wake-up, and one CPU, not two,
    /// that must not be preempted meanwhile. `None`: wherever the scheduler puts them.
    ///
    /// [`ReceiveOptions::fault_cpus`]: crate::protocol::ReceiveOptions::fault_cpus
    pub fault_cpus: Option<Vec<usize>>,
    /// Where the migration's progress records go ([`guestmem_events::Event`], operation
    /// `migrate-send`): at every change of status (setup, precopy, stopped, postcopy,
    /// postcopy-paused, then completed or failed with the error), after every round, and at
    /// the sink's interval within a round and during post-copy. `None`: none are made.
    pub events: Option<guestmem_events::Sink>,
    /// After a link broken during post-copy: returns new connections to the same destination
    /// (blocking until the operator asks to resume), or an error to give up.
    pub reconnect: Option<Reconnect>,
}

impl std::fmt::Debug for SendOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendOptions")
            .field("mode", &self.mode)
            .field("downtime", &self.downtime)
            .field("max_rounds", &self.max_rounds)
            .field("auto_converge", &self.auto_converge)
            .field("max_bandwidth", &self.max_bandwidth)
            .field("verify", &self.verify)
            .field("share_memory", &self.share_memory)
            .field("tracking", &self.tracking)
            .field("whole_pages", &self.whole_pages)
            .field("compress", &self.compress)
            .field("delta_cache_bytes", &self.delta_cache_bytes)
            .field("zstd_window_bytes", &self.zstd_window_bytes)
            .field("fault_cpus", &self.fault_cpus)
            .field("events", &self.events)
            .field("reconnect", &self.reconnect.is_some())
            .finish()
    }
}

impl Default for SendOptions {
    fn default() -> Self {
        SendOptions {
            mode: Mode::Precopy,
            downtime: Duration::from_millis(50),
            max_rounds: 30,
            auto_converge: true,
            max_bandwidth: None,
            verify: false,
            share_memory: false,
            tracking: None,
            whole_pages: false,
            compress: Compress::Auto,
            delta_cache_bytes: Some(0),
            zstd_window_bytes: DEFAULT_ZSTD_WINDOW_BYTES,
            fault_cpus: None,
            events: None,
            reconnect: None,
        }
    }
}

/// The delta cache's default size with its writers' page buffers, in percent of guest
/// memory: with the frame buffers and bitmaps, the source's extra memory stays under 5 % of
/// the guest's.
pub const DEFAULT_DELTA_CACHE_PERCENT: u64 = 4;

/// The zstd stream window of the pre-copy pages connections by default (see
/// [`SendOptions::zstd_window_bytes`]): none. A window saves wire bytes (12% of the first
/// pass on a real 2 GiB image with 128 MiB, see docs/benchmarks.md) for about its size in
/// memory per connection on each side, which a VMM asks for where the link is what limits.
pub const DEFAULT_ZSTD_WINDOW_BYTES: u64 = 0;

/// The least bandwidth limit per pages connection: below it, a connection would wait longer
/// than the destination's idle timeout between two 2 MiB blocks.
pub const MIN_BANDWIDTH_PER_CONNECTION: u64 = 1 << 20;

impl SendOptions {
    /// Refuses options with which a migration over `connections` pages connections could never
    /// finish, naming the option.
    pub fn check(&self, connections: usize) -> Result<()> {
        if let Some(bw) = self.max_bandwidth {
            let least = MIN_BANDWIDTH_PER_CONNECTION * connections.max(1) as u64;
            if bw < least {
                return Err(MigrationError::BadOption {
                    option: "max_bandwidth",
                    reason: format!(
                        "max_bandwidth of {bw} bytes/s is below {least} (1 MiB/s for each of \
                         the {connections} pages connections): the migration would never finish"
                    ),
                }
                .into());
            }
        }
        let w = self.zstd_window_bytes;
        let windows =
            1 << crate::stream::ZSTD_WINDOW_LOG_MIN..=1 << crate::stream::ZSTD_WINDOW_LOG_MAX;
        if w != 0 && (!w.is_power_of_two() || !windows.contains(&w)) {
            return Err(MigrationError::BadOption {
                option: "zstd_window_bytes",
                reason: format!(
                    "a zstd window of {w} bytes: 0 (none) or a power of two from 1 KiB to 1 GiB"
                ),
            }
            .into());
        }
        if self.max_rounds == 0 {
            return Err(MigrationError::BadOption {
                option: "max_rounds",
                reason: "max_rounds is 0: pre-copy needs at least one round".into(),
            }
            .into());
        }
        Ok(())
    }
}

impl SendOptions {
    /// The zstd stream window (log2 of bytes) of a migration over `connections` pages
    /// connections of a `guest_bytes` guest: `None` when its pre-copy rounds compress frame by
    /// frame (no zstd, no rounds, or a window of 0).
    pub(crate) fn zstd_window_log(&self, connections: usize, guest_bytes: u64) -> Option<u32> {
        let zstd = matches!(self.compress, Compress::Zstd | Compress::Auto);
        if !zstd || self.mode == Mode::Postcopy || self.zstd_window_bytes == 0 {
            return None;
        }
        // A window longer than what one connection carries in a pass over memory holds nothing
        // more.
        let per_connection = (guest_bytes / connections.max(1) as u64).max(1);
        let cap = per_connection.next_power_of_two().trailing_zeros();
        let log = self.zstd_window_bytes.trailing_zeros().min(cap);
        Some(log.clamp(
            crate::stream::ZSTD_WINDOW_LOG_MIN,
            crate::stream::ZSTD_WINDOW_LOG_MAX,
        ))
    }
}

impl SendOptions {
    /// These options fitted to what the destination accepted in the Hellos (see
    /// `crate::negotiate`): a feature it did not accept and the migration can do without is
    /// turned off (compression, the zstd stream, deltas); one the migration needs refuses it,
    /// naming the feature and the destination, before any page moves.
    pub(crate) fn fitted_to(&self, n: &Negotiated) -> Result<SendOptions> {
        let needs = |feature: &'static str, option: &'static str| -> Result<()> {
            if n.has(feature) {
                return Ok(());
            }
            Err(MigrationError::BadOption {
                option,
                reason: format!(
                    "the destination ({}) does not accept '{feature}' (negotiated protocol {}, \
                     features {})",
                    n.peer,
                    n.protocol,
                    n.features.join(", ")
                ),
            }
            .into())
        };
        if self.mode.has_postcopy() {
            needs(negotiate::POSTCOPY, "mode")?;
        }
        if self.share_memory {
            needs(negotiate::SHARED_MEMORY, "share_memory")?;
        }
        if self.verify {
            needs(negotiate::CHUNK_DIGESTS, "verify")?;
        }
        // Every guestmem so far takes Pages frames without CRC under TLS.
        needs(negotiate::NO_CRC, "the stream's frames")?;
        let mut fitted = self.clone();
        if !n.has(negotiate::PAGES_D) {
            fitted.whole_pages = true;
        }
        if !n.has(negotiate::ZSTD_STREAM) {
            fitted.zstd_window_bytes = 0;
        }
        if !n.has(negotiate::PAGES_Z) {
            fitted.compress = Compress::None;
            fitted.zstd_window_bytes = 0;
        }
        Ok(fitted)
    }
}

/// One pre-copy round (the last one runs with the guest stopped).
#[derive(Debug, Clone, Serialize)]
pub struct Round {
    /// Its number, from 1.
    pub round: u32,
    /// When it started, from the migration's start.
    pub start_ms: f64,
    /// How long it took.
    pub ms: f64,
    /// Dirty pages it went through: sent with contents, or as zero.
    pub pages: u64,
    /// Of them, zero pages.
    pub zero_pages: u64,
    /// Page bytes sent.
    pub bytes: u64,
    /// What they took on the wire: their non-zero lines, with a mask per page.
    pub wire_bytes: u64,
    /// Pages the guest dirtied meanwhile (what the next round has to send).
    pub dirty_pages_after: u64,
    /// Its bandwidth.
    pub bandwidth_mib_per_s: f64,
    /// The vCPUs' throttle at its end.
    pub throttle_percent: u64,
}

/// What a migration did, seen from the source. `guestmem migrate send --json` prints it as
/// format guestmem.migrate-send/1 (the CLI's `report::MIGRATE_SEND`, which a change bumps).
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Pre-copy, post-copy or hybrid.
    pub mode: Mode,
    /// Bytes of guest memory.
    pub guest_bytes: u64,
    /// Pages connections.
    pub connections: usize,
    /// The dirty tracking mode.
    pub tracking: String,
    /// From start to the destination's Complete.
    pub total_ms: f64,
    /// Source vCPUs stopped → destination vCPUs running (as the source sees the destination's
    /// Running frame: one link latency more than the truth).
    pub downtime_ms: f64,
    /// The downtime target.
    pub downtime_target_ms: f64,
    /// Of the downtime: the source's share of the memory digest check (`verify`): re-hashing
    /// the chunks the last round sent (on the busiest pages connection, beside its sending),
    /// then any chunk still stale, and combining the digests. The destination's share is in
    /// its report.
    pub verify_ms: f64,
    /// The memory digest at switch-over (`verify`): the regions' chunk digests combined.
    pub digest: Option<u64>,
    /// The last estimate fitted the target (else the round limit forced the switch).
    pub converged: bool,
    /// The highest throttle auto-converge set.
    pub max_throttle_percent: u64,
    /// Page bytes sent, all phases.
    pub bytes: u64,
    /// What the pages took on the wire (their non-zero lines and masks), all phases.
    pub wire_bytes: u64,
    /// Non-zero pages sent, all phases.
    pub pages_sent: u64,
    /// Zero pages not sent.
    pub zero_pages_skipped: u64,
    /// Bytes of guest memory handed over as files (local migration), never sent.
    pub shared_bytes: u64,
    /// The pre-copy rounds (the last with the guest stopped).
    pub rounds: Vec<Round>,
    /// Post-copy: pages served on request, their bytes, and how long until all was resident.
    pub postcopy_requests: u64,
    /// Their bytes.
    pub postcopy_bytes: u64,
    /// From Running to every page resident.
    pub postcopy_ms: f64,
    /// Post-copy links that broke and were resumed.
    pub link_breaks: u32,
    /// The source's own memory for the migration: bitmaps and buffers (and the zstd streams).
    pub source_extra_bytes: u64,
    /// The zstd streams' window per pages connection (0: frames compressed one by one).
    pub zstd_window_bytes: u64,
    /// What the source's zstd streams held at their most (all connections: windows and
    /// tables); about as much again on the destination.
    pub zstd_stream_bytes: u64,
    /// The destination's figures (post-copy faults and their latency).
    pub destination: Option<DestinationReport>,
    /// What compression the pre-copy Pages frames got.
    pub compression: CompressionReport,
    /// The delta cache: its size, hits and misses, and the pages it turned into deltas.
    pub delta: DeltaReport,
    /// What the Hellos agreed on: protocol, features, the destination's guestmem.
    pub negotiated: Negotiated,
}

/// A migration that failed. `vm` is the source VM, still running, when the source kept the
/// guest (any failure before Go); `None` once the destination owns it.
pub struct Failure<'a> {
    /// Why it failed.
    pub error: Error,
    /// The source VM, still running, if the source kept the guest.
    pub vm: Option<RunningVm<'a>>,
}

impl std::fmt::Debug for Failure<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} (source VM {})",
            self.error,
            if self.vm.is_some() {
                "still running"
            } else {
                "stopped"
            }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The option `check` refused, or `None` when it accepted them.
    fn refused(options: &SendOptions, connections: usize) -> Option<&'static str> {
        match options.check(connections) {
            Ok(()) => None,
            Err(Error::Migration(MigrationError::BadOption { option, .. })) => Some(option),
            Err(e) => panic!("unexpected error: {e}"),
        }
    }

    #[test]
    fn defaults_pass_the_check() {
        assert_eq!(refused(&SendOptions::default(), 4), None);
    }

    #[test]
    fn bandwidth_below_one_mib_per_connection_is_refused() {
        let options = SendOptions {
            max_bandwidth: Some(4 * MIN_BANDWIDTH_PER_CONNECTION - 1),
            ..SendOptions::default()
        };
        assert_eq!(refused(&options, 4), Some("max_bandwidth"));
        assert_eq!(refused(&options, 3), None);
        let err = options.check(4).unwrap_err().to_string();
        assert!(err.contains("max_bandwidth"), "{err}");
    }

    #[test]
    fn zstd_window_must_be_zero_or_a_power_of_two_in_range() {
        for bad in [3 << 10, 512, 2 << 30] {
            let options = SendOptions {
                zstd_window_bytes: bad,
                ..SendOptions::default()
            };
            assert_eq!(refused(&options, 1), Some("zstd_window_bytes"), "{bad}");
        }
        for good in [0, 1 << 10, 1 << 20, 1 << 30] {
            let options = SendOptions {
                zstd_window_bytes: good,
                ..SendOptions::default()
            };
            assert_eq!(refused(&options, 1), None, "{good}");
        }
    }

    #[test]
    fn zero_rounds_are_refused() {
        let options = SendOptions {
            max_rounds: 0,
            ..SendOptions::default()
        };
        assert_eq!(refused(&options, 1), Some("max_rounds"));
    }

    #[test]
    fn zstd_window_log_is_capped_by_memory_per_connection() {
        let options = SendOptions {
            compress: Compress::Zstd,
            zstd_window_bytes: 1 << 27,
            ..SendOptions::default()
        };
        assert_eq!(options.zstd_window_log(1, 1 << 30), Some(27));
        // 4 MiB per connection: the window shrinks to it.
        assert_eq!(options.zstd_window_log(4, 16 << 20), Some(22));
        assert_eq!(options.zstd_window_log(1, 4096), Some(12));
        // Never below the least window zstd takes.
        assert_eq!(
            options.zstd_window_log(1, 100),
            Some(crate::stream::ZSTD_WINDOW_LOG_MIN)
        );
    }

    #[test]
    fn no_zstd_window_without_zstd_rounds() {
        let window = SendOptions {
            compress: Compress::Zstd,
            zstd_window_bytes: 1 << 20,
            ..SendOptions::default()
        };
        assert_eq!(window.zstd_window_log(1, 1 << 30), Some(20));
        let postcopy = SendOptions {
            mode: Mode::Postcopy,
            ..window.clone()
        };
        assert_eq!(postcopy.zstd_window_log(1, 1 << 30), None);
        let none = SendOptions {
            zstd_window_bytes: 0,
            ..window.clone()
        };
        assert_eq!(none.zstd_window_log(1, 1 << 30), None);
    }

    /// Features the destination did not accept are done without, or refuse the migration
    /// when it needs them, naming the feature and the destination.
    #[test]
    fn options_fit_what_the_destination_accepted() {
        let narrow = Negotiated {
            protocol: negotiate::PROTOCOL,
            features: vec![negotiate::NO_CRC.into(), negotiate::CHUNK_DIGESTS.into()],
            peer: "guestmem test".into(),
        };
        let opts = SendOptions {
            verify: true,
            ..SendOptions::default()
        };
        let fitted = opts.fitted_to(&narrow).unwrap();
        assert!(fitted.whole_pages);
        assert_eq!(fitted.zstd_window_bytes, 0);
        assert!(matches!(fitted.compress, Compress::None));
        let all = opts.fitted_to(&Negotiated::default()).unwrap();
        assert!(!all.whole_pages && matches!(all.compress, Compress::Auto));
        let post = SendOptions {
            mode: Mode::Postcopy,
            ..SendOptions::default()
        };
        let e = crate::error_chain(&post.fitted_to(&narrow).unwrap_err(), ": ");
        assert!(
            e.contains("does not accept 'postcopy'") && e.contains("guestmem test"),
            "{e}"
        );
    }
}
