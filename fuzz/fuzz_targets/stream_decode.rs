//! Feeds arbitrary bytes to the migration stream decoder: it must return frames or errors, never
//! panic, hang, or allocate past its bound. Run: `cargo +nightly fuzz run stream_decode`.
#![no_main]

use guestmem_migration::stream::Frame;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut r = data;
    // Decode frame after frame until the bytes run out or one is refused.
    while let Ok(frame) = Frame::read_from(&mut r) {
        // Whatever decodes must encode back to the very bytes it came from.
        let again = frame.encode().expect("a decoded frame encodes");
        assert_eq!(Frame::read_from(&mut &again[..]).expect("re-decode"), frame);
    }
});
