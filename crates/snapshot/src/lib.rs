//! Snapshots: a paused VM written to a directory, and VMs restored from one.
//!
//! A snapshot directory holds:
//! - `manifest.json` ([`Manifest`]): format name and version, the VM configuration, the memory
//!   layout (each region's file and place in it) with a CRC-32 and a zero flag per 2 MiB chunk,
//!   a digest per region, the state file's BLAKE3, for a diff its base (path and checksum), and
//!   a BLAKE3 checksum over the whole manifest;
//! - `state.json`: the VM's state as its [`Machine`] saved it (an opaque blob; guestmem's own
//!   VM saves its complete vCPU and VM state and its payload's workloads, see [`PayloadVm`])
//!   and the states of its [`Component`]s;
//! - `memory`: the guest RAM regions back to back, zero pages left as holes (a sparse file);
//!   nothing else, so that a Firecracker page server can be handed it as it is;
//! - `sys`: the sys region (page tables, payload, control blocks);
//! - optionally `working-set.json`: the chunks a lazily restored guest faulted on first, in
//!   that order, recorded by [`Restored::record_working_set`] and fetched first by the next
//!   lazy restore (bound to the manifest by its checksum, and checksummed).
//!
//! Every byte a restored guest runs on is checked before it runs on it: the manifest as a whole
//! (its checksum, then every structural rule), the state (BLAKE3), a diff's base (its manifest
//! checksum must be the one the diff was written over), and each chunk against its CRC-32 —
//! full restore as it copies, map restore for every chunk (zero chunks included: their range
//! of the file must read as zeros) before it maps the file, lazy restore and the page server
//! as each chunk is first served. A zero chunk is served as zeros whatever its file range
//! holds. A snapshot is replaced atomically ([`write()`]): a failed write leaves the previous one
//! intact. CRC-32 finds damage, not a forger who also recomputes the manifest's checksum.
//!
//! Writing works from any [`Machine`] ([`write_machine`]); [`write()`] is that for guestmem's
//! own VM. Restoring is the one engine of [`restore()`] (module `restore`), for any snapshot
//! format that is a [`SnapshotImage`] (this crate's [`Snapshot`], the chunk store's), into any
//! VM a [`MachineBuilder`] builds or a [`PreparedVm`], in any [`RestoreMode`].
//!
//! [`Machine`]: guestmem_contract::component::Machine
//! [`Component`]: guestmem_contract::component::Component
//! [`PayloadVm`]: guestmem_contract::PayloadVm
//! [`MachineBuilder`]: guestmem_contract::MachineBuilder

mod copy_before_write;
mod error;
pub mod live;
mod manifest;
mod pagers;
mod pooled;
mod prepared;
pub mod progress;
mod recycle;
mod restore;
pub mod service;
mod sink;
mod sparse;
mod working_set;
mod write;

use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use guestmem_memory::{Backend, GuestMemory, PageBuf, Region, RegionSpec};
use guestmem_paging::PageSource;
use guestmem_sys::to_usize;
use guestmem_vm::{VmConfig, VmState};

use serde::{Deserialize, Serialize};

pub use error::{Error, Result};
pub use guestmem_sys::error_chain;
pub use manifest::{
    canonical_checksum, check_config_layout, BaseRef, Chunk, Manifest, RegionFile, RegionImage,
    CHUNK_BYTES, FORMAT, MAX_BASE_DEPTH, MIN_VERSION, VERSION,
};
pub use pooled::PoolMachine;
pub use prepared::{layout_mismatch, PreparedVm};
pub use restore::{
    record_working_set, restore, served_memory, RestoreMode, RestoreTarget, Restored,
    SnapshotImage, LAZY_BACKGROUND_NICE,
};
use sparse::{nonzero_page_runs, read_sparse};
pub use working_set::{
    regions_of, regions_of_memory, regions_of_pagers, WorkingSet, WorkingSetRegion,
    WORKING_SET_FORMAT,
};
pub use write::{
    write, write_diff, write_machine, write_machine_diff, write_with_components, WriteReport,
};

