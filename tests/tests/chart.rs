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
use layerwise_e2e::monitors::{self, in_namespaces, selects};
use layerwise_e2e::tools::{self, ok, tool};

/// How long the CRDs get to be served.
const WAIT: Duration = Duration::from_secs(60);

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
    monitors::install()?;
    let kube_version = client.apiserver_version().await?.git_version;
    let chart = chart()?;
    let ns = cluster::create_namespace(&client, "chart").await?;
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    let mut made: Vec<String> = Vec::new();
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
            // A set that watches one namespace puts the operator's Role there: that
            // namespace must exist for the dry run, as it must for an install.
            for line in manifests.lines() {
                let Some(other) = line.trim().strip_prefix("namespace: ") else {
                    continue;
                };
                if other != ns && !made.iter().any(|m| m == other) {
                    let new = serde_json::from_value(serde_json::json!({
                        "metadata": { "name": other }
                    }))?;
                    match namespaces.create(&PostParams::default(), &new).await {
                        Ok(_) => made.push(other.to_string()),
                        Err(kube::Error::Api(e)) if e.code == 409 => {}
                        Err(e) => return Err(e.into()),
                    }
                }
            }
            // Every namespaced object the chart renders names its namespace.
            ok(
                tool(
                    "kubectl",
                    &["apply", "--dry-run=server", "-f", "-"],
                    Some(&manifests),
                )?,
                &format!("server-side dry run of {what}"),
            )?;
        }
        Ok::<_, anyhow::Error>(())
    }
    .await;
    for other in &made {
        tools::finish_teardown(&client, other, Vec::new()).await?;
    }
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
        (
            "monitoring.podMonitor.enabled=true,monitoring.serviceMonitor.enabled=true",
            "/monitoring/serviceMonitor/enabled",
        ),
        ("enginePods.runtimeClass=nvidia", "runtimeClass"),
        (
            "enginePods.tolerations[0].operator=Maybe",
            "/enginePods/tolerations/0/operator",
        ),
        ("imagePullSecrets[0].nam=regcred", "/imagePullSecrets/0"),
        ("logFormat=yaml", "/logFormat"),
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

