//! `layerwise-operator`: runs the DiffusionDeployment controller until SIGTERM or Ctrl-C.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use clap::Parser;
use layerwise_operator::autoscaler::HttpLoad;
use layerwise_operator::planner::Limits;
use layerwise_operator::{resources, run, Settings};

/// Plans and runs layerwise engine deployments from DiffusionDeployments.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Engine image for deployments that name none (the chart passes its own).
    #[arg(
        long,
        env = "LAYERWISE_ENGINE_IMAGE",
        default_value = concat!("layerwise-engine-cuda:", env!("CARGO_PKG_VERSION"))
    )]
    engine_image: String,
    /// Device memory per rank kept for the runtime (MiB).
    #[arg(long, env = "LAYERWISE_DEVICE_OVERHEAD_MIB", default_value_t = 1024)]
    device_overhead_mib: u64,
    /// Host memory per pod beside the model (MiB).
    #[arg(long, env = "LAYERWISE_HOST_OVERHEAD_MIB", default_value_t = 2048)]
    host_overhead_mib: u64,
    /// The most device slots per rank the planner grows K to.
    #[arg(long, env = "LAYERWISE_MAX_SLOTS", default_value_t = 4)]
    max_slots: u32,
    /// Seconds between looks at each deployment (the autoscaler's period).
    #[arg(long, env = "LAYERWISE_RESYNC_SECONDS", default_value_t = 15)]
    resync_seconds: u64,
    /// Watch only this namespace (all when unset).
    #[arg(long, env = "LAYERWISE_WATCH_NAMESPACE")]
    namespace: Option<String>,
    /// Host folders models may be served from (comma-separated; the chart passes
    /// `agent.modelRoots`). A DiffusionDeployment whose hostPath lies outside them is refused.
    /// Unset: any absolute path.
    #[arg(long, env = "LAYERWISE_MODEL_ROOTS", value_delimiter = ',')]
    model_roots: Vec<String>,
    /// Timeout for reading an engine pod's /metrics (milliseconds).
    #[arg(long, env = "LAYERWISE_SCRAPE_TIMEOUT_MS", default_value_t = 2000)]
    scrape_timeout_ms: u64,
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("LAYERWISE_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = Args::parse();
    let client = kube::Client::try_default().await?;
    let settings = Settings {
        engine_image: args.engine_image,
        limits: Limits {
            device_overhead: args.device_overhead_mib << 20,
            host_overhead: args.host_overhead_mib << 20,
            max_slots: args.max_slots,
            ..Limits::default()
        },
        resync: Duration::from_secs(args.resync_seconds.max(1)),
        namespace: args.namespace,
        model_roots: args.model_roots,
    };
    let load = Arc::new(HttpLoad {
        port: resources::ENGINE_PORT as u16,
        timeout: Duration::from_millis(args.scrape_timeout_ms),
    });
    run(client, settings, load, shutdown()).await;
    Ok(())
}

/// Resolves on SIGTERM (what Kubernetes sends) or Ctrl-C.
async fn shutdown() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing the SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
