use std::io;

use crate::{Backend, RegionSpec};

pub type Result<T> = std::result::Result<T, Error>;

/// Everything that can go wrong with guest memory. Every variant names the region.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("region '{region}': size is zero")]
    ZeroSize { region: String },
    #[error("region '{region}': {what} {value:#x} is not a multiple of the {backend} backend's page size ({page_size:#x})")]
    Misaligned {
        region: String,
        what: &'static str,
        value: u64,
        backend: Backend,
        page_size: u64,
    },
    #[error("region '{region}': guest range {gpa:#x}+{size:#x} overflows the guest address space")]
    OutOfRange { region: String, gpa: u64, size: u64 },
    #[error("region '{region}' [{gpa:#x}..{end:#x}) overlaps region '{other}' [{other_gpa:#x}..{other_end:#x})")]
    Overlap {
        region: String,
        gpa: u64,
        end: u64,
        other: String,
        other_gpa: u64,
        other_end: u64,
    },
    #[error("region '{region}': the {backend} backend is not available: {reason}")]
    BackendUnavailable {
        region: String,
        backend: Backend,
        reason: String,
    },
    #[error("region '{region}': {op} failed: {source}")]
    Os {
        region: String,
        op: &'static str,
        source: io::Error,
    },
    #[error("region '{region}': cannot share another process's memory: {reason}")]
    Shared { region: String, reason: String },
    #[error("region name {0:?} cannot be used (it contains a NUL byte)")]
    BadName(String),
    #[error("region names must be unique: '{0}' is used twice")]
    DuplicateName(String),
    #[error("memslot {slot} does not exist (this guest memory has {slots} slots)")]
    NoSuchSlot { slot: usize, slots: usize },
    #[error("region '{region}': cannot populate: {reason}")]
    Populate { region: String, reason: String },
    #[error("region '{region}': cannot be used as vm-memory memory: {reason}")]
    VmMemory { region: String, reason: String },
    #[error("region '{region}': NUMA policy: {reason}")]
    Numa { region: String, reason: String },
    #[error("guest range {gpa:#x}+{len:#x} is not inside one region")]
    NotMapped { gpa: u64, len: u64 },
    #[error("guest range {gpa:#x}+{len:#x} is not inside one memslot (never added, or removed or moved away)")]
    NoMemslot { gpa: u64, len: u64 },
    #[error(
        "no free memslot for region '{region}': all {max} slots (KVM_CAP_NR_MEMSLOTS) are in use"
    )]
    SlotLimit { region: String, max: u32 },
    #[error("memslot {slot} does not exist")]
    UnknownSlot { slot: u32 },
    #[error("memslot for region '{region}' [{gpa:#x}..{end:#x}) overlaps memslot {other_slot} (region '{other}') [{other_gpa:#x}..{other_end:#x})")]
    SlotOverlap {
        region: String,
        gpa: u64,
        end: u64,
        other_slot: u32,
        other: String,
        other_gpa: u64,
        other_end: u64,
    },
    #[error("memslot for region '{region}': window {offset:#x}+{size:#x} is empty, not page-aligned or outside the region (size {region_size:#x})")]
    SlotWindow {
        region: String,
        offset: u64,
        size: u64,
        region_size: u64,
    },
    #[error("memslot {slot} (region '{region}'): {op} failed: {source}")]
    Kvm {
        slot: u32,
        region: String,
        op: &'static str,
        source: io::Error,
    },
    #[error("access {offset:#x}+{len:#x} is outside the cached guest range {gpa:#x}+{size:#x}")]
    OutsideMapping {
        gpa: u64,
        size: u64,
        offset: u64,
        len: u64,
    },
    #[error("guest memory is already registered as memslots")]
    AlreadyRegistered,
    #[error("memory image {path}: {reason}")]
    Image {
        path: std::path::PathBuf,
        reason: String,
    },
}

impl Error {
    pub(crate) fn os(spec: &RegionSpec, op: &'static str, source: io::Error) -> Error {
        Error::Os {
            region: spec.name.clone(),
            op,
            source,
        }
    }
}
