//! The pod spec translated into one `podman run`: the container's options (its security
//! context from `security`, its volumes and command line from `staging`, its environment
//! with the Secrets' values), its probes and its restart policy; what cannot be honoured is
//! refused.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;
use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, Probe as ProbeSpec};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::names::labels;
use super::refusal::{refuse_unless, Refusal};
use super::secrets::SecretKey;
use super::staging::{command_line, pre_stop, Staging};
use super::state::Config;

pub(super) const PROBE_EVERY: Duration = Duration::from_millis(250);
pub(super) const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
pub(super) const RESTART_BACKOFF: Duration = Duration::from_secs(1);

/// A probe as the runner runs it.
#[derive(Debug, Clone)]
pub(super) struct Probe {
    /// The address it dials and, for HTTP, the path it GETs.
    pub(super) addr: SocketAddr,
    pub(super) http_path: Option<String>,
    pub(super) period: Duration,
    pub(super) initial_delay: Duration,
    pub(super) failure_threshold: u32,
}

impl Probe {
    pub(super) async fn passes(&self) -> bool {
        match &self.http_path {
            Some(path) => {
                layerwise_engine::tools::loadgen::http(self.addr, "GET", path, None, PROBE_TIMEOUT)
                    .await
                    .is_ok_and(|r| (200..400).contains(&r.status))
            }
            None => matches!(
                tokio::time::timeout(PROBE_TIMEOUT, tokio::net::TcpStream::connect(self.addr))
                    .await,
                Ok(Ok(_))
            ),
        }
    }

    /// How long it may fail before the container counts as failed.
    pub(super) fn window(&self) -> Duration {
        self.initial_delay + self.period * self.failure_threshold
    }
}

/// What a container runs as: the `podman run` options, image and arguments, and how the
/// runner watches and stops it.
pub(super) struct Launch {
    pub(super) container: String,
    pub(super) image: String,
    pub(super) command: String,
    /// `command[1..]` and `args`, rewritten.
    pub(super) args: Vec<String>,
    /// The pod's `env`, resolved.
    pub(super) env: Vec<(String, String)>,
    /// `podman run` options (before the image).
    pub(super) options: Vec<String>,
    /// The user the spec asks for; `None`: the image's.
    pub(super) run_as_user: Option<i64>,
    pub(super) run_as_non_root: bool,
    pub(super) readiness: Option<Probe>,
    pub(super) liveness: Option<Probe>,
    pub(super) startup: Option<Probe>,
    pub(super) restart: RestartPolicy,
    pub(super) pre_stop: Duration,
    pub(super) grace: Duration,
    pub(super) log: PathBuf,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum RestartPolicy {
    Always,
    OnFailure,
    Never,
}

impl RestartPolicy {
    /// The pod's `restartPolicy` (`Always` when unset).
    pub(super) fn of(spec: &PodSpec) -> RestartPolicy {
        match spec.restart_policy.as_deref().unwrap_or("Always") {
            "Always" => RestartPolicy::Always,
            "OnFailure" => RestartPolicy::OnFailure,
            _ => RestartPolicy::Never,
        }
    }

