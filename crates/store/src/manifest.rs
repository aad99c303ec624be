//! `snapshots/NAME/manifest.json`: what a store snapshot holds, protected as a whole.
//!
//! Like a flat snapshot's manifest, it carries a BLAKE3 checksum over its own canonical form
//! (the compact JSON with `checksum` empty): an edited or damaged manifest is refused before
//! any chunk is read, and the checksum is the snapshot's identity (a diff names its base by
//! name and checksum; a working set names the manifest it was recorded for). Each region lists
//! one entry per chunk: `zero` (all zeros, not stored), `base` (a diff's chunk unchanged since
//! its base, which has it), `HASH:STORED@P+OFFSET` (STORED bytes from OFFSET in the pack
//! `packs[P]`), or, in manifests of version 1, `HASH:STORED` (the chunk object
//! `chunks/HH/HASH`, STORED bytes long). [`StoreManifest::parse`] checks every rule the restore
//! paths rely on.

use std::collections::HashMap;

use guestmem_memory::{RegionSpec, PAGE_SIZE};
use guestmem_sys::release::Writer;
use guestmem_vm::VmConfig;
use serde::{Deserialize, Serialize};

use guestmem_snapshot::check_config_layout;

use crate::chunk::{self, Hash, Loc, Stored};
use crate::objects::ObjectStore;
use crate::{Error, Result};

/// The `format` field of every store snapshot manifest.
pub const FORMAT: &str = "guestmem-store-snapshot";
/// The manifest version this code writes: 3 (the manifest names its [`Writer`], guestmem
/// 0.2.0; 2: chunks in packs, guestmem 0.1.0). Compatibility (README): a release reads the
/// versions of the two minor releases before it, from [`MIN_VERSION`]; another is refused
/// naming both versions ([`crate::Error::Version`]). A change to [`StoreManifest`],
/// [`StoreBase`], [`StoreRegion`] or a [`ChunkRef`]'s text bumps it (an added field must be
/// skipped when absent, so that older manifests keep their checksum).
pub const VERSION: u32 = 3;
/// The oldest version it reads: 1 (every chunk an object of its own).
pub const MIN_VERSION: u32 = 1;
/// How many diff snapshots may stand on one another.
pub const MAX_BASE_DEPTH: usize = 64;
/// The largest chunk size a manifest may give.
const MAX_CHUNK_BYTES: u64 = 64 << 20;

/// The most bytes the zstd frame of a `chunk_bytes` chunk takes (above zstd's compress bound).
pub fn max_stored(chunk_bytes: u64) -> u64 {
    chunk_bytes + chunk_bytes / 128 + 4096
}

/// The keys of a snapshot's objects.
pub fn manifest_key(name: &str) -> String {
    format!("snapshots/{name}/manifest.json")
}
/// The key of a snapshot's state object.
pub fn state_key(name: &str) -> String {
    format!("snapshots/{name}/state.json")
}
/// The key of a snapshot's recorded working set.
pub fn working_set_key(name: &str) -> String {
    format!("snapshots/{name}/working-set.json")
}

/// A store snapshot's manifest: what it holds and how to check it. A change bumps [`VERSION`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreManifest {
    /// The format's name ([`FORMAT`]).
    pub format: String,
    /// The format's version.
    pub version: u32,
    /// The snapshot's name in its store (a manifest found under another name is refused).
    pub name: String,
    /// The VM's configuration.
    pub config: VmConfig,
    /// The chunk size in bytes.
    pub chunk_bytes: u64,
    /// The packs its chunks are in (their ids, hex); a chunk names one by its index here.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub packs: Vec<String>,
    /// Every region of guest memory (the sys region included), in memory order.
    pub regions: Vec<StoreRegion>,
    /// The state object's bytes.
    pub state_bytes: u64,
    /// BLAKE3 of the state object, hex.
    pub state_blake3: String,
    /// A diff snapshot: its base in the same store, by name and manifest checksum.
    #[serde(default)]
    pub base: Option<StoreBase>,
    /// The guestmem that wrote the manifest (version 3 on; `None` before). Left out of the
    /// JSON when `None`, so that older manifests keep their canonical form and checksum.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub writer: Option<Writer>,
    /// BLAKE3 over the canonical form with this field empty, hex.
    pub checksum: String,
}

/// A diff snapshot's base. A change bumps [`VERSION`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreBase {
    /// The base's name in the same store.
    pub name: String,
    /// Its manifest's checksum, as the diff was written.
    pub checksum: String,
}