/// By default the agent is unprivileged and non-root, with the host's cgroup tree read-only,
/// and its cache budget is its container's memory limit: the prewarm readers run in the
/// container, so the kernel keeps the cache they bring in within it. A host-level prewarm
/// cgroup is an explicit opt-in (`agent.privileged`), refused without it.
#[test]
fn the_agent_is_unprivileged_by_default_and_privileged_only_on_request() -> Result<()> {
    let cgroup_mount = |c: &serde_json::Value| {
        c["volumeMounts"].as_array().and_then(|m| {
            m.iter()
                .find(|m| m["mountPath"] == "/sys/fs/cgroup")
                .cloned()
        })
    };
    let ds = agent_daemonset(&["agent.prewarm.cacheBudget=200Gi"])?;
    let pod = &ds["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    let env = env_of(c);
    let has = |k: &str, v: &str| env.iter().any(|(n, x)| n == k && x == v);
    ensure!(
        has("LAYERWISE_AGENT_CACHE_BUDGET", "200Gi")
            && !env
                .iter()
                .any(|(n, _)| n == "LAYERWISE_AGENT_PREWARM_CGROUP"),
        "{env:?}"
    );
    ensure!(
        c["resources"]["limits"]["memory"] == "200Gi",
        "{}",
        c["resources"]
    );
    let sc = &c["securityContext"];
    ensure!(
        sc["privileged"] == false
            && sc["allowPrivilegeEscalation"] == false
            && sc["capabilities"]["drop"][0] == "ALL"
            && sc.get("runAsUser").is_none()
            && pod["securityContext"]["runAsNonRoot"] == true
            && pod["securityContext"]["runAsUser"] == 65532,
        "{sc}"
    );
    let m = cgroup_mount(c).context("no /sys/fs/cgroup mount")?;
    ensure!(m["readOnly"] == true, "{m}");
    // No budget: no limit.
    let ds = agent_daemonset(&[])?;
    let c = &ds["spec"]["template"]["spec"]["containers"][0];
    ensure!(c["resources"].get("limits").is_none(), "{}", c["resources"]);

    // The opt-in: a host-level prewarm cgroup, with what making it takes.
    let ds = agent_daemonset(&[
        "agent.privileged=true",
        "agent.prewarm.cgroup=layerwise-prewarm",
        "agent.prewarm.cacheBudget=200Gi",
    ])?;
    let c = &ds["spec"]["template"]["spec"]["containers"][0];
    ensure!(
        env_of(c)
            .iter()
            .any(|(n, v)| n == "LAYERWISE_AGENT_PREWARM_CGROUP" && v == "layerwise-prewarm"),
        "{c}"
    );
    let sc = &c["securityContext"];
    ensure!(
        sc["privileged"] == true && sc["runAsUser"] == 0 && sc["readOnlyRootFilesystem"] == true,
        "{sc}"
    );
    // The cgroup's limit is the budget, not the container's.
    ensure!(c["resources"].get("limits").is_none(), "{}", c["resources"]);
    let m = cgroup_mount(c).context("no /sys/fs/cgroup mount")?;
    ensure!(m["readOnly"] == false, "{m}");

    // A prewarm cgroup without the opt-in, and a limit that contradicts the budget: refused
    // by name.
    let chart = chart()?;
    for (sets, named) in [
        (
            &["agent.prewarm.cgroup=layerwise-prewarm"][..],
            "/agent/privileged",
        ),
        (
            &[
                "agent.prewarm.cacheBudget=1Gi",
                "agent.resources.limits.memory=2Gi",
            ][..],
            "agent.resources.limits.memory",
        ),
    ] {
        let mut args = vec!["template", "layerwise", &chart, "--kube-version", "1.36.0"];
        for set in sets {
            args.extend(["--set", set]);
        }
        let out = tool("helm", &args, None)?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        ensure!(
            !out.status.success() && stderr.contains(named),
            "{sets:?}: want an error naming {named}, got {}: {stderr}",
            out.status
        );
    }
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

/// The notes `helm install` prints after an install show next commands that work: the
/// pods the first selects are the chart's operator and agents, and the DiffusionDeployment
/// the second applies passes the CRD's schema and rules in a server-side dry run, with its
/// model under one of the chart's model roots (the operator refuses others).
#[tokio::test]
async fn the_install_notes_show_next_commands_that_work() -> Result<()> {
    let client = cluster::client().await?;
    tools::install_crds(&client, WAIT).await?;
    let ns = cluster::create_namespace(&client, "notes").await?;
    let result = async {
        let chart = chart()?;
        let args = [
            "install",
            "lw",
            &chart,
            "--namespace",
            &ns,
            "--skip-crds",
            "--dry-run=server",
        ];
        let out = ok(tool("helm", &args, None)?, "helm install --dry-run")?;
        let notes = out
            .split_once("\nNOTES:\n")
            .map(|(_, n)| n)
            .context("helm printed no notes")?;
        let selector = "-l app.kubernetes.io/instance=lw";
        ensure!(
            notes.contains(&format!("kubectl -n {ns} get pods {selector}")),
            "{notes}"
        );
        let objects = render(&[], &[], "lw", &ns)?;
        for kind in ["Deployment", "DaemonSet"] {
            for o in of_kind(&objects, kind) {
                let labels = &o["spec"]["template"]["metadata"]["labels"];
                ensure!(
                    labels["app.kubernetes.io/instance"] == "lw",
                    "{kind} {}: pod labels {labels}",
                    o["metadata"]["name"]
                );
            }
        }
        let yaml = notes
            .split_once("<<'YAML'\n")
            .and_then(|(_, rest)| rest.split_once("\nYAML\n"))
            .map(|(yaml, _)| yaml)
            .context("no DiffusionDeployment between <<'YAML' and YAML in the notes")?;
        let applied = ok(
            tool(
                "kubectl",
                &["apply", "--dry-run=server", "-n", &ns, "-f", "-"],
                Some(yaml),
            )?,
            "kubectl apply of the notes' DiffusionDeployment",
        )?;
        ensure!(applied.contains("diffusiondeployment"), "{applied}");
        let dd: serde_json::Value = serde_saphyr::from_str(yaml)?;
        let path = dd["spec"]["model"]["location"]["hostPath"]
            .as_str()
            .context("the notes' model is not a hostPath")?;
        let values: serde_json::Value = serde_saphyr::from_str(&std::fs::read_to_string(
            std::path::Path::new(&chart).join("values.yaml"),
        )?)?;
        let roots = values["agent"]["modelRoots"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        ensure!(
            roots
                .iter()
                .filter_map(|r| r.as_str())
                .any(|r| path.starts_with(&format!("{}/", r.trim_end_matches('/')))),
            "the notes' model {path} is under none of agent.modelRoots {roots:?}"
        );
        Ok::<_, anyhow::Error>(())
    }
    .await;
    tools::finish_teardown(&client, &ns, Vec::new()).await?;
    result
}

/// `logFormat` reaches the operator and every agent as `--log-format`, `text` unless set
/// (the binaries' own default); the operator passes its own on to the engine pods it makes
/// (`engine_pods_log_as_the_operator_does_unless_their_spec_says_otherwise` in the operator),
/// and `auto_offload_sharded.rs` runs both containers with `json` and reads their lines.
#[test]
fn the_log_format_reaches_the_operator_and_the_agents() -> Result<()> {
    for (sets, want) in [(&[][..], "text"), (&["logFormat=json"][..], "json")] {
        let objects = render(sets, &[], "lw", "layerwise")?;
        let mut seen = Vec::new();
        for kind in ["Deployment", "DaemonSet"] {
            for o in of_kind(&objects, kind) {
                let c = &o["spec"]["template"]["spec"]["containers"][0];
                let args: Vec<&str> = c["args"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|a| a.as_str())
                    .collect();
                ensure!(
                    args.windows(2).any(|w| w == ["--log-format", want]),
                    "{kind} {}: args {args:?} with {sets:?}",
                    o["metadata"]["name"]
                );
                seen.push(c["command"][0].as_str().unwrap_or_default().to_string());
            }
        }
        seen.sort();
        ensure!(
            seen == ["layerwise-agent", "layerwise-operator"],
            "containers checked: {seen:?}"
        );
    }
    Ok(())
}

/// Every object `helm template` renders with `sets` (and `files`, value files), as JSON.
fn render(
    sets: &[&str],
    files: &[&str],
    release: &str,
    ns: &str,
) -> Result<Vec<serde_json::Value>> {
    let chart = chart()?;
    let mut args = vec![
        "template",
        release,
        &chart,
        "--namespace",
        ns,
        "--kube-version",
        "1.36.0",
    ];
    for set in sets {
        args.extend(["--set", set]);
    }
    for file in files {
        args.extend(["-f", file]);
    }
    let text = ok(tool("helm", &args, None)?, "helm template")?;
    let objects = serde_saphyr::from_multiple::<serde_json::Value>(&text)?;
    Ok(objects.into_iter().filter(|v| !v.is_null()).collect())
}

/// The objects of `kind` among `objects`.
fn of_kind<'a>(objects: &'a [serde_json::Value], kind: &str) -> Vec<&'a serde_json::Value> {
    objects.iter().filter(|o| o["kind"] == kind).collect()
}

/// Whether a role's rules grant `verb` on `resource` (of any API group).
fn grants(role: &serde_json::Value, verb: &str, resource: &str) -> bool {
    role["rules"].as_array().into_iter().flatten().any(|r| {
        let has = |key: &str, want: &str| {
            r[key]
                .as_array()
                .is_some_and(|v| v.iter().any(|x| x == want || x == "*"))
        };
        has("verbs", verb) && has("resources", resource)
    })
}

/// With operator.watchNamespace the operator's writes are a Role in that namespace: no
/// ClusterRole of the chart lets it create Deployments, Services or Secrets anywhere, and
/// only cluster-scoped reads stay cluster-wide. Without it, the ClusterRole carries them.
#[test]
fn watching_one_namespace_the_operator_is_granted_there_only() -> Result<()> {
    let objects = render(&["operator.watchNamespace=diffusion"], &[], "lw", "ops")?;
    let operator = "lw-layerwise-operator";
    // The operator's ClusterRoles: those bound to its service account.
    let bound: Vec<&serde_json::Value> = of_kind(&objects, "ClusterRoleBinding")
        .into_iter()
        .filter(|b| b["subjects"][0]["name"] == operator)
        .map(|b| &b["roleRef"]["name"])
        .collect();
    let cluster_roles: Vec<&serde_json::Value> = of_kind(&objects, "ClusterRole")
        .into_iter()
        .filter(|r| bound.contains(&&r["metadata"]["name"]))
        .collect();
    let ops = cluster_roles
        .iter()
        .find(|r| r["metadata"]["name"] == operator)
        .context("no operator ClusterRole")?;
    for (verb, resource) in [
        ("create", "deployments"),
        ("patch", "deployments"),
        ("create", "services"),
        ("patch", "services"),
        ("create", "secrets"),
        ("list", "pods"),
        ("patch", "diffusiondeployments"),
    ] {
        for role in &cluster_roles {
            ensure!(
                !grants(role, verb, resource),
                "ClusterRole {} grants {verb} {resource} with watchNamespace set",
                role["metadata"]["name"]
            );
        }
    }
    for (verb, resource) in [
        ("list", "nodes"),
        ("watch", "diffusionnodes"),
        ("patch", "diffusionnodes"),
    ] {
        ensure!(
            grants(ops, verb, resource),
            "the ClusterRole lost {verb} {resource}"
        );
    }
    let role = of_kind(&objects, "Role")
        .into_iter()
        .find(|r| r["metadata"]["name"] == operator)
        .context("no operator Role")?;
    ensure!(role["metadata"]["namespace"] == "diffusion", "{role}");
    for (verb, resource) in [
        ("create", "deployments"),
        ("create", "services"),
        ("create", "secrets"),
        ("patch", "diffusiondeployments/status"),
    ] {
        ensure!(
            grants(role, verb, resource),
            "the Role lacks {verb} {resource}"
        );
    }
    let binding = of_kind(&objects, "RoleBinding")
        .into_iter()
        .find(|b| b["metadata"]["name"] == operator)
        .context("no operator RoleBinding")?;
    ensure!(
        binding["metadata"]["namespace"] == "diffusion"
            && binding["roleRef"]["kind"] == "Role"
            && binding["subjects"][0]["name"] == operator
            && binding["subjects"][0]["namespace"] == "ops",
        "{binding}"
    );

    // Every namespace: one ClusterRole with both parts, no Role but the Lease's.
    let objects = render(&[], &[], "lw", "ops")?;
    let ops = of_kind(&objects, "ClusterRole")
        .into_iter()
        .find(|r| r["metadata"]["name"] == operator)
        .context("no operator ClusterRole")?;
    for (verb, resource) in [
        ("create", "deployments"),
        ("create", "secrets"),
        ("list", "nodes"),
    ] {
        ensure!(
            grants(ops, verb, resource),
            "the ClusterRole lacks {verb} {resource}"
        );
    }
    let roles: Vec<_> = of_kind(&objects, "Role")
        .iter()
        .map(|r| r["metadata"]["name"].clone())
        .collect();
    ensure!(roles == [format!("{operator}-lease")], "{roles:?}");
    Ok(())
}

/// Against the apiserver: the chart's aggregated roles put DiffusionDeployments into the
/// built-in `view` and `edit` ClusterRoles, so a namespace user bound to `view` reads them
/// and may not write them, one bound to `edit` writes them; the operator, watching one
/// namespace, may create Deployments and Secrets there and nowhere else, and still reads
/// Nodes.
#[tokio::test]
async fn namespace_users_get_diffusiondeployments_through_view_and_edit() -> Result<()> {
    use crds::DiffusionDeployment;
    use serde_json::json;

    let client = cluster::client().await?;
    tools::install_crds(&client, WAIT).await?;
    let ns = cluster::create_namespace(&client, "access").await?;
    let other = cluster::create_namespace(&client, "access-other").await?;
    // Release named after the namespace: its ClusterRoles are this test's own.
    let manifests = ok(
        tool(
            "helm",
            &[
                "template",
                &ns,
                &chart()?,
                "--namespace",
                &ns,
                "--kube-version",
                "1.36.0",
                "--set",
                &format!("operator.watchNamespace={ns}"),
                "--show-only",
                "templates/operator-rbac.yaml",
                "--show-only",
                "templates/user-rbac.yaml",
            ],
            None,
        )?,
        "helm template of the RBAC",
    )?;
    ok(
        tool("kubectl", &["apply", "-f", "-"], Some(&manifests))?,
        "kubectl apply of the RBAC",
    )?;
    let bindings = format!(
        r#"
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {{name: alice-view, namespace: {ns}}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: view}}
subjects: [{{apiGroup: rbac.authorization.k8s.io, kind: User, name: {ns}-alice}}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {{name: bob-edit, namespace: {ns}}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: edit}}
subjects: [{{apiGroup: rbac.authorization.k8s.io, kind: User, name: {ns}-bob}}]
"#
    );
    ok(
        tool("kubectl", &["apply", "-f", "-"], Some(&bindings))?,
        "kubectl apply of the users' bindings",
    )?;
    let result = async {
        let dd = |name: &str| -> Result<DiffusionDeployment> {
            Ok(serde_json::from_value(json!({
                "apiVersion": "layerwise.dev/v1alpha1", "kind": "DiffusionDeployment",
                "metadata": { "name": name },
                "spec": {
                    "model": { "family": "dit", "location": { "hostPath": "/models/m" } },
                    "workload": { "maxWidth": 512, "maxHeight": 512 },
                },
            }))?)
        };
        let admin: Api<DiffusionDeployment> = Api::namespaced(client.clone(), &ns);
        admin
            .create(&PostParams::default(), &dd("by-admin")?)
            .await?;
        let alice: Api<DiffusionDeployment> =
            Api::namespaced(tools::impersonating(&format!("{ns}-alice")).await?, &ns);
        let bob: Api<DiffusionDeployment> =
            Api::namespaced(tools::impersonating(&format!("{ns}-bob")).await?, &ns);
        // The aggregation controller folds the chart's roles into view and edit.
        cluster::wait_until("view to include diffusiondeployments", WAIT, || async {
            Ok(match alice.get("by-admin").await {
                Ok(d) => Ok(d),
                Err(e) => Err(e.to_string()),
            })
        })
        .await?;
        ensure!(!alice.list(&Default::default()).await?.items.is_empty());
        let refused = alice.create(&PostParams::default(), &dd("by-alice")?).await;
        ensure!(
            matches!(&refused, Err(kube::Error::Api(s)) if s.code == 403),
            "a viewer created a DiffusionDeployment: {refused:?}"
        );
        cluster::wait_until("edit to include diffusiondeployments", WAIT, || async {
            Ok(
                match bob.create(&PostParams::default(), &dd("by-bob")?).await {
                    Ok(d) => Ok(d),
                    Err(e) => Err(e.to_string()),
                },
            )
        })
        .await?;
        // The operator: the watched namespace only, for what it makes there.
        let sa = format!("system:serviceaccount:{ns}:{ns}-layerwise-operator");
        let can = |verb: &str, resource: &str, namespace: Option<&str>| -> Result<bool> {
            // `<resource>/<subresource>` here, `--subresource` for kubectl.
            let (resource, sub) = resource.split_once('/').unwrap_or((resource, ""));
            let sub = format!("--subresource={sub}");
            let mut args = vec!["auth", "can-i", verb, resource, "--as", &sa];
            if sub != "--subresource=" {
                args.push(&sub);
            }
            if let Some(n) = namespace {
                args.extend(["-n", n]);
            }
            let out = tool("kubectl", &args, None)?;
            Ok(String::from_utf8_lossy(&out.stdout).trim() == "yes")
        };
        for (verb, resource) in [
            ("create", "deployments.apps"),
            ("create", "services"),
            ("create", "secrets"),
            ("patch", "diffusiondeployments.layerwise.dev/status"),
        ] {
            ensure!(
                can(verb, resource, Some(&ns))?,
                "the operator may not {verb} {resource} in {ns}"
            );
            ensure!(
                !can(verb, resource, Some(&other))?,
                "the operator may {verb} {resource} in {other}"
            );
        }
        ensure!(
            can("list", "nodes", None)?,
            "the operator may not list nodes"
        );
        ensure!(
            can("patch", "diffusionnodes.layerwise.dev", None)?,
            "the operator may not patch diffusionnodes"
        );
        Ok::<_, anyhow::Error>(())
    }
    .await;
    let mut errors = Vec::new();
    if let Err(e) = ok(
        tool(
            "kubectl",
            &["delete", "--ignore-not-found", "-f", "-"],
            Some(&manifests),
        )?,
        "kubectl delete of the RBAC",
    ) {
        errors.push(e);
    }
    tools::finish_teardown(&client, &other, Vec::new()).await?;
    tools::finish_teardown(&client, &ns, errors).await?;
    result
}

