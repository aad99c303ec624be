//! What two guestmems agree on before any page moves: the migration protocol's version and the
//! features the stream may use (README, "Compatibility").
//!
//! Every frame starts with the fixed magic `GMf3`, which never changes again: versions travel
//! in the Hello. The source's Hello offers the protocol versions it speaks
//! ([`MIN_PROTOCOL`]..=[`PROTOCOL`]) and the features it may use ([`FEATURES`]); the
//! destination answers each connection's Hello with the version it chose (the highest both
//! speak) and the features it accepts of those offered, or refuses the connection with an Abort
//! naming both guestmems and both ranges. The source then sends nothing the destination did not
//! accept: a feature it can do without is turned off (`SendOptions::fitted_to`); one the migration
//! cannot do without (post-copy, shared memory, the digest check) refuses the migration before
//! any page moves, naming it. Both sides report what was negotiated ([`Negotiated`] in their
//! reports).
//!
//! guestmem 0.1.0 (protocol 1) negotiated nothing: its Hello offers no range and its answer
//! chooses none, it uses every feature of its time ([`PROTOCOL_1_FEATURES`]), and it compares
//! the switch-over State's format for equality (2). A peer whose Hello or answer says nothing of
//! protocols is that release, and a newer guestmem speaks protocol 1 to it exactly: no frame
//! or field it does not know, the State in format 2 with the machine's state bare.

use serde::{Deserialize, Serialize};

use guestmem_sys::release::LONG_VERSION;

/// The protocol version this build speaks best. 1: guestmem 0.1.0 (no negotiation; State
/// format 2, the machine's state bare). 2: guestmem 0.2.0 (the Hello's range and features,
/// the answer's choice; State format 3, the machine's state in its versioned envelope). A
/// change to the frames, to [`crate::migrate::Setup`]-like messages (Hello, Setup, Switchover,
/// the destination's report) or to their meaning bumps it; so does a change of the machine
/// state's envelope.
pub const PROTOCOL: u32 = 2;
/// The oldest protocol version this build speaks (README, "Compatibility": the previous minor
/// release's).
pub const MIN_PROTOCOL: u32 = 1;

/// Compressed Pages frames (PagesZ, codecs LZ4 and zstd), each on its own.
pub const PAGES_Z: &str = "pages-z";
/// A zstd stream per pre-copy pages connection (PagesZ codec 3).
pub const ZSTD_STREAM: &str = "zstd-stream";
/// Pages as deltas against the receiver's copy (PagesD frames).
pub const PAGES_D: &str = "pages-d";
/// Pages frames without their CRC, under TLS (`NO_CRC`).
pub const NO_CRC: &str = "no-crc";
/// The digest check at switch-over by chunk digests (`Setup.verify_chunk`).
pub const CHUNK_DIGESTS: &str = "chunk-digests";
/// The memory files handed over on a local migration (`Setup.shared`).
pub const SHARED_MEMORY: &str = "shared-memory";
/// Post-copy and hybrid migration (Request frames, the urgent connections).
pub const POSTCOPY: &str = "postcopy";

/// Every feature this build knows, offered by its source and accepted by its destination. A
/// new feature is added here (a source offers it, a destination that does not know it leaves it
/// out of its answer, and the source does without).
pub const FEATURES: &[&str] = &[
    PAGES_Z,
    ZSTD_STREAM,
    PAGES_D,
    NO_CRC,
    CHUNK_DIGESTS,
    SHARED_MEMORY,
    POSTCOPY,
];

/// What guestmem 0.1.0 (protocol 1) uses and takes without saying: every feature of its time.
pub const PROTOCOL_1_FEATURES: &[&str] = &[
    PAGES_Z,
    ZSTD_STREAM,
    PAGES_D,
    NO_CRC,
    CHUNK_DIGESTS,
    SHARED_MEMORY,
    POSTCOPY,
];

/// A range of protocol versions, as the source's Hello offers it. Format: a field of the
/// Hello; a change bumps [`PROTOCOL`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProtocolRange {
    /// The oldest version.
    pub min: u32,
    /// The newest.
    pub max: u32,
}

/// The destination's answer to each connection's Hello (JSON in a Hello frame). guestmem 0.1.0
/// answers with `guestmem_version` alone. Format: a change bumps [`PROTOCOL`] (fields may only
/// be added, with a default).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Answer {
    /// The destination's guestmem (its crate version; 0.1.0 sends it too).
    #[serde(default)]
    pub guestmem_version: String,
    /// The destination's build (`LONG_VERSION`: version and commit); absent from 0.1.0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guestmem: Option<String>,
    /// The protocol version chosen; absent from 0.1.0 (protocol 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol: Option<u32>,
    /// The features accepted, of those offered; absent from 0.1.0 (all of its time).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub features: Option<Vec<String>>,
}

