//! The options that describe a VM, shared by the commands that build one.

use std::path::PathBuf;

use guestmem_memory::{Backend, ImageLoad};
use guestmem_vm::{Vm, VmConfig};

use crate::units::parse_size;

#[derive(clap::Args)]
pub struct VmArgs {
    /// Guest memory size (one region at 1 GiB), e.g. 512M, 1G.
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    pub memory: u64,
    /// Number of vCPUs; each works on its own equal share of guest memory.
    #[arg(long, default_value_t = 2)]
    pub vcpus: usize,
    /// Memory backend: anon, memfd, memfd-hugetlb, hugetlb, gmem.
    #[arg(long, default_value = "anon")]
    pub backend: Backend,
    /// Start guest RAM from this memory image (raw or zstd-compressed, e.g. a capture made by
    /// scripts/capture-guest-memory.sh) instead of zeros; the workload runs on top of it.
    #[arg(long, value_name = "FILE")]
    pub image: Option<PathBuf>,
}

impl VmArgs {
    /// The VM these options describe, or an error naming the option that cannot work.
    pub fn config(&self) -> crate::Result<VmConfig> {
        if self.vcpus == 0 {
            return Err("--vcpus must be at least 1".into());
        }
        Ok(VmConfig::simple(self.vcpus, self.memory, self.backend))
    }

    /// Puts `--image` (if given) into the RAM of `vm`, a VM built from [`VmArgs::config`] that
    /// has not run yet.
    pub fn load_image(&self, vm: &Vm) -> crate::Result<Option<ImageLoad>> {
        let Some(path) = &self.image else {
            return Ok(None);
        };
        let ram = vm
            .memory()
            .region("ram")
            .ok_or("the VM has no region 'ram' to load --image into")?;
        let load = guestmem_memory::load_image(ram, path)?;
        tracing::info!(
            "image {} ({} MiB) loaded in {:.0} ms: {} pages copied, {} zero pages skipped",
            path.display(),
            load.image_bytes >> 20,
            load.elapsed.as_secs_f64() * 1e3,
            load.pages_copied,
            load.zero_pages_skipped
        );
        Ok(Some(load))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> VmArgs {
        let mut all = vec!["migrate", "send", "--to", "unix:/s", "--keys", "/k"];
        all.extend_from_slice(extra);
        match crate::tests::parse_for_test(&all).unwrap() {
            crate::Command::Migrate(crate::migrate::Migrate::Send(a)) => a.vm,
            _ => unreachable!("migrate send parses as itself"),
        }
    }

    /// The options make the VM they describe; no vCPU is refused naming the option; without
    /// --image nothing is loaded.
    #[test]
    fn options_make_the_vm_or_name_the_problem() {
        let c = args(&["--memory", "64M", "--vcpus", "3", "--backend", "memfd"])
            .config()
            .unwrap();
        assert_eq!((c.vcpus, c.regions.len()), (3, 1));
        assert_eq!(
            (c.regions[0].size, c.regions[0].backend),
            (64 << 20, Backend::Memfd)
        );
        let d = args(&[]);
        assert_eq!((d.memory, d.vcpus, d.backend), (1 << 30, 2, Backend::Anon));
        assert_eq!(
            args(&["--vcpus", "0"]).config().err().unwrap().to_string(),
            "--vcpus must be at least 1"
        );
        let small = args(&["--memory", "2M", "--vcpus", "1"]);
        let vm = Vm::new(&small.config().unwrap()).unwrap();
        assert!(small.load_image(&vm).unwrap().is_none());
        let missing = args(&["--memory", "2M", "--image", "/nonexistent/ram.raw"]);
        let e = missing.load_image(&vm).unwrap_err().to_string();
        assert!(e.contains("/nonexistent/ram.raw"), "{e}");
    }
}
