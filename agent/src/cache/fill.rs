//! Filling the node model cache from an S3-compatible store with the `object_store` crate
//! (its signing, ranged GETs, and retries with backoff; no hand-written HTTP): the objects
//! under the prefix are listed, the cap and the disk make room ([`Cache::make_room`]), each
//! object is fetched in parallel ranged GETs that carry the listed ETag (`If-Match`, so an
//! object replaced mid-download fails as [`Fault::ObjectChanged`] instead of mixing two
//! versions), every chunk is synced and journalled so a restarted agent resumes, and the
//! finished files are checked (size, MD5 against a single-part ETag, safetensors headers)
//! before the copy is published whole.

use std::collections::BTreeSet;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as ObjectPath;
use object_store::{BackoffConfig, GetOptions, GetRange, ObjectMeta, ObjectStore, RetryConfig};

use super::journal::{self, Journal};
use super::{Cache, Fault, FileEntry, Manifest, StageError, Staged};

/// Credentials for the store, from the deployment's Secret. Their `Debug` shows no secret.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    pub access_key_id: String,
    pub secret_access_key: String,
    pub session_token: Option<String>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Credentials(<redacted>)")
    }
}

/// An S3 source with its credentials resolved.
#[derive(Clone, Debug)]
pub struct Source {
    pub spec: crds::S3Source,
    pub credentials: Option<Credentials>,
}

impl Source {
    /// The cache key of this source ([`key_of`]).
    pub fn key(&self) -> String {
        key_of(&self.spec)
    }

    fn store(&self) -> Staged<Arc<dyn ObjectStore>> {
        let s = &self.spec;
        let mut b = AmazonS3Builder::new()
            .with_bucket_name(&s.bucket)
            .with_region(s.region.as_deref().unwrap_or("us-east-1"))
            .with_virtual_hosted_style_request(!s.path_style)
            .with_retry(RetryConfig {
                backoff: BackoffConfig {
                    init_backoff: Duration::from_millis(100),
                    max_backoff: Duration::from_secs(15),
                    base: 2.0,
                },
                max_retries: 5,
                retry_timeout: Duration::from_secs(120),
            });
        if let Some(e) = &s.endpoint {
            b = b.with_endpoint(e).with_allow_http(e.starts_with("http://"));
        }
        b = match &self.credentials {
            Some(c) => {
                let b = b
                    .with_access_key_id(&c.access_key_id)
                    .with_secret_access_key(&c.secret_access_key);
                match &c.session_token {
                    Some(t) => b.with_token(t),
                    None => b,
                }
            }
            None => b.with_skip_signature(true),
        };
        let store = b.build().map_err(|e| {
            StageError::new(
                Fault::StoreUnavailable,
                format!("{}: {e}", self.spec.describe()),
            )
        })?;
        Ok(Arc::new(store))
    }
}

/// The cache key of a source: the bucket and prefix, readable, and a hash over the
/// endpoint, bucket and prefix (two stores' same-named buckets are two copies).
pub fn key_of(s: &crds::S3Source) -> String {
    let ident = format!(
        "{}\n{}\n{}",
        s.endpoint.as_deref().unwrap_or(""),
        s.bucket,
        s.prefix.trim_matches('/')
    );
    // FNV-1a: stable across builds, unlike the standard hasher.
    let hash = ident.bytes().fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    });
    let readable: String = format!("{}-{}", s.bucket, s.prefix.trim_matches('/'))
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .take(80)
        .collect();
    format!("{readable}-{hash:016x}")
}

/// How a fill cuts and runs its requests.
#[derive(Clone, Copy, Debug)]
pub struct FillOptions {
    /// Bytes per ranged GET (the resume granularity).
    pub chunk_bytes: u64,
    /// Ranged GETs in flight at once, over all files.
    pub parallel: usize,
}

impl Default for FillOptions {
    fn default() -> Self {
        FillOptions {
            chunk_bytes: 16 << 20,
            parallel: 8,
        }
    }
}

/// Bytes of a fill so far, shared with whoever reports progress.
#[derive(Debug, Default)]
pub struct Progress {
    /// Bytes of the model on disk (resumed chunks count at once).
    pub done: AtomicU64,
    /// Bytes of the model in all (0 until listed).
    pub total: AtomicU64,
}

