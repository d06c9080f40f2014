//! What the operator's tests against the real control plane share (tests/cluster): a
//! [`World`] per test (its own namespace, the chart installed without CRDs, a fake agent
//! answering prepare requests as the node agents would) and controllers run in-process as
//! the chart's operator service account ([`World::operator`]), with kwok playing the GPU
//! nodes' kubelets. All traffic goes to the loopback apiserver.

// Each test binary uses its own part of these helpers.
#![allow(dead_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use crds::{DiffusionDeployment, DiffusionNode, ModelRequest, Profile};
use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::{Event as CoreEvent, Pod};
use kube::api::{ListParams, Patch, PatchParams};
use kube::config::KubeConfigOptions;
use kube::{Api, Client, Config, ResourceExt};
use layerwise_e2e::cluster;
use layerwise_e2e::tools::{self, impersonating_kubeconfig, install_crds, ok, repo, tool};
use layerwise_operator::autoscaler::{LoadSource, PodLoad};
use layerwise_operator::planner::Limits;
use layerwise_operator::resources::EnginePods;
use layerwise_operator::{client, run, Election, Settings, Telemetry};
use serde_json::json;
use tokio::task::JoinHandle;

pub const WAIT: Duration = Duration::from_secs(90);
pub const GIB: u64 = 1 << 30;

/// One test's world: a namespace, the chart (without CRDs) installed as release `release`,
/// and a fake agent for the namespace's models.
pub struct World {
    pub client: Client,
    pub ns: String,
    pub release: String,
    agent: JoinHandle<()>,
    operators: Vec<Operator>,
    /// Nodes a test added to the fleet, which the fake agent reports as it does the
    /// shapes file's.
    pub extra_shapes: ExtraShapes,
    /// Rounds the fake agent has finished over the fleet: a round that started after a
    /// change to `extra_shapes` has ended once this has grown by two.
    pub agent_rounds: Arc<AtomicU64>,
}

/// Node shapes beside the shapes file's, shared with the fake agent.
pub type ExtraShapes = Arc<std::sync::Mutex<Vec<layerwise_e2e::shapes::Shape>>>;

/// A controller run in-process: its task, what it reports, and a way to stop it (dropping
/// it shuts the controller down).
pub struct Operator {
    pub task: JoinHandle<Result<(), layerwise_operator::Error>>,
    pub telemetry: Arc<Telemetry>,
    pub identity: Option<String>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Operator {
    /// Asks it to shut down as on SIGTERM (finish reconciles, release the lease).
    pub fn shut_down(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }

    pub fn leads(&self) -> bool {
        self.telemetry.health.is_leader()
    }

    pub fn reconciles(&self) -> u64 {
        self.telemetry.metrics.reconciles.get()
    }
}

/// What a test changes of the operator's settings.
pub struct Setup {
    pub resync: Duration,
    pub election: Option<Election>,
    /// What every engine pod gets from the platform (the chart's values).
    pub engine_pods: EnginePods,
    /// The operator's default engine image (the chart's, which follows its version).
    pub engine_image: String,
    /// The fewest nodes a deployment asks to prepare its model.
    pub prepare_nodes: usize,
}

impl Default for Setup {
    fn default() -> Self {
        Setup {
            resync: Duration::from_secs(1),
            election: None,
            engine_pods: EnginePods::default(),
            engine_image: "layerwise:test".into(),
            prepare_nodes: 8,
        }
    }
}

impl World {
    /// The namespace, the chart and the fake agent answering with `profile`; no controller.
    pub async fn bare(test: &str, profile: Profile) -> Result<World> {
        World::answering(test, Arc::new(move |_: &ModelRequest| Ok(profile.clone()))).await
    }

    /// The namespace, the chart and the fake agent answering each prepare request with
    /// `answer`'s profile (or failing it with its message); no controller.
    pub async fn answering(test: &str, answer: Answer) -> Result<World> {
        World::installed(test, answer, &[]).await
    }

