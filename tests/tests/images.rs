//! The container images run the way the chart runs them: each starts as 65532:65532 with a
//! read-only root file system and no shell inside; the engine image runs the README's main
//! job on a model folder mounted read-only and serves over HTTP; the CUDA engine image, on
//! this machine without a GPU, computes on the CPU under `--device auto` and refuses
//! `--device cuda`, saying why each time; the agent and operator images answer `--help` and
//! do their work against the test cluster. (docs/deploy.md's "Deploy to a cluster" is checked
//! in chart.rs.)
//!
//! Images come from `scripts/images` (see [`images::ensure_built`]); containers use the
//! host network, and everything they listen on or dial is on 127.0.0.1.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use crds::{DiffusionDeployment, DiffusionNode, DiffusionNodeSpec, ModelRequest, ModelState};
use kube::api::{DeleteParams, PostParams};
use kube::Api;
use layerwise_e2e::cluster::{self, wait_until};
use layerwise_e2e::images::{self, expect_in, podman, podman_ok, shared_dir, Container};
use layerwise_e2e::tools::{self, ok, tool};
use layerwise_engine::tools::loadgen::http;

/// How long a container gets to come up and do its first piece of work.
const START: Duration = Duration::from_secs(90);
/// The SIGTERM grace every container gets at the end.
const GRACE_SECONDS: u32 = 30;

/// The images the tests can run here.
fn names() -> Vec<&'static str> {
    let names: Vec<_> = images::NAMES
        .into_iter()
        .filter(|n| *n != "engine-cuda" || images::cuda_enabled())
        .collect();
    if !images::cuda_enabled() {
        eprintln!("images: layerwise-engine-cuda not tested (LAYERWISE_IMAGES_CUDA=0)");
    }
    names
}

/// Each image: its configured user and entrypoint, `--help` from a read-only root with no
/// network, and no shell to run.
#[test]
fn every_image_is_its_binary_as_65532_without_a_shell() -> Result<()> {
    images::ensure_built()?;
    for name in names() {
        let tag = images::tag(name)?;
        let binary = images::binary(name);
        let user = podman_ok(&["image", "inspect", "--format", "{{.Config.User}}", &tag])?;
        ensure!(user.trim() == "65532:65532", "{tag}: USER {user:?}");
        let entry = podman_ok(&[
            "image",
            "inspect",
            "--format",
            "{{json .Config.Entrypoint}}",
            &tag,
        ])?;
        ensure!(
            entry.trim() == format!("[\"/usr/local/bin/{binary}\"]"),
            "{tag}: ENTRYPOINT {entry}"
        );
        let help = podman_ok(&[
            "run",
            "--rm",
            "--read-only",
            "--network",
            "none",
            &tag,
            "--help",
        ])?;
        expect_in(&help, "Usage:", &format!("{tag} --help"))?;
        // The binary is found on PATH too, as the chart's `command` names it.
        podman_ok(&[
            "run",
            "--rm",
            "--read-only",
            "--network",
            "none",
            "--entrypoint",
            binary,
            &tag,
            "--version",
        ])?;
        for shell in ["/bin/sh", "sh"] {
            let out = podman(&["run", "--rm", "--entrypoint", shell, &tag, "-c", "true"])?;
            ensure!(
                !out.status.success(),
                "{tag}: `{shell} -c true` ran: the image has a shell"
            );
        }
    }
    Ok(())
}

