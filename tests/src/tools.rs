//! The cluster's command-line tools (kubectl, helm) and the workspace's own binaries, for
//! tests that drive the cluster the way a person would.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};

use crate::cluster::{self, wait_until};

/// The repository's root folder.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// The folder with the test cluster's kubectl and helm (built by `tests/tools/build`, which
/// is a no-op when they are cached).
pub fn bin_dir() -> Result<PathBuf> {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    if let Some(b) = BIN.get() {
        return Ok(b.clone());
    }
    let out = Command::new(repo().join("tests/tools/build"))
        .stderr(Stdio::inherit())
        .output()?;
    ensure!(out.status.success(), "tests/tools/build failed");
    let line = String::from_utf8(out.stdout)?
        .lines()
        .last()
        .context("tests/tools/build printed nothing")?
        .trim()
        .to_string();
    Ok(BIN.get_or_init(|| PathBuf::from(line)).clone())
}

/// The kubeconfig of the test cluster: `KUBECONFIG` when it names a file, else the one
/// `tests/cluster/up` writes.
pub fn kubeconfig() -> PathBuf {
    std::env::var_os("KUBECONFIG")
        .filter(|p| !p.is_empty() && Path::new(p).is_file())
        .map(PathBuf::from)
        .unwrap_or_else(|| cluster::cluster_dir().join("kubeconfig"))
}

