//! Page-cache prewarm: read a model's files once, in parallel, so the engine's mmap later
//! finds them in memory. Nothing read is kept: each reader reuses one small buffer; the
//! page cache is the only copy.
//!
//! The files are cut into chunks that readers take in order, so even one large file is
//! read by every thread, and neighbouring threads read neighbouring chunks (the disk still
//! sees a mostly sequential stream). Before each chunk a reader reserves its bytes from a
//! shared token bucket (the bandwidth cap), hints the kernel (`WILLNEED` on the chunk), and
//! checks the node's available memory against the floor. Files whose identity (inode,
//! size, mtime) changes while they are read are read again.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::bucket::TokenBucket;
use crate::pagecache::{advise, Advice, Identity};
use crate::{meminfo, Error, Result};

/// How often a file that keeps changing is read again before giving up on it.
const MAX_ROUNDS: usize = 3;

/// How to warm.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Options {
    /// Reader threads.
    pub threads: usize,
    /// Bytes a reader takes at a time (and hints with `WILLNEED`).
    pub chunk_bytes: u64,
    /// The reused read buffer of each reader.
    pub buffer_bytes: usize,
    /// Bandwidth cap in bytes/s; `None` reads as fast as the disk allows.
    pub rate_bytes_per_s: Option<u64>,
    /// Stop when the node's MemAvailable falls below this many bytes (0: never).
    pub floor_bytes: u64,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            threads: 4,
            chunk_bytes: 8 << 20,
            buffer_bytes: 1 << 20,
            rate_bytes_per_s: None,
            floor_bytes: 0,
        }
    }
}

/// What a prewarm did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Outcome {
    /// Bytes read (a file read twice counts twice).
    pub bytes_read: u64,
    pub seconds: f64,
    /// Files that changed while being read (and were read again).
    pub changed: Vec<PathBuf>,
    /// Why warming stopped early, if it did.
    pub stopped: Option<String>,
}

impl Outcome {
    pub fn throughput(&self) -> f64 {
        if self.seconds > 0.0 {
            self.bytes_read as f64 / self.seconds
        } else {
            0.0
        }
    }
}

