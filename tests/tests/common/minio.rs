//! A real MinIO server for one test: started on a free loopback port with its own data
//! directory and a bucket, killed and removed on drop. MinIO is built by `scripts/setup.sh`;
//! without it the test fails, saying so (it is never skipped silently).

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const USER: &str = "guestmem-test";
pub const PASSWORD: &str = "guestmem-test-secret";

pub struct Minio {
    child: Child,
    dir: PathBuf,
    pub port: u16,
    pub bucket: String,
}

/// The MinIO binary: `$GUESTMEM_MINIO`, else where `scripts/setup.sh` builds it, else `minio`
/// on the PATH.
pub fn binary() -> PathBuf {
    if let Some(p) = std::env::var_os("GUESTMEM_MINIO") {
        return PathBuf::from(p);
    }
    let built = PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
        .join(".cache/guestmem/bin/minio");
    if built.exists() {
        return built;
    }
    if let Some(p) = std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|d| d.join("minio"))
        .find(|p| p.exists())
    {
        return p;
    }
    panic!(
        "MinIO is not built ({} is missing, and no minio on the PATH): run scripts/setup.sh, \
         which builds it (about 3-4 minutes), or set GUESTMEM_MINIO to a minio binary",
        built.display()
    );
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Minio {
    /// Starts MinIO with one bucket, `bucket`, and waits until it answers.
    pub fn start(bucket: &str) -> Minio {
        Minio::start_in(bucket, &std::env::temp_dir())
    }

    /// [`Minio::start`] with its directory (data and log) made inside `parent`, e.g. on a
    /// small file system.
    pub fn start_in(bucket: &str, parent: &std::path::Path) -> Minio {
        let bin = binary();
        let dir = parent.join(format!(
            "guestmem-minio-{}-{}",
            std::process::id(),
            free_port()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        // A top-level directory of the data directory is a bucket to a single-drive MinIO.
        std::fs::create_dir_all(dir.join("data").join(bucket)).unwrap();
        for attempt in 0..5 {
            let port = free_port();
            let console = free_port();
            let log = std::fs::File::create(dir.join("minio.log")).unwrap();
            let child = Command::new(&bin)
                .args(["server", "--quiet", "--address"])
                .arg(format!("127.0.0.1:{port}"))
                .arg("--console-address")
                .arg(format!("127.0.0.1:{console}"))
                .arg(dir.join("data"))
                .env("MINIO_ROOT_USER", USER)
                .env("MINIO_ROOT_PASSWORD", PASSWORD)
                .env("MINIO_BROWSER", "off")
                .stdin(Stdio::null())
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .unwrap_or_else(|e| panic!("start {}: {e}", bin.display()));
            let mut m = Minio {
                child,
                dir: dir.clone(),
                port,
                bucket: bucket.to_string(),
            };
            if m.wait_live(Duration::from_secs(30)) {
                return m;
            }
            eprintln!(
                "MinIO attempt {attempt} on port {port} did not come up: {}",
                std::fs::read_to_string(dir.join("minio.log")).unwrap_or_default()
            );
            let _ = m.child.kill();
            let _ = m.child.wait();
            std::mem::forget(m);
        }
        panic!(
            "MinIO did not start; see {}",
            dir.join("minio.log").display()
        );
    }

    fn wait_live(&mut self, timeout: Duration) -> bool {
        let start = Instant::now();
        while start.elapsed() < timeout {
            if let Ok(Some(_)) = self.child.try_wait() {
                return false;
            }
            if let Ok(mut s) = TcpStream::connect(("127.0.0.1", self.port)) {
                let req = format!(
                    "GET /minio/health/ready HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nConnection: close\r\n\r\n",
                    self.port
                );
                let mut resp = String::new();
                if s.write_all(req.as_bytes()).is_ok()
                    && s.read_to_string(&mut resp).is_ok()
                    && resp.starts_with("HTTP/1.1 200")
                {
                    return true;
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        false
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The AWS environment a client of this server needs.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT_URL", self.endpoint()),
            ("AWS_ACCESS_KEY_ID", USER.to_string()),
            ("AWS_SECRET_ACCESS_KEY", PASSWORD.to_string()),
            ("AWS_REGION", "us-east-1".to_string()),
        ]
    }

    /// Stops the server's process (SIGSTOP): its connections stay open and nothing answers.
    pub fn freeze(&self) {
        self.signal("-STOP");
    }

    /// Lets a frozen server go on (SIGCONT): it answers what it was sent meanwhile.
    pub fn thaw(&self) {
        self.signal("-CONT");
    }

    /// Sends `sig` to the server's process (our child, not reaped: no other has its pid).
    fn signal(&self, sig: &str) {
        let pid = self.child.id().to_string();
        let s = Command::new("kill").args([sig, &pid]).status().unwrap();
        assert!(s.success(), "kill {sig} {pid}: {s}");
    }

    /// The data directory's file for an object (to damage or remove it behind MinIO's back
    /// is not possible: MinIO keeps its own format), so tests go through the S3 API instead.
    pub fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }
}

impl Drop for Minio {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
