//! `guestmem bench …`: each benchmark reproduces one seed's table and, with `--json`, prints one
//! JSON object whose figures carry their unit in their name.

use clap::Subcommand;

#[derive(Subcommand)]
pub enum Bench {
    /// Placeholder until the first benchmark lands.
    #[command(hide = true)]
    None,
}

pub fn main(bench: Bench) -> crate::Result<()> {
    match bench {
        Bench::None => Err("no benchmark selected".into()),
    }
}
