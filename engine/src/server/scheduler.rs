//! The request scheduler. One task owns the queue and every job's state; the HTTP side
//! and the rank threads talk to it through one bounded channel and get answers on
//! oneshots. Every message from a rank names the image (request id, index) and the step it
//! is about, and the task checks it against what it handed out, so a late report for a
//! cancelled or failed request is counted and dropped, never delivered to another.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::sync::{mpsc, oneshot};
use utoipa::ToSchema;

use super::error::ApiError;
use super::ids::JobIds;
use super::kind::Kind;
use super::metrics::Metrics;
use super::owner::Credential;
use crate::execution::work::{Output, Request};
use crate::execution::work::{PassReport, Taken, WorkKey, WorkSource};
use crate::{Error, Result};

/// A job's state as the API reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    Queued,
    Running,
    Succeeded,
    Failed,
    Cancelled,
}

impl JobState {
    pub fn terminal(self) -> bool {
        matches!(
            self,
            JobState::Succeeded | JobState::Failed | JobState::Cancelled
        )
    }
}

/// One finished output as the API serves it.
#[derive(Debug)]
pub struct Media {
    pub bytes: Vec<u8>,
    pub content_type: &'static str,
    /// A clip's first frame, as PNG.
    pub thumbnail: Option<Vec<u8>>,
    /// Frames it holds (1 for an image).
    pub frames: usize,
}

impl Media {
    /// Bytes it holds in memory.
    pub fn len(&self) -> usize {
        self.bytes.len() + self.thumbnail.as_ref().map_or(0, Vec::len)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A job's state, queue position, progress and timings (`GET /v1/jobs/{id}`).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct JobStatus {
    pub id: String,
    /// `image` or `video`.
    pub kind: &'static str,
    /// The credential that created it, which alone may see it ([`super::owner`]); never
    /// shown.
    #[serde(skip)]
    #[schema(ignore)]
    pub owner: Option<Credential>,
    pub state: JobState,
    /// Images queued ahead of this job's first queued image (0: next to run).
    pub queue_position: Option<usize>,
    /// Outputs of the job.
    pub n: usize,
    pub steps_done: usize,
    pub steps_total: usize,
    /// Frames the decoder has made, over every output.
    pub frames_decoded: usize,
    pub frames_total: usize,
    /// The first output's request (every output of a job shares them but its seed).
    pub width: usize,
    pub height: usize,
    pub frames: usize,
    pub steps: usize,
    pub seed: u64,
    /// Videos: frames per second.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fps: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
    /// Unix seconds.
    pub created_at: u64,
    pub finished_at: Option<u64>,
    /// When a finished job's outputs go (unix seconds; they may go sooner when the byte
    /// budget for kept outputs needs the room).
    pub expires_at: Option<u64>,
    /// Its outputs are gone (expired or pushed out by newer ones); downloading them is a
    /// 410.
    pub expired: bool,
    pub queued_seconds: f64,
    pub running_seconds: Option<f64>,
    pub total_seconds: Option<f64>,
    pub error: Option<String>,
    /// The error's stable label (`JobState::Cancelled` reads `cancelled`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error_type: Option<&'static str>,
}

impl JobStatus {
    /// Overall completion in percent: denoising is 90 of it, decoding the last 10; 100 only
    /// once the job succeeded.
    pub fn progress(&self) -> u32 {
        if self.state == JobState::Succeeded {
            return 100;
        }
        let steps = self.steps_done as f64 / self.steps_total.max(1) as f64;
        let frames = self.frames_decoded as f64 / self.frames_total.max(1) as f64;
        ((90.0 * steps + 10.0 * frames).floor() as u32).min(99)
    }
}

/// How long and how much the server keeps of finished jobs.
#[derive(Debug, Clone, Copy)]
pub struct Retention {
    /// Finished jobs whose status is kept (their outputs go sooner, see below).
    pub keep_finished: usize,
    /// Bytes of finished outputs kept in memory; the oldest go first past it.
    pub max_bytes: usize,
    /// How long a finished job's outputs are kept.
    pub ttl: Duration,
}

impl Default for Retention {
    fn default() -> Self {
        Retention {
            keep_finished: 256,
            max_bytes: 1 << 30,
            ttl: Duration::from_secs(3600),
        }
    }
}

/// Final latents on their way to the decode thread, with what to make of them.
pub type DecodeJob = (WorkKey, candle_core::Tensor, Kind);

pub(super) type Reply<T> = oneshot::Sender<Result<T, ApiError>>;

/// What the HTTP side and the ranks tell the scheduler task.
pub enum Msg {
    Submit {
        requests: Vec<Request>,
        kind: Kind,
        owner: Option<Credential>,
        reply: Reply<u64>,
    },
    Status {
        id: u64,
        reply: Reply<JobStatus>,
    },
    Result {
        id: u64,
        index: usize,
        reply: Reply<Arc<Media>>,
    },
    /// Every job of `kind` the server still holds, newest first.
    List {
        kind: &'static str,
        reply: oneshot::Sender<Vec<JobStatus>>,
    },
    /// Cancels the job if it still runs and lets its outputs go.
    Delete {
        id: u64,
        reply: Reply<JobStatus>,
    },
    Wait {
        id: u64,
        reply: oneshot::Sender<()>,
    },
    Cancel {
        id: u64,
        reply: Reply<JobStatus>,
    },
    Take {
        rank: usize,
        reply: oneshot::Sender<Taken>,
    },
    WaitWork {
        generation: u64,
        reply: oneshot::Sender<()>,
    },
    Ready {
        rank: usize,
    },
    Step {
        rank: usize,
        key: WorkKey,
        step: usize,
    },
    Finished {
        rank: usize,
        key: WorkKey,
        out: Result<Output>,
    },
    /// The decoder has made `done` frames of this output so far.
    Frames {
        key: WorkKey,
        done: usize,
    },
    Decoded {
        key: WorkKey,
        media: Result<Media>,
    },
    Fatal {
        msg: String,
    },
    /// Take no more jobs; what is queued still runs.
    Close,
    /// The grace period is running out: fail what is still queued or running.
    Abort,
    /// How far a drain has come.
    Drained {
        reply: oneshot::Sender<Drained>,
    },
}

/// How far a drain has come: outputs still queued or in flight, and ended jobs whose
/// clients have not read how they ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Drained {
    pub working: usize,
    pub unread: usize,
}

