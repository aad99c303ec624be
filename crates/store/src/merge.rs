//! Merging a diff snapshot and its base chain into one snapshot that stands alone, under a
//! write lease (see [`crate::gc`]).

use std::collections::HashSet;

use crate::gc::Lease;
use crate::manifest::{resolve, ChunkRef, PackTable, StoreManifest};
use crate::objects::ObjectStore;
use crate::{Error, Result};

/// Merges snapshot `name` and its base chain into one snapshot `into` of the same store that
/// stands alone: a manifest operation (every chunk is already stored; none is read or put).
pub fn merge(objects: &dyn ObjectStore, name: &str, into: &str) -> Result<StoreManifest> {
    crate::write::check_name(into)?;
    let _lease = Lease::acquire(objects, "merge", into)?;
    let source = StoreManifest::load(objects, name)?;
    let resolved = resolve(objects, &source)?;
    let state = crate::restore::read_state(objects, &source)?;
    let mut merged = source.clone();
    merged.name = into.to_string();
    merged.base = None;
    merged.version = crate::manifest::VERSION;
    merged.writer = Some(guestmem_sys::release::Writer::this());
    let mut table = PackTable::default();
    for (region, chunks) in merged.regions.iter_mut().zip(resolved) {
        region.chunks = chunks
            .into_iter()
            .map(|c| match c {
                None => ChunkRef::Zero,
                Some(c) => table.entry(&c),
            })
            .collect();
    }
    merged.packs = table.into_ids();
    // The packs and chunks must all be there: merging over a damaged store would hide the
    // damage.
    for key in merged
        .data_chunks()
        .map(|c| c.object_key())
        .collect::<HashSet<_>>()
    {
        if !objects.exists(&key)? {
            return Err(Error::Missing {
                store: objects.describe(),
                key: format!("{key} (holding chunks of snapshot '{name}')"),
            });
        }
    }
    merged.seal();
    crate::write::commit(objects, &merged, &state)?;
    Ok(merged)
}
