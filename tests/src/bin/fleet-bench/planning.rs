//! The deployments and the time to plan them: created at once, waited for until every one
//! has a plan (and how many turn Available), with the time by stage, the slowest, the CPU
//! and the operator's memory.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use crds::DiffusionDeployment;
use futures::{StreamExt, TryStreamExt};
use kube::api::{ListParams, Patch, PatchParams};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client, ResourceExt};
use serde_json::json;

use super::agent::SharedStages;
use super::args::Args;
use super::common::{AGENT, NS, PARALLEL, WAIT};
use super::cpu::{control_plane_cpu, cpu_between, Cpu};
use super::fleet::SHAPES;
use super::operator::{Operator, Window};

/// All deployments at once, until planned: what the report takes of it.
pub(super) struct Planning {
    /// When each deployment got its plan, sorted.
    pub(super) planned: Vec<Duration>,
    /// How many turned Available, and when the last of them did.
    pub(super) available: usize,
    pub(super) last_available: Duration,
    /// The engine ReplicaSets made by then (see [`engine_replica_sets`]).
    pub(super) replica_sets: usize,
    /// The operator's CPU seconds while planning.
    pub(super) cpu_seconds: f64,
    pub(super) requests: Window,
    /// The operator's VmRSS and VmHWM once all were planned.
    pub(super) memory: (u64, u64),
}

impl Planning {
    /// Creates every deployment at once, waits until they are planned (see
    /// [`wait_planned`]) and prints how long that took, where the time went, and what the
    /// operator and the rest of the machine used meanwhile.
    pub(super) async fn measure(
        client: &Client,
        a: &Args,
        op: &Operator,
        stages: &SharedStages,
    ) -> Result<Planning> {
        let before = op.metrics().await?;
        let cpu0 = op.cpu_seconds()?;
        let cp0 = control_plane_cpu();
        let t0 = Instant::now();
        stages.lock().unwrap().t0 = Some(t0);
        // Watching before the first is created, so every deployment's first change is seen.
        let waiting = tokio::spawn({
            let client = client.clone();
            let count = a.deployments;
            async move { wait_planned(&client, count, t0).await }
        });
        create_deployments(client, a.deployments).await?;
        let plans = waiting.await??;
        let mut planned: Vec<Duration> = plans.by_name.values().copied().collect();
        planned.sort();
        let after = op.metrics().await?;
        let mem_planned = op.memory()?;
        let cpu_planning = op.cpu_seconds()? - cpu0;
        let wall_planning = t0.elapsed().as_secs_f64();
        // Until the last plan: what the rest of the machine did while the operator planned.
        let cp_planning = cpu_between(
            &cp0,
            &plans.cpu,
            planned.last().copied().unwrap_or_default().as_secs_f64(),
        );
        print_planned(a.deployments, &planned, &plans);
        print_slowest(&plans.slowest, stages);
        print_stages(stages, &plans.by_name);
        let replica_sets = engine_replica_sets(client).await?;
        println!(
            "rollouts: {replica_sets} engine ReplicaSets for {} deployments",
            a.deployments
        );
        let planning = Window::between(&before, &after);
        planning.print("while planning");
        print_planning_cpu(cpu_planning, wall_planning);
        println!("cpu until the last plan, the rest of the machine: {cp_planning}");
        print_memory(mem_planned);
        Ok(Planning {
            planned,
            available: plans.available,
            last_available: plans.last_available,
            replica_sets,
            cpu_seconds: cpu_planning,
            requests: planning,
            memory: mem_planned,
        })
    }
}

/// How long the `count` deployments took to plan (`planned`, sorted) and how many turned
/// Available.
pub(super) fn print_planned(count: usize, planned: &[Duration], plans: &Plans) {
    let available = plans.available;
    println!(
        "planned: all {} in {:.2} s (first {:.2} s, median {:.2} s, 90th percentile {:.2} s); {available} Available, the last after {:.2} s",
        count,
        planned.last().copied().unwrap_or_default().as_secs_f64(),
        planned.first().copied().unwrap_or_default().as_secs_f64(),
        planned[planned.len() / 2].as_secs_f64(),
        planned[planned.len() * 9 / 10].as_secs_f64(),
        plans.last_available.as_secs_f64()
    );
}