/// The README's main job inside the engine images: `synth` into a mounted folder, then
/// `generate` with the model mounted read-only and the image and stats written to another;
/// the image is the one the workspace's own binary makes. The CUDA image says why it falls
/// back to the CPU (`--device auto`) or fails (`--device cuda`).
#[test]
fn engine_images_run_the_main_job_on_read_only_roots() -> Result<()> {
    images::ensure_built()?;
    let work = tempfile::tempdir()?;
    let model = shared_dir(work.path(), "model")?;
    let tag = images::tag("engine")?;
    let model_rw = format!("{}:/model", model.display());
    let model_ro = format!("{}:/model:ro", model.display());
    let synth = [
        "run",
        "--rm",
        "--read-only",
        "--network",
        "none",
        "-v",
        &model_rw,
        &tag,
        "synth",
        "--preset",
        "tiny",
        "--out",
        "/model",
    ];
    podman_ok(&synth)?;
    ensure!(
        model.join("model_index.json").is_file(),
        "synth in {tag} wrote no model_index.json"
    );

    // The same job on the host, with the workspace's binary, for the reference image.
    let reference = work.path().join("reference.png");
    let host = std::process::Command::new(tools::workspace_bin("layerwise")?)
        .args(["generate", "--model"])
        .arg(&model)
        .args(main_job_flags())
        .arg("--out")
        .arg(&reference)
        .output()?;
    ensure!(
        host.status.success(),
        "layerwise generate on the host failed: {}",
        String::from_utf8_lossy(&host.stderr)
    );
    let reference = std::fs::read(&reference)?;

    for name in names().into_iter().filter(|n| n.starts_with("engine")) {
        let tag = images::tag(name)?;
        let out = shared_dir(work.path(), &format!("out-{name}"))?;
        let out_mount = format!("{}:/out", out.display());
        let generate = |device: &str| -> Result<std::process::Output> {
            let mut args = vec![
                "run",
                "--rm",
                "--read-only",
                "--network",
                "none",
                "-v",
                &model_ro,
                "-v",
                &out_mount,
                &tag,
                "generate",
                "--model",
                "/model",
            ];
            args.extend(main_job_flags());
            args.extend([
                "--out",
                "/out/tiny.png",
                "--stats",
                "/out/tiny.json",
                "--device",
                device,
            ]);
            podman(&args)
        };
        let run = generate("auto")?;
        let stderr = String::from_utf8_lossy(&run.stderr).into_owned();
        ensure!(
            run.status.success(),
            "{tag} generate failed ({}): {stderr}",
            run.status
        );
        let png = std::fs::read(out.join("tiny.png")).context("the image in the out folder")?;
        ensure!(
            png == reference,
            "{tag}: the image differs from the host binary's ({} vs {} bytes)",
            png.len(),
            reference.len()
        );
        let stats: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("tiny.json"))?)?;
        ensure!(
            stats["wall_seconds"].as_f64().is_some_and(|s| s > 0.0),
            "{tag}: stats without wall_seconds: {stats}"
        );
        if name == "engine-cuda" {
            // No NVIDIA driver in this container: auto falls back and says so...
            expect_in(&stderr, "no NVIDIA driver", &format!("{tag} --device auto"))?;
            // ...and cuda refuses, saying the same.
            let run = generate("cuda")?;
            let stderr = String::from_utf8_lossy(&run.stderr);
            ensure!(
                !run.status.success(),
                "{tag} --device cuda succeeded without a GPU"
            );
            expect_in(&stderr, "no NVIDIA driver", &format!("{tag} --device cuda"))?;
        }
    }
    Ok(())
}

/// The README's main job, less the model and output paths.
fn main_job_flags() -> [&'static str; 8] {
    [
        "--strategy",
        "offload-sharded",
        "--dp",
        "2",
        "--slots",
        "2",
        "--steps",
        "25",
    ]
}

