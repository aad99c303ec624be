//! Writing a snapshot, all or nothing.
//!
//! A snapshot is written whole into a new directory beside its destination (same file system)
//! and becomes visible in one step: `renameat2(RENAME_EXCHANGE)` swaps it with the snapshot it
//! replaces (or a plain rename when there is none), and only then is the old one deleted. A
//! write that fails on the way (a full disk, an I/O error, a VM that cannot be read) deletes its
//! new directory and leaves the previous snapshot where it was, intact and restorable; a
//! process killed mid-write leaves at most a hidden `.NAME.guestmem-new-*` directory, never a
//! manifest that looks complete.

use std::ffi::CString;
use std::fs::File;
use std::io::{self, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use guestmem_memory::{GuestMemory, PageBuf};
use guestmem_sys::to_usize;
use guestmem_tracking::{any_dirty, DirtyBitmap};
use guestmem_vm::{Vm, VmConfig};
use serde::Serialize;

use super::manifest::{
    BaseRef, Chunk, Manifest, RegionFile, RegionImage, CHUNK_BYTES, FORMAT, VERSION,
};
use super::sparse::nonzero_page_runs;
use super::{SavedState, Snapshot, MANIFEST, STATE, WORKING_SET};
use crate::{Error, Result};
use guestmem_contract::component::{ComponentState, Machine};

/// The files a snapshot directory may hold; a directory holding anything else is not
/// replaced (it is not a snapshot, and replacing it would delete someone's files).
const SNAPSHOT_FILES: [&str; 5] = [MANIFEST, STATE, "memory", "sys", WORKING_SET];

/// How much a snapshot wrote.
#[derive(Debug, Clone, Serialize)]
pub struct WriteReport {
    /// Bytes of guest memory the snapshot covers.
    pub memory_bytes: u64,
    /// Bytes of memory actually stored (non-zero pages).
    pub data_bytes: u64,
    /// Chunks that were all zeros (holes).
    pub zero_chunks: u64,
    /// Chunks in all.
    pub chunks: u64,
}

/// A VM as a snapshot takes it: its configuration, its guest memory, and its state as its
/// machine saved it.
struct SavedVm<'a> {
    config: &'a VmConfig,
    memory: &'a GuestMemory,
    state: Vec<u8>,
}

