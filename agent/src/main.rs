//! `layerwise-agent`: the node agent (`run`), a one-shot `prewarm` for people debugging a
//! node by hand, and the hidden `prewarm-worker` the agent runs prewarm jobs in.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use layerwise_agent::cache::fill::FillOptions;
use layerwise_agent::cache::stage::Stager;
use layerwise_agent::cache::Cache;
use layerwise_agent::cgroup::PrewarmCgroup;
use layerwise_agent::http::{self, AppState};
use layerwise_agent::metrics::Metrics;
use layerwise_agent::models::{self, Settings};
use layerwise_agent::node::{self, Context};
use layerwise_agent::pagecache::{self, Residency};
use layerwise_agent::prewarm::{self, Options};
use layerwise_agent::{meminfo, profiler, worker};
use layerwise_core::bytesize::parse_bytes;
use layerwise_engine::logging::{self, LogArgs};
use tracing::{info, warn};

#[derive(Parser)]
#[command(
    name = "layerwise-agent",
    version,
    about = "layerwise node agent: inventory, checkpoint profiles, page-cache prewarm"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
    #[command(flatten)]
    log: LogArgs,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the agent for this node: report inventory, profile and warm requested models.
    Run(RunArgs),
    /// Warm files or folders into the page cache once, showing residency before and after.
    Prewarm(PrewarmArgs),
    /// Runs one prewarm job read from stdin (the agent starts this; not for people).
    #[command(name = "prewarm-worker", hide = true)]
    PrewarmWorker,
    /// Profiles one model read from stdin under a memory limit (the agent starts this; not
    /// for people).
    #[command(name = "profile-worker", hide = true)]
    ProfileWorker {
        /// The address-space limit the process sets on itself before reading anything.
        #[arg(long = "memory-limit-bytes")]
        memory_limit_bytes: u64,
    },
}

#[derive(Args, Clone)]
struct WarmArgs {
    /// Parallel reader threads.
    #[arg(long, env = "LAYERWISE_AGENT_THREADS", default_value_t = 4)]
    threads: usize,
    /// Bandwidth cap (bytes/s, e.g. `500MB`); unset reads as fast as the disk allows.
    #[arg(long, env = "LAYERWISE_AGENT_RATE", value_parser = parse_bytes)]
    rate: Option<u64>,
    /// Stop warming when the node's MemAvailable falls below this (e.g. `4Gi`; 0: never).
    #[arg(long, env = "LAYERWISE_AGENT_MEMORY_FLOOR", value_parser = parse_bytes, default_value = "1Gi")]
    memory_floor: u64,
    /// Bytes each reader takes at a time.
    #[arg(long, env = "LAYERWISE_AGENT_CHUNK", value_parser = parse_bytes, default_value = "8Mi")]
    chunk: u64,
    /// The cgroup the readers run in, created if missing (relative to the cgroup root, e.g.
    /// `kubepods/layerwise-prewarm`); its memory limit is the cache budget. Unset: no cgroup.
    #[arg(long, env = "LAYERWISE_AGENT_PREWARM_CGROUP")]
    prewarm_cgroup: Option<String>,
    /// The page-cache budget (e.g. `200Gi`): the prewarm cgroup's memory limit, and the size
    /// above which a model is reported as too big to keep warm. Default: half the host memory.
    #[arg(long, env = "LAYERWISE_AGENT_CACHE_BUDGET", value_parser = parse_bytes)]
    cache_budget: Option<u64>,
}

impl WarmArgs {
    fn options(&self) -> Options {
        Options {
            threads: self.threads.max(1),
            chunk_bytes: self.chunk.max(1 << 16),
            rate_bytes_per_s: self.rate,
            floor_bytes: self.memory_floor,
            ..Options::default()
        }
    }

    fn budget(&self) -> Result<u64> {
        Ok(match self.cache_budget {
            Some(b) => b,
            None => meminfo::read()?.total / 2,
        })
    }

    /// The prewarm cgroup, when one is asked for. Not being able to make it is an error the
    /// caller decides about.
    fn cgroup(&self) -> Result<Option<PrewarmCgroup>> {
        let Some(path) = &self.prewarm_cgroup else {
            return Ok(None);
        };
        Ok(Some(PrewarmCgroup::create(path, self.budget()?)?))
    }
}

