//! Feeds arbitrary bytes to the migration stream decoder: it must return frames or errors, never
//! panic, hang, or allocate past its bound. Run: `cargo +nightly fuzz run stream_decode
//! fuzz/seeds/stream_decode` (the seeds hold Pages, PagesZ and PagesD frames, and frames of a
//! zstd stream).
#![no_main]

use guestmem_migration::stream::{Frame, FrameRef, ZstdStreamDecoder};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut r = data;
    // Decode frame after frame until the bytes run out or one is refused.
    while let Ok(frame) = Frame::read_from(&mut r) {
        // Whatever decodes must encode back to the very bytes it came from.
        let again = frame.encode().expect("a decoded frame encodes");
        assert_eq!(Frame::read_from(&mut &again[..]).expect("re-decode"), frame);
        // A delta that decodes applies to any pages of its size, and placed, patches them
        // the same way.
        if let Frame::Delta { count, .. } = &frame {
            let mut pages = vec![0x5au8; *count as usize * 4096];
            frame.apply_delta(&mut pages).expect("a decoded delta applies");
            let mut placed = vec![0x5au8; pages.len()];
            let (slot, mut buf) = (&mut placed[..], Vec::new());
            let got = Frame::read_into(&mut &again[..], &mut buf, move |_, _, _| Some(slot));
            assert!(matches!(got, Ok(FrameRef::Patched { .. })));
            assert!(placed == pages);
        }
    }
    // The same bytes on a connection with a zstd stream (its window bounded to 1 MiB): its
    // frames decode through the stream's decoder, in order, into no more than their
    // announced length; whatever decodes is a frame like any other.
    let mut stream = ZstdStreamDecoder::new(20).expect("a zstd stream decoder");
    let (mut r, mut buf) = (data, Vec::new());
    while let Ok(frame) = Frame::read_into_stream(&mut r, &mut buf, Some(&mut stream), |_, _, _| None)
    {
        let frame = match frame {
            FrameRef::Pages { gpa, pages, fresh } => Frame::Pages {
                gpa,
                pages: pages.to_vec(),
                fresh,
            },
            FrameRef::Frame(f) => f,
            other => panic!("nothing was lent, yet {other:?}"),
        };
        let again = frame.encode().expect("a decoded frame encodes");
        assert_eq!(Frame::read_from(&mut &again[..]).expect("re-decode"), frame);
    }
});