    /// [`World::answering`], with the chart installed with `values` (helm's `--set`,
    /// `--set-json` and so on) besides.
    pub async fn installed(test: &str, answer: Answer, values: &[&str]) -> Result<World> {
        let client = cluster::client().await?;
        install_crds(&client, WAIT).await?;
        let ns = cluster::create_namespace(&client, test).await?;
        let release = format!("lw-{}", &ns[ns.len() - 8..]);
        let chart = repo().join("charts/layerwise");
        let watch = format!("operator.watchNamespace={ns}");
        let mut args = vec![
            "install",
            &release,
            chart.to_str().unwrap(),
            "--namespace",
            &ns,
            "--skip-crds",
            "--set",
            &watch,
        ];
        args.extend(values);
        if let Err(e) = tool("helm", &args, None).and_then(|out| ok(out, "helm install")) {
            // A release that did not install leaves nothing but the namespace.
            return Err(tools::finish_teardown(&client, &ns, vec![e])
                .await
                .unwrap_err());
        }
        let extra_shapes = ExtraShapes::default();
        let agent_rounds = Arc::new(AtomicU64::new(0));
        let agent = tokio::spawn(fake_agent(
            client.clone(),
            ns.clone(),
            answer,
            extra_shapes.clone(),
            agent_rounds.clone(),
        ));
        Ok(World {
            client,
            ns,
            release,
            agent,
            operators: Vec::new(),
            extra_shapes,
            agent_rounds,
        })
    }

    /// A world with one controller (no leader election) reading load from `load`.
    pub async fn new(test: &str, load: Arc<dyn LoadSource>, profile: Profile) -> Result<World> {
        let mut w = World::bare(test, profile).await?;
        let op = w.operator(load, Setup::default()).await?;
        w.operators.push(op);
        Ok(w)
    }

    /// The chart's operator service account.
    pub fn service_account(&self) -> String {
        format!(
            "system:serviceaccount:{}:{}-layerwise-operator",
            self.ns, self.release
        )
    }