/// State the scheduler task publishes for cheap reads (readiness, the prefetch hint).
pub struct Shared {
    pub metrics: Metrics,
    pub dp: usize,
    pub(super) ready_ranks: AtomicUsize,
    pub(super) queued: AtomicUsize,
    pub closing: AtomicBool,
    pub failed: std::sync::Mutex<Option<String>>,
    /// Reports about requests the scheduler no longer expects (dropped, counted).
    pub stale: AtomicUsize,
    /// Woken once when the engine fails.
    pub fatal: tokio::sync::Notify,
    pub(super) started: Instant,
    /// When the server started, in unix seconds.
    pub started_unix: u64,
    /// Milliseconds since `started` at the last sign of progress (a pass, a take).
    pub(super) progress_ms: AtomicU64,
    /// How job ids are written and read (and whether they name this replica).
    pub ids: JobIds,
}

impl Shared {
    pub(super) fn touch(&self) {
        self.progress_ms
            .store(self.started.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// Time since a rank last finished a pass or took work.
    pub fn since_progress(&self) -> Duration {
        self.started.elapsed().saturating_sub(Duration::from_millis(
            self.progress_ms.load(Ordering::Relaxed),
        ))
    }

    pub fn ready(&self) -> Result<(), ApiError> {
        if let Some(f) = self.failed.lock().expect("shared lock").as_ref() {
            return Err(Error::unavailable(format!("engine failed: {f}")).into());
        }
        if self.closing.load(Ordering::SeqCst) {
            return Err(Error::unavailable("shutting down").into());
        }
        let r = self.ready_ranks.load(Ordering::SeqCst);
        if r < self.dp {
            return Err(
                Error::unavailable(format!("starting: {r} of {} ranks ready", self.dp)).into(),
            );
        }
        Ok(())
    }
}

/// The HTTP side's handle on the scheduler.
#[derive(Clone)]
pub struct Scheduler {
    pub(super) tx: mpsc::Sender<Msg>,
    pub shared: Arc<Shared>,
}

async fn ask<T>(tx: &mpsc::Sender<Msg>, make: impl FnOnce(Reply<T>) -> Msg) -> Result<T, ApiError> {
    let (reply, rx) = oneshot::channel();
    let gone = || ApiError::from(Error::unavailable("the scheduler has stopped"));
    tx.send(make(reply)).await.map_err(|_| gone())?;
    rx.await.map_err(|_| gone())?
}

impl Scheduler {
    /// Queues an anonymous job (for callers that are not an HTTP request: the tests).
    pub async fn submit(&self, requests: Vec<Request>, kind: Kind) -> Result<u64, ApiError> {
        let mut s = self.submit_for(requests, kind, None).await?;
        Ok(s.answered())
    }

    /// Queues a job of `owner`'s for an HTTP request that has yet to answer. Dropped at any
    /// point before [`Submission::answered`] (its connection closed, a half-close
    /// included, and hyper dropped the handler or its answer), the job is cancelled: no work
    /// runs that nobody can receive. That holds while the scheduler's reply is on its way
    /// too: the reply is then read on a task of its own and the job it names cancelled.
    pub async fn submit_for(
        &self,
        requests: Vec<Request>,
        kind: Kind,
        owner: Option<Credential>,
    ) -> Result<Submission, ApiError> {
        let (reply, rx) = oneshot::channel();
        let gone = || ApiError::from(Error::unavailable("the scheduler has stopped"));
        let msg = Msg::Submit {
            requests,
            kind,
            owner,
            reply,
        };
        // Dropped while waiting for room in the channel, nothing was sent: nothing to undo.
        self.tx.send(msg).await.map_err(|_| gone())?;
        let mut pending = PendingReply {
            rx: Some(rx),
            scheduler: self.clone(),
        };
        let rx = pending.rx.as_mut().expect("just set");
        let id = rx.await.map_err(|_| gone())?;
        pending.rx = None;
        Ok(Submission {
            scheduler: self.clone(),
            id: Some(id?),
        })
    }
    pub async fn list(&self, kind: &'static str) -> Vec<JobStatus> {
        let (reply, rx) = oneshot::channel();
        if self.tx.send(Msg::List { kind, reply }).await.is_err() {
            return Vec::new();
        }
        rx.await.unwrap_or_default()
    }
    pub async fn delete(&self, id: u64) -> Result<JobStatus, ApiError> {
        ask(&self.tx, |reply| Msg::Delete { id, reply }).await
    }
    pub async fn status(&self, id: u64) -> Result<JobStatus, ApiError> {
        ask(&self.tx, |reply| Msg::Status { id, reply }).await
    }
    pub async fn result(&self, id: u64, index: usize) -> Result<Arc<Media>, ApiError> {
        ask(&self.tx, |reply| Msg::Result { id, index, reply }).await
    }
    pub async fn cancel(&self, id: u64) -> Result<JobStatus, ApiError> {
        ask(&self.tx, |reply| Msg::Cancel { id, reply }).await
    }
    /// Resolves once job `id` is finished, failed or cancelled.
    pub async fn wait(&self, id: u64) {
        let (reply, rx) = oneshot::channel();
        if self.tx.send(Msg::Wait { id, reply }).await.is_ok() {
            let _ = rx.await;
        }
    }
    /// Cancels without waiting (for a client that went away, from a `Drop`). The message
    /// is sent by a task of its own, so a full channel delays the cancel instead of losing
    /// it.
    pub fn cancel_detached(&self, id: u64) {
        let (reply, _) = oneshot::channel();
        let msg = Msg::Cancel { id, reply };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                let tx = self.tx.clone();
                rt.spawn(async move {
                    let _ = tx.send(msg).await;
                });
            }
            Err(_) => {
                let _ = self.tx.try_send(msg);
            }
        }
    }
    /// How far a drain has come (`None` once the scheduler has stopped).
    pub async fn drained(&self) -> Option<Drained> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(Msg::Drained { reply }).await.ok()?;
        rx.await.ok()
    }
    pub async fn send(&self, m: Msg) {
        let _ = self.tx.send(m).await;
    }
}

