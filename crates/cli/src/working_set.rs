//! A lazy restore's working set as the CLI reports it (payload VM, store and Linux guest
//! restores alike): fetched first when the snapshot had one, else recorded from this run's
//! faults for the next lazy restore.

use guestmem_paging::{Pager, PagerStats, UserfaultPager};
use guestmem_sys::to_usize;
use serde::Serialize;

/// What a lazy restore did with the working set.
#[derive(Serialize)]
pub(crate) struct WorkingSetOutput {
    pub(crate) action: &'static str,
    pub(crate) chunks: usize,
    /// Page faults the pagers served during the run.
    pub(crate) faults: u64,
}

/// A lazy restore's working set: fetched first when the snapshot had one, else recorded
/// (`record`) from the faults of this run, for the next lazy restore to fetch first.
pub(crate) fn output(
    stats: &[PagerStats],
    prefetched: bool,
    record: impl FnOnce() -> crate::Result<usize>,
) -> crate::Result<Option<WorkingSetOutput>> {
    if stats.is_empty() {
        return Ok(None);
    }
    let faults = stats.iter().map(|s| s.faults).sum();
    Ok(Some(if prefetched {
        WorkingSetOutput {
            action: "fetched first",
            chunks: to_usize(stats.iter().map(|s| s.prefetch_chunks).sum::<u64>()),
            faults,
        }
    } else {
        WorkingSetOutput {
            action: "recorded",
            chunks: record()?,
            faults,
        }
    }))
}

/// The statistics of a lazy restore's pagers, of both kinds.
pub(crate) fn pager_stats(
    pagers: &[Pager],
    userfault_pagers: &[UserfaultPager],
) -> Vec<PagerStats> {
    pagers
        .iter()
        .map(Pager::stats)
        .chain(userfault_pagers.iter().map(UserfaultPager::stats))
        .collect()
}