/// What the two sides agreed on: reported by both.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Negotiated {
    /// The protocol version.
    pub protocol: u32,
    /// The features the stream may use.
    pub features: Vec<String>,
    /// The peer's guestmem, as it named itself.
    pub peer: String,
}

impl Default for Negotiated {
    fn default() -> Self {
        Negotiated {
            protocol: PROTOCOL,
            features: FEATURES.iter().map(|f| (*f).to_string()).collect(),
            peer: String::new(),
        }
    }
}

/// The State frame's format for a protocol version (`Setup.format`): 2 for protocol 1 (the
/// machine's state bare, as guestmem 0.1.0 reads it), 3 from protocol 2 (in its envelope).
pub const fn state_format(protocol: u32) -> u32 {
    if protocol <= 1 {
        2
    } else {
        3
    }
}

/// How a peer names itself: its build when it says it, else its crate version.
fn peer_name(version: &str, build: Option<&str>) -> String {
    match build {
        Some(b) => format!("guestmem {b}"),
        None if version.is_empty() => "an unnamed guestmem".into(),
        None => format!("guestmem {version}"),
    }
}

fn range_text(r: ProtocolRange) -> String {
    if r.min == r.max {
        format!("protocol {}", r.min)
    } else {
        format!("protocols {} to {}", r.min, r.max)
    }
}

const OURS: ProtocolRange = ProtocolRange {
    min: MIN_PROTOCOL,
    max: PROTOCOL,
};

/// The destination's choice for a source that offered `offer` (`None`: guestmem 0.1.0, which
/// speaks protocol 1 only) and `features` (`None`: all of protocol 1's), the source naming
/// itself `source`; or the refusal to send it (an Abort's reason, naming both sides' guestmem
/// and protocols).
pub(crate) fn choose(
    source: &str,
    offer: Option<ProtocolRange>,
    features: Option<&[String]>,
) -> std::result::Result<(Answer, Negotiated), String> {
    let offer = offer.unwrap_or(ProtocolRange { min: 1, max: 1 });
    let chosen = offer.max.min(PROTOCOL);
    if chosen < offer.min.max(MIN_PROTOCOL) {
        return Err(format!(
            "the source ({}) speaks migration {}, this destination (guestmem {LONG_VERSION}) \
             speaks {}: no version in common; migrate between releases next to each other \
             (each migrates to and from the one before it, README \"Compatibility\"), upgrading \
             the older side first",
            peer_name(source, None),
            range_text(offer),
            range_text(OURS)
        ));
    }
    let offered: Vec<String> = match features {
        Some(f) => f.to_vec(),
        None => PROTOCOL_1_FEATURES
            .iter()
            .map(|f| (*f).to_string())
            .collect(),
    };
    let accepted: Vec<String> = offered
        .into_iter()
        .filter(|f| FEATURES.contains(&f.as_str()))
        .collect();
    let answer = Answer {
        guestmem_version: env!("CARGO_PKG_VERSION").into(),
        guestmem: Some(LONG_VERSION.into()),
        protocol: Some(chosen),
        features: Some(accepted.clone()),
    };
    let negotiated = Negotiated {
        protocol: chosen,
        features: accepted,
        peer: peer_name(source, None),
    };
    Ok((answer, negotiated))
}

/// What the source takes from the destination's answer `json` (to the Hello that offered
/// [`FEATURES`] and this build's range): the destination's choice, or protocol 1 with its
/// features for a guestmem 0.1.0 that chose nothing. A choice outside this build's range, or a
/// feature not offered, is refused naming both sides.
pub(crate) fn accept(json: &[u8]) -> std::result::Result<Negotiated, String> {
    let answer: Answer = serde_json::from_slice(json).unwrap_or(Answer {
        guestmem_version: String::new(),
        guestmem: None,
        protocol: None,
        features: None,
    });
    let peer = peer_name(&answer.guestmem_version, answer.guestmem.as_deref());
    let protocol = answer.protocol.unwrap_or(1);
    if !(MIN_PROTOCOL..=PROTOCOL).contains(&protocol) {
        return Err(format!(
            "the destination ({peer}) chose migration protocol {protocol}; this source \
             (guestmem {LONG_VERSION}) speaks {}: migrate between releases next to each other \
             (README \"Compatibility\"), upgrading the older side first",
            range_text(OURS)
        ));
    }
    let features: Vec<String> = match answer.features {
        Some(f) => f,
        None => PROTOCOL_1_FEATURES
            .iter()
            .map(|f| (*f).to_string())
            .collect(),
    };
    if let Some(f) = features.iter().find(|f| !FEATURES.contains(&f.as_str())) {
        return Err(format!(
            "the destination ({peer}) accepted feature '{f}', which this source never offered"
        ));
    }
    Ok(Negotiated {
        protocol,
        features,
        peer,
    })
}