use guestmem_contract::component::ComponentState;

const MANIFEST: &str = "manifest.json";
const STATE: &str = "state.json";
const WORKING_SET: &str = "working-set.json";

/// A snapshot whose manifest and state have been read and checked.
#[derive(Debug)]
pub struct Snapshot {
    dir: PathBuf,
    manifest: Manifest,
    /// The machine's state, as its [`guestmem_contract::component::Machine::save`] gave it.
    machine: Vec<u8>,
    /// The components' states, saved with the VM's.
    components: Vec<ComponentState>,
    /// The `memory` and `sys` files, indexed by `RegionFile as usize`.
    files: [File; 2],
    /// A diff snapshot's base, opened and checked with it.
    base: Option<Box<Snapshot>>,
}

impl Snapshot {
    /// Reads and checks `dir`: the manifest (format, version, checksum, structure), the state
    /// (length, BLAKE3, shape), the memory files' lengths, and for a diff its base chain
    /// (each base must be the very snapshot the diff was written over).
    pub fn open(dir: &Path) -> Result<Snapshot> {
        Snapshot::open_checked(dir, None, 0)
    }

    fn open_checked(dir: &Path, expected: Option<&str>, depth: usize) -> Result<Snapshot> {
        let manifest_path = dir.join(MANIFEST);
        let bytes = read_regular(&manifest_path)?;
        let manifest = Manifest::parse(&bytes, &manifest_path)?;
        if let Some(expected) = expected {
            if manifest.checksum != expected {
                return Err(Error::Corrupt(format!(
                    "{}: this is not the base the diff was written over (its manifest checksum \
                     is {}, the diff's base had {expected}): the base was replaced or rewritten \
                     since",
                    manifest_path.display(),
                    manifest.checksum
                )));
            }
        }

        let state_path = dir.join(STATE);
        let state_json = read_regular(&state_path)?;
        if state_json.len() as u64 != manifest.state_bytes {
            return Err(Error::WrongLength {
                path: state_path,
                expected: manifest.state_bytes,
                found: state_json.len() as u64,
            });
        }
        let hash = blake3::hash(&state_json).to_hex().to_string();
        if hash != manifest.state_blake3 {
            return Err(Error::Corrupt(format!(
                "{}: BLAKE3 {hash}, the manifest says {}",
                state_path.display(),
                manifest.state_blake3
            )));
        }
        let SavedState {
            machine,
            components,
        } = parse_saved_state(&state_json, &state_path)?;

        let open = |which: RegionFile| -> Result<File> {
            let path = dir.join(which.name());
            let file = open_regular(&path)?;
            let len = file.metadata().map_err(Error::io(&path, "stat"))?.len();
            if len != manifest.file_bytes(which) {
                return Err(Error::WrongLength {
                    path,
                    expected: manifest.file_bytes(which),
                    found: len,
                });
            }
            Ok(file)
        };
        let files = [open(RegionFile::Memory)?, open(RegionFile::Sys)?];
        let base = match &manifest.base {
            None => None,
            Some(base_ref) => {
                if depth >= MAX_BASE_DEPTH {
                    return Err(Error::Corrupt(format!(
                        "{}: more than {MAX_BASE_DEPTH} diff snapshots stand on one another",
                        manifest_path.display()
                    )));
                }
                let base =
                    Snapshot::open_checked(&base_ref.dir, Some(&base_ref.checksum), depth + 1)?;
                let same_layout = base.manifest.config == manifest.config
                    && base.manifest.regions.len() == manifest.regions.len()
                    && base
                        .manifest
                        .regions
                        .iter()
                        .zip(&manifest.regions)
                        .all(|(b, d)| b.spec == d.spec && b.chunks.len() == d.chunks.len());
                if !same_layout {
                    return Err(Error::Corrupt(format!(
                        "{}: its base {} has another memory layout",
                        manifest_path.display(),
                        base_ref.dir.display()
                    )));
                }
                Some(Box::new(base))
            }
        };
        Ok(Snapshot {
            dir: dir.to_path_buf(),
            manifest,
            machine,
            components,
            files,
            base,
        })
    }

