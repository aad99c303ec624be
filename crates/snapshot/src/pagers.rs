//! The pagers of a lazy restore, one per guest RAM region, whatever the snapshot's format (a
//! flat memory file, a chunk store): a guest_memfd region is demand paged through KVM
//! Userfault ([`UserfaultPager`]), any other region through userfaultfd ([`Pager`]).
//!
//! guest_memfd goes through KVM Userfault because KVM maps its pages for the guest straight
//! from the file: userfaultfd on the host mapping never sees a vCPU's access, so a guest paged
//! by it alone would run on pages never fetched. Where the kernel lacks KVM Userfault the
//! region is refused, naming what is missing, before any vCPU runs.

use std::sync::Arc;

use guestmem_memory::{Backend, GuestMemory, Region};
use guestmem_paging::{PageSource, Pager, PagerConfig, UserfaultPager};
use guestmem_vm::layout;

use crate::Result;

/// The pagers bringing a lazily restored VM's RAM in; dropped before the VM (they hold its
/// regions' mappings registered).
#[derive(Debug, Default)]
pub struct RegionPagers {
    /// The userfaultfd pagers, in region order (guest_memfd regions left out).
    pub pagers: Vec<Pager>,
    /// The KVM Userfault pagers of the guest_memfd regions, in region order: the vCPU loop
    /// hands them its userfault exits (through the memory's router).
    pub userfault_pagers: Vec<UserfaultPager>,
}

/// Starts the pager of every RAM region of `memory` (registered as memslots; the sys region,
/// copied at once by the restore, left out): `prepare(i, region)` gives region `i`'s page
/// source and pager configuration. A guest_memfd region gets a [`UserfaultPager`], refused
/// naming KVM Userfault where the kernel lacks it; any other a [`Pager`].
pub fn start_region_pagers(
    memory: &GuestMemory,
    mut prepare: impl FnMut(usize, &Region) -> Result<(Arc<dyn PageSource>, PagerConfig)>,
) -> Result<RegionPagers> {
    let mut started = RegionPagers::default();
    for (i, region) in memory.regions().iter().enumerate() {
        if region.gpa() == layout::SYS_GPA {
            continue;
        }
        let (source, config) = prepare(i, region)?;
        if region.backend() == Backend::GuestMemfd {
            started
                .userfault_pagers
                .push(UserfaultPager::start(memory, i, source, &config)?);
        } else {
            started.pagers.push(Pager::start(region, source, &config)?);
        }
    }
    Ok(started)
}

#[cfg(test)]
mod tests {
    use super::*;
    use guestmem_memory::RegionSpec;
    use guestmem_paging::{FileSource, ZeroSource};

    /// Every region but the VM's own gets a userfaultfd pager over the source its caller
    /// prepared, which serves the bytes a host access faults on; a failed preparation stops
    /// the start naming its region.
    #[test]
    fn each_guest_region_gets_a_pager_over_its_source() {
        let memory = GuestMemory::new(
            &[
                RegionSpec::new("sys", layout::SYS_GPA, layout::SYS_SIZE, Backend::Anon),
                RegionSpec::new("ram", layout::RAM_GPA, 4 << 20, Backend::Anon),
                RegionSpec::new("hi", layout::RAM_GPA + (8 << 20), 2 << 20, Backend::Memfd),
            ],
            None,
        )
        .unwrap();
        let path = std::env::temp_dir().join(format!("guestmem-pagers-{}", std::process::id()));
        std::fs::write(&path, vec![0x5a; 4 << 20]).unwrap();
        let mut asked = Vec::new();
        let started = start_region_pagers(&memory, |i, region| {
            asked.push((i, region.name().to_string()));
            let source: Arc<dyn PageSource> = if region.name() == "ram" {
                Arc::new(FileSource::open(&path).map_err(crate::Error::io(&path, "open"))?)
            } else {
                Arc::new(ZeroSource {
                    size: region.size(),
                })
            };
            Ok((source, PagerConfig::default()))
        })
        .map_err(|e| e.to_string())
        .unwrap();
        assert_eq!(asked, [(1, "ram".to_string()), (2, "hi".to_string())]);
        assert_eq!(
            (started.pagers.len(), started.userfault_pagers.len()),
            (2, 0)
        );
        let mut got = [0u8; 8];
        memory.read(layout::RAM_GPA + (3 << 20), &mut got).unwrap();
        assert_eq!(got, [0x5a; 8]);
        assert!(started.pagers[0].stats().faults >= 1);
        drop(started);

        let e = start_region_pagers(&memory, |_, region| {
            Err(crate::Error::Layout(format!(
                "no source for '{}'",
                region.name()
            )))
        })
        .unwrap_err();
        assert_eq!(e.to_string(), "cannot restore here: no source for 'ram'");
        let _ = std::fs::remove_file(&path);
    }
}
