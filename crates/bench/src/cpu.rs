//! CPU time of a process's threads over an interval, grouped by what each thread is (from its
//! name): the source's and the destination's work during a migration, without the guest's vCPU
//! threads (a throttled payload spins, so a vCPU thread costs a whole CPU whatever the
//! migration does).
//!
//! A thread that exits during the interval takes its CPU time with it from `/proc/PID/task`,
//! so a background thread reads every thread's times every [`PERIOD`] and keeps the last
//! reading of each: a thread's last period before it exits may be missed.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const PERIOD: Duration = Duration::from_millis(50);
/// `/proc` counts CPU time in USER_HZ ticks, which Linux fixes at 100 for user space.
const TICKS_PER_S: f64 = 100.0;

/// Per thread: its class, its CPU ticks at the first and at the last reading.
type Seen = HashMap<(u32, u32), (Option<usize>, u64, u64)>;

/// A sampler of the CPU time of processes' threads, from [`Sampler::start`] to
/// [`Sampler::stop`].
pub struct Sampler {
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Seen>>,
    thread: Option<std::thread::JoinHandle<()>>,
    classes: usize,
}

impl Sampler {
    /// Samples the threads of `pids`, each thread counted in class `classify(pid index,
    /// name)` (of `classes`).
    pub fn start(
        pids: Vec<u32>,
        classes: usize,
        classify: fn(usize, &str) -> Option<usize>,
    ) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(Seen::new()));
        let read = {
            let seen = seen.clone();
            // `initial`: the threads there at the start count from their time then; those
            // born later from zero.
            move |initial: bool| {
                let mut seen = seen
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                for (i, &pid) in pids.iter().enumerate() {
                    for (tid, name, ticks) in threads(pid) {
                        let first = if initial { ticks } else { 0 };
                        seen.entry((pid, tid))
                            .and_modify(|e| e.2 = ticks)
                            .or_insert((classify(i, &name), first, ticks));
                    }
                }
            }
        };
        read(true);
        let thread = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("cpu-sampler".into())
                .spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        std::thread::sleep(PERIOD);
                        read(false);
                    }
                })
                .ok()
        };
        Sampler {
            stop,
            seen,
            thread,
            classes,
        }
    }

    /// Stops sampling; CPU seconds per class since [`Sampler::start`].
    pub fn stop(mut self) -> Vec<f64> {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let mut secs = vec![0.0; self.classes];
        let seen = self
            .seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for &(class, first, last) in seen.values() {
            if let Some(c) = class.filter(|&c| c < self.classes) {
                secs[c] += last.saturating_sub(first) as f64 / TICKS_PER_S;
            }
        }
        secs
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// `pid`'s threads: id, name, user + system ticks.
fn threads(pid: u32) -> Vec<(u32, String, u64)> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    dir.filter_map(|e| {
        let e = e.ok()?;
        let tid: u32 = e.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
        // `tid (name) state ...`: the name may hold spaces and parentheses; the fields
        // after the last ')' start with the state (field 3); utime and stime are 14 and 15.
        let open = stat.find('(')?;
        let close = stat.rfind(')')?;
        let name = stat[open + 1..close].to_string();
        let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
        let utime: u64 = fields.get(11)?.parse().ok()?;
        let stime: u64 = fields.get(12)?.parse().ok()?;
        Some((tid, name, utime + stime))
    })
    .collect()
}

/// This thread's CPU time (user and system, so page faults and the kernel's work for its
/// syscalls count), seconds.
pub(crate) fn thread_cpu_s() -> f64 {
    let mut r = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes one rusage into the zeroed buffer.
    let r = unsafe {
        libc::getrusage(libc::RUSAGE_THREAD, r.as_mut_ptr());
        r.assume_init()
    };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(r.ru_utime) + tv(r.ru_stime)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_a_busy_thread() {
        let s = Sampler::start(vec![std::process::id()], 1, |_, name| {
            (name == "cpu-test-spin").then_some(0)
        });
        std::thread::Builder::new()
            .name("cpu-test-spin".into())
            .spawn(|| {
                // Spin until this thread has had 0.3 s of CPU (however busy the host is).
                let me = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
                let tid: u32 = me.split_whitespace().next().unwrap().parse().unwrap();
                let mine = || {
                    threads(std::process::id())
                        .into_iter()
                        .find(|t| t.0 == tid)
                        .map_or(0, |t| t.2)
                };
                let mut x = 0u64;
                while mine() < 30 {
                    for _ in 0..100_000 {
                        x = std::hint::black_box(x.wrapping_add(1));
                    }
                }
            })
            .unwrap()
            .join()
            .unwrap();
        let secs = s.stop();
        // The sampler may miss the thread's last period before it exited.
        assert!(secs[0] >= 0.2 && secs[0] <= 0.4, "{secs:?}");
    }
}
