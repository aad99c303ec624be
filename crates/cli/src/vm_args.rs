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