/// A job an HTTP request queued and has not answered for yet: dropped before
/// [`Self::answered`], it cancels the job (see [`Scheduler::submit_for`]).
pub struct Submission {
    scheduler: Scheduler,
    id: Option<u64>,
}

impl Submission {
    /// The job's number.
    pub fn id(&self) -> u64 {
        self.id.expect("a submission holds its job until answered")
    }

    /// The request has its answer (or the job has finished): dropping no longer cancels.
    pub fn answered(&mut self) -> u64 {
        let id = self.id();
        self.id = None;
        id
    }
}

impl Drop for Submission {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            tracing::info!(job = %self.scheduler.shared.ids.format(id), "the request went away before its answer; cancelling its job");
            self.scheduler.cancel_detached(id);
        }
    }
}

/// The scheduler's answer to a submission, while it is awaited: dropped unread, the job it
/// names (if any) is cancelled once it arrives.
struct PendingReply {
    rx: Option<oneshot::Receiver<Result<u64, ApiError>>>,
    scheduler: Scheduler,
}

impl Drop for PendingReply {
    fn drop(&mut self) {
        let Some(rx) = self.rx.take() else { return };
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let scheduler = self.scheduler.clone();
        rt.spawn(async move {
            if let Ok(Ok(id)) = rx.await {
                drop(Submission {
                    scheduler,
                    id: Some(id),
                });
            }
        });
    }
}

