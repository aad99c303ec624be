//! S3-compatible object storage through Apache Arrow's `object_store`, behind the blocking
//! [`ObjectStore`] interface: the back end owns a small tokio runtime and blocks on it, so that
//! nothing outside this module is async. The chunk writers and fetchers are plain threads,
//! each with one request in flight, so that several are in flight at once.
//!
//! Every request waits for its answer under the store timeout policy ([`crate::policy`]): a
//! stall is told within seconds, ridden out up to the bound, and fails the request at the
//! bound naming the store, the object and how long it waited.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use futures::TryStreamExt;
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as ObjectPath;
use object_store::{
    BackoffConfig, ClientOptions, ObjectStore as ArrowObjectStore, PutPayload, RetryConfig,
};

use crate::objects::{ObjectInfo, ObjectStore};
use crate::policy::{StoreOptions, Verdict, Watch, MAX_RETRIES};
use crate::{Error, Result};

/// A store in an S3 bucket, under a key prefix.
#[derive(Debug)]
pub struct S3ObjectStore {
    bucket: String,
    prefix: String,
    store: Arc<dyn ArrowObjectStore>,
    runtime: tokio::runtime::Runtime,
    watch: Watch,
}

/// Why a request failed: the store's answer (or the client's error), or no answer in time.
enum Failure {
    /// What the client returned.
    Store(object_store::Error),
    /// No answer: this request waited the first, the store had answered nothing for the
    /// second.
    Stalled(Duration, Duration),
}

/// Whether `e` is the store's own answer (an HTTP status), not a failure to get one.
fn answered(e: &object_store::Error) -> bool {
    match e {
        object_store::Error::NotFound { .. }
        | object_store::Error::PermissionDenied { .. }
        | object_store::Error::Unauthenticated { .. }
        | object_store::Error::Precondition { .. }
        | object_store::Error::AlreadyExists { .. }
        | object_store::Error::NotModified { .. } => true,
        e => {
            let text = crate::chain_text(e);
            text.contains("Server returned non-2xx status code")
                || text.contains("Server returned error response")
        }
    }
}

/// Whether `endpoint` (`http://HOST:PORT…`) names this host.
fn loopback(endpoint: &str) -> bool {
    let rest = endpoint
        .strip_prefix("http://")
        .or_else(|| endpoint.strip_prefix("https://"))
        .unwrap_or(endpoint);
    let host = rest.split('/').next().unwrap_or("");
    let host = match host.rsplit_once(':') {
        Some((h, port)) if port.chars().all(|c| c.is_ascii_digit()) => h,
        _ => host,
    };
    matches!(host, "localhost" | "[::1]")
        || host
            .parse::<std::net::Ipv4Addr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Where an S3 store is and who asks: what the AWS environment variables say.
#[derive(Debug, Clone, Default)]
pub struct S3Config {
    /// `AWS_ENDPOINT_URL` (none: AWS itself).
    pub endpoint: Option<String>,
    /// `AWS_ACCESS_KEY_ID`.
    pub access_key_id: String,
    /// `AWS_SECRET_ACCESS_KEY`.
    pub secret_access_key: String,
    /// `AWS_REGION` (default `us-east-1`).
    pub region: Option<String>,
}

impl S3Config {
    /// From `AWS_ENDPOINT_URL` (or `AWS_ENDPOINT`), `AWS_ACCESS_KEY_ID`,
    /// `AWS_SECRET_ACCESS_KEY` and `AWS_REGION` (or `AWS_DEFAULT_REGION`); missing credentials
    /// are refused naming the variables.
    pub fn from_env(url: &str) -> Result<S3Config> {
        let var = |n: &str| std::env::var(n).ok().filter(|v| !v.is_empty());
        let missing: Vec<&str> = ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]
            .into_iter()
            .filter(|v| var(v).is_none())
            .collect();
        if !missing.is_empty() {
            return Err(Error::Location(format!(
                "{url}: no credentials: set {}",
                missing.join(" and ")
            )));
        }
        Ok(S3Config {
            endpoint: var("AWS_ENDPOINT_URL").or_else(|| var("AWS_ENDPOINT")),
            access_key_id: var("AWS_ACCESS_KEY_ID").expect("checked"),
            secret_access_key: var("AWS_SECRET_ACCESS_KEY").expect("checked"),
            region: var("AWS_REGION").or_else(|| var("AWS_DEFAULT_REGION")),
        })
    }
}

