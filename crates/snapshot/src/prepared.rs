//! Restoring into a pre-created VM (a warm pool): the KVM VM, its guest memory registered as
//! memslots and its vCPUs are built ahead of time for a configuration (memory layout, vCPU
//! count), so that the time from "restore this snapshot" to the guest running leaves out
//! creating the VM and registering its memslots (registering 8 GiB costs milliseconds on a
//! shadow-paging KVM).
//!
//! A [`PreparedVm`] has never run and its RAM was never touched, so a lazy restore can arm
//! its pagers on the memory as it is (a page no one wrote faults as missing). A snapshot
//! restored into it must have been taken of a VM of the very same configuration: anything
//! else is refused before any of its bytes reach the VM, naming what differs
//! ([`layout_mismatch`]).

use std::time::Duration;

use guestmem_memory::RegionSpec;
use guestmem_vm::{Vm, VmConfig};

use crate::{Error, Result};

/// A VM built for a configuration and never run, waiting for a snapshot of that configuration
/// (a [`crate::RestoreTarget`] of [`crate::restore`], for every snapshot format).
#[derive(Debug)]
pub struct PreparedVm {
    vm: Vm,
}

impl PreparedVm {
    /// Builds the VM of `config` (memory created and registered as memslots, payload and page
    /// tables in place, vCPUs created), to be restored into later.
    pub fn new(config: &VmConfig) -> Result<PreparedVm> {
        Ok(PreparedVm {
            vm: Vm::new(config)?,
        })
    }

    /// The configuration it was built for.
    pub fn config(&self) -> &VmConfig {
        self.vm.config()
    }

    /// Where building it spent its time, step by step.
    pub fn build_phases(&self) -> &[(&'static str, Duration)] {
        self.vm.build_phases()
    }

    /// Checks that a snapshot of a VM of `config` (named `snapshot` in the error) fits this
    /// VM; a pool can call it before handing the VM over, to keep it on a refusal.
    pub fn check(&self, config: &VmConfig, snapshot: &str) -> Result<()> {
        match layout_mismatch(self.config(), config) {
            None => Ok(()),
            Some(reason) => Err(Error::PreparedMismatch {
                snapshot: snapshot.to_string(),
                reason,
            }),
        }
    }

    /// The VM, for a snapshot of a VM of `config` (named `snapshot` in the error): refused
    /// (and the VM dropped) unless [`PreparedVm::check`] accepts it.
    pub fn take(self, config: &VmConfig, snapshot: &str) -> Result<Vm> {
        self.check(config, snapshot)?;
        Ok(self.vm)
    }
}

/// What differs between a prepared VM's configuration and a snapshot's, in words (`None`: they
/// are the same): the vCPU count, the RAM regions (by name), and per region its address, size,
/// backend and NUMA policy, and the dirty ring.
pub fn layout_mismatch(prepared: &VmConfig, snapshot: &VmConfig) -> Option<String> {
    let mut diffs = Vec::new();
    if prepared.vcpus != snapshot.vcpus {
        diffs.push(format!(
            "the snapshot has {} vCPU(s), the prepared VM {}",
            snapshot.vcpus, prepared.vcpus
        ));
    }
    let names = |c: &VmConfig| c.regions.iter().map(|r| r.name.clone()).collect::<Vec<_>>();
    if names(prepared) != names(snapshot) {
        diffs.push(format!(
            "the snapshot's RAM regions are {:?}, the prepared VM's {:?}",
            names(snapshot),
            names(prepared)
        ));
    } else {
        for (p, s) in prepared.regions.iter().zip(&snapshot.regions) {
            diffs.extend(region_mismatch(p, s));
        }
    }
    if prepared.dirty_ring_bytes != snapshot.dirty_ring_bytes {
        diffs.push(format!(
            "the snapshot's VM has dirty ring {:?} (bytes per vCPU), the prepared VM {:?}",
            snapshot.dirty_ring_bytes, prepared.dirty_ring_bytes
        ));
    }
    (!diffs.is_empty()).then(|| diffs.join("; "))
}

fn region_mismatch(p: &RegionSpec, s: &RegionSpec) -> Option<String> {
    let mut fields = Vec::new();
    if p.size != s.size {
        fields.push(format!(
            "{} bytes ({} MiB) in the snapshot, {} bytes ({} MiB) in the prepared VM",
            s.size,
            s.size >> 20,
            p.size,
            p.size >> 20
        ));
    }
    if p.gpa != s.gpa {
        fields.push(format!(
            "at guest address {:#x} in the snapshot, {:#x} in the prepared VM",
            s.gpa, p.gpa
        ));
    }
    if p.backend != s.backend {
        fields.push(format!(
            "backend {} in the snapshot, {} in the prepared VM",
            s.backend, p.backend
        ));
    }
    if p.numa != s.numa {
        fields.push(format!(
            "NUMA policy {:?} in the snapshot, {:?} in the prepared VM",
            s.numa, p.numa
        ));
    }
    (!fields.is_empty()).then(|| format!("region '{}': {}", s.name, fields.join(", ")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use guestmem_memory::Backend;

    #[test]
    fn the_same_configuration_fits() {
        let c = VmConfig::simple(2, 1 << 30, Backend::Anon);
        assert_eq!(layout_mismatch(&c, &c.clone()), None);
    }

    #[test]
    fn each_difference_is_named() {
        let prepared = VmConfig::simple(2, 1 << 30, Backend::Anon);
        let mut snap = VmConfig::simple(1, 8 << 30, Backend::Memfd);
        snap.regions[0].gpa += 1 << 30;
        let text = layout_mismatch(&prepared, &snap).unwrap();
        assert!(
            text.contains("the snapshot has 1 vCPU(s), the prepared VM 2"),
            "{text}"
        );
        assert!(
            text.contains("region 'ram': 8589934592 bytes (8192 MiB) in the snapshot, 1073741824 bytes (1024 MiB) in the prepared VM"),
            "{text}"
        );
        assert!(text.contains("at guest address"), "{text}");
        assert!(
            text.contains("backend memfd in the snapshot, anon in the prepared VM"),
            "{text}"
        );

        let mut other = prepared.clone();
        other.regions[0].name = "mem".into();
        let text = layout_mismatch(&prepared, &other).unwrap();
        assert!(
            text.contains(r#"RAM regions are ["mem"], the prepared VM's ["ram"]"#),
            "{text}"
        );

        let mut ring = prepared.clone();
        ring.dirty_ring_bytes = Some(4096);
        assert!(layout_mismatch(&prepared, &ring)
            .unwrap()
            .contains("dirty ring"));
    }
}
