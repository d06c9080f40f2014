//! The agent against the real control plane: the real binary, started for the fake node
//! `a100-0` with no GPU library on the machine, fills its `DiffusionNode` status
//! (inventory, profile, residency) for a model folder made here, and follows the spec as
//! models are added and removed.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use common::{http_get, Agent, AGENT};
use crds::{DiffusionNode, ModelState, NodeModelStatus};
use kube::api::{Patch, PatchParams};
use kube::Api;
use layerwise_e2e::cluster::{self, wait_until};
use layerwise_e2e::tools::{install_crds, kubeconfig};
use layerwise_engine::tools::synth::{synth, SynthOptions};
use serde_json::json;

const NODE: &str = "a100-0";
/// The field manager this test writes the spec with (the operator's role).
const REQUESTER: &str = "layerwise-agent-e2e";
const WAIT: Duration = Duration::from_secs(90);

/// Sets this test's model requests on the node.
async fn request(api: &Api<DiffusionNode>, models: &[(&str, &Path)]) -> Result<()> {
    let models = models
        .iter()
        .map(|(id, dir)| json!({ "id": id, "family": "dit", "location": { "hostPath": dir } }))
        .collect();
    common::request(api, NODE, REQUESTER, models).await
}

async fn model(api: &Api<DiffusionNode>, id: &str) -> Result<Option<NodeModelStatus>> {
    common::model(api, NODE, id).await
}

