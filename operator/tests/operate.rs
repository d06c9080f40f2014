//! An operator a platform team can operate, against the real control plane: leader election
//! hands the work to a standby when the leader's lease lapses (and at once when it shuts
//! down); Node and DiffusionNode changes reach the deployments they concern through the
//! stores' watches, with no list per reconcile; `/metrics` and the probes answer; and an
//! engine pod whose load cannot be read holds the replicas and is reported.

mod world;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context as _, Result};
use crds::{DiffusionDeployment, DiffusionNode, ModelRequest};
use futures::future::BoxFuture;
use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod, Service};
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, ResourceExt};
use layerwise_e2e::cluster::wait_until;
use layerwise_operator::autoscaler::{LoadSource, PodLoad};
use layerwise_operator::requests::{Change, Requests};
use layerwise_operator::Telemetry;
use serde_json::json;
use world::{
    condition, deployment_manifest, event_reasons, profile, running_pods, status_of, Fixed,
    Operator, Setup, World, WAIT,
};

/// ~25 GiB: resident on any of the fleet's GPUs.
fn small() -> crds::Profile {
    profile(57, 400 << 20)
}

fn idle() -> Arc<Fixed> {
    Arc::new(Fixed(AtomicU64::new(0)))
}

async fn lease(w: &World) -> Result<k8s_openapi::api::coordination::v1::LeaseSpec> {
    let leases: Api<Lease> = Api::namespaced(w.client.clone(), &w.ns);
    Ok(leases
        .get("layerwise-operator")
        .await?
        .spec
        .unwrap_or_default())
}

