//! `working-set.json`: the chunks a lazily restored guest faulted on first, kept beside the
//! snapshot for the next lazy restore to fetch first.

use guestmem_memory::{Backend, GuestMemory};
use guestmem_paging::{Pager, UserfaultPager};
use guestmem_vm::{layout, Vm};
use serde::{Deserialize, Serialize};

use super::manifest::CHUNK_BYTES;
use super::write::write_file;
use super::{read_regular, Snapshot, WORKING_SET};
use crate::{Error, Result};

/// The `format` field of a working-set file.
pub const WORKING_SET_FORMAT: &str = "guestmem-working-set";
/// The version of [`WorkingSet`] this code writes and reads (3: the number the snapshot
/// manifest had when working sets took their own; a working set is a hint, so another version
/// is refused and the lazy restore goes on without it). A change to [`WorkingSet`] or
/// [`WorkingSetRegion`] bumps it.
pub const WORKING_SET_VERSION: u32 = 3;

/// `working-set.json`: the chunks a lazily restored guest faulted on first, in fault order,
/// recorded for the next lazy restore of the same snapshot to fetch first. It is bound to the
/// snapshot by the manifest's CRC-32, and checksummed itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkingSet {
    /// [`WORKING_SET_FORMAT`].
    pub format: String,
    /// Its version.
    pub version: u32,
    /// The `checksum` of the manifest it was recorded for.
    pub manifest_checksum: String,
    /// Per region, the chunks in fault order.
    pub regions: Vec<WorkingSetRegion>,
    /// CRC-32 over every region's name and chunk offsets (see `WorkingSet::checksum`).
    pub crc32: u32,
}

/// One region's working set: region offsets of chunks, in the order the guest asked for them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkingSetRegion {
    /// The region's name.
    pub name: String,
    /// Region offsets of the pager's chunks, in the order the guest faulted on them.
    pub chunks: Vec<u64>,
}

/// The working set a lazy restore's guest showed: per RAM region of `vm` (the sys region
/// left out, `pagers` in the order of the regions), the chunks it faulted on, in order.
pub fn regions_of(vm: &Vm, pagers: &[Pager]) -> Vec<WorkingSetRegion> {
    regions_of_memory(vm.memory(), pagers)
}

/// [`regions_of`] for any VM's guest memory.
pub fn regions_of_memory(memory: &GuestMemory, pagers: &[Pager]) -> Vec<WorkingSetRegion> {
    regions_of_pagers(memory, pagers, &[])
}

/// [`regions_of_memory`] with the KVM Userfault pagers of the guest_memfd regions too (as
/// a lazy restore starts them: `pagers` for the other RAM regions, in order,
/// `userfault_pagers` for the guest_memfd ones).
pub fn regions_of_pagers(
    memory: &GuestMemory,
    pagers: &[Pager],
    userfault_pagers: &[UserfaultPager],
) -> Vec<WorkingSetRegion> {
    let mut pagers = pagers.iter();
    let mut userfault_pagers = userfault_pagers.iter();
    memory
        .regions()
        .iter()
        .filter(|r| r.gpa() != layout::SYS_GPA)
        .filter_map(|region| {
            let chunks = if region.backend() == Backend::GuestMemfd {
                userfault_pagers.next()?.fault_order()
            } else {
                pagers.next()?.fault_order()
            };
            Some(WorkingSetRegion {
                name: region.name().to_string(),
                chunks,
            })
        })
        .collect()
}

impl WorkingSet {
    fn checksum(regions: &[WorkingSetRegion]) -> u32 {
        let mut h = crc32fast::Hasher::new();
        for r in regions {
            h.update(r.name.as_bytes());
            h.update(&[0]);
            for c in &r.chunks {
                h.update(&c.to_le_bytes());
            }
        }
        h.finalize()
    }

    /// The chunk offsets recorded for region `name` (none if it has no entry).
    pub fn offsets(&self, name: &str) -> Vec<u64> {
        self.regions
            .iter()
            .find(|r| r.name == name)
            .map(|r| r.chunks.clone())
            .unwrap_or_default()
    }

    /// How many chunks it lists, over all regions.
    pub fn chunks(&self) -> usize {
        self.regions.iter().map(|r| r.chunks.len()).sum()
    }
}

impl Snapshot {
    /// The working set recorded beside the snapshot by an earlier lazy restore, if any. One
    /// recorded for another snapshot (the manifest's checksum differs), with a bad checksum,
    /// or naming chunks the snapshot does not have is refused with the reason.
    pub fn working_set(&self) -> Result<Option<WorkingSet>> {
        let path = self.dir.join(WORKING_SET);
        if !path.exists() {
            return Ok(None);
        }
        let bytes = read_regular(&path)?;
        let ws: WorkingSet = serde_json::from_slice(&bytes).map_err(|e| Error::Json {
            path: path.clone(),
            source: e,
        })?;
        let bad = |why: String| Err(Error::Corrupt(format!("{}: {why}", path.display())));
        if ws.format != WORKING_SET_FORMAT || ws.version != WORKING_SET_VERSION {
            return bad(format!(
                "format {} version {}, not {WORKING_SET_FORMAT} version {WORKING_SET_VERSION}",
                ws.format, ws.version
            ));
        }
        if ws.manifest_checksum != self.manifest.checksum {
            return bad(format!(
                "recorded for another snapshot (manifest checksum {}, this one's is {}); \
                 delete it",
                ws.manifest_checksum, self.manifest.checksum
            ));
        }
        let crc = WorkingSet::checksum(&ws.regions);
        if crc != ws.crc32 {
            return bad(format!(
                "checksum {crc:#010x}, the file says {:#010x}",
                ws.crc32
            ));
        }
        for r in &ws.regions {
            let Some(image) = self.manifest.regions.iter().find(|i| i.spec.name == r.name) else {
                return bad(format!("no region '{}' in the snapshot", r.name));
            };
            if let Some(c) = r
                .chunks
                .iter()
                .find(|&&c| c % CHUNK_BYTES != 0 || c >= image.spec.size)
            {
                return bad(format!(
                    "region '{}': {c:#x} is not a chunk of the region",
                    r.name
                ));
            }
        }
        Ok(Some(ws))
    }

