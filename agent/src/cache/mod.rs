//! The node model cache: a folder on the node (the chart's `agent.modelCache.path`) with a
//! size cap, holding whole copies of models whose source is not a folder the node already has
//! (an S3 prefix). It owns the cache's layout and its rules, so that a half-written model is
//! never visible and the cache never outgrows its cap or the disk:
//!
//! - `partial/<key>/` holds a copy being downloaded, with its resume journal; a copy is
//!   published by one `rename` into `ready/<key>/` after every file was checked and synced,
//!   with its manifest inside (`.layerwise-manifest.json`), so a reader sees all or nothing;
//! - room for a new copy is made by evicting the least recently used ready copies that no
//!   deployment references, and a copy that would not fit even then is refused by name
//!   ([`Fault::CacheFull`]) before a byte is downloaded.
//!
//! Filling a copy from S3 is [`fill`]; the pure decision of what to evict is
//! [`plan_room`].

pub mod fill;
mod journal;
pub mod stage;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

/// The manifest a published copy carries, inside its folder.
pub const MANIFEST: &str = ".layerwise-manifest.json";
/// The folders of published and in-progress copies.
const READY: &str = "ready";
const PARTIAL: &str = "partial";
/// Per published copy, an empty file whose mtime is the copy's last use (the LRU order):
/// outside the copy, so marking a use never changes a file of the model (which the node
/// loop would take for a changed model and prepare again).
const USED: &str = "used";

/// Why staging a model failed: a reason a condition or event names, and what happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The disk or the cache's cap cannot hold the model, even after evicting every copy
    /// no deployment references.
    CacheFull,
    /// The store refused the credentials (or has none and the bucket is private).
    AccessDenied,
    /// The bucket does not exist.
    NoSuchBucket,
    /// No object under the prefix, or an object listed is gone.
    ObjectNotFound,
    /// An object changed while it was being downloaded (its ETag moved).
    ObjectChanged,
    /// A downloaded file is not what the store listed: its size, its MD5 against the ETag,
    /// or its safetensors header.
    IntegrityMismatch,
    /// The store could not be reached or kept failing after retries.
    StoreUnavailable,
    /// Reading or writing the cache folder failed.
    CacheIo,
    /// The credentials Secret is missing, unreadable, or lacks a key.
    CredentialsUnavailable,
}

impl Fault {
    /// The name conditions, events and metrics use.
    pub fn reason(self) -> &'static str {
        match self {
            Fault::CacheFull => "CacheFull",
            Fault::AccessDenied => "AccessDenied",
            Fault::NoSuchBucket => "NoSuchBucket",
            Fault::ObjectNotFound => "ObjectNotFound",
            Fault::ObjectChanged => "ObjectChanged",
            Fault::IntegrityMismatch => "IntegrityMismatch",
            Fault::StoreUnavailable => "StoreUnavailable",
            Fault::CacheIo => "CacheIo",
            Fault::CredentialsUnavailable => "CredentialsUnavailable",
        }
    }

    /// Whether trying again later may succeed without anyone changing anything.
    pub fn transient(self) -> bool {
        matches!(
            self,
            Fault::ObjectChanged | Fault::StoreUnavailable | Fault::CacheIo
        )
    }
}

/// A staging failure: its [`Fault`] and a message naming the source, object or file at
/// fault (never a credential).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {msg}", fault.reason())]
pub struct StageError {
    pub fault: Fault,
    pub msg: String,
}

impl StageError {
    pub fn new(fault: Fault, msg: impl Into<String>) -> Self {
        StageError {
            fault,
            msg: msg.into(),
        }
    }

    fn io(path: &Path, e: std::io::Error) -> Self {
        StageError::new(Fault::CacheIo, format!("{}: {e}", path.display()))
    }
}

type Staged<T> = std::result::Result<T, StageError>;

/// One file of a copy, as the store listed it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct FileEntry {
    /// Its path inside the pipeline folder.
    pub path: String,
    pub size: u64,
    /// The store's ETag, where it gave one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etag: Option<String>,
}

/// What a published copy holds and where it came from.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Manifest {
    /// The source, as [`crds::S3Source::describe`] names it.
    pub source: String,
    pub files: Vec<FileEntry>,
}

impl Manifest {
    pub fn bytes(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }
}

