//! Item 5: transparent huge pages and hugetlbfs.

use std::fs;

use super::util::{io_error_name, meminfo_value, read, read_u64};
use super::{HugePageSize, Hugetlb, Thp};

pub(super) const THP_DIR: &str = "/sys/kernel/mm/transparent_hugepage";

/// The selected THP modes for anonymous memory and shmem.
pub fn thp() -> Thp {
    Thp {
        enabled: selected_mode(&format!("{THP_DIR}/enabled")),
        shmem_enabled: selected_mode(&format!("{THP_DIR}/shmem_enabled")),
    }
}

/// The word in `[brackets]` of a sysfs mode file such as `always [madvise] never`.
pub(super) fn selected_mode(path: &str) -> Result<String, String> {
    let text = read(path)?;
    text.split_whitespace()
        .find_map(|w| w.strip_prefix('[').and_then(|w| w.strip_suffix(']')))
        .map(str::to_string)
        .ok_or_else(|| format!("{path}: no [selected] mode in {text:?}"))
}

pub(super) const HUGEPAGES_DIR: &str = "/sys/kernel/mm/hugepages";

/// hugetlbfs: default size, pool, free pages, mounts and per-size pools.
pub fn hugetlb() -> Hugetlb {
    let meminfo = read("/proc/meminfo");
    let field = |name: &str| {
        meminfo
            .clone()
            .and_then(|m| meminfo_value(&m, name, "/proc/meminfo"))
    };
    Hugetlb {
        default_size_kib: field("Hugepagesize:"),
        nr_hugepages: read_u64("/proc/sys/vm/nr_hugepages"),
        free_hugepages: field("HugePages_Free:"),
        hugetlbfs_mounts: hugetlbfs_mounts(),
        sizes: huge_page_sizes(),
    }
}

pub(super) fn hugetlbfs_mounts() -> Result<Vec<String>, String> {
    let mounts = read("/proc/mounts")?;
    Ok(mounts
        .lines()
        .filter_map(|line| {
            let mut f = line.split_whitespace();
            let (_src, target, fstype) = (f.next()?, f.next()?, f.next()?);
            (fstype == "hugetlbfs").then(|| target.to_string())
        })
        .collect())
}

pub(super) fn huge_page_sizes() -> Result<Vec<HugePageSize>, String> {
    let dir = fs::read_dir(HUGEPAGES_DIR)
        .map_err(|e| format!("{HUGEPAGES_DIR}: {}", io_error_name(&e)))?;
    let mut sizes: Vec<HugePageSize> = dir
        .filter_map(|entry| {
            let name = entry.ok()?.file_name().into_string().ok()?;
            let size_kib = name
                .strip_prefix("hugepages-")?
                .strip_suffix("kB")?
                .parse()
                .ok()?;
            Some(HugePageSize {
                size_kib,
                nr_hugepages: read_u64(&format!("{HUGEPAGES_DIR}/{name}/nr_hugepages")),
                free_hugepages: read_u64(&format!("{HUGEPAGES_DIR}/{name}/free_hugepages")),
            })
        })
        .collect();
    sizes.sort_by_key(|s| s.size_kib);
    Ok(sizes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The selected mode is the bracketed word; a file without one is refused quoting it.
    #[test]
    fn the_selected_mode_is_the_bracketed_word() {
        let path = std::env::temp_dir().join(format!("guestmem-thp-{}", std::process::id()));
        let p = path.to_str().unwrap();
        std::fs::write(&path, "always [madvise] never\n").unwrap();
        assert_eq!(selected_mode(p).unwrap(), "madvise");
        std::fs::write(&path, "always madvise never\n").unwrap();
        assert_eq!(
            selected_mode(p).unwrap_err(),
            format!("{p}: no [selected] mode in \"always madvise never\\n\"")
        );
        let _ = std::fs::remove_file(&path);
        let mode = thp().enabled.unwrap();
        assert!(
            ["always", "madvise", "never"].contains(&mode.as_str()),
            "{mode}"
        );
    }
}