/// `serve` in each engine image: as 65532 on a read-only root, ready, an image over HTTP,
/// and a clean exit on SIGTERM.
#[tokio::test]
async fn engine_images_serve_as_65532_on_read_only_roots() -> Result<()> {
    images::ensure_built()?;
    let work = tempfile::tempdir()?;
    let model = shared_dir(work.path(), "model")?;
    let synth = std::process::Command::new(tools::workspace_bin("layerwise")?)
        .args(["synth", "--preset", "tiny", "--out"])
        .arg(&model)
        .output()?;
    ensure!(synth.status.success(), "layerwise synth failed");
    let model_ro = format!("{}:/model:ro", model.display());
    for name in names().into_iter().filter(|n| n.starts_with("engine")) {
        let tag = images::tag(name)?;
        let port = images::free_port()?;
        let listen = format!("127.0.0.1:{port}");
        let engine = Container::start(
            &format!("layerwise-test-serve-{name}"),
            &[
                "--read-only",
                "--network",
                "host",
                "-v",
                &model_ro,
                &tag,
                "serve",
                "--model",
                "/model",
                "--listen",
                &listen,
                "--dp",
                "2",
                "--slots",
                "2",
            ],
        )?;
        let addr: SocketAddr = listen.parse()?;
        wait_until(&format!("{tag} ready"), START, || async {
            if !engine.running()? {
                anyhow::bail!("{tag} exited:\n{}", engine.logs());
            }
            let ready = http(addr, "GET", "/readyz", None, Duration::from_secs(2)).await;
            Ok(match ready {
                Ok(r) if r.status == 200 => Ok(()),
                Ok(r) => Err(format!("HTTP {}", r.status)),
                Err(e) => Err(e.to_string()),
            })
        })
        .await?;
        engine.check_user_and_read_only_root()?;
        let body = br#"{"class_label": 3, "seed": 7, "steps": 4, "size": "64x64"}"#;
        let r = http(
            addr,
            "POST",
            "/v1/images/generations",
            Some(body),
            Duration::from_secs(120),
        )
        .await?;
        ensure!(
            r.status == 200,
            "{tag}: HTTP {}: {}",
            r.status,
            String::from_utf8_lossy(&r.body)
        );
        let code = engine.stop(GRACE_SECONDS)?;
        ensure!(
            code == 0,
            "{tag} exited {code} on SIGTERM:\n{}",
            engine.logs()
        );
    }
    Ok(())
}

/// A kubeconfig for the test cluster that the containers' user can read.
fn container_kubeconfig(dir: &Path) -> Result<String> {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join("kubeconfig");
    std::fs::copy(tools::kubeconfig(), &path)?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644))?;
    Ok(format!("{}:/etc/layerwise/kubeconfig:ro", path.display()))
}

/// The agent image against the test cluster: asked to prepare a model under its model root
/// (mounted read-only), it reports its node and the model warm in the DiffusionNode.
#[tokio::test]
async fn agent_image_reports_its_node_and_warms_a_model() -> Result<()> {
    images::ensure_built()?;
    let client = cluster::client().await?;
    tools::install_crds(&client, START).await?;
    let work = tempfile::tempdir()?;
    let kubeconfig = container_kubeconfig(work.path())?;
    let root = shared_dir(work.path(), "models")?;
    let synth = std::process::Command::new(tools::workspace_bin("layerwise")?)
        .args(["synth", "--preset", "tiny", "--layers", "2", "--out"])
        .arg(root.join("tiny"))
        .output()?;
    ensure!(synth.status.success(), "layerwise synth failed");

    // A node of our own: no fake node's DiffusionNode is touched.
    let node = format!("images-agent-{}", std::process::id());
    let nodes: Api<DiffusionNode> = Api::all(client.clone());
    let _ = nodes.delete(&node, &DeleteParams::default()).await;
    let request = ModelRequest {
        id: "images/tiny".into(),
        family: "dit".into(),
        location: crds::ModelLocation {
            host_path: Some("/models/tiny".into()),
            ..Default::default()
        },
    };
    let dn = DiffusionNode::new(
        &node,
        DiffusionNodeSpec {
            models: vec![request],
        },
    );
    nodes.create(&PostParams::default(), &dn).await?;
    let result = async {
        let tag = images::tag("agent")?;
        let port = images::free_port()?;
        let listen = format!("127.0.0.1:{port}");
        let models = format!("{}:/models:ro", root.display());
        let node_env = format!("NODE_NAME={node}");
        let agent = Container::start(
            "layerwise-test-agent",
            &[
                "--read-only",
                "--network",
                "host",
                "-v",
                &kubeconfig,
                "-v",
                &models,
                "-e",
                "KUBECONFIG=/etc/layerwise/kubeconfig",
                "-e",
                &node_env,
                "-e",
                "LAYERWISE_AGENT_MODEL_ROOTS=/models",
                &tag,
                "run",
                "--listen",
                &listen,
            ],
        )?;
        let status = wait_until(&format!("{node} warm by {tag}"), START, || async {
            if !agent.running()? {
                anyhow::bail!("{tag} exited:\n{}", agent.logs());
            }
            let dn = nodes.get(&node).await?;
            let Some(status) = dn.status else {
                return Ok(Err("no status".into()));
            };
            Ok(match status.models.first().map(|m| m.state) {
                Some(ModelState::Warm) if status.host_memory_bytes > 0 => Ok(status),
                Some(ModelState::Failed) => {
                    anyhow::bail!("the model failed: {:?}\n{}", status.models, agent.logs())
                }
                other => Err(format!("model state {other:?}")),
            })
        })
        .await?;
        ensure!(
            status.models[0].profile.is_some(),
            "warm without a profile: {:?}",
            status.models[0]
        );
        agent.check_user_and_read_only_root()?;
        let addr: SocketAddr = listen.parse()?;
        let health = http(addr, "GET", "/healthz", None, Duration::from_secs(5)).await?;
        ensure!(
            health.status == 200,
            "{tag} /healthz: HTTP {}",
            health.status
        );
        let code = agent.stop(GRACE_SECONDS)?;
        ensure!(
            code == 0,
            "{tag} exited {code} on SIGTERM:\n{}",
            agent.logs()
        );
        Ok::<_, anyhow::Error>(())
    }
    .await;
    let _ = nodes.delete(&node, &DeleteParams::default()).await;
    result
}

