//! The memslot manager and the mapping cache on the real /dev/kvm: invalid slot operations are
//! errors naming the problem, discards read as zero after revalidation, the guest sees what
//! device handles wrote after a remap, and device threads survive slot changes under stress.

use guestmem_sys::to_usize;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use guestmem_memory::{Backend, Error, MemslotManager, Region, RegionSpec, SlotFlags};
use guestmem_vm::{layout, VcpuWork, Vm, VmConfig, Workload};

const PAGE: u64 = 4096;
/// Far above any region the VM creates, so the tests' slots never meet its own.
const FREE_GPA: u64 = 0x40_0000_0000;

fn vm(backend: Backend) -> Vm {
    Vm::new(&VmConfig::simple(1, 2 << 20, backend)).expect("VM")
}

fn memslots(vm: &Vm) -> Arc<MemslotManager> {
    vm.memory().memslots().expect("registered").clone()
}

fn region(vm: &Vm, name: &str, size: u64, backend: Backend) -> Arc<Region> {
    let spec = RegionSpec::new(name, FREE_GPA, size, backend);
    Arc::new(Region::create(spec, Some(vm.fd())).expect("region"))
}

/// Reads the u64 at `offset` of a region's host mapping, whether or not a slot maps it.
fn region_word(region: &Region, offset: u64) -> u64 {
    assert!(offset + 8 <= region.size());
    // SAFETY: the region is alive (borrowed) and offset + 8 lies inside its mapping.
    unsafe { std::ptr::read_volatile(region.host_addr().add(to_usize(offset)) as *const u64) }
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn register_goes_through_the_manager() {
    let vm = vm(Backend::Anon);
    let slots = memslots(&vm);
    let list = slots.slots();
    assert_eq!(list.len(), 2, "sys and ram: {list:?}");
    assert_eq!((list[0].id, list[0].gpa), (0, layout::SYS_GPA));
    assert_eq!((list[1].id, list[1].gpa), (1, layout::RAM_GPA));
    assert!(slots.max_slots() >= 32);
    assert!(matches!(
        vm.memory().register(vm.fd()),
        Err(Error::AlreadyRegistered)
    ));
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn invalid_slot_operations_are_errors() {
    let vm = vm(Backend::Anon);
    let slots = memslots(&vm);
    let r = region(&vm, "dev", 4 * PAGE, Backend::Memfd);
    let flags = SlotFlags::default();
    let a = slots.add(&r, 0, 2 * PAGE, FREE_GPA, flags).unwrap();
    let generation = slots.generation();

    // Overlap with an existing slot, named.
    let e = slots
        .add(&r, 2 * PAGE, 2 * PAGE, FREE_GPA + PAGE, flags)
        .unwrap_err();
    assert!(
        matches!(e, Error::SlotOverlap { other_slot, .. } if other_slot == a),
        "{e}"
    );
    assert!(e.to_string().contains("region 'dev'"), "{e}");
    // Overlap with the VM's own RAM slot.
    let e = slots.add(&r, 0, PAGE, layout::RAM_GPA, flags).unwrap_err();
    assert!(matches!(e, Error::SlotOverlap { other_slot: 1, .. }), "{e}");
    // A move onto another slot, and a resize into one.
    let b = slots
        .add(&r, 2 * PAGE, PAGE, FREE_GPA + 2 * PAGE, flags)
        .unwrap();
    assert!(matches!(
        slots.move_to(b, FREE_GPA),
        Err(Error::SlotOverlap { .. })
    ));
    assert!(matches!(
        slots.resize(a, 3 * PAGE),
        Err(Error::SlotOverlap { .. })
    ));
    // Windows outside the region, empty or misaligned; misaligned guest addresses.
    for (off, size) in [
        (0, 5 * PAGE),
        (3 * PAGE, 2 * PAGE),
        (0, 0),
        (1, PAGE),
        (0, 100),
    ] {
        let e = slots
            .add(&r, off, size, FREE_GPA + 16 * PAGE, flags)
            .unwrap_err();
        assert!(
            matches!(e, Error::SlotWindow { .. }),
            "{off:#x}+{size:#x}: {e}"
        );
    }
    let e = slots
        .add(&r, 3 * PAGE, PAGE, FREE_GPA + 16 * PAGE + 8, flags)
        .unwrap_err();
    assert!(matches!(e, Error::Misaligned { .. }), "{e}");
    let e = slots
        .add(&r, 3 * PAGE, PAGE, !(PAGE - 1), flags)
        .unwrap_err();
    assert!(matches!(e, Error::OutOfRange { .. }), "{e}");
    // Unknown slots.
    for e in [
        slots.remove(4000).unwrap_err(),
        slots.move_to(4000, FREE_GPA).unwrap_err(),
        slots.resize(4000, PAGE).unwrap_err(),
        slots.set_flags(4000, flags).unwrap_err(),
        slots.slot(4000).unwrap_err(),
    ] {
        assert!(matches!(e, Error::UnknownSlot { slot: 4000 }), "{e}");
        assert_eq!(e.to_string(), "memslot 4000 does not exist");
    }
    // Discards outside any slot or misaligned; handles outside any slot or out of bounds.
    assert!(matches!(
        slots.discard(FREE_GPA + 8 * PAGE, PAGE),
        Err(Error::NoMemslot { .. })
    ));
    assert!(matches!(
        slots.discard(FREE_GPA, 100),
        Err(Error::Misaligned { .. })
    ));
    assert!(matches!(
        slots.map(FREE_GPA + 8 * PAGE, 8),
        Err(Error::NoMemslot { .. })
    ));
    assert!(matches!(
        slots.map(FREE_GPA + PAGE, 2 * PAGE),
        Err(Error::NoMemslot { .. })
    ));
    let h = slots.map(FREE_GPA, 64).unwrap();
    let e = h.read_u64(60).unwrap_err();
    assert!(
        matches!(
            e,
            Error::OutsideMapping {
                offset: 60,
                len: 8,
                ..
            }
        ),
        "{e}"
    );
    assert!(matches!(
        h.write(u64::MAX, &[1]),
        Err(Error::OutsideMapping { .. })
    ));
    // None of the refused operations changed anything.
    assert_eq!(slots.generation(), generation + 1, "only slot b was added");
    assert_eq!(slots.slot(a).unwrap().size, 2 * PAGE);
    // A removed id is reused first.
    slots.remove(a).unwrap();
    assert_eq!(slots.add(&r, 0, PAGE, FREE_GPA, flags).unwrap(), a);
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn exceeding_the_slot_limit_is_an_error() {
    let vm = vm(Backend::Anon);
    let slots = memslots(&vm);
    let free = u64::from(slots.max_slots()) - slots.len() as u64;
    let r = region(&vm, "many", free * PAGE, Backend::Anon);
    for i in 0..free {
        slots
            .add(
                &r,
                i * PAGE,
                PAGE,
                FREE_GPA + i * PAGE,
                SlotFlags::default(),
            )
            .unwrap_or_else(|e| panic!("slot {i} of {free}: {e}"));
    }
    assert_eq!(slots.len(), slots.max_slots() as usize);
    let extra = region(&vm, "one-too-many", PAGE, Backend::Anon);
    let e = slots
        .add(&extra, 0, PAGE, 0, SlotFlags::default())
        .unwrap_err();
    assert!(
        matches!(e, Error::SlotLimit { max, .. } if max == slots.max_slots()),
        "{e}"
    );
    assert!(e.to_string().contains("region 'one-too-many'"), "{e}");
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn flags_change_in_place_or_by_recreating() {
    let vm = vm(Backend::Anon);
    let slots = memslots(&vm);
    let r = region(&vm, "flags", 4 * PAGE, Backend::Memfd);
    let id = slots
        .add(&r, 0, 4 * PAGE, FREE_GPA, SlotFlags::default())
        .unwrap();
    let h = slots.map(FREE_GPA + PAGE, 8).unwrap();
    h.write_u64(0, 7).unwrap();
    for flags in [
        SlotFlags {
            log_dirty_pages: true,
            read_only: false,
        },
        SlotFlags {
            log_dirty_pages: false,
            read_only: true,
        },
        SlotFlags::default(),
    ] {
        let g = slots.generation();
        slots.set_flags(id, flags).unwrap();
        assert_eq!(slots.slot(id).unwrap().flags, flags);
        assert!(slots.generation() > g);
        assert_eq!(h.read_u64(0).unwrap(), 7, "contents survive a flag change");
    }
}

/// Writes through a handle, discards, and reads zero through the same handle after it
/// revalidated; on each backend that can discard without a VM of its own kind.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn discarded_ranges_read_as_zero_after_revalidation() {
    for backend in [Backend::Anon, Backend::Memfd, Backend::GuestMemfd] {
        let vm = vm(Backend::Anon);
        let slots = memslots(&vm);
        let r = region(&vm, "discard", 4 * PAGE, backend);
        slots
            .add(&r, 0, 4 * PAGE, FREE_GPA, SlotFlags::default())
            .unwrap();
        let h = slots.map(FREE_GPA, 4 * PAGE).unwrap();
        for page in 0..4 {
            h.write_u64(page * PAGE + 16, 0xabcd_0000 + page).unwrap();
            assert!(
                r.vmm_dirty().is_marked(page),
                "{backend}: page {page} marked dirty"
            );
        }
        let g = slots.generation();
        slots.discard(FREE_GPA + PAGE, 2 * PAGE).unwrap();
        assert!(
            slots.generation() > g,
            "{backend}: a discard bumps the generation"
        );
        let seen: Vec<u64> = (0..4).map(|p| h.read_u64(p * PAGE + 16).unwrap()).collect();
        assert_eq!(seen, [0xabcd_0000, 0, 0, 0xabcd_0003], "{backend}");
        let mut buf = [0xffu8; 32];
        slots.read(FREE_GPA + PAGE, &mut buf).unwrap();
        assert_eq!(buf, [0; 32], "{backend}: fresh lookup sees zero too");
    }
}

/// A handle follows its guest range to new host memory, and the guest agrees: the RAM slot is
/// replaced by a slot of another region at the same address, the handle writes, and the guest's
/// `verify` digest matches what the handle wrote, not the old memory.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn guest_sees_handle_writes_after_a_remap() {
    const SIZE: u64 = 2 << 20;
    let mut vm = vm(Backend::Memfd);
    let slots = memslots(&vm);
    let ram = slots
        .slots()
        .into_iter()
        .find(|s| s.gpa == layout::RAM_GPA)
        .unwrap();
    let h = slots.map(layout::RAM_GPA, SIZE).unwrap();
    h.write(0, &vec![0x11; to_usize(SIZE)]).unwrap();

    let other = region(&vm, "other", SIZE, Backend::Memfd);
    slots.remove(ram.id).unwrap();
    assert!(matches!(h.read_u64(0), Err(Error::NoMemslot { .. })));
    slots
        .add(&other, 0, SIZE, layout::RAM_GPA, SlotFlags::default())
        .unwrap();
    let pattern: Vec<u8> = (0..SIZE).map(|i| (i * 7 % 251) as u8).collect();
    h.write(0, &pattern).unwrap();

    let expected = guestmem_memory::digest_bytes(guestmem_memory::DIGEST_SEED, &pattern);
    let work = VcpuWork::split(Workload::Verify, layout::RAM_GPA, SIZE, 1, 0);
    let report = vm.run(&work, Duration::from_secs(10)).unwrap();
    assert_eq!(
        report.vcpus[0].digest, expected,
        "the guest reads the new memory"
    );
    assert_eq!(
        region_word(&ram.region, 0),
        0x1111_1111_1111_1111,
        "old memory untouched"
    );
    assert_eq!(
        region_word(&other, 8),
        u64::from_le_bytes(pattern[8..16].try_into().unwrap())
    );
}

/// Device threads write through handles for a few seconds while another thread adds, moves,
/// resizes and removes the slot under them. Each thread writes ever-growing values to its own
/// word. Checked: no crash; accesses fail only with `NoMemslot` (while the range is unmapped);
/// memory that no slot maps at the handle's address never changes (no write lands in a removed
/// or moved-away slot); and each mapping epoch, the current memory received the writes.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn device_threads_survive_slot_changes() {
    const THREADS: usize = 3;
    const RUN: Duration = Duration::from_secs(3);
    let vm = vm(Backend::Anon);
    let slots = memslots(&vm);
    let regions = [
        region(&vm, "a", 2 * PAGE, Backend::Memfd),
        region(&vm, "b", 2 * PAGE, Backend::Anon),
    ];
    let (home, away) = (FREE_GPA, FREE_GPA + (1 << 30));
    let mut id = slots
        .add(&regions[0], 0, 2 * PAGE, home, SlotFlags::default())
        .unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let oks = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let devices: Vec<_> = (0..THREADS)
        .map(|t| {
            let h = slots.map(home, PAGE).unwrap();
            let (stop, oks, errors) = (stop.clone(), oks.clone(), errors.clone());
            std::thread::spawn(move || {
                let mut value = 1u64;
                while !stop.load(Ordering::Relaxed) {
                    match h.write_u64(t as u64 * 8, value) {
                        Ok(()) => {
                            oks.fetch_add(1, Ordering::Relaxed);
                            value += 1;
                        }
                        Err(Error::NoMemslot { .. }) => {
                            errors.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => panic!("device thread {t}: unexpected error {e}"),
                    }
                    if let Err(e) = h.read_u64(t as u64 * 8) {
                        assert!(matches!(e, Error::NoMemslot { .. }), "thread {t}: {e}");
                    }
                }
            })
        })
        .collect();

    let words =
        |r: &Region| -> Vec<u64> { (0..THREADS).map(|t| region_word(r, t as u64 * 8)).collect() };
    // Lets the device threads write for a moment, then checks the words grew.
    let settle = |r: &Region, before: &[u64]| -> bool {
        std::thread::sleep(Duration::from_millis(2));
        words(r).iter().zip(before).any(|(now, then)| now > then)
    };
    let (mut epochs, mut epochs_written, mut current) = (0u64, 0u64, 0usize);
    let mut parked: [Option<Vec<u64>>; 2] = [None, None];
    let start = Instant::now();
    while start.elapsed() < RUN {
        let r = &regions[current];
        let at_map = words(r);
        epochs += 1;
        epochs_written += u64::from(settle(r, &at_map));
        slots.resize(id, PAGE).unwrap(); // the handles' page stays mapped
        epochs_written += u64::from(settle(r, &words(r)));
        epochs += 1;

        slots.move_to(id, away).unwrap();
        let frozen = words(r);
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(words(r), frozen, "a write landed in the moved-away slot");
        slots.move_to(id, home).unwrap();

        slots.remove(id).unwrap();
        let frozen = words(r);
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(words(r), frozen, "a write landed in the removed slot");
        parked[current] = Some(frozen);
        current = 1 - current;
        let next = &regions[current];
        if let Some(parked) = &parked[current] {
            assert_eq!(
                &words(next),
                parked,
                "memory changed while no slot mapped it"
            );
        }
        id = slots
            .add(next, 0, 2 * PAGE, home, SlotFlags::default())
            .unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    for d in devices {
        d.join().expect("device thread");
    }
    let (oks, errors) = (oks.load(Ordering::Relaxed), errors.load(Ordering::Relaxed));
    println!("{epochs} epochs, {epochs_written} saw writes; {oks} writes, {errors} refused");
    assert!(oks > 0 && errors > 0, "{oks} writes, {errors} refused");
    assert!(
        epochs_written > epochs / 2,
        "{epochs_written} of {epochs} epochs saw writes"
    );
    // Finally, a write lands in the memory mapped now.
    let h = slots.map(home, PAGE).unwrap();
    h.write_u64(0, u64::MAX).unwrap();
    assert_eq!(region_word(&regions[current], 0), u64::MAX);
    assert_ne!(region_word(&regions[1 - current], 0), u64::MAX);
}

/// guest_memfd slots are immutable in KVM: the manager moves and resizes them by deleting and
/// re-creating them (with the same guest_memfd offset), and handles follow.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn guest_memfd_slots_move_and_resize() {
    let vm = vm(Backend::Anon);
    let slots = memslots(&vm);
    let r = region(&vm, "gmem", 4 * PAGE, Backend::GuestMemfd);
    let id = slots
        .add(&r, PAGE, 2 * PAGE, FREE_GPA, SlotFlags::default())
        .unwrap();
    assert!(slots.slot(id).unwrap().guest_memfd());
    let old = slots.map(FREE_GPA + PAGE, 8).unwrap();
    old.write_u64(0, 0x5eed).unwrap();
    assert_eq!(
        region_word(&r, 2 * PAGE),
        0x5eed,
        "window starts at region offset PAGE"
    );

    let moved = FREE_GPA + (1 << 30);
    slots.move_to(id, moved).unwrap();
    assert!(matches!(old.read_u64(0), Err(Error::NoMemslot { .. })));
    let new = slots.map(moved + PAGE, 8).unwrap();
    assert_eq!(new.read_u64(0).unwrap(), 0x5eed);

    slots.resize(id, PAGE).unwrap();
    assert_eq!(slots.slot(id).unwrap().size, PAGE);
    assert!(matches!(new.read_u64(0), Err(Error::NoMemslot { .. })));
    let e = slots.resize(id, 4 * PAGE).unwrap_err();
    assert!(matches!(e, Error::SlotWindow { .. }), "{e}");
}