    /// Starts a controller here, with exactly the chart's RBAC and requests counted into its
    /// own telemetry.
    pub async fn operator(&self, load: Arc<dyn LoadSource>, setup: Setup) -> Result<Operator> {
        let telemetry = Arc::new(Telemetry::default());
        let kubeconfig = impersonating_kubeconfig(&self.service_account())?;
        let config =
            Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
        let client = client::counted(config, telemetry.clone())?;
        let identity = setup.election.as_ref().map(|e| e.identity.clone());
        let settings = Settings {
            engine_image: setup.engine_image,
            engine_pods: setup.engine_pods,
            limits: Limits::default(),
            resync: setup.resync,
            namespace: Some(self.ns.clone()),
            model_roots: vec!["/models".into()],
            prepare_nodes: setup.prepare_nodes,
            election: setup.election,
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let shutdown = async move {
            let _ = stopped.await;
        };
        let task = tokio::spawn(run(client, settings, load, telemetry.clone(), shutdown));
        Ok(Operator {
            task,
            telemetry,
            identity,
            stop: Some(stop),
        })
    }

    /// Leader election on a Lease of this namespace, short enough for a test.
    pub fn election(&self, identity: &str) -> Election {
        Election {
            lease: "layerwise-operator".into(),
            namespace: self.ns.clone(),
            identity: identity.into(),
            lease_seconds: 4,
            grace_seconds: 2,
        }
    }

    /// Removes everything the test made, best effort: every step runs and the first error
    /// is returned.
    pub async fn teardown(self) -> Result<()> {
        self.teardown_with(Vec::new()).await
    }

    /// [`World::teardown`], with the controllers the test started itself: they run until the
    /// deployments are gone (a leader among them removes the finalizers), then stop.
    pub async fn teardown_with(self, ops: Vec<Operator>) -> Result<()> {
        let mut errors: Vec<anyhow::Error> = Vec::new();
        tools::delete_diffusion_deployments(&self.client, &self.ns, WAIT, &mut errors).await;
        for op in self.operators.iter().chain(&ops) {
            op.task.abort();
        }
        self.agent.abort();
        // Drop what the fake agent reported for this namespace's models.
        let dns: Api<DiffusionNode> = Api::all(self.client.clone());
        for dn in dns
            .list(&ListParams::default())
            .await
            .map(|l| l.items)
            .unwrap_or_default()
        {
            let patch = json!({ "apiVersion": "layerwise.dev/v1alpha1", "kind": "DiffusionNode", "metadata": { "name": dn.name_any() } });
            // A DiffusionNode gone since the list (its Node removed) has nothing to clear.
            match dns
                .patch_status(
                    &dn.name_any(),
                    &PatchParams::apply(&agent_manager(&self.ns)).force(),
                    &Patch::Apply(&patch),
                )
                .await
            {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => errors.push(anyhow::Error::from(e).context(format!(
                    "clearing the fake agent's status on {}",
                    dn.name_any()
                ))),
            }
        }
        if let Err(e) = tools::helm_uninstall(&self.release, &self.ns) {
            errors.push(e);
        }
        tools::finish_teardown(&self.client, &self.ns, errors).await
    }
}

pub fn agent_manager(ns: &str) -> String {
    format!("e2e-agent-{ns}")
}

pub fn parse_memory(q: &str) -> u64 {
    let (num, unit) = q.split_at(q.find(|c: char| !c.is_ascii_digit()).unwrap_or(q.len()));
    let n: u64 = num.parse().unwrap_or(0);
    n * match unit {
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        _ => 1,
    }
}

/// How the fake agent answers a prepare request: the model's profile, or why it failed.
pub type Answer = Arc<dyn Fn(&ModelRequest) -> Result<Profile, String> + Send + Sync>;

/// Plays the node agent for this namespace's models: makes sure every fake node (the
/// shapes file's and `extra`'s) has a DiffusionNode reporting its shape, and answers each
/// prepare request from `ns` with `answer`'s profile, warm on the H200 node and warming
/// elsewhere.
pub async fn fake_agent(
    client: Client,
    ns: String,
    answer: Answer,
    extra: ExtraShapes,
    rounds: Arc<AtomicU64>,
) {
    let dns: Api<DiffusionNode> = Api::all(client.clone());
    let file = layerwise_e2e::shapes::load().expect("shapes file");
    loop {
        let mut shapes = file.clone();
        shapes.extend(extra.lock().expect("not poisoned").iter().cloned());
        for shape in &shapes {
            for node in shape.node_names() {
                let existing = match dns.get_opt(&node).await {
                    Ok(e) => e,
                    Err(_) => continue,
                };
                if existing.is_none() {
                    let obj = json!({ "apiVersion": "layerwise.dev/v1alpha1", "kind": "DiffusionNode", "metadata": { "name": node }, "spec": { "models": [] } });
                    let _ = dns
                        .patch(&node, &PatchParams::apply("e2e-agent"), &Patch::Apply(&obj))
                        .await;
                }
                let requested: Vec<ModelRequest> = existing
                    .map(|d| {
                        d.spec
                            .models
                            .into_iter()
                            .filter(|m| m.id.starts_with(&format!("{ns}/")))
                            .collect()
                    })
                    .unwrap_or_default();
                let models: Vec<serde_json::Value> = requested
                    .iter()
                    .map(|request| match answer(request) {
                        Ok(profile) => {
                            let warm = shape.prefix == "h200";
                            json!({
                                "id": request.id,
                                "state": if warm { "Warm" } else { "Warming" },
                                "residentBytes": if warm { profile.total_bytes } else { 0 },
                                "totalBytes": profile.total_bytes,
                                "profile": profile,
                            })
                        }
                        Err(error) => {
                            json!({ "id": request.id, "state": "Failed", "error": error })
                        }
                    })
                    .collect();
                let status = json!({
                    "accelerators": [{
                        "resourceName": shape.resource,
                        "product": shape.product,
                        "count": shape.devices,
                        "memoryBytes": shape.device_memory_mib << 20,
                        "fastPeerLink": true,
                    }],
                    "hostMemoryBytes": parse_memory(&shape.memory),
                    "models": models,
                });
                let patch = json!({ "apiVersion": "layerwise.dev/v1alpha1", "kind": "DiffusionNode", "metadata": { "name": node }, "status": status });
                let _ = dns
                    .patch_status(
                        &node,
                        &PatchParams::apply(&agent_manager(&ns)).force(),
                        &Patch::Apply(&patch),
                    )
                    .await;
            }
        }
        rounds.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// A checkpoint profile with `blocks` blocks of `block` bytes (bf16), 2 GiB outside them, an
/// SD-sized VAE and DiT-like activations.
pub fn profile(blocks: usize, block: u64) -> Profile {
    layerwise_e2e::fixtures::dit_profile(blocks, block, 2 * GIB, 320 << 20)
}

pub fn deployment_manifest(name: &str, extra: serde_json::Value) -> serde_json::Value {
    let mut dd = json!({
        "apiVersion": "layerwise.dev/v1alpha1",
        "kind": "DiffusionDeployment",
        "metadata": { "name": name },
        "spec": {
            "model": { "family": "dit", "location": { "hostPath": "/models/test-dit" } },
            "workload": { "maxWidth": 1024, "maxHeight": 1024, "maxSteps": 50, "guidance": true },
        }
    });
    merge(&mut dd["spec"], extra);
    dd
}

pub fn merge(a: &mut serde_json::Value, b: serde_json::Value) {
    match (a, b) {
        (serde_json::Value::Object(a), serde_json::Value::Object(b)) => {
            for (k, v) in b {
                merge(a.entry(k).or_insert(serde_json::Value::Null), v);
            }
        }
        (a, b) => *a = b,
    }
}

pub async fn status_of(
    api: &Api<DiffusionDeployment>,
    name: &str,
) -> Result<crds::DiffusionDeploymentStatus> {
    Ok(api.get(name).await?.status.unwrap_or_default())
}

pub fn condition(
    s: &crds::DiffusionDeploymentStatus,
    type_: &str,
) -> Option<(String, String, String)> {
    s.conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}

/// The deployment's engine pods that are not being deleted.
pub async fn engine_pods(client: &Client, ns: &str, name: &str) -> Result<Vec<Pod>> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let lp = ListParams::default().labels(&format!("app.kubernetes.io/instance={name}"));
    Ok(pods
        .list(&lp)
        .await?
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .collect())
}

/// Pods of the deployment that are Running, with their nodes.
pub async fn running_pods(client: &Client, ns: &str, name: &str) -> Result<Vec<(String, String)>> {
    Ok(engine_pods(client, ns, name)
        .await?
        .into_iter()
        .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
        .map(|p| {
            (
                p.name_any(),
                p.spec.and_then(|s| s.node_name).unwrap_or_default(),
            )
        })
        .collect())
}

pub async fn event_reasons(client: &Client, ns: &str) -> Result<Vec<String>> {
    let evs: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), ns);
    let mut reasons: Vec<String> = evs
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter_map(|e| e.reason)
        .collect();
    let core: Api<CoreEvent> = Api::namespaced(client.clone(), ns);
    reasons.extend(
        core.list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .filter_map(|e| e.reason),
    );
    Ok(reasons)
}

/// Every engine pod reports the same queue.
pub struct Fixed(pub AtomicU64);

impl LoadSource for Fixed {
    fn load<'a>(&'a self, _pod: &'a Pod) -> BoxFuture<'a, Result<PodLoad, String>> {
        let queued = self.0.load(Ordering::SeqCst);
        Box::pin(async move { Ok(PodLoad { queued, running: 0 }) })
    }
}