/// Runs one of the cluster's tools (kubectl, helm) with `stdin`, returning its output.
pub fn tool(name: &str, args: &[&str], stdin: Option<&str>) -> Result<Output> {
    let helm = std::env::temp_dir().join("layerwise-helm");
    let mut child = Command::new(bin_dir()?.join(name))
        .args(args)
        .env("KUBECONFIG", kubeconfig())
        .env("HELM_CACHE_HOME", helm.join("cache"))
        .env("HELM_CONFIG_HOME", helm.join("config"))
        .env("HELM_DATA_HOME", helm.join("data"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {name}"))?;
    if let Some(text) = stdin {
        child
            .stdin
            .take()
            .expect("stdin is piped")
            .write_all(text.as_bytes())?;
    }
    drop(child.stdin.take());
    Ok(child.wait_with_output()?)
}

/// The stdout of a tool run that must have succeeded; its output otherwise.
pub fn ok(out: Output, what: &str) -> Result<String> {
    ensure!(
        out.status.success(),
        "{what} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Deletes every DiffusionDeployment in `namespace` while the operator still runs (its
/// finalizer withdraws the prepare requests) and waits for them to go; if they do not, drops
/// their finalizers so the namespace can go. Errors are added to `errors`.
pub async fn delete_diffusion_deployments(
    client: &Client,
    namespace: &str,
    wait: Duration,
    errors: &mut Vec<anyhow::Error>,
) {
    use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
    use kube::ResourceExt;
    let dds: Api<crds::DiffusionDeployment> = Api::namespaced(client.clone(), namespace);
    let all = ListParams::default();
    if let Err(e) = dds.delete_collection(&DeleteParams::default(), &all).await {
        errors.push(e.into());
    }
    let gone = wait_until("DiffusionDeployments finalized", wait, || async {
        let left = dds.list(&all).await?.items.len();
        Ok(if left == 0 {
            Ok(())
        } else {
            Err(format!("{left} left"))
        })
    })
    .await;
    if let Err(e) = gone {
        errors.push(e);
        let left = dds.list(&all).await.map(|l| l.items).unwrap_or_default();
        let unfinalize = Patch::Merge(serde_json::json!({ "metadata": { "finalizers": null } }));
        for dd in left {
            let _ = dds
                .patch(&dd.name_any(), &PatchParams::default(), &unfinalize)
                .await;
        }
    }
}

/// `helm uninstall --wait` of a test's release.
pub fn helm_uninstall(release: &str, namespace: &str) -> Result<()> {
    let args = [
        "uninstall",
        release,
        "--namespace",
        namespace,
        "--wait",
        "--timeout",
        "60s",
    ];
    ok(tool("helm", &args, None)?, "helm uninstall")?;
    Ok(())
}

/// The end of a best-effort teardown: deletes the test's namespace, logs every error met on
/// the way and returns the first.
pub async fn finish_teardown(
    client: &Client,
    namespace: &str,
    mut errors: Vec<anyhow::Error>,
) -> Result<()> {
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    if let Err(e) = namespaces
        .delete(namespace, &kube::api::DeleteParams::default())
        .await
    {
        errors.push(e.into());
    }
    for e in &errors {
        eprintln!("teardown of {namespace}: {e:#}");
    }
    errors.into_iter().next().map_or(Ok(()), Err)
}

/// Installs the chart's CRDs (once per process; they stay, like any cluster's CRDs) and waits
/// until they are served.
pub async fn install_crds(client: &Client, wait: Duration) -> Result<()> {
    static DONE: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    DONE.get_or_try_init(|| async {
        let dir = repo().join("charts/layerwise/crds");
        apply_crds(
            client,
            &dir,
            &[
                "diffusiondeployments.layerwise.dev",
                "diffusionnodes.layerwise.dev",
            ],
            wait,
        )
        .await
    })
    .await?;
    Ok(())
}

/// Applies the CRDs in `path` (a file or a folder) and waits until each of `names` is
/// established.
pub async fn apply_crds(
    client: &Client,
    path: &Path,
    names: &[&str],
    wait: Duration,
) -> Result<()> {
    let path = path.to_str().context("CRD path is not UTF-8")?;
    let args = ["apply", "--server-side", "--force-conflicts", "-f", path];
    ok(tool("kubectl", &args, None)?, "kubectl apply crds")?;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for name in names {
        wait_until(&format!("CRD {name} established"), wait, || async {
            let crd = crds.get(name).await?;
            let established = crd
                .status
                .and_then(|s| s.conditions)
                .unwrap_or_default()
                .iter()
                .any(|c| c.type_ == "Established" && c.status == "True");
            Ok(if established {
                Ok(())
            } else {
                Err("not established".into())
            })
        })
        .await?;
    }
    Ok(())
}

/// The Gateway API inference extension's InferencePool CRD, at the release
/// `tests/tools/crd-versions` pins, as `tests/tools/build` copies it from that module.
pub fn inference_pool_crd() -> Result<PathBuf> {
    let path = bin_dir()?.join("../crds/inferencepools.yaml");
    ensure!(
        path.is_file(),
        "{} is missing (run tests/tools/build)",
        path.display()
    );
    Ok(path)
}

/// The groups every service account is in, for impersonating one.
const SERVICE_ACCOUNT_GROUPS: [&str; 2] = ["system:serviceaccounts", "system:authenticated"];

/// The test cluster's admin kubeconfig changed to impersonate `user` (with the service
/// accounts' groups): what a pod running as that service account is allowed, and no more.
pub fn impersonating_kubeconfig(user: &str) -> Result<Kubeconfig> {
    let mut kc = Kubeconfig::read_from(kubeconfig())?;
    for named in &mut kc.auth_infos {
        if let Some(auth) = named.auth_info.as_mut() {
            auth.impersonate = Some(user.to_string());
            auth.impersonate_groups = Some(SERVICE_ACCOUNT_GROUPS.map(String::from).to_vec());
        }
    }
    Ok(kc)
}

/// The user extra the apiserver adds to requests made with a pod-bound service-account
/// token: the name of the pod's node (Kubernetes 1.30 and later).
pub const NODE_NAME_EXTRA: &str = "authentication.kubernetes.io/node-name";

/// [`impersonating_kubeconfig`] as a pod on `node` is: with the node's name in the user
/// extra, as its pod-bound token carries it.
pub fn impersonating_kubeconfig_on_node(user: &str, node: &str) -> Result<Kubeconfig> {
    let mut kc = impersonating_kubeconfig(user)?;
    for named in &mut kc.auth_infos {
        if let Some(auth) = named.auth_info.as_mut() {
            auth.impersonate_user_extra = Some(std::collections::HashMap::from([(
                NODE_NAME_EXTRA.to_string(),
                vec![node.to_string()],
            )]));
        }
    }
    Ok(kc)
}

/// A client that impersonates `user` on `node` (see [`impersonating_kubeconfig_on_node`]).
pub async fn impersonating_on_node(user: &str, node: &str) -> Result<Client> {
    let kc = impersonating_kubeconfig_on_node(user, node)?;
    let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
    Ok(Client::try_from(config)?)
}

/// A client that impersonates `user` (see [`impersonating_kubeconfig`]).
pub async fn impersonating(user: &str) -> Result<Client> {
    let kc = impersonating_kubeconfig(user)?;
    let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
    Ok(Client::try_from(config)?)
}

/// A binary of this workspace (`layerwise`, `layerwise-operator`, `layerwise-agent`), built
/// first with the profile the tests were built with, so it is never stale.
pub fn workspace_bin(name: &str) -> Result<PathBuf> {
    ensure!(
        WORKSPACE_BINS.contains(&name),
        "{name} is not one of the workspace's binaries"
    );
    build_workspace_bins()?;
    let path = profile_dir()?.join(name);
    ensure!(path.is_file(), "{} was not built", path.display());
    Ok(path)
}

/// The binaries the e2e tests run.
const WORKSPACE_BINS: [&str; 3] = ["layerwise", "layerwise-operator", "layerwise-agent"];

/// The target folder of the profile this test binary was built with (`target/debug` for
/// `target/debug/deps/<test>`).
fn profile_dir() -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    exe.parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .with_context(|| format!("{} is not in a target folder", exe.display()))
}

/// The Cargo profile this test binary was built with: `dev` in `target/debug` (`cargo test`
/// with no profile given; the test targets' `test` profile inherits it), `release` in
/// `target/release`.
pub fn cargo_profile() -> Result<&'static str> {
    let dir = profile_dir()?;
    match dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") => Ok("dev"),
        Some("release") => Ok("release"),
        _ => bail!("{}: not a debug or release folder", dir.display()),
    }
}

/// `cargo build` of the binaries, once per process. It selects what `cargo test --workspace`
/// builds (every package's bins and tests), so features resolve the same way and this is a
/// no-op right after that; run alone, it rebuilds what changed.
fn build_workspace_bins() -> Result<()> {
    static BUILT: OnceLock<Result<(), String>> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let dir = profile_dir().map_err(|e| e.to_string())?;
            let profile: &[&str] = match cargo_profile().map_err(|e| e.to_string())? {
                "dev" => &[],
                _ => &["--release"],
            };
            let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
            let mut cmd = Command::new(cargo);
            // Not the variables cargo sets for this test process: build scripts that track
            // them (ring's tracks CARGO_MANIFEST_DIR) would count as changed and rebuild.
            for (key, _) in std::env::vars_os() {
                let k = key.to_string_lossy();
                let set_for_tests = [
                    "CARGO_MANIFEST_",
                    "CARGO_PKG_",
                    "CARGO_CRATE_NAME",
                    "CARGO_BIN_",
                    "CARGO_PRIMARY_PACKAGE",
                    "CARGO_TARGET_TMPDIR",
                    "CARGO_RUSTC_CURRENT_DIR",
                    "OUT_DIR",
                ];
                if set_for_tests.iter().any(|p| k.starts_with(p)) {
                    cmd.env_remove(&key);
                }
            }
            cmd.current_dir(repo())
                .args(["build", "--locked", "--workspace", "--bins", "--tests"])
                .args(profile)
                .env(
                    "CARGO_TARGET_DIR",
                    dir.parent().expect("profile dir has a parent"),
                );
            let out = cmd
                .stdin(Stdio::null())
                .output()
                .map_err(|e| format!("running cargo build: {e}"))?;
            if out.status.success() {
                Ok(())
            } else {
                Err(format!(
                    "cargo build of the workspace binaries failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                ))
            }
        })
        .clone()
        .map_err(anyhow::Error::msg)
}
