//! `layerwise serve`: the HTTP API over the scheduler and the dp rank threads, with
//! metrics, pipeline traces, graceful shutdown and a watchdog.
//!
//! Threads: the tokio runtime (HTTP and the scheduler task), one engine thread driving the
//! rank loop of [`crate::execution::rank`] (which starts one thread per rank), and one
//! decode thread that turns finished latents into PNGs so the VAE never holds the other
//! ranks' collectives hostage.

pub mod actor;
pub mod api;
pub mod metrics;
pub mod scheduler;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use clap::Args;

use crate::engine::Model;
use crate::execution::rank::EngineOptions;
use crate::execution::trace::Trace;
use crate::execution::work::WorkKey;
use crate::media::image::encode_png;
use crate::options::EngineArgs;
use crate::{Error, Result, Strategy};
use api::{AppState, Bounds};
use scheduler::{Msg, Scheduler};

/// An error on its way to an HTTP response (shared: one failure may answer many waiters).
#[derive(Debug, Clone)]
pub struct ApiError(pub Arc<Error>);

impl From<Error> for ApiError {
    fn from(e: Error) -> Self {
        ApiError(Arc::new(e))
    }
}

/// `layerwise serve` options.
#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// resident, sharded, offload or offload-sharded.
    #[arg(long, env = "LAYERWISE_STRATEGY", default_value = "offload-sharded")]
    pub strategy: String,
    /// Address to listen on (port 0 picks a free port; the chosen address is printed).
    #[arg(long, env = "LAYERWISE_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Images that may wait in the queue; more get 429.
    #[arg(long, env = "LAYERWISE_MAX_QUEUE", default_value_t = 64)]
    pub max_queue: usize,
    /// Largest image width or height in pixels.
    #[arg(long, env = "LAYERWISE_MAX_SIZE", default_value_t = 512)]
    pub max_size: usize,
    /// Most denoising steps per image.
    #[arg(long, env = "LAYERWISE_MAX_STEPS", default_value_t = 250)]
    pub max_steps: usize,
    /// Most images per request.
    #[arg(long, env = "LAYERWISE_MAX_N", default_value_t = 4)]
    pub max_n: usize,
    /// Largest request body in bytes.
    #[arg(long, env = "LAYERWISE_BODY_LIMIT", default_value_t = 64 * 1024)]
    pub body_limit: usize,
    /// Seconds running requests get to finish after SIGTERM.
    #[arg(long, env = "LAYERWISE_GRACE_SECONDS", default_value_t = 30)]
    pub grace_seconds: u64,
    /// Finished jobs whose results are kept for `GET /v1/jobs/{id}/result`.
    #[arg(long, env = "LAYERWISE_KEEP_FINISHED", default_value_t = 256)]
    pub keep_finished: usize,
    /// Record every copy, gather and compute span into this Chrome trace file (at exit).
    #[arg(long, env = "LAYERWISE_TRACE")]
    pub trace: Option<PathBuf>,
}

/// How the server ended: 0 after a clean shutdown, 1 when the engine failed.
pub type ExitCode = i32;

/// Runs the server until SIGTERM/SIGINT (exit 0) or an engine failure (exit 1).
pub fn serve(a: ServeArgs) -> Result<ExitCode> {
    let strategy: Strategy = a
        .strategy
        .parse()
        .map_err(|e| Error::invalid("strategy", format!("{e}")))?;
    if a.max_queue == 0 {
        return Err(Error::invalid("max-queue", "must be at least 1"));
    }
    let model = Arc::new(Model::open(&a.engine.model)?);
    if model.family.classes().is_none() {
        return Err(Error::invalid(
            "model",
            format!(
                "{}: the {} family is text-conditioned, and the HTTP API serves class-conditional families so far; use `layerwise generate --prompt`",
                a.engine.model.display(),
                model.family.name()
            ),
        ));
    }
    let trace = a.trace.as_ref().map(|_| Trace::new(1_000_000));
    let opts = EngineOptions {
        decode: false,
        trace: trace.clone(),
        ..a.engine.options(strategy)
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Error::invalid("runtime", format!("cannot start tokio: {e}")))?;
    let code = rt.block_on(run(a.clone(), model, opts))?;
    if let (Some(t), Some(path)) = (&trace, &a.trace) {
        t.write(path)?;
        eprintln!("wrote trace {} ({} spans)", path.display(), t.len());
    }
    // Do not wait for threads a failed engine may have left stuck.
    rt.shutdown_timeout(Duration::from_secs(1));
    Ok(code)
}

/// A started engine: the scheduler's handle and the engine thread's outcome.
pub struct Engine {
    pub scheduler: Scheduler,
    pub done: tokio::sync::oneshot::Receiver<Result<()>>,
}