/// Fills the cache with `source`'s copy, or finds it there, and returns its folder. The
/// copies in `referenced` are never evicted to make room.
pub async fn fill(
    cache: &Cache,
    source: &Source,
    referenced: &BTreeSet<String>,
    opts: FillOptions,
    progress: &Progress,
) -> Staged<PathBuf> {
    let key = source.key();
    if let Some(dir) = cache.lookup(&key) {
        let manifest = cache.manifest(&key)?;
        readable(source, &manifest).await?;
        let bytes = manifest.bytes();
        progress.total.store(bytes, Ordering::Relaxed);
        progress.done.store(bytes, Ordering::Relaxed);
        return Ok(dir);
    }
    let store = source.store()?;
    let what = source.spec.describe();
    let files = list(store.as_ref(), &source.spec, &what).await?;
    let total: u64 = files.iter().map(|(_, f)| f.size).sum();
    progress.total.store(total, Ordering::Relaxed);
    let partial = cache.partial_dir(&key);
    std::fs::create_dir_all(&partial).map_err(|e| StageError::io(&partial, e))?;
    let on_disk: u64 = super::dir_bytes(&partial);
    cache.make_room(&key, total.saturating_sub(on_disk), referenced)?;
    let chunk = opts.chunk_bytes.max(1);
    let mut jobs = Vec::new();
    for (meta, entry) in &files {
        let path = partial.join(&entry.path);
        let (journal, done) = Journal::open(
            &partial,
            &entry.path,
            entry.etag.as_deref(),
            entry.size,
            chunk,
        )
        .map_err(|e| StageError::io(&path, e))?;
        if done.is_empty() {
            // A fresh journal: whatever the file held was of another object or chunking.
            let _ = std::fs::remove_file(&path);
        }
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| StageError::io(dir, e))?;
        }
        let file = File::options()
            .create(true)
            .write(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| StageError::io(&path, e))?;
        file.set_len(entry.size)
            .map_err(|e| StageError::io(&path, e))?;
        let chunks = entry.size.div_ceil(chunk);
        let resumed: u64 = done.iter().map(|i| chunk_len(*i, chunk, entry.size)).sum();
        progress.done.fetch_add(resumed, Ordering::Relaxed);
        jobs.push(FileJob {
            meta: meta.clone(),
            path,
            file: Arc::new(file),
            journal: Arc::new(std::sync::Mutex::new(journal)),
            missing: (0..chunks).filter(|i| !done.contains(i)).collect(),
        });
    }
    let store = store.as_ref();
    // (file, chunk) pairs by value: a stream of closures over borrowed jobs would make the
    // fill's future fail the `Send` check of a spawned task (a higher-ranked lifetime).
    let work: Vec<(usize, u64)> = jobs
        .iter()
        .enumerate()
        .flat_map(|(j, job)| job.missing.iter().map(move |i| (j, *i)))
        .collect();
    let jobs = &jobs;
    futures::stream::iter(work)
        .map(|(j, i)| fetch_chunk(store, &jobs[j], i, chunk, progress))
        .buffer_unordered(opts.parallel.max(1))
        .try_collect::<Vec<()>>()
        .await?;
    for (_, entry) in &files {
        let path = partial.join(&entry.path);
        if let Err(e) = verify(&path, entry) {
            // A file that fails its check is discarded with its journal: the next fill
            // fetches it whole instead of finding the same bad bytes journalled as done.
            let _ = journal::forget(&partial, &entry.path);
            let _ = std::fs::remove_file(&path);
            return Err(e);
        }
    }
    let manifest = Manifest {
        source: what,
        files: files.into_iter().map(|(_, f)| f).collect(),
    };
    cache.publish(&key, &manifest)
}

/// Checks that `source`'s credentials may read the store before its copy, which another
/// request may have staged with other credentials, is handed out: a HEAD of one of its files.
/// A store that cannot be reached does not take a node's copy away (it was verified when
/// staged); a refusal (credentials, bucket, object) does.
async fn readable(source: &Source, manifest: &Manifest) -> Staged<()> {
    let Some(first) = manifest.files.first() else {
        return Ok(());
    };
    let store = source.store()?;
    let prefix = source.spec.prefix.trim_matches('/');
    let key = match prefix {
        "" => first.path.clone(),
        p => format!("{p}/{}", first.path),
    };
    match store.head(&ObjectPath::from(key.as_str())).await {
        Ok(_) => Ok(()),
        Err(e) => match store_error(&source.spec.describe(), e) {
            e if e.fault == Fault::StoreUnavailable => Ok(()),
            e => Err(e),
        },
    }
}

