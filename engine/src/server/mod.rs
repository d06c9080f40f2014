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
pub mod cache_field;
pub mod decoders;
pub mod error;
pub mod field;
pub mod flags;
pub mod forward;
pub mod ids;
pub mod kind;
pub mod launch;
pub mod metrics;
pub mod openai_fields;
pub mod openapi;
pub mod owner;
pub mod requests;
pub mod responses;
pub mod scheduler;
pub mod shutdown;

// The names callers outside the server use (the CLI, the operator's and the engine's tests).
pub use decoders::{decode_placement, make_media};
pub use error::ApiError;
pub use launch::{start, Engine};
pub use shutdown::ExitCode;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;

use crate::bounds::{ModelLimits, RequestBounds};
use crate::contract::{self, EngineContract};
use crate::decode::DecodeSite;
use crate::engine::Model;
use crate::execution::rank::EngineOptions;
use crate::execution::trace::Trace;
use crate::http;
use crate::options::BackendArgs;
use crate::{Error, Result};
use api::{AppState, Bounds};
use forward::Forwarding;
use ids::{JobIds, JobKey};
use scheduler::{Retention, Scheduler};
use shutdown::{exit_code, shut_down, watchdog, DrainPlan};

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
    /// Seconds a drain (SIGTERM) may take: queued and running jobs finish and finished
    /// results stay readable; in its last quarter (1 to 10 s) what still runs fails with a
    /// retryable 503, and the process is gone by its end.
    #[arg(long, env = contract::ENV_GRACE_SECONDS, default_value_t = contract::DEFAULT_GRACE_SECONDS)]
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
    /// Let a caller without a credential (no `Authorization: Bearer` header) list jobs: it
    /// then sees every anonymous caller's. Off by default, as jobs belong to the credential
    /// that created them and anonymous callers share none.
    #[arg(long, env = "LAYERWISE_ANONYMOUS_LIST", default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub anonymous_list: bool,
    /// The step cache (off by default), as `generate --cache` takes it: a kind with
    /// diffusers' defaults (`first_block`, `taylorseer`) or its JSON setting (MagCache
    /// with its calibrated `ratios`). Every request runs with it unless it asks otherwise,
    /// and none may ask for more: another kind, more skipping or more cached memory (the
    /// API's `cache` field; docs/serving.md). A kind the model's family cannot honour is
    /// refused at start.
    #[arg(long, env = layerwise_core::step_cache::ENV_CACHE, value_parser = crate::cache::StepCache::parse_flag)]
    pub cache: Option<crate::cache::StepCache>,
    /// Record every copy, gather and compute span into this Chrome trace file (at exit).
    #[arg(long, env = "LAYERWISE_TRACE")]
    pub trace: Option<PathBuf>,
}

impl ServeArgs {
    /// The bounds these flags set for a model that runs at most `limits`
    /// ([`crate::contract::BoundsArgs::request_bounds`]).
    /// Every operator flag within its range ([`flags`]), else an error naming the first
    /// outside and its range. (The request bounds' flags are checked where they are read
    /// against the model's limits, [`Self::request_bounds`].)
    pub fn check_ranges(&self) -> Result<()> {
        let n = |v: usize| v as u64;
        for (range, value) in [
            (flags::TIMEOUT_SECONDS, self.backend.timeout_seconds),
            (flags::MAX_QUEUE, n(self.max_queue)),
            (flags::BODY_LIMIT, n(self.body_limit)),
            (flags::HEADER_TIMEOUT_SECONDS, self.header_timeout_seconds),
            (flags::BODY_TIMEOUT_SECONDS, self.body_timeout_seconds),
            (flags::MAX_CONNECTIONS, n(self.max_connections)),
            (flags::GRACE_SECONDS, self.grace_seconds),
            (flags::KEEP_FINISHED, n(self.keep_finished)),
            (flags::RESULT_BYTES, n(self.result_bytes)),
            (flags::RESULT_TTL_SECONDS, self.result_ttl_seconds),
            (flags::FORWARD_TIMEOUT_SECONDS, self.forward_timeout_seconds),
        ] {
            range.check(value)?;
        }
        Ok(())
    }

    /// Each bound within its range ([`RequestBounds::checked`], the ranges the
    /// DiffusionDeployment's rules state).
    pub fn request_bounds(&self, limits: &ModelLimits) -> Result<RequestBounds> {
        Ok(self.contract.bounds.request_bounds(limits)?.checked()?)
    }
}

/// Runs the server until SIGTERM/SIGINT (exit 0) or an engine failure (exit 1).
pub fn serve(a: ServeArgs) -> Result<ExitCode> {
    let strategy = a.contract.strategy;
    a.check_ranges()?;
    let model = Arc::new(Model::open(&a.contract.run.model)?);
    if let Some(c) = &a.cache {
        crate::cache::bound::check_server(
            "--cache",
            c,
            model.family.name(),
            model.family.step_caches(),
            a.contract.run.sp,
        )?;
    }
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
    // The step cache's tensors beside them: its setting is the most any request holds
    // (a request may ask for less, never more), the figure the planner reserved. In the
    // element the ranks will compute in, as the planner charged it.
    let cache = a.cache.as_ref().map_or_else(Default::default, |c| c.hold());
    let element = model.compute_element(&a.backend.options(
        &a.contract.run,
        strategy,
        a.contract.kept.resident_blocks,
    ))?;
    let activations = reserved
        .cached_activation_bytes_per_rank(
            &model.checkpoint.activation_cost(),
            a.contract.run.sp as u64,
            cache,
            element,
        )
        .ok_or_else(|| {
            Error::invalid(
                "max-width",
                format!(
                    "a request at the bounds ({}x{}, {} frames, {} outputs) needs more activation memory than any device holds",
                    bounds.max_width, bounds.max_height, bounds.max_frames, bounds.max_n
                ),
            )
        })?;
    let offered = a
        .contract
        .decode_budget
        .unwrap_or(crate::decode::DEFAULT_DECODE_BUDGET);
    let (site, decoder) = decode_placement(
        &model,
        a.contract.decode,
        a.backend.device,
        a.contract.run.dp,
        &reserved,
        offered,
    )?;
    // On the device the plan charged the peak of the largest output's split: every
    // output decodes within that, not within all the plan offered.
    let decode_budget = match site {
        DecodeSite::Device if model.checkpoint.decode_cost().is_some() => decoder.peak,
        _ => offered,
    };
    tracing::info!(decode = %site, decoder_weights = decoder.weights, decode_peak = decoder.peak, "decoder placement");
    let opts = EngineOptions {
        // The ranks never decode: the decode threads do, beside them.
        decode: false,
        decoder,
        decode_budget,
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
    let plan = DrainPlan::new(Duration::from_secs(a.grace_seconds));
    let controller = tokio::spawn(shut_down(sched.clone(), engine_rx, plan, stop_tx));
    let limits = http::HttpLimits {
        header_timeout: Duration::from_secs(a.header_timeout_seconds),
        max_connections: a.max_connections,
        // The listener stays open through the drain (results are read then); what is
        // still open when it closes gets the rest of the grace, so no client can hold
        // the pod past it.
        drain: plan.connections,
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
            timeout: Duration::from_secs(a.forward_timeout_seconds),
            max_body: a.result_bytes as u64,
            ..Forwarding::default()
        },
        sp: a.contract.run.sp,
        anonymous_list: a.anonymous_list,
        cache: a.cache.clone(),
    }
}
