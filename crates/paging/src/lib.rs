//! Demand paging of guest memory: a [`Pager`] makes a region's pages appear on first access,
//! with the bytes of a [`PageSource`] (zero-fill, a snapshot file, a remote peer). It is the
//! engine under snapshot lazy restore and post-copy migration.
//!
//! - anon and hugetlb regions: userfaultfd `MISSING` faults, resolved with `UFFDIO_COPY`;
//! - memfd regions: the page cache is filled through a second mapping of the fd, then mapped
//!   into the guest's mapping with `UFFDIO_CONTINUE` (`MINOR` faults; `MISSING` ones for holes);
//! - guest_memfd regions: served as above where the kernel lets userfaultfd register their
//!   mapping (found by trying it), else refused naming what is missing: that registration and
//!   KVM Userfault (see [`Error::Unsupported`]).
//!
//! The region is cut into chunks (the fault-around size): a fault installs the whole chunk
//! around the faulting page. Chunks are sharded by range over several userfaultfds, each
//! served by handler threads that read events in batches; after a sequential fault the
//! following chunks are read ahead (by the handler, or by readahead threads that keep several
//! fetches in flight for a slow source); a background thread fetches the chunks nobody asked
//! for yet, at low priority, and retires the pager once all are resident. A chunk is fetched
//! from the source as one range ([`PageSource::fetch_pieces`]) and copied in as it arrives.
//! The pager's threads can be pinned to host CPUs of their own ([`PagerConfig::cpus`]).

pub mod affinity;
mod error;
mod pager;
pub mod priority;
mod shared;
mod source;
mod userfault;
pub mod write_protect;

pub use error::{Error, Result, UffdError};
pub use pager::{
    check_demand_paging, register_for_peer, OnFailure, Pager, PagerConfig, PagerStats, PeerPager,
    PeerRange, PeerReleased,
};
pub use shared::{Share, SharedImage};
pub use source::{FileSource, PageSource, RemoteSource, WindowSource, ZeroSource};
pub use userfault::{UserfaultPager, HOST_UFFD, HOST_WAIT};

/// A pager's counters, readable from another thread while the pager runs (a progress
/// sampler's): [`Pager::probe`], [`UserfaultPager::probe`].
#[derive(Clone)]
pub struct StatsProbe(std::sync::Arc<dyn Fn() -> PagerStats + Send + Sync>);

impl StatsProbe {
    pub(crate) fn new(stats: impl Fn() -> PagerStats + Send + Sync + 'static) -> StatsProbe {
        StatsProbe(std::sync::Arc::new(stats))
    }

    /// What the pager did so far.
    pub fn stats(&self) -> PagerStats {
        (self.0)()
    }
}

impl std::fmt::Debug for StatsProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("StatsProbe").field(&self.stats()).finish()
    }
}
