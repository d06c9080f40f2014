//! How serving ends: the controller that waits for a signal or an engine failure and drains
//! the running requests, the exit code and reason it leaves, and the watchdog that fails a
//! server whose ranks stopped making progress.

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
    /// The engine thread's result after draining, where it came in time.
    engine: Option<std::result::Result<Result<()>, tokio::sync::oneshot::error::RecvError>>,
}

/// Waits for SIGTERM, SIGINT or an engine failure; then closes the queue and tells the
/// server to stop accepting (`stop`). After a signal, running requests get `grace` to
/// finish, then are aborted, and the engine `timeout` more to end.
pub(super) async fn shut_down(
    sched: Scheduler,
    mut engine_rx: tokio::sync::oneshot::Receiver<Result<()>>,
    grace: Duration,
    timeout: Duration,
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
    // Stop accepting and fail what is queued; running requests get the grace period.
    sched.send(Msg::Close).await;
    let _ = stop.send(());
    if let Some(why) = failed {
        return Ending {
            failed: Some(why),
            engine: None,
        };
    }
    tracing::info!(?grace, "shutting down: draining running requests");
    let deadline = Instant::now() + grace;
    let engine = tokio::select! {
        r = &mut engine_rx => Some(r),
        _ = tokio::time::sleep_until(deadline.into()) => {
            sched.send(Msg::Abort).await;
            tokio::time::timeout(timeout, engine_rx).await.ok()
        }
    };
    Ending {
        failed: None,
        engine,
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