/// A published copy: its key, size and when a deployment last used it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub key: String,
    pub bytes: u64,
    pub last_used: SystemTime,
}

/// The node model cache at `dir`, holding at most `cap` bytes.
#[derive(Clone, Debug)]
pub struct Cache {
    dir: PathBuf,
    cap: u64,
}

impl Cache {
    /// Opens (creating) the cache folder. A copy left half-downloaded stays for its download
    /// to resume.
    pub fn open(dir: &Path, cap: u64) -> Staged<Cache> {
        for sub in [READY, PARTIAL, USED] {
            let d = dir.join(sub);
            std::fs::create_dir_all(&d).map_err(|e| StageError::io(&d, e))?;
        }
        Ok(Cache {
            dir: dir.to_path_buf(),
            cap,
        })
    }

    pub fn cap(&self) -> u64 {
        self.cap
    }

    /// The cache folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where the published copy of `key` is (whether or not it exists).
    pub fn ready_dir(&self, key: &str) -> PathBuf {
        ready_path(&self.dir, key)
    }

    fn partial_dir(&self, key: &str) -> PathBuf {
        self.dir.join(PARTIAL).join(key)
    }

    /// The published copy of `key`, marked as used now (the LRU order), if there is one.
    pub fn lookup(&self, key: &str) -> Option<PathBuf> {
        let dir = self.ready_dir(key);
        if !dir.join(MANIFEST).is_file() {
            return None;
        }
        let stamp = self.dir.join(USED).join(key);
        let now = std::fs::FileTimes::new().set_modified(SystemTime::now());
        let _ = std::fs::File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&stamp)
            .and_then(|f| f.set_times(now));
        Some(dir)
    }

    /// The manifest of the published copy of `key`.
    pub fn manifest(&self, key: &str) -> Staged<Manifest> {
        let path = self.ready_dir(key).join(MANIFEST);
        let text = std::fs::read(&path).map_err(|e| StageError::io(&path, e))?;
        serde_json::from_slice(&text)
            .map_err(|e| StageError::new(Fault::CacheIo, format!("{}: {e}", path.display())))
    }

    /// The published copies, with their sizes and last use (the manifest's mtime).
    pub fn entries(&self) -> Staged<Vec<Entry>> {
        let ready = self.dir.join(READY);
        let mut out = Vec::new();
        for e in std::fs::read_dir(&ready).map_err(|e| StageError::io(&ready, e))? {
            let e = e.map_err(|e| StageError::io(&ready, e))?;
            let key = e.file_name().to_string_lossy().into_owned();
            let Ok(manifest) = self.manifest(&key) else {
                continue;
            };
            let last_used = std::fs::metadata(self.dir.join(USED).join(&key))
                .or_else(|_| std::fs::metadata(e.path().join(MANIFEST)))
                .and_then(|m| m.modified())
                .unwrap_or(SystemTime::UNIX_EPOCH);
            out.push(Entry {
                key,
                bytes: manifest.bytes(),
                last_used,
            });
        }
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    /// Bytes the in-progress copies hold on disk (their files' allocated lengths).
    fn partial_bytes(&self) -> u64 {
        dir_bytes(&self.dir.join(PARTIAL))
    }

    /// Makes room for `need` more bytes of the copy `key`: evicts the least recently used
    /// published copies outside `referenced` until the cap and the disk both hold it, or
    /// refuses ([`Fault::CacheFull`]) without evicting anything when they never would.
    /// Returns the keys evicted.
    pub fn make_room(
        &self,
        key: &str,
        need: u64,
        referenced: &BTreeSet<String>,
    ) -> Staged<Vec<String>> {
        let entries = self.entries()?;
        let used = entries.iter().map(|e| e.bytes).sum::<u64>() + self.partial_bytes();
        let disk_free = disk_free(&self.dir)?;
        let evict = plan_room(&entries, referenced, key, used, need, self.cap, disk_free)?;
        for k in &evict {
            self.evict(k)?;
        }
        Ok(evict)
    }

    /// Removes the published copy `key`: renamed out of `ready/` first, so no reader finds a
    /// half-removed copy.
    pub fn evict(&self, key: &str) -> Staged<()> {
        let dir = self.ready_dir(key);
        let gone = self.dir.join(PARTIAL).join(format!(".evicting-{key}"));
        std::fs::rename(&dir, &gone).map_err(|e| StageError::io(&dir, e))?;
        let _ = std::fs::remove_file(self.dir.join(USED).join(key));
        std::fs::remove_dir_all(&gone).map_err(|e| StageError::io(&gone, e))
    }

    /// Publishes the finished copy of `key` with its manifest: the files and folders are
    /// synced, then the folder is renamed into `ready/` and the parent synced, so after a
    /// crash the copy is either whole under `ready/` or still under `partial/`.
    fn publish(&self, key: &str, manifest: &Manifest) -> Staged<PathBuf> {
        let partial = self.partial_dir(key);
        journal::remove(&partial).map_err(|e| StageError::io(&partial, e))?;
        let path = partial.join(MANIFEST);
        let text = serde_json::to_vec_pretty(manifest).expect("a manifest serializes");
        std::fs::write(&path, text).map_err(|e| StageError::io(&path, e))?;
        sync_tree(&partial).map_err(|e| StageError::io(&partial, e))?;
        let ready = self.ready_dir(key);
        if ready.exists() {
            // Another fill of the same source published first: keep its copy.
            let _ = std::fs::remove_dir_all(&partial);
            return Ok(ready);
        }
        std::fs::rename(&partial, &ready).map_err(|e| StageError::io(&ready, e))?;
        let parent = self.dir.join(READY);
        sync_dir(&parent).map_err(|e| StageError::io(&parent, e))?;
        Ok(ready)
    }
}