impl S3ObjectStore {
    /// The store at `s3://bucket/prefix`, with the endpoint, region and credentials of the
    /// usual AWS environment variables (`AWS_ENDPOINT_URL`, `AWS_REGION`,
    /// `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`). Plain HTTP is allowed only to a
    /// loopback endpoint (a MinIO on this host).
    pub fn from_env(bucket: &str, prefix: &str) -> Result<S3ObjectStore> {
        S3ObjectStore::from_env_with(bucket, prefix, StoreOptions::default())
    }

    /// [`S3ObjectStore::from_env`] under `options` (the store timeout).
    pub fn from_env_with(
        bucket: &str,
        prefix: &str,
        options: StoreOptions,
    ) -> Result<S3ObjectStore> {
        let url = if prefix.is_empty() {
            format!("s3://{bucket}")
        } else {
            format!("s3://{bucket}/{prefix}")
        };
        S3ObjectStore::with_options(bucket, prefix, &S3Config::from_env(&url)?, options)
    }

    /// The store at `s3://bucket/prefix` as `config` says, under the default
    /// [`StoreOptions`].
    pub fn new(bucket: &str, prefix: &str, config: &S3Config) -> Result<S3ObjectStore> {
        S3ObjectStore::with_options(bucket, prefix, config, StoreOptions::default())
    }

    /// The store at `s3://bucket/prefix` as `config` says, its requests under `options`.
    /// The client's own timeouts sit just past the bound (the policy's watch fails a request
    /// first, saying so); it sends a request again only after a server error (5xx) or a
    /// dropped connection, at most [`MAX_RETRIES`] times and within the bound.
    pub fn with_options(
        bucket: &str,
        prefix: &str,
        config: &S3Config,
        options: StoreOptions,
    ) -> Result<S3ObjectStore> {
        options.check()?;
        let url = if prefix.is_empty() {
            format!("s3://{bucket}")
        } else {
            format!("s3://{bucket}/{prefix}")
        };
        let endpoint = config.endpoint.clone();
        let bound = options.timeout;
        let mut builder = AmazonS3Builder::new()
            .with_bucket_name(bucket)
            .with_access_key_id(&config.access_key_id)
            .with_secret_access_key(&config.secret_access_key)
            .with_region(config.region.as_deref().unwrap_or("us-east-1"))
            .with_retry(RetryConfig {
                max_retries: MAX_RETRIES,
                retry_timeout: bound,
                backoff: BackoffConfig {
                    init_backoff: Duration::from_millis(100),
                    max_backoff: (bound / 4).min(Duration::from_secs(2)),
                    base: 2.0,
                },
            })
            .with_client_options(
                ClientOptions::new()
                    .with_connect_timeout(bound.min(Duration::from_secs(5)))
                    .with_timeout(bound + Duration::from_secs(1)),
            );
        if let Some(endpoint) = &endpoint {
            builder = builder.with_endpoint(endpoint);
        }
        if let Some(endpoint) = &endpoint {
            if endpoint.starts_with("http://") {
                if !loopback(endpoint) {
                    return Err(Error::Location(format!(
                        "{url}: AWS_ENDPOINT_URL {endpoint} is plain http to another host; \
                         use https (plain http is allowed only on loopback)"
                    )));
                }
                builder = builder.with_allow_http(true);
            }
        }
        let store = builder.build().map_err(|source| Error::Setup {
            store: url.clone(),
            source: Box::new(source),
        })?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("s3-io")
            .enable_all()
            .build()
            .map_err(|source| Error::Io {
                store: url,
                key: String::new(),
                op: "start the I/O runtime for",
                source,
            })?;
        let prefix = prefix.trim_matches('/').to_string();
        let described = if prefix.is_empty() {
            format!("s3://{bucket}")
        } else {
            format!("s3://{bucket}/{prefix}")
        };
        Ok(S3ObjectStore {
            bucket: bucket.to_string(),
            prefix,
            store: Arc::new(store),
            runtime,
            watch: Watch::new(described, options),
        })
    }

