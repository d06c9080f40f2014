//! How serving ends: the controller that waits for a signal or an engine failure and drains
//! the server, the exit code and reason it leaves, and the watchdog that fails a server
//! whose ranks stopped making progress.
//!
//! A drain (SIGTERM: a scale-down, a rollout, a node drain) finishes the work rather than
//! dropping it: readiness fails at once, so the Service stops sending new clients; new jobs
//! are refused with a retryable 503; queued and running jobs keep running; finished results
//! stay readable (other replicas forward reads of this one's jobs here). The last part of
//! the grace is kept for reading: jobs still queued or running then fail with a retryable
//! 503 (a running pass stops at its next block), so their clients can see it. The process
//! leaves as soon as nothing runs and every ended job has been read, and at the latest when
//! the grace is over.

use std::time::{Duration, Instant};

use super::scheduler::{Msg, Scheduler};
use crate::Result;

/// How the server ended: 0 after a clean shutdown, 1 when the engine failed.
pub type ExitCode = i32;

/// How serving ended, as [`shut_down`] saw it.
pub(super) struct Ending {
    /// `Some(why)` when the engine failed while serving (empty when the scheduler was told
    /// and recorded why).
    failed: Option<String>,
    /// The engine thread's result, where it came before the server stopped.
    engine: Option<std::result::Result<Result<()>, tokio::sync::oneshot::error::RecvError>>,
}

/// When, counted from the signal, each part of a drain of `grace` ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrainPlan {
    /// Jobs still queued or running then fail (retryably).
    pub abort: Duration,
    /// The listener closes; open connections get the rest of the grace.
    pub stop: Duration,
    /// How long open connections get after the listener closes.
    pub connections: Duration,
}

impl DrainPlan {
    /// The last quarter of the grace (at least 1 s, at most 10 s, never more than the grace)
    /// is for clients to read how their jobs ended; open connections get the last half of
    /// that (at most 5 s), so the process is gone within the grace.
    pub fn new(grace: Duration) -> DrainPlan {
        let read = (grace / 4)
            .clamp(Duration::from_secs(1), Duration::from_secs(10))
            .min(grace);
        let connections = (read / 2).min(Duration::from_secs(5));
        DrainPlan {
            abort: grace - read,
            stop: grace - connections,
            connections,
        }
    }
}

/// How often a drain asks whether it is done.
const DRAIN_POLL: Duration = Duration::from_millis(100);

/// Waits for SIGTERM, SIGINT or an engine failure; then drains as [`DrainPlan`] says (or,
/// after a failure, stops at once), and tells the server to stop accepting (`stop`).
pub(super) async fn shut_down(
    sched: Scheduler,
    mut engine_rx: tokio::sync::oneshot::Receiver<Result<()>>,
    plan: DrainPlan,
    stop: tokio::sync::oneshot::Sender<()>,
) -> Ending {
    let shared = sched.shared.clone();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("SIGTERM handler");
    // `Some(why)` when the engine failed. The reason is kept here as well as sent to
    // the scheduler: the exit message must not depend on the actor having handled it.
    let failed: Option<String> = tokio::select! {
        _ = term.recv() => None,
        _ = tokio::signal::ctrl_c() => None,
        _ = shared.fatal.notified() => Some(String::new()),
        r = &mut engine_rx => {
            let why = match r {
                Ok(Err(e)) => e.to_string(),
                Ok(Ok(())) => "the engine stopped while serving".to_string(),
                Err(_) => "the engine thread ended without a result".to_string(),
            };
            sched.send(Msg::Fatal { msg: why.clone() }).await;
            Some(why)
        }
    };
    let signalled = Instant::now();
    // Readiness fails and new jobs are refused from here; queued ones still run.
    sched.send(Msg::Close).await;
    if let Some(why) = failed {
        let _ = stop.send(());
        return Ending {
            failed: Some(why),
            engine: None,
        };
    }
    tracing::info!(?plan, "shutting down: finishing queued and running jobs");
    let engine = drain(&sched, engine_rx, signalled, plan).await;
    let _ = stop.send(());
    Ending {
        failed: None,
        engine,
    }
}