    /// Writes `regions` as the snapshot's working set (replacing any).
    pub(crate) fn write_working_set(&self, regions: Vec<WorkingSetRegion>) -> Result<()> {
        let ws = WorkingSet {
            format: WORKING_SET_FORMAT.into(),
            version: WORKING_SET_VERSION,
            manifest_checksum: self.manifest.checksum.clone(),
            crc32: WorkingSet::checksum(&regions),
            regions,
        };
        let path = self.dir.join(WORKING_SET);
        let json = serde_json::to_vec(&ws).map_err(|e| Error::Json {
            path: path.clone(),
            source: e,
        })?;
        let tmp = self.dir.join(format!("{WORKING_SET}.tmp"));
        write_file(&tmp, &json)?;
        std::fs::rename(&tmp, &path).map_err(Error::io(&path, "rename"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use guestmem_vm::VmConfig;
    use std::path::{Path, PathBuf};

    /// A snapshot of a fresh 8 MiB VM in a directory of its own.
    fn snapshot(name: &str) -> (PathBuf, Snapshot) {
        let dir = std::env::temp_dir().join(format!("guestmem-ws-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let vm = Vm::new(&VmConfig::simple(1, 8 << 20, Backend::Anon)).unwrap();
        crate::write(&vm, &dir).unwrap();
        let snap = Snapshot::open(&dir).unwrap();
        (dir, snap)
    }

    fn rewrite(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
        let path = dir.join(WORKING_SET);
        let mut v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        edit(&mut v);
        std::fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
    }

    fn refusal(snap: &Snapshot) -> String {
        match snap.working_set() {
            Err(Error::Corrupt(why)) => why,
            other => panic!("{other:?}"),
        }
    }

    /// A recorded working set reads back as written; each kind of damage is refused saying
    /// what is wrong, and a missing file is none.
    #[test]
    fn a_working_set_reads_back_or_is_refused_naming_the_damage() {
        let (dir, snap) = snapshot("round-trip");
        assert_eq!(snap.working_set().unwrap(), None);
        let chunks = vec![3 * CHUNK_BYTES, 0, CHUNK_BYTES];
        snap.write_working_set(vec![WorkingSetRegion {
            name: "ram".into(),
            chunks: chunks.clone(),
        }])
        .unwrap();
        let ws = snap.working_set().unwrap().expect("recorded");
        assert_eq!((ws.offsets("ram"), ws.chunks()), (chunks, 3));
        assert!(ws.offsets("sys").is_empty());
        let good = std::fs::read(dir.join(WORKING_SET)).unwrap();

        rewrite(&dir, |v| {
            v["regions"][0]["chunks"][1] = (5 * CHUNK_BYTES).into();
        });
        let e = refusal(&snap);
        assert!(
            e.contains(": checksum 0x") && e.contains(", the file says 0x"),
            "{e}"
        );

        let recrc = |v: &mut serde_json::Value| {
            let regions: Vec<WorkingSetRegion> =
                serde_json::from_value(v["regions"].clone()).unwrap();
            v["crc32"] = WorkingSet::checksum(&regions).into();
        };
        std::fs::write(dir.join(WORKING_SET), &good).unwrap();
        rewrite(&dir, |v| {
            v["regions"][0]["chunks"][1] = (CHUNK_BYTES + 4096).into();
            recrc(v);
        });
        assert!(
            refusal(&snap).ends_with(&format!(
                "region 'ram': {:#x} is not a chunk of the region",
                CHUNK_BYTES + 4096
            )),
            "{}",
            refusal(&snap)
        );
        rewrite(&dir, |v| {
            v["regions"][0]["chunks"][1] = (8u64 << 20).into();
            recrc(v);
        });
        assert!(refusal(&snap).contains("is not a chunk of the region"));
        rewrite(&dir, |v| {
            v["regions"][0]["name"] = "disk".into();
            recrc(v);
        });
        assert!(refusal(&snap).ends_with("no region 'disk' in the snapshot"));

        std::fs::write(dir.join(WORKING_SET), &good).unwrap();
        rewrite(&dir, |v| v["manifest_checksum"] = "0".into());
        assert!(refusal(&snap).contains("recorded for another snapshot"));
        std::fs::write(dir.join(WORKING_SET), &good).unwrap();
        rewrite(&dir, |v| v["version"] = 1.into());
        assert!(refusal(&snap).contains(&format!(
            "format {WORKING_SET_FORMAT} version 1, not {WORKING_SET_FORMAT} version {WORKING_SET_VERSION}"
        )));
        std::fs::write(dir.join(WORKING_SET), b"{").unwrap();
        assert!(matches!(snap.working_set(), Err(Error::Json { .. })));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
