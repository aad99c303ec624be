//! The restore engine: one way to bring back a snapshot, whatever holds it (a flat snapshot
//! directory, a chunk store) and however its memory comes back (copied in, mapped, paged in
//! lazily in this process, or served by a page server).
//!
//! A snapshot's format is a [`SnapshotImage`]: its configuration, machine state, identity, and
//! per region a checked page source, a checked full copy and (flat snapshots only) a checked
//! copy-on-write mapping. [`restore`] does the rest the same way for every image: build the VM
//! (or take a [`PreparedVm`], refused naming what differs before any byte reaches it), check
//! its layout, bring the memory back as the [`RestoreMode`] says, hand the VM its machine
//! state. Every refusal happens before a vCPU runs.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use guestmem_contract::component::ComponentState;
use guestmem_contract::{MachineBuilder, SharedFiles, TargetMachine};
use guestmem_memory::{Backend, GuestMemory, Region, RegionSpec};
use guestmem_pageserver::{PeerHandoff, ServedMemory, ServedRegion};
use guestmem_paging::{PageSource, Pager, PagerConfig, UserfaultPager};
use guestmem_vm::{layout, Vm, VmConfig};

use crate::pagers::{start_region_pagers, RegionPagers};
use crate::working_set::{regions_of_pagers, WorkingSetRegion};
use crate::{Error, PreparedVm, Result};

/// The nice value of a lazy restore's background fetches (working-set prefetch and sweep)
/// unless its configuration names one ([`PagerConfig::background_nice`]).
pub const LAZY_BACKGROUND_NICE: i32 = 10;

/// A snapshot as the restore engine reads it, whatever its format: every byte it hands out is
/// checked against its manifest before it is handed out.
pub trait SnapshotImage: Sync {
    /// Names it in messages ("snapshot DIR", "store snapshot STORE/NAME").
    fn describe(&self) -> String;

    /// The configuration of the VM it was taken of.
    fn config(&self) -> &VmConfig;

    /// Its memory regions in manifest order: the VM built for [`SnapshotImage::config`] must
    /// have exactly these.
    fn regions(&self) -> Vec<&RegionSpec>;

    /// How each chunk is checked before it is used, in words ("against its CRC-32").
    fn chunk_check(&self) -> &'static str;

    /// Its manifest's checksum: names the snapshot's bytes (clones sharing its pages, a
    /// recorded working set).
    fn identity(&self) -> &str;

    /// The VM's state as its machine saved it, for [`TargetMachine::restore`].
    fn machine_state(&self) -> &[u8];

    /// The states of the components saved with the VM, for the restored VM's components of
    /// the same names.
    fn components(&self) -> &[ComponentState];

    /// Whether `mode` can restore it; the error says why not.
    fn check_mode(&self, mode: &RestoreMode) -> Result<()>;

    /// Region `index` (manifest order) as a page source: each chunk checked before any of it
    /// is served.
    fn page_source(&self, index: usize) -> Result<Arc<dyn PageSource>>;

    /// Copies region `index` into `memory` (fresh: it reads as zeros), each chunk checked
    /// before any of it is written.
    fn copy_region(&self, memory: &GuestMemory, index: usize) -> Result<()>;

    /// The non-zero bytes of region `index`, checked: (region offset, bytes) pieces, read
    /// before the VM exists (the sys region, while the VM builds: see
    /// [`SnapshotImage::reads_overlap_build`]).
    fn read_region(&self, index: usize) -> Result<Vec<(u64, Vec<u8>)>>;

    /// Checks region `index` and maps it copy-on-write over `region` (anonymous memory, never
    /// run): only an image that is one plain file can; [`SnapshotImage::check_mode`] refuses
    /// map mode for the others.
    fn map_region(&self, region: &Region, index: usize) -> Result<()>;

    /// Checks memory restored in full once more, as a whole, where the format can (a chunk
    /// store compares each chunk's hash, catching a chunk placed wrong).
    fn check_restored(&self, _memory: &GuestMemory) -> Result<()> {
        Ok(())
    }

    /// Whether a lazy restore reads the sys region and the working set on threads while the VM
    /// builds: worth it where each read waits on a round trip (a chunk store); a local file
    /// is read sooner than threads start.
    fn reads_overlap_build(&self) -> bool {
        false
    }

    /// Fits a lazy restore's pager configuration to the image's chunks (a remote store wants
    /// smaller faults and more readahead).
    fn tune_pager(&self, _config: &mut PagerConfig) {}

    /// The working set an earlier lazy restore recorded, per region (chunk offsets in fault
    /// order), if any; one recorded for other bytes or damaged is refused, saying so.
    fn recorded_working_set(&self) -> Result<Option<Vec<WorkingSetRegion>>>;

