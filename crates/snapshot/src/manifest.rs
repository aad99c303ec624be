//! `manifest.json`: what a snapshot holds and where, protected as a whole.
//!
//! The manifest carries a BLAKE3 checksum over its own canonical form (the compact JSON of the
//! manifest with `checksum` empty), so an edited manifest (a data chunk marked zero, a chunk
//! checksum replaced, a region moved in the file) is refused before anything is read from the
//! memory file. That checksum is also the snapshot's identity: a diff names its base by path
//! *and* by the base manifest's checksum, and a recorded working set names the manifest it was
//! recorded for. Every structural rule that the restore paths rely on (one chunk entry per
//! chunk of a region, regions inside their file and not overlapping, flags that make sense) is
//! checked by [`Manifest::parse`], so a malformed manifest is an error, never a panic later.

use std::path::{Path, PathBuf};

use guestmem_memory::{RegionSpec, PAGE_SIZE};
use guestmem_sys::release::Writer;
use guestmem_vm::{layout, VmConfig};
use serde::{Deserialize, Serialize};

use super::sparse::zeros_hasher;
use crate::{Error, Result};

/// The `format` field of every guestmem snapshot manifest.
pub const FORMAT: &str = "guestmem-snapshot";
/// The manifest version this code writes (2: checksummed manifest, diff bound to its base's
/// checksum, the sys region in its own file; 3: `state.json` holds the machine's state as the
/// opaque blob its [`guestmem_contract::component::Machine`] saved, beside the components',
/// where version 2 held guestmem's own VM state, its payload's workloads included, field by
/// field; 4: the manifest names its [`Writer`], guestmem 0.2.0). Compatibility (README): a
/// release reads the versions of the two minor releases before it, from [`MIN_VERSION`]; a
/// snapshot of a version outside is refused naming both versions ([`crate::Error::Version`]).
/// A change to [`Manifest`], [`BaseRef`], [`RegionImage`] or [`Chunk`] bumps it (an added
/// field must be skipped when absent, so that older manifests keep their checksum).
pub const VERSION: u32 = 4;
/// The oldest manifest version this code reads: 3 (guestmem 0.1.0's, which names no writer).
pub const MIN_VERSION: u32 = 3;
/// The unit of checksums and of zero detection in the manifest.
pub const CHUNK_BYTES: u64 = 2 << 20;
/// How many diff snapshots may stand on one another (a longer chain is refused as malformed).
pub const MAX_BASE_DEPTH: usize = 64;

/// What `manifest.json` holds. A change bumps [`VERSION`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// [`FORMAT`].
    pub format: String,
    /// [`VERSION`].
    pub version: u32,
    /// The VM the snapshot is of.
    pub config: VmConfig,
    /// Every region of guest memory (the sys region included), in memory order.
    pub regions: Vec<RegionImage>,
    /// Bytes per chunk ([`CHUNK_BYTES`]).
    pub chunk_bytes: u64,
    /// Length of `state.json`.
    pub state_bytes: u64,
    /// BLAKE3 of `state.json`, hex.
    pub state_blake3: String,
    /// Length of the `memory` file: the guest RAM regions back to back, nothing else (so that
    /// Firecracker's page-server handlers, which expect exactly that, can serve it).
    pub memory_file_bytes: u64,
    /// Length of the `sys` file: the sys region (page tables, payload, control blocks).
    pub sys_file_bytes: u64,
    /// A diff snapshot: the snapshot this one builds on (chunks marked `inherited` come from
    /// there).
    #[serde(default)]
    pub base: Option<BaseRef>,
    /// The guestmem that wrote the snapshot (version 4 on; `None` in version 3, written by
    /// guestmem 0.1.0). Left out of the JSON when `None`, so that a version-3 manifest's
    /// canonical form, and its checksum, stay what 0.1.0 computed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub writer: Option<Writer>,
    /// BLAKE3 over the manifest's canonical form with this field empty, hex (see the module
    /// docs). The snapshot's identity.
    pub checksum: String,
}

/// How a diff names its base: where it is and which snapshot it must be. A change bumps
/// [`VERSION`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BaseRef {
    /// The base's directory.
    pub dir: PathBuf,
    /// The base manifest's `checksum` when the diff was written.
    pub checksum: String,
}

