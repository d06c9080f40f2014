//! The chart as platform teams install it: every value set it documents (the defaults and
//! `charts/layerwise/ci/*.yaml`) passes `helm lint --strict`, and renders to manifests the
//! test cluster's apiserver accepts in a server-side dry run; values the schema forbids are
//! refused by name; docs/deploy.md's "Deploy to a cluster" installs the images
//! `scripts/images` builds.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
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
    let ns = cluster::create_namespace(&client, "chart").await?;
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
        (
            "agent.prewarm.cgroup=kubepods/../..",
            "/agent/prewarm/cgroup",
        ),
        ("enginePods.runtimeClass=nvidia", "runtimeClass"),
        (
            "enginePods.tolerations[0].operator=Maybe",
            "/enginePods/tolerations/0/operator",
        ),
        ("imagePullSecrets[0].nam=regcred", "/imagePullSecrets/0"),
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

/// The agent DaemonSet as `helm template` renders it with `sets`, as JSON.
fn agent_daemonset(sets: &[&str]) -> Result<serde_json::Value> {
    let chart = chart()?;
    let mut args = vec![
        "template",
        "layerwise",
        &chart,
        "--kube-version",
        "1.36.0",
        "--show-only",
        "templates/agent-daemonset.yaml",
    ];
    for set in sets {
        args.extend(["--set", set]);
    }
    let text = ok(tool("helm", &args, None)?, "helm template of the agent")?;
    Ok(serde_saphyr::from_str(&text)?)
}

