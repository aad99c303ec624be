//! `snapshots/NAME/manifest.json`: what a store snapshot holds, protected as a whole.
//!
//! Like a flat snapshot's manifest, it carries a BLAKE3 checksum over its own canonical form
//! (the compact JSON with `checksum` empty): an edited or damaged manifest is refused before
//! any chunk is read, and the checksum is the snapshot's identity (a diff names its base by
//! name and checksum; a working set names the manifest it was recorded for). Each region lists
//! one entry per chunk: `zero` (all zeros, not stored), `base` (a diff's chunk unchanged since
//! its base, which has it) or `HASH:STORED` (the chunk object `chunks/HH/HASH`, STORED bytes
//! long). [`StoreManifest::parse`] checks every rule the restore paths rely on.

use guestmem_memory::{RegionSpec, PAGE_SIZE};
use guestmem_vm::VmConfig;
use serde::{Deserialize, Serialize};

use guestmem_migration::snapshot::check_config_layout;

use crate::backend::Backend;
use crate::chunk::{self, Hash};
use crate::{Error, Result};

/// The `format` field of every store snapshot manifest.
pub const FORMAT: &str = "guestmem-store-snapshot";
/// The manifest version this code writes and reads.
pub const VERSION: u32 = 1;
/// How many diff snapshots may stand on one another.
pub const MAX_BASE_DEPTH: usize = 64;
/// The largest chunk size a manifest may give.
const MAX_CHUNK_BYTES: u64 = 64 << 20;

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

/// A store snapshot's manifest: what it holds and how to check it.
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
    /// Every region of guest memory (the sys region included), in memory order.
    pub regions: Vec<StoreRegion>,
    /// The state object's bytes.
    pub state_bytes: u64,
    /// BLAKE3 of the state object, hex.
    pub state_blake3: String,
    /// A diff snapshot: its base in the same store, by name and manifest checksum.
    #[serde(default)]
    pub base: Option<StoreBase>,
    /// BLAKE3 over the canonical form with this field empty, hex.
    pub checksum: String,
}

/// A diff snapshot's base.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreBase {
    /// The base's name in the same store.
    pub name: String,
    /// Its manifest's checksum, as the diff was written.
    pub checksum: String,
}

/// One region of guest memory in a store snapshot.
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

/// One chunk of a region.
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
    },
}

impl Serialize for ChunkRef {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            ChunkRef::Zero => s.serialize_str("zero"),
            ChunkRef::Base => s.serialize_str("base"),
            ChunkRef::Data { hash, stored } => {
                s.serialize_str(&format!("{}:{stored}", chunk::hex(hash)))
            }
        }
    }
}

impl<'de> Deserialize<'de> for ChunkRef {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        match text.as_str() {
            "zero" => Ok(ChunkRef::Zero),
            "base" => Ok(ChunkRef::Base),
            _ => text
                .split_once(':')
                .and_then(|(h, n)| Some((chunk::parse_hex(h)?, n.parse().ok()?)))
                .map(|(hash, stored)| ChunkRef::Data { hash, stored })
                .ok_or_else(|| {
                    serde::de::Error::custom(format!(
                        "chunk entry '{text}' is not zero, base or HASH:STORED"
                    ))
                }),
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
        guestmem_migration::snapshot::canonical_checksum(&canonical)
    }

    /// Sets the checksum.
    pub fn seal(&mut self) {
        self.checksum = self.compute_checksum();
    }

    /// Every distinct chunk the manifest itself stores (not its base's).
    pub fn data_chunks(&self) -> impl Iterator<Item = (Hash, u64)> + '_ {
        self.regions
            .iter()
            .flat_map(|r| &r.chunks)
            .filter_map(|c| match c {
                ChunkRef::Data { hash, stored } => Some((*hash, *stored)),
                _ => None,
            })
    }

    /// Parses and checks the manifest `bytes` read from `key` of `store` for snapshot `name`:
    /// format and version first (a foreign file or another version is said to be one), then
    /// the shape, the checksum, the name, and every structural rule.
    pub fn parse(bytes: &[u8], store: &str, key: &str, name: &str) -> Result<StoreManifest> {
        #[derive(Deserialize)]
        struct Head {
            format: Option<serde_json::Value>,
            version: Option<serde_json::Value>,
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
                found: head
                    .format
                    .map(|f| f.to_string())
                    .unwrap_or_else(|| "none".into()),
            });
        }
        let version = head.version.and_then(|v| v.as_u64()).unwrap_or(0);
        if version != u64::from(VERSION) {
            return Err(Error::Version {
                store: store.to_string(),
                key: key.to_string(),
                found: version,
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
        }
        Ok(())
    }

    /// Reads and checks the manifest of snapshot `name` in `backend`.
    pub fn load(backend: &dyn Backend, name: &str) -> Result<StoreManifest> {
        let key = manifest_key(name);
        let bytes = backend.get(&key).map_err(|e| match e {
            Error::Missing { store, key } => Error::Missing {
                store,
                key: format!(
                    "{key} (no snapshot '{name}' in the store, or its write did not finish)"
                ),
            },
            e => e,
        })?;
        StoreManifest::parse(&bytes, &backend.describe(), &key, name)
    }
}

/// A snapshot's chunks with a diff's `base` entries resolved through its base chain: per region,
/// per chunk, `None` for zeros or the chunk's hash and stored length.
pub type Resolved = Vec<Vec<Option<(Hash, u64)>>>;

/// Resolves `manifest`'s base chain in `backend`: each base must be the very snapshot the diff
/// was written over (its checksum) and of the same layout.
pub fn resolve(backend: &dyn Backend, manifest: &StoreManifest) -> Result<Resolved> {
    let mut resolved: Resolved = manifest
        .regions
        .iter()
        .map(|r| r.chunks.iter().map(|_| None).collect())
        .collect();
    let mut pending: Vec<(usize, usize)> = Vec::new();
    for (ri, r) in manifest.regions.iter().enumerate() {
        for (ci, c) in r.chunks.iter().enumerate() {
            match c {
                ChunkRef::Zero => {}
                ChunkRef::Data { hash, stored } => resolved[ri][ci] = Some((*hash, *stored)),
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
                backend.describe(),
                manifest.name
            )));
        }
        let base = StoreManifest::load(backend, &b.name)?;
        if base.checksum != b.checksum {
            return Err(Error::Corrupt(format!(
                "{}: snapshot '{}' is not the base '{child_name}' was written over (its manifest \
                 checksum is {}, the diff's base had {}): the base was replaced since",
                backend.describe(),
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
                backend.describe(),
                b.name
            )));
        }
        pending.retain(|&(ri, ci)| match base.regions[ri].chunks[ci] {
            ChunkRef::Zero => false,
            ChunkRef::Data { hash, stored } => {
                resolved[ri][ci] = Some((hash, stored));
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
            backend.describe(),
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
                    chunks: vec![ChunkRef::Zero; layout::SYS_SIZE.div_ceil(cb) as usize],
                },
                StoreRegion {
                    spec: config.regions[0].clone(),
                    digest: None,
                    chunks: vec![
                        ChunkRef::Data {
                            hash: [7; 32],
                            stored: 100,
                        },
                        ChunkRef::Zero,
                        ChunkRef::Zero,
                        ChunkRef::Zero,
                    ],
                },
            ],
            config,
            chunk_bytes: cb,
            state_bytes: 10,
            state_blake3: "00".into(),
            base: None,
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
    }
}
