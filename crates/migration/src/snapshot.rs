//! Snapshots: a paused VM written to a directory, and VMs restored from one.
//!
//! A snapshot directory holds three files:
//! - `manifest.json`: format name and version, the VM configuration, the memory layout (each
//!   region's place in the memory file) with a CRC-32 and a zero flag per 2 MiB chunk, a digest
//!   per region, and the state file's CRC-32;
//! - `state.json`: the complete vCPU and VM state ([`VmState`]);
//! - `memory`: every region's bytes at its offset, zero pages left as holes (a sparse file);
//! - optionally `working-set.json`: the chunks a lazily restored guest faulted on first, in
//!   that order, recorded by [`LazyVm::record_working_set`] and fetched first by the next
//!   lazy restore (bound to the manifest by its CRC-32, and checksummed).
//!
//! Everything is checked before any vCPU runs: format, version, checksums, sizes, and whether
//! this host can build the layout.

use std::fs::File;
use std::io::{self, Write};
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use guestmem_memory::{Backend, GuestMemory, Region, RegionSpec, PAGE_SIZE};
use guestmem_paging::{PageSource, Pager, PagerConfig};
use guestmem_tracking::DirtyBitmap;
use guestmem_vm::{layout, Vm, VmConfig, VmState};
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The `format` field of every guestmem snapshot manifest.
pub const FORMAT: &str = "guestmem-snapshot";
/// The manifest version this code writes and reads.
pub const VERSION: u32 = 1;
/// The unit of checksums and of zero detection in the manifest.
pub const CHUNK_BYTES: u64 = 2 << 20;

const MANIFEST: &str = "manifest.json";
const STATE: &str = "state.json";
const MEMORY: &str = "memory";
const WORKING_SET: &str = "working-set.json";
/// The `format` field of a working-set file.
pub const WORKING_SET_FORMAT: &str = "guestmem-working-set";

/// What `manifest.json` holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    pub config: VmConfig,
    /// Every region of guest memory (the sys region included), in memory order.
    pub regions: Vec<RegionImage>,
    pub chunk_bytes: u64,
    pub state_bytes: u64,
    pub state_crc32: u32,
    /// Length of the memory file.
    pub memory_file_bytes: u64,
    /// A diff snapshot: the snapshot directory this one builds on (chunks marked `inherited`
    /// come from there).
    #[serde(default)]
    pub base: Option<PathBuf>,
}

/// One region in the memory file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RegionImage {
    pub spec: RegionSpec,
    pub file_offset: u64,
    /// `guestmem_memory::GuestMemory::digest` of the whole region at snapshot time.
    pub digest: u64,
    /// One entry per [`CHUNK_BYTES`] of the region (the last may be shorter).
    pub chunks: Vec<Chunk>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Chunk {
    /// CRC-32 of the chunk's bytes (zero pages included).
    pub crc32: u32,
    /// The chunk is all zeros: nothing of it is in the memory file.
    pub zero: bool,
    /// Diff snapshots: no page of the chunk was written since the base, which holds it.
    #[serde(default)]
    pub inherited: bool,
}

/// `working-set.json`: the chunks a lazily restored guest faulted on first, in fault order,
/// recorded for the next lazy restore of the same snapshot to fetch first. It is bound to the
/// snapshot by the manifest's CRC-32, and checksummed itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkingSet {
    pub format: String,
    pub version: u32,
    /// CRC-32 of the `manifest.json` it was recorded for.
    pub manifest_crc32: u32,
    pub regions: Vec<WorkingSetRegion>,
    /// CRC-32 over every region's name and chunk offsets (see `WorkingSet::checksum`).
    pub crc32: u32,
}

/// One region's working set: region offsets of chunks, in the order the guest asked for them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkingSetRegion {
    pub name: String,
    pub chunks: Vec<u64>,
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

/// How much a snapshot wrote.
#[derive(Debug, Clone, Serialize)]
pub struct WriteReport {
    pub memory_bytes: u64,
    /// Bytes of memory actually stored (non-zero pages).
    pub data_bytes: u64,
    pub zero_chunks: u64,
    pub chunks: u64,
}

