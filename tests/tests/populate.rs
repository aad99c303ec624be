//! Population (guest_memfd write() and the other methods): exact bytes on every backend and by
//! every method, zero pages left unallocated, and a clear error for each bad input with nothing
//! written.

mod common;

use guestmem_sys::to_usize;
use std::io::Write;
use std::os::fd::AsFd;
use std::time::Duration;

use common::{image_with_zero_runs, resident, HugePages};
use guestmem_memory::{
    digest_bytes, populate, populate_with, Backend, Error, GuestMemory, Method, PopulateFrom,
    RegionSpec, DIGEST_SEED,
};
use guestmem_vm::{layout, VcpuWork, Vm, VmConfig, Workload};
use kvm_ioctls::{Kvm, VmFd};

const SIZE: u64 = 8 << 20;
const GPA: u64 = 1 << 32;

fn vm_fd() -> VmFd {
    Kvm::new().unwrap().create_vm().unwrap()
}

fn memory(backend: Backend, vm: &VmFd) -> GuestMemory {
    GuestMemory::new(&[RegionSpec::new("img", GPA, SIZE, backend)], Some(vm)).unwrap()
}

fn read_back(mem: &GuestMemory, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    mem.read(GPA + offset, &mut buf).unwrap();
    buf
}

/// What each backend needs from the host, held for the test's lifetime.
fn host_for(backend: Backend) -> Option<HugePages> {
    HugePages::for_backend(backend, SIZE)
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn every_method_lands_the_exact_bytes_on_every_backend() {
    let vm = vm_fd();
    for backend in Backend::ALL {
        let _host = host_for(backend);
        let page = to_usize(backend.page_size());
        // Half the region, starting one page in, so both edges stay untouched.
        let (offset, len) = (page as u64, to_usize(SIZE) / 2);
        let image = image_with_zero_runs(len, page);
        for &method in Method::candidates(backend) {
            let mem = memory(backend, &vm);
            let region = &mem.regions()[0];
            let done = populate_with(
                region,
                offset,
                len as u64,
                PopulateFrom::Bytes(&image),
                Some(method),
            )
            .unwrap_or_else(|e| panic!("{backend} via {method}: {e}"));
            assert_eq!(
                read_back(&mem, offset, len),
                image,
                "{backend} via {method}"
            );
            assert!(
                read_back(&mem, 0, page).iter().all(|&b| b == 0)
                    && read_back(&mem, offset + len as u64, page)
                        .iter()
                        .all(|&b| b == 0),
                "{backend} via {method}: bytes outside the range changed"
            );
            let zero_pages = image
                .chunks(page)
                .filter(|p| p.iter().all(|&b| b == 0))
                .count();
            assert_eq!(
                done.zero_pages_skipped, zero_pages as u64,
                "{backend} via {method}"
            );
            assert_eq!(
                done.pages_copied + done.zero_pages_skipped,
                (len / page) as u64,
                "{backend} via {method}"
            );
            // Every populated page is marked for the dirty tracker, and nothing else.
            let marks = region.vmm_dirty();
            let first = offset / 4096;
            let last = first + len as u64 / 4096;
            assert!(
                (first..last).all(|p| marks.is_marked(p)),
                "{backend} via {method}"
            );
            assert!(!marks.is_marked(first - 1) && !marks.is_marked(last));
        }
    }
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn gmem_reports_the_method_it_used() {
    let vm = vm_fd();
    let mem = memory(Backend::GuestMemfd, &vm);
    let image = image_with_zero_runs(to_usize(SIZE), 4096);
    let done = populate(&mem.regions()[0], 0, SIZE, PopulateFrom::Bytes(&image)).unwrap();
    let flags = vm.check_extension_raw(guestmem_sys::uapi::KVM_CAP_GUEST_MEMFD_FLAGS.into());
    let write = guestmem_sys::probe::guest_memfd_write(&vm, flags as u64).unwrap();
    if write.present {
        assert_eq!(done.method, Method::GmemWrite);
    } else {
        // This kernel has no guest_memfd write(): the fallback says so.
        assert_eq!(done.method, Method::PopulateCopy);
        let why = done.fallback_reason.expect("a reason for the fallback");
        assert!(why.contains("write() unavailable"), "{why}");
    }
    assert_eq!(read_back(&mem, 0, to_usize(SIZE)), image);
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn the_guest_reads_the_populated_bytes() {
    for backend in [Backend::GuestMemfd, Backend::Anon, Backend::Memfd] {
        let mut vm = Vm::new(&VmConfig::simple(1, SIZE, backend)).unwrap();
        let image = image_with_zero_runs(to_usize(SIZE), 4096);
        let region = vm.memory().region("ram").unwrap();
        populate(region, 0, SIZE, PopulateFrom::Bytes(&image)).unwrap();
        let work = VcpuWork::split(Workload::Verify, layout::RAM_GPA, SIZE, 1, 1);
        let report = vm.run(&work, Duration::from_secs(20)).unwrap();
        assert_eq!(
            report.vcpus[0].digest,
            digest_bytes(DIGEST_SEED, &image),
            "{backend}: the guest's digest of the region is not the image's"
        );
    }
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn zero_pages_stay_unallocated_and_read_zero() {
    let vm = vm_fd();
    for backend in [Backend::Anon, Backend::Memfd, Backend::GuestMemfd] {
        let mem = memory(backend, &vm);
        let region = &mem.regions()[0];
        let image = image_with_zero_runs(to_usize(SIZE), 4096);
        populate(region, 0, SIZE, PopulateFrom::Bytes(&image)).unwrap();
        let res = resident(region.host_addr(), to_usize(SIZE));
        for (i, page) in image.chunks(4096).enumerate() {
            let zero = page.iter().all(|&b| b == 0);
            assert_eq!(
                res[i], !zero,
                "{backend}: page {i} (zero: {zero}) resident: {}",
                res[i]
            );
        }
        assert_eq!(read_back(&mem, 0, to_usize(SIZE)), image, "{backend}");

        // A reused range: zero pages of a second image still read zero.
        let other = image_with_zero_runs(to_usize(SIZE), 4096)
            .iter()
            .map(|b| !b)
            .collect::<Vec<u8>>();
        populate(region, 0, SIZE, PopulateFrom::Bytes(&other)).unwrap();
        assert_eq!(
            read_back(&mem, 0, to_usize(SIZE)),
            other,
            "{backend} reused"
        );
    }
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn populates_from_a_file_at_an_offset_and_from_a_pipe() {
    let vm = vm_fd();
    let image = image_with_zero_runs(to_usize(SIZE), 4096);
    let mut file = tempfile();
    file.write_all(&[7u8; 4096]).unwrap();
    file.write_all(&image).unwrap();
    let mem = memory(Backend::GuestMemfd, &vm);
    let src = PopulateFrom::Fd {
        fd: file.as_fd(),
        offset: 4096,
    };
    populate(&mem.regions()[0], 0, SIZE, src).unwrap();
    assert_eq!(read_back(&mem, 0, to_usize(SIZE)), image);

    let (rx, mut tx) = std::io::pipe().unwrap();
    let part = image[..1 << 20].to_vec();
    let writer = std::thread::spawn(move || tx.write_all(&part).unwrap());
    let mem = memory(Backend::Memfd, &vm);
    populate(
        &mem.regions()[0],
        4096,
        1 << 20,
        PopulateFrom::Fd {
            fd: rx.as_fd(),
            offset: 0,
        },
    )
    .unwrap();
    writer.join().unwrap();
    assert_eq!(read_back(&mem, 4096, 1 << 20), image[..1 << 20]);
}

fn tempfile() -> std::fs::File {
    let path = std::env::temp_dir().join(format!("guestmem-populate-{}", std::process::id()));
    let file = std::fs::File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    std::fs::remove_file(&path).unwrap();
    file
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn each_bad_input_is_refused_with_nothing_written() {
    let vm = vm_fd();
    let image = vec![0xabu8; 2 * to_usize(SIZE)];
    let mut short_file = tempfile();
    short_file.write_all(&image[..8192]).unwrap();
    let (rx, tx) = std::io::pipe().unwrap();
    std::thread::spawn(move || {
        let mut tx = tx;
        tx.write_all(&[1u8; 4096]).unwrap(); // then EOF
    });
    // (what, backend, offset, len, source, method, expected message)
    type Case<'a> = (
        &'a str,
        Backend,
        u64,
        u64,
        PopulateFrom<'a>,
        Option<Method>,
        &'a str,
    );
    let cases: Vec<Case> = vec![
        (
            "unaligned offset",
            Backend::GuestMemfd,
            100,
            4096,
            PopulateFrom::Bytes(&image),
            None,
            "offset 0x64",
        ),
        (
            "unaligned length",
            Backend::Memfd,
            0,
            4097,
            PopulateFrom::Bytes(&image),
            None,
            "length 0x1001",
        ),
        (
            "zero length",
            Backend::Anon,
            0,
            0,
            PopulateFrom::Bytes(&image),
            None,
            "length is zero",
        ),
        (
            "past the end",
            Backend::GuestMemfd,
            4096,
            SIZE,
            PopulateFrom::Bytes(&image),
            None,
            "runs past the region's end",
        ),
        (
            "short slice",
            Backend::Anon,
            0,
            8192,
            PopulateFrom::Bytes(&image[..4096]),
            None,
            "source is short: it has 0x1000",
        ),
        (
            "short file",
            Backend::GuestMemfd,
            0,
            SIZE,
            PopulateFrom::file(&short_file),
            None,
            "source is short: it has 0x2000",
        ),
        (
            "short pipe",
            Backend::Memfd,
            0,
            8192,
            PopulateFrom::Fd {
                fd: rx.as_fd(),
                offset: 0,
            },
            None,
            "source is short: it has 0x1000",
        ),
        (
            "pipe at an offset",
            Backend::Memfd,
            0,
            4096,
            PopulateFrom::Fd {
                fd: rx.as_fd(),
                offset: 4096,
            },
            None,
            "cannot start at offset 0x1000",
        ),
        (
            "pwrite on anon",
            Backend::Anon,
            0,
            4096,
            PopulateFrom::Bytes(&image),
            Some(Method::Pwrite),
            "method 'pwrite' cannot write into the anon backend",
        ),
    ];
    for (what, backend, offset, len, source, method, expect) in cases {
        let mem = memory(backend, &vm);
        let region = &mem.regions()[0];
        let err = populate_with(region, offset, len, source, method).unwrap_err();
        assert!(matches!(err, Error::Populate { .. }), "{what}: {err:?}");
        let msg = err.to_string();
        assert!(
            msg.contains("region 'img'") && msg.contains(expect),
            "{what}: {msg}"
        );
        assert!(
            resident(region.host_addr(), to_usize(SIZE))
                .iter()
                .all(|&r| !r),
            "{what}: pages were written"
        );
        assert!(
            (0..SIZE / 4096).all(|p| !region.vmm_dirty().is_marked(p)),
            "{what}: marked"
        );
    }
}