    /// Records `regions` as its working set, for the next lazy restore to fetch first.
    fn write_working_set(&self, regions: Vec<WorkingSetRegion>) -> Result<()>;
}

/// How a snapshot's memory comes back.
#[derive(Debug, Clone)]
pub enum RestoreMode {
    /// Copy every non-zero page into fresh memory, then run.
    Full,
    /// Map a flat snapshot's memory file privately (copy-on-write) over anonymous regions;
    /// other backends are copied as in `Full`. A diff snapshot (several files) and a store
    /// snapshot (compressed objects) are refused.
    Map,
    /// Run at once while a pager per RAM region brings the memory in, on first access and in
    /// the background (a recorded working set first when `prefetch` is empty). A guest_memfd
    /// region is paged through KVM Userfault, refused naming `KVM_MEM_USERFAULT` where the
    /// kernel lacks it.
    Lazy(PagerConfig),
    /// Hand the RAM to the Firecracker-compatible page server listening on this socket, which
    /// brings it in (see [`served_memory`] for serving a snapshot); the sys region is copied in
    /// here.
    PageServer(PathBuf),
}

/// Where a restore gets its VM: a [`MachineBuilder`] builds a new one for the snapshot's
/// configuration (`&mut VmBuilder` for guestmem's own), a [`PreparedVm`] was built ahead of
/// time (refused, naming what differs, for a snapshot of another configuration).
pub trait RestoreTarget {
    /// The VM restored into.
    type Machine: TargetMachine;

    /// Refuses a snapshot of `config` (named `snapshot`) that this target cannot take, before
    /// anything is read.
    fn check(&self, _config: &VmConfig, _snapshot: &str) -> Result<()> {
        Ok(())
    }

    /// The VM for a snapshot of `config`, its steps added to `phases`.
    fn machine(
        self,
        config: &VmConfig,
        snapshot: &str,
        phases: &mut Vec<(String, Duration)>,
    ) -> Result<Self::Machine>;
}

impl<B: MachineBuilder> RestoreTarget for &mut B {
    type Machine = B::Machine;

    fn machine(
        self,
        config: &VmConfig,
        _snapshot: &str,
        phases: &mut Vec<(String, Duration)>,
    ) -> Result<B::Machine> {
        let vm = self.build(config, SharedFiles::new())?;
        phases.extend(vm.build_phases());
        Ok(vm)
    }
}

impl RestoreTarget for PreparedVm {
    type Machine = Vm;

    fn check(&self, config: &VmConfig, snapshot: &str) -> Result<()> {
        PreparedVm::check(self, config, snapshot)
    }

    fn machine(
        self,
        config: &VmConfig,
        snapshot: &str,
        phases: &mut Vec<(String, Duration)>,
    ) -> Result<Vm> {
        let mut t = Instant::now();
        let vm = self.take(config, snapshot)?;
        lap(phases, &mut t, "check the prepared VM");
        Ok(vm)
    }
}

/// A restored VM, not running yet: the caller restores its components from
/// [`SnapshotImage::components`] and resumes it. The pagers are dropped (their threads joined)
/// before the VM and its memory, as the field order says.
#[derive(Debug)]
pub struct Restored<M = Vm> {
    /// Lazy mode: the userfaultfd pagers bringing the RAM in (guest_memfd regions left out).
    pub pagers: Vec<Pager>,
    /// Lazy mode: the KVM Userfault pagers of the guest_memfd regions: the vCPU loop hands
    /// them its userfault exits.
    pub userfault_pagers: Vec<UserfaultPager>,
    /// The VM, its memory (or its pagers) and vCPU state in place.
    pub vm: M,
    /// Page-server mode: the handshake's connection and userfaultfd (keep them, and the
    /// server serving, while the VM lives).
    pub peer: Option<PeerHandoff>,
    /// Where the restore spent its time, step by step (the VM's build steps included).
    pub phases: Vec<(String, Duration)>,
    /// From the start of the restore to the vCPUs being ready.
    pub ready: Duration,
    /// Lazy mode: whether the pagers fetch a recorded working set first.
    pub prefetched: bool,
}

impl<M: TargetMachine> Restored<M> {
    /// Records the chunks the guest faulted on since a lazy restore of `image`, in fault
    /// order, as its working set, for the next lazy restore to fetch first. Returns how many
    /// chunks it lists.
    pub fn record_working_set(&self, image: &dyn SnapshotImage) -> Result<usize> {
        record_working_set(
            image,
            self.vm.memory(),
            &self.pagers,
            &self.userfault_pagers,
        )
    }
}