/// Where the tail's time went: what the slowest deployments waited on before their plan.
pub(super) fn print_slowest(slowest: &Slowest, stages: &SharedStages) {
    for (name, at, waited) in slowest {
        let (asked, reported) = {
            let st = stages.lock().unwrap();
            let id = format!("{NS}/{name}");
            let secs = |t: Option<&Duration>| {
                t.map_or("never".to_string(), |t| format!("{:.1} s", t.as_secs_f64()))
            };
            (secs(st.asked.get(&id)), secs(st.reported.get(&id)))
        };
        println!(
            "  slow: {name} planned after {:.2} s (first ask seen {asked}, first profile reported {reported}); waited on {}",
            at.as_secs_f64(),
            if waited.is_empty() {
                "nothing reported".to_string()
            } else {
                waited.join(", ")
            }
        );
    }
}

/// The engine ReplicaSets in the namespace. Each change of an engine Deployment's pod
/// template makes one (and replaces its pods): more than one per deployment means plans
/// were rolled while they settled.
pub(super) async fn engine_replica_sets(client: &Client) -> Result<usize> {
    Ok(
        Api::<k8s_openapi::api::apps::v1::ReplicaSet>::namespaced(client.clone(), NS)
            .list_metadata(&ListParams::default())
            .await?
            .items
            .len(),
    )
}

