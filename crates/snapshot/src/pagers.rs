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