/// [`Restored::record_working_set`] for a restore taken apart: `memory` the VM's, the pagers as
/// the restore gave them.
pub fn record_working_set(
    image: &dyn SnapshotImage,
    memory: &GuestMemory,
    pagers: &[Pager],
    userfault_pagers: &[UserfaultPager],
) -> Result<usize> {
    let regions = regions_of_pagers(memory, pagers, userfault_pagers);
    let n = regions.iter().map(|r| r.chunks.len()).sum();
    image.write_working_set(regions)?;
    Ok(n)
}

/// Restores `image` into the VM `into` gives (see [`RestoreTarget`]), its memory brought back
/// as `mode` says, then hands it the machine state ([`TargetMachine::restore`]). Every check
/// happens before this returns, so a refused snapshot never runs a vCPU.
pub fn restore<I, T>(image: &I, into: T, mode: RestoreMode) -> Result<Restored<T::Machine>>
where
    I: SnapshotImage + ?Sized,
    T: RestoreTarget,
{
    let start = Instant::now();
    image.check_mode(&mode)?;
    let name = image.describe();
    into.check(image.config(), &name)?;
    let mut phases = Vec::new();
    let (mut vm, working_set) = match mode {
        RestoreMode::Full | RestoreMode::Map => {
            let vm = into.machine(image.config(), &name, &mut phases)?;
            check_layout(vm.memory(), image)?;
            (vm, None)
        }
        RestoreMode::Lazy(_) | RestoreMode::PageServer(_) => {
            let want_working_set = matches!(&mode, RestoreMode::Lazy(c) if c.prefetch.is_empty());
            build_with_sys(image, into, &name, want_working_set, &mut phases)?
        }
    };
    let mut t = Instant::now();
    let (mut pagers, mut peer) = (RegionPagers::default(), None);
    match &mode {
        RestoreMode::Full | RestoreMode::Map => {
            copy_or_map(image, vm.memory(), matches!(mode, RestoreMode::Map))?;
            lap(&mut phases, &mut t, "copy the memory");
        }
        RestoreMode::Lazy(config) => {
            pagers = start_pagers(image, &vm, config, working_set.as_deref())?;
            lap(&mut phases, &mut t, "start pagers");
        }
        RestoreMode::PageServer(socket) => {
            let handoff = guestmem_pageserver::hand_memory_to_server(vm.memory(), socket)?;
            peer = Some(handoff);
            lap(&mut phases, &mut t, "hand the RAM to the page server");
        }
    }
    vm.restore(image.machine_state())?;
    lap(&mut phases, &mut t, "restore vCPU state");
    Ok(Restored {
        pagers: pagers.pagers,
        userfault_pagers: pagers.userfault_pagers,
        vm,
        peer,
        phases,
        ready: start.elapsed(),
        prefetched: working_set.is_some(),
    })
}

/// The VM of a lazy or page-server restore with the sys region (page tables, payload, control
/// blocks: small, and needed at once) copied in, and the recorded working set when
/// `want_working_set`. The RAM regions are left to the pagers (or the page server).
fn build_with_sys<I, T>(
    image: &I,
    into: T,
    name: &str,
    want_working_set: bool,
    phases: &mut Vec<(String, Duration)>,
) -> Result<(T::Machine, Option<Vec<WorkingSetRegion>>)>
where
    I: SnapshotImage + ?Sized,
    T: RestoreTarget,
{
    if image.reads_overlap_build() {
        return build_while_reading(image, into, name, want_working_set, phases);
    }
    let vm = into.machine(image.config(), name, phases)?;
    let mut t = Instant::now();
    check_layout(vm.memory(), image)?;
    if let Some(i) = sys_index(image) {
        image.copy_region(vm.memory(), i)?;
    }
    lap(phases, &mut t, "copy the sys region");
    let working_set = if want_working_set {
        image.recorded_working_set()?
    } else {
        None
    };
    lap(phases, &mut t, "read the working set");
    Ok((vm, working_set))
}

/// [`build_with_sys`] with the sys region and the working set read on threads while the VM
/// builds (against a remote store, the VM's creation and the round trips overlap).
fn build_while_reading<I, T>(
    image: &I,
    into: T,
    name: &str,
    want_working_set: bool,
    phases: &mut Vec<(String, Duration)>,
) -> Result<(T::Machine, Option<Vec<WorkingSetRegion>>)>
where
    I: SnapshotImage + ?Sized,
    T: RestoreTarget,
{
    let (vm, sys, working_set) = std::thread::scope(|s| {
        let sys = s.spawn(|| read_sys(image));
        let working_set = s.spawn(|| {
            if want_working_set {
                image.recorded_working_set()
            } else {
                Ok(None)
            }
        });
        let vm = into.machine(image.config(), name, phases);
        (
            vm,
            sys.join().expect("reading the sys region panicked"),
            working_set
                .join()
                .expect("reading the working set panicked"),
        )
    });
    let vm = vm?;
    let mut t = Instant::now();
    check_layout(vm.memory(), image)?;
    for (gpa, bytes) in sys? {
        vm.memory().write(gpa, &bytes)?;
    }
    lap(phases, &mut t, "copy the sys region");
    Ok((vm, working_set?))
}

