//! What each vCPU runs, and what it reports.

use serde::{Deserialize, Serialize};

/// A guest workload over one vCPU's range. Format: part of the saved VM state ([`VcpuWork`]);
/// a change bumps `guestmem_contract::PAYLOAD_STATE.version`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Workload {
    /// Write every page of the range once (the shape of the kernel's demand_paging_test).
    Touch,
    /// Keep rewriting every page of the range, pass after pass, until stopped (or `passes`
    /// passes), at full speed or throttled to `pages_per_s` (the shape of dirty_log_perf_test).
    Dirty {
        /// The throttle, in pages per second (`None`: full speed).
        pages_per_s: Option<u64>,
        /// Passes before it stops (`None`: until stopped).
        passes: Option<u64>,
        /// Write the first pass at full speed (memory filled), and throttle only after it.
        #[serde(default)]
        fill_first: bool,
    },
    /// Like `Dirty`, but each page write rewrites 2 to 33 of the page's 64-byte lines with
    /// the same lines of another page of the range, as a real guest re-dirties memory a few
    /// lines at a time with bytes like the ones already there (see payload.S). Run over guest
    /// RAM started from a captured image, the memory stays as dense and compressible as a
    /// real guest's.
    Rewrite {
        /// The throttle, in pages per second (`None`: full speed).
        pages_per_s: Option<u64>,
        /// Passes before it stops (`None`: until stopped).
        passes: Option<u64>,
    },
    /// Read every page and report a digest (see `guestmem_memory::digest_bytes`).
    Verify,
    /// Like `Dirty` at full speed, but only `write_percent` % of the pages (a fixed
    /// pseudo-random share, see payload.S) are written each pass; the others are read (the `-w`
    /// of the kernel's dirty_log_perf_test).
    Mixed {
        /// The share of pages written each pass.
        write_percent: u64,
        /// Passes before it stops (`None`: until stopped).
        passes: Option<u64>,
    },
    /// `writes` writes to pseudo-random pages of the range (see
    /// [`crate::payload::random_writes`]), each logged as its page's gpa, 8 bytes per write, at
    /// `log_gpa` (which must lie outside the range).
    Random {
        /// How many writes.
        writes: u64,
        /// Where the log of written pages goes.
        log_gpa: u64,
    },
}

impl Workload {
    /// The workload's name (as the CLI takes it).
    pub fn name(&self) -> &'static str {
        match self {
            Workload::Touch => "touch",
            Workload::Dirty { .. } => "dirty",
            Workload::Rewrite { .. } => "rewrite",
            Workload::Verify => "verify",
            Workload::Mixed { .. } => "mixed",
            Workload::Random { .. } => "random",
        }
    }
}

/// One vCPU's assignment: a workload over `[gpa, gpa + size)`, with a seed for the values it
/// writes. Format: part of the saved VM state; a change bumps
/// `guestmem_contract::PAYLOAD_STATE.version`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VcpuWork {
    /// What it runs.
    pub workload: Workload,
    /// Its range's guest address.
    pub gpa: u64,
    /// Its range's bytes.
    pub size: u64,
    /// The seed of the values it writes.
    pub seed: u64,
}

impl VcpuWork {
    /// Splits `[gpa, gpa + size)` into `vcpus` equal page-aligned ranges, one per vCPU, each with
    /// seed `seed + i`.
    pub fn split(
        workload: Workload,
        gpa: u64,
        size: u64,
        vcpus: usize,
        seed: u64,
    ) -> Vec<VcpuWork> {
        let pages = size / guestmem_memory::PAGE_SIZE;
        let per = pages / vcpus as u64;
        (0..vcpus)
            .map(|i| VcpuWork {
                workload,
                gpa: gpa + i as u64 * per * guestmem_memory::PAGE_SIZE,
                size: per * guestmem_memory::PAGE_SIZE,
                seed: seed + i as u64,
            })
            .collect()
    }

    /// Pages in its range.
    pub fn pages(&self) -> u64 {
        self.size / guestmem_memory::PAGE_SIZE
    }
}

/// What one vCPU did, read from its control block.
#[derive(Debug, Clone, Serialize)]
pub struct VcpuReport {
    /// The vCPU.
    pub vcpu: usize,
    /// Its workload's name.
    pub workload: &'static str,
    /// Page operations (writes or page reads) since the vCPU started.
    pub pages: u64,
    /// Completed passes over the range (`write` workloads).
    pub generation: u64,
    /// The `verify` digest (0 for other workloads).
    pub digest: u64,
    /// Guest time between the payload's start and end, from its TSC stamps.
    pub guest_seconds: f64,
    /// Its rate, in guest time.
    pub pages_per_s: f64,
}

/// What a run did, in total.
#[derive(Debug, Clone, Serialize)]
pub struct RunReport {
    /// Each vCPU's figures.
    pub vcpus: Vec<VcpuReport>,
    /// Host time the run took.
    pub wall_seconds: f64,
    /// Pages of every vCPU.
    pub total_pages: u64,
    /// Sum of the vCPUs' own rates.
    pub total_pages_per_s: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each vCPU gets an equal, page-aligned, consecutive range and its own seed; the pages
    /// left over after an equal split go to nobody.
    #[test]
    fn split_gives_equal_consecutive_ranges() {
        let w = Workload::Touch;
        let work = VcpuWork::split(w, 0x4000_0000, 10 * 4096 + 100, 3, 7);
        let got: Vec<_> = work.iter().map(|v| (v.gpa, v.size, v.seed)).collect();
        assert_eq!(
            got,
            [
                (0x4000_0000, 3 * 4096, 7),
                (0x4000_3000, 3 * 4096, 8),
                (0x4000_6000, 3 * 4096, 9)
            ]
        );
        assert!(work.iter().all(|v| v.pages() == 3 && v.workload == w));
        assert_eq!(
            Workload::Random {
                writes: 1,
                log_gpa: 0
            }
            .name(),
            "random"
        );
    }
}
