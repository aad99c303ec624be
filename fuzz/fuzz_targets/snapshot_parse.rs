//! Feeds arbitrary bytes to the snapshot parsers (manifest, state, working set): each must
//! return a value or an error naming the problem, never panic. A manifest that parses is sealed
//! and well-formed, so it must survive a round trip through its own encoding. Run:
//! `cargo +nightly fuzz run snapshot_parse`.
#![no_main]

use std::path::Path;

use guestmem_snapshot::{parse_state, Manifest, WorkingSet};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = Path::new("fuzz.json");
    if let Ok(manifest) = Manifest::parse(data, path) {
        let again = serde_json::to_vec(&manifest).expect("a parsed manifest encodes");
        assert_eq!(Manifest::parse(&again, path).expect("re-parse"), manifest);
    }
    for vcpus in [1, 2] {
        let _ = parse_state(data, vcpus, path);
    }
    let _ = serde_json::from_slice::<WorkingSet>(data);
});