/// One file being downloaded: its object, its open file and journal, the chunks to fetch.
struct FileJob {
    meta: ObjectMeta,
    path: PathBuf,
    file: Arc<File>,
    journal: Arc<std::sync::Mutex<Journal>>,
    missing: Vec<u64>,
}

fn chunk_len(index: u64, chunk: u64, size: u64) -> u64 {
    (size - index * chunk).min(chunk)
}

/// Fetches chunk `index` of `job` with a ranged GET that must match the listed ETag, writes
/// and syncs it, then journals it.
async fn fetch_chunk(
    store: &dyn ObjectStore,
    job: &FileJob,
    index: u64,
    chunk: u64,
    progress: &Progress,
) -> Staged<()> {
    let start = index * chunk;
    let end = start + chunk_len(index, chunk, job.meta.size);
    let opts = GetOptions {
        range: Some(GetRange::Bounded(start..end)),
        if_match: job.meta.e_tag.clone(),
        ..Default::default()
    };
    let key = job.meta.location.to_string();
    let bytes = async {
        store
            .get_opts(&job.meta.location, opts)
            .await?
            .bytes()
            .await
    }
    .await
    .map_err(|e| store_error(&key, e))?;
    if bytes.len() as u64 != end - start {
        return Err(StageError::new(
            Fault::IntegrityMismatch,
            format!(
                "object {key}: bytes {start}..{end} came back as {} bytes (the object is shorter than listed)",
                bytes.len()
            ),
        ));
    }
    let (file, journal, path) = (job.file.clone(), job.journal.clone(), job.path.clone());
    tokio::task::spawn_blocking(move || -> std::io::Result<()> {
        file.write_all_at(&bytes, start)?;
        file.sync_data()?;
        journal.lock().expect("journal lock").done(index)
    })
    .await
    .expect("the chunk writer does not panic")
    .map_err(|e| StageError::io(&path, e))?;
    progress.done.fetch_add(end - start, Ordering::Relaxed);
    Ok(())
}

/// The objects under the source's prefix, as files of the pipeline folder.
async fn list(
    store: &dyn ObjectStore,
    spec: &crds::S3Source,
    what: &str,
) -> Staged<Vec<(ObjectMeta, FileEntry)>> {
    let prefix = spec.prefix.trim_matches('/');
    let listed: Vec<ObjectMeta> = store
        .list(
            (!prefix.is_empty())
                .then(|| ObjectPath::from(prefix))
                .as_ref(),
        )
        .try_collect()
        .await
        .map_err(|e| store_error(what, e))?;
    let mut files = Vec::new();
    for meta in listed {
        let key = meta.location.to_string();
        let rel = if prefix.is_empty() {
            key.as_str()
        } else {
            key.strip_prefix(prefix)
                .and_then(|r| r.strip_prefix('/'))
                .unwrap_or(&key)
        };
        if rel.is_empty() || rel.ends_with('/') {
            continue; // a folder marker
        }
        let safe = Path::new(rel)
            .components()
            .all(|c| matches!(c, Component::Normal(_)))
            && !rel.split('/').any(journal::is_journal)
            && rel != super::MANIFEST;
        if !safe {
            return Err(StageError::new(
                Fault::IntegrityMismatch,
                format!("{what}: object {key} is not a plain path inside the prefix"),
            ));
        }
        let entry = FileEntry {
            path: rel.to_string(),
            size: meta.size,
            etag: meta.e_tag.clone(),
        };
        files.push((meta, entry));
    }
    if files.is_empty() {
        return Err(StageError::new(
            Fault::ObjectNotFound,
            format!("{what}: no objects under the prefix"),
        ));
    }
    files.sort_by(|a, b| a.1.path.cmp(&b.1.path));
    Ok(files)
}

