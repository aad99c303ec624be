//! `guestmem numa`: creates a region under a NUMA policy, populates it, and prints where its
//! pages are, per host node, in the before/after table shape of guest_memfd NUMA mempolicy.

use guestmem_sys::to_usize;
use std::collections::BTreeMap;

use guestmem_memory::{
    node_pages, nodes_with_memory, populate, Backend, GuestMemory, NumaPolicy, PopulateFrom,
    RegionSpec,
};
use serde::Serialize;

use crate::units::parse_size;

#[derive(clap::Args)]
pub struct Args {
    /// Region size, e.g. 256M.
    #[arg(long, default_value = "256M", value_parser = parse_size)]
    size: u64,
    /// Region backend: anon, memfd, memfd-hugetlb, hugetlb, gmem (gmem needs /dev/kvm).
    #[arg(long, default_value = "memfd")]
    backend: Backend,
    /// NUMA policy, e.g. interleave:0-1, bind:1, preferred:0, default.
    #[arg(long, default_value = "default")]
    numa: NumaPolicy,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Output {
    backend: Backend,
    policy: String,
    /// The policy the kernel reports for the region's mapping.
    policy_reported: String,
    size_bytes: u64,
    nodes: Vec<u32>,
    /// Per node: MemUsed before and after population, and the region's pages there.
    mem_used_before_mib: BTreeMap<u32, f64>,
    mem_used_after_mib: BTreeMap<u32, f64>,
    region_mib: BTreeMap<u32, f64>,
}

pub fn main(args: Args) -> crate::Result<()> {
    let nodes = nodes_with_memory();
    let spec = RegionSpec {
        numa: args.numa.clone(),
        ..RegionSpec::new("ram", 1 << 32, args.size, args.backend)
    };
    let kvm_vm = match args.backend {
        Backend::GuestMemfd => {
            let kvm = kvm_ioctls::Kvm::new()?;
            let vm = kvm.create_vm()?;
            Some((kvm, vm))
        }
        _ => None,
    };
    let before = mem_used_mib(&nodes)?;
    let mem = GuestMemory::new(&[spec], kvm_vm.as_ref().map(|(_, vm)| vm))?;
    let region = &mem.regions()[0];
    // Non-zero bytes, so that every page is allocated; 2 MiB at a time.
    let chunk = vec![0x5au8; to_usize((2 << 20).min(args.size))];
    for offset in (0..args.size).step_by(chunk.len()) {
        let len = (chunk.len() as u64).min(args.size - offset);
        populate(region, offset, len, PopulateFrom::Bytes(&chunk))?;
    }
    let after = mem_used_mib(&nodes)?;
    let region_mib = node_pages(region)?
        .into_iter()
        .map(|(n, b)| (n, b as f64 / f64::from(1 << 20)))
        .collect();
    let out = Output {
        backend: args.backend,
        policy: args.numa.to_string(),
        policy_reported: region.numa_policy()?.to_string(),
        size_bytes: args.size,
        nodes,
        mem_used_before_mib: before,
        mem_used_after_mib: after,
        region_mib,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "{} MiB {} region, policy {} (kernel reports {}), MiB per host node:",
        args.size >> 20,
        out.backend,
        out.policy,
        out.policy_reported
    );
    let mut header = format!("{:<28}", "");
    for n in &out.nodes {
        header += &format!("{:>10}", format!("Node {n}"));
    }
    println!("{header}{:>10}", "Total");
    let line = |label: &str, values: &BTreeMap<u32, f64>| {
        let mut s = format!("{label:<28}");
        for n in &out.nodes {
            s += &format!("{:>10.2}", values.get(n).copied().unwrap_or(0.0));
        }
        println!("{s}{:>10.2}", values.values().sum::<f64>());
    };
    line("Before populating: MemUsed", &out.mem_used_before_mib);
    line("After populating:  MemUsed", &out.mem_used_after_mib);
    line("Region pages (move_pages)", &out.region_mib);
    Ok(())
}

/// `MemUsed` of each node from `/sys/devices/system/node/nodeN/meminfo`, in MiB.
fn mem_used_mib(nodes: &[u32]) -> crate::Result<BTreeMap<u32, f64>> {
    nodes
        .iter()
        .map(|&n| {
            let path = format!("/sys/devices/system/node/node{n}/meminfo");
            let text = std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?;
            let kib: f64 = text
                .lines()
                .find_map(|l| l.split("MemUsed:").nth(1))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
                .ok_or_else(|| format!("{path}: no MemUsed line"))?;
            Ok((n, kib / 1024.0))
        })
        .collect()
}
