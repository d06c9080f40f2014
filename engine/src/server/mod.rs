//! `layerwise serve`: the HTTP API over the scheduler and the dp rank threads, with
//! metrics, pipeline traces, graceful shutdown and a watchdog.
//!
//! Threads: the tokio runtime (HTTP and the scheduler task), one engine thread driving the
//! rank loop of [`crate::execution::rank`] (which starts one thread per rank), and decode
//! threads that turn finished latents into PNGs and MP4s so the VAE never holds the other
//! ranks' collectives hostage: one on the host's CPU, or one per rank on that rank's GPU
//! ([`crate::decode`] decides which).

pub mod actor;
pub mod api;
pub mod body;
pub mod field;
pub mod forward;
pub mod ids;
pub mod kind;
pub mod metrics;
pub mod openapi;
pub mod requests;
pub mod responses;
pub mod scheduler;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use clap::Args;

use crate::bounds::{ModelLimits, RequestBounds};
use crate::contract::{self, EngineContract};
use crate::decode::{DecodeChoice, DecodeSite, DecoderBytes};
use crate::engine::Model;
use crate::execution::cuda::{self, DeviceChoice};
use crate::execution::family::Decoder;
use crate::execution::rank::EngineOptions;
use crate::execution::trace::Trace;
use crate::http;
use crate::media::image::encode_png;
use crate::media::video::{self, Clip, VideoFormat};
use crate::options::BackendArgs;
use crate::{Error, Result};
use api::{AppState, Bounds};
use forward::Forwarding;
use ids::{JobIds, JobKey};
use kind::Kind;
use scheduler::{DecodeJob, Media, Msg, Retention, Scheduler};

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
    // What a plan tells the server: the operator's pods pass exactly this.
    #[command(flatten)]
    pub contract: EngineContract,
    #[command(flatten)]
    pub backend: BackendArgs,
    /// Images that may wait in the queue; more get 429.
    #[arg(long, env = "LAYERWISE_MAX_QUEUE", default_value_t = 64)]
    pub max_queue: usize,
    /// The model's name in the API (`model` of requests, `GET /v1/models`); the model
    /// folder's name when unset.
    #[arg(long, env = "LAYERWISE_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    /// Largest request body in bytes.
    #[arg(long, env = "LAYERWISE_BODY_LIMIT", default_value_t = 64 * 1024)]
    pub body_limit: usize,
    /// Seconds a request's headers may take to arrive (idle connections close after it).
    #[arg(long, env = "LAYERWISE_HEADER_TIMEOUT_SECONDS", default_value_t = 10)]
    pub header_timeout_seconds: u64,
    /// Seconds a request's body may take to arrive after its headers (408 after).
    #[arg(long, env = "LAYERWISE_BODY_TIMEOUT_SECONDS", default_value_t = 30)]
    pub body_timeout_seconds: u64,
    /// Connections served at once; more wait in the listen backlog.
    #[arg(long, env = "LAYERWISE_MAX_CONNECTIONS", default_value_t = 512)]
    pub max_connections: usize,
    /// Seconds running requests get to finish after SIGTERM.
    #[arg(long, env = "LAYERWISE_GRACE_SECONDS", default_value_t = 30)]
    pub grace_seconds: u64,
    /// Finished jobs whose status is kept for `GET /v1/jobs/{id}` and `/v1/videos/{id}`.
    #[arg(long, env = "LAYERWISE_KEEP_FINISHED", default_value_t = 256)]
    pub keep_finished: usize,
    /// Bytes of finished images and videos kept for download; the oldest go first past it.
    #[arg(long, env = "LAYERWISE_RESULT_BYTES", default_value_t = 1 << 30)]
    pub result_bytes: usize,
    /// Seconds a finished job's images and videos are kept for download.
    #[arg(long, env = "LAYERWISE_RESULT_TTL_SECONDS", default_value_t = 3600)]
    pub result_ttl_seconds: u64,
    /// The deployment's key for job ids (the operator's Secret; every replica of a deployment
    /// has the same). With it an id names the replica that owns the job, and a replica asked
    /// for another's job fetches it from there; without it ids stay local. Prefer the
    /// environment variable to the flag, which other users of the host can read.
    #[arg(long, env = contract::ENV_JOB_KEY, hide_env_values = true)]
    pub job_key: Option<JobKey>,
    /// The IP address other replicas reach this one at (the pod's IP, from the downward
    /// API); the listen address when unset. The port is the one listened on.
    #[arg(long, env = contract::ENV_POD_IP)]
    pub pod_ip: Option<IpAddr>,
    /// Seconds the owner of a job may take to answer a request sent on to it (and between
    /// the chunks of its answer).
    #[arg(long, env = "LAYERWISE_FORWARD_TIMEOUT_SECONDS", default_value_t = 10)]
    pub forward_timeout_seconds: u64,
    /// Record every copy, gather and compute span into this Chrome trace file (at exit).
    #[arg(long, env = "LAYERWISE_TRACE")]
    pub trace: Option<PathBuf>,
}

