//! Thread priorities on the fault path: a vCPU waits while its fault is served, so the threads
//! serving faults run ahead of everything else the host does (best effort: raising a priority
//! needs `CAP_SYS_NICE`; without it they run at the default).

/// Runs the calling thread at nice -10: ahead of normal tasks, still sharing the CPU with them.
pub fn raise() {
    // SAFETY: setpriority on this thread only (a tid is a valid PRIO_PROCESS `who`).
    unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, -10) };
}

/// Runs the calling thread at nice `nice` (a background thread: a higher value than the
/// process's lowers its priority, which needs no privilege).
pub fn set_nice(nice: i32) {
    // SAFETY: setpriority on this thread only (a tid is a valid PRIO_PROCESS `who`).
    unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, nice) };
}

/// Runs `f` on the calling thread as [`make_realtime`] does, then puts the thread's
/// scheduling policy and nice value back: short foreground work that a client waits for (a
/// restore) runs ahead of the vCPUs and the background work of a busy host, without keeping
/// the priority afterwards. Threads it starts begin under its policy: pager threads reset
/// theirs ([`reset`]).
pub fn foreground<T>(f: impl FnOnce() -> T) -> T {
    // SAFETY: sched_getscheduler and sched_getparam read this thread's (pid 0) policy into a
    // parameter block of ours; gettid has no preconditions; __errno_location returns this
    // thread's errno; getpriority reads this thread's nice value only (it may return -1 as a
    // nice value: errno tells an error apart).
    let (policy, param, nice) = unsafe {
        let policy = libc::sched_getscheduler(0);
        let mut param = libc::sched_param { sched_priority: 0 };
        libc::sched_getparam(0, &raw mut param);
        *libc::__errno_location() = 0;
        let nice = libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t);
        (
            policy,
            param,
            (*libc::__errno_location() == 0).then_some(nice),
        )
    };
    make_realtime();
    let out = f();
    if policy >= 0 {
        // SAFETY: sets this thread's (pid 0) policy back to what it read above.
        unsafe { libc::sched_setscheduler(0, policy, &raw const param) };
    }
    set_nice(nice.unwrap_or(0));
    out
}

/// Runs the calling thread under the normal policy (`SCHED_OTHER`) if it runs under another
/// (it inherited `SCHED_FIFO` from the thread that started it, see [`foreground`]); its nice
/// value stays as inherited. A pager thread starts so, then takes its own priority.
pub fn reset() {
    // SAFETY: sched_getscheduler reads this thread's (pid 0) policy.
    if unsafe { libc::sched_getscheduler(0) } == libc::SCHED_OTHER {
        return;
    }
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: sched_setscheduler on this thread only (pid 0), with a valid parameter block.
    unsafe { libc::sched_setscheduler(0, libc::SCHED_OTHER, &raw const param) };
}

/// Runs the calling thread at nice 0 again (after [`raise`]).
pub fn normal() {
    // SAFETY: setpriority on this thread only (a tid is a valid PRIO_PROCESS `who`).
    unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 0) };
}

/// Runs the calling thread under `SCHED_FIFO` (priority 1): it preempts every normal task the
/// moment it becomes runnable, so a fault waits for no time slice. Only for threads that block
/// between short bursts of work, as fault service does (the kernel's real-time throttling still
/// leaves others 5% of each second). Falls back to [`raise`] where that is not permitted.
pub fn make_realtime() {
    let param = libc::sched_param { sched_priority: 1 };
    // SAFETY: sched_setscheduler on this thread only (pid 0), with a valid parameter block.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &raw const param) } != 0 {
        raise();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nice() -> i32 {
        // SAFETY: reads this thread's nice value only.
        unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t) }
    }

    fn policy() -> i32 {
        // SAFETY: reads this thread's (pid 0) policy.
        unsafe { libc::sched_getscheduler(0) }
    }

    /// `foreground` runs its closure at a raised priority (real time where allowed) and puts
    /// the thread's policy and nice value back afterwards; `reset` and `normal` return to the
    /// defaults.
    #[test]
    fn foreground_puts_the_priority_back() {
        std::thread::spawn(|| {
            set_nice(5);
            assert_eq!(nice(), 5);
            let (inside_policy, inside_nice) = foreground(|| (policy(), nice()));
            assert!(
                inside_policy == libc::SCHED_FIFO || inside_nice < 5,
                "not raised: policy {inside_policy}, nice {inside_nice}"
            );
            assert_eq!((policy(), nice()), (libc::SCHED_OTHER, 5));
            make_realtime();
            reset();
            assert_eq!(policy(), libc::SCHED_OTHER);
            normal();
            assert_eq!(nice(), 0);
        })
        .join()
        .unwrap();
    }
}