/// The ranks' handle on the scheduler (a [`WorkSource`]); blocking, for rank threads.
pub struct RankSource {
    pub(super) tx: mpsc::Sender<Msg>,
    pub(super) shared: Arc<Shared>,
}

impl RankSource {
    fn call<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Msg) -> Result<T> {
        let (reply, rx) = oneshot::channel();
        let gone = || Error::unavailable("the scheduler has stopped");
        self.tx.blocking_send(make(reply)).map_err(|_| gone())?;
        rx.blocking_recv().map_err(|_| gone())
    }
    fn tell(&self, m: Msg) {
        let _ = self.tx.blocking_send(m);
    }
}

impl WorkSource for RankSource {
    fn take(&self, rank: usize) -> Result<Taken> {
        self.call(|reply| Msg::Take { rank, reply }).or_else(|_| {
            Ok(Taken {
                work: None,
                generation: 0,
                closed: true,
            })
        })
    }
    fn pending(&self, _rank: usize) -> bool {
        self.shared.queued.load(Ordering::SeqCst) > 0
    }
    fn wait(&self, _rank: usize, generation: u64) -> Result<()> {
        // A stopped scheduler is a closed source: return and let the ranks exit.
        let _ = self.call(|reply| Msg::WaitWork { generation, reply });
        Ok(())
    }
    fn ready(&self, rank: usize) {
        self.tell(Msg::Ready { rank });
    }
    fn step_done(&self, rank: usize, key: WorkKey, step: usize, _total: usize, took: Duration) {
        self.shared.metrics.step(took);
        self.tell(Msg::Step { rank, key, step });
    }
    fn pass_done(&self, rank: usize, report: &PassReport) {
        self.shared.touch();
        self.shared.metrics.pass(rank, report);
    }
    fn finished(&self, rank: usize, key: WorkKey, out: Result<Output>) {
        self.tell(Msg::Finished { rank, key, out });
    }
    fn failed(&self, rank: usize, error: &Error) {
        // The root cause, whichever rank is heard first: a rank that only gave up quotes it.
        self.tell(Msg::Fatal {
            msg: crate::execution::rank::first_cause(rank, error),
        });
    }
}
