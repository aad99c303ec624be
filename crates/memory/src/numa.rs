//! NUMA placement of a region's pages by policy (guest_memfd NUMA mempolicy): `default`, `bind`,
//! `interleave` or `preferred` over a list of host nodes, in force before the region's first page
//! is allocated.
//!
//! - anon, memfd, hugetlbfs: `mbind` on the mapping (memfd and hugetlbfs keep it as the file's
//!   shared policy).
//! - guest_memfd: `mbind` on the mapping too, which is enough where the kernel has guest_memfd
//!   NUMA mempolicy's shared policy (found by trying: a second mapping of the fd reports the
//!   policy). Otherwise the policy stays with that one mapping and does not steer allocation, so
//!   the pages are allocated up front (`fallocate(KEEP_SIZE)`) by a thread that carries the policy
//!   (`set_mempolicy`), and population threads carry it as well.

use guestmem_sys::to_usize;
use std::collections::BTreeMap;
use std::io;
use std::os::fd::AsRawFd;

use guestmem_sys::uapi::{MPOL_BIND, MPOL_DEFAULT, MPOL_F_ADDR, MPOL_INTERLEAVE, MPOL_PREFERRED};
use serde::{Deserialize, Serialize};

use crate::{Backend, Error, Region, RegionSpec, Result};

/// Node masks cover this many nodes (the kernel's largest `MAX_NUMNODES` is 1024).
const MASK_BITS: usize = 1024;
type NodeMask = [libc::c_ulong; MASK_BITS / 64];

/// The `MPOL_*` mode of a policy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NumaMode {
    /// The process's policy: no placement of our own.
    #[default]
    Default,
    /// Only the listed nodes.
    Bind,
    /// Page by page, round-robin over the listed nodes.
    Interleave,
    /// The one listed node first, others when it is full.
    Preferred,
}

impl NumaMode {
    fn mpol(self) -> i32 {
        match self {
            NumaMode::Default => MPOL_DEFAULT,
            NumaMode::Bind => MPOL_BIND,
            NumaMode::Interleave => MPOL_INTERLEAVE,
            NumaMode::Preferred => MPOL_PREFERRED,
        }
    }

    fn from_mpol(mode: i32) -> Option<NumaMode> {
        [
            NumaMode::Default,
            NumaMode::Bind,
            NumaMode::Interleave,
            NumaMode::Preferred,
        ]
        .into_iter()
        .find(|m| m.mpol() == mode)
    }

    /// The mode's name (as parsed).
    pub fn name(self) -> &'static str {
        match self {
            NumaMode::Default => "default",
            NumaMode::Bind => "bind",
            NumaMode::Interleave => "interleave",
            NumaMode::Preferred => "preferred",
        }
    }
}

/// A region's NUMA policy: a mode and the host nodes it names (none for `default`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NumaPolicy {
    /// The policy's mode.
    pub mode: NumaMode,
    /// The host nodes it names.
    pub nodes: Vec<u32>,
}

impl std::fmt::Display for NumaPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.mode.name())?;
        if !self.nodes.is_empty() {
            let nodes: Vec<String> = self.nodes.iter().map(u32::to_string).collect();
            write!(f, ":{}", nodes.join(","))?;
        }
        Ok(())
    }
}

impl std::str::FromStr for NumaPolicy {
    type Err = String;

    /// `default`, or `MODE:NODES` with MODE `bind`, `interleave` or `preferred` and NODES a
    /// list such as `0`, `0-1` or `0,2-3`.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let (mode, nodes) = s.split_once(':').unwrap_or((s, ""));
        let mode = match mode {
            "default" => NumaMode::Default,
            "bind" => NumaMode::Bind,
            "interleave" => NumaMode::Interleave,
            "preferred" => NumaMode::Preferred,
            _ => {
                return Err(format!(
                    "NUMA policy '{s}': unknown mode '{mode}' (expected default, bind, interleave or preferred)"
                ))
            }
        };
        let nodes = if nodes.is_empty() {
            Vec::new()
        } else {
            parse_node_list(nodes).map_err(|e| format!("NUMA policy '{s}': {e}"))?
        };
        Ok(NumaPolicy { mode, nodes })
    }
}