/// One region of guest memory in a store snapshot. A change bumps [`VERSION`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreRegion {
    /// The region.
    pub spec: RegionSpec,
    /// `GuestMemory::digest` of the whole region at snapshot time, in manifests written before
    /// the chunks' own hashes became the restore's whole-memory check (read, not written: a
    /// restore checks every chunk of memory against its hash instead).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<u64>,
    /// Its chunks, in order.
    pub chunks: Vec<ChunkRef>,
}

/// One chunk of a region (its text in the manifest: a change bumps [`VERSION`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChunkRef {
    /// All zero: not stored.
    Zero,
    /// Unchanged since the diff's base: the base's chunk.
    Base,
    /// Stored under its BLAKE3 hash, in `stored` compressed bytes.
    Data {
        /// BLAKE3 of the chunk's bytes.
        hash: Hash,
        /// Its compressed bytes in the store.
        stored: u64,
        /// Where they are in a pack of the manifest's table (`None`: a chunk object of its
        /// own, version 1).
        at: Option<PackAt>,
    },
}

/// Where a chunk is in one of the manifest's packs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PackAt {
    /// The pack's index in [`StoreManifest::packs`].
    pub pack: u32,
    /// Where the chunk's frame starts in it.
    pub offset: u64,
}

/// Builds a manifest's pack table while its chunk entries are made.
#[derive(Default)]
pub(crate) struct PackTable {
    ids: Vec<String>,
    index: HashMap<Hash, u32>,
}

impl PackTable {
    /// The entry of `chunk`, its pack (if any) entered in the table.
    pub(crate) fn entry(&mut self, chunk: &Stored) -> ChunkRef {
        let at = match chunk.loc {
            Loc::Object => None,
            Loc::Pack { id, offset } => {
                let next =
                    u32::try_from(self.ids.len()).expect("fewer than 2^32 packs in a manifest");
                let pack = *self.index.entry(id).or_insert_with(|| next);
                if pack == next {
                    self.ids.push(chunk::hex(&id));
                }
                Some(PackAt { pack, offset })
            }
        };
        ChunkRef::Data {
            hash: chunk.hash,
            stored: chunk.stored,
            at,
        }
    }

    /// The table.
    pub(crate) fn into_ids(self) -> Vec<String> {
        self.ids
    }
}

impl Serialize for ChunkRef {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            ChunkRef::Zero => s.serialize_str("zero"),
            ChunkRef::Base => s.serialize_str("base"),
            ChunkRef::Data {
                hash,
                stored,
                at: None,
            } => s.serialize_str(&format!("{}:{stored}", chunk::hex(hash))),
            ChunkRef::Data {
                hash,
                stored,
                at: Some(PackAt { pack, offset }),
            } => s.serialize_str(&format!("{}:{stored}@{pack}+{offset}", chunk::hex(hash))),
        }
    }
}

impl<'de> Deserialize<'de> for ChunkRef {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        match text.as_str() {
            "zero" => Ok(ChunkRef::Zero),
            "base" => Ok(ChunkRef::Base),
            _ => {
                let parse = || {
                    let (hash, rest) = text.split_once(':')?;
                    let hash = chunk::parse_hex(hash)?;
                    let (stored, at) = match rest.split_once('@') {
                        None => (rest.parse().ok()?, None),
                        Some((stored, at)) => {
                            let (pack, offset) = at.split_once('+')?;
                            let at = PackAt {
                                pack: pack.parse().ok()?,
                                offset: offset.parse().ok()?,
                            };
                            (stored.parse().ok()?, Some(at))
                        }
                    };
                    Some(ChunkRef::Data { hash, stored, at })
                };
                parse().ok_or_else(|| {
                    serde::de::Error::custom(format!(
                        "chunk entry '{text}' is not zero, base, HASH:STORED@PACK+OFFSET or \
                         HASH:STORED"
                    ))
                })
            }
        }
    }
}

impl StoreRegion {
    /// The bytes of chunk `index` (the last may be short).
    pub fn chunk_len(&self, chunk_bytes: u64, index: usize) -> u64 {
        chunk_bytes.min(self.spec.size - index as u64 * chunk_bytes)
    }
}

