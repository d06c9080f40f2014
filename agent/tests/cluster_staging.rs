//! The agent binary staging a model from a real S3-compatible server (SeaweedFS, on
//! loopback) for a request in its `DiffusionNode`, against the real control plane: the
//! credentials come from a Secret in the requester's namespace, the copy is published into
//! the node model cache and reported `Staged` with its folder, then profiled and warmed from
//! it; the progress is in the status and the metrics; a wrong key and a missing Secret are
//! reported by their names while the staged model stays warm.

mod common;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use common::{files, http_get, Agent, AGENT};
use crds::{DiffusionNode, ModelState, NodeModelStatus, StagingState};
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::{Patch, PatchParams};
use kube::Api;
use layerwise_e2e::cluster::{self, wait_until};
use layerwise_e2e::s3::{S3Server, ACCESS_KEY, SECRET_KEY};
use layerwise_e2e::tools::{install_crds, kubeconfig};
use layerwise_engine::tools::synth::{synth, SynthOptions};
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as ObjectPath;
use object_store::ObjectStore;
use serde_json::json;

/// A fake node of the test cluster no other agent test uses.
const NODE: &str = "a100-1";
const NS: &str = "agent-staging";
const REQUESTER: &str = "layerwise-agent-staging-e2e";
const WAIT: Duration = Duration::from_secs(120);

/// Sets this test's requests on the node: `(id, secret)` for the model under `org/tiny`.
async fn request(api: &Api<DiffusionNode>, endpoint: &str, models: &[(&str, &str)]) -> Result<()> {
    let models = models
        .iter()
        .map(|(id, secret)| {
            json!({ "id": id, "family": "dit", "location": { "s3": {
                "endpoint": endpoint, "bucket": "models", "prefix": "org/tiny/",
                "region": "us-east-1", "pathStyle": true,
                "credentialsSecret": { "name": secret },
            } } })
        })
        .collect();
    common::request(api, NODE, REQUESTER, models).await
}

async fn model(api: &Api<DiffusionNode>, id: &str) -> Result<Option<NodeModelStatus>> {
    common::model(api, NODE, id).await
}