/// Whether `selector` (a monitor's `selector`, a LabelSelector with `matchLabels`) selects an
/// How many scrape targets the monitors among `objects` make of `pod`: each PodMonitor
/// endpoint that selects it and names one of its container ports, and each ServiceMonitor
/// endpoint that selects one of `services` whose selector takes the pod and whose port of
/// that name reaches a container port of the pod.
fn targets(
    objects: &[serde_json::Value],
    services: &[serde_json::Value],
    pod: &serde_json::Value,
) -> usize {
    let ns = pod["metadata"]["namespace"].as_str().unwrap_or_default();
    let labels = &pod["metadata"]["labels"];
    let ports: Vec<&serde_json::Value> = pod["spec"]["containers"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|c| c["ports"].as_array().into_iter().flatten())
        .collect();
    let has_port = |name: &serde_json::Value| {
        ports
            .iter()
            .any(|p| &p["name"] == name || &p["containerPort"] == name)
    };
    let mut n = 0;
    for m in of_kind(objects, "PodMonitor") {
        if in_namespaces(m, ns) && selects(&m["spec"]["selector"], labels) {
            n += m["spec"]["podMetricsEndpoints"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|e| has_port(&e["port"]))
                .count();
        }
    }
    for m in of_kind(objects, "ServiceMonitor") {
        for s in services {
            let s_ns = s["metadata"]["namespace"].as_str().unwrap_or_default();
            let takes_pod = s_ns == ns
                && s["spec"]["selector"]
                    .as_object()
                    .is_some_and(|sel| sel.iter().all(|(k, v)| labels.get(k) == Some(v)));
            if !takes_pod
                || !in_namespaces(m, s_ns)
                || !selects(&m["spec"]["selector"], &s["metadata"]["labels"])
            {
                continue;
            }
            for e in m["spec"]["endpoints"].as_array().into_iter().flatten() {
                let port = s["spec"]["ports"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .find(|p| p["name"] == e["port"]);
                if port.is_some_and(|p| has_port(&p["targetPort"])) {
                    n += 1;
                }
            }
        }
    }
    n
}

/// Every documented value set, and each engine monitor on its own: each engine pod the
/// operator makes (built by the operator's code, in the watched namespace), each operator pod
/// and each agent pod is scraped by exactly one monitor endpoint when monitoring is on, none
/// when it is off; the operator through its metrics Service, whose target port is the
/// operator container's `metrics` port.
#[test]
fn each_engine_pod_and_the_operator_are_scraped_once() -> Result<()> {
    use layerwise_e2e::engine_objects::{diffusion_deployment, engine_objects};

    let mut sets: Vec<(String, Vec<String>, Vec<String>)> = value_sets()?
        .into_iter()
        .map(|f| {
            let name = f.clone().unwrap_or_else(|| "the defaults".into());
            (name, Vec::new(), f.into_iter().collect())
        })
        .collect();
    for one in ["podMonitor", "serviceMonitor"] {
        sets.push((
            format!("{one} alone"),
            vec![format!("monitoring.{one}.enabled=true")],
            Vec::new(),
        ));
    }
    let mut monitored_sets = 0;
    for (what, set_args, files) in &sets {
        let sets: Vec<&str> = set_args.iter().map(String::as_str).collect();
        let files: Vec<&str> = files.iter().map(String::as_str).collect();
        let objects = render(&sets, &files, "lw", "ops")?;
        let monitored = !of_kind(&objects, "PodMonitor").is_empty()
            || !of_kind(&objects, "ServiceMonitor").is_empty();
        let want = usize::from(monitored);
        monitored_sets += want;
        let watched = objects
            .iter()
            .filter(|o| o["kind"] == "Deployment")
            .flat_map(|d| {
                d["spec"]["template"]["spec"]["containers"][0]["env"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
            })
            .find(|e| e["name"] == "LAYERWISE_WATCH_NAMESPACE")
            .and_then(|e| e["value"].as_str().map(String::from))
            .unwrap_or_else(|| "models".into());
        let dd = diffusion_deployment(
            "tiny",
            &watched,
            serde_json::json!({ "persistentVolumeClaim": { "claimName": "models" } }),
        )?;
        let (pod, service) = engine_objects(&dd)?;
        let mut services: Vec<serde_json::Value> =
            of_kind(&objects, "Service").into_iter().cloned().collect();
        services.push(serde_json::to_value(&service)?);
        let engine = serde_json::to_value(&pod)?;
        let n = targets(&objects, &services, &engine);
        ensure!(
            n == want,
            "{what}: the engine pod is scraped {n} times, want {want}"
        );
        // The chart's own pods, as their controllers template them.
        for (kind, name) in [
            ("Deployment", "lw-layerwise-operator"),
            ("DaemonSet", "lw-layerwise-agent"),
        ] {
            let Some(owner) = of_kind(&objects, kind)
                .into_iter()
                .find(|o| o["metadata"]["name"] == name)
            else {
                continue;
            };
            let mut pod = owner["spec"]["template"].clone();
            pod["metadata"]["namespace"] = "ops".into();
            let n = targets(&objects, &services, &pod);
            ensure!(
                n == want,
                "{what}: the {kind} {name}'s pod is scraped {n} times, want {want}"
            );
        }
        // The operator's Service reaches its metrics port, monitored or not.
        let svc = services
            .iter()
            .find(|s| s["metadata"]["name"] == "lw-layerwise-operator-metrics")
            .with_context(|| format!("{what}: no operator metrics Service"))?;
        ensure!(
            svc["spec"]["ports"][0]["targetPort"] == "metrics",
            "{what}: {svc}"
        );
    }
    ensure!(
        monitored_sets >= 3,
        "only {monitored_sets} value sets turn monitoring on"
    );
    Ok(())
}