/// Every regular file under `root` (or `root` itself when it is a file), sorted, skipping
/// symlinks so a model folder cannot point the agent elsewhere.
pub fn files_under(root: &Path) -> Result<Vec<PathBuf>> {
    let meta = std::fs::symlink_metadata(root).map_err(|e| Error::io(root, e))?;
    if meta.is_file() {
        return Ok(vec![root.to_path_buf()]);
    }
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).map_err(|e| Error::io(&dir, e))? {
            let entry = entry.map_err(|e| Error::io(&dir, e))?;
            let ty = entry.file_type().map_err(|e| Error::io(entry.path(), e))?;
            if ty.is_dir() {
                stack.push(entry.path());
            } else if ty.is_file() {
                out.push(entry.path());
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Shared state of one round of readers.
struct Round<'a> {
    files: Vec<(File, &'a Path)>,
    chunks: Vec<(usize, u64, u64)>,
    next: AtomicUsize,
    bucket: Option<Mutex<TokenBucket>>,
    origin: Instant,
    stopped: Mutex<Option<String>>,
}

/// Reads `files` into the page cache with `opts`, calling `progress` with bytes as they are
/// read. `stop` set by another thread ends the run early (reported as stopped).
pub fn run(
    files: &[PathBuf],
    opts: &Options,
    stop: &AtomicBool,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Outcome> {
    let start = Instant::now();
    let mut outcome = Outcome::default();
    let origin = Instant::now();
    let bucket = opts
        .rate_bytes_per_s
        .map(|r| TokenBucket::new(r, opts.chunk_bytes, 0.0));
    let bucket = bucket.map(Mutex::new);
    let mut todo: Vec<PathBuf> = files.to_vec();
    let mut bucket = bucket;
    for _ in 0..MAX_ROUNDS {
        let before = todo
            .iter()
            .map(|p| Identity::of(p))
            .collect::<Result<Vec<_>>>()?;
        let (read, stopped, b) = round(&todo, opts, stop, progress, bucket, origin)?;
        bucket = b;
        outcome.bytes_read += read;
        if stopped.is_some() {
            outcome.stopped = stopped;
            break;
        }
        let changed: Vec<PathBuf> = todo
            .iter()
            .zip(&before)
            .filter(|(p, id)| Identity::of(p).ok().as_ref() != Some(*id))
            .map(|(p, _)| p.clone())
            .collect();
        for p in &changed {
            tracing::info!(file = %p.display(), "file changed while warming; reading it again");
            if !outcome.changed.contains(p) {
                outcome.changed.push(p.clone());
            }
        }
        todo = changed;
        if todo.is_empty() {
            break;
        }
    }
    outcome.seconds = start.elapsed().as_secs_f64();
    Ok(outcome)
}

type RoundResult = (u64, Option<String>, Option<Mutex<TokenBucket>>);

fn round(
    paths: &[PathBuf],
    opts: &Options,
    stop: &AtomicBool,
    progress: &(dyn Fn(u64) + Sync),
    bucket: Option<Mutex<TokenBucket>>,
    origin: Instant,
) -> Result<RoundResult> {
    let mut files = Vec::with_capacity(paths.len());
    let mut chunks = Vec::new();
    let chunk = opts.chunk_bytes.max(opts.buffer_bytes as u64).max(4096);
    for (i, p) in paths.iter().enumerate() {
        let f = File::open(p).map_err(|e| Error::io(p, e))?;
        let len = f.metadata().map_err(|e| Error::io(p, e))?.len();
        // A hint only: a file system without read-ahead is still read.
        let _ = advise(&f, 0, 0, Advice::Sequential);
        let mut off = 0;
        while off < len {
            let n = chunk.min(len - off);
            chunks.push((i, off, n));
            off += n;
        }
        files.push((f, p.as_path()));
    }
    let r = Round {
        files,
        chunks,
        next: AtomicUsize::new(0),
        bucket,
        origin,
        stopped: Mutex::new(None),
    };
    let threads = opts.threads.clamp(1, r.chunks.len().max(1));
    let read = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| s.spawn(|| reader(&r, opts, stop, progress)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("prewarm reader panicked"))
            .collect::<Result<Vec<u64>>>()
    })?;
    let stopped = r.stopped.into_inner().unwrap();
    Ok((read.iter().sum(), stopped, r.bucket))
}

fn reader(
    r: &Round,
    opts: &Options,
    stop: &AtomicBool,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<u64> {
    let mut buf = vec![0u8; opts.buffer_bytes.max(4096)];
    let mut total = 0;
    loop {
        if stop.load(Ordering::Relaxed) {
            r.stopped
                .lock()
                .unwrap()
                .get_or_insert_with(|| "cancelled".into());
            return Ok(total);
        }
        if r.stopped.lock().unwrap().is_some() {
            return Ok(total);
        }
        let i = r.next.fetch_add(1, Ordering::Relaxed);
        let Some(&(fi, off, len)) = r.chunks.get(i) else {
            return Ok(total);
        };
        if opts.floor_bytes > 0 {
            let avail = meminfo::read()?.available;
            if avail < opts.floor_bytes {
                r.stopped.lock().unwrap().get_or_insert_with(|| {
                    format!(
                        "node MemAvailable {avail} bytes fell below the prewarm floor of {} bytes",
                        opts.floor_bytes
                    )
                });
                return Ok(total);
            }
        }
        if let Some(b) = &r.bucket {
            let now = r.origin.elapsed().as_secs_f64();
            let wait = b.lock().unwrap().reserve(len, now);
            if wait > 0.0 {
                std::thread::sleep(Duration::from_secs_f64(wait));
            }
        }
        let (file, path) = &r.files[fi];
        let _ = advise(file, off, len, Advice::WillNeed);
        let mut done = 0;
        while done < len {
            let want = buf.len().min((len - done) as usize);
            let n = file
                .read_at(&mut buf[..want], off + done)
                .map_err(|e| Error::io(*path, e))?;
            if n == 0 {
                // Truncated under us: the identity check after the round reads it again.
                break;
            }
            done += n as u64;
        }
        total += done;
        progress(done);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pagecache;
    use std::sync::atomic::AtomicU64;

    fn write(dir: &Path, name: &str, len: usize) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, vec![1u8; len]).unwrap();
        p
    }

    #[test]
    fn reads_every_byte_once_and_reports_progress() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        let a = write(dir.path(), "a", 3 << 20);
        let b = write(&dir.path().join("sub"), "b", 12345);
        std::os::unix::fs::symlink(&a, dir.path().join("link")).unwrap();
        let files = files_under(dir.path()).unwrap();
        assert_eq!(files, vec![a.clone(), b.clone()], "symlinks are skipped");
        for f in &files {
            pagecache::evict(f).unwrap();
        }
        let seen = AtomicU64::new(0);
        let opts = Options {
            chunk_bytes: 1 << 20,
            buffer_bytes: 256 << 10,
            ..Options::default()
        };
        let out = run(&files, &opts, &AtomicBool::new(false), &|n| {
            seen.fetch_add(n, Ordering::Relaxed);
        })
        .unwrap();
        assert_eq!(out.bytes_read, (3 << 20) + 12345);
        assert_eq!(seen.load(Ordering::Relaxed), out.bytes_read);
        assert_eq!(out.stopped, None);
        let r = pagecache::residency_of(&files).unwrap();
        assert_eq!(r.resident, r.total);
    }

    #[test]
    fn stop_flag_and_floor_stop_with_a_reason() {
        let dir = tempfile::tempdir().unwrap();
        let a = write(dir.path(), "a", 1 << 20);
        let out = run(
            std::slice::from_ref(&a),
            &Options::default(),
            &AtomicBool::new(true),
            &|_| {},
        )
        .unwrap();
        assert_eq!(out.stopped.as_deref(), Some("cancelled"));
        assert_eq!(out.bytes_read, 0);
        let opts = Options {
            floor_bytes: u64::MAX,
            ..Options::default()
        };
        let out = run(&[a], &opts, &AtomicBool::new(false), &|_| {}).unwrap();
        assert!(out.stopped.unwrap().contains("below the prewarm floor"));
    }

    #[test]
    fn missing_file_names_the_file() {
        let err = run(
            &[PathBuf::from("/nonexistent/x.safetensors")],
            &Options::default(),
            &AtomicBool::new(false),
            &|_| {},
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("/nonexistent/x.safetensors"),
            "{err}"
        );
    }

    #[test]
    fn a_file_rewritten_while_read_is_read_again() {
        let dir = tempfile::tempdir().unwrap();
        let a = write(dir.path(), "a", 4 << 20);
        let once = AtomicBool::new(false);
        let path = a.clone();
        let opts = Options {
            threads: 1,
            chunk_bytes: 1 << 20,
            ..Options::default()
        };
        let out = run(
            std::slice::from_ref(&a),
            &opts,
            &AtomicBool::new(false),
            &|_| {
                if !once.swap(true, Ordering::Relaxed) {
                    // Replace the file (new inode) after the first chunk.
                    let tmp = path.with_extension("tmp");
                    std::fs::write(&tmp, vec![2u8; 2 << 20]).unwrap();
                    std::fs::rename(&tmp, &path).unwrap();
                }
            },
        )
        .unwrap();
        assert_eq!(out.changed, vec![a]);
        assert!(
            out.bytes_read >= (4 << 20) + (2 << 20) - (3 << 20),
            "{out:?}"
        );
    }
}
