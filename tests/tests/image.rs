//! Guest memory that starts from an image, and the `rewrite` workload that re-dirties it as a
//! real guest does.

mod common;

use guestmem_sys::to_usize;
use std::time::Duration;

use common::TempDir;
use guestmem_memory::{load_image, Backend, PAGE_SIZE};
use guestmem_vm::payload::rewrite_of;
use guestmem_vm::{layout, VcpuWork, Vm, VmConfig, Workload};

const SIZE: u64 = 8 << 20;

/// A small image with what real memory has: zero pages, dense pages and a few sparse ones.
#[allow(clippy::cast_possible_truncation)] // test data: the low byte of a pattern.
fn image() -> Vec<u8> {
    let mut x = 0x1234_5678_9abc_def1u64;
    let mut bytes = vec![0u8; to_usize(SIZE)];
    for (p, page) in bytes.chunks_mut(to_usize(PAGE_SIZE)).enumerate() {
        match p % 8 {
            0 | 1 => {} // zero
            2 => page[100] = p as u8 | 1,
            _ => {
                for b in page.iter_mut() {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    // Text-like: compressible, but every line non-zero.
                    *b = b'a' + (x % 16) as u8;
                }
            }
        }
    }
    bytes
}

/// A raw and a zstd-compressed image both land in guest RAM byte for byte; one that does not
/// fit, or is not whole pages, is refused naming the file.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn an_image_becomes_guest_ram_raw_or_compressed() {
    let dir = TempDir::new("image");
    let bytes = image();
    let raw = dir.0.join("ram.raw");
    std::fs::write(&raw, &bytes).unwrap();
    let zst = dir.0.join("ram.raw.zst");
    std::fs::write(&zst, zstd::encode_all(&bytes[..], 3).unwrap()).unwrap();
    for path in [&raw, &zst] {
        for backend in [Backend::Anon, Backend::Memfd] {
            let vm = Vm::new(&VmConfig::simple(1, 2 * SIZE, backend)).unwrap();
            let load = load_image(vm.memory().region("ram").unwrap(), path).unwrap();
            assert_eq!(load.image_bytes, SIZE);
            assert_eq!(load.compressed, path == &zst);
            assert_eq!(
                load.zero_pages_skipped,
                bytes
                    .chunks(4096)
                    .filter(|p| p.iter().all(|&b| b == 0))
                    .count() as u64
            );
            let mut back = vec![0u8; 2 * to_usize(SIZE)];
            vm.memory().read(layout::RAM_GPA, &mut back).unwrap();
            assert!(back[..to_usize(SIZE)] == bytes[..], "{}", path.display());
            assert!(back[to_usize(SIZE)..].iter().all(|&b| b == 0));
        }
    }
    let vm = Vm::new(&VmConfig::simple(1, SIZE / 2, Backend::Anon)).unwrap();
    let e = load_image(vm.memory().region("ram").unwrap(), &zst)
        .unwrap_err()
        .to_string();
    assert!(e.contains("ram.raw.zst") && e.contains("do not fit"), "{e}");
    let odd = dir.0.join("odd.raw");
    std::fs::write(&odd, [1u8; 5000]).unwrap();
    let e = load_image(vm.memory().region("ram").unwrap(), &odd)
        .unwrap_err()
        .to_string();
    assert!(e.contains("odd.raw") && e.contains("whole number"), "{e}");
}

/// One pass of `rewrite` over an image leaves exactly the bytes the host predicts: each page
/// got 2-33 of its lines from another page of the range, and its stamp.
#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn the_rewrite_workload_rewrites_lines_from_other_pages() {
    let mut expected = image();
    let mut vm = Vm::new(&VmConfig::simple(1, SIZE, Backend::Anon)).unwrap();
    vm.memory().write(layout::RAM_GPA, &expected).unwrap();
    let rewrite = Workload::Rewrite {
        pages_per_s: None,
        passes: Some(1),
    };
    let work = VcpuWork::split(rewrite, layout::RAM_GPA, SIZE, 1, 7);
    let report = vm.run(&work, Duration::from_secs(30)).unwrap();
    let pages = SIZE / PAGE_SIZE;
    assert_eq!(report.vcpus[0].pages, pages);

    let original = expected.clone();
    let mut lines_changed = Vec::new();
    for p in 0..pages {
        let gpa = layout::RAM_GPA + p * PAGE_SIZE;
        let w = rewrite_of(7, gpa, 0, layout::RAM_GPA, pages);
        assert!((2..=33).contains(&w.lines));
        w.apply(&mut expected, gpa, layout::RAM_GPA);
        let at = to_usize(p * PAGE_SIZE);
        let new = &expected[at..at + to_usize(PAGE_SIZE)];
        let old = &original[at..at + to_usize(PAGE_SIZE)];
        lines_changed.push(
            new.chunks(64)
                .zip(old.chunks(64))
                .filter(|(a, b)| a != b)
                .count(),
        );
    }
    let mut memory = vec![0u8; to_usize(SIZE)];
    vm.memory().read(layout::RAM_GPA, &mut memory).unwrap();
    let first_diff = memory.iter().zip(&expected).position(|(a, b)| a != b);
    assert_eq!(
        first_diff, None,
        "the guest's bytes differ from the prediction"
    );
    // Real re-dirtying: a few lines per page, never the whole page.
    assert!(
        lines_changed.iter().all(|&n| (1..=33).contains(&n)),
        "{lines_changed:?}"
    );
}