impl StoreManifest {
    /// BLAKE3 over the canonical form with the checksum field empty, hex.
    pub fn compute_checksum(&self) -> String {
        let mut canonical = self.clone();
        canonical.checksum.clear();
        guestmem_snapshot::canonical_checksum(&canonical)
    }

    /// Sets the checksum.
    pub fn seal(&mut self) {
        self.checksum = self.compute_checksum();
    }

    /// The ids of its packs, in table order (checked by [`StoreManifest::validate`]).
    pub fn pack_ids(&self) -> Vec<Hash> {
        self.packs
            .iter()
            .map(|p| chunk::parse_hex(p).unwrap_or_default())
            .collect()
    }

    /// The chunk `entry` names (`None` for zero and base entries), its pack resolved through
    /// `ids` ([`StoreManifest::pack_ids`]).
    pub fn stored(entry: &ChunkRef, ids: &[Hash]) -> Option<Stored> {
        match *entry {
            ChunkRef::Data { hash, stored, at } => Some(Stored {
                hash,
                stored,
                loc: match at {
                    None => Loc::Object,
                    Some(PackAt { pack, offset }) => Loc::Pack {
                        id: ids[pack as usize],
                        offset,
                    },
                },
            }),
            _ => None,
        }
    }

    /// Every chunk the manifest itself stores (not its base's), in memory order (a chunk held
    /// twice is listed twice).
    pub fn data_chunks(&self) -> impl Iterator<Item = Stored> + '_ {
        let ids = self.pack_ids();
        self.regions
            .iter()
            .flat_map(|r| &r.chunks)
            .filter_map(move |c| StoreManifest::stored(c, &ids))
    }

    /// Parses and checks the manifest `bytes` read from `key` of `store` for snapshot `name`:
    /// format and version first (a foreign file or another version is said to be one), then
    /// the shape, the checksum, the name, and every structural rule.
    pub fn parse(bytes: &[u8], store: &str, key: &str, name: &str) -> Result<StoreManifest> {
        #[derive(Deserialize)]
        struct Head {
            format: Option<serde_json::Value>,
            version: Option<serde_json::Value>,
            writer: Option<serde_json::Value>,
        }
        let json = |source| Error::Json {
            store: store.to_string(),
            key: key.to_string(),
            source,
        };
        let head: Head = serde_json::from_slice(bytes).map_err(json)?;
        if head.format.as_ref().and_then(|f| f.as_str()) != Some(FORMAT) {
            return Err(Error::Foreign {
                store: store.to_string(),
                key: key.to_string(),
                found: head.format.map_or_else(|| "none".into(), |f| f.to_string()),
            });
        }
        let version = head.version.and_then(|v| v.as_u64()).unwrap_or(0);
        if !(u64::from(MIN_VERSION)..=u64::from(VERSION)).contains(&version) {
            return Err(Error::Version {
                store: store.to_string(),
                key: key.to_string(),
                found: version,
                writer: head
                    .writer
                    .and_then(|w| serde_json::from_value::<Writer>(w).ok())
                    .map_or_else(
                        || "an unknown guestmem".into(),
                        |w| Writer::describe(Some(&w)),
                    ),
                min: MIN_VERSION,
                supported: VERSION,
            });
        }
        let manifest: StoreManifest = serde_json::from_slice(bytes).map_err(json)?;
        let bad = |why: String| Error::Corrupt(format!("{store}: {key}: {why}"));
        let computed = manifest.compute_checksum();
        if computed != manifest.checksum {
            return Err(bad(format!(
                "the manifest's contents do not match its checksum (computed {computed}, it \
                 says {}): it was altered or damaged",
                manifest.checksum
            )));
        }
        if manifest.name != name {
            return Err(bad(format!(
                "the manifest of snapshot '{}', found under the name '{name}'",
                manifest.name
            )));
        }
        manifest.validate().map_err(bad)?;
        Ok(manifest)
    }

    /// The structural rules: chunk size, vCPUs, one sys region, one entry per chunk, page
    /// multiples, `base` entries only in a diff.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let cb = self.chunk_bytes;
        if !(PAGE_SIZE..=MAX_CHUNK_BYTES).contains(&cb) || !cb.is_power_of_two() {
            return Err(format!(
                "chunk size {cb} is not a power of two from {PAGE_SIZE} to {MAX_CHUNK_BYTES}"
            ));
        }
        check_config_layout(&self.config, self.regions.iter().map(|r| &r.spec))?;
        if self.version < 2 && !self.packs.is_empty() {
            return Err(format!(
                "a manifest of version {} lists packs (version 2 has them)",
                self.version
            ));
        }
        if self.version < 3 && self.writer.is_some() {
            return Err(format!(
                "a manifest of version {} names a writer (version 3 does)",
                self.version
            ));
        }
        if let Some(p) = self.packs.iter().find(|p| chunk::parse_hex(p).is_none()) {
            return Err(format!("pack '{p}' is not named by 64 hex digits"));
        }
        for r in &self.regions {
            let name = &r.spec.name;
            if r.spec.size == 0 || r.spec.size % PAGE_SIZE != 0 {
                return Err(format!(
                    "region '{name}': size {:#x} is not a page multiple",
                    r.spec.size
                ));
            }
            let expected = r.spec.size.div_ceil(cb);
            if r.chunks.len() as u64 != expected {
                return Err(format!(
                    "region '{name}' lists {} chunks; its {:#x} bytes make {expected}",
                    r.chunks.len(),
                    r.spec.size
                ));
            }
            if self.base.is_none() {
                if let Some(i) = r.chunks.iter().position(|c| *c == ChunkRef::Base) {
                    return Err(format!(
                        "region '{name}' chunk {i} is inherited, but the snapshot has no base"
                    ));
                }
            }
            if let Some(i) = r
                .chunks
                .iter()
                .position(|c| matches!(c, ChunkRef::Data { stored: 0, .. }))
            {
                return Err(format!("region '{name}' chunk {i} is stored in 0 bytes"));
            }
            // A frame is never longer than zstd's bound for a chunk: a larger length (or an
            // offset it would run past the end of a u64 from) would have a read allocate it.
            let most = max_stored(cb);
            if let Some(i) = r.chunks.iter().position(|c| match c {
                ChunkRef::Data { stored, at, .. } => {
                    *stored > most || at.is_some_and(|at| at.offset.checked_add(*stored).is_none())
                }
                _ => false,
            }) {
                return Err(format!(
                    "region '{name}' chunk {i} is stored in more bytes than a {cb}-byte chunk's \
                     frame can take ({most}), or past the largest offset"
                ));
            }
            let packs = self.packs.len();
            if let Some(i) = r.chunks.iter().position(
                |c| matches!(c, ChunkRef::Data { at: Some(at), .. } if at.pack as usize >= packs),
            ) {
                return Err(format!(
                    "region '{name}' chunk {i} names a pack the manifest's {packs} do not include"
                ));
            }
        }
        Ok(())
    }

    /// Reads and checks the manifest of snapshot `name` in `objects`.
    pub fn load(objects: &dyn ObjectStore, name: &str) -> Result<StoreManifest> {
        let key = manifest_key(name);
        let bytes = objects.get(&key).map_err(|e| match e {
            Error::Missing { store, key } => Error::Missing {
                store,
                key: format!(
                    "{key} (no snapshot '{name}' in the store, or its write did not finish)"
                ),
            },
            e => e,
        })?;
        StoreManifest::parse(&bytes, &objects.describe(), &key, name)
    }
}

