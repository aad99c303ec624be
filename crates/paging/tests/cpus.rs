//! A pager whose threads are pinned to host CPUs ([`PagerConfig::cpus`]) serves the same bytes,
//! and every one of its threads runs on those CPUs only. (Its own test binary: the threads of
//! other tests' pagers, named alike, would be counted too.)

mod common;

use guestmem_sys::to_usize;
use std::sync::Arc;

use common::pattern_file;
use guestmem_memory::{Backend, GuestMemory, RegionSpec};
use guestmem_paging::{Error, FileSource, PageSource, Pager, PagerConfig};

const SIZE: u64 = 32 << 20;

/// `Cpus_allowed_list` of every thread of this process whose name starts with `prefix`.
fn allowed_cpus_of_threads(prefix: &str) -> Vec<String> {
    let mut lists = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").expect("list the threads") {
        let task = task.expect("a thread").path();
        let Ok(name) = std::fs::read_to_string(task.join("comm")) else {
            continue; // the thread exited meanwhile
        };
        let Ok(status) = std::fs::read_to_string(task.join("status")) else {
            continue;
        };
        if name.starts_with(prefix) {
            let list = status
                .lines()
                .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                .expect("status has Cpus_allowed_list");
            lists.push(list.trim().to_string());
        }
    }
    lists
}

#[test]
fn a_pager_pinned_to_cpu_0_serves_the_region_from_cpu_0() {
    for backend in [Backend::Anon, Backend::Memfd] {
        let file = pattern_file(SIZE);
        let source = Arc::new(FileSource::new(file).expect("map the file"));
        let mut expected = vec![0u8; to_usize(SIZE)];
        source.fetch(0, &mut expected).expect("read the file");
        let memory = GuestMemory::new(&[RegionSpec::new("ram", 0, SIZE, backend)], None)
            .expect("create the region");
        let region = memory.region("ram").expect("the region");
        // No background sweep: every thread stays until the pager is dropped.
        let config = PagerConfig {
            uffds: 2,
            handlers: 2,
            readahead_threads: 2,
            background: false,
            cpus: Some(vec![0]),
            ..PagerConfig::default()
        };
        let pager = Pager::start(region, source, &config).expect("start the pager");
        common::check_read_through(&memory, &pager, &expected, backend);
        // Two handlers and two readahead threads, all of which have served by now.
        assert_eq!(allowed_cpus_of_threads("uffd-"), ["0", "0", "0", "0"]);
        drop(pager);
    }
}

#[test]
fn a_cpu_the_process_may_not_run_on_is_refused_by_name() {
    let memory = GuestMemory::new(&[RegionSpec::new("ram", 0, 4 << 20, Backend::Anon)], None)
        .expect("create the region");
    let region = memory.region("ram").expect("the region");
    let source = Arc::new(FileSource::new(pattern_file(4 << 20)).expect("map the file"));
    for (cpus, named) in [(vec![0, 1023], "CPU 1023 "), (vec![4096], "CPU 4096 ")] {
        let config = PagerConfig {
            cpus: Some(cpus.clone()),
            ..PagerConfig::default()
        };
        match Pager::start(region, source.clone(), &config) {
            Err(e @ Error::Config { .. }) => {
                let e = e.to_string();
                assert!(
                    e.contains("region 'ram'") && e.contains(named),
                    "{cpus:?}: {e}"
                );
            }
            Err(e) => panic!("{cpus:?}: not a configuration error: {e}"),
            Ok(_) => panic!("{cpus:?}: a pager was started"),
        }
    }
    let empty = PagerConfig {
        cpus: Some(Vec::new()),
        ..PagerConfig::default()
    };
    assert!(matches!(
        Pager::start(region, source, &empty),
        Err(Error::Config { .. })
    ));
}