impl<'a> SavedVm<'a> {
    /// guestmem's own VM, not running.
    fn vm(vm: &'a Vm) -> Result<SavedVm<'a>> {
        Ok(SavedVm {
            config: vm.config(),
            memory: vm.memory(),
            state: guestmem_contract::payload_state(vm)?,
        })
    }

    /// Any VMM's VM, paused: its [`Machine::save`] gives the state.
    fn machine<M: Machine + ?Sized>(machine: &'a mut M) -> Result<SavedVm<'a>> {
        let state = machine.save()?;
        let machine: &'a M = machine;
        Ok(SavedVm {
            config: machine.config(),
            memory: machine.memory(),
            state,
        })
    }
}

/// Writes a snapshot of `vm`, which is not running (a [`guestmem_vm::RunningVm`] borrows it
/// mutably, so holding `&Vm` proves it is paused or stopped), into `dir`. An existing snapshot
/// there is replaced atomically (see the module docs); a directory holding other files is
/// refused.
pub fn write(vm: &Vm, dir: &Path) -> Result<WriteReport> {
    write_snapshot(SavedVm::vm(vm)?, dir, None, &[])
}

/// [`write()`] with the states of the VM's components beside the VM's (in `state.json`), for
/// [`super::Snapshot::components`] to hand back on restore.
pub fn write_with_components(
    vm: &Vm,
    dir: &Path,
    components: &[ComponentState],
) -> Result<WriteReport> {
    write_snapshot(SavedVm::vm(vm)?, dir, None, components)
}

/// Writes a snapshot of `machine` (any VMM's VM, paused: its state is what
/// [`Machine::save`] gives) and its `components`' states into `dir`, as [`write()`] does.
pub fn write_machine<M: Machine + ?Sized>(
    machine: &mut M,
    dir: &Path,
    components: &[ComponentState],
) -> Result<WriteReport> {
    write_snapshot(SavedVm::machine(machine)?, dir, None, components)
}

/// Writes a diff snapshot of `vm` over the snapshot in `base`: only the chunks holding a page
/// that `dirty` reports (a [`guestmem_tracking::Tracker`] started when `base` was taken) are
/// stored; the others are inherited from `base`, which the diff names by path and by its
/// manifest's checksum (a base replaced since is refused on restore).
pub fn write_diff(vm: &Vm, dir: &Path, base: &Path, dirty: &[DirtyBitmap]) -> Result<WriteReport> {
    let saved = SavedVm::vm(vm)?;
    let base = base_ref(saved.config, dir, base)?;
    write_snapshot(saved, dir, Some((base, dirty)), &[])
}

/// [`write_diff`] of `machine` (paused) and its `components`' states.
pub fn write_machine_diff<M: Machine + ?Sized>(
    machine: &mut M,
    dir: &Path,
    base: &Path,
    dirty: &[DirtyBitmap],
    components: &[ComponentState],
) -> Result<WriteReport> {
    let saved = SavedVm::machine(machine)?;
    let base = base_ref(saved.config, dir, base)?;
    write_snapshot(saved, dir, Some((base, dirty)), components)
}

/// How a diff of a VM of `config` written into `dir` names its `base`, which must be of the
/// same configuration and not `dir` itself.
pub(super) fn base_ref(config: &VmConfig, dir: &Path, base: &Path) -> Result<BaseRef> {
    let base_snapshot = Snapshot::open(base)?;
    if base_snapshot.manifest.config != *config {
        return Err(Error::Write(format!(
            "{}: the base snapshot is of another VM configuration",
            base.display()
        )));
    }
    let base_dir = std::fs::canonicalize(base).map_err(Error::io(base, "resolve"))?;
    if std::fs::canonicalize(dir).is_ok_and(|d| d == base_dir) {
        return Err(Error::Write(format!(
            "{}: a diff cannot replace its own base",
            dir.display()
        )));
    }
    Ok(BaseRef {
        dir: base_dir,
        checksum: base_snapshot.manifest.checksum.clone(),
    })
}

fn write_snapshot(
    saved: SavedVm<'_>,
    dir: &Path,
    diff: Option<(BaseRef, &[DirtyBitmap])>,
    components: &[ComponentState],
) -> Result<WriteReport> {
    // A symlink to a snapshot directory: replace the directory it names, not the link.
    let resolved = std::fs::canonicalize(dir).ok();
    let dir = resolved.as_deref().unwrap_or(dir);
    check_replaceable(dir)?;
    let staging = staging_dir(dir)?;
    std::fs::create_dir(&staging).map_err(Error::io(&staging, "create directory"))?;
    let written = write_files(saved, &staging, diff, components).and_then(|report| {
        sync_dir(&staging)?;
        commit(&staging, dir)?;
        Ok(report)
    });
    if written.is_err() {
        // Nothing of the failed write stays; the previous snapshot (if any) is untouched.
        let _ = std::fs::remove_dir_all(&staging);
    }
    written
}

/// Refuses to replace `dir` when it is not a directory or holds anything but snapshot files.
pub(super) fn check_replaceable(dir: &Path) -> Result<()> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io(dir, "read directory")(e)),
    };
    for entry in entries {
        let entry = entry.map_err(Error::io(dir, "read directory"))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if !SNAPSHOT_FILES.contains(&name.as_ref()) && !name.ends_with(".tmp") {
            return Err(Error::Write(format!(
                "{}: holds '{name}', which is not part of a snapshot; write the snapshot into \
                 a new or empty directory (an existing snapshot there is replaced, nothing \
                 else)",
                dir.display()
            )));
        }
    }
    Ok(())
}

/// A fresh hidden directory beside `dir` (the same file system, so the commit is a rename).
pub(super) fn staging_dir(dir: &Path) -> Result<PathBuf> {
    let name = dir.file_name().ok_or_else(|| {
        Error::Write(format!(
            "{}: not a directory name a snapshot can be written to",
            dir.display()
        ))
    })?;
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).map_err(Error::io(&parent, "create directory"))?;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    Ok(parent.join(format!(
        ".{}.guestmem-new-{}-{nanos:x}",
        name.to_string_lossy(),
        std::process::id()
    )))
}

/// Makes `staging` the snapshot at `dir` in one step, then deletes what was there.
pub(super) fn commit(staging: &Path, dir: &Path) -> Result<()> {
    let c = |p: &Path| CString::new(p.as_os_str().as_bytes()).expect("paths have no NUL");
    let (from, to) = (c(staging), c(dir));
    if dir.exists() {
        // SAFETY: two NUL-terminated paths that live across the call; renameat2 only reads them.
        let r = unsafe {
            libc::renameat2(
                libc::AT_FDCWD,
                from.as_ptr(),
                libc::AT_FDCWD,
                to.as_ptr(),
                libc::RENAME_EXCHANGE,
            )
        };
        if r != 0 {
            return Err(Error::io(
                dir,
                "swap in the new snapshot (renameat2 RENAME_EXCHANGE)",
            )(io::Error::last_os_error()));
        }
        // `staging` now holds the replaced snapshot.
        std::fs::remove_dir_all(staging).map_err(Error::io(staging, "remove the old snapshot"))?;
    } else {
        std::fs::rename(staging, dir)
            .map_err(Error::io(dir, "rename the new snapshot into place"))?;
    }
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        sync_dir(parent)?;
    }
    Ok(())
}

pub(super) fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(Error::io(dir, "sync directory"))
}

