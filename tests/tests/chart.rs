//! The chart as platform teams install it: every value set it documents (the defaults and
//! `charts/layerwise/ci/*.yaml`) passes `helm lint --strict`, and renders to manifests the
//! test cluster's apiserver accepts in a server-side dry run; values the schema forbids are
//! refused by name; README's "Deploy to a cluster" installs the images `scripts/images`
//! builds.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use k8s_openapi::api::core::v1::Namespace;
use kube::api::PostParams;
use kube::Api;
use layerwise_e2e::cluster;
use layerwise_e2e::images::{self, expect_in};
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

/// README's "Deploy to a cluster": its `helm install` renders, with the image values it
/// sets, to manifests the test cluster's apiserver accepts (server-side dry run), whose pods
/// run the images `scripts/images` builds, by the chart's default names.
#[tokio::test]
async fn readme_deploy_renders_with_the_images() -> Result<()> {
    let readme = std::fs::read_to_string(tools::repo().join("README.md"))?;
    let section = readme
        .split("\n## Deploy to a cluster\n")
        .nth(1)
        .context("README has no \"## Deploy to a cluster\" section")?;
    let section = section.split("\n## ").next().unwrap_or(section);
    let block = section
        .split("```sh\n")
        .skip(1)
        .filter_map(|b| b.split("```").next())
        .find(|b| b.contains("helm install"))
        .context("no sh block with `helm install` under \"Deploy to a cluster\"")?;
    let version = images::app_version()?;
    // The push loop tags every image the chart runs with the chart's appVersion.
    let pushed: Vec<&str> = block
        .lines()
        .find_map(|l| l.trim().strip_prefix("for image in "))
        .and_then(|l| l.split(';').next())
        .context("no `for image in ...` push loop")?
        .split_whitespace()
        .collect();
    ensure!(
        pushed == ["operator", "agent", "engine-cuda"],
        "README pushes {pushed:?}"
    );
    expect_in(
        block,
        &format!("\"layerwise-$image:{version}\""),
        "README's push loop",
    )?;
    let registry = "example.invalid/layerwise";
    let command = block.replace("\\\n", " ").replace("$registry", registry);
    let install = command
        .lines()
        .find(|l| l.trim_start().starts_with("helm install"))
        .context("no helm install line")?;
    let words = shell_words(install);
    ensure!(
        words.get(..4)
            == Some(&["helm", "install", "layerwise", "charts/layerwise"].map(String::from)[..]),
        "README's helm install starts {words:?}"
    );

    let client = cluster::client().await?;
    tools::install_crds(&client, WAIT).await?;
    let ns = cluster::unique_namespace("readme");
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(serde_json::json!({ "metadata": { "name": ns } }))?,
        )
        .await?;
    let result = async {
        let chart = tools::repo().join("charts/layerwise");
        let chart = chart.to_str().context("repository path is not UTF-8")?;
        let kube_version = client.apiserver_version().await?.git_version;
        let mut args = vec![
            "template",
            "layerwise",
            chart,
            "--namespace",
            &ns,
            "--kube-version",
            &kube_version,
        ];
        let mut rest = words[4..].iter();
        while let Some(word) = rest.next() {
            match word.as_str() {
                "--create-namespace" => {}
                "--namespace" => {
                    rest.next();
                }
                "--set" => {
                    args.push("--set");
                    args.push(rest.next().context("--set without a value")?);
                }
                other => anyhow::bail!(
                    "README's helm install has {other}, which this test does not know"
                ),
            }
        }
        let manifests = ok(tool("helm", &args, None)?, "helm template")?;
        for name in ["operator", "agent", "engine-cuda"] {
            let image = format!("{registry}/layerwise-{name}:{version}");
            expect_in(&manifests, &image, "the rendered chart")?;
        }
        ok(
            tool(
                "kubectl",
                &["apply", "--dry-run=server", "-n", &ns, "-f", "-"],
                Some(&manifests),
            )?,
            "kubectl apply --dry-run=server of README's helm install",
        )?;
        // The chart's defaults name the images scripts/images builds.
        let defaults = ok(
            tool(
                "helm",
                &[
                    "template",
                    "layerwise",
                    chart,
                    "--kube-version",
                    &kube_version,
                ],
                None,
            )?,
            "helm template (defaults)",
        )?;
        for name in ["operator", "agent", "engine-cuda"] {
            let image = format!("\"layerwise-{name}:{version}\"");
            expect_in(&defaults, &image, "the chart's default images")?;
        }
        Ok::<_, anyhow::Error>(())
    }
    .await;
    tools::finish_teardown(&client, &ns, Vec::new()).await?;
    result
}

/// Splits a shell command line into words: whitespace outside quotes separates, single and
/// double quotes group (no escapes or expansions; README's commands need none).
fn shell_words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut quote = None;
    let mut any = false;
    for c in line.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => word.push(c),
            (None, '\'' | '"') => {
                quote = Some(c);
                any = true;
            }
            (None, c) if c.is_whitespace() => {
                if any || !word.is_empty() {
                    words.push(std::mem::take(&mut word));
                    any = false;
                }
            }
            (None, c) => word.push(c),
        }
    }
    if any || !word.is_empty() {
        words.push(word);
    }
    words
}