/// Writes a snapshot of `vm`, which is not running (a [`guestmem_vm::RunningVm`] borrows it
/// mutably, so holding `&Vm` proves it is paused or stopped), into `dir` (created if needed;
/// an existing snapshot there is replaced).
pub fn write(vm: &Vm, dir: &Path) -> Result<WriteReport> {
    write_snapshot(vm, dir, None)
}

/// Writes a diff snapshot of `vm` over the snapshot in `base`: only the chunks holding a page
/// that `dirty` reports (a [`guestmem_tracking::Tracker`] started when `base` was taken) are
/// stored; the others are inherited from `base`. Restoring it needs `base` (in full mode).
pub fn write_diff(vm: &Vm, dir: &Path, base: &Path, dirty: &[DirtyBitmap]) -> Result<WriteReport> {
    let base_snapshot = Snapshot::open(base)?;
    if base_snapshot.manifest.config != *vm.config() {
        return Err(Error::Layout(format!(
            "{}: the base snapshot is of another VM configuration",
            base.display()
        )));
    }
    let base = std::fs::canonicalize(base).map_err(Error::io(base, "resolve"))?;
    write_snapshot(vm, dir, Some((&base, dirty)))
}

fn write_snapshot(
    vm: &Vm,
    dir: &Path,
    diff: Option<(&Path, &[DirtyBitmap])>,
) -> Result<WriteReport> {
    std::fs::create_dir_all(dir).map_err(Error::io(dir, "create directory"))?;
    // A working set recorded for the snapshot being replaced says nothing about this one.
    match std::fs::remove_file(dir.join(WORKING_SET)) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            return Err(Error::io(&dir.join(WORKING_SET), "remove")(e))
        }
        _ => {}
    }
    let state = vm.save_state()?;
    let state_json = serde_json::to_vec(&state).map_err(|e| Error::Json {
        path: dir.join(STATE),
        source: e,
    })?;
    write_file(&dir.join(STATE), &state_json)?;

    let memory_path = dir.join(MEMORY);
    let file = File::create(&memory_path).map_err(Error::io(&memory_path, "create"))?;
    let mut report = WriteReport {
        memory_bytes: 0,
        data_bytes: 0,
        zero_chunks: 0,
        chunks: 0,
    };
    let mut regions = Vec::new();
    let mut file_offset = 0;
    let mut buf = vec![0u8; CHUNK_BYTES as usize];
    for region in vm.memory().regions() {
        let mut chunks = Vec::new();
        for offset in (0..region.size()).step_by(CHUNK_BYTES as usize) {
            let len = CHUNK_BYTES.min(region.size() - offset) as usize;
            if let Some((_, dirty)) = diff {
                let (first, last) = (region.gpa() + offset, region.gpa() + offset + len as u64);
                let written = dirty.iter().any(|d| {
                    (first..last)
                        .step_by(PAGE_SIZE as usize)
                        .any(|gpa| d.contains(gpa))
                });
                if !written {
                    chunks.push(Chunk {
                        crc32: 0,
                        zero: false,
                        inherited: true,
                    });
                    continue;
                }
            }
            let bytes = &mut buf[..len];
            vm.memory().read(region.gpa() + offset, bytes)?;
            let mut zero = true;
            for (run_start, run) in nonzero_page_runs(bytes) {
                zero = false;
                file.write_all_at(run, file_offset + offset + run_start as u64)
                    .map_err(Error::io(&memory_path, "write"))?;
                report.data_bytes += run.len() as u64;
            }
            report.zero_chunks += zero as u64;
            chunks.push(Chunk {
                crc32: crc32fast::hash(bytes),
                zero,
                inherited: false,
            });
        }
        report.chunks += chunks.len() as u64;
        report.memory_bytes += region.size();
        regions.push(RegionImage {
            spec: region.spec().clone(),
            file_offset,
            digest: vm.memory().digest(region.gpa(), region.size())?,
            chunks,
        });
        file_offset += region.size().next_multiple_of(CHUNK_BYTES);
    }
    file.set_len(file_offset)
        .map_err(Error::io(&memory_path, "set length"))?;
    file.sync_all().map_err(Error::io(&memory_path, "sync"))?;

    let manifest = Manifest {
        format: FORMAT.into(),
        version: VERSION,
        config: vm.config().clone(),
        regions,
        chunk_bytes: CHUNK_BYTES,
        state_bytes: state_json.len() as u64,
        state_crc32: crc32fast::hash(&state_json),
        memory_file_bytes: file_offset,
        base: diff.map(|(base, _)| base.to_path_buf()),
    };
    let json = serde_json::to_vec_pretty(&manifest).map_err(|e| Error::Json {
        path: dir.join(MANIFEST),
        source: e,
    })?;
    // The manifest goes last, and whole: a snapshot without one is no snapshot.
    let tmp = dir.join(format!("{MANIFEST}.tmp"));
    write_file(&tmp, &json)?;
    std::fs::rename(&tmp, dir.join(MANIFEST)).map_err(Error::io(dir, "rename manifest"))?;
    Ok(report)
}

