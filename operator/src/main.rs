//! `layerwise-operator`: serves `/metrics`, `/healthz` and `/readyz`, takes part in leader
//! election, and runs the DiffusionDeployment controller while it leads, until SIGTERM or
//! Ctrl-C (the default, as the chart and the image run it); `layerwise-operator plan`
//! prints the plan it would record for a model, a node and a workload, without a cluster
//! ([`layerwise_operator::plan_cli`]).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context as _, Result};
use clap::{Parser, Subcommand};
use layerwise_engine::logging::{self, LogArgs, LogFormat};
use layerwise_operator::autoscaler::HttpLoad;
use layerwise_operator::plan_cli::{self, LimitArgs, PlanArgs};
use layerwise_operator::resources::EnginePods;
use layerwise_operator::{client, http, resources, run, Election, Settings, Telemetry};
use tracing::info;

/// Plans and runs layerwise engine deployments from DiffusionDeployments.
#[derive(Parser, Debug)]
#[command(version, args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: Args,
    #[command(flatten)]
    log: LogArgs,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Prints the plan the operator would record for a model, a node and a workload
    /// (strategy, dp, sp, slots, memory term by term, predicted times, reasons), or the
    /// refusal it would state (exit code 3). Needs no cluster.
    Plan(PlanArgs),
}

/// The operator's run (the default without a command).
#[derive(clap::Args, Debug)]
struct Args {
    /// Engine image for deployments that name none (the chart passes its own).
    #[arg(
        long,
        env = "LAYERWISE_ENGINE_IMAGE",
        default_value = concat!("layerwise-engine-cuda:", env!("CARGO_PKG_VERSION"))
    )]
    engine_image: String,
    /// Secrets every engine pod pulls its image with (comma-separated names; the chart
    /// passes its `imagePullSecrets`). Each must exist in the DiffusionDeployment's namespace.
    #[arg(
        long,
        env = "LAYERWISE_ENGINE_IMAGE_PULL_SECRETS",
        value_delimiter = ','
    )]
    engine_image_pull_secrets: Vec<String>,
    /// RuntimeClass of engine pods whose DiffusionDeployment names none (for example
    /// `nvidia`; the chart passes `enginePods.runtimeClassName`). Unset: the cluster's default.
    #[arg(long, env = "LAYERWISE_ENGINE_RUNTIME_CLASS")]
    engine_runtime_class: Option<String>,
    /// Tolerations every engine pod carries, as a JSON list (the chart passes
    /// `enginePods.tolerations`), beside each DiffusionDeployment's own.
    #[arg(long, env = "LAYERWISE_ENGINE_TOLERATIONS")]
    engine_tolerations: Option<String>,
    #[command(flatten)]
    limits: LimitArgs,
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
    /// The fewest candidate nodes a deployment asks to profile and warm its model (more
    /// when its most replicas need more nodes).
    #[arg(long, env = "LAYERWISE_PREPARE_NODES", default_value_t = 8)]
    prepare_nodes: usize,
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, env = "LAYERWISE_LISTEN", default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Take part in leader election: run the controller only while holding the Lease.
    #[arg(long, env = "LAYERWISE_LEADER_ELECT", default_value_t = true, action = clap::ArgAction::Set)]
    leader_elect: bool,
    /// Name of the Lease replicas elect a leader on.
    #[arg(
        long,
        env = "LAYERWISE_LEASE_NAME",
        default_value = "layerwise-operator"
    )]
    lease_name: String,
    /// Namespace of the Lease (the chart passes the operator's own).
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    lease_namespace: String,
    /// Seconds a lease lasts after its last renewal (how long a crashed leader's replica
    /// waits at most before taking over).
    #[arg(long, env = "LAYERWISE_LEASE_SECONDS", default_value_t = 15)]
    lease_seconds: u64,
    /// Seconds before the lease lapses that the leader renews it (also the clock skew
    /// between replicas it tolerates); less than the lease.
    #[arg(long, env = "LAYERWISE_LEASE_GRACE_SECONDS", default_value_t = 5)]
    lease_grace_seconds: u64,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Plan(args)) => std::process::exit(plan_cli::run(&args)?),
        None => serve(cli.run, cli.log.log_format),
    }
}

#[tokio::main]
async fn serve(args: Args, log_format: LogFormat) -> Result<()> {
    logging::init(log_format, "info")?;
    ensure!(
        args.lease_grace_seconds >= 1 && args.lease_grace_seconds < args.lease_seconds,
        "--lease-grace-seconds ({}) must be at least 1 and less than --lease-seconds ({})",
        args.lease_grace_seconds,
        args.lease_seconds
    );
    let engine_pods = EnginePods::from_flags(
        &args.engine_image_pull_secrets,
        args.engine_runtime_class.as_deref(),
        args.engine_tolerations.as_deref(),
    )
    .map_err(anyhow::Error::msg)?;
    // The engines log as the operator does.
    let engine_pods = EnginePods {
        log_format,
        ..engine_pods
    };
    let telemetry = Arc::new(Telemetry::default());
    let config = kube::Config::infer()
        .await
        .context("finding the Kubernetes API")?;
    let client = client::counted(config, telemetry.clone())?;
    let election = args.leader_elect.then(|| Election {
        lease: args.lease_name.clone(),
        namespace: args.lease_namespace.clone(),
        identity: identity(),
        lease_seconds: args.lease_seconds,
        grace_seconds: args.lease_grace_seconds,
    });
    let settings = Settings {
        engine_image: args.engine_image,
        engine_pods,
        limits: args.limits.limits(),
        resync: Duration::from_secs(args.resync_seconds.max(1)),
        namespace: args.namespace,
        model_roots: args.model_roots,
        prepare_nodes: args.prepare_nodes.max(1),
        election,
    };
    let load = Arc::new(HttpLoad::new(
        resources::ENGINE_PORT as u16,
        Duration::from_millis(args.scrape_timeout_ms),
    ));

    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("listening on {}", args.listen))?;
    info!(addr = %listener.local_addr()?, "serving /metrics, /healthz and /readyz");
    let (stop_http, http_stopped) = tokio::sync::oneshot::channel::<()>();
    let limits = layerwise_engine::http::HttpLimits::PROBES;
    let server = tokio::spawn(layerwise_engine::http::serve(
        listener,
        http::app(telemetry.clone()),
        limits,
        async move {
            let _ = http_stopped.await;
        },
    ));
    let result = run(client, settings, load, telemetry, shutdown()).await;
    let _ = stop_http.send(());
    let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
    info!("stopped");
    Ok(result?)
}

/// This process's identity in the Lease: the pod's name (or the host's) and a random part,
/// so that a restarted container never takes its predecessor's lease for its own.
fn identity() -> String {
    let name = std::env::var("POD_NAME")
        .or_else(|_| std::env::var("HOSTNAME"))
        .unwrap_or_else(|_| "layerwise-operator".into());
    let mut bytes = [0u8; 4];
    let suffix = match getrandom::fill(&mut bytes) {
        Ok(()) => u32::from_le_bytes(bytes),
        Err(_) => std::process::id(),
    };
    format!("{name}_{suffix:08x}")
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_format_is_a_flag_of_the_operator() {
        let cli = Cli::try_parse_from(["layerwise-operator", "--log-format", "json"]).unwrap();
        assert_eq!(cli.log.log_format, LogFormat::Json);
        assert!(Cli::try_parse_from(["layerwise-operator", "--log-format", "xml"]).is_err());
    }
}
