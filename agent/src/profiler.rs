//! The profiler: a short-lived child process (this binary's hidden `profile-worker`
//! subcommand) that reads one requested model's checkpoint headers and lists its files.
//!
//! A checkpoint is input from whoever created the DiffusionDeployment, and its headers are
//! parsed into memory: a header built to expand, or a reader that never returns, must cost
//! a model its profile, never the agent its life (and with it every other model's status on
//! the node). So the parse runs in a process of its own with an address-space limit it sets
//! on itself before reading anything (`RLIMIT_AS`), under a deadline the parent enforces by
//! killing it; the parent turns either end into an error that names the cause. The child
//! also confines the checkpoint reader to the model roots, so a file of the model folder
//! that leads outside them through a symlink is refused by name and never read.
//!
//! Protocol: the parent passes the limit as an argument and writes one JSON [`Job`] line to
//! the child's stdin; the child writes one JSON [`Reply`] line to stdout and exits.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use crds::Profile;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::{prewarm, Error, Result};

/// The hidden subcommand the agent binary profiles under.
pub const SUBCOMMAND: &str = "profile-worker";
/// Its flag carrying the address-space limit in bytes.
pub const MEMORY_FLAG: &str = "--memory-limit-bytes";

/// The most of the child's stderr kept for the error message.
const STDERR_KEPT: u64 = 16 << 10;
/// The most of the child's reply read (a profile and a file list).
const REPLY_KEPT: u64 = 64 << 20;

/// What the profiler may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Address space of the child process in bytes (its code and libraries included). The
    /// reader caps a safetensors header at 16 MiB and parsing costs about 20 times the
    /// header, so the default leaves room for a few of the largest at once.
    pub memory_bytes: u64,
    /// How long the child may take before it is killed.
    pub timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            memory_bytes: 2 << 30,
            timeout: Duration::from_secs(120),
        }
    }
}

/// One model to profile.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Job {
    /// The model folder, as this process sees it.
    pub dir: PathBuf,
    /// Folders the model's files must stay in once their symlinks are followed (empty: no
    /// confinement). Those that do not exist on this node are left out by the child.
    pub roots: Vec<PathBuf>,
}

/// What the child says.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "camelCase")]
pub enum Reply {
    Profiled {
        profile: Box<Profile>,
        files: Vec<PathBuf>,
    },
    Failed {
        error: String,
    },
}