/// Which file of the snapshot holds a region's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RegionFile {
    /// `memory`: the guest RAM regions.
    Memory,
    /// `sys`: the sys region.
    Sys,
}

impl RegionFile {
    /// The file's name in the snapshot directory.
    pub fn name(self) -> &'static str {
        match self {
            RegionFile::Memory => "memory",
            RegionFile::Sys => "sys",
        }
    }

    /// The file that holds a region at `gpa`: the sys region has its own.
    pub fn for_region(spec: &RegionSpec) -> RegionFile {
        if spec.gpa == layout::SYS_GPA {
            RegionFile::Sys
        } else {
            RegionFile::Memory
        }
    }
}

/// One region in its file. A change bumps [`VERSION`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegionImage {
    /// The region.
    pub spec: RegionSpec,
    /// The file holding it.
    pub file: RegionFile,
    /// Where in that file it starts.
    pub file_offset: u64,
    /// `guestmem_memory::GuestMemory::digest` of the whole region at snapshot time.
    pub digest: u64,
    /// One entry per [`CHUNK_BYTES`] of the region (the last may be shorter).
    pub chunks: Vec<Chunk>,
}

impl RegionImage {
    /// The length of chunk `index` (the last chunk of a region may be shorter).
    pub fn chunk_len(&self, index: usize) -> u64 {
        CHUNK_BYTES.min(self.spec.size - index as u64 * CHUNK_BYTES)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
/// One chunk of a region, as the manifest lists it. A change bumps [`VERSION`].
pub struct Chunk {
    /// CRC-32 of the chunk's bytes (zero pages included; for a zero chunk, that of zeros).
    pub crc32: u32,
    /// The chunk is all zeros: its range of the file must be zeros too (holes).
    pub zero: bool,
    /// Diff snapshots: no page of the chunk was written since the base, which holds it.
    #[serde(default)]
    pub inherited: bool,
}

/// The layout rules every snapshot format relies on: vCPUs within what the layout holds, and
/// the configuration's RAM regions plus exactly one sys region (`regions`: the images' specs);
/// a Linux guest's memory ([`guestmem_vm::linux::is_linux_config`]) has no sys region.
pub fn check_config_layout<'a>(
    config: &VmConfig,
    regions: impl ExactSizeIterator<Item = &'a RegionSpec> + Clone,
) -> std::result::Result<(), String> {
    if config.vcpus == 0 || config.vcpus > layout::MAX_VCPUS {
        return Err(format!(
            "{} vCPUs (this layout holds 1 to {})",
            config.vcpus,
            layout::MAX_VCPUS
        ));
    }
    if guestmem_vm::linux::is_linux_config(config) {
        let sys = regions.clone().filter(|r| r.gpa == layout::SYS_GPA).count();
        if regions.len() != config.regions.len() || sys != 0 {
            return Err(format!(
                "{} regions for a Linux guest's configuration of {} RAM regions (and no sys \
                 region)",
                regions.len(),
                config.regions.len()
            ));
        }
        return Ok(());
    }
    if regions.len() != config.regions.len() + 1 {
        return Err(format!(
            "{} regions for a configuration of {} RAM regions plus the sys region",
            regions.len(),
            config.regions.len()
        ));
    }
    let sys = regions.filter(|r| r.gpa == layout::SYS_GPA).count();
    if sys != 1 {
        return Err(format!("{sys} sys regions, not 1"));
    }
    Ok(())
}

/// BLAKE3 (hex) of `canonical`'s compact JSON: the checksum of a manifest-like record, computed
/// over a copy whose own checksum field was emptied (the flat snapshot's manifest, the store's
/// manifest and its working set all seal themselves this way).
pub fn canonical_checksum(canonical: &impl serde::Serialize) -> String {
    let bytes = serde_json::to_vec(canonical).expect("a manifest serializes");
    blake3::hash(&bytes).to_hex().to_string()
}

impl Manifest {
    /// The checksum of `self`'s canonical form (see the module docs).
    pub fn compute_checksum(&self) -> String {
        let mut canonical = self.clone();
        canonical.checksum.clear();
        canonical_checksum(&canonical)
    }

    /// Sets `checksum` over everything else; the last step before writing.
    pub fn seal(&mut self) {
        self.checksum = self.compute_checksum();
    }