    /// The options its requests run under.
    pub fn options(&self) -> &StoreOptions {
        self.watch.options()
    }

    /// Runs one request (`op` of `key`) to its answer under the store timeout policy: a stall
    /// is told once, ridden out up to the bound, then fails the request.
    fn call<T>(
        &self,
        key: &str,
        op: &'static str,
        request: impl Future<Output = object_store::Result<T>>,
    ) -> std::result::Result<T, Failure> {
        if let Err(silent) = self.watch.admit() {
            return Err(Failure::Stalled(Duration::ZERO, silent));
        }
        let start = Instant::now();
        let tick = (self.watch.options().probe() / 4)
            .clamp(Duration::from_millis(10), Duration::from_millis(250));
        self.runtime.block_on(async {
            let mut request = std::pin::pin!(request);
            loop {
                match tokio::time::timeout(tick, request.as_mut()).await {
                    Ok(Ok(v)) => {
                        self.watch.answered(key, op);
                        return Ok(v);
                    }
                    Ok(Err(e)) => {
                        if answered(&e) {
                            self.watch.answered(key, op);
                        }
                        return Err(Failure::Store(e));
                    }
                    Err(_) => {
                        if let Verdict::Fail(waited, silent) = self.watch.waiting(key, op, start) {
                            return Err(Failure::Stalled(waited, silent));
                        }
                    }
                }
            }
        })
    }

    /// Sorts a failed request into what a user must fix.
    fn fail(&self, key: &str, op: &'static str) -> impl FnOnce(Failure) -> Error {
        let err = self.err(key, op);
        let (store, key, timeout) = (self.describe(), key.to_string(), self.options().timeout);
        move |f| match f {
            Failure::Store(e) => err(e),
            Failure::Stalled(waited, silent) => Error::Stalled {
                store,
                key,
                op,
                waited_s: waited.as_secs_f64(),
                silent_s: silent.as_secs_f64(),
                timeout_s: timeout.as_secs_f64(),
            },
        }
    }

    fn path(&self, key: &str) -> ObjectPath {
        if self.prefix.is_empty() {
            ObjectPath::from(key)
        } else {
            ObjectPath::from(format!("{}/{key}", self.prefix))
        }
    }

    /// Sorts an `object_store` error into what a user must fix.
    fn err(&self, key: &str, op: &'static str) -> impl FnOnce(object_store::Error) -> Error {
        let (store, key) = (self.describe(), key.to_string());
        move |source| {
            let text = crate::chain_text(&source);
            let boxed = |s: object_store::Error| Box::new(s);
            match source {
                _ if text.contains("NoSuchBucket") => Error::NoBucket {
                    store,
                    key,
                    op,
                    source: boxed(source),
                },
                object_store::Error::NotFound { .. } => Error::Missing { store, key },
                object_store::Error::Unauthenticated { .. }
                | object_store::Error::PermissionDenied { .. } => Error::Credentials {
                    store,
                    key,
                    op,
                    source: boxed(source),
                },
                _ if [
                    "InvalidAccessKeyId",
                    "SignatureDoesNotMatch",
                    "AccessDenied",
                    "403 Forbidden",
                ]
                .iter()
                .any(|t| text.contains(t)) =>
                {
                    Error::Credentials {
                        store,
                        key,
                        op,
                        source: boxed(source),
                    }
                }
                _ if [
                    "error sending request",
                    "onnection refused",
                    "dns error",
                    "timed out",
                    "connect",
                ]
                .iter()
                .any(|t| text.contains(t)) =>
                {
                    Error::Unreachable {
                        store,
                        key,
                        op,
                        source: boxed(source),
                    }
                }
                _ => Error::Object {
                    store,
                    key,
                    op,
                    source: boxed(source),
                },
            }
        }
    }
}