#[derive(Args)]
struct RunArgs {
    /// This node's name (the downward API's spec.nodeName).
    #[arg(long, env = "NODE_NAME")]
    node_name: String,
    /// Address of /metrics and /healthz.
    #[arg(long, env = "LAYERWISE_AGENT_LISTEN", default_value = "127.0.0.1:9464")]
    listen: SocketAddr,
    /// The cgroup engine pods run in (relative to the cgroup root, e.g. `kubepods` or
    /// `kubepods.slice`); its memory limit is reported.
    #[arg(long, env = "LAYERWISE_AGENT_PODS_CGROUP")]
    pods_cgroup: Option<String>,
    /// Prefix of model host paths inside the agent's container (where the host's model
    /// folders are mounted read-only); unset: host paths are used as they are.
    #[arg(long, env = "LAYERWISE_AGENT_MODEL_ROOT")]
    model_root: Option<PathBuf>,
    /// Host folders models may be read from (comma-separated; the chart passes
    /// `agent.modelRoots`). A model outside them, or leading outside them through a symlink,
    /// fails. Unset: any absolute path.
    #[arg(long, env = "LAYERWISE_AGENT_MODEL_ROOTS", value_delimiter = ',')]
    model_roots: Vec<String>,
    /// Address space of the process that reads a model's checkpoint headers (e.g. `2Gi`):
    /// a checkpoint that needs more to profile fails, and the agent goes on.
    #[arg(long, env = "LAYERWISE_AGENT_PROFILE_MEMORY", value_parser = parse_bytes, default_value = "2Gi")]
    profile_memory: u64,
    /// Seconds that process may take before it is stopped and the model fails.
    #[arg(
        long,
        env = "LAYERWISE_AGENT_PROFILE_TIMEOUT_SECONDS",
        default_value_t = 120
    )]
    profile_timeout_seconds: u64,
    /// Seconds between inventory and residency refreshes.
    #[arg(
        long,
        env = "LAYERWISE_AGENT_REINVENTORY_SECONDS",
        default_value_t = 30
    )]
    reinventory_seconds: u64,
    #[command(flatten)]
    warm: WarmArgs,
    #[command(flatten)]
    cache: CacheArgs,
}

#[derive(Args)]
struct CacheArgs {
    /// The node model cache: a host folder (mounted at the same path in the agent's
    /// container, read-write) that models from S3 are staged into and engine pods mount
    /// read-only. Unset: the agent stages nothing and fails such models by name.
    #[arg(long, env = "LAYERWISE_AGENT_MODEL_CACHE")]
    model_cache: Option<PathBuf>,
    /// The cache's size cap (e.g. `500Gi`): least recently used models no deployment
    /// references are evicted to stay under it, and a model that cannot fit is refused.
    #[arg(long, env = "LAYERWISE_AGENT_MODEL_CACHE_SIZE", value_parser = parse_bytes, default_value = "100Gi")]
    model_cache_size: u64,
    /// Bytes per ranged GET (the resume granularity).
    #[arg(long, env = "LAYERWISE_AGENT_STAGING_CHUNK", value_parser = parse_bytes, default_value = "16Mi")]
    staging_chunk: u64,
    /// Ranged GETs in flight at once.
    #[arg(long, env = "LAYERWISE_AGENT_STAGING_PARALLEL", default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=256))]
    staging_parallel: u16,
}

impl CacheArgs {
    fn stager(&self) -> Result<Option<Arc<Stager>>> {
        let Some(dir) = &self.model_cache else {
            return Ok(None);
        };
        if !dir.is_absolute() {
            bail!("--model-cache {}: must be an absolute path", dir.display());
        }
        let cache = Cache::open(dir, self.model_cache_size)
            .with_context(|| format!("--model-cache {}", dir.display()))?;
        let options = FillOptions {
            chunk_bytes: self.staging_chunk.max(1 << 16),
            parallel: self.staging_parallel as usize,
        };
        Ok(Some(Arc::new(Stager::new(cache, dir.clone(), options))))
    }
}

#[derive(Args)]
struct PrewarmArgs {
    /// Files or folders to warm.
    #[arg(required = true)]
    paths: Vec<PathBuf>,
    #[command(flatten)]
    warm: WarmArgs,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    logging::init(cli.log.log_format, "info")?;
    match cli.cmd {
        Cmd::PrewarmWorker => Ok(worker::serve_stdio()?),
        Cmd::ProfileWorker { memory_limit_bytes } => Ok(profiler::serve_stdio(memory_limit_bytes)?),
        Cmd::Prewarm(a) => prewarm_once(a),
        Cmd::Run(a) => tokio::runtime::Runtime::new()?.block_on(run(a)),
    }
}

