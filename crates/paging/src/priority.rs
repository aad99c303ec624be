//! Thread priorities on the fault path: a vCPU waits while its fault is served, so the threads
//! serving faults run ahead of everything else the host does (best effort: raising a priority
//! needs `CAP_SYS_NICE`; without it they run at the default).

/// Runs the calling thread at nice -10: ahead of normal tasks, still sharing the CPU with them.
pub fn raise() {
    // SAFETY: setpriority on this thread only (a tid is a valid PRIO_PROCESS `who`).
    unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, -10) };
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