    /// The length the manifest gives the file `file`.
    pub fn file_bytes(&self, file: RegionFile) -> u64 {
        match file {
            RegionFile::Memory => self.memory_file_bytes,
            RegionFile::Sys => self.sys_file_bytes,
        }
    }

    /// Parses and checks `bytes` read from `path`: format and version first (another version
    /// is reported as such, not as a parse error), then the shape, the checksum, and every
    /// structural rule (see [`Manifest::validate`]).
    pub fn parse(bytes: &[u8], path: &Path) -> Result<Manifest> {
        #[derive(Deserialize)]
        struct Head {
            format: Option<serde_json::Value>,
            version: Option<serde_json::Value>,
            writer: Option<serde_json::Value>,
        }
        let version_error = |found: u64, writer: Option<&serde_json::Value>| Error::Version {
            path: path.to_path_buf(),
            found,
            writer: writer
                .and_then(|w| serde_json::from_value::<Writer>(w.clone()).ok())
                .map_or_else(
                    || "an unknown guestmem".into(),
                    |w| Writer::describe(Some(&w)),
                ),
            min: MIN_VERSION,
            supported: VERSION,
        };
        // One pass for a manifest of a version this code reads (the restore path waits on
        // it); only when that fails is the head read alone, to tell another format or version
        // from a damaged manifest.
        let head_error = |e: serde_json::Error| -> Error {
            let Ok(head) = serde_json::from_slice::<Head>(bytes) else {
                return Error::Json {
                    path: path.to_path_buf(),
                    source: e,
                };
            };
            if head.format.as_ref().and_then(|f| f.as_str()) != Some(FORMAT) {
                return Error::NotASnapshot {
                    path: path.to_path_buf(),
                    found: head.format.map_or_else(|| "none".into(), |f| f.to_string()),
                };
            }
            let version = head.version.and_then(|v| v.as_u64()).unwrap_or(0);
            if !(u64::from(MIN_VERSION)..=u64::from(VERSION)).contains(&version) {
                return version_error(version, head.writer.as_ref());
            }
            Error::Json {
                path: path.to_path_buf(),
                source: e,
            }
        };
        let manifest: Manifest = serde_json::from_slice(bytes).map_err(head_error)?;
        if manifest.format != FORMAT {
            return Err(Error::NotASnapshot {
                path: path.to_path_buf(),
                found: serde_json::Value::from(manifest.format).to_string(),
            });
        }
        if !(MIN_VERSION..=VERSION).contains(&manifest.version) {
            let writer = manifest.writer.as_ref().map(|w| serde_json::json!(w));
            return Err(version_error(manifest.version.into(), writer.as_ref()));
        }
        if manifest.version < 4 && manifest.writer.is_some() {
            return Err(Error::Corrupt(format!(
                "{}: a manifest of version {} names a writer (version 4 does)",
                path.display(),
                manifest.version
            )));
        }
        let computed = manifest.compute_checksum();
        if computed != manifest.checksum {
            return Err(Error::Corrupt(format!(
                "{}: the manifest's contents do not match its checksum (computed {computed}, \
                 it says {}): it was altered or damaged",
                path.display(),
                manifest.checksum
            )));
        }
        manifest.validate(path)?;
        Ok(manifest)
    }

