//! After the switch-over: the received VM resumed, the source told, and (post-copy) the wait
//! until every page is resident.

use std::time::{Duration, Instant};

use guestmem_paging::Pager;

use super::*;
use crate::protocol::{link_error, write_frame, Mode};
use crate::stream::Frame;
use crate::{MigrationError, Result};
use guestmem_contract::TargetMachine;

impl Transfer {
    /// Runs the received VM's vCPUs ([`TargetMachine::resume`]), tells the source (the
    /// downtime ends), and, in post-copy, opens the link to the pagers.
    pub fn resume<'v, M: TargetMachine>(&mut self, vm: &'v mut M) -> Result<M::Running<'v>> {
        let resumed = self.resume_reported(vm);
        if let Some(p) = &self.progress {
            match &resumed {
                Ok(_) => self.ticker = p.running(self.postcopy.as_ref()),
                Err(e) => p.failed(e),
            }
        }
        resumed
    }

    /// [`Transfer::resume`], before its progress record.
    fn resume_reported<'v, M: TargetMachine>(&mut self, vm: &'v mut M) -> Result<M::Running<'v>> {
        let mut links = self.links.take().ok_or(MigrationError::AlreadyResumed)?;
        let running = vm.resume()?;
        self.running_at = Some(Instant::now());
        write_frame(&mut links.pages[0], &Frame::Running)?;
        if !self.streams.is_empty() {
            crate::stream::free_aside(std::mem::take(&mut self.streams));
        }
        match &self.postcopy {
            None => {
                let json = serde_json::to_vec(&self.report).expect("a report serializes");
                write_frame(&mut links.pages[0], &Frame::Complete { report_json: json })?;
            }
            Some(p) => {
                p.link.open(links)?;
                let link = p.link.clone();
                let listener = p.listener.clone();
                let migration = p.migration;
                std::thread::Builder::new()
                    .name("postcopy-keeper".into())
                    .spawn(move || link.keep(&listener, migration))
                    .map_err(|e| link_error("spawning the link keeper", e))?;
            }
        }
        Ok(running)
    }

    /// The migration's mode.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Post-copy: memory still to arrive, in bytes (0 once everything is resident).
    pub fn missing_bytes(&self) -> u64 {
        self.postcopy.as_ref().map_or(0, |p| {
            let uffd: u64 = p
                .pagers
                .iter()
                .map(|pager| {
                    let s = pager.stats();
                    if s.retired {
                        0
                    } else {
                        pager.size().saturating_sub(s.resident_bytes)
                    }
                })
                .sum();
            let kvm: u64 = p
                .userfault_pagers
                .iter()
                .map(|pager| pager.size().saturating_sub(pager.stats().resident_bytes))
                .sum();
            uffd + kvm
        })
    }

    /// Waits until the transfer is over (post-copy: every page resident, the source told), and
    /// returns the destination's figures. A post-copy whose source is gone for good ends with
    /// the error (and the VM, stopped by it, names the guest address it missed).
    pub fn finish(mut self) -> Result<DestinationReport> {
        let progress = self.progress.take();
        let finished = self.finish_postcopy();
        drop(self.ticker.take());
        match (&progress, &finished) {
            (Some(p), Ok((report, missing))) if self.mode.has_postcopy() => {
                p.finished(report, *missing);
            }
            (Some(p), Err(e)) => p.failed(e),
            _ => {}
        }
        finished.map(|(report, _)| report)
    }

    /// [`Transfer::finish`]: the report, and (post-copy) the bytes still missing at the end
    /// (none, unless a pager retired early).
    fn finish_postcopy(&mut self) -> Result<(DestinationReport, u64)> {
        let Some(p) = self.postcopy.take() else {
            return Ok((self.report.clone(), 0));
        };
        let started = Instant::now();
        loop {
            let mut all = true;
            for pager in &p.pagers {
                if !pager.wait_resident(Duration::from_millis(50))? {
                    all = false;
                }
            }
            for pager in &p.userfault_pagers {
                if !pager.wait_resident(Duration::from_millis(50))? {
                    all = false;
                }
            }
            if all {
                break;
            }
        }
        // Its probes go before the pagers do.
        drop(self.ticker.take());
        let missing = p
            .pagers
            .iter()
            .map(|pg| pg.size().saturating_sub(pg.stats().resident_bytes))
            .chain(
                p.userfault_pagers
                    .iter()
                    .map(|pg| pg.size().saturating_sub(pg.stats().resident_bytes)),
            )
            .sum();
        let mut report = self.report.clone();
        // From Running to the last pager's retirement, however late `finish` is called (not
        // the time `finish` waited: ~0 when the guest ran for longer than post-copy took).
        let retired = p
            .pagers
            .iter()
            .filter_map(Pager::retired_at)
            .chain(
                p.userfault_pagers
                    .iter()
                    .filter_map(UserfaultPager::resident_at),
            )
            .max();
        report.resident_ms = match (self.running_at, retired) {
            (Some(running), Some(retired)) => retired.saturating_duration_since(running),
            _ => started.elapsed(),
        }
        .as_secs_f64()
            * 1e3;
        report.faults = p.pagers.iter().map(|pg| pg.stats().faults).sum::<u64>()
            + p.userfault_pagers
                .iter()
                .map(|pg| pg.stats().faults)
                .sum::<u64>();
        p.link.fill_report(&mut report);
        let json = serde_json::to_vec(&report).expect("a report serializes");
        p.link.close(&json)?;
        Ok((report, missing))
    }
}