/// Writes the state file into `dir`: the machine's saved `state` and its `components`'
/// states. Returns its bytes (the manifest names their hash).
pub(super) fn write_state(
    dir: &Path,
    state: Vec<u8>,
    components: &[ComponentState],
) -> Result<Vec<u8>> {
    let state = SavedState {
        machine: state,
        components: components.to_vec(),
    };
    let state_json = serde_json::to_vec(&state).map_err(|e| Error::Json {
        path: dir.join(STATE),
        source: e,
    })?;
    write_file(&dir.join(STATE), &state_json)?;
    Ok(state_json)
}

/// Writes the non-zero pages of the chunk `bytes` into `file` (at `path`) at `offset`,
/// adding them to `report`; returns the chunk's entry.
fn write_chunk(
    bytes: &[u8],
    (file, path, offset): (&File, &Path, u64),
    report: &mut WriteReport,
) -> Result<Chunk> {
    let mut zero = true;
    for (run_start, run) in nonzero_page_runs(bytes) {
        zero = false;
        file.write_all_at(run, offset + run_start as u64)
            .map_err(Error::io(path, "write"))?;
        report.data_bytes += run.len() as u64;
    }
    report.zero_chunks += u64::from(zero);
    Ok(Chunk {
        crc32: crc32fast::hash(bytes),
        zero,
        inherited: false,
    })
}

/// Writes the state, memory, sys and manifest files of a snapshot of the VM `saved` into `dir`.
fn write_files(
    saved: SavedVm<'_>,
    dir: &Path,
    diff: Option<(BaseRef, &[DirtyBitmap])>,
    components: &[ComponentState],
) -> Result<WriteReport> {
    let SavedVm {
        config,
        memory,
        state,
    } = saved;
    let state_json = write_state(dir, state, components)?;

    let create = |f: RegionFile| {
        let path = dir.join(f.name());
        File::create(&path)
            .map(|file| (file, path.clone(), 0u64))
            .map_err(Error::io(&path, "create"))
    };
    // Indexed by `RegionFile as usize`.
    let mut files = [create(RegionFile::Memory)?, create(RegionFile::Sys)?];
    let mut report = WriteReport {
        memory_bytes: 0,
        data_bytes: 0,
        zero_chunks: 0,
        chunks: 0,
    };
    let mut regions = Vec::new();
    let mut buf = PageBuf::zeroed(to_usize(CHUNK_BYTES));
    let dirty = diff.as_ref().map(|(_, dirty)| *dirty);
    for region in memory.regions() {
        let which = RegionFile::for_region(region.spec());
        let (file, path, end) = &mut files[which as usize];
        let file_offset = *end;
        let mut chunks = Vec::new();
        for offset in (0..region.size()).step_by(to_usize(CHUNK_BYTES)) {
            let len = to_usize(CHUNK_BYTES.min(region.size() - offset));
            let gpa = region.gpa() + offset;
            if dirty.is_some_and(|d| !any_dirty(d, gpa, len as u64)) {
                chunks.push(Chunk {
                    crc32: 0,
                    zero: false,
                    inherited: true,
                });
                continue;
            }
            let bytes = &mut buf[..len];
            memory.read(gpa, bytes)?;
            let at = (&*file, &**path, file_offset + offset);
            chunks.push(write_chunk(bytes, at, &mut report)?);
        }
        report.chunks += chunks.len() as u64;
        report.memory_bytes += region.size();
        regions.push(RegionImage {
            spec: region.spec().clone(),
            file: which,
            file_offset,
            digest: memory.digest(region.gpa(), region.size())?,
            chunks,
        });
        *end += region.size();
    }
    for (file, path, end) in &files {
        file.set_len(*end).map_err(Error::io(path, "set length"))?;
        file.sync_all().map_err(Error::io(path, "sync"))?;
    }

    let manifest = Manifest {
        format: FORMAT.into(),
        version: VERSION,
        config: config.clone(),
        regions,
        chunk_bytes: CHUNK_BYTES,
        state_bytes: state_json.len() as u64,
        state_blake3: blake3::hash(&state_json).to_hex().to_string(),
        memory_file_bytes: files[RegionFile::Memory as usize].2,
        sys_file_bytes: files[RegionFile::Sys as usize].2,
        base: diff.map(|(base, _)| base),
        writer: Some(guestmem_sys::release::Writer::this()),
        checksum: String::new(),
    };
    write_manifest(dir, manifest)?;
    Ok(report)
}

/// Seals `manifest` and writes it into `dir`.
pub(super) fn write_manifest(dir: &Path, mut manifest: Manifest) -> Result<()> {
    manifest.seal();
    // Compact: a restore parses it before anything else (an 8 GiB guest's is 4096 chunks).
    let json = serde_json::to_vec(&manifest).map_err(|e| Error::Json {
        path: dir.join(MANIFEST),
        source: e,
    })?;
    write_file(&dir.join(MANIFEST), &json)
}

pub(crate) fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(path).map_err(Error::io(path, "create"))?;
    f.write_all(bytes).map_err(Error::io(path, "write"))?;
    f.sync_all().map_err(Error::io(path, "sync"))
}