    /// Checks every rule the restore paths rely on, naming the region and chunk that breaks
    /// one: the chunk size; vCPUs within what the layout holds; one sys region, in the sys
    /// file; per region a page-multiple size and offset, one chunk entry per chunk, the
    /// region inside its file and overlapping no other; the memory file exactly its regions;
    /// chunk flags that agree (a zero chunk's checksum is that of zeros, an inherited chunk
    /// needs a base).
    pub fn validate(&self, path: &Path) -> Result<()> {
        let bad = |why: String| Err(Error::Corrupt(format!("{}: {why}", path.display())));
        if self.chunk_bytes != CHUNK_BYTES {
            return bad(format!(
                "chunk size {} is not {CHUNK_BYTES}",
                self.chunk_bytes
            ));
        }
        if let Err(why) = check_config_layout(&self.config, self.regions.iter().map(|r| &r.spec)) {
            return bad(why);
        }
        let mut extents: Vec<(RegionFile, u64, u64, &str)> = Vec::new();
        for image in &self.regions {
            let name = &image.spec.name;
            let size = image.spec.size;
            if size == 0 || size % PAGE_SIZE != 0 || image.file_offset % PAGE_SIZE != 0 {
                return bad(format!(
                    "region '{name}': size {size:#x} or file offset {:#x} is not a positive \
                     multiple of the page size",
                    image.file_offset
                ));
            }
            if image.file != RegionFile::for_region(&image.spec) {
                return bad(format!(
                    "region '{name}' is in the {} file, which is not its own",
                    image.file.name()
                ));
            }
            let expected = size.div_ceil(CHUNK_BYTES);
            if image.chunks.len() as u64 != expected {
                return bad(format!(
                    "region '{name}' lists {} chunks; its {size:#x} bytes make {expected}",
                    image.chunks.len()
                ));
            }
            let file_len = self.file_bytes(image.file);
            let end = image.file_offset.checked_add(size);
            if end.is_none_or(|end| end > file_len) {
                return bad(format!(
                    "region '{name}' ({size:#x} bytes at {:#x}) ends beyond its file's \
                     {file_len:#x} bytes",
                    image.file_offset
                ));
            }
            extents.push((
                image.file,
                image.file_offset,
                image.file_offset + size,
                name,
            ));
            check_chunks(image, self.base.is_some()).or_else(bad)?;
        }
        check_extents(extents, |file| self.file_bytes(file)).or_else(bad)
    }
}

/// Why the chunk entries of `image` are wrong, if they are: a chunk marked both zero and
/// inherited, inherited without a base (`has_base`), or marked zero with another checksum.
fn check_chunks(image: &RegionImage, has_base: bool) -> std::result::Result<(), String> {
    let name = &image.spec.name;
    // Every whole chunk's: computed once (8 GiB of zeros are 4096 of them).
    let full_zero_crc = zeros_hasher(CHUNK_BYTES).finalize();
    for (i, chunk) in image.chunks.iter().enumerate() {
        let at = i as u64 * CHUNK_BYTES;
        if chunk.zero && chunk.inherited {
            return Err(format!(
                "region '{name}' chunk at offset {at:#x} is marked both zero and inherited"
            ));
        }
        if chunk.inherited && !has_base {
            return Err(format!(
                "region '{name}' chunk at offset {at:#x} is inherited, but the snapshot has \
                 no base"
            ));
        }
        let zeros_crc = || match image.chunk_len(i) {
            CHUNK_BYTES => full_zero_crc,
            len => zeros_hasher(len).finalize(),
        };
        if chunk.zero && chunk.crc32 != zeros_crc() {
            return Err(format!(
                "region '{name}' chunk at offset {at:#x} is marked zero, but its checksum \
                 {:#010x} is not that of zeros",
                chunk.crc32
            ));
        }
    }
    Ok(())
}

/// Why the regions' `extents` (file, start, end, region) in the files do not tile them, if
/// they do not: two overlap, or a file (of `file_bytes` bytes) holds more than its regions.
fn check_extents(
    mut extents: Vec<(RegionFile, u64, u64, &str)>,
    file_bytes: impl Fn(RegionFile) -> u64,
) -> std::result::Result<(), String> {
    extents.sort();
    for pair in extents.windows(2) {
        let ((fa, _, end_a, a), (fb, start_b, _, b)) = (pair[0], pair[1]);
        if fa == fb && start_b < end_a {
            return Err(format!(
                "regions '{a}' and '{b}' overlap in the {} file",
                fa.name()
            ));
        }
    }
    for file in [RegionFile::Memory, RegionFile::Sys] {
        let used: u64 = extents
            .iter()
            .filter(|e| e.0 == file)
            .map(|e| e.2 - e.1)
            .sum();
        if used != file_bytes(file) {
            return Err(format!(
                "the {} file is {:#x} bytes but its regions hold {used:#x}",
                file.name(),
                file_bytes(file)
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use guestmem_memory::Backend;

    /// A Linux guest's memory has its RAM regions and no sys region; the payload VM's has one.
    #[test]
    fn a_linux_layout_has_no_sys_region_and_the_payloads_has_one() {
        let linux = guestmem_vm::linux::linux_config(1, 256 << 20, Backend::Anon);
        let ram = linux.regions[0].clone();
        let sys = RegionSpec::new("sys", layout::SYS_GPA, layout::SYS_SIZE, Backend::Anon);
        assert!(check_config_layout(&linux, [&ram].into_iter()).is_ok());
        let e = check_config_layout(&linux, [&ram, &sys].into_iter()).unwrap_err();
        assert!(e.contains("Linux guest"), "{e}");
        let payload = VmConfig::simple(1, 8 << 20, Backend::Anon);
        let specs: Vec<_> = payload.regions.clone();
        assert!(check_config_layout(&payload, specs.iter()).is_err());
        let with_sys: Vec<_> = std::iter::once(sys).chain(specs).collect();
        assert!(check_config_layout(&payload, with_sys.iter()).is_ok());
    }

    fn manifest() -> Manifest {
        let config = VmConfig::simple(2, 8 << 20, Backend::Anon);
        let zero = |len: u64| Chunk {
            crc32: zeros_hasher(len).finalize(),
            zero: true,
            inherited: false,
        };
        let mut m = Manifest {
            format: FORMAT.into(),
            version: VERSION,
            regions: vec![
                RegionImage {
                    spec: RegionSpec::new("sys", layout::SYS_GPA, layout::SYS_SIZE, Backend::Anon),
                    file: RegionFile::Sys,
                    file_offset: 0,
                    digest: 1,
                    chunks: vec![
                        Chunk {
                            crc32: 7,
                            zero: false,
                            inherited: false,
                        },
                        zero(CHUNK_BYTES),
                        zero(CHUNK_BYTES),
                        zero(layout::SYS_SIZE - 3 * CHUNK_BYTES),
                    ],
                },
                RegionImage {
                    spec: config.regions[0].clone(),
                    file: RegionFile::Memory,
                    file_offset: 0,
                    digest: 2,
                    chunks: vec![zero(CHUNK_BYTES); 4],
                },
            ],
            config,
            chunk_bytes: CHUNK_BYTES,
            state_bytes: 10,
            state_blake3: "00".into(),
            memory_file_bytes: 8 << 20,
            sys_file_bytes: layout::SYS_SIZE,
            base: None,
            writer: Some(Writer::this()),
            checksum: String::new(),
        };
        m.seal();
        m
    }

    fn parse(m: &Manifest) -> Result<Manifest> {
        Manifest::parse(&serde_json::to_vec_pretty(m).unwrap(), Path::new("m.json"))
    }

    #[test]
    fn a_sealed_manifest_parses_back_equal() {
        let m = manifest();
        assert_eq!(parse(&m).unwrap(), m);
    }

    /// Any edit that keeps the JSON well-formed is caught by the checksum, naming it.
    #[test]
    fn an_edited_manifest_is_refused_by_its_checksum() {
        let mut m = manifest();
        m.regions[0].chunks[0].zero = true;
        let e = parse(&m).unwrap_err().to_string();
        assert!(e.contains("m.json") && e.contains("checksum"), "{e}");
    }

    /// Structural faults are refused with the region named, even when the checksum was
    /// recomputed over them (a manifest made by another tool, or forged).
    #[test]
    fn structural_faults_are_named_not_panics() {
        type Edit = fn(&mut Manifest);
        let cases: [(Edit, &str); 8] = [
            (
                |m| {
                    m.regions[1].chunks.pop();
                },
                "lists 3 chunks",
            ),
            (|m| m.regions[1].file_offset = 4096, "ends beyond"),
            (|m| m.regions[1].file = RegionFile::Sys, "not its own"),
            (|m| m.regions[1].chunks[0].inherited = true, "both zero"),
            (
                |m| {
                    m.regions[1].chunks[0].zero = false;
                    m.regions[1].chunks[0].inherited = true;
                },
                "has no base",
            ),
            (|m| m.regions[1].chunks[1].crc32 = 5, "not that of zeros"),
            (|m| m.memory_file_bytes += 4096, "its regions hold"),
            (|m| m.config.vcpus = 0, "0 vCPUs"),
        ];
        for (edit, want) in cases {
            let mut m = manifest();
            edit(&mut m);
            m.seal();
            let e = parse(&m).unwrap_err().to_string();
            assert!(e.contains(want), "want '{want}' in: {e}");
        }
    }

    #[test]
    fn overlapping_or_short_extents_are_named() {
        let bytes = |file| match file {
            RegionFile::Memory => 0x3000,
            RegionFile::Sys => 0,
        };
        let m = RegionFile::Memory;
        let tiled = vec![(m, 0x1000, 0x3000, "b"), (m, 0, 0x1000, "a")];
        assert_eq!(check_extents(tiled, bytes), Ok(()));
        let overlap = vec![(m, 0, 0x2000, "a"), (m, 0x1000, 0x3000, "b")];
        let e = check_extents(overlap, bytes).unwrap_err();
        assert!(e.contains("'a' and 'b' overlap in the memory"), "{e}");
        let short = vec![(m, 0, 0x2000, "a")];
        let e = check_extents(short, bytes).unwrap_err();
        assert!(e.contains("regions hold 0x2000"), "{e}");
    }

    #[test]
    fn a_diff_may_inherit_chunks_a_full_snapshot_may_not() {
        let mut image = manifest().regions.remove(1);
        image.chunks[2] = Chunk {
            crc32: 0,
            zero: false,
            inherited: true,
        };
        assert_eq!(check_chunks(&image, true), Ok(()));
        let e = check_chunks(&image, false).unwrap_err();
        assert!(e.contains("offset 0x") && e.contains("no base"), "{e}");
    }

    #[test]
    fn another_format_or_version_is_named() {
        let mut m = manifest();
        m.version = 1;
        let e = parse(&m).unwrap_err().to_string();
        assert!(e.contains("version 1"), "{e}");
        let e = Manifest::parse(b"{\"format\":\"x\"}", Path::new("m.json"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a guestmem snapshot"), "{e}");
        assert!(Manifest::parse(b"[1,2", Path::new("m.json")).is_err());
    }

    /// A version 2 snapshot (its `state.json` of guestmem's own VM, field by field) is refused
    /// before anything else of it is read, naming both versions, whether or not the rest of
    /// its manifest parses.
    #[test]
    fn a_version_2_snapshot_is_refused_naming_its_version() {
        let mut m = manifest();
        m.version = 2;
        m.seal();
        let e = parse(&m).unwrap_err();
        assert!(
            matches!(
                e,
                Error::Version {
                    found: 2,
                    supported: VERSION,
                    ..
                }
            ),
            "{e:?}"
        );
        let text = e.to_string();
        assert!(
            text.starts_with("m.json: snapshot format version 2, written by guestmem ")
                && text.contains(&format!("reads versions {MIN_VERSION} to {VERSION}")),
            "{text}"
        );
        let old = br#"{"format":"guestmem-snapshot","version":2,"state":"field by field"}"#;
        let e = Manifest::parse(old, Path::new("manifest.json")).unwrap_err();
        assert!(matches!(e, Error::Version { found: 2, .. }), "{e:?}");
    }

    /// A manifest of a newer version than this build reads is refused naming its writer and
    /// both versions, even when its fields are unknown here.
    #[test]
    fn a_newer_snapshot_is_refused_naming_its_writer() {
        let newer = br#"{"format":"guestmem-snapshot","version":9,"novel":1,
            "writer":{"version":"0.9.0","commit":"abc"}}"#;
        let e = Manifest::parse(newer, Path::new("manifest.json")).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("format version 9, written by guestmem 0.9.0 (commit abc)")
                && text.contains(guestmem_sys::release::VERSION)
                && text.contains(&format!("versions {MIN_VERSION} to {VERSION}")),
            "{text}"
        );
    }

    /// A version-3 manifest (guestmem 0.1.0's: no writer) parses with its checksum as 0.1.0
    /// computed it; one naming a writer is refused.
    #[test]
    fn a_version_3_manifest_reads_without_a_writer() {
        let mut m = manifest();
        m.version = 3;
        m.writer = None;
        m.seal();
        let json = serde_json::to_string(&m).unwrap();
        assert!(!json.contains("writer"), "{json}");
        assert_eq!(parse(&m).unwrap(), m);
        m.writer = Some(Writer::this());
        m.seal();
        let e = parse(&m).unwrap_err().to_string();
        assert!(e.contains("names a writer"), "{e}");
    }
}
