//! The capability probe against this machine's known facts (see shared/notes/kvm-on-this-host.md):
//! kernel 6.18 with kvm_pvm, guest_memfd MMAP|INIT_SHARED, without the seeds kernel's guest_memfd
//! `write()` and KVM Userfault.
use guestmem_sys::probe::{probe, Probe};

fn kvm_caps(p: &Probe) -> &guestmem_sys::probe::KvmCaps {
    p.kvm.as_ref().expect("/dev/kvm should open on this host")
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn kvm_caps_match_this_host() {
    let p = probe();
    let k = kvm_caps(&p);
    assert_eq!(k.api_version, 12);
    assert!(*k.nr_memslots.as_ref().unwrap() > 0, "{:?}", k.nr_memslots);
    assert_ne!(*k.user_memory2.as_ref().unwrap(), 0);
    assert_ne!(*k.guest_memfd.as_ref().unwrap(), 0);

    let gmem = k.guest_memfd_flags.as_ref().unwrap();
    assert_eq!(gmem.raw, 3);
    assert_eq!(gmem.names, ["MMAP", "INIT_SHARED"]);
    assert!(p.has_guest_memfd_mmap());

    let manual = k.manual_dirty_log_protect2.as_ref().unwrap();
    assert!(manual.has("MANUAL_PROTECT_ENABLE"), "{manual:?}");
    assert!(manual.has("INITIALLY_SET"), "{manual:?}");

    assert!(*k.dirty_log_ring_max_bytes.as_ref().unwrap() > 0);
    assert!(*k.dirty_log_ring_acq_rel_max_bytes.as_ref().unwrap() > 0);
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn guest_memfd_write_is_absent() {
    let p = probe();
    let w = p.guest_memfd_write.as_ref().unwrap();
    assert!(!w.present, "{w:?}");
    assert_eq!(w.flag, None);
    assert!(
        w.detail.contains("ESPIPE") || w.detail.contains("EINVAL"),
        "{w:?}"
    );
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn kvm_userfault_is_absent() {
    let p = probe();
    let u = p.kvm_userfault.as_ref().unwrap();
    assert!(!u.present, "{u:?}");
    assert!(u.detail.contains("EINVAL"), "{u:?}");
}

#[test]
fn numa_has_a_node_with_memory() {
    let p = probe();
    let nodes = p.numa.nodes.as_ref().unwrap();
    assert!(nodes.iter().any(|n| n.mem_total_kib > 0), "{nodes:?}");
    assert!(p.numa.get_mempolicy.available, "{:?}", p.numa.get_mempolicy);
}

#[test]
fn userfaultfd_offers_minor_shmem_and_wp() {
    let p = probe();
    let u = p.userfaultfd.as_ref().unwrap();
    assert!(u.has_feature("MINOR_SHMEM"), "{:?}", u.features);
    assert!(u.has_feature("PAGEFAULT_FLAG_WP"), "{:?}", u.features);
    assert!(u.ioctls.has("API"), "{:?}", u.ioctls);
}

#[test]
fn host_answers() {
    let p = probe();
    assert!(p.host.kernel_release.as_ref().unwrap().starts_with("6."));
    assert!(*p.host.page_size_bytes.as_ref().unwrap() >= 4096);
    assert!(*p.host.online_cpus.as_ref().unwrap() >= 1);
}

#[test]
fn serializes_to_json() {
    let p = probe();
    let v = serde_json::to_value(&p).unwrap();
    for key in [
        "host",
        "kvm",
        "guest_memfd_write",
        "kvm_userfault",
        "userfaultfd",
        "thp",
        "hugetlb",
        "numa",
    ] {
        assert!(v.get(key).is_some(), "missing {key} in {v}");
    }
    assert!(v["host"]["page_size_bytes"]["Ok"].as_u64().is_some(), "{v}");
    assert!(
        v["numa"]["nodes"]["Ok"][0]["mem_total_kib"]
            .as_u64()
            .is_some(),
        "{v}"
    );
}