/// A snapshot whose manifest and state have been read and checked.
pub struct Snapshot {
    dir: PathBuf,
    manifest: Manifest,
    /// CRC-32 of `manifest.json` as read (binds a working set to this snapshot).
    manifest_crc32: u32,
    state: VmState,
    memory: File,
    /// A diff snapshot's base, opened and checked with it.
    base: Option<Box<Snapshot>>,
}

impl Snapshot {
    /// Reads and checks `dir`: format, version, state checksum, memory file length.
    pub fn open(dir: &Path) -> Result<Snapshot> {
        let manifest_path = dir.join(MANIFEST);
        let bytes = std::fs::read(&manifest_path).map_err(Error::io(&manifest_path, "read"))?;
        // One parse in the usual case (the chunk list grows with the memory size). When it
        // fails, the format and version are looked at alone, so that another version's layout
        // is reported as such rather than as a parse error.
        #[derive(Deserialize)]
        struct Head {
            format: Option<serde_json::Value>,
            version: Option<serde_json::Value>,
        }
        let parsed: std::result::Result<Manifest, _> = serde_json::from_slice(&bytes);
        let head = match &parsed {
            Ok(m) => Head {
                format: Some(m.format.clone().into()),
                version: Some(m.version.into()),
            },
            Err(_) => serde_json::from_slice(&bytes).map_err(|e| Error::Json {
                path: manifest_path.clone(),
                source: e,
            })?,
        };
        if head.format.as_ref().and_then(|f| f.as_str()) != Some(FORMAT) {
            return Err(Error::NotASnapshot {
                path: manifest_path,
                found: head
                    .format
                    .map(|f| f.to_string())
                    .unwrap_or_else(|| "none".into()),
            });
        }
        let version = head.version.and_then(|v| v.as_u64()).unwrap_or(0);
        if version != u64::from(VERSION) {
            return Err(Error::Version {
                path: manifest_path,
                found: version,
                supported: VERSION,
            });
        }
        let manifest = parsed.map_err(|e| Error::Json {
            path: manifest_path.clone(),
            source: e,
        })?;
        if manifest.chunk_bytes != CHUNK_BYTES {
            return Err(Error::Corrupt(format!(
                "{}: chunk size {} is not {CHUNK_BYTES}",
                manifest_path.display(),
                manifest.chunk_bytes
            )));
        }

        let state_path = dir.join(STATE);
        let state_json = std::fs::read(&state_path).map_err(Error::io(&state_path, "read"))?;
        if state_json.len() as u64 != manifest.state_bytes {
            return Err(Error::Truncated {
                path: state_path,
                expected: manifest.state_bytes,
                found: state_json.len() as u64,
            });
        }
        let crc = crc32fast::hash(&state_json);
        if crc != manifest.state_crc32 {
            return Err(Error::Corrupt(format!(
                "{}: checksum {crc:#010x}, the manifest says {:#010x}",
                state_path.display(),
                manifest.state_crc32
            )));
        }
        let state: VmState = serde_json::from_slice(&state_json).map_err(|e| Error::Json {
            path: state_path,
            source: e,
        })?;

        let memory_path = dir.join(MEMORY);
        let memory = File::open(&memory_path).map_err(Error::io(&memory_path, "open"))?;
        let len = memory
            .metadata()
            .map_err(Error::io(&memory_path, "stat"))?
            .len();
        if len != manifest.memory_file_bytes {
            return Err(Error::Truncated {
                path: memory_path,
                expected: manifest.memory_file_bytes,
                found: len,
            });
        }
        let base = match &manifest.base {
            None => None,
            Some(path) => {
                let base = Snapshot::open(path)?;
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
                        path.display()
                    )));
                }
                Some(Box::new(base))
            }
        };
        Ok(Snapshot {
            dir: dir.to_path_buf(),
            manifest_crc32: crc32fast::hash(&bytes),
            manifest,
            state,
            memory,
            base,
        })
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

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The snapshot's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The working set recorded beside the snapshot by an earlier lazy restore, if any. One
    /// recorded for another snapshot (the manifest's checksum differs), with a bad checksum,
    /// or naming chunks the snapshot does not have is refused with the reason.
    pub fn working_set(&self) -> Result<Option<WorkingSet>> {
        let path = self.dir.join(WORKING_SET);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io(&path, "read")(e)),
        };
        let ws: WorkingSet = serde_json::from_slice(&bytes).map_err(|e| Error::Json {
            path: path.clone(),
            source: e,
        })?;
        let bad = |why: String| Err(Error::Corrupt(format!("{}: {why}", path.display())));
        if ws.format != WORKING_SET_FORMAT || ws.version != VERSION {
            return bad(format!(
                "format {} version {}, not {WORKING_SET_FORMAT} version {VERSION}",
                ws.format, ws.version
            ));
        }
        if ws.manifest_crc32 != self.manifest_crc32 {
            return bad(format!(
                "recorded for another snapshot (manifest checksum {:#010x}, this one's is \
                 {:#010x}); delete it",
                ws.manifest_crc32, self.manifest_crc32
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
    fn write_working_set(&self, regions: Vec<WorkingSetRegion>) -> Result<()> {
        let ws = WorkingSet {
            format: WORKING_SET_FORMAT.into(),
            version: VERSION,
            manifest_crc32: self.manifest_crc32,
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

    pub fn state(&self) -> &VmState {
        &self.state
    }

    /// Reads chunk `index` of region image `image` into `buf` and checks its CRC-32.
    pub fn read_chunk(&self, image: &RegionImage, index: usize, buf: &mut [u8]) -> Result<()> {
        let offset = index as u64 * CHUNK_BYTES;
        let len = CHUNK_BYTES.min(image.spec.size - offset) as usize;
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
        let len = CHUNK_BYTES.min(image.spec.size - offset) as usize;
        let (crc, ranges) = read_sparse(&self.memory, image.file_offset + offset, &mut buf[..len])
            .map_err(Error::io(&self.dir.join(MEMORY), "read"))?;
        if crc != image.chunks[index].crc32 {
            return Err(Error::Corrupt(format!(
                "region '{}' chunk at offset {offset:#x}: checksum {crc:#010x}, the manifest \
                 says {:#010x}",
                image.spec.name, image.chunks[index].crc32
            )));
        }
        Ok(ranges)
    }
}

/// Reads `buf.len()` bytes of `file` at `at`, but only its data extents (`SEEK_DATA` /
/// `SEEK_HOLE`, rounded out to whole pages), into `buf` at their offsets; returns the CRC-32 of
/// the whole range (holes count as zeros, without hashing them) and the ranges of `buf` read.
/// On file systems without hole reporting the whole range is one extent.
fn read_sparse(file: &File, at: u64, buf: &mut [u8]) -> io::Result<(u32, Vec<Range<usize>>)> {
    let end = at + buf.len() as u64;
    let page = PAGE_SIZE;
    let mut ranges: Vec<Range<usize>> = Vec::new();
    let mut pos = at;
    while pos < end {
        // SAFETY: lseek on an fd we hold; it only reports offsets (reads use pread).
        let data = unsafe { libc::lseek(file.as_raw_fd(), pos as libc::off_t, libc::SEEK_DATA) };
        if data < 0 {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::ENXIO) => break, // only a hole from `pos` on
                Some(libc::EINVAL) => {
                    // No hole reporting here: read everything.
                    ranges.clear();
                    ranges.push(0..buf.len());
                    break;
                }
                _ => return Err(e),
            }
        }
        let data = data as u64;
        if data >= end {
            break;
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(file.as_raw_fd(), data as libc::off_t, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(io::Error::last_os_error());
        }
        let lo = ((data - at) / page * page) as usize;
        let hi = ((hole as u64).min(end) - at)
            .next_multiple_of(page)
            .min(buf.len() as u64) as usize;
        match ranges.last_mut() {
            Some(last) if last.end >= lo => last.end = last.end.max(hi),
            _ => ranges.push(lo..hi),
        }
        pos = hole as u64;
    }
    let mut hasher = crc32fast::Hasher::new();
    let mut done = 0usize;
    for r in &ranges {
        file.read_exact_at(&mut buf[r.clone()], at + r.start as u64)?;
        hasher.combine(&zeros_hasher((r.start - done) as u64));
        hasher.update(&buf[r.clone()]);
        done = r.end;
    }
    hasher.combine(&zeros_hasher((buf.len() - done) as u64));
    Ok((hasher.finalize(), ranges))
}

/// A CRC-32 state over `len` zero bytes, combined from powers of two (O(log len)) instead of
/// hashing the zeros.
fn zeros_hasher(len: u64) -> crc32fast::Hasher {
    static POWERS: OnceLock<Vec<crc32fast::Hasher>> = OnceLock::new();
    let powers = POWERS.get_or_init(|| {
        let mut page = crc32fast::Hasher::new();
        page.update(&[0u8; PAGE_SIZE as usize]);
        let mut powers = vec![page];
        for _ in 1..40 {
            let mut next = powers.last().expect("one").clone();
            next.combine(&next.clone());
            powers.push(next);
        }
        powers
    });
    let mut h = crc32fast::Hasher::new();
    let pages = len / PAGE_SIZE;
    for (k, power) in powers.iter().enumerate() {
        if pages >> k & 1 == 1 {
            h.combine(power);
        }
    }
    let rest = (len % PAGE_SIZE) as usize;
    if rest > 0 {
        let mut tail = crc32fast::Hasher::new();
        tail.update(&[0u8; PAGE_SIZE as usize][..rest]);
        h.combine(&tail);
    }
    h
}

/// How to bring a snapshot's memory back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RestoreMode {
    /// Copy every non-zero page into fresh memory, then run.
    Full,
    /// Map the memory file privately (copy-on-write) over anonymous regions; other backends
    /// are copied as in `Full`.
    Map,
}

/// Builds a VM from `snapshot` with its memory and vCPU state; the caller resumes it. Every
/// check happens before this returns, so a refused snapshot never runs a vCPU.
pub fn restore(snapshot: &Snapshot, mode: RestoreMode) -> Result<Vm> {
    let manifest = &snapshot.manifest;
    if mode == RestoreMode::Map && snapshot.base.is_some() {
        return Err(Error::Layout(
            "a diff snapshot spans several memory files: restore it in full mode (or lazily)"
                .into(),
        ));
    }
    let mut vm = Vm::new(&manifest.config)?;
    check_layout(vm.memory(), &manifest.regions)?;
    let mut buf = vec![0u8; CHUNK_BYTES as usize];
    for (i, (region, image)) in vm
        .memory()
        .regions()
        .iter()
        .zip(&manifest.regions)
        .enumerate()
    {
        if mode == RestoreMode::Map && region.backend() == Backend::Anon {
            verify_chunks(snapshot, image, &mut buf)?;
            map_private(region, &snapshot.memory, image.file_offset)
                .map_err(Error::io(&snapshot.dir.join(MEMORY), "mmap"))?;
        } else {
            copy_chunks(snapshot, vm.memory(), region, i, &mut buf)?;
        }
    }
    vm.restore_state(&snapshot.state)?;
    Ok(vm)
}

/// A VM restored lazily: its vCPUs can run at once while its pagers bring the memory in, on
/// first access and in the background. The pagers are dropped (and their threads joined) before
/// the VM and its memory, as the field order says.
pub struct LazyVm {
    pub pagers: Vec<Pager>,
    pub vm: Vm,
    /// Where the restore spent its time, step by step (the VM's build steps included).
    pub phases: Vec<(String, Duration)>,
    /// Whether the pagers fetch a recorded working set first.
    pub prefetched: bool,
}

/// Builds a VM from `snapshot` whose memory arrives on demand: every guest RAM region gets a
/// [`Pager`] that serves its pages from the memory file, checking each chunk's CRC-32 the first
/// time any of it is fetched (a corrupt chunk stops the VM with an error naming the guest
/// address). The sys region (page tables, payload, control blocks) is small and copied at once.
/// Backends userfaultfd cannot serve (guest_memfd) are refused, naming the kernel feature.
/// A diff snapshot's chunks come from the diff where it holds them, else from its base chain.
/// When the snapshot has a recorded working set ([`LazyVm::record_working_set`]) and
/// `config.prefetch` is empty, the pagers fetch that working set first.
pub fn restore_lazy(snapshot: &Snapshot, config: &PagerConfig) -> Result<LazyVm> {
    let mut phases = Vec::new();
    let mut vm = vm_for_lazy_restore(snapshot, &mut phases)?;
    let mut t = Instant::now();
    let working_set = if config.prefetch.is_empty() {
        snapshot.working_set()?
    } else {
        None
    };
    lap(&mut phases, &mut t, "read the working set");
    let mut pagers = Vec::new();
    for (i, (region, image)) in vm
        .memory()
        .regions()
        .iter()
        .zip(&snapshot.manifest.regions)
        .enumerate()
    {
        if region.gpa() == layout::SYS_GPA {
            continue;
        }
        let source = SnapshotSource::new(snapshot, i)?;
        let mut config = PagerConfig {
            abort: Some(vm.abort_handle()),
            // The restored vCPUs wait on their faults from the first instruction on.
            realtime_handlers: true,
            ..config.clone()
        };
        if let Some(ws) = &working_set {
            config.prefetch = ws.offsets(&image.spec.name);
        }
        pagers.push(Pager::start(region, Arc::new(source), &config)?);
    }
    lap(&mut phases, &mut t, "start pagers");
    vm.restore_state(&snapshot.state)?;
    lap(&mut phases, &mut t, "restore vCPU state");
    Ok(LazyVm {
        pagers,
        vm,
        phases,
        prefetched: working_set.is_some(),
    })
}

impl LazyVm {
    /// Writes the chunks the guest faulted on since the restore, in fault order, beside
    /// `snapshot` (see [`Snapshot::working_set`]), for the next lazy restore to fetch first.
    /// Returns how many chunks it lists.
    pub fn record_working_set(&self, snapshot: &Snapshot) -> Result<usize> {
        record_working_set(snapshot, &self.vm, &self.pagers)
    }
}

/// [`LazyVm::record_working_set`] for a lazy restore taken apart (`pagers` in the order
/// [`restore_lazy`] made them).
pub fn record_working_set(snapshot: &Snapshot, vm: &Vm, pagers: &[Pager]) -> Result<usize> {
    let regions: Vec<WorkingSetRegion> = vm
        .memory()
        .regions()
        .iter()
        .filter(|r| r.gpa() != layout::SYS_GPA)
        .zip(pagers)
        .map(|(region, pager)| WorkingSetRegion {
            name: region.name().to_string(),
            chunks: pager.fault_order(),
        })
        .collect();
    let n = regions.iter().map(|r| r.chunks.len()).sum();
    snapshot.write_working_set(regions)?;
    Ok(n)
}

/// Records the step `name` as ending now.
fn lap(phases: &mut Vec<(String, Duration)>, t: &mut Instant, name: &str) {
    let now = Instant::now();
    phases.push((name.to_string(), now - *t));
    *t = now;
}

/// The first steps of every lazy restore: build the VM, check its layout, and copy in the sys region (page tables, payload,
/// control blocks: small, and needed at once). The guest RAM regions are left to a pager.
pub(crate) fn vm_for_lazy_restore(
    snapshot: &Snapshot,
    phases: &mut Vec<(String, Duration)>,
) -> Result<Vm> {
    let vm = Vm::new(&snapshot.manifest.config)?;
    phases.extend(
        vm.build_phases()
            .iter()
            .map(|(name, d)| (format!("Vm::new: {name}"), *d)),
    );
    let mut t = Instant::now();
    check_layout(vm.memory(), &snapshot.manifest.regions)?;
    let mut buf = vec![0u8; CHUNK_BYTES as usize];
    for (i, region) in vm.memory().regions().iter().enumerate() {
        if region.gpa() == layout::SYS_GPA {
            copy_chunks(snapshot, vm.memory(), region, i, &mut buf)?;
        }
    }
    lap(phases, &mut t, "copy the sys region");
    Ok(vm)
}

/// The guest RAM regions of a VM built by [`vm_for_lazy_restore`], with their images.
pub(crate) fn lazy_regions<'a>(
    vm: &'a Vm,
    snapshot: &'a Snapshot,
) -> impl Iterator<Item = (&'a Region, &'a RegionImage)> {
    vm.memory()
        .regions()
        .iter()
        .zip(&snapshot.manifest.regions)
        .filter(|(region, _)| region.gpa() != layout::SYS_GPA)
        .map(|(region, image)| (&**region, image))
}

/// One region's bytes in a snapshot's memory file (and, for a diff snapshot, its bases'),
/// each chunk checked against its CRC-32 before any of it is served.
pub(crate) struct SnapshotSource {
    name: String,
    size: u64,
    /// The memory files of the snapshot and its bases, each with its image of the region.
    layers: Vec<(File, RegionImage)>,
    /// Per chunk, the layer holding it (`None`: all zeros).
    holders: Vec<Option<usize>>,
    verified: Vec<AtomicBool>,
}

impl SnapshotSource {
    pub(crate) fn new(snapshot: &Snapshot, region: usize) -> Result<SnapshotSource> {
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
                let file = s
                    .memory
                    .try_clone()
                    .map_err(Error::io(&s.dir.join(MEMORY), "dup"))?;
                Ok((file, s.manifest.regions[region].clone()))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(SnapshotSource {
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

    fn verify(&self, index: usize, layer: usize) -> io::Result<()> {
        if self.verified[index].load(Ordering::Acquire) {
            return Ok(());
        }
        let (file, image) = &self.layers[layer];
        let offset = index as u64 * CHUNK_BYTES;
        let mut chunk = vec![0u8; CHUNK_BYTES.min(self.size - offset) as usize];
        let (crc, _) = read_sparse(file, image.file_offset + offset, &mut chunk)?;
        if crc != image.chunks[index].crc32 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "corrupt snapshot: region '{}' chunk at offset {offset:#x}: checksum \
                     {crc:#010x}, the manifest says {:#010x}",
                    self.name, image.chunks[index].crc32
                ),
            ));
        }
        self.verified[index].store(true, Ordering::Release);
        Ok(())
    }
}

