//! `--progress json[=FILE]`: the library's progress records ([`guestmem_events::Event`]) as
//! JSON lines on stderr or into a file; and, when stderr is a terminal that the lines do not
//! go to, a progress bar (bytes moved and to go, rate, ETA) drawn from the same records.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use guestmem_events::{Event, Metrics, MetricsAddr, MetricsServer, Sink, Status};
use indicatif::{ProgressBar, ProgressStyle};

/// Where `--progress` sends the records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProgressTo {
    /// `json`: JSON lines on stderr.
    Stderr,
    /// `json=FILE`: JSON lines into FILE (created or truncated).
    File(PathBuf),
}

impl std::str::FromStr for ProgressTo {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once('=') {
            None if s == "json" => Ok(ProgressTo::Stderr),
            Some(("json", file)) if !file.is_empty() => Ok(ProgressTo::File(file.into())),
            _ => Err(format!(
                "'{s}': the progress format is json (JSON lines on stderr) or json=FILE"
            )),
        }
    }
}

/// The flags of a command that reports progress.
#[derive(clap::Args, Debug, Clone)]
pub struct ProgressArgs {
    /// Progress records, one JSON object per line (schema guestmem.progress/1,
    /// docs/schemas/): `json` on stderr, `json=FILE` into FILE. At every change of status and
    /// every --progress-interval-ms.
    #[arg(long, value_name = "json[=FILE]")]
    pub progress: Option<ProgressTo>,
    /// Milliseconds between two progress records of the same status (at least 10).
    #[arg(long, default_value_t = 1000)]
    pub progress_interval_ms: u64,
}

/// What a command reports its progress to: the library's sink, and the bar it draws (cleared
/// with [`Progress::finish`]).
#[derive(Debug, Default)]
pub struct Progress {
    pub sink: Option<Sink>,
    bar: Option<ProgressBar>,
}

impl Progress {
    /// JSON lines where `args` say, and a bar when `bar` is asked for and stderr is a
    /// terminal that the lines do not go to.
    pub fn new(args: &ProgressArgs, bar: bool) -> crate::Result<Progress> {
        let lines: Option<Box<dyn Write + Send>> = match &args.progress {
            None => None,
            Some(ProgressTo::Stderr) => Some(Box::new(std::io::stderr())),
            Some(ProgressTo::File(path)) => {
                Some(Box::new(std::fs::File::create(path).map_err(|e| {
                    format!("--progress json={}: cannot create it: {e}", path.display())
                })?))
            }
        };
        let bar =
            (bar && args.progress != Some(ProgressTo::Stderr) && std::io::stderr().is_terminal())
                .then(new_bar);
        if lines.is_none() && bar.is_none() {
            return Ok(Progress::default());
        }
        let lines = lines.map(Mutex::new);
        let shown = bar.clone();
        let sink = Sink::new(move |e: &Event| {
            if let Some(out) = &lines {
                let mut out = out
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                // A reader gone (a closed pipe) does not stop the work.
                let _ = writeln!(out, "{}", e.to_json_line()).and_then(|()| out.flush());
            }
            if let Some(bar) = &shown {
                draw(bar, e);
            }
        })
        .every(Duration::from_millis(args.progress_interval_ms));
        Ok(Progress {
            sink: Some(sink),
            bar,
        })
    }

    /// Only the bar, when stderr is a terminal.
    pub fn bar() -> Progress {
        let args = ProgressArgs {
            progress: None,
            progress_interval_ms: 1000,
        };
        Progress::new(&args, true).expect("no file to create")
    }