    /// The open file holding `image`'s bytes.
    fn file(&self, image: &RegionImage) -> &File {
        &self.files[image.file as usize]
    }

    /// The path of the file holding `image`'s bytes.
    pub fn file_path(&self, image: &RegionImage) -> PathBuf {
        self.dir.join(image.file.name())
    }

    /// Puts chunk `index` of region `region` into `buf` from this snapshot or, for an inherited
    /// chunk, from its base chain, and checks its CRC-32. Only the memory file's data extents
    /// are read (zero pages are holes): returns the chunk-relative ranges of `buf` that hold
    /// data (the rest of `buf` is left alone and stands for zeros), or `None` for an all-zero
    /// chunk.
    fn chunk(
        &self,
        region: usize,
        index: usize,
        buf: &mut [u8],
    ) -> Result<Option<Vec<Range<usize>>>> {
        let image = &self.manifest.regions[region];
        let chunk = image.chunks[index];
        if chunk.inherited {
            let base = self.base.as_ref().ok_or_else(|| {
                Error::Corrupt(format!(
                    "region '{}' chunk {index} is inherited, but the snapshot has no base",
                    image.spec.name
                ))
            })?;
            return base.chunk(region, index, buf);
        }
        if chunk.zero {
            return Ok(None);
        }
        self.read_chunk_data(image, index, buf).map(Some)
    }

    /// The snapshot (this one or one of its bases) that holds chunk `index` of region
    /// `region`, or `None` when the chunk is all zeros.
    fn holder(&self, region: usize, index: usize) -> Result<Option<&Snapshot>> {
        let image = &self.manifest.regions[region];
        let chunk = image.chunks[index];
        if chunk.inherited {
            return match &self.base {
                Some(base) => base.holder(region, index),
                None => Err(Error::Corrupt(format!(
                    "region '{}' chunk {index} is inherited, but the snapshot has no base",
                    image.spec.name
                ))),
            };
        }
        Ok((!chunk.zero).then_some(self))
    }

    /// Its manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The snapshot's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Names it in messages: "snapshot DIR".
    pub fn describe(&self) -> String {
        format!("snapshot {}", self.dir.display())
    }

    /// The VM's state, as its machine saved it ([`guestmem_contract::component::Machine::save`]), for
    /// [`TargetMachine::restore`].
    pub fn machine_state(&self) -> &[u8] {
        &self.machine
    }

    /// The states of the components saved with the VM ([`write_with_components`]), for the
    /// restored VM's components of the same names.
    pub fn components(&self) -> &[ComponentState] {
        &self.components
    }

    /// Reads chunk `index` of region image `image` into `buf` and checks its CRC-32.
    pub fn read_chunk(&self, image: &RegionImage, index: usize, buf: &mut [u8]) -> Result<()> {
        let offset = index as u64 * CHUNK_BYTES;
        let len = to_usize(CHUNK_BYTES.min(image.spec.size - offset));
        buf[..len].fill(0);
        self.read_chunk_data(image, index, buf).map(|_| ())
    }

    /// Reads the data extents of chunk `index` of `image` into `buf` and checks the chunk's
    /// CRC-32 (holes count as zeros); returns the ranges read.
    fn read_chunk_data(
        &self,
        image: &RegionImage,
        index: usize,
        buf: &mut [u8],
    ) -> Result<Vec<Range<usize>>> {
        let offset = index as u64 * CHUNK_BYTES;
        let len = to_usize(CHUNK_BYTES.min(image.spec.size - offset));
        let (crc, ranges) = read_sparse(
            self.file(image),
            image.file_offset + offset,
            &mut buf[..len],
        )
        .map_err(Error::io(&self.file_path(image), "read"))?;
        if crc != image.chunks[index].crc32 {
            let what = if image.chunks[index].zero {
                "is all zeros in the manifest, but its range of the file (holes) holds data"
            } else {
                "does not match its checksum"
            };
            return Err(Error::Corrupt(format!(
                "{}: region '{}' chunk {index} (offset {offset:#x}) {what}: checksum \
                 {crc:#010x}, the manifest says {:#010x}",
                self.dir.display(),
                image.spec.name,
                image.chunks[index].crc32
            )));
        }
        Ok(ranges)
    }
}

