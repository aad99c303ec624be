use std::io;

use crate::{Backend, RegionSpec};

/// What guest memory operations return.
pub type Result<T> = std::result::Result<T, Error>;

/// Everything that can go wrong with guest memory. Every variant names the region.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A region of zero bytes.
    #[error("region '{region}': size is zero")]
    ZeroSize {
        /// The region's name.
        region: String,
    },
    /// A region's address or size that its backend's pages cannot hold.
    #[error("region '{region}': {what} {value:#x} is not a multiple of the {backend} backend's page size ({page_size:#x})")]
    Misaligned {
        /// The region's name.
        region: String,
        /// Which value (guest address, size).
        what: &'static str,
        /// The value.
        value: u64,
        /// The backend.
        backend: Backend,
        /// The backend's page size.
        page_size: u64,
    },
    /// A region past the end of the guest address space.
    #[error("region '{region}': guest range {gpa:#x}+{size:#x} overflows the guest address space")]
    OutOfRange {
        /// The region's name.
        region: String,
        /// The guest physical address.
        gpa: u64,
        /// Its bytes.
        size: u64,
    },
    /// Two regions overlap.
    #[error("region '{region}' [{gpa:#x}..{end:#x}) overlaps region '{other}' [{other_gpa:#x}..{other_end:#x})")]
    Overlap {
        /// The region's name.
        region: String,
        /// The guest physical address.
        gpa: u64,
        /// Its end (exclusive).
        end: u64,
        /// The other region's name.
        other: String,
        /// The other's guest physical address.
        other_gpa: u64,
        /// The other's end (exclusive).
        other_end: u64,
    },
    /// The backend is not available on this host.
    #[error("region '{region}': the {backend} backend is not available: {reason}")]
    BackendUnavailable {
        /// The region's name.
        region: String,
        /// The backend.
        backend: Backend,
        /// Why.
        reason: String,
    },
    /// A system call failed.
    #[error("region '{region}': {op} failed")]
    Os {
        /// The region's name.
        region: String,
        /// The operation that failed.
        op: &'static str,
        /// The kernel's error.
        #[source]
        source: io::Error,
    },
    /// Another process's memory file cannot back the region.
    #[error("region '{region}': cannot share another process's memory: {reason}")]
    Shared {
        /// The region's name.
        region: String,
        /// Why.
        reason: String,
    },
    /// A region name that cannot be used.
    #[error("region name {0:?} cannot be used (it contains a NUL byte)")]
    BadName(String),
    /// Two regions have the same name.
    #[error("region names must be unique: '{0}' is used twice")]
    DuplicateName(String),
    /// A memslot number past the last one.
    #[error("memslot {slot} does not exist (this guest memory has {slots} slots)")]
    NoSuchSlot {
        /// The memslot.
        slot: usize,
        /// How many there are.
        slots: usize,
    },
    /// A region cannot be populated as asked.
    #[error("region '{region}': cannot populate: {reason}")]
    Populate {
        /// The region's name.
        region: String,
        /// Why.
        reason: String,
    },
    /// A region cannot be used through vm-memory's traits.
    #[error("region '{region}': cannot be used as vm-memory memory: {reason}")]
    VmMemory {
        /// The region's name.
        region: String,
        /// Why.
        reason: String,
    },
    /// A NUMA policy cannot be applied.
    #[error("region '{region}': NUMA policy: {reason}")]
    Numa {
        /// The region's name.
        region: String,
        /// Why.
        reason: String,
    },
    /// A guest range that is not inside one region.
    #[error("guest range {gpa:#x}+{len:#x} is not inside one region")]
    NotMapped {
        /// The guest physical address.
        gpa: u64,
        /// Its bytes.
        len: u64,
    },
    /// A guest range that is not inside one memslot.
    #[error("guest range {gpa:#x}+{len:#x} is not inside one memslot (never added, or removed or moved away)")]
    NoMemslot {
        /// The guest physical address.
        gpa: u64,
        /// Its bytes.
        len: u64,
    },
    /// Every memslot KVM allows is in use.
    #[error(
        "no free memslot for region '{region}': all {max} slots (KVM_CAP_NR_MEMSLOTS) are in use"
    )]
    SlotLimit {
        /// The region's name.
        region: String,
        /// The most KVM allows.
        max: u32,
    },
    /// A memslot that does not exist.
    #[error("memslot {slot} does not exist")]
    UnknownSlot {
        /// The memslot.
        slot: u32,
    },
    /// Two memslots overlap.
    #[error("memslot for region '{region}' [{gpa:#x}..{end:#x}) overlaps memslot {other_slot} (region '{other}') [{other_gpa:#x}..{other_end:#x})")]
    SlotOverlap {
        /// The region's name.
        region: String,
        /// The guest physical address.
        gpa: u64,
        /// Its end (exclusive).
        end: u64,
        /// The other memslot.
        other_slot: u32,
        /// The other region's name.
        other: String,
        /// The other's guest physical address.
        other_gpa: u64,
        /// The other's end (exclusive).
        other_end: u64,
    },
    /// A memslot's window that does not fit its region.
    #[error("memslot for region '{region}': window {offset:#x}+{size:#x} is empty, not page-aligned or outside the region (size {region_size:#x})")]
    SlotWindow {
        /// The region's name.
        region: String,
        /// The window's offset in the region.
        offset: u64,
        /// The window's bytes.
        size: u64,
        /// The region's bytes.
        region_size: u64,
    },
    /// A KVM ioctl on a memslot failed.
    #[error("memslot {slot} (region '{region}'): {op} failed")]
    Kvm {
        /// The memslot.
        slot: u32,
        /// The region's name.
        region: String,
        /// The operation that failed.
        op: &'static str,
        /// The kernel's error.
        source: io::Error,
    },
    /// An access outside a cached mapping.
    #[error("access {offset:#x}+{len:#x} is outside the cached guest range {gpa:#x}+{size:#x}")]
    OutsideMapping {
        /// The mapping's guest address.
        gpa: u64,
        /// The mapping's bytes.
        size: u64,
        /// The access's offset in it.
        offset: u64,
        /// The access's bytes.
        len: u64,
    },
    /// The memory is registered as memslots already.
    #[error("guest memory is already registered as memslots")]
    AlreadyRegistered,
    /// A KVM Userfault bitmap that does not fit a region's memslot.
    #[error("region '{region}': KVM Userfault: {reason}")]
    Userfault {
        /// The region.
        region: String,
        /// What is wrong.
        reason: String,
    },
    /// A memory image that cannot be used.
    #[error("memory image {path}: {reason}")]
    Image {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        reason: String,
    },
    /// A memory image that cannot be read.
    #[error("memory image {path}: {what}")]
    ImageIo {
        /// The file.
        path: std::path::PathBuf,
        /// What was being done ("cannot open", "decompressing at offset …").
        what: String,
        /// The operating system's (or the decompressor's) error.
        #[source]
        source: io::Error,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A system call's error names the region and the call, its cause kept as the source
    /// only; addresses and sizes are printed in hex.
    #[test]
    fn errors_name_the_region_and_print_addresses_in_hex() {
        let spec = RegionSpec::new("ram", 0x4000_0000, 1 << 20, Backend::Memfd);
        let e = Error::os(
            &spec,
            "memfd_create",
            io::Error::from_raw_os_error(libc::EMFILE),
        );
        assert_eq!(e.to_string(), "region 'ram': memfd_create failed");
        let source = std::error::Error::source(&e)
            .expect("the cause")
            .to_string();
        assert!(source.contains("os error 24"), "{source}");
        let e = Error::Misaligned {
            region: "ram".into(),
            what: "size",
            value: 0x1800,
            backend: Backend::Hugetlbfs,
            page_size: 0x20_0000,
        };
        assert_eq!(
            e.to_string(),
            "region 'ram': size 0x1800 is not a multiple of the hugetlb backend's page size \
             (0x200000)"
        );
    }
}
