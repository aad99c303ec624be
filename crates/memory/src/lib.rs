//! Guest memory for KVM VMMs: regions of host memory placed at guest physical addresses, on one
//! of several backends (anonymous, memfd, hugetlbfs, guest_memfd), registered as KVM memslots.
//!
//! Host-side access never creates Rust references into guest memory: the guest (and other host
//! threads) may change it at any time, so reads and writes copy through raw pointers.

mod dirty_marks;
mod error;
mod guest_memory;
mod image;
mod mapping_cache;
mod memslot;
mod numa;
mod page_buf;
mod populate;
mod region;
mod userfault;
pub mod vmm_compat;

pub use dirty_marks::DirtyMarks;
pub use error::{Error, Result};
pub use guest_memory::{digest_bytes, GuestMemory, DIGEST_SEED};
pub use image::{load_image, ImageLoad};
pub use mapping_cache::CachedMapping;
pub use memslot::{Memslot, MemslotManager, SlotFlags};
pub use numa::{node_pages, nodes_with_memory, NumaMode, NumaPolicy};
pub use page_buf::PageBuf;
pub use populate::{populate, populate_with, Method, PopulateFrom, Populated};
pub use region::{hugetlbfs_mount, Backend, Region, RegionSpec, HUGE_PAGE_SIZE};
pub use userfault::{UserfaultBitmap, UserfaultHandler, UserfaultRouter};

/// The base page size of guest memory (x86-64).
pub const PAGE_SIZE: u64 = 4096;