/// The operator image against the test cluster, watching one namespace: a
/// DiffusionDeployment whose model lies outside the model roots is refused with a condition
/// only the operator writes.
#[tokio::test]
async fn operator_image_reconciles_in_the_test_cluster() -> Result<()> {
    images::ensure_built()?;
    let client = cluster::client().await?;
    tools::install_crds(&client, START).await?;
    let work = tempfile::tempdir()?;
    let kubeconfig = container_kubeconfig(work.path())?;
    let ns = cluster::create_namespace(&client, "images").await?;
    let mut errors = Vec::new();
    let tag = images::tag("operator")?;
    let watch = format!("LAYERWISE_WATCH_NAMESPACE={ns}");
    let result = async {
        let operator = Container::start(
            "layerwise-test-operator",
            &[
                "--read-only",
                "--network",
                "host",
                "-v",
                &kubeconfig,
                "-e",
                "KUBECONFIG=/etc/layerwise/kubeconfig",
                "-e",
                &watch,
                "-e",
                "LAYERWISE_MODEL_ROOTS=/models",
                &tag,
            ],
        )?;
        let manifest = format!(
            "apiVersion: layerwise.dev/v1alpha1
kind: DiffusionDeployment
metadata: {{name: elsewhere, namespace: {ns}}}
spec:
  model: {{family: dit, location: {{hostPath: /elsewhere/dit}}}}
  workload: {{maxWidth: 256, maxHeight: 256, maxSteps: 25, maxBatch: 1}}
  strategy: auto
  replicas: 1
"
        );
        ok(
            tool("kubectl", &["apply", "-f", "-"], Some(&manifest))?,
            "kubectl apply",
        )?;
        let dds: Api<DiffusionDeployment> = Api::namespaced(client.clone(), &ns);
        wait_until("the operator's ModelOutsideRoots", START, || async {
            if !operator.running()? {
                anyhow::bail!("{tag} exited:\n{}", operator.logs());
            }
            let dd = dds.get("elsewhere").await?;
            let conditions = dd.status.map(|s| s.conditions).unwrap_or_default();
            Ok(match conditions.iter().find(|c| c.type_ == "Planned") {
                Some(c) if c.status == "False" && c.reason == "ModelOutsideRoots" => Ok(()),
                other => Err(format!("Planned: {other:?}")),
            })
        })
        .await?;
        operator.check_user_and_read_only_root()?;
        tools::delete_diffusion_deployments(&client, &ns, START, &mut errors).await;
        let code = operator.stop(GRACE_SECONDS)?;
        ensure!(
            code == 0,
            "{tag} exited {code} on SIGTERM:\n{}",
            operator.logs()
        );
        Ok::<_, anyhow::Error>(())
    }
    .await;
    tools::finish_teardown(&client, &ns, errors).await?;
    result
}