/// Opens `path` for reading, refusing anything but a regular file: a FIFO or a device in a
/// snapshot directory would block the open or never end.
pub(crate) fn open_regular(path: &Path) -> Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(Error::io(path, "read"))?;
    let meta = file.metadata().map_err(Error::io(path, "stat"))?;
    if !meta.is_file() {
        return Err(Error::Corrupt(format!(
            "{}: not a regular file",
            path.display()
        )));
    }
    Ok(file)
}

/// The whole of the regular file `path` (see [`open_regular`]).
pub(crate) fn read_regular(path: &Path) -> Result<Vec<u8>> {
    use std::io::Read;
    let mut bytes = Vec::new();
    open_regular(path)?
        .read_to_end(&mut bytes)
        .map_err(Error::io(path, "read"))?;
    Ok(bytes)
}

/// What `state.json` holds (and a store snapshot's state object): the machine's state (hex in
/// JSON; guestmem's own VM's in its versioned envelope, `guestmem_contract::envelope`) and the
/// components' states. Format: a change bumps the flat snapshot's [`VERSION`] and the store
/// manifest's version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SavedState {
    /// What [`guestmem_contract::component::Machine::save`] gave.
    #[serde(with = "guestmem_contract::component::hex_bytes")]
    pub machine: Vec<u8>,
    /// The components' states.
    #[serde(default)]
    pub components: Vec<ComponentState>,
}

fn parse_saved_state(bytes: &[u8], path: &Path) -> Result<SavedState> {
    serde_json::from_slice(bytes).map_err(|e| Error::Json {
        path: path.to_path_buf(),
        source: e,
    })
}

/// Parses the state of guestmem's own VM (the JSON of a [`VmState`], as
/// [`guestmem_contract::PayloadVm`] saves it; read from `path`) for a VM of `vcpus` vCPUs: its
/// shape, and one vCPU state and one workload per vCPU.
pub fn parse_state(bytes: &[u8], vcpus: usize, path: &Path) -> Result<VmState> {
    let state: VmState = serde_json::from_slice(bytes).map_err(|e| Error::Json {
        path: path.to_path_buf(),
        source: e,
    })?;
    if state.vcpus.len() != vcpus || state.work.len() != vcpus {
        return Err(Error::Corrupt(format!(
            "{}: state for {} vCPUs ({} workloads), the configuration has {vcpus}",
            path.display(),
            state.vcpus.len(),
            state.work.len(),
        )));
    }
    Ok(state)
}

/// One region's bytes in a snapshot's memory file (and, for a diff snapshot, its bases'),
/// each chunk checked against its CRC-32 before any of it is served.
#[derive(Debug)]
pub struct SnapshotSource {
    /// The snapshot directory (named in errors).
    dir: PathBuf,
    name: String,
    size: u64,
    /// The memory files of the snapshot and its bases, each with its image of the region.
    layers: Vec<(File, RegionImage)>,
    /// Per chunk, the layer holding it (`None`: all zeros).
    holders: Vec<Option<usize>>,
    verified: Vec<AtomicBool>,
}