impl ServeArgs {
    /// The bounds these flags set for a model that runs at most `limits`
    /// ([`crate::contract::BoundsArgs::request_bounds`]).
    pub fn request_bounds(&self, limits: &ModelLimits) -> Result<RequestBounds> {
        Ok(self.contract.bounds.request_bounds(limits)?)
    }
}

/// How long connections may still take past the grace period at shutdown.
const DRAIN_MARGIN: Duration = Duration::from_secs(5);

/// How the server ended: 0 after a clean shutdown, 1 when the engine failed.
pub type ExitCode = i32;

/// Runs the server until SIGTERM/SIGINT (exit 0) or an engine failure (exit 1).
pub fn serve(a: ServeArgs) -> Result<ExitCode> {
    let strategy = a.contract.strategy;
    if a.max_queue == 0 {
        return Err(Error::invalid("max-queue", "must be at least 1"));
    }
    let model = Arc::new(Model::open(&a.contract.run.model)?);
    let trace = a.trace.as_ref().map(|_| Trace::new(1_000_000));
    // Device memory kept free for the largest request the bounds admit: what the planner
    // reserved for this pod.
    let bounds = a.request_bounds(&model.checkpoint.limits())?;
    tracing::info!(
        max_width = bounds.max_width,
        max_height = bounds.max_height,
        max_frames = bounds.max_frames,
        "request bounds"
    );
    let mut reserved = bounds;
    if model.family.video().is_none() {
        // An image family refuses frames, so its largest request is one frame.
        reserved.max_frames = 1;
    }
    let activations = reserved
        .activation_bytes_per_rank(&model.checkpoint.activation_cost(), a.contract.run.sp as u64)
        .ok_or_else(|| {
            Error::invalid(
                "max-width",
                format!(
                    "a request at the bounds ({}x{}, {} frames, {} outputs) needs more activation memory than any device holds",
                    bounds.max_width, bounds.max_height, bounds.max_frames, bounds.max_n
                ),
            )
        })?;
    let (site, decoder) = decode_placement(
        &model,
        a.contract.decode,
        a.backend.device,
        a.contract.run.dp,
        &reserved,
    )?;
    tracing::info!(decode = %site, decoder_weights = decoder.weights, decode_peak = decoder.peak, "decoder placement");
    let opts = EngineOptions {
        // The ranks never decode: the decode threads do, beside them.
        decode: false,
        decoder,
        trace: trace.clone(),
        activations,
        resident_blocks_by_component: a.contract.kept.resident_blocks_by_component.0.clone(),
        ..a.backend
            .options(&a.contract.run, strategy, a.contract.kept.resident_blocks)
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Error::internal("cannot start tokio", e))?;
    let code = rt.block_on(run(a.clone(), bounds, model, opts, site))?;
    if let (Some(t), Some(path)) = (&trace, &a.trace) {
        t.write(path)?;
        eprintln!("wrote trace {} ({} spans)", path.display(), t.len());
    }
    // Do not wait for threads a failed engine may have left stuck.
    rt.shutdown_timeout(Duration::from_secs(1));
    Ok(code)
}

