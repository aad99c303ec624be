//! CPU placement of threads: a VMM keeps its vCPU threads and its housekeeping threads (the
//! pager's) on separate host CPUs by pinning each group to its own set.

use std::io;

/// A set of host CPUs that threads are pinned to.
#[derive(Clone, Copy)]
pub struct CpuSet(libc::cpu_set_t);

impl CpuSet {
    /// The CPUs `cpus`, each of which must be one the calling thread may run on
    /// (`sched_getaffinity`): the error names the first that is not, and the allowed ones.
    pub fn new(cpus: &[usize]) -> Result<CpuSet, String> {
        if cpus.is_empty() {
            return Err("an empty CPU list; at least one CPU is needed".into());
        }
        let allowed = CpuSet::of_current_thread()
            .map_err(|e| format!("sched_getaffinity (the CPUs this process may use): {e}"))?;
        // SAFETY: an all-zero cpu_set_t is the empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        for &cpu in cpus {
            if !allowed.contains(cpu) {
                return Err(format!(
                    "CPU {cpu} does not exist or is not one this process may run on (allowed: \
                     {})",
                    allowed.list()
                ));
            }
            // SAFETY: `cpu` is below CPU_SETSIZE (`contains` checked it), within the set.
            unsafe { libc::CPU_SET(cpu, &mut set) };
        }
        Ok(CpuSet(set))
    }

    /// The CPUs the calling thread may run on now.
    pub fn of_current_thread() -> io::Result<CpuSet> {
        // SAFETY: an all-zero cpu_set_t is the empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: fills `set`, whose size we pass, for the calling thread (pid 0).
        if unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&set), &raw mut set) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(CpuSet(set))
    }

    /// Restricts the calling thread to these CPUs; the threads it starts afterwards inherit
    /// them.
    pub fn pin_current_thread(&self) -> io::Result<()> {
        // SAFETY: reads the set, whose size we pass, for the calling thread (pid 0).
        if unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&self.0), &raw const self.0) }
            != 0
        {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    fn contains(&self, cpu: usize) -> bool {
        // SAFETY: CPU_ISSET reads bit `cpu` of the set, checked to be within it first.
        cpu < libc::CPU_SETSIZE as usize && unsafe { libc::CPU_ISSET(cpu, &self.0) }
    }

    /// The CPUs of the set, in order.
    pub fn cpus(&self) -> Vec<usize> {
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&cpu| self.contains(cpu))
            .collect()
    }

    /// The CPUs of the set, e.g. "0, 1".
    fn list(&self) -> String {
        let cpus: Vec<String> = self
            .cpus()
            .iter()
            .map(std::string::ToString::to_string)
            .collect();
        cpus.join(", ")
    }
}

impl std::fmt::Debug for CpuSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CpuSet({})", self.list())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An empty list and a CPU this process may not use are refused, the latter listing the
    /// allowed ones; a thread pinned to a set runs on exactly it.
    #[test]
    fn sets_are_checked_and_pin_a_thread() {
        assert_eq!(
            CpuSet::new(&[]).unwrap_err(),
            "an empty CPU list; at least one CPU is needed"
        );
        let allowed = CpuSet::of_current_thread().unwrap().cpus();
        assert!(!allowed.is_empty());
        let e = CpuSet::new(&[allowed[0], 100_000]).unwrap_err();
        let list: Vec<String> = allowed.iter().map(ToString::to_string).collect();
        assert_eq!(
            e,
            format!(
                "CPU 100000 does not exist or is not one this process may run on (allowed: {})",
                list.join(", ")
            )
        );
        let first = *allowed.last().unwrap();
        let set = CpuSet::new(&[first]).unwrap();
        assert_eq!(format!("{set:?}"), format!("CpuSet({first})"));
        let pinned = std::thread::spawn(move || {
            set.pin_current_thread().unwrap();
            CpuSet::of_current_thread().unwrap().cpus()
        })
        .join()
        .unwrap();
        assert_eq!(pinned, vec![first]);
    }
}