/// A kernel node list (`0`, `0-1`, `0,2-3`) as node numbers, ascending and without repeats.
fn parse_node_list(list: &str) -> std::result::Result<Vec<u32>, String> {
    let mut nodes = Vec::new();
    for part in list.trim().split(',') {
        let num = |t: &str| {
            t.trim()
                .parse::<u32>()
                .map_err(|_| format!("'{t}' is not a node number"))
        };
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (num(a)?, num(b)?),
            None => (num(part)?, num(part)?),
        };
        if lo > hi || hi as usize >= MASK_BITS {
            return Err(format!("'{part}' is not a node range below {MASK_BITS}"));
        }
        nodes.extend(lo..=hi);
    }
    nodes.sort_unstable();
    nodes.dedup();
    Ok(nodes)
}

/// The host nodes that have memory (`/sys/devices/system/node/has_memory`; node 0 on a kernel
/// without NUMA).
pub fn nodes_with_memory() -> Vec<u32> {
    std::fs::read_to_string("/sys/devices/system/node/has_memory")
        .ok()
        .and_then(|s| parse_node_list(&s).ok())
        .unwrap_or_else(|| vec![0])
}

impl NumaPolicy {
    /// Refuses a policy the kernel would refuse or misread: nodes with `default`, none (or, for
    /// `preferred`, more than one) otherwise, and nodes that do not exist or have no memory.
    pub fn check(&self, region: &str) -> Result<()> {
        let bad = |reason: String| Error::Numa {
            region: region.to_string(),
            reason,
        };
        match (self.mode, self.nodes.len()) {
            (NumaMode::Default, 0) => return Ok(()),
            (NumaMode::Default, _) => {
                return Err(bad(format!("'{self}': the default policy takes no nodes")))
            }
            (_, 0) => return Err(bad(format!("'{self}' names no node"))),
            (NumaMode::Preferred, n) if n > 1 => {
                return Err(bad(format!("'{self}': preferred takes exactly one node")))
            }
            _ => {}
        }
        let have = nodes_with_memory();
        if let Some(n) = self.nodes.iter().find(|n| !have.contains(n)) {
            return Err(bad(format!(
                "host node {n} does not exist or has no memory (nodes with memory: {have:?})"
            )));
        }
        Ok(())
    }

    fn mask(&self) -> NodeMask {
        let mut mask = [0; MASK_BITS / 64];
        for &n in &self.nodes {
            mask[n as usize / 64] |= 1 << (n % 64);
        }
        mask
    }
}

/// Puts the region's policy in force on its fresh mapping (see the module documentation).
/// Called by `Region::create` before any page is allocated.
pub(crate) fn apply(
    spec: &RegionSpec,
    addr: *mut u8,
    fd: Option<&std::os::fd::OwnedFd>,
) -> Result<()> {
    let policy = &spec.numa;
    if policy.mode == NumaMode::Default {
        return Ok(());
    }
    let mask = policy.mask();
    // SAFETY: `addr`/`size` is the region's own fresh mapping; `mask` is a live array of
    // MASK_BITS bits (maxnode is one more, as the kernel expects).
    let ret = unsafe {
        libc::syscall(
            libc::SYS_mbind,
            addr,
            to_usize(spec.size),
            policy.mode.mpol(),
            mask.as_ptr(),
            MASK_BITS + 1,
            0u32,
        )
    };
    if ret != 0 {
        return Err(Error::os(spec, "mbind", io::Error::last_os_error()));
    }
    if spec.backend != Backend::GuestMemfd {
        return Ok(());
    }
    let fd = fd.expect("guest_memfd region has an fd");
    if gmem_has_shared_policy(spec, fd, policy)? {
        tracing::debug!(region = %spec.name, "guest_memfd keeps the policy as a shared policy");
        return Ok(());
    }
    // The kernel lacks guest_memfd NUMA mempolicy: allocate every page now, from a thread that
    // carries the policy.
    let raw = fd.as_raw_fd();
    let size = spec.size;
    std::thread::scope(|s| {
        s.spawn(|| {
            set_thread_policy(policy).map_err(|e| Error::os(spec, "set_mempolicy", e))?;
            // SAFETY: fallocate on an fd the region owns, inside its size.
            let ret =
                unsafe { libc::fallocate(raw, libc::FALLOC_FL_KEEP_SIZE, 0, size as libc::off_t) };
            if ret != 0 {
                return Err(Error::os(
                    spec,
                    "fallocate(KEEP_SIZE) under the NUMA policy",
                    io::Error::last_os_error(),
                ));
            }
            Ok(())
        })
        .join()
        .expect("placement thread panicked")
    })?;
    tracing::debug!(region = %spec.name, "guest_memfd pages allocated under set_mempolicy");
    Ok(())
}