/// The index of `image`'s sys region (page tables, payload, control blocks) among its
/// regions, if it has one.
fn sys_index<I: SnapshotImage + ?Sized>(image: &I) -> Option<usize> {
    image
        .regions()
        .iter()
        .position(|r| r.gpa == layout::SYS_GPA)
}

/// The non-zero bytes of `image`'s sys region, checked, as (guest address, bytes) pieces
/// (none without a sys region): read once, written into each VM restored.
pub(crate) fn read_sys<I: SnapshotImage + ?Sized>(image: &I) -> Result<Vec<(u64, Vec<u8>)>> {
    let Some(i) = sys_index(image) else {
        return Ok(Vec::new());
    };
    Ok(image
        .read_region(i)?
        .into_iter()
        .map(|(offset, bytes)| (layout::SYS_GPA + offset, bytes))
        .collect())
}

/// Full and map modes: every region copied in, or (map, anonymous regions) mapped from the
/// image; then the image's own check of the whole.
fn copy_or_map<I: SnapshotImage + ?Sized>(
    image: &I,
    memory: &GuestMemory,
    map: bool,
) -> Result<()> {
    for (i, region) in memory.regions().iter().enumerate() {
        if map && region.backend() == Backend::Anon {
            image.map_region(region, i)?;
        } else {
            image.copy_region(memory, i)?;
        }
    }
    image.check_restored(memory)
}

/// Starts the pagers of a lazy restore of `image` on `vm`'s RAM: each region's page source is
/// the image's, prefetching its recorded working set (if any), its pages shared with clones
/// under the image's identity.
pub(crate) fn start_pagers<I, M>(
    image: &I,
    vm: &M,
    config: &PagerConfig,
    working_set: Option<&[WorkingSetRegion]>,
) -> Result<RegionPagers>
where
    I: SnapshotImage + ?Sized,
    M: TargetMachine,
{
    let memory = vm.memory().clone();
    let abort = vm.abort_handle();
    start_region_pagers(&memory, |i, region| {
        let source = image.page_source(i)?;
        let mut config = PagerConfig {
            abort: abort.clone(),
            // The restored vCPUs wait on their faults from the first instruction on.
            realtime_handlers: true,
            // The working-set prefetch and the sweep yield to the guests' faults and to other
            // restores on a busy host.
            background_nice: config.background_nice.or(Some(LAZY_BACKGROUND_NICE)),
            ..config.clone()
        };
        image.tune_pager(&mut config);
        if let Some(ws) = working_set {
            config.prefetch = ws
                .iter()
                .find(|r| r.name == region.name())
                .map(|r| r.chunks.clone())
                .unwrap_or_default();
        }
        // Clones share the pages of this very snapshot: its identity names them.
        config.share = config.share.map(|s| s.of(image.identity()));
        Ok((source, config))
    })
}

/// The RAM of `image` (every region but the sys region, back to back in manifest order) for a
/// Firecracker-compatible page server: each region served by the image's page source, which
/// checks each chunk before any of it is served.
pub fn served_memory(image: &dyn SnapshotImage) -> Result<ServedMemory> {
    let regions = image
        .regions()
        .into_iter()
        .enumerate()
        .filter(|(_, r)| r.gpa != layout::SYS_GPA)
        .map(|(i, r)| {
            Ok(ServedRegion {
                name: r.name.clone(),
                size: r.size,
                source: image.page_source(i)?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(ServedMemory::Regions {
        label: image.describe(),
        checks: format!(
            "each chunk checked {} before it is served",
            image.chunk_check()
        ),
        regions,
    })
}

/// Refuses a VM whose memory is not laid out as `image`'s regions.
pub(crate) fn check_layout<I: SnapshotImage + ?Sized>(
    memory: &GuestMemory,
    image: &I,
) -> Result<()> {
    let built: Vec<&RegionSpec> = memory.regions().iter().map(|r| r.spec()).collect();
    let saved = image.regions();
    if built != saved {
        return Err(Error::Layout(format!(
            "the snapshot's regions {saved:?} differ from those its configuration builds here \
             {built:?}"
        )));
    }
    Ok(())
}

/// Records the step `name` as ending now.
fn lap(phases: &mut Vec<(String, Duration)>, t: &mut Instant, name: &str) {
    let now = Instant::now();
    phases.push((name.to_string(), now - *t));
    *t = now;
}
