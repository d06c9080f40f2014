//! Pod Security admission of the engine pods the operator makes, against the real apiserver:
//! in a namespace labelled `pod-security.kubernetes.io/enforce: restricted`, the engine pod
//! of a DiffusionDeployment whose model is on a PersistentVolumeClaim is admitted as the
//! operator builds it (non-root, no privilege escalation, every capability dropped, the
//! runtime's seccomp filter, no host paths); one whose model is a hostPath is refused, and
//! the refusal names the hostPath volume (`restricted`, and `baseline` too, forbid them).

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Patch, PatchParams, PostParams};
use kube::Api;
use layerwise_e2e::engine_objects::{diffusion_deployment, engine_objects};
use layerwise_e2e::{cluster, tools};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(60);

#[tokio::test]
async fn a_claim_based_engine_pod_is_admitted_under_restricted() -> Result<()> {
    let client = cluster::client().await?;
    tools::install_crds(&client, WAIT).await?;
    let ns = cluster::create_namespace(&client, "restricted").await?;
    let result = async {
        let namespaces: Api<Namespace> = Api::all(client.clone());
        namespaces
            .patch(
                &ns,
                &PatchParams::default(),
                &Patch::Merge(json!({ "metadata": { "labels": {
                    "pod-security.kubernetes.io/enforce": "restricted",
                    "pod-security.kubernetes.io/enforce-version": "latest",
                } } })),
            )
            .await?;
        let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
        // A dry run goes through admission, Pod Security's included, and schedules nothing.
        let dry = PostParams {
            dry_run: true,
            ..Default::default()
        };
        let claim = engine_objects(&diffusion_deployment(
            "on-claim",
            &ns,
            json!({ "persistentVolumeClaim": { "claimName": "models", "subPath": "tiny" } }),
        )?)?
        .0;
        pods.create(&dry, &claim)
            .await
            .context("the claim-based engine pod under `restricted`")?;
        let host = engine_objects(&diffusion_deployment(
            "on-host",
            &ns,
            json!({ "hostPath": "/models/tiny" }),
        )?)?
        .0;
        let refused = pods.create(&dry, &host).await;
        let message = match &refused {
            Err(kube::Error::Api(s)) if s.code == 403 => s.message.clone(),
            other => anyhow::bail!("a hostPath engine pod under `restricted`: {other:?}"),
        };
        println!("hostPath engine pod: {message}");
        ensure!(
            message.contains("restricted") && message.contains("hostPath"),
            "{message}"
        );
        Ok::<_, anyhow::Error>(())
    }
    .await;
    tools::finish_teardown(&client, &ns, Vec::new()).await?;
    result
}
