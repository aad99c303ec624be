//! NUMA placement (guest_memfd NUMA mempolicy): the policy round-trips on every backend, a missing
//! node is refused, and populated pages are where the policy says.

mod common;

use common::HugePages;
use guestmem_memory::{
    node_pages, nodes_with_memory, populate, Backend, Error, GuestMemory, NumaMode, NumaPolicy,
    PopulateFrom, RegionSpec,
};
use guestmem_sys::to_usize;
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
    let image = vec![0x5au8; to_usize(SIZE)];
    for backend in [Backend::Anon, Backend::Memfd, Backend::GuestMemfd] {
        let mem = GuestMemory::new(&[spec(backend, &format!("bind:{node}"))], Some(&vm)).unwrap();
        let region = &mem.regions()[0];
        assert_eq!(region.spec().numa.mode, NumaMode::Bind);
        assert!(
            node_pages(region).unwrap().is_empty(),
            "{backend}: pages before population"
        );
        populate(region, 0, SIZE, PopulateFrom::Bytes(&image)).unwrap();
        let placed = node_pages(region).unwrap();
        assert_eq!(
            placed.into_iter().collect::<Vec<_>>(),
            vec![(node, SIZE)],
            "{backend}"
        );
    }
    assert_eq!(NumaPolicy::default().to_string(), "default");
}

/// guest_memfd placed by policy, checked per node with `move_pages` after population: on a
/// host of two or more nodes, `bind` puts all 64 MiB on the named node (each node in turn),
/// `interleave` over two nodes splits them within 2 % of even, and `preferred` puts them on the
/// preferred node (it has room); on one node each policy names that node and all the pages sit
/// there. Where the kernel has no host-mapped guest_memfd, the region is refused naming what
/// it lacks.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn gmem_placement_follows_bind_interleave_and_preferred() {
    const GMEM_SIZE: u64 = 64 << 20;
    let vm = Kvm::new().unwrap().create_vm().unwrap();
    let placed_spec = |policy: &str| RegionSpec {
        numa: policy.parse().unwrap(),
        ..RegionSpec::new("placed", 1 << 32, GMEM_SIZE, Backend::GuestMemfd)
    };
    if !guestmem_sys::probe::probe().has_guest_memfd_mmap() {
        let err = GuestMemory::new(&[placed_spec("default")], Some(&vm)).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("region 'placed'")
                && (msg.contains("KVM_CAP_GUEST_MEMFD") || msg.contains("MMAP|INIT_SHARED")),
            "{msg}"
        );
        return;
    }
    let nodes = nodes_with_memory();
    let (first, last) = (nodes[0], nodes[nodes.len() - 1]);
    let image = vec![0xa5u8; to_usize(GMEM_SIZE)];
    let place = |policy: &str| {
        let mem = GuestMemory::new(&[placed_spec(policy)], Some(&vm))
            .unwrap_or_else(|e| panic!("{policy}: {e}"));
        let region = &mem.regions()[0];
        assert_eq!(region.numa_policy().unwrap().to_string(), policy);
        populate(region, 0, GMEM_SIZE, PopulateFrom::Bytes(&image)).unwrap();
        let placed = node_pages(region).unwrap();
        assert_eq!(
            placed.values().sum::<u64>(),
            GMEM_SIZE,
            "{policy}: every page is somewhere: {placed:?}"
        );
        placed
    };
    for node in &nodes {
        let placed = place(&format!("bind:{node}"));
        assert_eq!(
            placed.get(node),
            Some(&GMEM_SIZE),
            "bind:{node}: {placed:?}"
        );
    }
    let placed = place(&format!("preferred:{last}"));
    assert_eq!(
        placed.get(&last),
        Some(&GMEM_SIZE),
        "preferred:{last}: {placed:?}"
    );
    if first == last {
        let placed = place(&format!("interleave:{first}"));
        assert_eq!(placed.get(&first), Some(&GMEM_SIZE), "{placed:?}");
        return;
    }
    let placed = place(&format!("interleave:{first},{last}"));
    let even = GMEM_SIZE / 2;
    for node in [first, last] {
        let on = *placed.get(&node).unwrap_or(&0);
        assert!(
            on.abs_diff(even) * 50 <= even,
            "interleave: node {node} holds {on} bytes of {GMEM_SIZE}, more than 2 % off even: \
             {placed:?}"
        );
    }
}
