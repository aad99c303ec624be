//! A restore service: one snapshot (any [`SnapshotImage`]: flat or in a chunk store) held
//! open, restored lazily again and again (clones), with everything that does not depend on
//! which clone is restored done once or ahead of time.
//!
//! Opened once: the sys region (page tables, payload, control blocks) read and checked; the
//! recorded working set read and checked; the vCPU and VM state parsed. Ahead of a restore, in
//! a pool: VMs of the snapshot's configuration built (memory registered as memslots, vCPUs
//! created), the sys region copied in, the pagers armed on their RAM (userfaultfd registered,
//! the shared image mapped, the threads started, the working-set prefetch held)
//! ([`ArmedVm`]); a finished clone's VM can go back into the pool, wiped and armed again
//! ([`RestoreService::recycle`]), instead of a new one being built. What a restore does: put
//! the vCPU state in and let the prefetch go. Every chunk is still checked before any clone
//! sees it: the pagers are the restore engine's own (see [`crate::restore`]). A lazy restore that opens the snapshot and builds the VM each
//! time spends most of its time on what this leaves out, and with many restores at once on
//! few cores those parts queue for the CPU.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use guestmem_paging::{priority, PagerConfig};
use guestmem_vm::Vm;

use crate::pagers::RegionPagers;
use crate::pooled::PoolMachine;
use crate::progress::RestoreProgress;
use crate::recycle;
use crate::restore::{check_layout, read_sys, start_pagers, Restored, SnapshotImage};
use crate::working_set::WorkingSetRegion;
use crate::{Error, PreparedVm, Result};
use guestmem_events::{Metrics, Sink};
use std::sync::Arc;

/// Restores through a service in this process so far (their records' `session`).
static SESSIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A snapshot held open for lazy restores (see the module docs), with a pool of VMs armed
/// for it: guestmem's payload VMs by default, or a Linux guest's ([`guestmem_vm::linux::LinuxVm`],
/// whose console a restore's caller then points at the clone's).
pub struct RestoreService<I, M: PoolMachine = Vm> {
    image: I,
    /// The sys region's non-zero pieces (guest address, bytes), checked.
    sys: Vec<(u64, Vec<u8>)>,
    working_set: Option<Vec<WorkingSetRegion>>,
    /// The VM's state, parsed.
    state: M::State,
    config: PagerConfig,
    pool: Mutex<Vec<ArmedVm<M>>>,
    /// Where each restore's progress records go.
    events: Option<Sink>,
    /// The process's metrics: the pool's size and the recycles (the restores' own figures
    /// come through `events`).
    metrics: Option<Arc<Metrics>>,
}

impl<I: SnapshotImage, M: PoolMachine> std::fmt::Debug for RestoreService<I, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RestoreService")
            .field("image", &self.image.describe())
            .field("pooled", &self.pooled())
            .finish_non_exhaustive()
    }
}

/// A VM built for a [`RestoreService`]'s snapshot and never run, its sys region in place and
/// its pagers armed (their background fetches held): what is left of a restore into it is
/// putting its vCPU state in and letting the prefetch go. The pagers go before the VM.
#[derive(Debug)]
pub struct ArmedVm<M = Vm> {
    pagers: RegionPagers,
    vm: M,
    /// The identity of the snapshot whose sys region it holds.
    snapshot: String,
    /// How long copying the sys region in and arming the pagers took.
    armed_in: Duration,
}

impl<M: PoolMachine> ArmedVm<M> {
    /// The VM (e.g. to look at its build phases); never run.
    pub fn vm(&self) -> &M {
        &self.vm
    }

    /// The steps of its build: the VM's build phases, then copying the sys region in and
    /// arming the pagers.
    pub fn build_steps(&self) -> Vec<(&'static str, Duration)> {
        let mut steps = self.vm.build_steps();
        steps.push(("copy the sys region and arm the pagers", self.armed_in));
        steps
    }
}

