//! The test cluster: found or brought up once per test process, handed out as kube clients.
//!
//! In order of preference the tests use
//! 1. the cluster `KUBECONFIG` names, when its apiserver answers (what `scripts/test` does);
//! 2. a cluster that an earlier test process (or a person) started with `tests/cluster/up`
//!    and that still answers at `$LAYERWISE_CLUSTER_DIR/kubeconfig`;
//! 3. a new one from `tests/cluster/up`, started once for this process and left running for
//!    the next test binary; `tests/cluster/down` stops it.
//!
//! A kube `Client` runs a background task on the runtime that built it, and every
//! `#[tokio::test]` has its own runtime, so the process shares the kubeconfig path, not a
//! client: [`client`] builds a fresh client each call.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

/// How long the apiserver gets to answer before a kubeconfig counts as unreachable.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// The kubeconfig this process settled on, once it has.
static KUBECONFIG: Mutex<Option<PathBuf>> = Mutex::new(None);

/// The state folder `tests/cluster/up` uses (same defaults as `tests/cluster/env`).
pub fn cluster_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("LAYERWISE_CLUSTER_DIR") {
        return dir.into();
    }
    let cache = std::env::var_os("LAYERWISE_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|d| Path::new(&d).join("layerwise")))
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/layerwise")))
        .unwrap_or_else(|| PathBuf::from("/tmp/layerwise"));
    cache.join("cluster")
}

/// A client for the test cluster, bringing the cluster up first if this process has none.
pub async fn client() -> Result<Client> {
    let known = KUBECONFIG.lock().unwrap().clone();
    if let Some(path) = known {
        return connect(&path).await;
    }
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(path) = std::env::var_os("KUBECONFIG").filter(|p| !p.is_empty()) {
        candidates.push(path.into());
    }
    candidates.push(cluster_dir().join("kubeconfig"));
    for path in candidates {
        if !path.is_file() {
            continue;
        }
        match connect(&path).await {
            Ok(client) => {
                tracing::info!(kubeconfig = %path.display(), "reusing cluster");
                *KUBECONFIG.lock().unwrap() = Some(path);
                return Ok(client);
            }
            Err(err) => eprintln!("e2e: cluster at {} unusable: {err:#}", path.display()),
        }
    }
    let path = tokio::task::spawn_blocking(bring_up).await??;
    let client = connect(&path).await?;
    *KUBECONFIG.lock().unwrap() = Some(path);
    Ok(client)
}

/// Builds a client from `path` and checks that the apiserver answers.
async fn connect(path: &Path) -> Result<Client> {
    let kubeconfig = Kubeconfig::read_from(path)
        .with_context(|| format!("reading kubeconfig {}", path.display()))?;
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .with_context(|| format!("loading kubeconfig {}", path.display()))?;
    let client = Client::try_from(config)?;
    let version = tokio::time::timeout(PROBE_TIMEOUT, client.apiserver_version())
        .await
        .with_context(|| format!("apiserver of {} did not answer", path.display()))??;
    tracing::debug!(version = %version.git_version, "apiserver answered");
    Ok(client)
}

/// Runs `tests/cluster/up` (once per process: callers hold no lock, but `up` itself
/// replaces any stale cluster) and returns the kubeconfig it printed.
fn bring_up() -> Result<PathBuf> {
    static UP: Mutex<Option<PathBuf>> = Mutex::new(None);
    let mut done = UP.lock().unwrap();
    if let Some(path) = done.as_ref() {
        return Ok(path.clone());
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("cluster/up");
    eprintln!(
        "e2e: no cluster answers; starting one with {}",
        script.display()
    );
    let out = Command::new(&script)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!("{} failed ({}): {stdout}", script.display(), out.status);
    }
    let path = stdout
        .lines()
        .last()
        .and_then(|l| l.strip_prefix("export KUBECONFIG="))
        .with_context(|| format!("{} printed no `export KUBECONFIG=`", script.display()))?;
    let path = PathBuf::from(path.trim());
    *done = Some(path.clone());
    Ok(path)
}

/// A namespace name unique to this test and process, for tests to create and delete.
pub fn unique_namespace(test: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or_default();
    format!("e2e-{test}-{}-{nanos:x}", std::process::id())
}

/// Creates a namespace of its own for `test` (see [`unique_namespace`]) and returns its
/// name; the test deletes it when done.
pub async fn create_namespace(client: &Client, test: &str) -> Result<String> {
    use k8s_openapi::api::core::v1::Namespace;
    let ns = unique_namespace(test);
    let mut object = Namespace::default();
    object.metadata.name = Some(ns.clone());
    kube::Api::<Namespace>::all(client.clone())
        .create(&Default::default(), &object)
        .await
        .with_context(|| format!("creating namespace {ns}"))?;
    Ok(ns)
}

/// Polls `check` every half second until it yields `Some`, or fails after `timeout`
/// with `what` and the last thing `check` saw.
pub async fn wait_until<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Result<T, String>>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let last = match check().await? {
            Ok(value) => return Ok(value),
            Err(last) => last,
        };
        if tokio::time::Instant::now() >= deadline {
            bail!("timed out after {timeout:?} waiting for {what}; last seen: {last}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