/// A snapshot's chunks with a diff's `base` entries resolved through its base chain: per region,
/// per chunk, `None` for zeros or the stored chunk.
pub type Resolved = Vec<Vec<Option<Stored>>>;

/// Resolves `manifest`'s base chain in `objects`: each base must be the very snapshot the diff
/// was written over (its checksum) and of the same layout.
pub fn resolve(objects: &dyn ObjectStore, manifest: &StoreManifest) -> Result<Resolved> {
    let mut resolved: Resolved = manifest
        .regions
        .iter()
        .map(|r| r.chunks.iter().map(|_| None).collect())
        .collect();
    let mut pending: Vec<(usize, usize)> = Vec::new();
    let ids = manifest.pack_ids();
    for (ri, r) in manifest.regions.iter().enumerate() {
        for (ci, c) in r.chunks.iter().enumerate() {
            match c {
                ChunkRef::Zero => {}
                ChunkRef::Data { .. } => resolved[ri][ci] = StoreManifest::stored(c, &ids),
                ChunkRef::Base => pending.push((ri, ci)),
            }
        }
    }
    let mut base_ref = manifest.base.clone();
    let mut child_name = manifest.name.clone();
    let mut depth = 0;
    while let (false, Some(b)) = (pending.is_empty(), base_ref) {
        depth += 1;
        if depth > MAX_BASE_DEPTH {
            return Err(Error::Corrupt(format!(
                "{}: snapshot '{}': more than {MAX_BASE_DEPTH} diff snapshots stand on one another",
                objects.describe(),
                manifest.name
            )));
        }
        let base = StoreManifest::load(objects, &b.name)?;
        if base.checksum != b.checksum {
            return Err(Error::Corrupt(format!(
                "{}: snapshot '{}' is not the base '{child_name}' was written over (its manifest \
                 checksum is {}, the diff's base had {}): the base was replaced since",
                objects.describe(),
                b.name,
                base.checksum,
                b.checksum
            )));
        }
        let same = base.config == manifest.config
            && base.chunk_bytes == manifest.chunk_bytes
            && base.regions.len() == manifest.regions.len()
            && base
                .regions
                .iter()
                .zip(&manifest.regions)
                .all(|(a, m)| a.spec == m.spec && a.chunks.len() == m.chunks.len());
        if !same {
            return Err(Error::Corrupt(format!(
                "{}: the base '{}' of '{child_name}' has another memory layout",
                objects.describe(),
                b.name
            )));
        }
        let ids = base.pack_ids();
        pending.retain(|&(ri, ci)| match &base.regions[ri].chunks[ci] {
            ChunkRef::Zero => false,
            c @ ChunkRef::Data { .. } => {
                resolved[ri][ci] = StoreManifest::stored(c, &ids);
                false
            }
            ChunkRef::Base => true,
        });
        child_name = b.name.clone();
        base_ref = base.base;
    }
    if let Some(&(ri, ci)) = pending.first() {
        return Err(Error::Corrupt(format!(
            "{}: snapshot '{}': region '{}' chunk {ci} is inherited, but no base holds it",
            objects.describe(),
            manifest.name,
            manifest.regions[ri].spec.name
        )));
    }
    Ok(resolved)
}

