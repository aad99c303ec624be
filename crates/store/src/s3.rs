//! S3-compatible object storage through Apache Arrow's `object_store`, behind the blocking
//! [`ObjectStore`] interface: the back end owns a small tokio runtime and blocks on it, so that
//! nothing outside this module is async. The chunk writers and fetchers are plain threads,
//! each with one request in flight, so that several are in flight at once.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures::TryStreamExt;
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as ObjectPath;
use object_store::{ClientOptions, ObjectStore as ArrowObjectStore, PutPayload, RetryConfig};

use crate::objects::{ObjectInfo, ObjectStore};
use crate::{Error, Result};

/// A store in an S3 bucket, under a key prefix.
#[derive(Debug)]
pub struct S3ObjectStore {
    bucket: String,
    prefix: String,
    store: Arc<dyn ArrowObjectStore>,
    runtime: tokio::runtime::Runtime,
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
        let url = if prefix.is_empty() {
            format!("s3://{bucket}")
        } else {
            format!("s3://{bucket}/{prefix}")
        };
        S3ObjectStore::new(bucket, prefix, &S3Config::from_env(&url)?)
    }

    /// The store at `s3://bucket/prefix` as `config` says.
    pub fn new(bucket: &str, prefix: &str, config: &S3Config) -> Result<S3ObjectStore> {
        let url = if prefix.is_empty() {
            format!("s3://{bucket}")
        } else {
            format!("s3://{bucket}/{prefix}")
        };
        let endpoint = config.endpoint.clone();
        let mut builder = AmazonS3Builder::new()
            .with_bucket_name(bucket)
            .with_access_key_id(&config.access_key_id)
            .with_secret_access_key(&config.secret_access_key)
            .with_region(config.region.as_deref().unwrap_or("us-east-1"))
            .with_retry(RetryConfig {
                max_retries: 2,
                retry_timeout: Duration::from_secs(10),
                ..RetryConfig::default()
            })
            .with_client_options(
                ClientOptions::new()
                    .with_connect_timeout(Duration::from_secs(5))
                    .with_timeout(Duration::from_secs(60)),
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
        Ok(S3ObjectStore {
            bucket: bucket.to_string(),
            prefix: prefix.trim_matches('/').to_string(),
            store: Arc::new(store),
            runtime,
        })
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
        self.runtime
            .block_on(async {
                let got = self.store.get(&path).await?;
                got.bytes().await
            })
            .map(|b| b.to_vec())
            .map_err(self.err(key, "read"))
    }

    fn get_range(&self, key: &str, start: u64, len: u64) -> Result<Vec<u8>> {
        let path = self.path(key);
        let got = self
            .runtime
            .block_on(self.store.get_range(&path, start..start + len));
        match got {
            Ok(b) => Ok(b.to_vec()),
            Err(object_store::Error::NotFound { .. }) => Err(Error::Missing {
                store: self.describe(),
                key: key.to_string(),
            }),
            Err(e) => {
                // A range past the object's end is refused by the server: what is there
                // (maybe nothing) is the answer, for the caller to find short.
                let size = self
                    .runtime
                    .block_on(self.store.head(&path))
                    .map(|m| m.size);
                match size {
                    Ok(size) if size < start + len => {
                        if size <= start {
                            return Ok(Vec::new());
                        }
                        self.runtime
                            .block_on(self.store.get_range(&path, start..size))
                            .map(|b| b.to_vec())
                            .map_err(self.err(key, "read"))
                    }
                    _ => Err(self.err(key, "read")(e)),
                }
            }
        }
    }

    fn put(&self, key: &str, bytes: &[u8]) -> Result<()> {
        let path = self.path(key);
        let payload = PutPayload::from(bytes.to_vec());
        self.runtime
            .block_on(self.store.put(&path, payload))
            .map(|_| ())
            .map_err(self.err(key, "write"))
    }

    fn exists(&self, key: &str) -> Result<bool> {
        let path = self.path(key);
        match self.runtime.block_on(self.store.head(&path)) {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(self.err(key, "stat")(e)),
        }
    }

    fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        let path = self.path(prefix.trim_end_matches('/'));
        let strip = if self.prefix.is_empty() {
            String::new()
        } else {
            format!("{}/", self.prefix)
        };
        let metas: Vec<object_store::ObjectMeta> = self
            .runtime
            .block_on(self.store.list(Some(&path)).try_collect())
            .map_err(self.err(prefix, "list"))?;
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
        match self.runtime.block_on(self.store.delete(&path)) {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.err(key, "delete")(e)),
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