impl Negotiated {
    /// Whether the stream may use `feature`.
    pub fn has(&self, feature: &str) -> bool {
        self.features.iter().any(|f| f == feature)
    }

    /// The State frame's format ([`state_format`]).
    pub fn state_format(&self) -> u32 {
        state_format(self.protocol)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(f: &[&str]) -> Vec<String> {
        f.iter().map(|s| (*s).to_string()).collect()
    }

    /// Two builds of this release choose its protocol and every feature; the answer reads back
    /// the same on the source.
    #[test]
    fn peers_of_this_release_choose_its_protocol() {
        let offer = ProtocolRange {
            min: MIN_PROTOCOL,
            max: PROTOCOL,
        };
        let (answer, negotiated) = choose("0.2.0", Some(offer), Some(&strings(FEATURES))).unwrap();
        assert_eq!(negotiated.protocol, PROTOCOL);
        assert_eq!(negotiated.features, strings(FEATURES));
        let back = accept(&serde_json::to_vec(&answer).unwrap()).unwrap();
        assert_eq!(
            (back.protocol, &back.features),
            (PROTOCOL, &strings(FEATURES))
        );
        assert!(back.peer.contains(LONG_VERSION), "{}", back.peer);
        assert_eq!(back.state_format(), 3);
    }

    /// guestmem 0.1.0 as the source (a Hello with no range, no features) gets protocol 1 and
    /// its features; as the destination (an answer of its version alone) it is taken for
    /// protocol 1, State format 2.
    #[test]
    fn a_0_1_0_peer_is_spoken_to_in_protocol_1() {
        let (answer, negotiated) = choose("0.1.0", None, None).unwrap();
        assert_eq!(answer.protocol, Some(1));
        assert_eq!(negotiated.features, strings(PROTOCOL_1_FEATURES));
        assert_eq!(negotiated.state_format(), 2);
        let old = accept(br#"{"guestmem_version":"0.1.0"}"#).unwrap();
        assert_eq!(
            (old.protocol, old.features, old.peer.as_str()),
            (1, strings(PROTOCOL_1_FEATURES), "guestmem 0.1.0")
        );
    }

    /// A peer outside the window is refused, both versions named, with what to do.
    #[test]
    fn a_peer_outside_the_window_is_refused_naming_both() {
        let future = ProtocolRange { min: 7, max: 9 };
        let e = choose("0.9.0", Some(future), None).unwrap_err();
        assert!(
            e.contains("guestmem 0.9.0")
                && e.contains("protocols 7 to 9")
                && e.contains(LONG_VERSION)
                && e.contains(&range_text(OURS))
                && e.contains("upgrading the older side first"),
            "{e}"
        );
        let e =
            accept(br#"{"guestmem_version":"0.9.0","guestmem":"0.9.0 (commit f)","protocol":9}"#)
                .unwrap_err();
        assert!(
            e.contains("guestmem 0.9.0 (commit f)")
                && e.contains("protocol 9")
                && e.contains(LONG_VERSION),
            "{e}"
        );
        let e = accept(br#"{"protocol":2,"features":["teleport"]}"#).unwrap_err();
        assert!(e.contains("'teleport'"), "{e}");
    }

    /// A newer source offering a feature this build does not know: it is left out of the
    /// answer.
    #[test]
    fn features_this_build_does_not_know_are_left_out() {
        let mut offered = strings(FEATURES);
        offered.push("teleport".into());
        let (answer, _) = choose(
            "0.3.0",
            Some(ProtocolRange { min: 1, max: 3 }),
            Some(&offered),
        )
        .unwrap();
        assert_eq!(answer.features, Some(strings(FEATURES)));
        assert_eq!(answer.protocol, Some(PROTOCOL));
    }

    /// The exchange guestmem 0.1.0 recorded (tests/golden/v0.1.0/migration): its Hellos and
    /// Setups read here and get protocol 1, its answer is taken for protocol 1, and what this
    /// build sends it keeps every field 0.1.0 reads, with the same JSON types.
    #[test]
    fn the_recorded_0_1_0_exchange_decodes() {
        use crate::protocol::{Hello, Setup};
        let hello = include_str!("../../../tests/golden/v0.1.0/migration/hello.json");
        let postcopy = include_str!("../../../tests/golden/v0.1.0/migration/hello-postcopy.json");
        for json in [hello, postcopy] {
            let h: Hello = serde_json::from_str(json).unwrap();
            assert_eq!((h.protocols, h.features.as_ref()), (None, None));
            let (answer, n) = choose(&h.guestmem_version, h.protocols, None).unwrap();
            assert_eq!((answer.protocol, n.protocol), (Some(1), 1));
            assert_eq!(n.peer, "guestmem 0.1.0");
            // What this build sends back keeps 0.1.0's one field.
            let ours: serde_json::Value = serde_json::to_value(&answer).unwrap();
            assert_eq!(ours["guestmem_version"], env!("CARGO_PKG_VERSION"));
            // And this build's own Hello carries every field of 0.1.0's, of the same type.
            let mut mine = h.clone();
            mine.protocols = Some(OURS);
            mine.features = Some(strings(FEATURES));
            assert_same_fields(json, &serde_json::to_string(&mine).unwrap());
        }
        for json in [
            include_str!("../../../tests/golden/v0.1.0/migration/setup.json"),
            include_str!("../../../tests/golden/v0.1.0/migration/setup-postcopy.json"),
        ] {
            let setup: Setup = serde_json::from_str(json).unwrap();
            assert_eq!(setup.format, state_format(1));
            assert_same_fields(json, &serde_json::to_string(&setup).unwrap());
        }
        let answer = include_bytes!("../../../tests/golden/v0.1.0/migration/answer.json");
        let n = accept(answer).unwrap();
        assert_eq!((n.protocol, n.state_format()), (1, 2));
        assert_eq!(n.features, strings(PROTOCOL_1_FEATURES));
    }

    /// The exchange guestmem 0.2.0 recorded (tests/golden/v0.2.0/migration) decodes: its
    /// Hellos offer protocols 1 to 2 and get this build's choice, its Setups are of the State
    /// format of protocol 2, its answer chose protocol 2; what this build sends keeps every
    /// field of those.
    #[test]
    fn the_recorded_0_2_0_exchange_decodes() {
        use crate::protocol::{Hello, Setup};
        for json in [
            include_str!("../../../tests/golden/v0.2.0/migration/hello.json"),
            include_str!("../../../tests/golden/v0.2.0/migration/hello-postcopy.json"),
        ] {
            let h: Hello = serde_json::from_str(json).unwrap();
            assert_eq!(h.protocols, Some(ProtocolRange { min: 1, max: 2 }));
            let (answer, n) = choose(
                h.guestmem.as_deref().unwrap(),
                h.protocols,
                h.features.as_deref(),
            )
            .unwrap();
            assert_eq!(answer.protocol, Some(2.min(PROTOCOL)));
            assert!(n.peer.starts_with("guestmem 0.2.0 (commit "), "{}", n.peer);
            assert_same_fields(json, &serde_json::to_string(&h).unwrap());
        }
        for json in [
            include_str!("../../../tests/golden/v0.2.0/migration/setup.json"),
            include_str!("../../../tests/golden/v0.2.0/migration/setup-postcopy.json"),
        ] {
            let setup: Setup = serde_json::from_str(json).unwrap();
            assert_eq!(setup.format, state_format(2));
            assert_same_fields(json, &serde_json::to_string(&setup).unwrap());
        }
        let answer = include_bytes!("../../../tests/golden/v0.2.0/migration/answer.json");
        let n = accept(answer).unwrap();
        assert_eq!((n.protocol, n.state_format()), (2, 3));
        assert_eq!(n.features, strings(FEATURES));
    }

    /// Every field of the JSON object `old` is in `new`, with a value of the same JSON type.
    fn assert_same_fields(old: &str, new: &str) {
        let old: serde_json::Value = serde_json::from_str(old).unwrap();
        let new: serde_json::Value = serde_json::from_str(new).unwrap();
        let kind = |v: &serde_json::Value| match v {
            serde_json::Value::Null => "null",
            serde_json::Value::Bool(_) => "bool",
            serde_json::Value::Number(_) => "number",
            serde_json::Value::String(_) => "string",
            serde_json::Value::Array(_) => "array",
            serde_json::Value::Object(_) => "object",
        };
        for (k, v) in old.as_object().unwrap() {
            let n = new
                .get(k)
                .unwrap_or_else(|| panic!("field '{k}' is gone: {new}"));
            assert_eq!(kind(v), kind(n), "field '{k}' changed type: {new}");
        }
    }
}
