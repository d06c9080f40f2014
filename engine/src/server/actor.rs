//! Kept whole: one task's state machine; every method keeps the same invariants over its
//! private state (the queue, `in_flight`, kept bytes), which a split would expose to siblings.
//!
//! The scheduler task itself: the one owner of the queue and of every job's state. See
//! [`super::scheduler`] for the messages it answers and the handles that send them;
//! [`start`] spawns it.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::{mpsc, oneshot};

use super::error::ApiError;
use super::ids::JobIds;
use super::kind::Kind;
use super::metrics::Metrics;
use super::owner::Credential;
use super::scheduler::{
    DecodeJob, Drained, JobState, JobStatus, Media, Msg, RankSource, Retention, Scheduler, Shared,
};
use crate::execution::work::{Condition, Output, Request};
use crate::execution::work::{Taken, Work, WorkKey};
use crate::{Error, Result};

/// Where an output that has left the queue is. The actor's `in_flight` map, not the jobs,
/// is what counts running work: a job may end or be evicted while its outputs are still on a
/// rank or with the decoder, and their reports must still take them out of the count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flight {
    Rank(usize),
    Decoding,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Image {
    Queued,
    Running(usize),
    Decoding,
    Done,
    Dropped,
}

pub(super) struct Job {
    requests: Vec<Request>,
    kind: Kind,
    /// The credential that created it ([`super::owner`]).
    owner: Option<Credential>,
    images: Vec<Image>,
    steps: Vec<usize>,
    frames_decoded: Vec<usize>,
    media: Vec<Option<Arc<Media>>>,
    /// Its outputs were let go (time or byte budget).
    expired: bool,
    state: JobState,
    error: Option<Arc<Error>>,
    cancel: Arc<AtomicBool>,
    created: Instant,
    created_unix: u64,
    started: Option<Instant>,
    finished: Option<Instant>,
    finished_unix: Option<u64>,
    waiters: Vec<oneshot::Sender<()>>,
    /// Outputs some client has downloaded, and whether one has seen the job ended (its
    /// status or result read after it ended): a draining server stays up for the rest.
    read: Vec<bool>,
    seen_ended: bool,
}

impl Job {
    fn media_bytes(&self) -> usize {
        self.media.iter().flatten().map(|m| m.len()).sum()
    }

