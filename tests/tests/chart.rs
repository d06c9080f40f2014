//! The chart as platform teams install it: every value set it documents (the defaults and
//! `charts/layerwise/ci/*.yaml`) passes `helm lint --strict`, and renders to manifests the
//! test cluster's apiserver accepts in a server-side dry run; values the schema forbids are
//! refused by name.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use k8s_openapi::api::core::v1::Namespace;
use kube::api::PostParams;
use kube::Api;
use layerwise_e2e::cluster;
use layerwise_e2e::tools::{self, ok, tool};

/// How long the CRDs get to be served.
const WAIT: Duration = Duration::from_secs(60);

/// Just enough of the Prometheus Operator's CRDs for the apiserver to take the chart's
/// monitors in a dry run (any fields; the real CRDs validate them on a real cluster).
const MONITOR_CRDS: &str = r#"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: podmonitors.monitoring.coreos.com}
spec:
  group: monitoring.coreos.com
  scope: Namespaced
  names: {kind: PodMonitor, plural: podmonitors, singular: podmonitor, listKind: PodMonitorList}
  versions:
    - name: v1
      served: true
      storage: true
      schema: {openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}}
---
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: servicemonitors.monitoring.coreos.com}
spec:
  group: monitoring.coreos.com
  scope: Namespaced
  names: {kind: ServiceMonitor, plural: servicemonitors, singular: servicemonitor, listKind: ServiceMonitorList}
  versions:
    - name: v1
      served: true
      storage: true
      schema: {openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}}
"#;

/// The chart's folder, as a string for the tools' arguments.
fn chart() -> Result<String> {
    let chart = tools::repo().join("charts/layerwise");
    Ok(chart
        .to_str()
        .context("repository path is not UTF-8")?
        .to_string())
}

/// The documented value sets: `None` for the defaults, then each file under ci/.
fn value_sets() -> Result<Vec<Option<String>>> {
    let dir = tools::repo().join("charts/layerwise/ci");
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .map(|e| Ok(e?.path()))
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    files.sort();
    ensure!(!files.is_empty(), "no value sets in {}", dir.display());
    Ok(std::iter::once(None)
        .chain(files.into_iter().map(Some))
        .collect())
}

#[tokio::test]
async fn every_value_set_lints_renders_and_passes_a_server_side_dry_run() -> Result<()> {
    let client = cluster::client().await?;
    tools::install_crds(&client, WAIT).await?;
    ok(
        tool(
            "kubectl",
            &["apply", "--server-side", "-f", "-"],
            Some(MONITOR_CRDS),
        )?,
        "kubectl apply of the monitor CRDs",
    )?;
    for crd in [
        "podmonitors.monitoring.coreos.com",
        "servicemonitors.monitoring.coreos.com",
    ] {
        let name = format!("crd/{crd}");
        let args = [
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            &name,
        ];
        ok(
            tool("kubectl", &args, None)?,
            "kubectl wait for the monitor CRDs",
        )?;
    }
    let kube_version = client.apiserver_version().await?.git_version;
    let chart = chart()?;
    let ns = cluster::unique_namespace("chart");
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(serde_json::json!({ "metadata": { "name": ns } }))?,
        )
        .await?;
    let result = async {
        for set in value_sets()? {
            let what = set.as_deref().unwrap_or("the defaults");
            let mut values: Vec<&str> = Vec::new();
            if let Some(file) = set.as_deref() {
                values.extend(["-f", file]);
            }
            let mut lint = vec!["lint", "--strict", &chart];
            lint.extend(&values);
            ok(tool("helm", &lint, None)?, &format!("helm lint of {what}"))?;
            let mut template = vec![
                "template",
                "layerwise",
                &chart,
                "--namespace",
                &ns,
                "--kube-version",
                &kube_version,
            ];
            template.extend(&values);
            let manifests = ok(
                tool("helm", &template, None)?,
                &format!("helm template of {what}"),
            )?;
            ok(
                tool(
                    "kubectl",
                    &["apply", "--dry-run=server", "-n", &ns, "-f", "-"],
                    Some(&manifests),
                )?,
                &format!("server-side dry run of {what}"),
            )?;
        }
        Ok::<_, anyhow::Error>(())
    }
    .await;
    tools::finish_teardown(&client, &ns, Vec::new()).await?;
    result
}

/// The schema refuses a misspelt key and a value out of range, naming them.
#[test]
fn the_schema_refuses_bad_values_by_name() -> Result<()> {
    let chart = chart()?;
    for (set, named) in [
        ("operator.maxSlot=3", "maxSlot"),
        ("agent.port=0", "/agent/port"),
        ("agent.modelRoots[0]=models", "/agent/modelRoots/0"),
        ("monitoring.interval=soon", "/monitoring/interval"),
    ] {
        let args = [
            "template",
            "layerwise",
            &chart,
            "--kube-version",
            "1.36.0",
            "--set",
            set,
        ];
        let out = tool("helm", &args, None)?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        ensure!(
            !out.status.success() && stderr.contains(named),
            "--set {set}: want a schema error naming {named}, got {}: {stderr}",
            out.status
        );
    }
    Ok(())
}
