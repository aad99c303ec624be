//! `guestmem probe`: what the running kernel offers for guest memory.

#[derive(clap::Args)]
pub struct Args {
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

pub fn main(args: Args) -> crate::Result<()> {
    let probe = guestmem_sys::probe::probe();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&probe)?);
    } else {
        print!("{}", probe.table());
    }
    Ok(())
}