    /// Ended, but its client may not know yet: a success with outputs still kept that
    /// nobody downloaded, or a failure nobody has read. A cancelled job's client cancelled
    /// it.
    fn unread(&self) -> bool {
        match self.state {
            JobState::Succeeded => {
                !self.expired
                    && self
                        .media
                        .iter()
                        .zip(&self.read)
                        .any(|(m, r)| m.is_some() && !r)
            }
            JobState::Failed => !self.seen_ended,
            _ => false,
        }
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

pub(super) struct Actor {
    pub(super) shared: Arc<Shared>,
    pub(super) decode: std::sync::mpsc::SyncSender<DecodeJob>,
    pub(super) jobs: HashMap<u64, Job>,
    pub(super) done_order: VecDeque<u64>,
    pub(super) queue: VecDeque<WorkKey>,
    pub(super) next_id: u64,
    pub(super) generation: u64,
    pub(super) work_waiters: Vec<(u64, oneshot::Sender<()>)>,
    pub(super) closed: bool,
    pub(super) max_queue: usize,
    pub(super) retention: Retention,
    /// Bytes of finished outputs held.
    pub(super) kept_bytes: usize,
    /// Outputs on a rank or with the decoder, whatever became of their jobs.
    in_flight: HashMap<WorkKey, Flight>,
    /// Moving average of one image's wall time, for Retry-After.
    pub(super) image_seconds: f64,
}

impl Actor {
    pub(super) async fn run(mut self, mut rx: mpsc::Receiver<Msg>) {
        while let Some(m) = rx.recv().await {
            self.handle(m);
            self.expire();
            self.shared.queued.store(self.queue.len(), Ordering::SeqCst);
            self.shared.metrics.queue_depth.set(self.queue.len() as i64);
            self.shared.metrics.running.set(self.in_flight.len() as i64);
        }
    }

    fn handle(&mut self, m: Msg) {
        match m {
            Msg::Submit {
                requests,
                kind,
                owner,
                reply,
            } => {
                let _ = reply.send(self.submit(requests, kind, owner));
            }
            Msg::List { kind, reply } => {
                let mut all: Vec<(Instant, u64, JobStatus)> = self
                    .jobs
                    .iter()
                    .filter(|(_, j)| j.kind.label() == kind)
                    .filter_map(|(id, j)| Some((j.created, *id, self.status(*id).ok()?)))
                    .collect();
                all.sort_by_key(|(created, ..)| std::cmp::Reverse(*created));
                for (_, id, _) in &all {
                    self.seen(*id);
                }
                let _ = reply.send(all.into_iter().map(|(.., s)| s).collect());
            }
            Msg::Delete { id, reply } => {
                if let Some(j) = self.jobs.get(&id) {
                    if !j.state.terminal() {
                        self.end(id, JobState::Cancelled, None);
                    }
                    self.drop_media(id);
                }
                let _ = reply.send(self.status(id));
            }
            Msg::Status { id, reply } => {
                let _ = reply.send(self.status(id));
                self.seen(id);
            }
            Msg::Result { id, index, reply } => {
                let r = self.result(id, index);
                self.seen(id);
                if let (Ok(_), Some(j)) = (&r, self.jobs.get_mut(&id)) {
                    j.read[index] = true;
                }
                let _ = reply.send(r);
            }
            Msg::Drained { reply } => {
                let _ = reply.send(Drained {
                    working: self.queue.len() + self.in_flight.len(),
                    unread: self.jobs.values().filter(|j| j.unread()).count(),
                });
            }
            Msg::Wait { id, reply } => match self.jobs.get_mut(&id) {
                Some(j) if !j.state.terminal() => j.waiters.push(reply),
                _ => drop(reply.send(())),
            },
            Msg::Cancel { id, reply } => {
                if let Some(j) = self.jobs.get(&id) {
                    if !j.state.terminal() {
                        self.end(id, JobState::Cancelled, None);
                    }
                }
                let _ = reply.send(self.status(id));
            }
            Msg::Take { rank, reply } => {
                let work = self.take(rank);
                let _ = reply.send(Taken {
                    work,
                    generation: self.generation,
                    closed: self.closed && self.queue.is_empty(),
                });
            }
            Msg::WaitWork { generation, reply } => {
                if generation < self.generation || self.closed {
                    let _ = reply.send(());
                } else {
                    self.work_waiters.push((generation, reply));
                }
            }
            Msg::Ready { rank } => {
                let n = self.shared.ready_ranks.fetch_add(1, Ordering::SeqCst) + 1;
                tracing::info!(rank, ready = n, "rank ready");
                self.shared.metrics.ready.set((n >= self.shared.dp) as i64);
            }
            Msg::Step { rank, key, step } => match self.image(key) {
                Some((j, Image::Running(r))) if r == rank => j.steps[key.index as usize] = step,
                _ => self.stale(key, "step"),
            },
            Msg::Finished { rank, key, out } => self.finished(rank, key, out),
            // A job that ended while its clip was decoding has nothing to report to.
            Msg::Frames { key, done } => {
                if let Some((j, Image::Decoding)) = self.image(key) {
                    j.frames_decoded[key.index as usize] = done;
                }
            }
            Msg::Decoded { key, media } => self.decoded(key, media),
            Msg::Fatal { msg } => self.fatal(msg),
            Msg::Close => self.close(),
            Msg::Abort => self.fail_live(|| {
                Error::unavailable(
                    "this replica is shutting down and its grace period ran out before the request finished; submit it again (another replica takes it)",
                )
            }),
        }
    }

    /// Notes that a client has read job `id` (once it ended, the client knows how).
    fn seen(&mut self, id: u64) {
        if let Some(j) = self.jobs.get_mut(&id) {
            j.seen_ended |= j.state.terminal();
        }
    }

    fn stale(&self, key: WorkKey, what: &str) {
        self.shared.stale.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(%key, what, "stale report dropped");
    }

    fn image(&mut self, key: WorkKey) -> Option<(&mut Job, Image)> {
        let j = self.jobs.get_mut(&key.id)?;
        let s = *j.images.get(key.index as usize)?;
        Some((j, s))
    }

    fn submit(
        &mut self,
        requests: Vec<Request>,
        kind: Kind,
        owner: Option<Credential>,
    ) -> Result<u64, ApiError> {
        if let Some(f) = self.shared.failed.lock().expect("shared lock").as_ref() {
            return Err(Error::unavailable(format!("engine failed: {f}")).into());
        }
        if self.closed {
            return Err(Error::unavailable(
                "shutting down; submit again (another replica takes it)",
            )
            .into());
        }
        // Everything accepted and not yet on a rank counts against the queue: the outputs
        // waiting for a rank and those waiting for (or in) the decoder. So at most
        // max_queue + dp outputs are ever in the server, and the decoder's channel, that
        // large, always has room for what a rank finishes.
        let need = requests.len();
        let decoding = self
            .in_flight
            .values()
            .filter(|f| **f == Flight::Decoding)
            .count();
        if self.queue.len() + decoding + need > self.max_queue {
            self.shared.metrics.rejected("queue_full");
            let ahead = (self.queue.len() + self.in_flight.len()) as f64 / self.shared.dp as f64;
            return Err(Error::QueueFull {
                queued: self.queue.len() + decoding,
                decoding,
                capacity: self.max_queue,
                need,
                retry_after: (ahead * self.image_seconds).ceil().max(1.0) as u64,
            }
            .into());
        }
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);
        let n = requests.len();
        self.shared.metrics.requested(kind, n);
        self.jobs.insert(
            id,
            Job {
                requests,
                kind,
                owner,
                images: vec![Image::Queued; n],
                steps: vec![0; n],
                frames_decoded: vec![0; n],
                media: vec![None; n],
                expired: false,
                state: JobState::Queued,
                error: None,
                cancel: Arc::new(AtomicBool::new(false)),
                created: Instant::now(),
                created_unix: unix_now(),
                started: None,
                finished: None,
                finished_unix: None,
                waiters: Vec::new(),
                read: vec![false; n],
                seen_ended: false,
            },
        );
        self.queue
            .extend((0..n as u32).map(|index| WorkKey { id, index }));
        self.generation += 1;
        let g = self.generation;
        let (wake, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.work_waiters)
            .into_iter()
            .partition(|(seen, _)| *seen < g);
        self.work_waiters = keep;
        for (_, w) in wake {
            let _ = w.send(());
        }
        Ok(id)
    }

    fn take(&mut self, rank: usize) -> Option<Work> {
        let key = self.queue.pop_front()?;
        self.shared.touch();
        let j = self
            .jobs
            .get_mut(&key.id)
            .expect("queued images belong to live jobs");
        j.images[key.index as usize] = Image::Running(rank);
        self.shared
            .metrics
            .queue_wait_seconds
            .observe(j.created.elapsed().as_secs_f64());
        j.state = JobState::Running;
        j.started.get_or_insert_with(Instant::now);
        self.in_flight.insert(key, Flight::Rank(rank));
        Some(Work {
            key,
            req: j.requests[key.index as usize].clone(),
            cancel: Some(j.cancel.clone()),
        })
    }

    fn finished(&mut self, rank: usize, key: WorkKey, out: Result<Output>) {
        if self.in_flight.get(&key) != Some(&Flight::Rank(rank)) {
            return self.stale(key, "finished");
        }
        self.in_flight.remove(&key);
        let i = key.index as usize;
        let Some(j) = self.jobs.get_mut(&key.id) else {
            // Ended and evicted while it ran: the rank is free, nothing to keep.
            return self.trim_when_idle();
        };
        let (live, kind) = (!j.state.terminal(), j.kind);
        match out {
            Ok(o) if live => {
                j.images[i] = Image::Decoding;
                self.in_flight.insert(key, Flight::Decoding);
                if self.decode.try_send((key, o.latents, kind)).is_err() {
                    // Admission keeps the channel from filling, so only a decoder that
                    // is gone refuses: nothing more can finish.
                    self.in_flight.remove(&key);
                    self.fatal("the decode thread has stopped".into());
                }
            }
            Ok(_) => j.images[i] = Image::Dropped,
            Err(e) => {
                j.images[i] = Image::Dropped;
                if live {
                    self.end(key.id, JobState::Failed, Some(e));
                }
            }
        }
        self.trim_when_idle();
    }

    fn decoded(&mut self, key: WorkKey, media: Result<Media>) {
        if self.in_flight.get(&key) != Some(&Flight::Decoding) {
            return self.stale(key, "decoded");
        }
        self.in_flight.remove(&key);
        let i = key.index as usize;
        let Some(j) = self.jobs.get_mut(&key.id) else {
            return self.trim_when_idle();
        };
        match media {
            Ok(m) if !j.state.terminal() => {
                j.images[i] = Image::Done;
                j.frames_decoded[i] = m.frames;
                self.shared.metrics.generated(j.kind, m.frames);
                j.media[i] = Some(Arc::new(m));
                if j.images.iter().all(|s| *s == Image::Done) {
                    let per_image = j.started.map_or(0.0, |s| s.elapsed().as_secs_f64())
                        / j.images.len() as f64;
                    self.image_seconds = if self.image_seconds == 0.0 {
                        per_image
                    } else {
                        0.8 * self.image_seconds + 0.2 * per_image
                    };
                    self.kept_bytes += j.media_bytes();
                    self.end(key.id, JobState::Succeeded, None);
                }
            }
            Ok(_) => j.images[i] = Image::Dropped,
            Err(e) => {
                j.images[i] = Image::Dropped;
                self.end(key.id, JobState::Failed, Some(e));
            }
        }
        self.trim_when_idle();
    }

    /// Lets job `id`'s outputs go (it keeps its status until it ages out).
    fn drop_media(&mut self, id: u64) {
        let Some(j) = self.jobs.get_mut(&id) else {
            return;
        };
        if j.state == JobState::Succeeded && !j.expired {
            self.kept_bytes -= j.media_bytes();
            j.expired = true;
        }
        j.media.iter_mut().for_each(|m| *m = None);
    }

    /// Lets outputs go once their time is up, and the oldest while the kept bytes are over
    /// the budget.
    fn expire(&mut self) {
        let ttl = self.retention.ttl;
        let now = Instant::now();
        let mut over = self.kept_bytes.saturating_sub(self.retention.max_bytes);
        let mut gone = Vec::new();
        for id in &self.done_order {
            let Some(j) = self.jobs.get(id) else { continue };
            if j.state != JobState::Succeeded || j.expired {
                continue;
            }
            let old = j.finished.is_some_and(|f| now.duration_since(f) >= ttl);
            if old || over > 0 {
                over = over.saturating_sub(j.media_bytes());
                gone.push(*id);
            }
        }
        for id in gone {
            self.drop_media(id);
        }
    }

    /// Moves job `id` to a terminal state: stops its other images, answers its waiters.
    fn end(&mut self, id: u64, state: JobState, error: Option<Error>) {
        let Some(j) = self.jobs.get_mut(&id) else {
            return;
        };
        if j.state.terminal() {
            return;
        }
        j.state = state;
        j.error = error.map(Arc::new);
        j.finished = Some(Instant::now());
        j.finished_unix = Some(unix_now());
        j.cancel.store(true, Ordering::SeqCst);
        for (i, img) in j.images.iter_mut().enumerate() {
            if *img == Image::Queued {
                *img = Image::Dropped;
                self.queue.retain(|k| {
                    *k != WorkKey {
                        id,
                        index: i as u32,
                    }
                });
            }
        }
        if state != JobState::Succeeded {
            j.media.iter_mut().for_each(|p| *p = None);
        }
        for w in j.waiters.drain(..) {
            let _ = w.send(());
        }
        let m = &self.shared.metrics;
        m.finished(match state {
            JobState::Succeeded => "succeeded",
            JobState::Cancelled => "cancelled",
            _ => j.error.as_ref().map_or("failed", |e| e.label()),
        });
        m.request_seconds.observe(j.created.elapsed().as_secs_f64());
        self.done_order.push_back(id);
        while self.done_order.len() > self.retention.keep_finished {
            let old = self.done_order.pop_front().expect("non-empty");
            self.drop_media(old);
            self.jobs.remove(&old);
        }
    }

    /// Takes no more jobs; what is queued still runs (the ranks leave once the queue is
    /// empty and they are idle).
    fn close(&mut self) {
        self.closed = true;
        self.shared.closing.store(true, Ordering::SeqCst);
        for (_, w) in self.work_waiters.drain(..) {
            let _ = w.send(());
        }
    }

    fn fatal(&mut self, msg: String) {
        tracing::error!(%msg, "engine failed; failing every request in flight");
        self.shared
            .failed
            .lock()
            .expect("shared lock")
            .get_or_insert(msg.clone());
        self.shared.metrics.ready.set(0);
        self.shared.fatal.notify_one();
        self.fail_live(|| {
            Error::unavailable(format!("the engine failed; the server will restart: {msg}"))
        });
        self.close();
    }

    /// Fails every job that has not ended yet with the error `why` makes.
    fn fail_live(&mut self, why: impl Fn() -> Error) {
        let live: Vec<u64> = self
            .jobs
            .iter()
            .filter(|(_, j)| !j.state.terminal())
            .map(|(id, _)| *id)
            .collect();
        for id in live {
            self.end(id, JobState::Failed, Some(why()));
        }
    }

    fn status(&self, id: u64) -> Result<JobStatus, ApiError> {
        let j = self.jobs.get(&id).ok_or_else(|| Error::NotFound {
            what: format!("job `{}`", self.shared.ids.format(id)),
        })?;
        let first_queued = j.images.iter().position(|i| *i == Image::Queued);
        let queue_position = first_queued.and_then(|i| {
            self.queue.iter().position(|k| {
                *k == WorkKey {
                    id,
                    index: i as u32,
                }
            })
        });
        let now = Instant::now();
        let end = j.finished.unwrap_or(now);
        let first = &j.requests[0];
        let ttl = self.retention.ttl.as_secs();
        Ok(JobStatus {
            id: self.shared.ids.format(id),
            kind: j.kind.label(),
            owner: j.owner,
            state: j.state,
            queue_position,
            n: j.images.len(),
            steps_done: j.steps.iter().sum(),
            steps_total: j.requests.iter().map(|r| r.steps).sum(),
            frames_decoded: j.frames_decoded.iter().sum(),
            frames_total: j.requests.iter().map(|r| r.frames).sum(),
            width: first.width,
            height: first.height,
            frames: first.frames,
            steps: first.steps,
            seed: first.seed,
            fps: match j.kind {
                Kind::Video { fps } => Some(fps),
                Kind::Image => None,
            },
            prompt: match &first.condition {
                Condition::Prompt { prompt, .. } => Some(prompt.clone()),
                Condition::Class(_) => None,
            },
            created_at: j.created_unix,
            finished_at: j.finished_unix,
            expires_at: j
                .finished_unix
                .filter(|_| j.state == JobState::Succeeded)
                .map(|f| f + ttl),
            expired: j.expired,
            queued_seconds: j
                .started
                .unwrap_or(end)
                .duration_since(j.created)
                .as_secs_f64(),
            running_seconds: j.started.map(|s| end.duration_since(s).as_secs_f64()),
            total_seconds: j
                .finished
                .map(|f| f.duration_since(j.created).as_secs_f64()),
            error: j.error.as_ref().map(|e| e.to_string()),
            error_type: match j.state {
                JobState::Cancelled => Some("cancelled"),
                _ => j.error.as_ref().map(|e| e.label()),
            },
        })
    }

    fn result(&self, id: u64, index: usize) -> Result<Arc<Media>, ApiError> {
        let j = self.jobs.get(&id).ok_or_else(|| Error::NotFound {
            what: format!("job `{}`", self.shared.ids.format(id)),
        })?;
        if index >= j.images.len() {
            return Err(Error::invalid(
                "index",
                format!("{index}: the job has {} image(s)", j.images.len()),
            )
            .into());
        }
        match j.state {
            JobState::Succeeded => j.media[index].clone().ok_or_else(|| {
                Error::Gone {
                    what: format!(
                        "the outputs of job `{}` are no longer kept (kept {} s after finishing, and while under the server's byte budget for kept outputs)",
                        self.shared.ids.format(id),
                        self.retention.ttl.as_secs()
                    ),
                }
                .into()
            }),
            JobState::Failed => Err(ApiError(
                j.error.clone().expect("failed jobs carry their error"),
            )),
            s => Err(Error::Conflict {
                what: format!(
                    "job `{}` is {}; no result",
                    self.shared.ids.format(id),
                    serde_json::to_value(s)
                        .expect("state")
                        .as_str()
                        .unwrap_or("")
                ),
            }
            .into()),
        }
    }

    /// Hands freed heap back to the OS once the server is idle, so memory returns to its
    /// idle level after a burst (glibc keeps freed arenas otherwise).
    fn trim_when_idle(&self) {
        if self.in_flight.is_empty() && self.queue.is_empty() {
            #[cfg(all(target_os = "linux", target_env = "gnu"))]
            // SAFETY: malloc_trim only releases free memory of the allocator's arenas.
            unsafe {
                libc::malloc_trim(0);
            }
        }
    }
}

/// Starts the scheduler task on the current tokio runtime. `decode` receives finished
/// latents; whoever decodes them answers with [`Msg::Decoded`]. `ids` writes the ids of the
/// jobs it takes.
pub fn start(
    dp: usize,
    max_queue: usize,
    retention: Retention,
    ids: JobIds,
    decode: std::sync::mpsc::SyncSender<DecodeJob>,
) -> (Scheduler, RankSource) {
    let (tx, rx) = mpsc::channel(1024);
    let shared = Arc::new(Shared {
        metrics: Metrics::new(dp),
        dp,
        ready_ranks: AtomicUsize::new(0),
        queued: AtomicUsize::new(0),
        closing: AtomicBool::new(false),
        failed: std::sync::Mutex::new(None),
        stale: AtomicUsize::new(0),
        fatal: tokio::sync::Notify::new(),
        started: Instant::now(),
        started_unix: unix_now(),
        progress_ms: AtomicU64::new(0),
        ids,
    });
    let actor = Actor {
        shared: shared.clone(),
        decode,
        jobs: HashMap::new(),
        done_order: VecDeque::new(),
        queue: VecDeque::new(),
        // Numbers start at a random point of the 64-bit space, so two pods behind one
        // Service (or one pod after a restart) never hand out the same id: without a key
        // (see `super::ids`) a client asking the wrong replica gets a 404, never another
        // client's job; with one the id names its owner and the request goes there.
        next_id: rand::random::<u64>(),
        generation: 0,
        work_waiters: Vec::new(),
        closed: false,
        max_queue,
        retention,
        kept_bytes: 0,
        in_flight: HashMap::new(),
        image_seconds: 0.0,
    };
    tokio::spawn(actor.run(rx));
    (
        Scheduler {
            tx: tx.clone(),
            shared: shared.clone(),
        },
        RankSource { tx, shared },
    )
}