impl SnapshotSource {
    /// The source of region `region` (its index in the manifest) of `snapshot`.
    pub fn new(snapshot: &Snapshot, region: usize) -> Result<SnapshotSource> {
        let mut chain = vec![snapshot];
        while let Some(base) = &chain.last().expect("one").base {
            chain.push(base);
        }
        let image = &snapshot.manifest.regions[region];
        let holders = (0..image.chunks.len())
            .map(|c| {
                Ok(snapshot.holder(region, c)?.map(|h| {
                    chain
                        .iter()
                        .position(|s| std::ptr::eq(*s, h))
                        .expect("the holder is in the chain")
                }))
            })
            .collect::<Result<Vec<_>>>()?;
        let layers = chain
            .iter()
            .map(|s| {
                let image = &s.manifest.regions[region];
                let file = s
                    .file(image)
                    .try_clone()
                    .map_err(Error::io(&s.file_path(image), "dup"))?;
                Ok((file, image.clone()))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(SnapshotSource {
            dir: snapshot.dir.clone(),
            name: image.spec.name.clone(),
            size: image.spec.size,
            verified: holders
                .iter()
                .map(|h| AtomicBool::new(h.is_none()))
                .collect(),
            layers,
            holders,
        })
    }

    /// Reads chunk `index` from `layer` into `chunk` (the whole chunk) and checks it.
    fn read_checked(&self, index: usize, layer: usize, chunk: &mut [u8]) -> io::Result<()> {
        let (file, image) = &self.layers[layer];
        let offset = index as u64 * CHUNK_BYTES;
        chunk.fill(0);
        let (crc, _) = read_sparse(file, image.file_offset + offset, chunk)?;
        if crc != image.chunks[index].crc32 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "corrupt snapshot {}: region '{}' chunk {index} (offset {offset:#x}): \
                     checksum {crc:#010x}, the manifest says {:#010x}",
                    self.dir.display(),
                    self.name,
                    image.chunks[index].crc32
                ),
            ));
        }
        self.verified[index].store(true, Ordering::Release);
        Ok(())
    }
}

impl PageSource for SnapshotSource {
    /// A whole chunk (what the pager asks for by default) is read once, straight into `buf`,
    /// and checked there: the bytes served are the bytes checked. A part of a chunk is served
    /// from a checked read of the whole chunk the first time, and read from the file after
    /// that.
    fn fetch(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let end = offset + buf.len() as u64;
        if buf.is_empty() || end > self.size {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("fetch {offset:#x}+{:#x} outside the region", buf.len()),
            ));
        }
        // Chunk by chunk: each may live in another layer.
        let mut at = offset;
        while at < end {
            let index = (at / CHUNK_BYTES) as usize;
            let chunk_start = index as u64 * CHUNK_BYTES;
            let chunk_end = (chunk_start + CHUNK_BYTES).min(self.size);
            let piece_end = chunk_end.min(end);
            let piece = &mut buf[to_usize(at - offset)..to_usize(piece_end - offset)];
            match self.holders[index] {
                None => piece.fill(0),
                Some(layer) if at == chunk_start && piece_end == chunk_end => {
                    self.read_checked(index, layer, piece)?;
                }
                Some(layer) if !self.verified[index].load(Ordering::Acquire) => {
                    // The whole chunk is read into this thread's scratch buffer, kept from
                    // one fetch to the next (a fresh buffer per chunk would fault its pages
                    // in every time).
                    thread_local! {
                        static CHUNK: std::cell::RefCell<PageBuf> =
                            std::cell::RefCell::new(PageBuf::zeroed(0));
                    }
                    CHUNK.with_borrow_mut(|chunk| {
                        let len = to_usize(chunk_end - chunk_start);
                        chunk.grow_to(len);
                        self.read_checked(index, layer, &mut chunk[..len])?;
                        piece.copy_from_slice(
                            &chunk[to_usize(at - chunk_start)..to_usize(piece_end - chunk_start)],
                        );
                        io::Result::Ok(())
                    })?;
                }
                Some(layer) => {
                    let (file, image) = &self.layers[layer];
                    file.read_exact_at(piece, image.file_offset + at)?;
                }
            }
            at = piece_end;
        }
        Ok(())
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn is_zero(&self, offset: u64, len: u64) -> bool {
        let end = (offset + len).min(self.size);
        end > offset
            && (offset / CHUNK_BYTES..=(end - 1) / CHUNK_BYTES)
                .all(|c| self.holders[to_usize(c)].is_none())
    }
}