/// Where `serve` decodes (`choice` for the backend that `dp` ranks on `device` resolve to)
/// and what the decoder keeps on each rank's device there for outputs within `bounds`:
/// the engine's side of the figure the planner reserves from the profile, by the same
/// [`DecodeSite::decoder_bytes`].
pub fn decode_placement(
    model: &Model,
    choice: DecodeChoice,
    device: DeviceChoice,
    dp: usize,
    bounds: &RequestBounds,
) -> Result<(DecodeSite, DecoderBytes)> {
    let site = choice.resolve(cuda::resolve(device, dp)?.kind());
    let decoder = site
        .decoder_bytes(
            model.checkpoint.decoder_bytes(),
            &model.checkpoint.activation_cost(),
            bounds,
        )
        .ok_or_else(|| {
            Error::invalid(
                "max-width",
                format!(
                    "decoding an output at the bounds ({}x{}) on the device needs more memory than any device holds",
                    bounds.max_width, bounds.max_height
                ),
            )
        })?;
    Ok((site, decoder))
}

/// A started engine: the scheduler's handle and the engine thread's outcome.
pub struct Engine {
    pub scheduler: Scheduler,
    pub done: tokio::sync::oneshot::Receiver<Result<()>>,
}

/// Starts the scheduler task (on the current tokio runtime), the decode threads and the
/// engine thread with its ranks. The server and the in-process tests both start here.
/// With `decode` on the device, each rank's device gets its decoder now, before the ranks
/// measure what memory is left them; a decoder that does not load fails the start.
pub fn start(
    model: Arc<Model>,
    opts: EngineOptions,
    decode: DecodeSite,
    max_queue: usize,
    retention: Retention,
    ids: JobIds,
) -> Result<Engine> {
    let decoders = match decode {
        DecodeSite::Host => Vec::new(),
        DecodeSite::Device => {
            let resolved = cuda::resolve(opts.device, opts.dp * opts.sp)?;
            // Outputs come from each group's leader: a decoder on its device.
            (0..opts.dp)
                .map(|group| {
                    let rank = group * opts.sp;
                    let device = resolved.rank_device(rank)?;
                    let vae = model.decoder(&device).map_err(|e| Error::Rank {
                        rank,
                        msg: format!("cannot load the VAE decoder on its device: {e}"),
                    })?;
                    Ok(DeviceDecoder { rank, device, vae })
                })
                .collect::<Result<Vec<_>>>()?
        }
    };
    // Admission keeps at most max_queue + dp outputs past the queue (see the actor's
    // `submit`), so the decoders' channel always has room for what a rank finishes.
    let (decode_tx, decode_rx) = std::sync::mpsc::sync_channel::<DecodeJob>(max_queue + opts.dp);
    let (scheduler, source) = actor::start(opts.dp, max_queue, retention, ids, decode_tx);
    let rt = tokio::runtime::Handle::current();
    if decoders.is_empty() {
        spawn_decoder(model.clone(), scheduler.clone(), decode_rx, rt);
    } else {
        // One queue, a decoder per device: an output goes to whichever is free, and each
        // device decodes one output at a time (the peak its budget keeps free).
        let queue = Arc::new(Mutex::new(decode_rx));
        for d in decoders {
            spawn_device_decoder(d, scheduler.clone(), queue.clone(), rt.clone())?;
        }
    }
    let (engine_tx, done) = tokio::sync::oneshot::channel::<Result<()>>();
    std::thread::Builder::new()
        .name("engine".into())
        .spawn(move || {
            let r = model.drive(&opts, &source).map(drop);
            let _ = engine_tx.send(r);
        })
        .map_err(|e| Error::internal("cannot start the engine thread", e))?;
    Ok(Engine { scheduler, done })
}

