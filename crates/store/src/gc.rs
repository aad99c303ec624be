//! Store maintenance that must not race a snapshot being written: leases, garbage
//! collection, deleting snapshots (merging them is [`crate::merge`]).
//!
//! Safety against a concurrent write rests on two kinds of lease object under `leases/`:
//! a writer (a snapshot write or a merge) puts `leases/write-…` before it looks at which
//! chunks the store holds, and a collection puts `leases/gc-…` before it looks at which
//! leases exist. Then each looks for the other's: a writer that sees a live gc lease waits for
//! it to go; a collection that sees a live write lease removes nothing. Both put before they
//! read, on a store with read-after-write consistency (S3, MinIO, a local directory), so at
//! least one of two concurrent parties sees the other: a collection never removes a chunk a
//! writer counted on finding. A lease older than [`LEASE_TTL`], or taken by a process of this
//! host that is gone, is a crashed party's and is ignored (and removed by the next collection). On top, a collection leaves chunks younger
//! than its grace period alone.

use std::collections::HashSet;
use std::time::{Duration, Instant, SystemTime};

use serde::Serialize;

use crate::chunk;
use crate::manifest::{manifest_key, state_key, working_set_key, StoreManifest};
use crate::objects::ObjectStore;
use crate::{Error, Result};

/// A lease older than this is a crashed writer's or collector's.
pub const LEASE_TTL: Duration = Duration::from_secs(3600);
/// How long a writer waits for a collection under way to end.
const GC_WAIT: Duration = Duration::from_secs(120);

/// A lease held until dropped (see the module docs).
pub struct Lease<'a> {
    objects: &'a dyn ObjectStore,
    key: String,
}

// By hand: a back end need not implement `Debug`.
impl std::fmt::Debug for Lease<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap_or_default()
        .trim()
        .to_string()
}

fn lease_key(kind: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "leases/{kind}-{}-{}-{nanos}",
        hostname(),
        std::process::id()
    )
}

/// Whether the lease `key` was taken by a process of this host that is gone (a crashed or
/// killed writer): `leases/KIND-HOST-PID-NANOS`.
fn holder_is_gone(key: &str) -> bool {
    let mut parts = key.rsplitn(3, '-');
    let (Some(_nanos), Some(pid), Some(rest)) = (parts.next(), parts.next(), parts.next()) else {
        return false;
    };
    let Ok(pid) = pid.parse::<i32>() else {
        return false;
    };
    let host = hostname();
    if host.is_empty() || !rest.ends_with(&format!("-{host}")) || pid <= 0 {
        return false;
    }
    // SAFETY: signal 0 only asks whether the process exists; nothing is sent.
    let r = unsafe { libc::kill(pid, 0) };
    r != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
}

/// The live leases of `kind` other than `own`: younger than [`LEASE_TTL`] and not held by a
/// process of this host that is gone.
fn live(objects: &dyn ObjectStore, kind: &str, own: &str) -> Result<Vec<String>> {
    let now = SystemTime::now();
    Ok(objects
        .list("leases/")?
        .into_iter()
        .filter(|o| o.key != own && o.key.starts_with(&format!("leases/{kind}-")))
        .filter(|o| now.duration_since(o.modified).unwrap_or_default() < LEASE_TTL)
        .filter(|o| !holder_is_gone(&o.key))
        .map(|o| o.key)
        .collect())
}