impl PageSource for SnapshotSource {
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
            let piece_end = ((index as u64 + 1) * CHUNK_BYTES).min(end);
            let piece = &mut buf[(at - offset) as usize..(piece_end - offset) as usize];
            match self.holders[index] {
                None => piece.fill(0),
                Some(layer) => {
                    self.verify(index, layer)?;
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
                .all(|c| self.holders[c as usize].is_none())
    }
}

pub(crate) fn check_layout(memory: &GuestMemory, images: &[RegionImage]) -> Result<()> {
    let built: Vec<&RegionSpec> = memory.regions().iter().map(|r| r.spec()).collect();
    let saved: Vec<&RegionSpec> = images.iter().map(|i| &i.spec).collect();
    if built != saved {
        return Err(Error::Layout(format!(
            "the snapshot's regions {saved:?} differ from those its configuration builds here \
             {built:?}"
        )));
    }
    Ok(())
}

fn verify_chunks(snapshot: &Snapshot, image: &RegionImage, buf: &mut [u8]) -> Result<()> {
    for (i, chunk) in image.chunks.iter().enumerate() {
        if !chunk.zero {
            snapshot.read_chunk_data(image, i, buf)?;
        }
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
    for i in 0..snapshot.manifest.regions[index].chunks.len() {
        let offset = i as u64 * CHUNK_BYTES;
        let len = CHUNK_BYTES.min(size - offset) as usize;
        let Some(ranges) = snapshot.chunk(index, i, &mut buf[..len])? else {
            continue;
        };
        for r in ranges {
            for (start, run) in nonzero_page_runs(&buf[r.clone()]) {
                memory.write(region.gpa() + offset + (r.start + start) as u64, run)?;
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
            region.host_addr() as *mut libc::c_void,
            region.size() as usize,
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

/// Whether `bytes` are all zero (16 bytes at a time, which the compiler vectorizes).
fn is_zero(bytes: &[u8]) -> bool {
    let mut words = bytes.chunks_exact(16);
    let mut acc = 0u128;
    for w in &mut words {
        acc |= u128::from_ne_bytes(w.try_into().expect("16 bytes"));
    }
    acc == 0 && words.remainder().iter().all(|&b| b == 0)
}

/// The runs of consecutive non-zero pages in `bytes`, as (offset, bytes).
fn nonzero_page_runs(bytes: &[u8]) -> impl Iterator<Item = (usize, &[u8])> {
    let page = PAGE_SIZE as usize;
    let pages = bytes.len().div_ceil(page);
    let is_zero = move |p: usize| is_zero(&bytes[p * page..((p + 1) * page).min(bytes.len())]);
    let mut p = 0;
    std::iter::from_fn(move || {
        while p < pages && is_zero(p) {
            p += 1;
        }
        if p == pages {
            return None;
        }
        let start = p;
        while p < pages && !is_zero(p) {
            p += 1;
        }
        let end = (p * page).min(bytes.len());
        Some((start * page, &bytes[start * page..end]))
    })
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(path).map_err(Error::io(path, "create"))?;
    f.write_all(bytes).map_err(Error::io(path, "write"))?;
    f.sync_all().map_err(Error::io(path, "sync"))
}

#[cfg(test)]
mod tests {
    use super::{nonzero_page_runs, read_sparse, zeros_hasher};
    use std::os::unix::fs::FileExt;

    #[test]
    fn zero_runs_hash_like_zeros() {
        for len in [0u64, 4096, 3 * 4096, 2 << 20, (2 << 20) + 4096 + 100] {
            assert_eq!(
                zeros_hasher(len).finalize(),
                crc32fast::hash(&vec![0u8; len as usize]),
                "{len} zero bytes"
            );
        }
    }

    /// A sparse file read by extents gives the bytes and the CRC-32 of a plain read.
    #[test]
    fn sparse_reads_match_plain_reads() {
        let path = std::env::temp_dir().join(format!("guestmem-sparse-{}", std::process::id()));
        let file = std::fs::File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        let _ = std::fs::remove_file(&path);
        let len = 4u64 << 20;
        file.set_len(len + (1 << 20)).unwrap();
        file.write_all_at(&[7u8; 5000], 4096 * 3).unwrap();
        file.write_all_at(&[9u8; 4096], (2 << 20) + 4096 * 100)
            .unwrap();
        file.write_all_at(&[1u8; 10], len - 10).unwrap();
        let mut plain = vec![0u8; len as usize];
        file.read_exact_at(&mut plain, 0).unwrap();
        let mut sparse = vec![0u8; len as usize];
        let (crc, ranges) = read_sparse(&file, 0, &mut sparse).unwrap();
        assert_eq!(crc, crc32fast::hash(&plain));
        assert_eq!(sparse, plain);
        assert!(
            ranges.iter().map(|r| r.len()).sum::<usize>() < (1 << 20),
            "holes are not read: {ranges:?}"
        );
        // From an offset inside a hole, to the end of the file (a hole).
        let mut tail = vec![0u8; 1 << 20];
        let (crc, _) = read_sparse(&file, len, &mut tail).unwrap();
        assert_eq!(crc, crc32fast::hash(&[0u8; 1 << 20]));
    }

    #[test]
    fn runs_skip_zero_pages() {
        let mut b = vec![0u8; 5 * 4096];
        b[4096] = 1;
        b[2 * 4096 + 17] = 2;
        b[4 * 4096 + 4095] = 3;
        let runs: Vec<(usize, usize)> = nonzero_page_runs(&b).map(|(o, r)| (o, r.len())).collect();
        assert_eq!(runs, vec![(4096, 2 * 4096), (4 * 4096, 4096)]);
        assert_eq!(nonzero_page_runs(&[0u8; 8192]).count(), 0);
    }
}