/// How this replica writes job ids: naming itself at `bound` (or the pod IP) when it has a
/// key.
fn job_ids(a: &ServeArgs, bound: SocketAddr) -> Result<JobIds> {
    let Some(key) = a.job_key.clone() else {
        return Ok(JobIds::local());
    };
    let ip = a.pod_ip.unwrap_or(bound.ip());
    if ip.is_unspecified() {
        return Err(Error::invalid(
            "pod-ip",
            format!(
                "with a job key, ids name the address other replicas reach this one at, and {bound} names none; set LAYERWISE_POD_IP (the downward API's status.podIP) or listen on a specific address"
            ),
        ));
    }
    Ok(JobIds::keyed(key, SocketAddr::new(ip, bound.port())))
}

/// Listens, starts the engine and serves until [`shut_down`] ends it: 0 after a clean
/// shutdown, 1 when the engine failed.
async fn run(
    a: ServeArgs,
    bounds: RequestBounds,
    model: Arc<Model>,
    opts: EngineOptions,
    decode: DecodeSite,
) -> Result<ExitCode> {
    // Bound first: job ids name the port actually listened on.
    let listener = tokio::net::TcpListener::bind(a.contract.listen)
        .await
        .map_err(|e| Error::internal(format!("cannot listen on {}", a.contract.listen), e))?;
    let addr = listener
        .local_addr()
        .map_err(|e| Error::internal("the listener has no local address", e))?;
    let ids = job_ids(&a, addr)?;
    let Engine {
        scheduler: sched,
        done: engine_rx,
    } = start(
        model.clone(),
        opts.clone(),
        decode,
        a.max_queue,
        Retention {
            keep_finished: a.keep_finished,
            max_bytes: a.result_bytes,
            ttl: Duration::from_secs(a.result_ttl_seconds),
        },
        ids,
    )?;
    let watchdog = tokio::spawn(watchdog(sched.clone(), opts.timeout));
    let state = app_state(&a, sched.clone(), model, bounds);
    println!("listening on http://{addr}");
    let replica = sched.shared.ids.me().map(|m| m.to_string());
    tracing::info!(%addr, dp = a.contract.run.dp, strategy = %opts.strategy, ?replica, "serving");

    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let grace = Duration::from_secs(a.grace_seconds);
    let controller = tokio::spawn(shut_down(
        sched.clone(),
        engine_rx,
        grace,
        opts.timeout,
        stop_tx,
    ));
    let limits = http::HttpLimits {
        header_timeout: Duration::from_secs(a.header_timeout_seconds.max(1)),
        max_connections: a.max_connections,
        // Running requests get the grace period, then fail at once: their connections
        // answer within it and a moment more; no client can hold the shutdown longer.
        drain: grace + DRAIN_MARGIN,
    };
    http::serve(listener, api::app(state), limits, async {
        let _ = stop_rx.await;
    })
    .await;
    let ending = controller
        .await
        .map_err(|e| Error::internal("the shutdown task failed", e))?;
    watchdog.abort();
    Ok(exit_code(&sched, ending))
}

/// What the API's handlers share: the scheduler, the model under its served name, the
/// bounds on requests and how requests for other replicas' jobs reach them.
fn app_state(
    a: &ServeArgs,
    scheduler: Scheduler,
    model: Arc<Model>,
    bounds: RequestBounds,
) -> AppState {
    AppState {
        scheduler,
        model_name: a
            .served_model_name
            .clone()
            .unwrap_or_else(|| api::folder_name(&a.contract.run.model)),
        model,
        bounds: Bounds {
            request: bounds,
            body_limit: a.body_limit,
            body_timeout: Duration::from_secs(a.body_timeout_seconds),
        },
        forwarding: Forwarding {
            timeout: Duration::from_secs(a.forward_timeout_seconds.max(1)),
            max_body: a.result_bytes as u64,
            ..Forwarding::default()
        },
    }
}

/// How serving ended, as [`shut_down`] saw it.
struct Ending {
    /// `Some(why)` when the engine failed while serving (empty when the scheduler was told
    /// and recorded why).
    failed: Option<String>,
    /// The engine thread's result after draining, where it came in time.
    engine: Option<std::result::Result<Result<()>, tokio::sync::oneshot::error::RecvError>>,
}