async fn replicas_of(w: &World, name: &str) -> Result<Option<i32>> {
    let deploys: Api<Deployment> = Api::namespaced(w.client.clone(), &w.ns);
    Ok(deploys.get_opt(name).await?.and_then(|d| d.spec?.replicas))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_takes_over_when_the_leaders_lease_lapses() -> Result<()> {
    let w = World::bare("leader", small()).await?;
    let mut ops = Vec::new();
    let result = takeover(&w, &mut ops).await;
    let torn = w.teardown_with(ops).await;
    result.and(torn)
}

async fn takeover(w: &World, ops: &mut Vec<Operator>) -> Result<()> {
    let setup = |id: &str| Setup {
        election: Some(w.election(id)),
        ..Setup::default()
    };
    ops.push(w.operator(idle(), setup("replica-a")).await?);
    wait_until("replica-a leads", WAIT, || async {
        Ok(if ops[0].leads() {
            Ok(())
        } else {
            Err("standing by".into())
        })
    })
    .await?;
    ops.push(w.operator(idle(), setup("replica-b")).await?);
    let (a, b) = (0, 1);

    // The leader plans a deployment; the standby does nothing, not even watch.
    let api: Api<DiffusionDeployment> = Api::namespaced(w.client.clone(), &w.ns);
    let selector = json!({ "accelerator": { "nodeSelector": { "node.kubernetes.io/instance-type": "a100" } }, "replicas": 1 });
    api.create(
        &PostParams::default(),
        &serde_json::from_value(deployment_manifest("small", selector))?,
    )
    .await?;
    wait_until("planned by the leader", WAIT, || async {
        let s = status_of(&api, "small").await?;
        Ok(match (&s.plan, replicas_of(w, "small").await?) {
            (Some(_), Some(1)) => Ok(()),
            (plan, r) => Err(format!("plan {:?}, replicas {r:?}", plan.is_some())),
        })
    })
    .await?;
    // Two lease periods: the standby stays one.
    tokio::time::sleep(Duration::from_secs(8)).await;
    let standby = &ops[b].telemetry;
    ensure!(!ops[b].leads() && ops[a].leads(), "leadership moved");
    ensure!(ops[a].reconciles() > 0, "the leader did not reconcile");
    ensure!(
        ops[b].reconciles() == 0,
        "the standby reconciled {} times",
        ops[b].reconciles()
    );
    for verb in ["list", "watch"] {
        ensure!(
            standby
                .metrics
                .api_requests_of(verb, "diffusiondeployments")
                == 0,
            "the standby sent {verb} requests for DiffusionDeployments"
        );
    }
    let held = lease(w).await?;
    ensure!(
        held.holder_identity.as_deref() == Some("replica-a"),
        "{held:?}"
    );
    let transitions = held.lease_transitions.unwrap_or(0);

    // The leader crashes (no release): the standby takes over once the lease lapses, not
    // before.
    ops[a].task.abort();
    let crashed = Instant::now();
    let last_renewal = lease(w).await?.renew_time.context("no renewTime")?.0;
    wait_until("replica-b leads", WAIT, || async {
        Ok(if ops[b].leads() {
            Ok(())
        } else {
            Err("standing by".into())
        })
    })
    .await?;
    let took = crashed.elapsed();
    let now = lease(w).await?;
    ensure!(
        now.holder_identity.as_deref() == Some("replica-b"),
        "{now:?}"
    );
    ensure!(
        now.lease_transitions.unwrap_or(0) > transitions,
        "transitions {:?} after {transitions}",
        now.lease_transitions
    );
    let acquired = now.acquire_time.context("no acquireTime")?.0;
    let lapsed = last_renewal + Duration::from_secs(w.election("x").lease_seconds);
    ensure!(
        acquired >= lapsed,
        "replica-b acquired the lease at {acquired}, before it lapsed at {lapsed}"
    );
    eprintln!("replica-b took over {took:?} after replica-a crashed");

    // The new leader reconciles: a spec change reaches the Deployment.
    api.patch(
        "small",
        &PatchParams::default(),
        &Patch::Merge(json!({ "spec": { "replicas": 2 } })),
    )
    .await?;
    wait_until("the new leader applies the change", WAIT, || async {
        let r = replicas_of(w, "small").await?;
        Ok(if r == Some(2) {
            Ok(())
        } else {
            Err(format!("replicas {r:?}"))
        })
    })
    .await?;
    // Counted when a reconcile ends, which is after it applied the Deployment.
    wait_until("the new leader's reconcile ends", WAIT, || async {
        Ok(if ops[b].reconciles() > 0 {
            Ok(())
        } else {
            Err("no reconcile counted".into())
        })
    })
    .await?;

    // A leader that shuts down hands the lease over at once.
    ops[b].shut_down();
    let stopped = Instant::now();
    tokio::time::timeout(WAIT, &mut ops[b].task)
        .await
        .context("replica-b did not stop")???;
    let released = lease(w).await?;
    ensure!(released.holder_identity.is_none(), "{released:?}");
    ops.push(w.operator(idle(), setup("replica-c")).await?);
    let c = ops.len() - 1;
    wait_until("replica-c leads", WAIT, || async {
        Ok(if ops[c].leads() {
            Ok(())
        } else {
            Err("standing by".into())
        })
    })
    .await?;
    let handover = stopped.elapsed();
    eprintln!("replica-c led {handover:?} after replica-b shut down");
    ensure!(
        handover < Duration::from_secs(w.election("x").lease_seconds),
        "the handover took {handover:?}: the lease was not released"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_changes_reach_deployments_through_the_stores_without_lists() -> Result<()> {
    let w = World::bare("stores", small()).await?;
    let op = w.operator(idle(), Setup::default()).await?;
    // A label of this test's own on a fleet node, removed whatever happens.
    let label = format!("e2e.layerwise.dev/pool-{}", &w.ns[w.ns.len() - 8..]);
    let result = stores(&w, &op, &label).await;
    let nodes: Api<Node> = Api::all(w.client.clone());
    let unlabel = nodes
        .patch(
            "a100-1",
            &PatchParams::default(),
            &Patch::Merge(json!({ "metadata": { "labels": { label.as_str(): null } } })),
        )
        .await;
    let torn = w.teardown_with(vec![op]).await;
    result
        .and(unlabel.map(|_| ()).map_err(anyhow::Error::from))
        .and(torn)
}

async fn stores(w: &World, op: &Operator, label: &str) -> Result<()> {
    let api: Api<DiffusionDeployment> = Api::namespaced(w.client.clone(), &w.ns);
    let selector = json!({ "accelerator": { "nodeSelector": { label: "yes" } }, "replicas": 1 });
    api.create(
        &PostParams::default(),
        &serde_json::from_value(deployment_manifest("pooled", selector))?,
    )
    .await?;
    wait_until("no candidate nodes yet", WAIT, || async {
        let s = status_of(&api, "pooled").await?;
        Ok(match condition(&s, "ModelProfiled") {
            Some((st, reason, _)) if st == "False" && reason == "NoCandidateNodes" => Ok(()),
            other => Err(format!("ModelProfiled {other:?}")),
        })
    })
    .await?;

    // A node joins the pool: the Node watch brings the deployment back well before its
    // 30 s retry, and it plans on that node.
    let nodes: Api<Node> = Api::all(w.client.clone());
    nodes
        .patch(
            "a100-1",
            &PatchParams::default(),
            &Patch::Merge(json!({ "metadata": { "labels": { label: "yes" } } })),
        )
        .await?;
    let labelled = Instant::now();
    let plan = wait_until("planned on the labelled node", WAIT, || async {
        let s = status_of(&api, "pooled").await?;
        Ok(match s.plan {
            Some(p) => Ok(p),
            None => Err(format!(
                "ModelProfiled {:?}",
                condition(&s, "ModelProfiled")
            )),
        })
    })
    .await?;
    let took = labelled.elapsed();
    eprintln!("planned {took:?} after the node was labelled");
    ensure!(plan.nodes == ["a100-1"], "{:?}", plan.nodes);
    ensure!(
        took < Duration::from_secs(20),
        "planned only after {took:?}: the retry, not the Node watch"
    );

    // Reconciles go on every second; the fleet is listed once, when the stores start.
    let metrics = &op.telemetry.metrics;
    let before = op.reconciles();
    tokio::time::sleep(Duration::from_secs(5)).await;
    ensure!(
        op.reconciles() >= before + 3,
        "{} reconciles in 5 s",
        op.reconciles() - before
    );
    for resource in ["nodes", "diffusionnodes"] {
        ensure!(
            metrics.api_requests_of("list", resource) == 1,
            "{} lists of {resource} over {} reconciles",
            metrics.api_requests_of("list", resource),
            op.reconciles()
        );
    }
    // A steady reconcile reads the engine Deployment and Service from the stores and sends
    // nothing: neither has changed since it applied them.
    // At least three reconciles, however slow the machine: each is a 1 s resync plus the
    // 1 s debounce and the reconcile itself, so 5 s held only two on a loaded machine.
    let steady = requests(&op.telemetry);
    let (r0, before) = (op.reconciles(), steady.values().sum::<u64>());
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(5)).await;
    while op.reconciles() < r0 + 3 && started.elapsed() < Duration::from_secs(20) {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let now = requests(&op.telemetry);
    let (r1, after) = (op.reconciles(), now.values().sum::<u64>());
    let sent: BTreeMap<&String, u64> = now
        .iter()
        .map(|(k, v)| (k, v - steady.get(k).copied().unwrap_or(0)))
        .filter(|(_, d)| *d > 0)
        .collect();
    let per = (after - before) as f64 / (r1 - r0).max(1) as f64;
    eprintln!(
        "{:.2} API requests per steady reconcile over {} reconciles: {sent:?}",
        per,
        r1 - r0
    );
    ensure!(
        r1 - r0 >= 3 && per <= 0.5,
        "{per:.2} requests per steady reconcile over {} reconciles: {sent:?}",
        r1 - r0
    );

    // What the operator made and someone else changed is made right again: a replica count
    // set by hand, and a Service deleted.
    let deployments: Api<Deployment> = Api::namespaced(w.client.clone(), &w.ns);
    let services: Api<Service> = Api::namespaced(w.client.clone(), &w.ns);
    let want = deployments
        .get("pooled")
        .await?
        .spec
        .and_then(|s| s.replicas);
    deployments
        .patch(
            "pooled",
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "replicas": 7 } })),
        )
        .await?;
    services.delete("pooled", &Default::default()).await?;
    wait_until(
        "the engine Deployment and Service made right",
        WAIT,
        || async {
            let replicas = deployments
                .get("pooled")
                .await?
                .spec
                .and_then(|s| s.replicas);
            let service = services.get_opt("pooled").await?;
            Ok(if replicas == want && service.is_some() {
                Ok(())
            } else {
                Err(format!(
                    "replicas {replicas:?} (want {want:?}), Service {}",
                    service.is_some()
                ))
            })
        },
    )
    .await?;

    // What /metrics and the probes say, over HTTP as a scraper sees them.
    let (addr, server) = serve(op.telemetry.clone()).await?;
    let text = get(addr, "/metrics").await?;
    for want in [
        "layerwise_operator_reconciles_total",
        "layerwise_operator_reconcile_duration_seconds_bucket",
        "layerwise_operator_reconcile_stops_total{reason=\"NoCandidateNodes\"}",
        &format!(
            "layerwise_operator_plans_total{{strategy=\"{}\"}}",
            plan.strategy.as_str()
        ),
        "layerwise_operator_leader 1",
        "layerwise_operator_api_requests_total{verb=\"list\",resource=\"nodes\"} 1",
    ] {
        ensure!(text.contains(want), "no `{want}` in /metrics:\n{text}");
    }
    ensure!(get(addr, "/healthz").await? == "ok\n");
    ensure!(get(addr, "/readyz").await? == "leading\n");
    server.abort();
    Ok(())
}