/// Where the published copy of `key` is in a cache folder at `dir` (as the agent reads it,
/// or as the node's pods mount it).
pub fn ready_path(dir: &Path, key: &str) -> PathBuf {
    dir.join(READY).join(key)
}

/// Which published copies to evict, least recently used first, so that `need` more bytes fit
/// under `cap` (with `used` bytes held now) and on the disk (`disk_free` bytes free): only
/// copies outside `referenced` and other than `key` go. Refuses, evicting nothing, when even
/// evicting them all would not make room.
pub fn plan_room(
    entries: &[Entry],
    referenced: &BTreeSet<String>,
    key: &str,
    used: u64,
    need: u64,
    cap: u64,
    disk_free: u64,
) -> Staged<Vec<String>> {
    let mut candidates: Vec<&Entry> = entries
        .iter()
        .filter(|e| e.key != key && !referenced.contains(&e.key))
        .collect();
    candidates.sort_by_key(|e| (e.last_used, e.key.clone()));
    let fits = |freed: u64| {
        used.saturating_sub(freed).saturating_add(need) <= cap
            && need <= disk_free.saturating_add(freed)
    };
    let mut freed = 0;
    let mut evict = Vec::new();
    for e in candidates.iter() {
        if fits(freed) {
            return Ok(evict);
        }
        freed += e.bytes;
        evict.push(e.key.clone());
    }
    if fits(freed) {
        return Ok(evict);
    }
    let evictable: u64 = candidates.iter().map(|e| e.bytes).sum();
    let kept = used.saturating_sub(evictable);
    Err(StageError::new(
        Fault::CacheFull,
        format!(
            "the model needs {need} more bytes; the cache holds {kept} bytes of models in use or in progress under its cap of {cap} bytes, and the disk has {disk_free} bytes free (plus {evictable} bytes of unused models it could evict): raise the cache's size cap or give it a larger disk"
        ),
    ))
}

/// Free bytes on the file system holding `dir` (for an unprivileged writer).
fn disk_free(dir: &Path) -> Staged<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).map_err(|_| {
        StageError::new(
            Fault::CacheIo,
            format!("{}: a NUL in the path", dir.display()),
        )
    })?;
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a valid statvfs to fill.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(StageError::io(dir, std::io::Error::last_os_error()));
    }
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}

/// Bytes of the files under `dir` (0 where it cannot be read).
fn dir_bytes(dir: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    rd.flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            Ok(t) if t.is_file() => e.metadata().map_or(0, |m| m.len()),
            _ => 0,
        })
        .sum()
}

/// Syncs every file and folder under `dir`, and `dir` itself.
fn sync_tree(dir: &Path) -> std::io::Result<()> {
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        if e.file_type()?.is_dir() {
            sync_tree(&e.path())?;
        } else {
            std::fs::File::open(e.path())?.sync_all()?;
        }
    }
    sync_dir(dir)
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests;