/// Waits for SIGTERM, SIGINT or an engine failure; then closes the queue and tells the
/// server to stop accepting (`stop`). After a signal, running requests get `grace` to
/// finish, then are aborted, and the engine `timeout` more to end.
async fn shut_down(
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
fn exit_code(sched: &Scheduler, ending: Ending) -> ExitCode {
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
    rx: std::sync::mpsc::Receiver<DecodeJob>,
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
            for (key, latents, kind) in rx {
                let progress = |done| rt.block_on(sched.send(Msg::Frames { key, done }));
                let media = guarded("the CPU", || {
                    make_media(vae.as_ref(), &latents, kind, progress)
                });
                rt.block_on(sched.send(Msg::Decoded { key, media }));
            }
        })
        .expect("spawn decode thread");
}

/// A decoder on one rank's device.
struct DeviceDecoder {
    rank: usize,
    device: Device,
    vae: Box<dyn Decoder>,
}

impl DeviceDecoder {
    /// Decodes one output's host `latents` on this device into its media. A failure names
    /// the device (`name`), except latents the decoder refuses, which answer as they do
    /// on the host.
    fn decode(
        &self,
        name: &str,
        latents: &Tensor,
        kind: Kind,
        progress: impl FnMut(usize),
    ) -> Result<Media> {
        latents
            .to_device(&self.device)
            .map_err(Error::from)
            .and_then(|l| make_media(self.vae.as_ref(), &l, kind, progress))
            .map_err(|e| match e {
                e @ Error::Core(layerwise_core::Error::Invalid { .. }) => e,
                e => Error::Decode {
                    device: name.to_string(),
                    msg: e.to_string(),
                },
            })
    }
}

/// Runs one output's decode on `device`. A panic in it fails that output alone, naming the
/// device, and the decode thread goes on to the next (a panic would otherwise end the
/// thread and leave its job, and every one queued behind it, waiting forever).
fn guarded(device: &str, decode: impl FnOnce() -> Result<Media>) -> Result<Media> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(decode)).unwrap_or_else(|p| {
        Err(Error::Decode {
            device: device.to_string(),
            msg: format!(
                "the decoder panicked: {}",
                crate::error::panic_message(p.as_ref())
            ),
        })
    })
}

/// A decode thread on rank `d.rank`'s device, taking outputs from the shared `queue`. An
/// output that fails to decode there (out of device memory, a kernel error, latents the
/// decoder refuses) fails its job alone, naming the device; the thread carries on.
fn spawn_device_decoder(
    d: DeviceDecoder,
    sched: Scheduler,
    queue: Arc<Mutex<std::sync::mpsc::Receiver<DecodeJob>>>,
    rt: tokio::runtime::Handle,
) -> Result<()> {
    let name = match d.device {
        Device::Cpu => format!("the CPU (rank {})", d.rank),
        _ => format!("GPU {}", d.rank),
    };
    std::thread::Builder::new()
        .name(format!("decode-{}", d.rank))
        .spawn(move || loop {
            // The guard is dropped at the end of the statement: the others wait on the
            // queue only while this one does.
            let job = queue.lock().expect("decode queue lock").recv();
            let Ok((key, latents, kind)) = job else {
                return;
            };
            let progress = |done| rt.block_on(sched.send(Msg::Frames { key, done }));
            let media = guarded(&name, || d.decode(&name, &latents, kind, progress));
            rt.block_on(sched.send(Msg::Decoded { key, media }));
        })
        .map_err(|e| Error::internal("cannot start a decode thread", e))?;
    Ok(())
}

