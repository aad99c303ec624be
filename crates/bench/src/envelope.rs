//! What every bench's `--json` carries beside its own figures, under the key `run`: the code that
//! produced them (commit, and whether the tree had uncommitted changes when the binary was built),
//! the host (kernel, CPU model, cores), what the hypervisor under this machine took while the
//! bench ran (steal), and the command line — so that any stored figure can be traced back and
//! reproduced, and two results can be told apart by more than their date.

use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

use crate::Steal;

/// When the bench process started measuring: set once by [`crate::main`].
static STARTED: OnceLock<Started> = OnceLock::new();

struct Started {
    steal: Steal,
    at: SystemTime,
    load_average: Option<String>,
}

fn started() -> &'static Started {
    STARTED.get_or_init(|| Started {
        steal: Steal::start(),
        at: SystemTime::now(),
        load_average: load_average(),
    })
}

/// Marks the start of the run whose steal time and load the envelope reports.
pub(crate) fn start() {
    started();
}

/// `/proc/loadavg`'s 1, 5 and 15 minute figures: how much else wanted the CPUs.
pub(crate) fn load_average() -> Option<String> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
}

/// The envelope itself.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub(crate) struct Run {
    /// `git rev-parse HEAD` of the tree the binary was built from ("unknown" outside git).
    pub commit: String,
    /// Whether that tree had uncommitted changes to tracked files at build time.
    pub tree_dirty: bool,
    pub guestmem_version: &'static str,
    /// `uname -r`.
    pub kernel: String,
    /// `/proc/cpuinfo`'s first `model name`.
    pub cpu_model: String,
    pub cores: usize,
    /// Steal over the whole bench run, percent of all CPUs' time.
    pub host_steal_percent: Option<f64>,
    /// The load average when the bench started and when it printed its results: on this
    /// 2-core machine, anything much above the bench's own threads means figures taken beside
    /// other work.
    pub load_average_start: Option<String>,
    pub load_average_end: Option<String>,
    pub started_unix_s: u64,
    pub duration_s: f64,
    pub command_line: Vec<String>,
}

impl Run {
    /// The envelope of this process's run so far.
    pub(crate) fn now() -> Run {
        let started = started();
        Run {
            commit: env!("GUESTMEM_COMMIT").to_string(),
            tree_dirty: env!("GUESTMEM_TREE_DIRTY") == "true",
            guestmem_version: env!("CARGO_PKG_VERSION"),
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .map_or_else(|_| "unknown".into(), |s| s.trim().to_string()),
            cpu_model: cpu_model().unwrap_or_else(|| "unknown".into()),
            cores: std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
            host_steal_percent: started.steal.percent().map(|p| (p * 100.0).round() / 100.0),
            load_average_start: started.load_average.clone(),
            load_average_end: load_average(),
            started_unix_s: started
                .at
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            duration_s: started.at.elapsed().map_or(0.0, |d| d.as_secs_f64()),
            command_line: std::env::args().collect(),
        }
    }
}

fn cpu_model() -> Option<String> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("model name"))?;
    Some(line.split_once(':')?.1.trim().to_string())
}

/// Prints a bench's `--json` output: its own object with the envelope added as `run`.
pub(crate) fn print(out: &impl Serialize) -> crate::Result<()> {
    println!(
        "{}",
        serde_json::to_string_pretty(&with_run(out, Run::now())?)?
    );
    Ok(())
}

fn with_run(out: &impl Serialize, run: Run) -> crate::Result<serde_json::Value> {
    let mut value = serde_json::to_value(out)?;
    match value.as_object_mut() {
        Some(object) => {
            object.insert("run".into(), serde_json::to_value(run)?);
            Ok(value)
        }
        None => Ok(serde_json::json!({ "result": value, "run": run })),
    }
}

/// For the benches' figures: the runs of one figure and what a reader compares them by.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub(crate) struct Figure {
    pub runs: Vec<f64>,
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Figure {
    /// None for no runs (or a NaN among them, which no bench produces on purpose).
    pub(crate) fn of(runs: &[f64]) -> Option<Figure> {
        if runs.is_empty() || runs.iter().any(|r| r.is_nan()) {
            return None;
        }
        let mut sorted = runs.to_vec();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        let median = if n % 2 == 1 {
            sorted[n / 2]
        } else {
            (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
        };
        Some(Figure {
            runs: runs.to_vec(),
            median,
            min: sorted[0],
            max: sorted[n - 1],
        })
    }

    /// [`Figure::of`] the runs a bench took: at least one (its `--runs` is checked before it
    /// starts) and none NaN (times and rates).
    pub(crate) fn measured(runs: &[f64]) -> Figure {
        Figure::of(runs).expect("a bench takes at least one run, and times and rates are not NaN")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_envelope_is_added_beside_the_figures() {
        #[derive(Serialize)]
        struct Out {
            total_ms: f64,
        }
        let run = Run::now();
        let v = with_run(&Out { total_ms: 1.5 }, run.clone()).unwrap();
        assert_eq!(v["total_ms"], 1.5);
        assert_eq!(v["run"]["commit"], run.commit.as_str());
        assert_eq!(v["run"]["cores"], run.cores);
        assert!(
            run.commit.len() == 40 || run.commit == "unknown",
            "{}",
            run.commit
        );
        assert!(!run.kernel.is_empty());
        // A bench whose output is not an object keeps it, under `result`.
        let v = with_run(&[1, 2], run).unwrap();
        assert_eq!(v["result"][1], 2);
    }

    #[test]
    fn a_figure_has_its_runs_median_min_and_max() {
        let f = Figure::of(&[3.0, 1.0, 2.0]).unwrap();
        assert_eq!((f.median, f.min, f.max), (2.0, 1.0, 3.0));
        assert_eq!(f.runs, vec![3.0, 1.0, 2.0]);
        assert_eq!(Figure::of(&[4.0, 1.0]).unwrap().median, 2.5);
        assert_eq!(Figure::of(&[]), None);
        assert_eq!(Figure::of(&[1.0, f64::NAN]), None);
    }
}