/// The operator's CPU while planning, beside the machine's load average.
pub(super) fn print_planning_cpu(cpu_planning: f64, wall_planning: f64) {
    println!(
        "cpu: the operator used {cpu_planning:.1} s of CPU in {wall_planning:.1} s while planning ({:.0}% of one core; the machine's load average {})",
        100.0 * cpu_planning / wall_planning.max(1e-9),
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
}

/// The operator's VmRSS and VmHWM (see [`Operator::memory`]).
pub(super) fn print_memory(memory: (u64, u64)) {
    println!(
        "memory: VmRSS {:.1} MiB, VmHWM {:.1} MiB",
        memory.0 as f64 / 1048576.0,
        memory.1 as f64 / 1048576.0
    );
}

pub(super) async fn create_deployments(client: &Client, count: usize) -> Result<()> {
    let api: Api<DiffusionDeployment> = Api::namespaced(client.clone(), NS);
    futures::stream::iter((0..count).map(|k| {
        let api = api.clone();
        async move {
            let mut spec = json!({
                "model": { "family": "dit", "location": { "hostPath": format!("/models/m-{k}") } },
                "workload": { "maxWidth": 1024, "maxHeight": 1024, "maxSteps": 50, "guidance": true },
            });
            // The largest models take any GPU node; the others keep to one instance type
            // each (the 162 GiB one to those with the memory for it).
            if k % 4 != 3 {
                let choices: &[usize] = if k % 4 == 2 {
                    &[0, 1, 2, 3, 5]
                } else {
                    &[0, 1, 2, 3, 4, 5]
                };
                let shape = &SHAPES[choices[(k / 4) % choices.len()]];
                spec["accelerator"] =
                    json!({ "nodeSelector": { "node.kubernetes.io/instance-type": shape.prefix } });
            }
            // Mostly fixed replicas; some scaled from outside, some by the builtin autoscaler
            // (whose scrapes of kwok's pods fail: they hold their replicas).
            match k % 10 {
                0 => spec["autoscaling"] = json!({ "minReplicas": 1, "maxReplicas": 4 }),
                1 | 2 => {
                    spec["autoscaling"] =
                        json!({ "mode": "external", "minReplicas": 1, "maxReplicas": 6 })
                }
                _ => spec["replicas"] = json!(1 + k % 3),
            }
            let dd = json!({ "apiVersion": "layerwise.dev/v1alpha1", "kind": "DiffusionDeployment",
                             "metadata": { "name": format!("m-{k}") }, "spec": spec });
            api.patch(
                &format!("m-{k}"),
                &PatchParams::apply(AGENT).force(),
                &Patch::Apply(dd),
            )
            .await
            .with_context(|| format!("creating DiffusionDeployment m-{k}"))?;
            anyhow::Ok(())
        }
    }))
    .buffer_unordered(PARALLEL)
    .try_collect::<Vec<()>>()
    .await?;
    Ok(())
}

/// What the slowest deployments waited on: name, when planned, and each not-True
/// condition's `type reason` seen before the plan, with when it was first seen.
pub(super) type Slowest = Vec<(String, Duration, Vec<String>)>;

/// What [`wait_planned`] saw, each time counted from the deployments' creation.
pub(super) struct Plans {
    /// When each deployment got its plan, by name.
    pub(super) by_name: BTreeMap<String, Duration>,
    /// How many turned Available, and when the last of them did.
    pub(super) available: usize,
    pub(super) last_available: Duration,
    /// The five slowest to plan.
    pub(super) slowest: Slowest,
    /// The CPU each part of the machine had used when the last deployment was planned.
    pub(super) cpu: Cpu,
}

/// When each deployment got its plan; then how many turned Available, and when the last of
/// them did (within two minutes of the last plan: kwok runs the engine pods, but a plan's
/// nodes may lack free GPUs for all of them); the five slowest to plan; and the CPU each
/// part of the machine had used when the last deployment was planned.
/// Follows a watch of the deployments, so each time is when the change reached the
/// apiserver's watch cache, and the benchmark adds no LISTs of its own to what the control
/// plane serves while the operator is measured.
pub(super) async fn wait_planned(client: &Client, count: usize, t0: Instant) -> Result<Plans> {
    let api: Api<DiffusionDeployment> = Api::namespaced(client.clone(), NS);
    let mut progress = Progress::default();
    let events = watcher(api, watcher::Config::default())
        .default_backoff()
        .applied_objects();
    let mut events = std::pin::pin!(events);
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tokio::select! {
            event = events.next() => {
                let dd = match event {
                    Some(Ok(dd)) => dd,
                    Some(Err(e)) => {
                        eprintln!("watching the deployments: {e}");
                        continue;
                    }
                    None => bail!("the watch of the deployments ended"),
                };
                progress.saw(dd, t0.elapsed(), count);
            }
            _ = tick.tick() => {}
        }
        let now = t0.elapsed();
        let settled = progress
            .all_planned
            .is_some_and(|t| now > t + Duration::from_secs(120));
        if progress.available.len() == count || settled {
            return Ok(progress.plans());
        }
        if progress.all_planned.is_none() && now > WAIT {
            let stuck = progress.stuck();
            bail!(
                "after {now:?}: {} of {count} planned; {stuck:?}",
                progress.planned.len()
            );
        }
    }
}

/// What the watch of the deployments has shown so far, each time counted from their
/// creation.
#[derive(Default)]
pub(super) struct Progress {
    /// When each deployment was first seen planned.
    pub(super) planned: BTreeMap<String, Duration>,
    /// When each deployment was first seen Available.
    pub(super) available: BTreeMap<String, Duration>,
    /// For each deployment, its not-True conditions' `type reason` seen before its plan,
    /// with when each was first seen.
    pub(super) waited: BTreeMap<String, BTreeMap<String, Duration>>,
    /// Each deployment as last seen.
    pub(super) latest: BTreeMap<String, DiffusionDeployment>,
    /// When the last of them was planned.
    pub(super) all_planned: Option<Duration>,
    /// The CPU each part of the machine had used then.
    pub(super) cpu_planned: Cpu,
}

