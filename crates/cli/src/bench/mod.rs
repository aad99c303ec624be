//! `guestmem bench …`: each benchmark reproduces one seed's table and, with `--json`, prints one
//! JSON object whose figures carry their unit in their name.

use clap::Subcommand;

mod memslots;

#[derive(Subcommand)]
pub enum Bench {
    /// Seed 002: memslot_perf_test over the memslot manager, and cached vs fresh device accesses.
    Memslots(memslots::Args),
}

pub fn main(bench: Bench) -> crate::Result<()> {
    match bench {
        Bench::Memslots(args) => memslots::main(args),
    }
}
