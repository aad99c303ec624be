//! `guestmem bench …`: each benchmark reproduces one seed's table and, with `--json`, prints one
//! JSON object whose figures carry their unit in their name.

use clap::Subcommand;

mod populate;

#[derive(Subcommand)]
pub enum Bench {
    /// Seed 000: populating a region from an image, method by method, against mmap+memcpy.
    Populate(populate::Args),
}

pub fn main(bench: Bench) -> crate::Result<()> {
    match bench {
        Bench::Populate(args) => populate::main(args),
    }
}