    /// Clears the bar, if one is drawn.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

/// `--metrics ADDR`: the process's metrics served for Prometheus.
#[derive(clap::Args, Debug, Clone)]
pub struct MetricsArgs {
    /// Serve metrics (OpenMetrics text, `GET /metrics`; docs/metrics.md) on unix:PATH or a
    /// loopback HOST:PORT, e.g. 127.0.0.1:9464, while the process runs.
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<MetricsAddr>,
}

/// The metrics and their server, while the process serves them.
#[derive(Debug)]
pub struct Served {
    pub metrics: Arc<Metrics>,
    _server: MetricsServer,
}

impl MetricsArgs {
    /// The metrics, served where `--metrics` says (told on stderr), or `None`.
    pub fn start(&self) -> crate::Result<Option<Served>> {
        let Some(addr) = &self.metrics else {
            return Ok(None);
        };
        let metrics = Metrics::new();
        let server = MetricsServer::start(metrics.clone(), addr)
            .map_err(|e| format!("--metrics {addr:?}: cannot listen: {e}"))?;
        match (server.port(), addr) {
            (Some(port), _) => {
                eprintln!("guestmem: metrics on 127.0.0.1 port {port} (GET /metrics)");
            }
            (None, MetricsAddr::Unix(path)) => {
                eprintln!(
                    "guestmem: metrics on unix:{} (GET /metrics)",
                    path.display()
                );
            }
            (None, MetricsAddr::Tcp(_)) => {}
        }
        Ok(Some(Served {
            metrics,
            _server: server,
        }))
    }
}

/// The progress reporter of this process's snapshot or restore, which a stall of its chunk
/// store is told to (one such operation per process).
static STALL_REPORTER: Mutex<Option<Arc<guestmem_events::Reporter>>> = Mutex::new(None);

/// Store stalls from now on show in `reporter`'s records (`stalled`, then the status before
/// once the store answers).
pub fn report_stalls_to(reporter: Arc<guestmem_events::Reporter>) {
    *STALL_REPORTER
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(reporter);
}

/// The store options' `on_stall` (`--store-timeout`): a stall, or the store answering again,
/// into the progress records where a run reports them. A failure needs no record here: the
/// run's own error ends its stream `failed`.
pub fn store_stall(e: &guestmem_store::StallEvent) {
    let reporter = STALL_REPORTER
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    if let Some(r) = reporter {
        match e.status {
            guestmem_store::StallStatus::Stalled => r.stalled(),
            guestmem_store::StallStatus::Answered => r.answered(),
            _ => {}
        }
    }
}

/// `sink` and the metrics' sink, whichever there are.
pub fn with_metrics(sink: Option<Sink>, served: Option<&Served>) -> Option<Sink> {
    match (sink, served.map(|s| s.metrics.sink())) {
        (Some(a), Some(b)) => Some(a.tee(b)),
        (a, b) => a.or(b),
    }
}

fn new_bar() -> ProgressBar {
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} {elapsed_precise} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} \
             ETA {eta} {msg}",
        )
        .expect("a valid template")
        .progress_chars("=> "),
    );
    bar.enable_steady_tick(Duration::from_millis(100));
    bar
}

/// The bar for record `e`: bytes moved of those moved and to go, and what the record adds.
fn draw(bar: &ProgressBar, e: &Event) {
    let to_go = e.bytes_remaining.unwrap_or(0);
    bar.set_length(e.bytes_transferred + to_go);
    bar.set_position(e.bytes_transferred);
    let mut msg = e.status.to_string();
    if let Some(r) = e.round {
        msg += &format!(" round {r}");
    }
    if let Some(d) = e.dirty_rate_bytes_per_s {
        msg += &format!(", dirty {:.1} MiB/s", d / f64::from(1 << 20));
    }
    if let Some(ms) = e.expected_downtime_ms {
        msg += &format!(", downtime ~{ms:.1} ms");
    }
    if let Some(t) = e.throttle_percent.filter(|&t| t > 0) {
        msg += &format!(", throttled {t} %");
    }
    if let Some(f) = e.faults {
        msg += &format!(", {f} faults");
    }
    if e.status == Status::Failed {
        msg += &format!(": {}", e.error.as_deref().unwrap_or("?"));
    }
    bar.set_message(msg);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_takes_json_or_json_to_a_file() {
        assert_eq!("json".parse(), Ok(ProgressTo::Stderr));
        assert_eq!(
            "json=/tmp/p.jsonl".parse(),
            Ok(ProgressTo::File("/tmp/p.jsonl".into()))
        );
        for bad in ["", "text", "json=", "yaml=x"] {
            let e = bad.parse::<ProgressTo>().unwrap_err();
            assert!(e.contains("json=FILE"), "{e}");
        }
    }

    /// Records written to a file are one JSON object per line, in order.
    #[test]
    fn records_go_to_the_file_as_json_lines() {
        let path = std::env::temp_dir().join(format!("gm-progress-{}.jsonl", std::process::id()));
        let args = ProgressArgs {
            progress: Some(ProgressTo::File(path.clone())),
            progress_interval_ms: 10,
        };
        let p = Progress::new(&args, false).unwrap();
        let r = guestmem_events::Reporter::new(
            p.sink.clone().unwrap(),
            guestmem_events::Operation::Snapshot,
        );
        r.emit(Event::new(Status::Setup));
        r.emit(Event::new(Status::Completed));
        let text = std::fs::read_to_string(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert_eq!(lines[0]["status"], "setup");
        assert_eq!(lines[1]["status"], "completed");
        assert_eq!(lines[1]["operation"], "snapshot");
    }
}