impl Progress {
    /// Notes what `dd` shows at `now`; once all `count` are planned, when, and the CPU used.
    pub(super) fn saw(&mut self, dd: DiffusionDeployment, now: Duration, count: usize) {
        let st = dd.status.clone().unwrap_or_default();
        let is = |t: &str| {
            st.conditions
                .iter()
                .any(|c| c.type_ == t && c.status == "True")
        };
        if st.plan.is_some() && is("Planned") {
            self.planned.entry(dd.name_any()).or_insert(now);
        } else {
            let seen = self.waited.entry(dd.name_any()).or_default();
            for c in st.conditions.iter().filter(|c| c.status != "True") {
                seen.entry(format!("{} {}", c.type_, c.reason))
                    .or_insert(now);
            }
        }
        if is("Available") {
            self.available.entry(dd.name_any()).or_insert(now);
        }
        self.latest.insert(dd.name_any(), dd);
        if self.planned.len() == count && self.all_planned.is_none() {
            self.all_planned = Some(now);
            self.cpu_planned = control_plane_cpu();
        }
    }

    /// What the wait found: the plans, the Available count, and what the five slowest
    /// waited on, in the order each reason was first seen.
    pub(super) fn plans(mut self) -> Plans {
        let mut by_time: Vec<(String, Duration)> =
            self.planned.iter().map(|(n, t)| (n.clone(), *t)).collect();
        by_time.sort_by_key(|(_, t)| *t);
        let slowest = by_time
            .iter()
            .rev()
            .take(5)
            .map(|(name, at)| {
                let seen = self.waited.remove(name).unwrap_or_default();
                let mut seen: Vec<(String, Duration)> = seen.into_iter().collect();
                seen.sort_by_key(|(_, t)| *t);
                let seen = seen
                    .into_iter()
                    .map(|(why, t)| format!("{why} (from {:.1} s)", t.as_secs_f64()))
                    .collect();
                (name.clone(), *at, seen)
            })
            .collect();
        let last = self.available.values().max().copied().unwrap_or_default();
        Plans {
            by_name: self.planned,
            available: self.available.len(),
            last_available: last,
            slowest,
            cpu: self.cpu_planned,
        }
    }

    /// Up to five deployments not planned yet, each with its False conditions.
    pub(super) fn stuck(&self) -> Vec<String> {
        self.latest
            .values()
            .filter(|d| !self.planned.contains_key(&d.name_any()))
            .map(|d| {
                let reasons: Vec<String> = d
                    .status
                    .iter()
                    .flat_map(|s| &s.conditions)
                    .filter(|c| c.status == "False")
                    .map(|c| format!("{} {}: {}", c.type_, c.reason, c.message))
                    .collect();
                format!("{}: {}", d.name_any(), reasons.join("; "))
            })
            .take(5)
            .collect()
    }
}

/// Where the deployments' time to plan went, by stage (median, 90th percentile and
/// largest, in seconds): created to their first ask reaching an agent, that ask to the first
/// report of the model's profile written, that report to the plan, and that report to the
/// agents' own watch showing it.
pub(super) fn print_stages(stages: &SharedStages, planned: &BTreeMap<String, Duration>) {
    let st = stages.lock().unwrap();
    let (mut ask, mut report, mut plan) = (Vec::new(), Vec::new(), Vec::new());
    let mut seen = Vec::new();
    for (name, at) in planned {
        let id = format!("{NS}/{name}");
        let (Some(a), Some(r)) = (st.asked.get(&id), st.reported.get(&id)) else {
            continue;
        };
        ask.push(a.as_secs_f64());
        report.push(r.saturating_sub(*a).as_secs_f64());
        plan.push(at.saturating_sub(*r).as_secs_f64());
        if let Some(s) = st.seen.get(&id) {
            seen.push(s.saturating_sub(*r).as_secs_f64());
        }
    }
    let summary = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        match v.len() {
            0 => "none".to_string(),
            n => format!(
                "median {:.1} s, 90th percentile {:.1} s, largest {:.1} s",
                v[n / 2],
                v[n * 9 / 10],
                v[n - 1]
            ),
        }
    };
    println!(
        "stages of {} deployments: created to first ask {}; ask to first profile reported {}; report to plan {}; report to the agents' watch showing it {}",
        ask.len(),
        summary(&mut ask),
        summary(&mut report),
        summary(&mut plan),
        summary(&mut seen)
    );
}