/// The agent container's environment as (name, value) pairs.
fn env_of(container: &serde_json::Value) -> Vec<(String, String)> {
    container["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| Some((e["name"].as_str()?.into(), e["value"].as_str()?.into())))
        .collect()
}

/// By default the chart runs the prewarm readers in a cgroup whose memory limit is the
/// cache budget, so the budget is enforced by the kernel, and gives the agent what making
/// that cgroup takes (root, privileged, the host's cgroup tree writable). Without one the
/// agent is unprivileged and the cgroup tree read-only.
#[test]
fn the_agent_enforces_its_cache_budget_in_a_prewarm_cgroup_by_default() -> Result<()> {
    let ds = agent_daemonset(&["agent.prewarm.cacheBudget=200Gi"])?;
    let c = &ds["spec"]["template"]["spec"]["containers"][0];
    let env = env_of(c);
    let has = |k: &str, v: &str| env.iter().any(|(n, x)| n == k && x == v);
    ensure!(
        has("LAYERWISE_AGENT_PREWARM_CGROUP", "layerwise-prewarm")
            && has("LAYERWISE_AGENT_CACHE_BUDGET", "200Gi"),
        "{env:?}"
    );
    let sc = &c["securityContext"];
    ensure!(
        sc["privileged"] == true && sc["runAsUser"] == 0 && sc["readOnlyRootFilesystem"] == true,
        "{sc}"
    );
    let cgroup_mount = |c: &serde_json::Value| {
        c["volumeMounts"].as_array().and_then(|m| {
            m.iter()
                .find(|m| m["mountPath"] == "/sys/fs/cgroup")
                .cloned()
        })
    };
    let m = cgroup_mount(c).context("no /sys/fs/cgroup mount")?;
    ensure!(m["readOnly"] == false, "{m}");

    let ds = agent_daemonset(&["agent.prewarm.cgroup="])?;
    let pod = &ds["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    ensure!(
        !env_of(c)
            .iter()
            .any(|(n, _)| n == "LAYERWISE_AGENT_PREWARM_CGROUP"),
        "{c}"
    );
    let sc = &c["securityContext"];
    ensure!(
        sc["privileged"] == false
            && sc.get("runAsUser").is_none()
            && pod["securityContext"]["runAsNonRoot"] == true,
        "{sc}"
    );
    let m = cgroup_mount(c).context("no /sys/fs/cgroup mount")?;
    ensure!(m["readOnly"] == true, "{m}");
    Ok(())
}

/// docs/deploy.md's "Deploy to a cluster": its `helm install` renders, with the image values it
/// sets, to manifests the test cluster's apiserver accepts (server-side dry run), whose pods
/// run the images `scripts/images` builds, by the chart's default names.
#[tokio::test]
async fn deploy_page_renders_with_the_images() -> Result<()> {
    let page = std::fs::read_to_string(tools::repo().join("docs/deploy.md"))?;
    let section = page
        .split("\n## Deploy to a cluster\n")
        .nth(1)
        .context("docs/deploy.md has no \"## Deploy to a cluster\" section")?;
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
        "docs/deploy.md pushes {pushed:?}"
    );
    expect_in(
        block,
        &format!("\"layerwise-$image:{version}\""),
        "docs/deploy.md's push loop",
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
        "docs/deploy.md's helm install starts {words:?}"
    );

    let client = cluster::client().await?;
    tools::install_crds(&client, WAIT).await?;
    let ns = cluster::create_namespace(&client, "deploy-page").await?;
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
                    "docs/deploy.md's helm install has {other}, which this test does not know"
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
            "kubectl apply --dry-run=server of docs/deploy.md's helm install",
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
/// double quotes group (no escapes or expansions; docs/deploy.md's commands need none).
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

/// The chart's own-node policy against the real apiserver: the agent's service account,
/// with the node name a pod-bound token carries, may write its own node's DiffusionNode
/// (object and status) and no other node's; a token that names no node may write none;
/// other identities are not matched.
#[tokio::test]
async fn each_agent_writes_only_its_own_nodes_diffusionnode() -> Result<()> {
    use crds::DiffusionNode;
    use kube::api::{Patch, PatchParams};
    use serde_json::json;

    let client = cluster::client().await?;
    tools::install_crds(&client, WAIT).await?;
    let kube_version = client.apiserver_version().await?.git_version;
    let chart = chart()?;
    let ns = cluster::create_namespace(&client, "own-node").await?;
    // The release is named after the namespace, so its cluster-scoped objects are this
    // test's own.
    let manifests = ok(
        tool(
            "helm",
            &[
                "template",
                &ns,
                &chart,
                "--namespace",
                &ns,
                "--kube-version",
                &kube_version,
                "--show-only",
                "templates/agent-rbac.yaml",
                "--show-only",
                "templates/agent-own-node-policy.yaml",
            ],
            None,
        )?,
        "helm template of the agent's RBAC and policy",
    )?;
    ok(
        tool("kubectl", &["apply", "-f", "-"], Some(&manifests))?,
        "kubectl apply of the agent's RBAC and policy",
    )?;
    let (a, b, c) = (format!("{ns}-a"), format!("{ns}-b"), format!("{ns}-c"));
    let admin: Api<DiffusionNode> = Api::all(client.clone());
    let result = async {
        for name in [&a, &b] {
            admin
                .create(
                    &PostParams::default(),
                    &serde_json::from_value(json!({
                        "apiVersion": "layerwise.dev/v1alpha1",
                        "kind": "DiffusionNode",
                        "metadata": { "name": name },
                        "spec": {}
                    }))?,
                )
                .await?;
        }
        let agent = format!("system:serviceaccount:{ns}:{ns}-layerwise-agent");
        let on_a: Api<DiffusionNode> = Api::all(tools::impersonating_on_node(&agent, &a).await?);
        let no_node: Api<DiffusionNode> = Api::all(tools::impersonating(&agent).await?);
        let pp = PatchParams::default();
        let status = |bytes: u64| Patch::Merge(json!({ "status": { "hostMemoryBytes": bytes } }));
        let label = Patch::Merge(json!({ "metadata": { "labels": { "touched": "yes" } } }));

        // The policy takes effect once the apiserver has loaded it.
        let refused = cluster::wait_until("the own-node policy to refuse", WAIT, || async {
            Ok(match on_a.patch_status(&b, &pp, &status(1)).await {
                Ok(_) => Err("agent A patched B's status".to_string()),
                Err(e) => Ok(e.to_string()),
            })
        })
        .await?;
        println!("agent of A writing B's status: {refused}");
        ensure!(
            refused.contains(&format!(
                "the layerwise agent of node {a} may write only that node's DiffusionNode, not {b}"
            )),
            "{refused}"
        );
        let e = on_a
            .patch(&b, &pp, &label)
            .await
            .err()
            .context("agent A labelled B")?;
        ensure!(e.to_string().contains("may write only"), "{e}");
        let e = on_a
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "apiVersion": "layerwise.dev/v1alpha1",
                    "kind": "DiffusionNode",
                    "metadata": { "name": c },
                    "spec": {}
                }))?,
            )
            .await
            .err()
            .context("agent A created another node's DiffusionNode")?;
        ensure!(e.to_string().contains("may write only"), "{e}");
        // Its own node's: the object and the status.
        on_a.patch_status(&a, &pp, &status(7)).await?;
        on_a.patch(&a, &pp, &label).await?;
        ensure!(
            admin.get(&a).await?.status.map(|s| s.host_memory_bytes) == Some(7),
            "A's status was not written"
        );
        // A token bound to no node writes nothing.
        let e = no_node
            .patch_status(&a, &pp, &status(8))
            .await
            .err()
            .context("a token without a node wrote A's status")?;
        ensure!(e.to_string().contains("names no node"), "{e}");
        // Other identities are not the policy's business.
        admin.patch_status(&b, &pp, &status(9)).await?;
        Ok::<_, anyhow::Error>(())
    }
    .await;
    let mut errors = Vec::new();
    for name in [&a, &b, &c] {
        if let Err(e) = admin.delete(name, &Default::default()).await {
            if !matches!(&e, kube::Error::Api(s) if s.code == 404) {
                errors.push(e.into());
            }
        }
    }
    if let Err(e) = ok(
        tool(
            "kubectl",
            &["delete", "--ignore-not-found", "-f", "-"],
            Some(&manifests),
        )?,
        "kubectl delete of the agent's RBAC and policy",
    ) {
        errors.push(e);
    }
    tools::finish_teardown(&client, &ns, errors).await?;
    result
}