impl ObjectStore for S3ObjectStore {
    fn describe(&self) -> String {
        if self.prefix.is_empty() {
            format!("s3://{}", self.bucket)
        } else {
            format!("s3://{}/{}", self.bucket, self.prefix)
        }
    }

    fn get(&self, key: &str) -> Result<Vec<u8>> {
        let path = self.path(key);
        self.call(key, "read", async {
            let got = self.store.get(&path).await?;
            got.bytes().await
        })
        .map(|b| b.to_vec())
        .map_err(self.fail(key, "read"))
    }

    fn get_range(&self, key: &str, start: u64, len: u64) -> Result<Vec<u8>> {
        let path = self.path(key);
        let got = self.call(key, "read", self.store.get_range(&path, start..start + len));
        match got {
            Ok(b) => Ok(b.to_vec()),
            Err(Failure::Store(object_store::Error::NotFound { .. })) => Err(Error::Missing {
                store: self.describe(),
                key: key.to_string(),
            }),
            // A range past the object's end is refused by the server (an answer): what is
            // there (maybe nothing) is the answer, for the caller to find short. A request
            // without an answer is not sent again.
            Err(Failure::Store(e)) if answered(&e) => {
                let size = self
                    .call(key, "stat", self.store.head(&path))
                    .map(|m| m.size);
                match size {
                    Ok(size) if size < start + len => {
                        if size <= start {
                            return Ok(Vec::new());
                        }
                        self.call(key, "read", self.store.get_range(&path, start..size))
                            .map(|b| b.to_vec())
                            .map_err(self.fail(key, "read"))
                    }
                    Err(f @ Failure::Stalled(..)) => Err(self.fail(key, "stat")(f)),
                    _ => Err(self.err(key, "read")(e)),
                }
            }
            Err(f) => Err(self.fail(key, "read")(f)),
        }
    }

    fn put(&self, key: &str, bytes: &[u8]) -> Result<()> {
        let path = self.path(key);
        let payload = PutPayload::from(bytes.to_vec());
        self.call(key, "write", self.store.put(&path, payload))
            .map(|_| ())
            .map_err(self.fail(key, "write"))
    }

    fn exists(&self, key: &str) -> Result<bool> {
        let path = self.path(key);
        match self.call(key, "stat", self.store.head(&path)) {
            Ok(_) => Ok(true),
            Err(Failure::Store(object_store::Error::NotFound { .. })) => Ok(false),
            Err(f) => Err(self.fail(key, "stat")(f)),
        }
    }

    fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        let path = self.path(prefix.trim_end_matches('/'));
        let strip = if self.prefix.is_empty() {
            String::new()
        } else {
            format!("{}/", self.prefix)
        };
        // Each page of the listing is a request of its own, under the bound.
        let mut listing = self.store.list(Some(&path));
        let mut metas: Vec<object_store::ObjectMeta> = Vec::new();
        while let Some(meta) = self
            .call(prefix, "list", listing.try_next())
            .map_err(self.fail(prefix, "list"))?
        {
            metas.push(meta);
        }
        let mut out: Vec<ObjectInfo> = metas
            .into_iter()
            .map(|m| {
                let full = m.location.to_string();
                let millis = m.last_modified.timestamp_millis().max(0) as u64;
                ObjectInfo {
                    key: full.strip_prefix(&strip).unwrap_or(&full).to_string(),
                    size: m.size,
                    modified: SystemTime::UNIX_EPOCH + Duration::from_millis(millis),
                }
            })
            .collect();
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    fn delete(&self, key: &str) -> Result<()> {
        let path = self.path(key);
        match self.call(key, "delete", self.store.delete(&path)) {
            Ok(()) | Err(Failure::Store(object_store::Error::NotFound { .. })) => Ok(()),
            Err(f) => Err(self.fail(key, "delete")(f)),
        }
    }

    fn remote(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_endpoints() {
        assert!(loopback("http://127.0.0.1:9000"));
        assert!(loopback("http://localhost:9000/"));
        assert!(!loopback("http://example.com:9000"));
        assert!(!loopback("http://127.0.0.1.example.com"));
    }
}