async fn run(a: RunArgs) -> Result<()> {
    let cgroup = match a.warm.cgroup() {
        Ok(c) => c.map(Arc::new),
        Err(e) => {
            warn!(error = %e, "no prewarm cgroup: warming is bounded by the memory floor only");
            None
        }
    };
    let budget = match &cgroup {
        Some(c) => Some(c.budget()?),
        None => a.warm.cache_budget,
    };
    if let Some(c) = &cgroup {
        info!(cgroup = c.path(), budget, "prewarm cgroup ready");
    }
    let stager = a.cache.stager()?;
    if let Some(s) = &stager {
        info!(dir = %s.dir().display(), cap = s.cache().cap(), "node model cache ready");
    }
    let settings = Arc::new(Settings {
        model_root: a.model_root,
        model_roots: a.model_roots,
        worker_exe: std::env::current_exe().context("locating the agent binary")?,
        profiler: profiler::Limits {
            memory_bytes: a.profile_memory,
            timeout: Duration::from_secs(a.profile_timeout_seconds.max(1)),
        },
        options: a.warm.options(),
        cgroup,
        budget,
        model_cache: stager.as_ref().map(|s| s.dir().to_path_buf()),
    });
    let metrics = Arc::new(Metrics::new());
    let state = Arc::new(AppState::new(metrics.clone()));
    let listener = tokio::net::TcpListener::bind(a.listen)
        .await
        .with_context(|| format!("listening on {}", a.listen))?;
    info!(addr = %listener.local_addr()?, node = %a.node_name, "serving /metrics and /healthz");
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut http_stop = stop_rx.clone();
    let app = http::app(state.clone());
    let limits = layerwise_engine::http::HttpLimits::PROBES;
    let server = tokio::spawn(layerwise_engine::http::serve(
        listener,
        app,
        limits,
        async move {
            let _ = http_stop.changed().await;
        },
    ));
    let client = kube::Client::try_default()
        .await
        .context("connecting to the Kubernetes API")?;
    let ctx = Context {
        client,
        node: a.node_name,
        settings,
        metrics,
        http: state,
        pods_cgroup: a.pods_cgroup,
        reinventory: Duration::from_secs(a.reinventory_seconds.max(1)),
        stager,
    };
    let result = node::run(ctx, shutdown()).await;
    let _ = stop_tx.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
    info!("stopped");
    Ok(result?)
}

async fn shutdown() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing the SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    info!("signal received");
}

fn report(label: &str, r: Residency) {
    println!(
        "{label}: {} of {} bytes resident ({:.1}%)",
        r.resident,
        r.total,
        r.percent()
    );
}

fn prewarm_once(a: PrewarmArgs) -> Result<()> {
    let mut files = Vec::new();
    for p in &a.paths {
        files.extend(prewarm::files_under(p)?);
    }
    if files.is_empty() {
        bail!("no files under {:?}", a.paths);
    }
    let before = pagecache::residency_of(&files)?;
    report("before", before);
    let bar = ProgressBar::new(before.total);
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
        )
        .expect("valid template"),
    );
    let opts = a.warm.options();
    let cgroup = a.warm.cgroup()?;
    let budget = match &cgroup {
        Some(c) => Some(c.budget()?),
        None => a.warm.cache_budget,
    };
    let outcome = match &cgroup {
        // In the cgroup: run the job in a worker placed there, as the agent does.
        Some(cg) => {
            let job = worker::Job {
                files: files.clone(),
                options: opts,
            };
            let exe = std::env::current_exe()?;
            let b = bar.clone();
            tokio::runtime::Runtime::new()?.block_on(worker::run(
                &exe,
                Some(cg),
                &job,
                move |n| b.set_position(n),
            ))?
        }
        None => {
            let read = AtomicU64::new(0);
            prewarm::run(&files, &opts, &AtomicBool::new(false), &|n| {
                bar.set_position(read.fetch_add(n, Ordering::Relaxed) + n);
            })?
        }
    };
    bar.finish_and_clear();
    let after = pagecache::residency_of(&files)?;
    println!(
        "read {} bytes in {:.2}s ({:.0} MB/s)",
        outcome.bytes_read,
        outcome.seconds,
        outcome.throughput() / 1e6
    );
    report("after", after);
    if let Some(cg) = &cgroup {
        let m = cg.memory()?;
        println!(
            "prewarm cgroup {}: limit {} bytes, usage {} bytes, peak {} bytes",
            cg.path(),
            m.limit.unwrap_or(0),
            m.usage,
            m.peak
        );
    }
    let (state, why) = models::verdict(after, budget, outcome.stopped.as_deref());
    println!("state: {state:?}");
    if let Some(why) = why {
        println!("{why}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_format_is_a_flag_of_every_command() {
        let cli = Cli::try_parse_from(["layerwise-agent", "prewarm", "--log-format", "json", "/m"])
            .unwrap();
        assert_eq!(cli.log.log_format, logging::LogFormat::Json);
    }

    #[test]
    fn sizes_take_the_one_grammar() {
        // `16GB` was a size to the agent and not to the CRDs, `16e9` the other way round.
        for (text, bytes) in [
            ("16GB", 16_000_000_000),
            ("16e9", 16_000_000_000),
            ("16GiB", 16 << 30),
        ] {
            let cli =
                Cli::try_parse_from(["layerwise-agent", "prewarm", "--memory-floor", text, "/m"])
                    .unwrap();
            let Cmd::Prewarm(a) = cli.cmd else {
                unreachable!()
            };
            assert_eq!(a.warm.memory_floor, bytes, "{text}");
        }
        let e = Cli::try_parse_from([
            "layerwise-agent",
            "prewarm",
            "--memory-floor",
            "16 parsecs",
            "/m",
        ])
        .err()
        .unwrap()
        .to_string();
        assert!(
            e.contains("--memory-floor") && e.contains("an unknown unit"),
            "{e}"
        );
    }
}