/// Runs a drain begun at `signalled`: until nothing runs and every ended job was read, or
/// the plan's stop; jobs still running at its abort fail. Returns the engine's result if it
/// came.
async fn drain(
    sched: &Scheduler,
    mut engine_rx: tokio::sync::oneshot::Receiver<Result<()>>,
    signalled: Instant,
    plan: DrainPlan,
) -> Option<std::result::Result<Result<()>, tokio::sync::oneshot::error::RecvError>> {
    let (abort_at, stop_at) = (signalled + plan.abort, signalled + plan.stop);
    let mut engine = None;
    let mut aborted = false;
    let mut poll = tokio::time::interval(DRAIN_POLL);
    loop {
        tokio::select! {
            r = &mut engine_rx, if engine.is_none() => engine = Some(r),
            _ = tokio::time::sleep_until(abort_at.into()), if !aborted => {
                aborted = true;
                tracing::warn!("grace nearly over: failing the jobs still queued or running");
                sched.send(Msg::Abort).await;
            }
            _ = tokio::time::sleep_until(stop_at.into()) => {
                tracing::info!("grace over: stopping");
                return engine;
            }
            _ = poll.tick() => match sched.drained().await {
                Some(d) if d.working == 0 && d.unread == 0 => {
                    tracing::info!(took = ?signalled.elapsed(), "drained: every job ended and was read");
                    return engine;
                }
                Some(_) => {}
                None => return engine,
            },
        }
    }
}

/// 0 when nothing failed; otherwise 1, with the reason printed.
pub(super) fn exit_code(sched: &Scheduler, ending: Ending) -> ExitCode {
    let Ending { failed, engine } = ending;
    let engine_err = match &engine {
        Some(Ok(Err(e))) => {
            tracing::error!(error = %e, "engine failed");
            Some(e.to_string())
        }
        _ => None,
    };
    // The first reason recorded wins: the scheduler's (a stalled rank, the watchdog), then
    // the one the controller saw, then the engine's own result after draining.
    let recorded = sched.shared.failed.lock().expect("shared lock").clone();
    if recorded.is_none() && failed.is_none() && engine_err.is_none() {
        return 0;
    }
    let why = [recorded, failed, engine_err]
        .into_iter()
        .flatten()
        .find(|w| !w.is_empty())
        .unwrap_or_else(|| "no reason was recorded".to_string());
    eprintln!("layerwise: engine failed: {why}");
    1
}

/// Fails the pod when requests are running but no rank has finished a pass for the
/// timeout (the backend's own timeouts catch stalled transfers and peers; this catches
/// everything else).
pub(super) async fn watchdog(s: Scheduler, timeout: Duration) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        let sh = &s.shared;
        if sh.metrics.running.get() > 0 && sh.since_progress() > timeout {
            let msg = format!(
                "no rank finished a pass for {:?} while requests were running",
                sh.since_progress()
            );
            s.send(Msg::Fatal { msg }).await;
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(grace: u64) -> DrainPlan {
        DrainPlan::new(Duration::from_secs(grace))
    }

    #[test]
    fn the_last_quarter_of_the_grace_is_for_reading_and_everything_ends_within_it() {
        let secs = Duration::from_secs_f64;
        assert_eq!(
            plan(30),
            DrainPlan {
                abort: secs(22.5),
                stop: secs(26.25),
                connections: secs(3.75)
            }
        );
        // A short grace still leaves a second to read; a long one at most 10 s.
        assert_eq!(plan(3).abort, secs(2.0));
        assert_eq!(plan(600).abort, secs(590.0));
        assert_eq!(plan(600).connections, secs(5.0));
        for g in [0, 1, 2, 3, 8, 30, 600] {
            let p = plan(g);
            assert!(p.abort <= p.stop && p.stop + p.connections == Duration::from_secs(g));
        }
        assert_eq!(
            plan(0),
            DrainPlan {
                abort: Duration::ZERO,
                stop: Duration::ZERO,
                connections: Duration::ZERO
            }
        );
    }
}
