//! Item 6: NUMA nodes and the mempolicy syscalls.

use std::fs;

use libc::c_void;

use super::util::{errno_name, io_error_name, last_errno, meminfo_value, read};
use super::{Numa, NumaNode, SyscallCheck};
use crate::uapi::{self};

pub(super) const NODE_DIR: &str = "/sys/devices/system/node";

/// NUMA nodes with their memory, and whether the memory-policy syscalls answer.
pub fn numa() -> Numa {
    Numa {
        nodes: numa_nodes(),
        get_mempolicy: get_mempolicy(),
        mbind: mbind(),
    }
}

pub(super) fn numa_nodes() -> Result<Vec<NumaNode>, String> {
    let dir = fs::read_dir(NODE_DIR).map_err(|e| format!("{NODE_DIR}: {}", io_error_name(&e)))?;
    let mut nodes = Vec::new();
    for entry in dir.flatten() {
        let Ok(name) = entry.file_name().into_string() else {
            continue;
        };
        let Some(id) = name
            .strip_prefix("node")
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let path = format!("{NODE_DIR}/{name}/meminfo");
        let text = read(&path)?;
        nodes.push(NumaNode {
            id,
            mem_total_kib: meminfo_value(&text, "MemTotal:", &path)?,
            mem_free_kib: meminfo_value(&text, "MemFree:", &path)?,
        });
    }
    if nodes.is_empty() {
        return Err(format!("{NODE_DIR}: no node* directories"));
    }
    nodes.sort_by_key(|n| n.id);
    Ok(nodes)
}

pub(super) fn get_mempolicy() -> SyscallCheck {
    let null = std::ptr::null_mut::<c_void>();
    // SAFETY: with null policy/nodemask pointers, maxnode 0, addr 0 and flags 0 the kernel
    // writes nothing and only looks up the calling task's policy.
    let ret = unsafe { libc::syscall(libc::SYS_get_mempolicy, null, null, 0usize, null, 0usize) };
    syscall_check("get_mempolicy(NULL, NULL, 0, NULL, 0)", ret)
}

pub(super) fn mbind() -> SyscallCheck {
    let null = std::ptr::null_mut::<c_void>();
    // SAFETY: an empty range (addr 0, len 0) with MPOL_DEFAULT and no nodemask: the kernel
    // validates the arguments and returns without touching any mapping.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_mbind,
            null,
            0usize,
            uapi::MPOL_DEFAULT,
            null,
            0usize,
            0u32,
        )
    };
    syscall_check("mbind(NULL, 0, MPOL_DEFAULT, NULL, 0, 0)", ret)
}

pub(super) fn syscall_check(call: &str, ret: libc::c_long) -> SyscallCheck {
    if ret == 0 {
        SyscallCheck {
            available: true,
            detail: format!("{call} = 0"),
        }
    } else {
        SyscallCheck {
            available: false,
            detail: format!("{call}: {}", errno_name(last_errno())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A syscall that returned 0 is available; one that failed is not, naming its errno.
    #[test]
    fn a_syscall_check_names_the_errno() {
        let ok = syscall_check("f()", 0);
        assert!(ok.available);
        assert_eq!(ok.detail, "f() = 0");
        // SAFETY: close(-1) only sets errno (EBADF).
        let ret = unsafe { libc::close(-1) };
        let failed = syscall_check("close(-1)", libc::c_long::from(ret));
        assert!(!failed.available);
        assert_eq!(failed.detail, "close(-1): EBADF");
        assert!(get_mempolicy().available, "{:?}", get_mempolicy());
    }
}
