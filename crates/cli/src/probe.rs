//! `guestmem probe`: what the running kernel offers for guest memory, as JSON or as a table.

use guestmem_sys::probe::{BitFlags, Probe};
use guestmem_sys::uapi;

#[derive(clap::Args)]
pub struct Args {
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

pub fn main(args: Args) -> crate::Result<()> {
    let probe = guestmem_sys::probe::probe();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&probe)?);
    } else {
        print!("{}", table(&probe));
    }
    Ok(())
}

/// A human-readable table: one `name  value  (detail)` line per item.
pub fn table(p: &Probe) -> String {
    let mut rows: Vec<Row> = Vec::new();
    host_rows(p, &mut rows);
    kvm_rows(p, &mut rows);
    userfaultfd_rows(p, &mut rows);
    memory_rows(p, &mut rows);
    format_rows(&rows)
}

fn host_rows(p: &Probe, rows: &mut Vec<Row>) {
    let h = &p.host;
    rows.push(row_res("host.kernel_release", &h.kernel_release, |v| {
        (v.clone(), String::new())
    }));
    rows.push(row_res("host.page_size_bytes", &h.page_size_bytes, |v| {
        (v.to_string(), String::new())
    }));
    rows.push(row_res("host.online_cpus", &h.online_cpus, |v| {
        (v.to_string(), String::new())
    }));
    rows.push(match &h.kernel_tls {
        Ok(()) => row(
            "host.kernel_tls",
            "yes",
            "TCP migration connections hand their TLS records to the kernel",
        ),
        Err(e) => row(
            "host.kernel_tls",
            "absent",
            &format!("{e}: TLS records stay with rustls"),
        ),
    });
}

fn kvm_rows(p: &Probe, rows: &mut Vec<Row>) {
    let k = match &p.kvm {
        Ok(k) => k,
        Err(e) => {
            rows.push(row("kvm", "unavailable", e));
            rows.push(row("kvm.guest_memfd_write", "unknown", "needs /dev/kvm"));
            rows.push(row("kvm.userfault", "unknown", "needs /dev/kvm"));
            rows.push(row("kvm.guest_memfd_uffd", "unknown", "needs /dev/kvm"));
            return;
        }
    };
    rows.push(row(
        "kvm",
        "open",
        "/dev/kvm and a throw-away VM; caps asked on the VM fd",
    ));
    rows.push(row(
        "kvm.api_version",
        &k.api_version.to_string(),
        "KVM_GET_API_VERSION",
    ));
    rows.push(row_res("kvm.nr_memslots", &k.nr_memslots, |v| {
        (v.to_string(), "KVM_CAP_NR_MEMSLOTS".into())
    }));
    rows.push(row_res("kvm.user_memory2", &k.user_memory2, |v| {
        (yes_no(*v), format!("KVM_CAP_USER_MEMORY2 = {v}"))
    }));
    rows.push(row_res("kvm.guest_memfd", &k.guest_memfd, |v| {
        (yes_no(*v), format!("KVM_CAP_GUEST_MEMFD = {v}"))
    }));
    rows.push(row_res(
        "kvm.guest_memfd_flags",
        &k.guest_memfd_flags,
        |f| (format!("{:#x}", f.raw), joined(f)),
    ));
    rows.push(row_res(
        "kvm.manual_dirty_log_protect2",
        &k.manual_dirty_log_protect2,
        |f| (format!("{:#x}", f.raw), joined(f)),
    ));
    let entry = std::mem::size_of::<uapi::kvm_dirty_gfn>() as u64;
    rows.push(row_res(
        "kvm.dirty_log_ring_max_bytes",
        &k.dirty_log_ring_max_bytes,
        |v| {
            (
                v.to_string(),
                format!("{} entries of {entry} bytes per vCPU", v / entry),
            )
        },
    ));
    rows.push(row_res(
        "kvm.dirty_log_ring_acq_rel_max_bytes",
        &k.dirty_log_ring_acq_rel_max_bytes,
        |v| (v.to_string(), "KVM_CAP_DIRTY_LOG_RING_ACQ_REL".into()),
    ));
    rows.push(row_res("kvm.pre_fault_memory", &k.pre_fault_memory, |v| {
        (yes_no(*v), format!("KVM_CAP_PRE_FAULT_MEMORY = {v}"))
    }));
    let unknown = if k.unknown_caps_answering.is_empty() {
        "none".to_string()
    } else {
        k.unknown_caps_answering
            .iter()
            .map(|c| format!("{}={}", c.cap, c.answer))
            .collect::<Vec<_>>()
            .join(" ")
    };
    rows.push(row(
        "kvm.unknown_caps_answering",
        &unknown,
        "caps 245..=260, information only",
    ));
    rows.push(row_res(
        "kvm.guest_memfd_write",
        &p.guest_memfd_write,
        |w| {
            let value = match (w.present, w.flag) {
                (true, Some(f)) => format!("present (flag {f:#x})"),
                (true, None) => "present".to_string(),
                (false, _) => "absent".to_string(),
            };
            (value, w.detail.clone())
        },
    ));
    rows.push(row_res("kvm.userfault", &p.kvm_userfault, |u| {
        (present_absent(u.present), u.detail.clone())
    }));
    rows.push(row_res("kvm.guest_memfd_uffd", &p.guest_memfd_uffd, |u| {
        (present_absent(u.present()), u.detail.clone())
    }));
}