async fn secret(api: &Api<Secret>, name: &str, secret_key: &str) -> Result<()> {
    let obj = json!({ "apiVersion": "v1", "kind": "Secret", "metadata": { "name": name },
        "stringData": { "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": secret_key } });
    api.patch(
        name,
        &PatchParams::apply(REQUESTER).force(),
        &Patch::Apply(&obj),
    )
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_stages_a_model_from_s3_then_profiles_and_warms_the_copy() -> Result<()> {
    let client = cluster::client().await?;
    install_crds(&client, WAIT).await?;
    let api: Api<DiffusionNode> = Api::all(client.clone());
    let existed = api.get_opt(NODE).await?.is_some();
    let namespaces: Api<Namespace> = Api::all(client.clone());
    // A namespace an earlier run deleted takes its Secrets with it as it terminates.
    wait_until("the earlier run's namespace gone", WAIT, || async {
        Ok(match namespaces.get_opt(NS).await? {
            Some(ns) if ns.metadata.deletion_timestamp.is_some() => Err("terminating".to_string()),
            _ => Ok(()),
        })
    })
    .await?;
    namespaces
        .patch(
            NS,
            &PatchParams::apply(REQUESTER),
            &Patch::Apply(
                json!({ "apiVersion": "v1", "kind": "Namespace", "metadata": { "name": NS } }),
            ),
        )
        .await?;
    let secrets: Api<Secret> = Api::namespaced(client.clone(), NS);
    secret(&secrets, "store", SECRET_KEY).await?;
    secret(&secrets, "wrong", "not-the-key").await?;

    let s3 = S3Server::start()?;
    s3.create_bucket("models")?;
    let dir = tempfile::tempdir()?;
    let original = dir.path().join("tiny");
    let mut o = SynthOptions::preset("tiny")?;
    o.seed = 5;
    synth(&original, &o)?;
    let store: Arc<dyn ObjectStore> = Arc::new(
        AmazonS3Builder::new()
            .with_endpoint(&s3.endpoint)
            .with_allow_http(true)
            .with_bucket_name("models")
            .with_region("us-east-1")
            .with_access_key_id(ACCESS_KEY)
            .with_secret_access_key(SECRET_KEY)
            .build()?,
    );
    for rel in files(&original) {
        let bytes = std::fs::read(original.join(&rel))?;
        store
            .put(
                &ObjectPath::from(format!("org/tiny/{}", rel.display())),
                bytes.into(),
            )
            .await?;
    }
    let cache = dir.path().join("cache");

    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let _agent = Agent(
        Command::new(AGENT)
            .args(["run", "--listen", &format!("127.0.0.1:{port}")])
            .args(["--reinventory-seconds", "2", "--memory-floor", "0"])
            .args(["--cache-budget", "1Gi", "--model-cache-size", "1Gi"])
            .args(["--staging-chunk", "64Ki", "--staging-parallel", "2"])
            .arg("--model-cache")
            .arg(&cache)
            .env("NODE_NAME", NODE)
            .env("KUBECONFIG", kubeconfig())
            .env("LAYERWISE_LOG", "info")
            .stdin(Stdio::null())
            .spawn()?,
    );

    let result = async {
        request(&api, &s3.endpoint, &[("agent-staging/tiny", "store")]).await?;
        let m = wait_until("tiny staged, profiled and warm", WAIT, || async {
            Ok(match model(&api, "agent-staging/tiny").await? {
                Some(m) if m.state == ModelState::Warm => Ok(m),
                other => Err(format!("{other:?}")),
            })
        })
        .await?;
        let st = m.staging.as_ref().context("no staging status")?;
        let path = PathBuf::from(st.path.as_deref().context("staged without a path")?);
        ensure!(
            st.state == StagingState::Staged
                && st.bytes == st.total_bytes
                && st.total_bytes > 0
                && st.reason.is_none()
                && path.starts_with(cache.join("ready")),
            "{st:?}"
        );
        for rel in files(&original) {
            ensure!(
                std::fs::read(path.join(&rel))? == std::fs::read(original.join(&rel))?,
                "{} differs from the original",
                rel.display()
            );
        }
        let profile = m.profile.as_ref().context("warm without a profile")?;
        ensure!(profile.family == "dit" && profile.blocks > 0, "{profile:?}");
        let metrics = http_get(port, "/metrics")?;
        let staged = format!(
            "layerwise_agent_staged_bytes{{model=\"agent-staging/tiny\"}} {}",
            st.total_bytes
        );
        ensure!(metrics.contains(&staged), "{staged} not in {metrics}");

        // A wrong key and a missing Secret: each named, retried, and the staged model stays.
        request(
            &api,
            &s3.endpoint,
            &[
                ("agent-staging/tiny", "store"),
                ("agent-staging/wrong", "wrong"),
                ("agent-staging/missing", "absent"),
            ],
        )
        .await?;
        for (id, reason) in [
            ("agent-staging/wrong", "AccessDenied"),
            ("agent-staging/missing", "CredentialsUnavailable"),
        ] {
            let m = wait_until(&format!("{id} refused"), WAIT, || async {
                Ok(match model(&api, id).await? {
                    Some(m)
                        if m.staging
                            .as_ref()
                            .is_some_and(|s| s.state == StagingState::Failed) =>
                    {
                        Ok(m)
                    }
                    other => Err(format!("{other:?}")),
                })
            })
            .await?;
            let s = m.staging.unwrap();
            ensure!(
                m.state == ModelState::Staging
                    && s.reason.as_deref() == Some(reason)
                    && s.failures >= 1,
                "{id}: {s:?}"
            );
            let msg = s.message.unwrap_or_default();
            ensure!(
                !msg.contains(SECRET_KEY) && !msg.contains("not-the-key"),
                "{id}: a credential in {msg}"
            );
        }
        ensure!(
            model(&api, "agent-staging/tiny").await?.map(|m| m.state) == Some(ModelState::Warm),
            "the staged model left Warm"
        );
        let metrics = http_get(port, "/metrics")?;
        ensure!(
            metrics.contains(
                "layerwise_agent_staging_failures_total{model=\"agent-staging/wrong\",reason=\"AccessDenied\"}"
            ),
            "{metrics}"
        );
        ensure!(path.join("model_index.json").is_file());
        Ok(())
    }
    .await;

    if existed {
        let _ = request(&api, &s3.endpoint, &[]).await;
    } else {
        let _ = api.delete(NODE, &Default::default()).await;
    }
    let _ = namespaces.delete(NS, &Default::default()).await;
    result
}
