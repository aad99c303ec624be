//! NUMA placement (seed 004): the policy round-trips on every backend, a missing node is
//! refused, and populated pages are where the policy says.

mod common;

use common::HugePages;
use guestmem_memory::{
    node_pages, nodes_with_memory, populate, Backend, Error, GuestMemory, NumaMode, NumaPolicy,
    RegionSpec, Source,
};
use kvm_ioctls::Kvm;

const SIZE: u64 = 4 << 20;

fn spec(backend: Backend, policy: &str) -> RegionSpec {
    RegionSpec {
        numa: policy.parse().unwrap(),
        ..RegionSpec::new("placed", 1 << 32, SIZE, backend)
    }
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn policy_round_trips_on_every_backend() {
    let vm = Kvm::new().unwrap().create_vm().unwrap();
    let nodes = nodes_with_memory();
    let all = nodes
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let policies = [
        format!("bind:{}", nodes[0]),
        format!("interleave:{all}"),
        format!("preferred:{}", nodes[nodes.len() - 1]),
        "default".to_string(),
    ];
    for backend in Backend::ALL {
        let _pages = HugePages::for_backend(backend, SIZE);
        for policy in &policies {
            let mem = GuestMemory::new(&[spec(backend, policy)], Some(&vm))
                .unwrap_or_else(|e| panic!("{backend} {policy}: {e}"));
            let region = &mem.regions()[0];
            let seen = region.numa_policy().unwrap();
            assert_eq!(
                seen.to_string(),
                *policy,
                "{backend}: get_mempolicy disagrees"
            );
        }
    }
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn a_missing_node_is_refused() {
    let vm = Kvm::new().unwrap().create_vm().unwrap();
    let missing = nodes_with_memory().last().unwrap() + 1;
    for backend in [Backend::Anon, Backend::Memfd, Backend::GuestMemfd] {
        for mode in ["bind", "interleave", "preferred"] {
            let policy = format!("{mode}:{missing}");
            let err = GuestMemory::new(&[spec(backend, &policy)], Some(&vm)).unwrap_err();
            assert!(
                matches!(err, Error::Numa { .. }),
                "{backend} {policy}: {err:?}"
            );
            let msg = err.to_string();
            assert!(
                msg.contains("region 'placed'")
                    && msg.contains(&format!(
                        "host node {missing} does not exist or has no memory"
                    )),
                "{msg}"
            );
        }
    }
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn populated_pages_sit_on_the_bound_node() {
    let vm = Kvm::new().unwrap().create_vm().unwrap();
    let node = *nodes_with_memory().last().unwrap();
    let image = vec![0x5au8; SIZE as usize];
    for backend in [Backend::Anon, Backend::Memfd, Backend::GuestMemfd] {
        let mem = GuestMemory::new(&[spec(backend, &format!("bind:{node}"))], Some(&vm)).unwrap();
        let region = &mem.regions()[0];
        assert_eq!(region.spec().numa.mode, NumaMode::Bind);
        assert!(
            node_pages(region).unwrap().is_empty(),
            "{backend}: pages before population"
        );
        populate(region, 0, SIZE, Source::Bytes(&image)).unwrap();
        let placed = node_pages(region).unwrap();
        assert_eq!(
            placed.into_iter().collect::<Vec<_>>(),
            vec![(node, SIZE)],
            "{backend}"
        );
    }
    assert_eq!(NumaPolicy::default().to_string(), "default");
}