/// Limits this process's address space to `bytes`: from here on an allocation beyond it
/// fails (and Rust aborts the process, saying so on stderr).
fn limit_address_space(bytes: u64) -> Result<()> {
    let lim = libc::rlimit {
        rlim_cur: bytes as libc::rlim_t,
        rlim_max: bytes as libc::rlim_t,
    };
    // SAFETY: setrlimit reads the struct we pass and touches no memory of ours.
    if unsafe { libc::setrlimit(libc::RLIMIT_AS, &lim) } != 0 {
        return Err(Error::io(
            "setrlimit(RLIMIT_AS)",
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// The child's side: limits itself to `memory_bytes`, reads one job from stdin, profiles,
/// and writes the reply to stdout.
pub fn serve_stdio(memory_bytes: u64) -> Result<()> {
    limit_address_space(memory_bytes)?;
    let mut line = String::new();
    std::io::stdin()
        .lock()
        .read_line(&mut line)
        .map_err(|e| Error::io("<stdin>", e))?;
    let job: Job = serde_json::from_str(&line)
        .map_err(|e| Error::Profile(format!("profiler: bad job: {e}")))?;
    let reply = match profile(&job) {
        Ok((profile, files)) => Reply::Profiled {
            profile: Box::new(profile),
            files,
        },
        Err(e) => Reply::Failed {
            error: e.to_string(),
        },
    };
    println!(
        "{}",
        serde_json::to_string(&reply).expect("replies serialize")
    );
    Ok(())
}

fn profile(job: &Job) -> Result<(Profile, Vec<PathBuf>)> {
    let roots: Vec<PathBuf> = job.roots.iter().filter(|r| r.exists()).cloned().collect();
    if !job.roots.is_empty() {
        if roots.is_empty() {
            return Err(Error::Profile(format!(
                "{}: none of the model roots exists on this node",
                job.dir.display()
            )));
        }
        layerwise_core::checkpoint::confine(&roots)?;
    }
    let profile = layerwise_engine::families::profile(&job.dir)?;
    let files = model_files(&job.dir, &roots)?;
    Ok((profile, files))
}

/// The files of the model folder `dir` to warm, sorted: its regular files, and its
/// symlinks to files or folders that stay inside `roots` (a Hugging Face snapshot links
/// every file into the cache's blobs), each folder walked once. A symlink that leads
/// outside the roots fails the model, naming the link, not where it points. With no roots
/// (an unconfined agent), symlinks are skipped, never followed.
pub fn model_files(dir: &Path, roots: &[PathBuf]) -> Result<Vec<PathBuf>> {
    if roots.is_empty() {
        return prewarm::files_under(dir);
    }
    let real_roots: Vec<PathBuf> = roots.iter().filter_map(|r| r.canonicalize().ok()).collect();
    let inside = |p: &Path| -> Result<PathBuf> {
        let real = p.canonicalize().map_err(|e| Error::io(p, e))?;
        if real_roots.iter().any(|r| real.starts_with(r)) {
            return Ok(real);
        }
        Err(Error::Profile(format!(
            "{}: leads outside the model roots ({}) through a symlink; a model's files must stay inside them",
            p.display(),
            roots
                .iter()
                .map(|r| r.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )))
    };
    // Folders and files by where they really are: each is walked or listed once, however
    // many links lead to it (a link cycle included).
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    seen.insert(inside(dir)?);
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).map_err(|e| Error::io(&d, e))? {
            let entry = entry.map_err(|e| Error::io(&d, e))?;
            let path = entry.path();
            let ty = entry.file_type().map_err(|e| Error::io(&path, e))?;
            if !(ty.is_symlink() || ty.is_dir() || ty.is_file()) {
                continue;
            }
            let real = inside(&path)?;
            let meta = std::fs::metadata(&real).map_err(|e| Error::io(&path, e))?;
            if (meta.is_dir() || meta.is_file()) && !seen.insert(real) {
                continue;
            }
            if meta.is_dir() {
                stack.push(path);
            } else if meta.is_file() {
                out.push(path);
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Reads `r` to its end, keeping the first `keep` bytes: a child that writes more is still
/// read, so it never blocks on a full pipe.
async fn drain(mut r: impl tokio::io::AsyncRead + Unpin, keep: u64) -> std::io::Result<Vec<u8>> {
    let mut kept = Vec::new();
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = r.read(&mut buf).await?;
        if n == 0 {
            return Ok(kept);
        }
        let room = (keep as usize).saturating_sub(kept.len());
        kept.extend_from_slice(&buf[..n.min(room)]);
    }
}

/// The parent's side: profiles `job` in a child process of `exe` under `limits`. A child
/// that runs out of memory, out of time or dies otherwise is an error naming the folder and
/// the cause; the agent itself is untouched.
pub async fn run(exe: &Path, job: &Job, limits: Limits) -> Result<(Profile, Vec<PathBuf>)> {
    let dir = job.dir.display().to_string();
    let fail = |msg: String| Error::Profile(format!("profiling {dir}: {msg}"));
    let mut child = tokio::process::Command::new(exe)
        .arg(SUBCOMMAND)
        .arg(MEMORY_FLAG)
        .arg(limits.memory_bytes.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| fail(format!("starting the profiler {}: {e}", exe.display())))?;
    let text = serde_json::to_string(job).expect("jobs serialize");
    let mut stdin = child.stdin.take().expect("piped stdin");
    let stdout = child.stdout.take().expect("piped stdout");
    let stderr = child.stderr.take().expect("piped stderr");
    let finished = tokio::time::timeout(limits.timeout, async {
        // A child that died at once closes its stdin: that shows in its status below.
        let _ = stdin.write_all(format!("{text}\n").as_bytes()).await;
        drop(stdin);
        let (out, err) = tokio::join!(drain(stdout, REPLY_KEPT), drain(stderr, STDERR_KEPT));
        let (out, err) = (out?, err?);
        let status = child.wait().await?;
        Ok::<_, std::io::Error>((status, out, err))
    })
    .await;
    let (status, out, err) = match finished {
        Ok(r) => r.map_err(|e| fail(format!("talking to the profiler: {e}")))?,
        Err(_) => {
            // kill_on_drop ends it when `child` goes out of scope; say why it was stopped.
            return Err(fail(format!(
                "the profiler did not finish within its {} s time limit and was stopped (a file that never ends, or a checkpoint too large to read in that time)",
                limits.timeout.as_secs_f64()
            )));
        }
    };
    if let Ok(reply) = serde_json::from_slice::<Reply>(&out) {
        return match reply {
            Reply::Profiled { profile, files } => Ok((*profile, files)),
            Reply::Failed { error } => Err(Error::Profile(error)),
        };
    }
    let err = String::from_utf8_lossy(&err);
    // Rust's allocation-failure handler says so, then aborts.
    if let Some(line) = err.lines().find(|l| l.contains("memory allocation of")) {
        return Err(fail(format!(
            "the profiler ran out of its {}-byte memory limit ({line}): a checkpoint whose headers need that much to read is refused",
            limits.memory_bytes
        )));
    }
    let last = err
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("");
    Err(fail(format!(
        "the profiler ended ({status}) without a profile: {last}"
    )))
}
