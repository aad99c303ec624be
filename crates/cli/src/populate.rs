//! `guestmem populate`: fills a fresh VM region from an image file by the fastest method the
//! kernel and backend offer, and reports which one it used and how long it took.

use std::fs::File;
use std::path::PathBuf;

use guestmem_memory::{
    populate, Backend, GuestMemory, NumaPolicy, PopulateFrom, Populated, RegionSpec,
};
use serde::Serialize;

use crate::units::parse_size;

#[derive(clap::Args)]
pub struct Args {
    /// The image to load (its size must be a multiple of the backend's page size).
    #[arg(long)]
    image: PathBuf,
    /// Region backend: anon, memfd, memfd-hugetlb, hugetlb, gmem.
    #[arg(long, default_value = "gmem")]
    backend: Backend,
    /// Region size (default: the image's size).
    #[arg(long, value_parser = parse_size)]
    size: Option<u64>,
    /// Where in the region the image goes.
    #[arg(long, default_value = "0", value_parser = parse_size)]
    offset: u64,
    /// NUMA policy of the region, e.g. interleave:0-1, bind:0, preferred:1, default.
    #[arg(long, default_value = "default")]
    numa: NumaPolicy,
    /// Print one JSON object instead of the summary.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Output {
    image: PathBuf,
    backend: Backend,
    region_bytes: u64,
    offset: u64,
    numa: String,
    elapsed_ms: f64,
    #[serde(flatten)]
    populated: Populated,
}

pub fn main(args: Args) -> crate::Result<()> {
    let file = File::open(&args.image).map_err(|e| format!("{}: {e}", args.image.display()))?;
    let len = file.metadata()?.len();
    let size = args.size.unwrap_or(args.offset + len);
    let spec = RegionSpec {
        numa: args.numa.clone(),
        ..RegionSpec::new("image", 1 << 32, size, args.backend)
    };
    let kvm = kvm_ioctls::Kvm::new()?;
    let vm = kvm.create_vm()?;
    let mem = GuestMemory::new(&[spec], Some(&vm))?;
    let populated = populate(
        &mem.regions()[0],
        args.offset,
        len,
        PopulateFrom::file(&file),
    )?;
    let out = Output {
        image: args.image,
        backend: args.backend,
        region_bytes: size,
        offset: args.offset,
        numa: args.numa.to_string(),
        elapsed_ms: populated.elapsed.as_secs_f64() * 1e3,
        populated,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    let p = &out.populated;
    println!(
        "populated {} bytes of a {} MiB {} region at offset {:#x} via {} in {:.1} ms \
         ({} pages copied, {} zero pages skipped, {} threads)",
        p.bytes,
        size >> 20,
        out.backend,
        out.offset,
        p.method,
        out.elapsed_ms,
        p.pages_copied,
        p.zero_pages_skipped,
        p.threads
    );
    if let Some(why) = &p.fallback_reason {
        println!("fallback: {why}");
    }
    Ok(())
}
