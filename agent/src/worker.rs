//! The prewarm worker: a short-lived child process (this binary's hidden `prewarm-worker`
//! subcommand) that runs one prewarm job. The parent puts the child into the prewarm cgroup
//! *before* handing it the job, so every page it reads is charged there, on cgroup v1 and v2
//! alike; killing the child (a model removed from the spec, shutdown) stops the job at once.
//!
//! Protocol: the parent writes one JSON [`Job`] line to the child's stdin; the child writes
//! JSON [`Event`] lines to stdout, progress a few times a second and one final `done` or
//! `failed`.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use crate::cgroup::PrewarmCgroup;
use crate::prewarm::{self, Options, Outcome};
use crate::{Error, Result};

/// The hidden subcommand the agent binary runs a job under.
pub const SUBCOMMAND: &str = "prewarm-worker";

/// How often the worker reports progress.
const PROGRESS_EVERY: Duration = Duration::from_millis(200);

/// One prewarm job.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Job {
    pub files: Vec<PathBuf>,
    pub options: Options,
}

/// What the worker says.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "camelCase")]
pub enum Event {
    /// Bytes read so far.
    Progress {
        bytes: u64,
    },
    Done {
        outcome: Outcome,
    },
    Failed {
        error: String,
    },
}

/// The child's side: reads one job from stdin, runs it, reports on stdout.
pub fn serve_stdio() -> Result<()> {
    let mut line = String::new();
    std::io::stdin()
        .lock()
        .read_line(&mut line)
        .map_err(|e| Error::io("<stdin>", e))?;
    let job: Job =
        serde_json::from_str(&line).map_err(|e| Error::Worker(format!("bad job: {e}")))?;
    let read = AtomicU64::new(0);
    let finished = AtomicBool::new(false);
    let emit = |e: &Event| {
        let mut out = std::io::stdout().lock();
        // The parent is gone when stdout is closed; the job is then moot.
        let _ = writeln!(
            out,
            "{}",
            serde_json::to_string(e).expect("events serialize")
        );
        let _ = out.flush();
    };
    let result = std::thread::scope(|s| {
        s.spawn(|| {
            while !finished.load(Ordering::Relaxed) {
                std::thread::sleep(PROGRESS_EVERY);
                emit(&Event::Progress {
                    bytes: read.load(Ordering::Relaxed),
                });
            }
        });
        let r = prewarm::run(&job.files, &job.options, &AtomicBool::new(false), &|n| {
            read.fetch_add(n, Ordering::Relaxed);
        });
        finished.store(true, Ordering::Relaxed);
        r
    });
    match result {
        Ok(outcome) => emit(&Event::Done { outcome }),
        Err(e) => emit(&Event::Failed {
            error: e.to_string(),
        }),
    }
    Ok(())
}

/// The parent's side: runs `job` in a child process of `exe` (placed in `cgroup` when
/// given), calling `progress` with bytes read so far. Dropping the future kills the child.
pub async fn run(
    exe: &Path,
    cgroup: Option<&PrewarmCgroup>,
    job: &Job,
    mut progress: impl FnMut(u64),
) -> Result<Outcome> {
    let mut child = tokio::process::Command::new(exe)
        .arg(SUBCOMMAND)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| Error::Worker(format!("starting {}: {e}", exe.display())))?;
    let pid = child
        .id()
        .ok_or_else(|| Error::Worker("exited at once".into()))?;
    if let Some(cg) = cgroup {
        cg.add_process(pid)?;
    }
    let mut stdin = child.stdin.take().expect("piped stdin");
    let text =
        serde_json::to_string(job).map_err(|e| Error::Worker(format!("encoding the job: {e}")))?;
    stdin
        .write_all(format!("{text}\n").as_bytes())
        .await
        .map_err(|e| Error::Worker(format!("sending the job to process {pid}: {e}")))?;
    drop(stdin);
    let mut lines = BufReader::new(child.stdout.take().expect("piped stdout")).lines();
    let mut last = None;
    while let Some(line) = lines
        .next_line()
        .await
        .map_err(|e| Error::Worker(format!("reading process {pid}: {e}")))?
    {
        match serde_json::from_str::<Event>(&line) {
            Ok(Event::Progress { bytes }) => progress(bytes),
            Ok(e) => last = Some(e),
            Err(e) => return Err(Error::Worker(format!("process {pid} said {line:?}: {e}"))),
        }
    }
    let status = child
        .wait()
        .await
        .map_err(|e| Error::Worker(format!("waiting for process {pid}: {e}")))?;
    match last {
        Some(Event::Done { outcome }) => {
            progress(outcome.bytes_read);
            Ok(outcome)
        }
        Some(Event::Failed { error }) => Err(Error::Worker(error)),
        _ => Err(Error::Worker(format!(
            "process {pid} ended ({status}) without a result"
        ))),
    }
}