/// Whether a second mapping of the guest_memfd reports `policy` (guest_memfd NUMA mempolicy's
/// shared policy).
fn gmem_has_shared_policy(
    spec: &RegionSpec,
    fd: &std::os::fd::OwnedFd,
    policy: &NumaPolicy,
) -> Result<bool> {
    let len = to_usize(crate::PAGE_SIZE);
    // SAFETY: a fresh one-page shared mapping of the region's fd; it aliases the region's first
    // page, which nothing reads or writes through it.
    let second = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if second == libc::MAP_FAILED {
        return Err(Error::os(
            spec,
            "mmap (shared-policy probe)",
            io::Error::last_os_error(),
        ));
    }
    let seen = mapping_policy(second as *const u8);
    // SAFETY: exactly the mapping made above.
    unsafe { libc::munmap(second, len) };
    Ok(seen.map_err(|e| Error::os(spec, "get_mempolicy", e))? == *policy)
}

/// Sets the calling thread's policy (`set_mempolicy`).
pub(crate) fn set_thread_policy(policy: &NumaPolicy) -> io::Result<()> {
    let mask = policy.mask();
    // SAFETY: `mask` is a live array of MASK_BITS bits; the call only changes this thread.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_set_mempolicy,
            policy.mode.mpol(),
            mask.as_ptr(),
            MASK_BITS + 1,
        )
    };
    if ret != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The policy of the mapping at `addr`, as `get_mempolicy(MPOL_F_ADDR)` reports it.
fn mapping_policy(addr: *const u8) -> io::Result<NumaPolicy> {
    let mut mode: libc::c_int = 0;
    let mut mask: NodeMask = [0; MASK_BITS / 64];
    // SAFETY: `mode` and `mask` are live and large enough for MASK_BITS bits; `addr` is only
    // looked up, never dereferenced by the kernel.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut mode,
            mask.as_mut_ptr(),
            MASK_BITS + 1,
            addr,
            MPOL_F_ADDR,
        )
    };
    if ret != 0 {
        return Err(io::Error::last_os_error());
    }
    // The mode word may carry MPOL_F_* flags in its high bits.
    let mode = NumaMode::from_mpol(mode & 0xffff).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("unknown policy mode {mode}"),
        )
    })?;
    let nodes = match mode {
        NumaMode::Default => Vec::new(),
        _ => (0..u32::try_from(MASK_BITS).expect("the node mask has 1024 bits"))
            .filter(|&n| mask[n as usize / 64] & (1 << (n % 64)) != 0)
            .collect(),
    };
    Ok(NumaPolicy { mode, nodes })
}

impl Region {
    /// The policy the kernel reports for this region's mapping (`get_mempolicy(MPOL_F_ADDR)`).
    pub fn numa_policy(&self) -> Result<NumaPolicy> {
        mapping_policy(self.host_addr()).map_err(|e| Error::os(self.spec(), "get_mempolicy", e))
    }
}