#[cfg(test)]
mod tests {
    use super::*;
    use guestmem_memory::Backend as MemBackend;
    use guestmem_sys::to_usize;
    use guestmem_vm::layout;

    pub(crate) fn manifest(name: &str) -> StoreManifest {
        let config = VmConfig::simple(2, 1 << 20, MemBackend::Anon);
        let cb = 256 << 10;
        let mut m = StoreManifest {
            format: FORMAT.into(),
            version: VERSION,
            name: name.into(),
            regions: vec![
                StoreRegion {
                    spec: RegionSpec::new(
                        "sys",
                        layout::SYS_GPA,
                        layout::SYS_SIZE,
                        MemBackend::Anon,
                    ),
                    digest: None,
                    chunks: vec![ChunkRef::Zero; to_usize(layout::SYS_SIZE.div_ceil(cb))],
                },
                StoreRegion {
                    spec: config.regions[0].clone(),
                    digest: None,
                    chunks: vec![
                        ChunkRef::Data {
                            hash: [7; 32],
                            stored: 100,
                            at: Some(PackAt {
                                pack: 0,
                                offset: 4096,
                            }),
                        },
                        ChunkRef::Zero,
                        ChunkRef::Zero,
                        ChunkRef::Data {
                            hash: [8; 32],
                            stored: 50,
                            at: Some(PackAt { pack: 0, offset: 0 }),
                        },
                    ],
                },
            ],
            config,
            chunk_bytes: cb,
            packs: vec![chunk::hex(&[9; 32])],
            state_bytes: 10,
            state_blake3: "00".into(),
            base: None,
            writer: Some(Writer::this()),
            checksum: String::new(),
        };
        m.seal();
        m
    }

    fn parse(m: &StoreManifest) -> Result<StoreManifest> {
        StoreManifest::parse(
            &serde_json::to_vec_pretty(m).unwrap(),
            "s3://b",
            "k",
            &m.name,
        )
    }

    #[test]
    fn parses_back_equal() {
        let m = manifest("a");
        assert_eq!(parse(&m).unwrap(), m);
    }