fn userfaultfd_rows(p: &Probe, rows: &mut Vec<Row>) {
    match &p.userfaultfd {
        Ok(u) => {
            let via = match &u.dev_userfaultfd_error {
                Some(e) => format!("/dev/userfaultfd failed: {e}"),
                None => "UFFDIO_API with features = 0".to_string(),
            };
            rows.push(row("uffd.opened_via", &u.opened_via, &via));
            rows.push(row(
                "uffd.features",
                &format!("{:#x}", u.features.raw),
                &joined(&u.features),
            ));
            rows.push(row(
                "uffd.ioctls",
                &format!("{:#x}", u.ioctls.raw),
                &joined(&u.ioctls),
            ));
        }
        Err(e) => rows.push(row("uffd", "unavailable", e)),
    }
}

fn memory_rows(p: &Probe, rows: &mut Vec<Row>) {
    let t = &p.thp;
    rows.push(row_res("thp.enabled", &t.enabled, |v| {
        (v.clone(), "anonymous memory".into())
    }));
    rows.push(row_res("thp.shmem_enabled", &t.shmem_enabled, |v| {
        (v.clone(), "shmem/memfd".into())
    }));
    let h = &p.hugetlb;
    rows.push(row_res(
        "hugetlb.default_size_kib",
        &h.default_size_kib,
        |v| (v.to_string(), "Hugepagesize".into()),
    ));
    rows.push(row_res("hugetlb.nr_hugepages", &h.nr_hugepages, |v| {
        (v.to_string(), "/proc/sys/vm/nr_hugepages".into())
    }));
    rows.push(row_res("hugetlb.free_hugepages", &h.free_hugepages, |v| {
        (v.to_string(), "HugePages_Free".into())
    }));
    rows.push(row_res(
        "hugetlb.hugetlbfs_mounts",
        &h.hugetlbfs_mounts,
        |m| {
            if m.is_empty() {
                ("none".into(), "no hugetlbfs in /proc/mounts".into())
            } else {
                (m.join(" "), String::new())
            }
        },
    ));
    match &h.sizes {
        Ok(sizes) => {
            for s in sizes {
                let value = format!(
                    "nr {} free {}",
                    res_str(&s.nr_hugepages),
                    res_str(&s.free_hugepages)
                );
                rows.push(row(
                    &format!("hugetlb.size_{}_kib", s.size_kib),
                    &value,
                    "/sys/kernel/mm/hugepages",
                ));
            }
        }
        Err(e) => rows.push(row("hugetlb.sizes", "unknown", e)),
    }
    match &p.numa.nodes {
        Ok(nodes) => {
            for n in nodes {
                let value = format!("total {} KiB, free {} KiB", n.mem_total_kib, n.mem_free_kib);
                rows.push(row(
                    &format!("numa.node{}", n.id),
                    &value,
                    "MemTotal, MemFree",
                ));
            }
        }
        Err(e) => rows.push(row("numa.nodes", "unknown", e)),
    }
    for (name, c) in [
        ("numa.get_mempolicy", &p.numa.get_mempolicy),
        ("numa.mbind", &p.numa.mbind),
    ] {
        let value = if c.available {
            "available"
        } else {
            "unavailable"
        };
        rows.push(row(name, value, &c.detail));
    }
}

/// A bitmask's names joined by `|`, or `none`.
fn joined(flags: &BitFlags) -> String {
    if flags.names.is_empty() {
        "none".to_string()
    } else {
        flags.names.join("|")
    }
}

fn yes_no(v: u64) -> String {
    if v != 0 { "yes" } else { "no" }.to_string()
}

fn present_absent(present: bool) -> String {
    if present { "present" } else { "absent" }.to_string()
}

fn res_str<T: ToString>(r: &Result<T, String>) -> String {
    match r {
        Ok(v) => v.to_string(),
        Err(_) => "?".to_string(),
    }
}

/// One table line: name, value, detail.
type Row = (String, String, String);

fn row(name: &str, value: &str, detail: &str) -> Row {
    (name.to_string(), value.to_string(), detail.to_string())
}

fn row_res<T>(name: &str, r: &Result<T, String>, show: impl FnOnce(&T) -> (String, String)) -> Row {
    match r {
        Ok(v) => {
            let (value, detail) = show(v);
            (name.to_string(), value, detail)
        }
        Err(e) => row(name, "error", e),
    }
}

fn format_rows(rows: &[Row]) -> String {
    let name_w = rows.iter().map(|r| r.0.len()).max().unwrap_or(0);
    // Long values (the kernel release) would push every detail far right: cap the column.
    let value_w = rows
        .iter()
        .map(|r| r.1.len())
        .filter(|&w| w <= 24)
        .max()
        .unwrap_or(0);
    let mut out = String::new();
    for (name, value, detail) in rows {
        let line = if detail.is_empty() {
            format!("{name:<name_w$}  {value}")
        } else {
            format!("{name:<name_w$}  {value:<value_w$}  ({detail})")
        };
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_has_one_line_per_item() {
        let t = table(&guestmem_sys::probe::probe());
        for name in [
            "host.kernel_release",
            "thp.enabled",
            "hugetlb.default_size_kib",
            "numa.get_mempolicy",
        ] {
            assert!(
                t.lines().any(|l| l.starts_with(name)),
                "no {name} line in\n{t}"
            );
        }
    }

    #[test]
    fn rows_line_up_and_errors_show_as_error() {
        let rows = vec![
            row("a", "yes", ""),
            row_res::<u64>("long.name", &Err("EPERM".into()), |_| unreachable!()),
            row_res("b", &Ok(3u64), |v| (v.to_string(), "three".into())),
        ];
        assert_eq!(
            format_rows(&rows),
            "a          yes\nlong.name  error  (EPERM)\nb          3      (three)\n"
        );
        assert_eq!(
            joined(&BitFlags {
                raw: 0,
                names: vec![]
            }),
            "none"
        );
        assert_eq!(
            joined(&BitFlags {
                raw: 3,
                names: vec!["A".into(), "B".into()]
            }),
            "A|B"
        );
    }
}
