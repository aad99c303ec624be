//! Which data chunks of a lazily restored snapshot its page sources have fetched, so that a
//! restore that fails on its store says which chunks were never fetched (the guest was stopped
//! rather than run without them).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use guestmem_sys::to_usize;

/// The most runs of chunks a message lists (then how many more there are).
const MAX_RUNS: usize = 12;

/// One region's chunks: which hold data, which of those were fetched; whether this restore
/// fetches the region at all (a page server serves RAM only).
#[derive(Debug)]
struct RegionLedger {
    label: String,
    data: Vec<bool>,
    fetched: Vec<AtomicU64>,
    used: AtomicBool,
}

/// The fetched chunks of a snapshot's regions, shared by their page sources.
#[derive(Debug)]
pub(crate) struct Ledger {
    regions: Vec<RegionLedger>,
}

impl Ledger {
    /// A ledger of `regions`: each its label ("STORE/NAME region 'R'") and which of its
    /// chunks hold data (the others are zeros, never fetched).
    pub(crate) fn new(regions: Vec<(String, Vec<bool>)>) -> Ledger {
        Ledger {
            regions: regions
                .into_iter()
                .map(|(label, data)| RegionLedger {
                    fetched: (0..data.len().div_ceil(64))
                        .map(|_| AtomicU64::new(0))
                        .collect(),
                    label,
                    data,
                    used: AtomicBool::new(false),
                })
                .collect(),
        }
    }

    /// Region `region` is fetched by this restore (its chunks never fetched will count).
    pub(crate) fn use_region(&self, region: usize) {
        self.regions[region].used.store(true, Ordering::Relaxed);
    }

    /// Chunk `chunk` of region `region` is fetched (and checked).
    pub(crate) fn mark(&self, region: usize, chunk: u64) {
        let c = to_usize(chunk);
        if let Some(word) = self.regions[region].fetched.get(c / 64) {
            word.fetch_or(1 << (c % 64), Ordering::Relaxed);
        }
    }

    /// The data chunks never fetched, per region used that has any: "LABEL: N of M data
    /// chunks never fetched: 3-9, 12, …".
    pub(crate) fn unfetched(&self) -> String {
        let mut parts = Vec::new();
        for r in self
            .regions
            .iter()
            .filter(|r| r.used.load(Ordering::Relaxed))
        {
            let fetched =
                |c: usize| r.fetched[c / 64].load(Ordering::Relaxed) & (1 << (c % 64)) != 0;
            let missing: Vec<usize> = (0..r.data.len())
                .filter(|&c| r.data[c] && !fetched(c))
                .collect();
            if missing.is_empty() {
                continue;
            }
            let total = r.data.iter().filter(|d| **d).count();
            parts.push(format!(
                "{}: {} of {total} data chunks never fetched: chunks {}",
                r.label,
                missing.len(),
                runs_text(&missing)
            ));
        }
        if parts.is_empty() {
            "every data chunk was fetched".into()
        } else {
            parts.join("; ")
        }
    }
}

/// Sorted chunk indices as runs: "3-9, 12, 40-63" (the first [`MAX_RUNS`], then how many more).
fn runs_text(sorted: &[usize]) -> String {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for &c in sorted {
        match runs.last_mut() {
            Some((_, end)) if *end + 1 == c => *end = c,
            _ => runs.push((c, c)),
        }
    }
    let mut text: Vec<String> = runs
        .iter()
        .take(MAX_RUNS)
        .map(|&(a, b)| {
            if a == b {
                a.to_string()
            } else {
                format!("{a}-{b}")
            }
        })
        .collect();
    if runs.len() > MAX_RUNS {
        text.push(format!("and {} more runs", runs.len() - MAX_RUNS));
    }
    text.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The chunks never fetched are named in runs, data chunks only, regions with none left
    /// out, and regions this restore does not fetch.
    #[test]
    fn names_the_data_chunks_never_fetched_in_runs() {
        let mut data = vec![true; 20];
        data[5] = false;
        let l = Ledger::new(vec![
            ("s/v region 'sys'".into(), vec![true]),
            ("s/v region 'ram'".into(), data),
            ("s/v region 'other'".into(), vec![true]),
        ]);
        l.use_region(0);
        l.use_region(1);
        l.mark(0, 0);
        for c in [0, 1, 2, 10, 19] {
            l.mark(1, c);
        }
        assert_eq!(
            l.unfetched(),
            "s/v region 'ram': 14 of 19 data chunks never fetched: chunks 3-4, 6-9, 11-18"
        );
        let many: Vec<usize> = (0..40).map(|i| i * 2).collect();
        assert!(runs_text(&many).ends_with("22, and 28 more runs"));
        for c in 0..20 {
            l.mark(1, c);
        }
        assert_eq!(l.unfetched(), "every data chunk was fetched");
    }
}
