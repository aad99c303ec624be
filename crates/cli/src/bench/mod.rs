//! `guestmem bench …`: each benchmark reproduces one seed's table and, with `--json`, prints one
//! JSON object whose figures carry their unit in their name.

use clap::Subcommand;

mod dirty_log;

#[derive(Subcommand)]
pub enum Bench {
    /// Dirty-page tracking per mode, like the kernel's dirty_log_perf_test (seed 003).
    DirtyLog(dirty_log::Args),
}

pub fn main(bench: Bench) -> crate::Result<()> {
    match bench {
        Bench::DirtyLog(args) => dirty_log::main(args),
    }
}