/// Requests so far by "verb resource".
fn requests(t: &Telemetry) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for line in t.metrics.encode().lines() {
        let Some(rest) = line.strip_prefix("layerwise_operator_api_requests_total{") else {
            continue;
        };
        if let Some((labels, n)) = rest.rsplit_once("} ") {
            out.insert(labels.to_string(), n.trim().parse().unwrap_or(0));
        }
    }
    out
}

/// Serves the operator's endpoints on a loopback port, as `main` does.
async fn serve(
    telemetry: Arc<Telemetry>,
) -> Result<(std::net::SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let limits = layerwise_engine::http::HttpLimits {
        header_timeout: Duration::from_secs(5),
        max_connections: 4,
        drain: Duration::from_secs(1),
    };
    let server = tokio::spawn(layerwise_engine::http::serve(
        listener,
        layerwise_operator::http::app(telemetry),
        limits,
        futures::future::pending(),
    ));
    Ok((addr, server))
}

/// GET `path`: the body of a 200, an error otherwise.
async fn get(addr: std::net::SocketAddr, path: &str) -> Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).await?;
    let text = String::from_utf8_lossy(&out);
    let (head, body) = text.split_once("\r\n\r\n").context("no HTTP response")?;
    ensure!(
        head.starts_with("HTTP/1.1 200") || head.starts_with("HTTP/1.0 200"),
        "{path}: {head}"
    );
    Ok(body.to_string())
}

