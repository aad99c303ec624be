//! The options that describe a VM, shared by the commands that build one.

use guestmem_memory::Backend;
use guestmem_vm::VmConfig;

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
}

impl VmArgs {
    /// The VM these options describe, or an error naming the option that cannot work.
    pub fn config(&self) -> crate::Result<VmConfig> {
        if self.vcpus == 0 {
            return Err("--vcpus must be at least 1".into());
        }
        Ok(VmConfig::simple(self.vcpus, self.memory, self.backend))
    }
}