/// Where the region's pages are: bytes per host node. Pages that exist (`mincore`) are mapped
/// for reading (`MADV_POPULATE_READ`, which allocates nothing new), then asked page by page with
/// `move_pages` (no node list: query only). Pages never allocated are not counted.
pub fn node_pages(region: &Region) -> Result<BTreeMap<u32, u64>> {
    const BATCH: usize = 16384;
    let page = to_usize(region.backend().page_size());
    let base = region.host_addr();
    let count = to_usize(region.size()) / page;
    let os = |op, e| Error::os(region.spec(), op, e);
    let mut bytes = BTreeMap::new();
    let mut incore = vec![0u8; BATCH * page / to_usize(crate::PAGE_SIZE)];
    let mut status = vec![0 as libc::c_int; BATCH];
    for first in (0..count).step_by(BATCH) {
        let n = BATCH.min(count - first);
        // SAFETY: the batch lies inside the region's mapping.
        let start = unsafe { base.add(first * page) };
        // SAFETY: `incore` has one byte per 4 KiB page of the batch.
        if unsafe { libc::mincore(start.cast(), n * page, incore.as_mut_ptr()) } != 0 {
            return Err(os("mincore", io::Error::last_os_error()));
        }
        let per = page / to_usize(crate::PAGE_SIZE);
        let addrs: Vec<*mut libc::c_void> = (0..n)
            .filter(|i| incore[i * per] & 1 != 0)
            // SAFETY: inside the batch.
            .map(|i| unsafe { start.add(i * page) }.cast())
            .collect();
        for &addr in &addrs {
            // SAFETY: one page of the region's mapping that already exists: mapping it for
            // reading changes no byte and allocates nothing.
            if unsafe { libc::madvise(addr, page, libc::MADV_POPULATE_READ) } != 0 {
                return Err(os(
                    "madvise(MADV_POPULATE_READ)",
                    io::Error::last_os_error(),
                ));
            }
        }
        // SAFETY: `addrs` and `status` hold at least `addrs.len()` entries; a null node list
        // only queries.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_move_pages,
                0,
                addrs.len(),
                addrs.as_ptr(),
                std::ptr::null::<libc::c_int>(),
                status.as_mut_ptr(),
                0,
            )
        };
        if ret < 0 {
            return Err(os("move_pages", io::Error::last_os_error()));
        }
        for &s in &status[..addrs.len()] {
            if s >= 0 {
                *bytes.entry(s as u32).or_insert(0) += page as u64;
            }
        }
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_parse_and_print() {
        let p: NumaPolicy = "interleave:0-1,3".parse().unwrap();
        assert_eq!(p.mode, NumaMode::Interleave);
        assert_eq!(p.nodes, vec![0, 1, 3]);
        assert_eq!(p.to_string(), "interleave:0,1,3");
        assert_eq!(
            "default".parse::<NumaPolicy>().unwrap(),
            NumaPolicy::default()
        );
        let e = "spread:0".parse::<NumaPolicy>().unwrap_err();
        assert!(e.contains("unknown mode 'spread'"), "{e}");
        let e = "bind:x".parse::<NumaPolicy>().unwrap_err();
        assert!(e.contains("'x' is not a node number"), "{e}");
        let e = "bind:3-1".parse::<NumaPolicy>().unwrap_err();
        assert!(e.contains("'3-1'"), "{e}");
    }

    #[test]
    fn check_refuses_bad_node_lists() {
        let check = |s: &str| {
            s.parse::<NumaPolicy>()
                .unwrap()
                .check("r")
                .unwrap_err()
                .to_string()
        };
        assert!(check("bind").contains("names no node"));
        assert!(check("default:0").contains("takes no nodes"));
        assert!(check("preferred:0-1").contains("exactly one node"));
        let e = check("bind:1023");
        assert!(
            e.contains("region 'r'") && e.contains("host node 1023 does not exist"),
            "{e}"
        );
    }
}