/// One pod's load cannot be read; the others report `queued` each.
struct Flaky {
    queued: AtomicU64,
    failing: Mutex<Option<String>>,
}

impl LoadSource for Flaky {
    fn load<'a>(&'a self, pod: &'a Pod) -> BoxFuture<'a, Result<PodLoad, String>> {
        let fails = self.failing.lock().unwrap().as_deref() == Some(&pod.name_any());
        let queued = self.queued.load(Ordering::SeqCst);
        Box::pin(async move {
            if fails {
                Err("connecting to its /metrics: connection refused (test)".into())
            } else {
                Ok(PodLoad { queued, running: 0 })
            }
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_whose_load_cannot_be_read_holds_the_replicas() -> Result<()> {
    let w = World::bare("scrape", small()).await?;
    let load = Arc::new(Flaky {
        queued: AtomicU64::new(0),
        failing: Mutex::new(None),
    });
    let op = w.operator(load.clone(), Setup::default()).await?;
    let result = unreadable(&w, &op, &load).await;
    let torn = w.teardown_with(vec![op]).await;
    result.and(torn)
}

async fn unreadable(w: &World, op: &Operator, load: &Flaky) -> Result<()> {
    let api: Api<DiffusionDeployment> = Api::namespaced(w.client.clone(), &w.ns);
    let auto = json!({
        "autoscaling": { "minReplicas": 1, "maxReplicas": 3, "targetQueuePerReplica": 2, "scaleDownDelaySeconds": 2 },
        "accelerator": { "nodeSelector": { "node.kubernetes.io/instance-type": "a100" } },
    });
    api.create(
        &PostParams::default(),
        &serde_json::from_value(deployment_manifest("flaky", auto))?,
    )
    .await?;
    let replicas = |want: i32| {
        move || async move {
            let r = replicas_of(w, "flaky").await?;
            let pods = running_pods(&w.client, &w.ns, "flaky").await?.len();
            Ok(if r == Some(want) && pods == want as usize {
                Ok(())
            } else {
                Err(format!("replicas {r:?}, {pods} running"))
            })
        }
    };
    wait_until("1 replica running", WAIT, replicas(1)).await?;
    // 5 queued per pod: three replicas.
    load.queued.store(5, Ordering::SeqCst);
    wait_until("3 replicas running", WAIT, replicas(3)).await?;

    // The load drops, and one pod stops answering: with its load unknown nothing is
    // removed, however long past the 2 s delay, and the condition names the pod.
    let pods = running_pods(&w.client, &w.ns, "flaky").await?;
    let silent = pods[0].0.clone();
    *load.failing.lock().unwrap() = Some(silent.clone());
    load.queued.store(0, Ordering::SeqCst);
    let failed = wait_until("ScrapeFailed reported", WAIT, || async {
        let s = status_of(&api, "flaky").await?;
        Ok(match condition(&s, "ScrapeFailed") {
            Some((st, _, msg)) if st == "True" => Ok(msg),
            other => Err(format!("ScrapeFailed {other:?}")),
        })
    })
    .await?;
    ensure!(
        failed.contains(&silent) && failed.contains("load of 1 of "),
        "{failed}"
    );
    for _ in 0..8 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let r = replicas_of(w, "flaky").await?;
        ensure!(r == Some(3), "scaled to {r:?} with a pod's load unknown");
    }
    let counted = op.telemetry.metrics.encode();
    let series = format!(
        "layerwise_operator_autoscaler_scrape_failures_total{{deployment=\"{}/flaky\"}}",
        w.ns
    );
    ensure!(counted.contains(&series), "no {series} in\n{counted}");
    ensure!(
        event_reasons(&w.client, &w.ns)
            .await?
            .iter()
            .any(|r| r == "ScrapeFailed"),
        "no ScrapeFailed event"
    );

    // It answers again: the condition clears and the idle replicas go after the delay.
    *load.failing.lock().unwrap() = None;
    wait_until("scaled down to 1", WAIT, replicas(1)).await?;
    let s = status_of(&api, "flaky").await?;
    ensure!(
        condition(&s, "ScrapeFailed").map(|c| (c.0, c.1))
            == Some(("False".into(), "AllPodsReported".into())),
        "{:?}",
        condition(&s, "ScrapeFailed")
    );
    Ok(())
}

/// Many deployments asking one node at once: their changes go out in a few writes, not one
/// each, beside the agent's status writes; another writer's entries are kept, and its
/// changes that move the entries under this process fail its stale patch, which is
/// computed again from a fresh read instead of removing the wrong entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepare_requests_to_one_node_go_out_together_and_keep_other_writers_entries() -> Result<()>
{
    let w = World::bare("requests", small()).await?;
    let node = format!("{}-node", w.ns);
    let result = one_node(&w, &node).await;
    let dns: Api<DiffusionNode> = Api::all(w.client.clone());
    let deleted = dns
        .delete(&node, &Default::default())
        .await
        .map(|_| ())
        .map_err(anyhow::Error::from);
    let torn = w.teardown().await;
    result.and(deleted).and(torn)
}

async fn one_node(w: &World, node: &str) -> Result<()> {
    let dns: Api<DiffusionNode> = Api::all(w.client.clone());
    let request = |id: &str, path: &str| ModelRequest {
        id: id.into(),
        family: "dit".into(),
        location: crds::ModelLocation {
            host_path: Some(path.into()),
            ..Default::default()
        },
    };
    // Another writer's JSON patch (an operator serving other namespaces, or a person).
    let other = |ops: serde_json::Value| {
        let dns = dns.clone();
        async move {
            let patch: json_patch::Patch = serde_json::from_value(ops)?;
            dns.patch(node, &PatchParams::default(), &Patch::Json::<()>(patch))
                .await?;
            anyhow::Ok(())
        }
    };
    let created = json!({ "apiVersion": "layerwise.dev/v1alpha1", "kind": "DiffusionNode",
                          "metadata": { "name": node }, "spec": { "models": [] } });
    dns.patch(
        node,
        &PatchParams::apply("e2e-agent"),
        &Patch::Apply(&created),
    )
    .await?;
    other(json!([{ "op": "add", "path": "/spec/models/-", "value": request("other/x", "/m/x") }]))
        .await?;

    // The leader's store of this one DiffusionNode.
    let (store, writer) = reflector::store::<DiffusionNode>();
    let watch = watcher(
        dns.clone(),
        watcher::Config::default().fields(&format!("metadata.name={node}")),
    )
    .default_backoff()
    .reflect(writer)
    .applied_objects()
    .for_each(|_| async {});
    let watch = tokio::spawn(watch);
    let seen = |models: usize| {
        let store = store.clone();
        async move {
            wait_until("the store sees the node", WAIT, || async {
                let n = store
                    .get(&ObjectRef::new(node))
                    .map_or(0, |d| d.spec.models.len());
                Ok(if n == models {
                    Ok(())
                } else {
                    Err(format!("{n} requests"))
                })
            })
            .await
        }
    };
    seen(1).await?;
    let generation = |dn: &DiffusionNode| dn.metadata.generation.unwrap_or(0);
    let g0 = generation(&dns.get(node).await?);

    // The agent reports all along, as it does while it profiles.
    let reporting = {
        let dns = dns.clone();
        let node = node.to_string();
        tokio::spawn(async move {
            for i in 0..40u64 {
                let status = json!({ "apiVersion": "layerwise.dev/v1alpha1", "kind": "DiffusionNode",
                                     "status": { "hostMemoryBytes": (i + 1) << 30 } });
                let _ = dns
                    .patch_status(
                        &node,
                        &PatchParams::apply("e2e-agent").force(),
                        &Patch::Apply(&status),
                    )
                    .await;
            }
        })
    };
    let requests = Requests::new(w.client.clone(), store.clone(), "layerwise-operator");
    let ids: Vec<String> = (0..30).map(|i| format!("{}/d{i}", w.ns)).collect();
    futures::future::try_join_all(
        ids.iter()
            .map(|id| requests.change(node, Change::Ask(request(id, &format!("/m/{id}"))))),
    )
    .await?;
    reporting.await?;
    let dn = dns.get(node).await?;
    let writes = generation(&dn) - g0;
    eprintln!("30 asks in {writes} writes");
    ensure!(
        dn.spec.models.len() == 31 && dn.spec.models[0].id == "other/x",
        "{:?}",
        dn.spec.models.iter().map(|m| &m.id).collect::<Vec<_>>()
    );
    ensure!(writes <= 4, "30 asks to one node took {writes} writes");
    for id in &ids {
        let stored = seen(31).await.map(|_| store.get(&ObjectRef::new(node)));
        let stored = stored?.context("the node left the store")?;
        ensure!(
            requests.asked(&stored, id) == Some(request(id, &format!("/m/{id}"))),
            "{id} is not asked"
        );
    }

    // The other writer removes its entry, which moves every index this process knows. A
    // writer whose store still shows the node as it was (a snapshot taken before) computes
    // a patch whose tests fail, and computes it again from a fresh read.
    let (behind, mut snapshot) = reflector::store::<DiffusionNode>();
    snapshot.apply_watcher_event(&watcher::Event::Apply(dns.get(node).await?));
    other(
        json!([{ "op": "test", "path": "/spec/models/0/id", "value": "other/x" },
                 { "op": "remove", "path": "/spec/models/0" }]),
    )
    .await?;
    let requests = Requests::new(w.client.clone(), behind, "layerwise-operator");
    let (d3, d5, d17) = (&ids[3], &ids[5], &ids[17]);
    futures::future::try_join_all([
        requests.change(node, Change::Withdraw(d5.clone())),
        requests.change(node, Change::Withdraw(d17.clone())),
        requests.change(node, Change::Ask(request(d3, "/m/moved"))),
    ])
    .await?;
    let models = dns.get(node).await?.spec.models;
    let names: Vec<&str> = models.iter().map(|m| m.id.as_str()).collect();
    ensure!(
        models.len() == 28
            && !names.contains(&"other/x")
            && !names.contains(&d5.as_str())
            && !names.contains(&d17.as_str())
            && models.iter().any(|m| m == &request(d3, "/m/moved")),
        "{names:?}"
    );

    // Its appends move no index: a withdraw right after one goes through and keeps it.
    other(json!([{ "op": "add", "path": "/spec/models/-", "value": request("other/y", "/m/y") }]))
        .await?;
    requests
        .change(node, Change::Withdraw(ids[0].clone()))
        .await?;
    let names: Vec<String> = dns
        .get(node)
        .await?
        .spec
        .models
        .into_iter()
        .map(|m| m.id)
        .collect();
    ensure!(
        names.len() == 28 && names.contains(&"other/y".to_string()) && !names.contains(&ids[0]),
        "{names:?}"
    );
    watch.abort();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_plan_is_recorded_before_its_engine_objects_are_applied() -> Result<()> {
    let w = World::bare("record", small()).await?;
    let op = w.operator(idle(), Setup::default()).await?;
    let result = recorded_first(&w).await;
    let torn = w.teardown_with(vec![op]).await;
    result.and(torn)
}

/// The first resource version at which `api` shows an object named `name` that `done`
/// accepts. The test cluster has one etcd, whose revisions order writes across kinds.
fn first_version<K>(
    api: Api<K>,
    name: &'static str,
    done: fn(&K) -> bool,
) -> tokio::task::JoinHandle<Result<u64>>
where
    K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + 'static,
{
    tokio::spawn(async move {
        let events = watcher(
            api,
            watcher::Config::default().fields(&format!("metadata.name={name}")),
        )
        .applied_objects();
        let mut events = std::pin::pin!(events);
        let found = tokio::time::timeout(WAIT, async {
            while let Some(obj) = events.next().await {
                let obj = obj?;
                if done(&obj) {
                    return Ok(obj.resource_version().unwrap_or_default());
                }
            }
            anyhow::bail!("the watch of {name} ended")
        })
        .await
        .with_context(|| format!("{name} not seen within {WAIT:?}"))??;
        found
            .parse::<u64>()
            .with_context(|| format!("resource version {found:?}"))
    })
}

/// A deployment's first plan reaches its status before its engine Deployment and Service
/// exist: applying them can wait on the control plane (a new Service waits its turn for a
/// ClusterIP), and the plan does not wait with them.
async fn recorded_first(w: &World) -> Result<()> {
    const NAME: &str = "recorded";
    let dds: Api<DiffusionDeployment> = Api::namespaced(w.client.clone(), &w.ns);
    let planned = first_version(dds.clone(), NAME, |dd: &DiffusionDeployment| {
        dd.status.as_ref().is_some_and(|s| s.plan.is_some())
    });
    let deployment = first_version(
        Api::<Deployment>::namespaced(w.client.clone(), &w.ns),
        NAME,
        |_| true,
    );
    let service = first_version(
        Api::<Service>::namespaced(w.client.clone(), &w.ns),
        NAME,
        |_| true,
    );
    // The watches start before the deployment exists.
    tokio::time::sleep(Duration::from_secs(1)).await;
    dds.create(
        &PostParams::default(),
        &serde_json::from_value(deployment_manifest(NAME, json!({ "replicas": 1 })))?,
    )
    .await?;
    let (planned, deployment, service) = (planned.await??, deployment.await??, service.await??);
    eprintln!(
        "plan written at {planned}, Deployment created at {deployment}, Service at {service}"
    );
    ensure!(
        planned < deployment && planned < service,
        "the plan was written at revision {planned}, after the Deployment ({deployment}) or the Service ({service})"
    );
    Ok(())
}
