//! Live migration of a guest started from real Linux memory (an excerpt of a capture, see
//! scripts/capture-guest-memory.sh) that re-dirties it as a real guest does, with every
//! compression mode, with and without delta encoding of re-dirtied pages: the memory arrives
//! whole (the destination's digest equals the source's at switch-over), compression shrinks
//! what crosses the wire, and re-dirtied pages travel as deltas.

mod common;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use common::TempDir;
use guestmem_memory::{load_image, Backend};
use guestmem_migration::compress::Compress;
use guestmem_migration::migrate::{self, Links, Mode, ReceiveOptions, SendOptions};
use guestmem_migration::transport::{generate_credentials, Credentials, Endpoint, Listener, Role};
use guestmem_vm::{layout, VcpuWork, Vm, VmConfig, Workload};

const SIZE: u64 = 16 << 20;

fn image() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/linux-8M.raw.zst")
}

#[test]
#[cfg_attr(not(kvm), ignore = "no usable /dev/kvm on this host")]
fn real_memory_migrates_whole_with_every_compression_and_delta() {
    // Delta cache: none, all of guest memory (every re-dirtied page has its last version),
    // and a small one (slots shared by many pages); the default is none for a guest this
    // small.
    // zstd streams: off by default (0: each frame on its own), 1 MiB, and 128 MiB (cut to
    // what each connection carries).
    let default_window = SendOptions::default().zstd_window_bytes;
    for (compress, delta_cache, window) in [
        (Compress::None, Some(0), default_window),
        (Compress::Lz4, Some(0), default_window),
        (Compress::Zstd, Some(0), default_window),
        (Compress::Zstd, Some(0), 128 << 20),
        (Compress::Zstd, Some(0), 1 << 20),
        (Compress::Auto, Some(0), 1 << 20),
        (Compress::None, Some(SIZE), default_window),
        (Compress::Lz4, Some(SIZE), default_window),
        (Compress::Zstd, Some(SIZE / 32), default_window),
        (Compress::Lz4, None, default_window),
    ] {
        let dir = TempDir::new(&format!("real-{compress:?}-{delta_cache:?}-{window}"));
        generate_credentials(&dir.0).unwrap();
        let endpoint = Endpoint::Unix(dir.0.join("sock"));
        let listener = Arc::new(
            Listener::bind(
                &endpoint,
                &Credentials::load(&dir.0, Role::Destination).unwrap(),
            )
            .unwrap(),
        );
        let dest = std::thread::spawn(move || {
            let migrate::Incoming {
                mut vm,
                mut transfer,
            } = migrate::receive(listener, &ReceiveOptions::default()).unwrap();
            let running = transfer.resume(&mut vm).unwrap();
            std::thread::sleep(Duration::from_millis(100));
            running.stop();
            running.wait(Duration::from_secs(30)).unwrap();
            transfer.finish().unwrap();
        });

        let mut vm = Vm::new(&VmConfig::simple(2, SIZE, Backend::Anon)).unwrap();
        let load = load_image(vm.memory().region("ram").unwrap(), &image()).unwrap();
        assert_eq!(load.image_bytes, 8 << 20);
        let rewrite = Workload::Rewrite {
            pages_per_s: Some(20_000),
            passes: None,
        };
        let running = vm
            .start(&VcpuWork::split(rewrite, layout::RAM_GPA, SIZE, 2, 3))
            .unwrap();
        std::thread::sleep(Duration::from_millis(200));
        let opts = SendOptions {
            verify: true,
            compress,
            delta_cache_bytes: delta_cache,
            zstd_window_bytes: window,
            ..Default::default()
        };
        let creds = Credentials::load(&dir.0, Role::Source).unwrap();
        let links = Links::connect(&endpoint, &creds, Mode::Precopy, 2).unwrap();
        // `verify`: the destination compared its memory digest with the source's at
        // switch-over, or the migration failed.
        let report = migrate::send(running, links, &opts).unwrap_or_else(|f| {
            panic!("{compress:?}, delta {delta_cache:?}, window {window}: {f:?}")
        });
        dest.join().unwrap();
        assert!(report.verify_ms > 0.0 && report.digest.is_some());
        let c = &report.compression;
        assert_eq!(c.mode, compress);
        let compressed = c.lz4_frames + c.zstd_frames;
        match compress {
            Compress::None => assert_eq!(compressed, 0),
            Compress::Lz4 => assert!(c.lz4_frames > 0 && c.zstd_frames == 0, "{c:?}"),
            Compress::Zstd => assert!(c.zstd_frames > 0 && c.lz4_frames == 0, "{c:?}"),
            // Its probes (the first frame, then every 48th) go with zstd.
            Compress::Auto => assert!(c.zstd_frames > 0, "{c:?}"),
        }
        // The streams, where zstd may be used and a window was asked for; the destination
        // decoded them (else the digests could not have matched).
        let streams = matches!(compress, Compress::Zstd | Compress::Auto) && window > 0;
        let share = (report.guest_bytes / 2).next_power_of_two();
        let expected_window = if streams { window.min(share) } else { 0 };
        assert_eq!(
            report.zstd_window_bytes, expected_window,
            "{compress:?} {window}"
        );
        let dest_held = report.destination.as_ref().unwrap().zstd_stream_bytes;
        if compress == Compress::Zstd && streams {
            assert!(
                report.zstd_stream_bytes >= expected_window,
                "{}",
                report.zstd_stream_bytes
            );
            assert!(dest_held > 0);
        } else if !streams {
            assert_eq!((report.zstd_stream_bytes, dest_held), (0, 0));
        }
        let d = &report.delta;
        match delta_cache {
            Some(0) => assert_eq!(*d, Default::default()),
            Some(SIZE) => {
                // Pages re-dirtied between rounds were all cached: most went as deltas.
                assert_eq!(d.cache_bytes, SIZE, "{d:?}");
                assert!(d.hits > 0 && d.delta_pages * 2 > d.hits, "{d:?}");
                assert!(d.delta_bytes * 2 < d.delta_pages * 4096, "{d:?}");
            }
            Some(bytes) => assert!(d.cache_bytes == bytes && d.hits + d.misses > 0, "{d:?}"),
            None => assert_eq!(d.cache_bytes, 0, "{d:?}"),
        }
        if matches!(compress, Compress::Lz4 | Compress::Zstd) {
            // Real memory compresses (about 2x with LZ4): the wire carries much less.
            assert!(
                report.wire_bytes * 10 < report.bytes * 7,
                "{compress:?}: {} bytes of pages took {} on the wire",
                report.bytes,
                report.wire_bytes
            );
        }
    }
}
