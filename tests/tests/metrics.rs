//! The restore service's metrics (`RestoreService::with_metrics`, served by `MetricsServer` on
//! a Unix socket) scraped under a few lazy restores: the counters equal the sums of the
//! restores' own final progress records and of their pagers' statistics, the pool and the
//! recycles are counted.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use common::{snapshot_running_vm, TempDir};
use guestmem_events::{Event, Metrics, MetricsAddr, MetricsServer, Sink, Status};
use guestmem_memory::Backend;
use guestmem_paging::PagerConfig;
use guestmem_snapshot::service::RestoreService;
use guestmem_snapshot::Snapshot;
use guestmem_vm::VmConfig;

const RAM: u64 = 32 << 20;

fn scrape(socket: &std::path::Path) -> String {
    let mut c = UnixStream::connect(socket).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(c, "GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n").unwrap();
    let mut text = String::new();
    c.read_to_string(&mut text).unwrap();
    assert!(text.starts_with("HTTP/1.1 200 OK"), "{text}");
    text.split("\r\n\r\n").nth(1).unwrap().to_string()
}

fn value(text: &str, series: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {series} in:\n{text}"))
}

#[test]
#[cfg_attr(not(all(kvm, uffd)), ignore = "needs /dev/kvm and userfaultfd")]
fn restore_service_metrics_count_its_restores() {
    let dir = TempDir::new("metrics");
    snapshot_running_vm(&VmConfig::simple(2, RAM, Backend::Anon), RAM, &dir.0);
    let metrics = Metrics::new();
    let socket = dir.0.join("metrics.sock");
    let _server =
        MetricsServer::start(metrics.clone(), &MetricsAddr::Unix(socket.clone())).unwrap();
    let (sink, records) = Sink::channel();
    let service = RestoreService::new(Snapshot::open(&dir.0).unwrap(), PagerConfig::default())
        .unwrap()
        .with_events(sink.every(Duration::from_millis(10)))
        .with_metrics(metrics.clone());
    service.fill(2).unwrap();
    assert_eq!(value(&scrape(&socket), "guestmem_restore_pool_size"), 2.0);

    let mut faults = 0;
    for i in 0..3 {
        let mut clone = service.restore().unwrap();
        let running = clone.lazy.vm.resume().unwrap();
        std::thread::sleep(Duration::from_millis(100));
        running.stop();
        running.wait(Duration::from_secs(30)).unwrap();
        for p in &clone.lazy.pagers {
            assert!(p.wait_resident(Duration::from_secs(60)).unwrap());
        }
        clone.progress.as_mut().unwrap().finish();
        faults += clone
            .lazy
            .pagers
            .iter()
            .map(|p| p.stats().faults)
            .sum::<u64>();
        if i == 0 {
            service.recycle(clone.lazy).unwrap();
        }
    }
    let finals: Vec<Event> = records.try_iter().filter(|e| e.status.is_final()).collect();
    assert_eq!(finals.len(), 3, "{finals:?}");
    assert!(finals.iter().all(|e| e.status == Status::Completed));
    // Each restore's records carry its own session number, in the order they began.
    let sessions: Vec<u64> = finals.iter().map(|e| e.session.unwrap()).collect();
    assert!(
        sessions.windows(2).all(|w| w[1] == w[0] + 1),
        "{sessions:?}"
    );
    let text = scrape(&socket);
    let op = "{operation=\"restore\"}";
    assert_eq!(
        value(
            &text,
            "guestmem_operations_total{operation=\"restore\",status=\"completed\"}"
        ),
        3.0
    );
    let sum = |f: fn(&Event) -> u64| finals.iter().map(f).sum::<u64>() as f64;
    assert_eq!(
        value(&text, &format!("guestmem_page_faults_total{op}")),
        sum(|e| e.faults.unwrap())
    );
    assert_eq!(sum(|e| e.faults.unwrap()), faults as f64);
    assert_eq!(
        value(&text, &format!("guestmem_chunks_fetched_total{op}")),
        sum(|e| e.chunks_fetched.unwrap())
    );
    assert_eq!(
        value(&text, &format!("guestmem_data_processed_bytes_total{op}")),
        sum(|e| e.bytes_transferred)
    );
    assert_eq!(
        value(
            &text,
            &format!("guestmem_operation_duration_seconds_count{op}")
        ),
        3.0
    );
    assert_eq!(value(&text, "guestmem_restore_recycles_total"), 1.0);
    // Two pooled, three restores, one recycled back: none left.
    assert_eq!(value(&text, "guestmem_restore_pool_size"), 0.0);
}