#[tokio::test]
async fn agent_reports_inventory_profiles_and_residency_and_follows_the_spec() -> Result<()> {
    let client = cluster::client().await?;
    install_crds(&client, WAIT).await?;
    let api: Api<DiffusionNode> = Api::all(client.clone());
    let existed = api.get_opt(NODE).await?.is_some();

    let dir = tempfile::tempdir()?;
    let good = dir.path().join("tiny");
    synth(&good, &SynthOptions::preset("tiny")?)?;
    // A copy whose transformer weights are not safetensors: profiling must fail naming it.
    let broken = dir.path().join("broken");
    synth(&broken, &SynthOptions::preset("tiny")?)?;
    let bad_file = broken.join("transformer/diffusion_pytorch_model.safetensors");
    std::fs::write(&bad_file, b"\xff\xff\xff\xff\xff\xff\xff\x7fnot a header")?;
    for f in layerwise_agent::prewarm::files_under(&good)? {
        layerwise_agent::pagecache::evict(&f)?;
    }

    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let mut child = Agent(
        Command::new(AGENT)
            .args([
                "run",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--reinventory-seconds",
                "2",
                "--memory-floor",
                "0",
                "--cache-budget",
                "1Gi",
            ])
            .env("NODE_NAME", NODE)
            .env("KUBECONFIG", kubeconfig())
            .env("LAYERWISE_LOG", "info")
            .stdin(Stdio::null())
            .spawn()?,
    );

    let result = async {
        // The agent creates the object if missing and reports the inventory.
        let host_total = layerwise_agent::meminfo::read()?.total;
        let st = wait_until("inventory reported", WAIT, || async {
            let st = api
                .get_opt(NODE)
                .await?
                .and_then(|d| d.status)
                .unwrap_or_default();
            Ok(if st.host_memory_bytes == host_total {
                Ok(st)
            } else {
                Err(format!("{st:?}"))
            })
        })
        .await?;
        // No GPU library here: the accelerators come from the fake node's GPU Feature
        // Discovery labels (tests/cluster/shapes: 8 x A100 80 GB).
        let acc: Vec<_> = st
            .accelerators
            .iter()
            .map(|a| {
                (
                    a.resource_name.as_str(),
                    a.product.as_str(),
                    a.count,
                    a.memory_bytes,
                )
            })
            .collect();
        ensure!(
            acc == [("nvidia.com/gpu", "NVIDIA-A100-SXM4-80GB", 8, 81920 << 20)],
            "accelerators from the Node's labels: {acc:?}"
        );

        // Add a model: profiled, then warm with residency measured.
        request(&api, &[("agent-e2e/tiny", &good)]).await?;
        let m = wait_until("tiny profiled and warm", WAIT, || async {
            Ok(match model(&api, "agent-e2e/tiny").await? {
                Some(m) if m.state == ModelState::Warm => Ok(m),
                other => Err(format!("{other:?}")),
            })
        })
        .await?;
        let profile = m.profile.as_ref().context("warm without a profile")?;
        ensure!(
            profile.family == "dit" && profile.blocks > 0 && profile.total_bytes > 0,
            "{profile:?}"
        );
        ensure!(
            profile.activation.bytes_per_token > 0,
            "activation cost missing: {profile:?}"
        );
        // Warm means at least WARM_FRACTION resident: the kernel (proactive reclaim, other
        // tests) may drop a page or two between the read and the mincore that reports it.
        ensure!(
            m.total_bytes >= profile.total_bytes
                && m.resident_bytes as f64
                    >= m.total_bytes as f64 * layerwise_agent::models::WARM_FRACTION,
            "{m:?}"
        );
        ensure!(
            m.profiled_at.is_some() && m.warmed_at.is_some() && m.error.is_none(),
            "{m:?}"
        );

        // A broken checkpoint is a failed model naming the file, not a crash.
        request(
            &api,
            &[("agent-e2e/tiny", &good), ("agent-e2e/broken", &broken)],
        )
        .await?;
        let b = wait_until("broken model failed", WAIT, || async {
            Ok(match model(&api, "agent-e2e/broken").await? {
                Some(m) if m.state == ModelState::Failed => Ok(m),
                other => Err(format!("{other:?}")),
            })
        })
        .await?;
        let err = b.error.unwrap_or_default();
        ensure!(
            err.contains("diffusion_pytorch_model.safetensors"),
            "error does not name the file: {err}"
        );

        let metrics = http_get(port, "/metrics")?;
        ensure!(
            metrics.contains("layerwise_agent_warmed_bytes_total{model=\"agent-e2e/tiny\"}"),
            "{metrics}"
        );
        ensure!(
            metrics.contains("layerwise_agent_resident_bytes{model=\"agent-e2e/tiny\"}"),
            "{metrics}"
        );
        ensure!(
            http_get(port, "/healthz")?.starts_with("HTTP/1.0 200")
                || http_get(port, "/healthz")?.starts_with("HTTP/1.1 200"),
            "healthz"
        );

        // Remove the good model: it leaves the status; the other stays.
        request(&api, &[("agent-e2e/broken", &broken)]).await?;
        wait_until("tiny gone from the status", WAIT, || async {
            let st = api.get(NODE).await?.status.unwrap_or_default();
            let ids: Vec<String> = st.models.iter().map(|m| m.id.clone()).collect();
            Ok(
                if st.model("agent-e2e/tiny").is_none() && st.model("agent-e2e/broken").is_some() {
                    Ok(())
                } else {
                    Err(format!("{ids:?}"))
                },
            )
        })
        .await?;

        // SIGTERM: a clean, prompt exit.
        // SAFETY: kill(2) with our own child's pid and a valid signal number.
        let rc = unsafe { libc::kill(child.0.id() as libc::pid_t, libc::SIGTERM) };
        ensure!(rc == 0, "kill failed");
        let status = wait_until("agent exits after SIGTERM", Duration::from_secs(20), || {
            let s = child.0.try_wait();
            async move {
                Ok(match s? {
                    Some(s) => Ok(s),
                    None => Err("still running".to_string()),
                })
            }
        })
        .await?;
        ensure!(status.success(), "agent exited with {status}");
        Ok(())
    }
    .await;

    // Leave the node as it was: delete the object this test made, or withdraw this test's
    // requests and the agent's status from one that was there.
    if existed {
        if let Err(e) = request(&api, &[]).await {
            eprintln!("withdrawing this test's requests from {NODE}: {e}");
        }
        let clear = json!({ "apiVersion": "layerwise.dev/v1alpha1", "kind": "DiffusionNode", "status": {} });
        let _ = api
            .patch_status(
                NODE,
                &PatchParams::apply("layerwise-agent").force(),
                &Patch::Apply(&clear),
            )
            .await;
    } else {
        let _ = api.delete(NODE, &Default::default()).await;
    }
    result
}