/// A flat snapshot directory as the restore engine reads it: each chunk checked against the
/// manifest's CRC-32 before any of it is copied, mapped or served.
impl SnapshotImage for Snapshot {
    fn describe(&self) -> String {
        Snapshot::describe(self)
    }

    fn config(&self) -> &VmConfig {
        &self.manifest.config
    }

    fn regions(&self) -> Vec<&RegionSpec> {
        self.manifest.regions.iter().map(|i| &i.spec).collect()
    }

    fn chunk_check(&self) -> &'static str {
        "against its CRC-32"
    }

    fn identity(&self) -> &str {
        &self.manifest.checksum
    }

    fn machine_state(&self) -> &[u8] {
        &self.machine
    }

    fn components(&self) -> &[ComponentState] {
        &self.components
    }

    fn check_mode(&self, mode: &RestoreMode) -> Result<()> {
        let Some(base) = &self.manifest.base else {
            return Ok(());
        };
        match mode {
            RestoreMode::Map => Err(Error::Layout(
                "a diff snapshot spans several memory files: restore it in full mode (or lazily)"
                    .into(),
            )),
            RestoreMode::PageServer(_) => Err(Error::Layout(format!(
                "a diff snapshot's RAM is spread over its memory file and its base's ({}): \
                 restore it in full mode, or lazily in this process",
                base.dir.display()
            ))),
            RestoreMode::Full | RestoreMode::Lazy(_) => Ok(()),
        }
    }

    fn page_source(&self, index: usize) -> Result<Arc<dyn PageSource>> {
        Ok(Arc::new(SnapshotSource::new(self, index)?))
    }

    fn copy_region(&self, memory: &GuestMemory, index: usize) -> Result<()> {
        let mut buf = PageBuf::zeroed(to_usize(CHUNK_BYTES));
        copy_chunks(self, memory, &memory.regions()[index], index, &mut buf)
    }

    fn read_region(&self, index: usize) -> Result<Vec<(u64, Vec<u8>)>> {
        let size = self.manifest.regions[index].spec.size;
        let mut buf = PageBuf::zeroed(to_usize(CHUNK_BYTES));
        let mut pieces = Vec::new();
        for i in 0..self.manifest.regions[index].chunks.len() {
            let offset = i as u64 * CHUNK_BYTES;
            let len = to_usize(CHUNK_BYTES.min(size - offset));
            let Some(ranges) = self.chunk(index, i, &mut buf[..len])? else {
                continue;
            };
            for r in ranges {
                for (start, run) in nonzero_page_runs(&buf[r.clone()]) {
                    pieces.push((offset + (r.start + start) as u64, run.to_vec()));
                }
            }
        }
        Ok(pieces)
    }

    fn map_region(&self, region: &Region, index: usize) -> Result<()> {
        let image = &self.manifest.regions[index];
        // The guest will see the file itself: every chunk of it, zero chunks included (holes,
        // or zeros), must be what the manifest says.
        let mut buf = PageBuf::zeroed(to_usize(CHUNK_BYTES));
        verify_chunks(self, image, &mut buf)?;
        map_private(region, self.file(image), image.file_offset)
            .map_err(Error::io(&self.file_path(image), "mmap"))
    }

    fn recorded_working_set(&self) -> Result<Option<Vec<WorkingSetRegion>>> {
        Ok(self.working_set()?.map(|ws| ws.regions))
    }

    fn write_working_set(&self, regions: Vec<WorkingSetRegion>) -> Result<()> {
        Snapshot::write_working_set(self, regions)
    }
}

fn verify_chunks(snapshot: &Snapshot, image: &RegionImage, buf: &mut [u8]) -> Result<()> {
    for i in 0..image.chunks.len() {
        snapshot.read_chunk_data(image, i, buf)?;
    }
    Ok(())
}