impl<'a> Lease<'a> {
    /// Takes a write lease for `what` (a snapshot name), then waits for any collection under
    /// way to end.
    pub fn acquire(objects: &'a dyn ObjectStore, op: &str, what: &str) -> Result<Lease<'a>> {
        let key = lease_key("write");
        objects.put(&key, format!("{op} {what}\n").as_bytes())?;
        let lease = Lease { objects, key };
        let start = Instant::now();
        loop {
            let gcs = live(objects, "gc", &lease.key)?;
            if gcs.is_empty() {
                return Ok(lease);
            }
            if start.elapsed() > GC_WAIT {
                return Err(Error::Write(format!(
                    "{}: a garbage collection is under way ({}) and did not end in {} s",
                    objects.describe(),
                    gcs.join(", "),
                    GC_WAIT.as_secs()
                )));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.objects.delete(&self.key) {
            tracing::warn!(
                "could not remove the lease {}: {}",
                self.key,
                crate::chain_text(&e)
            );
        }
    }
}

/// What a collection found and did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct GcReport {
    /// Snapshot manifests read.
    pub manifests: usize,
    /// Objects of chunks the store holds: packs, and chunk objects of a store written before
    /// packs.
    pub chunks: usize,
    /// Of those, the ones some manifest references.
    pub referenced_chunks: usize,
    /// Of those, the ones removed.
    pub removed_chunks: usize,
    /// Their stored bytes.
    pub removed_bytes: u64,
    /// Unreferenced ones left alone because they are younger than the grace period.
    pub young_chunks: usize,
    /// Stale leases (older than [`LEASE_TTL`], or of a gone process of this host) removed.
    pub stale_leases: usize,
    /// Temporary files of interrupted puts removed (a local store's).
    pub stale_temporaries: usize,
}

/// Removes the packs (and chunk objects) no snapshot manifest of the store references and that
/// are older than `grace`. A pack goes when no manifest lists any chunk of it. Refuses, removing nothing, while a snapshot write holds a live lease, or when a
/// manifest cannot be read (its chunks could not be told apart from garbage).
pub fn gc(objects: &dyn ObjectStore, grace: Duration) -> Result<GcReport> {
    let key = lease_key("gc");
    objects.put(&key, b"gc\n")?;
    let lease = Lease { objects, key };
    let writers = live(objects, "write", &lease.key)?;
    if !writers.is_empty() {
        return Err(Error::Write(format!(
            "{}: a snapshot write is under way ({}): nothing was collected; run gc again when \
             it is done",
            objects.describe(),
            writers.join(", ")
        )));
    }
    let mut report = GcReport::default();
    let mut referenced = HashSet::new();
    for o in objects.list("snapshots/")? {
        let Some(name) = o
            .key
            .strip_prefix("snapshots/")
            .and_then(|k| k.strip_suffix("/manifest.json"))
        else {
            continue;
        };
        let manifest =
            StoreManifest::load(objects, name).map_err(|e| Error::GcUnreadableManifest {
                store: objects.describe(),
                name: name.to_string(),
                source: Box::new(e),
            })?;
        report.manifests += 1;
        referenced.extend(manifest.data_chunks().map(|c| c.object_key()));
    }
    let now = SystemTime::now();
    let mut stored = objects.list("chunks/")?;
    stored.extend(objects.list("packs/")?);
    for o in stored {
        if chunk::hash_of_key(&o.key).is_none() && chunk::pack_of_key(&o.key).is_none() {
            continue;
        }
        report.chunks += 1;
        if referenced.contains(&o.key) {
            report.referenced_chunks += 1;
            continue;
        }
        if now.duration_since(o.modified).unwrap_or_default() < grace {
            report.young_chunks += 1;
            continue;
        }
        objects.delete(&o.key)?;
        report.removed_chunks += 1;
        report.removed_bytes += o.size;
    }
    report.stale_temporaries = objects.remove_stale_temporaries(LEASE_TTL)?;
    for o in objects.list("leases/")? {
        if o.key != lease.key
            && (now.duration_since(o.modified).unwrap_or_default() >= LEASE_TTL
                || holder_is_gone(&o.key))
        {
            objects.delete(&o.key)?;
            report.stale_leases += 1;
        }
    }
    Ok(report)
}

/// Deletes snapshot `name`'s manifest (first: the snapshot is gone from then on), state and
/// working set; its chunks stay until a collection. Refuses while another snapshot of the
/// store stands on it as its base.
pub fn delete(objects: &dyn ObjectStore, name: &str) -> Result<()> {
    StoreManifest::load(objects, name)?;
    for o in objects.list("snapshots/")? {
        let Some(other) = o
            .key
            .strip_prefix("snapshots/")
            .and_then(|k| k.strip_suffix("/manifest.json"))
        else {
            continue;
        };
        if other == name {
            continue;
        }
        if let Ok(m) = StoreManifest::load(objects, other) {
            if m.base.as_ref().is_some_and(|b| b.name == name) {
                return Err(Error::Write(format!(
                    "{}: snapshot '{other}' is a diff over '{name}': merge it (guestmem snapshot \
                     merge) or delete it first",
                    objects.describe()
                )));
            }
        }
    }
    objects.delete(&manifest_key(name))?;
    objects.delete(&state_key(name))?;
    objects.delete(&working_set_key(name))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::local::LocalObjectStore;

    /// A writer waits for a live collection's lease to go; a collection refuses while a
    /// writer's lease is live; leases older than the TTL count for nothing.
    #[test]
    fn writers_and_collections_exclude_each_other() {
        let dir = std::env::temp_dir().join(format!("guestmem-lease-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let b = LocalObjectStore::new(&dir);
        b.put("leases/gc-other-1-1", b"gc\n").unwrap();
        let t = Instant::now();
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(500));
                b.delete("leases/gc-other-1-1").unwrap();
            });
            let lease = Lease::acquire(&b, "write", "x").unwrap();
            assert!(
                t.elapsed() >= Duration::from_millis(500),
                "{:?}",
                t.elapsed()
            );
            let e = gc(&b, Duration::ZERO).unwrap_err().to_string();
            assert!(e.contains("write is under way"), "{e}");
            drop(lease);
        });
        assert!(b.list("leases/").unwrap().is_empty(), "both leases removed");
        // A crashed writer's lease, older than the TTL, does not block a collection forever.
        b.put("leases/write-crashed-1-1", b"write y\n").unwrap();
        let old = SystemTime::now() - LEASE_TTL - Duration::from_secs(60);
        std::fs::File::options()
            .write(true)
            .open(dir.join("leases/write-crashed-1-1"))
            .unwrap()
            .set_modified(old)
            .unwrap();
        let r = gc(&b, Duration::ZERO).unwrap();
        assert_eq!(r.stale_leases, 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A manifest gc cannot read stops it before it removes anything, as a typed error whose
    /// source says why (once).
    #[test]
    fn an_unreadable_manifest_stops_gc_naming_it_with_its_cause() {
        let dir = std::env::temp_dir().join(format!("guestmem-gc-bad-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let b = LocalObjectStore::new(&dir);
        b.put("snapshots/vm1/manifest.json", b"{ not json").unwrap();
        b.put("chunks/ab/abcd", b"garbage").unwrap();
        let e = gc(&b, Duration::ZERO).unwrap_err();
        assert!(
            matches!(&e, Error::GcUnreadableManifest { name, .. } if name == "vm1"),
            "{e:?}"
        );
        assert!(e.to_string().contains("gc removed nothing"), "{e}");
        let chain = crate::chain_text(&e);
        let cause = std::error::Error::source(&e).expect("a source").to_string();
        assert!(cause.contains("not valid JSON"), "{chain}");
        assert_eq!(chain.matches(&cause).count(), 1, "{chain}");
        assert!(b.get("chunks/ab/abcd").is_ok(), "nothing removed");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