/// Starts the scheduler task (on the current tokio runtime), the decode thread and the
/// engine thread with its ranks. The server and the in-process tests both start here.
pub fn start(
    model: Arc<Model>,
    opts: EngineOptions,
    max_queue: usize,
    keep_finished: usize,
) -> Result<Engine> {
    let (decode_tx, decode_rx) =
        std::sync::mpsc::sync_channel::<(WorkKey, Tensor)>(max_queue + opts.dp + 8);
    let (scheduler, source) = actor::start(opts.dp, max_queue, keep_finished, decode_tx);
    spawn_decoder(
        model.clone(),
        scheduler.clone(),
        decode_rx,
        tokio::runtime::Handle::current(),
    );
    let (engine_tx, done) = tokio::sync::oneshot::channel::<Result<()>>();
    std::thread::Builder::new()
        .name("engine".into())
        .spawn(move || {
            let r = model.drive(&opts, &source).map(drop);
            let _ = engine_tx.send(r);
        })
        .map_err(|e| Error::invalid("engine", format!("cannot start the engine thread: {e}")))?;
    Ok(Engine { scheduler, done })
}

async fn run(a: ServeArgs, model: Arc<Model>, opts: EngineOptions) -> Result<ExitCode> {
    let Engine {
        scheduler: sched,
        done: mut engine_rx,
    } = start(model.clone(), opts.clone(), a.max_queue, a.keep_finished)?;
    let watchdog = tokio::spawn(watchdog(sched.clone(), opts.timeout));
    let state = AppState {
        scheduler: sched.clone(),
        model,
        bounds: Bounds {
            max_size: a.max_size,
            max_steps: a.max_steps,
            max_n: a.max_n,
            body_limit: a.body_limit,
        },
    };
    let listener = tokio::net::TcpListener::bind(a.listen)
        .await
        .map_err(|e| Error::invalid("listen", format!("{}: {e}", a.listen)))?;
    let addr = listener
        .local_addr()
        .map_err(|e| Error::invalid("listen", e.to_string()))?;
    println!("listening on http://{addr}");
    tracing::info!(%addr, dp = a.engine.dp, strategy = %opts.strategy, "serving");

    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let shared = sched.shared.clone();
    let grace = Duration::from_secs(a.grace_seconds);
    let sched2 = sched.clone();
    let controller = tokio::spawn(async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        let failed = tokio::select! {
            _ = term.recv() => false,
            _ = tokio::signal::ctrl_c() => false,
            _ = shared.fatal.notified() => true,
            r = &mut engine_rx => {
                if let Ok(Err(e)) = r { sched2.send(Msg::Fatal { msg: e.to_string() }).await; }
                true
            }
        };
        // Stop accepting and fail what is queued; running requests get the grace period.
        sched2.send(Msg::Close).await;
        let _ = stop_tx.send(());
        if failed {
            return (true, None);
        }
        tracing::info!(?grace, "shutting down: draining running requests");
        let deadline = Instant::now() + grace;
        tokio::select! {
            r = &mut engine_rx => (false, Some(r)),
            _ = tokio::time::sleep_until(deadline.into()) => {
                sched2.send(Msg::Abort).await;
                (false, tokio::time::timeout(opts.timeout, engine_rx).await.ok())
            }
        }
    });
    axum::serve(listener, api::app(state))
        .with_graceful_shutdown(async {
            let _ = stop_rx.await;
        })
        .await
        .map_err(|e| Error::invalid("listen", e.to_string()))?;
    let (failed, engine) = controller
        .await
        .map_err(|e| Error::invalid("shutdown", e.to_string()))?;
    watchdog.abort();
    let engine_failed = matches!(engine, Some(Ok(Err(_))));
    if let Some(Ok(Err(e))) = &engine {
        tracing::error!(error = %e, "engine failed");
    }
    if failed || engine_failed || sched.shared.failed.lock().expect("shared lock").is_some() {
        let why = sched
            .shared
            .failed
            .lock()
            .expect("shared lock")
            .clone()
            .unwrap_or_default();
        eprintln!("layerwise: engine failed: {why}");
        return Ok(1);
    }
    Ok(0)
}

/// Fails the pod when requests are running but no rank has finished a pass for the
/// timeout (the backend's own timeouts catch stalled transfers and peers; this catches
/// everything else).
async fn watchdog(s: Scheduler, timeout: Duration) {
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

fn spawn_decoder(
    model: Arc<Model>,
    sched: Scheduler,
    rx: std::sync::mpsc::Receiver<(WorkKey, Tensor)>,
    rt: tokio::runtime::Handle,
) {
    std::thread::Builder::new()
        .name("decode".into())
        .spawn(move || {
            let vae = match model.decoder(&Device::Cpu) {
                Ok(v) => v,
                Err(e) => {
                    rt.block_on(sched.send(Msg::Fatal {
                        msg: format!("cannot load the VAE decoder: {e}"),
                    }));
                    return;
                }
            };
            for (key, latents) in rx {
                let png = vae.decode(&latents).and_then(|i| encode_png(&i));
                rt.block_on(sched.send(Msg::Decoded { key, png }));
            }
        })
        .expect("spawn decode thread");
}