/// Decodes one output's latents into what the API serves: a PNG for an image; for a clip,
/// an MP4 and its first frame as a PNG thumbnail. `progress` hears the frames decoded so far.
pub fn make_media(
    vae: &dyn Decoder,
    latents: &Tensor,
    kind: Kind,
    mut progress: impl FnMut(usize),
) -> Result<Media> {
    let (mut frames, mut first, mut size) = (Vec::new(), None, (0, 0));
    vae.decode_frames(latents, &mut |batch| {
        // Frames decoded on a GPU come to the host once, to be encoded there.
        let batch = batch.to_device(&Device::Cpu)?;
        let (_, _, h, w) = batch.dims4()?;
        size = (w, h);
        if first.is_none() {
            first = Some(encode_png(&batch.get(0)?)?);
        }
        if let Kind::Video { .. } = kind {
            frames.extend(video::rgb8(&batch)?);
            progress(frames.len());
        }
        Ok(())
    })?;
    let first = first.ok_or_else(|| Error::bug("the decoder made no frames"))?;
    Ok(match kind {
        Kind::Image => Media {
            bytes: first,
            content_type: "image/png",
            thumbnail: None,
            frames: 1,
        },
        Kind::Video { fps } => {
            let clip = Clip {
                width: size.0,
                height: size.1,
                fps,
                frames: frames.iter().map(Vec::as_slice).collect(),
            };
            Media {
                bytes: video::encode(&clip, VideoFormat::Mp4)?,
                content_type: "video/mp4",
                thumbnail: Some(first),
                frames: frames.len(),
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A decoder that fails as a device would, or refuses the latents.
    struct Failing {
        refuse: bool,
    }

    impl Decoder for Failing {
        fn decode(&self, _: &Tensor) -> Result<Tensor> {
            Err(if self.refuse {
                Error::invalid("latents", "expected [1, 16, frames, height, width]")
            } else {
                candle_core::Error::Msg("CUDA_ERROR_OUT_OF_MEMORY: out of memory".into()).into()
            })
        }
    }

    /// A decoder with a bug.
    struct Panicking;

    impl Decoder for Panicking {
        fn decode(&self, _: &Tensor) -> Result<Tensor> {
            panic!("index out of bounds: the len is 3 but the index is 7")
        }
    }

    #[test]
    fn a_decoder_that_panics_fails_its_output_alone() {
        let latents = Tensor::zeros((1, 4, 2, 2), candle_core::DType::F32, &Device::Cpu).unwrap();
        let d = DeviceDecoder {
            rank: 0,
            device: Device::Cpu,
            vae: Box::new(Panicking),
        };
        let e = guarded("GPU 0", || d.decode("GPU 0", &latents, Kind::Image, |_| {})).unwrap_err();
        assert_eq!(e.label(), "decode_failed");
        let msg = e.to_string();
        assert!(
            msg.contains("GPU 0") && msg.contains("panicked") && msg.contains("index is 7"),
            "{msg}"
        );
        // The same thread decodes the next output.
        let ok = DeviceDecoder {
            rank: 0,
            device: Device::Cpu,
            vae: Box::new(Failing { refuse: true }),
        };
        let e = guarded("GPU 0", || {
            ok.decode("GPU 0", &latents, Kind::Image, |_| {})
        })
        .unwrap_err();
        assert_eq!(e.http_status(), 422, "{e}");
    }

    #[test]
    fn a_failed_decode_on_a_device_names_the_device_and_refused_latents_answer_as_on_the_host() {
        let latents = Tensor::zeros((1, 4, 2, 2), candle_core::DType::F32, &Device::Cpu).unwrap();
        let oom = DeviceDecoder {
            rank: 1,
            device: Device::Cpu,
            vae: Box::new(Failing { refuse: false }),
        };
        let e = oom
            .decode("GPU 1", &latents, Kind::Image, |_| {})
            .unwrap_err();
        assert!(matches!(e, Error::Decode { .. }), "{e:?}");
        assert_eq!(e.label(), "decode_failed");
        assert_eq!(e.http_status(), 500);
        let msg = e.to_string();
        assert!(
            msg.contains("decoding on GPU 1") && msg.contains("out of memory"),
            "{msg}"
        );
        let bad = DeviceDecoder {
            rank: 0,
            device: Device::Cpu,
            vae: Box::new(Failing { refuse: true }),
        };
        let e = bad
            .decode("GPU 0", &latents, Kind::Image, |_| {})
            .unwrap_err();
        assert_eq!(e.field(), Some("latents"), "{e}");
        assert_eq!(e.http_status(), 422);
    }
}