    /// Whether a container that ended with `code` (`None`: unknown) starts again.
    pub(super) fn again(self, code: Option<i32>) -> bool {
        match self {
            RestartPolicy::Always => true,
            RestartPolicy::OnFailure => code != Some(0),
            RestartPolicy::Never => false,
        }
    }
}

/// The probe `spec` of `container`, dialing `ip`.
pub(super) fn probe(
    container: &Container,
    ip: IpAddr,
    spec: Option<&ProbeSpec>,
    which: &str,
) -> Result<Option<Probe>, Refusal> {
    let Some(spec) = spec else { return Ok(None) };
    let named = |port: &IntOrString| -> Result<u16, Refusal> {
        let port = match port {
            IntOrString::Int(p) => *p,
            IntOrString::String(named) => container
                .ports
                .iter()
                .flatten()
                .find(|p| p.name.as_deref() == Some(named))
                .map(|p| p.container_port)
                .ok_or_else(|| {
                    Refusal::config(format!("{which} probe: port {named} is not declared"))
                })?,
        };
        u16::try_from(port)
            .map_err(|_| Refusal::config(format!("{which} probe: port {port} is out of range")))
    };
    let (port, http_path) = if let Some(get) = &spec.http_get {
        refuse_unless!(
            get.scheme.as_deref().unwrap_or("HTTP") == "HTTP"
                && get.host.is_none()
                && get.http_headers.as_ref().is_none_or(Vec::is_empty),
            "{which} probe: only plain HTTP GETs of the pod IP are supported by the node runner"
        );
        (
            named(&get.port)?,
            Some(get.path.clone().unwrap_or_else(|| "/".into())),
        )
    } else if let Some(tcp) = &spec.tcp_socket {
        refuse_unless!(
            tcp.host.is_none(),
            "{which} probe: a TCP probe of another host"
        );
        (named(&tcp.port)?, None)
    } else {
        return Err(Refusal::config(format!(
            "{which} probe: only httpGet and tcpSocket probes are supported by the node runner"
        )));
    };
    let secs =
        |v: Option<i32>, default: i32| Duration::from_secs(v.unwrap_or(default).max(0) as u64);
    Ok(Some(Probe {
        addr: SocketAddr::new(ip, port),
        http_path,
        period: secs(spec.period_seconds, 10).max(Duration::from_secs(1)),
        initial_delay: secs(spec.initial_delay_seconds, 0),
        failure_threshold: spec.failure_threshold.unwrap_or(3).max(1) as u32,
    }))
}

/// Builds the container for the pod's (only) container: stages its volumes and resolves its
/// environment.
pub(super) fn launch(
    config: &Config,
    pod: &Pod,
    node: &str,
    ip: IpAddr,
    secrets: &BTreeMap<SecretKey, String>,
) -> Result<Launch, Refusal> {
    let (spec, container) = one_container(pod)?;
    let image = container
        .image
        .clone()
        .ok_or_else(|| Refusal::config("the container has no image"))?;
    let (staging, mut options) = Staging::new(config, pod, spec, container, node, ip)?;
    let mut env = staging.environment(secrets)?;
    staging.mount_volumes(&mut options, &mut env)?;
    for (k, v) in &env {
        options.push(format!("--env={k}={v}"));
    }
    if let Some(dir) = &container.working_dir {
        options.push(format!("--workdir={dir}"));
    }
    let (entry, args) = command_line(container, ip);
    if let Some(entry) = &entry {
        options.push(format!("--entrypoint={entry}"));
    }

    let restart = RestartPolicy::of(spec);
    let pre_stop = pre_stop(container)?;
    let grace =
        Duration::from_secs(spec.termination_grace_period_seconds.unwrap_or(30).max(0) as u64);
    let log = config.work.join(format!("{}.log", staging.name));
    options.push(format!("--log-opt=path={}", log.display()));
    options.extend(labels(&config.namespace));
    Ok(Launch {
        container: staging.container_name(),
        image,
        command: entry.unwrap_or_default(),
        args,
        env,
        options,
        run_as_user: staging.sec.user,
        run_as_non_root: staging.sec.non_root,
        readiness: probe(
            container,
            ip,
            container.readiness_probe.as_ref(),
            "readiness",
        )?,
        liveness: probe(container, ip, container.liveness_probe.as_ref(), "liveness")?,
        startup: probe(container, ip, container.startup_probe.as_ref(), "startup")?,
        restart,
        pre_stop,
        grace,
        log,
    })
}

/// The pod's spec and its one container, refusing the pod-level features this kubelet does
/// not have.
pub(super) fn one_container(pod: &Pod) -> Result<(&PodSpec, &Container), Refusal> {
    let spec = pod
        .spec
        .as_ref()
        .ok_or_else(|| Refusal::config("pod without spec"))?;
    let [container]: &[Container; 1] = spec
        .containers
        .as_slice()
        .try_into()
        .map_err(|_| Refusal::config("the node runner runs pods of one container"))?;
    refuse_unless!(
        spec.init_containers.as_ref().is_none_or(Vec::is_empty),
        "init containers are not supported by the node runner"
    );
    refuse_unless!(
        spec.host_network != Some(true) && spec.host_pid != Some(true) && spec.host_ipc != Some(true),
        "hostNetwork, hostPID and hostIPC are not supported by the node runner (every pod has its own loopback IP)"
    );
    refuse_unless!(
        spec.share_process_namespace != Some(true),
        "shareProcessNamespace is not supported by the node runner"
    );
    refuse_unless!(
        container.env_from.as_ref().is_none_or(Vec::is_empty),
        "envFrom is not supported by the node runner"
    );
    Ok((spec, container))
}