    #[test]
    fn refuses_edited_truncated_foreign_and_misnamed() {
        let mut m = manifest("a");
        m.regions[1].chunks[1] = ChunkRef::Data {
            hash: [1; 32],
            stored: 5,
            at: None,
        };
        let e = parse(&m).unwrap_err().to_string();
        assert!(e.contains("checksum") && e.contains("altered"), "{e}");

        let bytes = serde_json::to_vec_pretty(&manifest("a")).unwrap();
        let e = StoreManifest::parse(&bytes[..bytes.len() / 2], "s3://b", "k", "a")
            .unwrap_err()
            .to_string();
        assert!(e.contains("s3://b: k") && e.contains("truncated"), "{e}");

        let e = StoreManifest::parse(
            br#"{"format":"guestmem-snapshot","version":2}"#,
            "s",
            "k",
            "a",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("not a guestmem store snapshot") && e.contains("guestmem-snapshot"),
            "{e}"
        );

        let e = StoreManifest::parse(&bytes, "s", "k", "b")
            .unwrap_err()
            .to_string();
        assert!(e.contains("snapshot 'a'") && e.contains("'b'"), "{e}");

        let mut m = manifest("a");
        m.regions[1].chunks.pop();
        m.seal();
        let e = parse(&m).unwrap_err().to_string();
        assert!(e.contains("lists 3 chunks"), "{e}");

        // A chunk naming a pack past the table, a version-1 manifest with packs, a version
        // this code does not know.
        let mut m = manifest("a");
        m.regions[1].chunks[1] = ChunkRef::Data {
            hash: [1; 32],
            stored: 5,
            at: Some(PackAt { pack: 1, offset: 0 }),
        };
        m.seal();
        let e = parse(&m).unwrap_err().to_string();
        assert!(e.contains("chunk 1 names a pack"), "{e}");
        // A length no chunk's frame has, and one that runs past the largest offset: refused
        // before a read would allocate it.
        for (stored, offset) in [(u64::MAX / 2, 0), (100, u64::MAX - 10)] {
            let mut m = manifest("a");
            m.regions[1].chunks[0] = ChunkRef::Data {
                hash: [1; 32],
                stored,
                at: Some(PackAt { pack: 0, offset }),
            };
            m.seal();
            let e = parse(&m).unwrap_err().to_string();
            assert!(e.contains("chunk 0 is stored in more bytes"), "{e}");
        }
        let mut m = manifest("a");
        m.version = 1;
        m.seal();
        let e = parse(&m).unwrap_err().to_string();
        assert!(e.contains("version 1 lists packs"), "{e}");
        let mut m = manifest("a");
        m.version = VERSION + 1;
        m.seal();
        let e = parse(&m).unwrap_err().to_string();
        assert!(
            e.contains(&format!(
                "store snapshot version {}, written by guestmem ",
                VERSION + 1
            )) && e.contains(&format!("reads versions {MIN_VERSION} to {VERSION}")),
            "{e}"
        );
    }

    /// A version-1 manifest (every chunk an object of its own) still reads, its chunks
    /// resolved to their objects; a version-2 one resolves to its packs.
    #[test]
    fn version_1_chunks_are_objects_and_version_2_chunks_are_in_packs() {
        let mut v1 = manifest("a");
        v1.version = 1;
        v1.writer = None;
        v1.packs.clear();
        for c in &mut v1.regions[1].chunks {
            if let ChunkRef::Data { at, .. } = c {
                *at = None;
            }
        }
        v1.seal();
        let json = String::from_utf8(serde_json::to_vec(&v1).unwrap()).unwrap();
        assert!(!json.contains("packs") && !json.contains('@'), "{json}");
        let v1 = parse(&v1).unwrap();
        let chunks: Vec<Stored> = v1.data_chunks().collect();
        assert_eq!(chunks.len(), 2);
        assert!(chunks.iter().all(|c| c.loc == Loc::Object));
        assert_eq!(chunks[0].object_key(), chunk::key(&[7; 32]));

        let mut v2 = manifest("a");
        v2.version = 2;
        v2.writer = None;
        v2.seal();
        let v2 = parse(&v2).unwrap();
        let chunks: Vec<Stored> = v2.data_chunks().collect();
        assert_eq!(
            chunks[0].loc,
            Loc::Pack {
                id: [9; 32],
                offset: 4096
            }
        );
        assert_eq!(chunks[1].offset(), 0);
        assert_eq!(chunks[1].object_key(), chunk::pack_key(&[9; 32]));
        // The table interns a pack once.
        let mut t = PackTable::default();
        let a = t.entry(&chunks[0]);
        let b = t.entry(&chunks[1]);
        assert_eq!((a, b), (v2.regions[1].chunks[0], v2.regions[1].chunks[3]));
        assert_eq!(t.into_ids(), v2.packs);
    }
}