pub(crate) fn copy_chunks(
    snapshot: &Snapshot,
    memory: &GuestMemory,
    region: &Region,
    index: usize,
    buf: &mut [u8],
) -> Result<()> {
    let size = snapshot.manifest.regions[index].spec.size;
    // guest_memfd: `write()` where the fd takes it (the seeds kernel), else the mapping.
    let mut by_write = region.backend() == Backend::GuestMemfd;
    for i in 0..snapshot.manifest.regions[index].chunks.len() {
        let offset = i as u64 * CHUNK_BYTES;
        let len = to_usize(CHUNK_BYTES.min(size - offset));
        let Some(ranges) = snapshot.chunk(index, i, &mut buf[..len])? else {
            continue;
        };
        for r in ranges {
            for (start, run) in nonzero_page_runs(&buf[r.clone()]) {
                let gpa = region.gpa() + offset + (r.start + start) as u64;
                if by_write {
                    match memory.write_file(gpa, run) {
                        Ok(()) => continue,
                        Err(e) => {
                            tracing::debug!("guest_memfd write() unavailable ({e}): copying");
                            by_write = false;
                        }
                    }
                }
                memory.write(gpa, run)?;
            }
        }
    }
    Ok(())
}

/// Replaces an anonymous region's mapping, in place, by a private (copy-on-write) mapping of
/// the memory file. The memslot keeps its host address, so KVM follows the new mapping.
fn map_private(region: &Region, file: &File, file_offset: u64) -> io::Result<()> {
    // SAFETY: the range is exactly the region's own anonymous mapping, which the region owns
    // and which no vCPU has used yet (the VM was built but never run); MAP_FIXED replaces it
    // atomically with a mapping of the same length and protection, which the region unmaps on
    // drop as before. The file is at least `file_offset + size` long (checked on open).
    let addr = unsafe {
        libc::mmap(
            region.host_addr().cast::<libc::c_void>(),
            to_usize(region.size()),
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_FIXED,
            file.as_raw_fd(),
            file_offset as libc::off_t,
        )
    };
    if addr == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_machine_state_travels_as_an_opaque_blob_beside_the_components() {
        let path = Path::new("state.json");
        let components = vec![ComponentState {
            name: "rng0".into(),
            data: vec![1, 2, 0xff],
        }];
        // Any bytes: the snapshot does not read them.
        let machine = vec![0, 0x7b, 0xfe, 0x22];
        let json = serde_json::to_vec(&SavedState {
            machine: machine.clone(),
            components: components.clone(),
        })
        .unwrap();
        assert_eq!(
            std::str::from_utf8(&json).unwrap(),
            r#"{"machine":"007bfe22","components":[{"name":"rng0","data":"0102ff"}]}"#
        );
        let back = parse_saved_state(&json, path).unwrap();
        assert_eq!((back.machine, back.components), (machine, components));
        // No components: none.
        let alone = parse_saved_state(br#"{"machine":""}"#, path).unwrap();
        assert!(alone.machine.is_empty() && alone.components.is_empty());
        // A version 2 state (guestmem's VM state field by field) is not taken for one.
        let e = parse_saved_state(br#"{"vcpus":[],"clock":{},"work":[]}"#, path).err();
        assert!(matches!(e, Some(Error::Json { .. })), "{e:?}");
    }

    #[test]
    fn a_payload_state_for_another_vcpu_count_is_refused() {
        let state = serde_json::to_vec(&VmState {
            vcpus: Vec::new(),
            clock: Default::default(),
            work: Vec::new(),
        })
        .unwrap();
        assert!(parse_state(&state, 0, Path::new("s")).is_ok_and(|s| s.work.is_empty()));
        let e = parse_state(&state, 1, Path::new("s"))
            .err()
            .unwrap()
            .to_string();
        assert_eq!(
            e,
            "corrupt snapshot: s: state for 0 vCPUs (0 workloads), the configuration has 1"
        );
    }
}