/// Checks a downloaded file against its listing: its size, its MD5 where the ETag is a
/// single-part upload's (32 hex digits), and a safetensors file's header.
fn verify(path: &Path, entry: &FileEntry) -> Staged<()> {
    let bad =
        |msg: String| StageError::new(Fault::IntegrityMismatch, format!("{}: {msg}", entry.path));
    let len = std::fs::metadata(path)
        .map_err(|e| StageError::io(path, e))?
        .len();
    if len != entry.size {
        return Err(bad(format!(
            "{len} bytes on disk, the store listed {}",
            entry.size
        )));
    }
    if let Some(md5) = entry.etag.as_deref().and_then(single_part_md5) {
        let got = md5_of(path).map_err(|e| StageError::io(path, e))?;
        if got != md5 {
            return Err(bad(format!(
                "MD5 {got} does not match the store's ETag {md5}: the object is corrupt in the store or was corrupted in transit"
            )));
        }
    }
    if entry.path.ends_with(".safetensors") {
        layerwise_core::checkpoint::Header::read(path).map_err(|e| bad(e.to_string()))?;
    }
    Ok(())
}

/// The MD5 an ETag states, where it is a single-part upload's (a multipart ETag, `…-N`, is
/// not a digest of the content).
fn single_part_md5(etag: &str) -> Option<String> {
    let e = etag.trim_matches('"').to_ascii_lowercase();
    (e.len() == 32 && e.bytes().all(|b| b.is_ascii_hexdigit())).then_some(e)
}

fn md5_of(path: &Path) -> std::io::Result<String> {
    use md5::{Digest, Md5};
    use std::io::Read;
    let mut f = File::open(path)?;
    let mut h = Md5::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(format!("{:x}", h.finalize()))
}

/// The fault a store error is: the one mapping from `object_store`'s errors (and the S3
/// error codes they carry) to the reasons conditions name.
fn store_error(what: &str, e: object_store::Error) -> StageError {
    use object_store::Error as E;
    let text = e.to_string();
    let fault = match &e {
        E::Precondition { .. } => Fault::ObjectChanged,
        E::PermissionDenied { .. } | E::Unauthenticated { .. } => Fault::AccessDenied,
        _ if text.contains("NoSuchBucket") => Fault::NoSuchBucket,
        _ if [
            "AccessDenied",
            "InvalidAccessKeyId",
            "SignatureDoesNotMatch",
            "Forbidden",
        ]
        .iter()
        .any(|c| text.contains(c)) =>
        {
            Fault::AccessDenied
        }
        E::NotFound { .. } => Fault::ObjectNotFound,
        _ => Fault::StoreUnavailable,
    };
    StageError::new(fault, format!("{what}: {text}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_single_part_etags_are_digests() {
        assert_eq!(
            single_part_md5("\"9E107D9D372BB6826BD81D3542A419D6\"").as_deref(),
            Some("9e107d9d372bb6826bd81d3542a419d6")
        );
        assert_eq!(
            single_part_md5("\"9e107d9d372bb6826bd81d3542a419d6-3\""),
            None
        );
        assert_eq!(single_part_md5("abc"), None);
    }

    #[test]
    fn keys_are_stable_readable_and_tell_stores_apart() {
        let src = |endpoint: Option<&str>| Source {
            spec: crds::S3Source {
                endpoint: endpoint.map(String::from),
                bucket: "models".into(),
                prefix: "org/wan 2.2/".into(),
                ..Default::default()
            },
            credentials: None,
        };
        let a = src(Some("http://127.0.0.1:1")).key();
        assert!(a.starts_with("models-org_wan_2.2-"), "{a}");
        assert_eq!(a, src(Some("http://127.0.0.1:1")).key());
        assert_ne!(a, src(Some("http://127.0.0.1:2")).key());
        assert_ne!(a, src(None).key());
        let creds = Credentials {
            access_key_id: "AKIDEXAMPLE".into(),
            secret_access_key: "wJalrXUtnFEMI".into(),
            session_token: None,
        };
        let shown = format!(
            "{:?}",
            Source {
                credentials: Some(creds),
                ..src(None)
            }
        );
        assert!(
            !shown.contains("wJalrXUtnFEMI") && !shown.contains("AKIDEXAMPLE"),
            "{shown}"
        );
    }
}