/// A clone restored by a [`RestoreService`].
#[derive(Debug)]
pub struct ServiceRestore<M = Vm> {
    /// Its progress records, when the service has a sink ([`RestoreService::with_events`]):
    /// a ticker reads the pagers until the memory is resident (call
    /// [`RestoreProgress::finish`] when the clone is done with, for the final record).
    pub progress: Option<RestoreProgress>,
    /// The restored VM and its pagers (the caller resumes the VM).
    pub lazy: Restored<M>,
    /// Where the restore spent its time, step by step (its `ready` is their sum).
    pub phases: Vec<(&'static str, Duration)>,
    /// If the pool was empty: the steps of the build on the restore's clock (inside its
    /// "prepare (pool empty)" phase; see [`ArmedVm::build_steps`]), to tell where such a build
    /// waits; empty otherwise.
    pub built: Vec<(&'static str, Duration)>,
}

impl<I: SnapshotImage> RestoreService<I> {
    /// A service of guestmem's payload VMs for `image` ([`RestoreService::for_machine`]).
    pub fn new(image: I, config: PagerConfig) -> Result<RestoreService<I>> {
        RestoreService::for_machine(image, config)
    }

    /// `prepared` armed for this snapshot: refused, naming what differs, unless it was built
    /// for the snapshot's configuration; then the sys region is copied in and the pagers are
    /// armed, their background fetches held until a restore.
    pub fn arm(&self, prepared: PreparedVm) -> Result<ArmedVm> {
        let t = Instant::now();
        let vm = prepared.take(self.image.config(), &self.image.describe())?;
        self.arm_vm(vm, t)
    }
}

impl<I: SnapshotImage, M: PoolMachine> RestoreService<I, M> {
    /// A service for `image` pooling VMs of kind `M`, restored with pagers configured by
    /// `config` (its `share` names the directory of the clones' shared image; the snapshot's
    /// identity is added): reads and checks its sys region and working set and parses its
    /// state (a state of another VM kind is refused, naming both).
    pub fn for_machine(image: I, config: PagerConfig) -> Result<RestoreService<I, M>> {
        let sys = read_sys(&image)?;
        let working_set = if config.prefetch.is_empty() {
            image.recorded_working_set()?
        } else {
            None
        };
        let state = M::parse_state(image.machine_state())?;
        Ok(RestoreService {
            image,
            sys,
            working_set,
            state,
            config,
            pool: Mutex::new(Vec::new()),
            events: None,
            metrics: None,
        })
    }

    /// The same service, its restores, pool and recycles counted in `metrics` (each restore's
    /// records also go to [`Metrics::sink`], besides any [`RestoreService::with_events`] sink).
    #[must_use]
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> RestoreService<I, M> {
        let sink = metrics.sink();
        self.events = Some(match self.events.take() {
            Some(s) => s.tee(sink),
            None => sink,
        });
        self.metrics = Some(metrics);
        self
    }

    /// The pool's size (`pool`, its lock held) told to the metrics.
    fn pool_size_is(&self, pool: usize) {
        if let Some(m) = &self.metrics {
            m.pool_size.set(i64::try_from(pool).unwrap_or(i64::MAX));
        }
    }

    /// The same service, each restore's progress records ([`RestoreProgress`], operation
    /// `restore`) going to `sink`.
    #[must_use]
    pub fn with_events(mut self, sink: Sink) -> RestoreService<I, M> {
        self.events = Some(sink);
        self
    }

    /// A restore's records begin, if the service has a sink, marked with the restore's number
    /// (this process's restores through a service, from 1: they run concurrently).
    fn progress(&self) -> Option<RestoreProgress> {
        let total = self.image.regions().iter().map(|r| r.size).sum();
        self.events.as_ref().map(|s| {
            let session = SESSIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
            RestoreProgress::start_session(s, total, Some(session))
        })
    }

    /// `restored` with its records: `failed`, or the ticker over its pagers.
    fn reported(
        progress: Option<RestoreProgress>,
        restored: Result<ServiceRestore<M>>,
    ) -> Result<ServiceRestore<M>> {
        let Some(mut p) = progress else {
            return restored;
        };
        match restored {
            Err(e) => {
                p.failed(&e);
                Err(e)
            }
            Ok(mut r) => {
                p.ready(&r.lazy.pagers, &r.lazy.userfault_pagers);
                r.progress = Some(p);
                Ok(r)
            }
        }
    }

    /// The snapshot it restores (its components' states are in
    /// [`SnapshotImage::components`]).
    pub fn image(&self) -> &I {
        &self.image
    }

    /// Builds a VM armed for this snapshot (see [`ArmedVm`]), to be restored later.
    pub fn prepare(&self) -> Result<ArmedVm<M>> {
        let vm = M::build(self.image.config())?;
        self.arm_vm(vm, Instant::now())
    }

    /// `vm` (of the snapshot's configuration, its memory as a fresh build's) armed: the sys
    /// region copied in, the pagers armed with their background fetches held; `t` is when
    /// arming it started.
    fn arm_vm(&self, vm: M, t: Instant) -> Result<ArmedVm<M>> {
        check_layout(vm.memory(), &self.image)?;
        for (gpa, bytes) in &self.sys {
            vm.memory().write(*gpa, bytes)?;
        }
        let config = PagerConfig {
            hold_background: true,
            ..self.config.clone()
        };
        let pagers = start_pagers(&self.image, &vm, &config, self.working_set.as_deref())?;
        Ok(ArmedVm {
            pagers,
            vm,
            snapshot: self.image.identity().to_string(),
            armed_in: t.elapsed(),
        })
    }

    /// Takes a finished clone of this service (its vCPUs stopped: nothing runs it) back into
    /// the pool instead of tearing its VM down, which saves the next restore that finds the pool
    /// empty a build of a VM (the kernel's part of which queues behind running guests on a
    /// busy host). Its pagers are stopped; every region of its memory, the sys region among
    /// them, is replaced by fresh memory (the module `recycle` lists what else is reset or
    /// checked); what its vCPUs' last exits left pending in KVM is completed; then it is
    /// armed as a new VM is (the sys region copied in, new pagers over its RAM, nothing
    /// resident, the working-set prefetch held) and pooled; the next restore puts the vCPU
    /// state in. A VM that cannot be reset so (a pager failed, its run was aborted, a
    /// guest_memfd region, dirty rings, changed memslots, another configuration) is torn
    /// down and the error names why ([`Error::NotRecycled`]); so is one whose reset fails
    /// part-way: a VM is never pooled half reset.
    pub fn recycle(&self, clone: Restored<M>) -> Result<()> {
        let t = Instant::now();
        let Restored {
            pagers,
            userfault_pagers,
            mut vm,
            peer,
            ..
        } = clone;
        let unfit = recycle::unfit(
            &pagers,
            &userfault_pagers,
            &vm,
            peer.as_ref(),
            self.image.config(),
        );
        // The pagers stop (threads joined, userfaultfds unregistered) before anything of the
        // VM is touched or dropped.
        drop((pagers, userfault_pagers, peer));
        unfit.map_err(Error::NotRecycled)?;
        // A pager that failed after the check above still stopped the VM's runs.
        if let Some(reason) = vm.abort_handle().and_then(|h| h.reason()) {
            return Err(Error::NotRecycled(format!("its run was aborted: {reason}")));
        }
        vm.complete_pending_exits()?;
        recycle::wipe(vm.memory()).map_err(Error::NotRecycled)?;
        let armed = self.arm_vm(vm, t)?;
        let mut pool = self
            .pool
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        pool.push(armed);
        self.pool_size_is(pool.len());
        if let Some(m) = &self.metrics {
            m.recycles.inc();
        }
        Ok(())
    }

    /// Adds armed VMs to the pool until it holds `n`.
    pub fn fill(&self, n: usize) -> Result<()> {
        while self.pooled() < n {
            let armed = self.prepare()?;
            let mut pool = self
                .pool
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            pool.push(armed);
            self.pool_size_is(pool.len());
        }
        Ok(())
    }

    /// Armed VMs waiting in the pool.
    pub fn pooled(&self) -> usize {
        self.pool
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len()
    }

    /// The build phases of the VM the pool would hand out next (empty if none).
    pub fn pooled_build_phases(&self) -> Vec<(&'static str, Duration)> {
        self.pool
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .last()
            .map(ArmedVm::<M>::build_steps)
            .unwrap_or_default()
    }

    /// Restores a clone into a VM of the pool, or one built now if the pool is empty (its
    /// phases then start with "prepare (pool empty)"). The build runs at the caller's
    /// priority: it takes milliseconds of CPU and waits on the kernel, too long to hold a
    /// real-time priority over the running guests and the pool's refill.
    pub fn restore(&self) -> Result<ServiceRestore<M>> {
        let progress = self.progress();
        Self::reported(progress, self.restore_unreported())
    }

    /// [`RestoreService::restore`], before its records.
    fn restore_unreported(&self) -> Result<ServiceRestore<M>> {
        let t = Instant::now();
        let pooled = {
            let mut pool = self
                .pool
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let armed = pool.pop();
            self.pool_size_is(pool.len());
            armed
        };
        match pooled {
            Some(armed) => self.restore_armed_unreported(armed),
            None => {
                let armed = self.prepare()?;
                let built = t.elapsed();
                let steps = armed.build_steps();
                let mut restored = self.restore_armed_unreported(armed)?;
                restored.phases.insert(0, ("prepare (pool empty)", built));
                restored.built = steps;
                restored.lazy.ready += built;
                Ok(restored)
            }
        }
    }

    /// Drops every VM of the pool (their memory and descriptors go back).
    pub fn clear(&self) {
        let pool = std::mem::take(
            &mut *self
                .pool
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        self.pool_size_is(0);
        drop(pool);
    }

    /// Restores a clone into `armed`: puts the vCPU state in and lets its pagers' prefetch (the
    /// working set) go; the caller resumes it. A VM armed for another snapshot is refused.
    pub fn restore_armed(&self, armed: ArmedVm<M>) -> Result<ServiceRestore<M>> {
        let progress = self.progress();
        Self::reported(progress, self.restore_armed_unreported(armed))
    }

    /// [`RestoreService::restore_armed`], before its records.
    fn restore_armed_unreported(&self, armed: ArmedVm<M>) -> Result<ServiceRestore<M>> {
        // The client waits for it: ahead of the vCPUs and the host's background work
        // (prefetches, the pool's refill) while it runs (it is short: arming and vCPU state).
        priority::foreground(|| self.restore_armed_now(armed))
    }

    fn restore_armed_now(&self, armed: ArmedVm<M>) -> Result<ServiceRestore<M>> {
        let start = Instant::now();
        let mut t = start;
        let mut phases = Vec::new();
        let mut lap = |name: &'static str| {
            let now = Instant::now();
            phases.push((name, now - t));
            t = now;
        };
        if armed.snapshot != self.image.identity() {
            return Err(Error::Layout(format!(
                "the VM was armed for the snapshot of manifest checksum {}, not {}'s ({})",
                armed.snapshot,
                self.image.describe(),
                self.image.identity()
            )));
        }
        let ArmedVm {
            pagers:
                RegionPagers {
                    pagers,
                    userfault_pagers,
                },
            mut vm,
            ..
        } = armed;
        vm.restore_parsed(&self.state)?;
        lap("restore vCPU state");
        for p in &pagers {
            p.release();
        }
        lap("release the prefetch");
        Ok(ServiceRestore {
            progress: None,
            lazy: Restored {
                pagers,
                userfault_pagers,
                vm,
                peer: None,
                phases: phases.iter().map(|(n, d)| ((*n).to_string(), *d)).collect(),
                ready: start.elapsed(),
                prefetched: self.working_set.is_some(),
            },
            phases,
            built: Vec::new(),
        })
    }
}
