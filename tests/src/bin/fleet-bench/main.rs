//! `fleet-bench`: the operator at fleet scale, against the local control plane
//! (`scripts/bench-fleet` brings up a cluster of its own and runs this; not a test).
//!
//! It adds N fake GPU nodes of mixed shapes (kwok keeps them Ready) with their
//! DiffusionNodes, plays every node agent itself (a prepare request is answered with a warm
//! profile at once, one report at a time per node), starts the `layerwise-operator` binary
//! it is given (leader election on, metrics on a loopback port), creates D
//! DiffusionDeployments at once and reports:
//! - the time until every deployment has a plan, and how many turn Available (kwok runs
//!   their engine pods) and when;
//! - where the time to plan went, by stage (see [`planning::print_stages`]);
//! - the operator's memory (VmRSS, and VmHWM, its peak), and the CPU it and the rest of the
//!   machine (etcd, kube-apiserver, the controller manager, the scheduler, kwok, this
//!   benchmark's fake agents) used: idle for 10 s before the deployments, and until the
//!   last plan;
//! - API requests per reconcile (the operator counts its own requests by verb and
//!   resource), while planning and in the steady state after;
//! - a restart: the time a new operator takes to lead and reconcile every deployment once.
//!
//! Loopback only: node N has InternalIP 127.3.x.y and podCIDR 127.(16+N/256).(N%256).0/24.
//!
//!   fleet-bench --operator PATH [--nodes 1000] [--deployments 100] [--resync-seconds 15]
//!               [--steady-seconds 45] [--json FILE]

mod agent;
mod args;
mod common;
mod cpu;
mod fleet;
mod operator;
mod planning;
mod report;
mod steady;

use std::time::{Duration, Instant};

use anyhow::Result;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::PostParams;
use kube::{Api, Client};
use layerwise_e2e::cluster;
use layerwise_e2e::tools::install_crds;
use serde_json::json;

use agent::{agent, SharedStages};
use args::args;
use common::NS;
use cpu::print_idle_cpu;
use fleet::{create_fleet, fleet, SHAPES};
use operator::Operator;
use planning::Planning;
use report::json_report;
use steady::{Restart, Steady};

#[tokio::main]
async fn main() -> Result<()> {
    let a = args()?;
    let client = cluster::client().await?;
    install_crds(&client, Duration::from_secs(60)).await?;
    ensure_namespace(&client).await?;

    let t = Instant::now();
    let fleet = fleet(a.nodes);
    create_fleet(&client, &fleet).await?;
    println!(
        "fleet: {} nodes and DiffusionNodes of {} shapes in {:.1} s",
        fleet.len(),
        SHAPES.len(),
        t.elapsed().as_secs_f64()
    );
    // The agents start timing with the deployments (Planning::measure); nothing is asked
    // before.
    let stages = SharedStages::default();
    let agent = tokio::spawn(agent(client.clone(), fleet.clone(), stages.clone()));

    let mut op = Operator::start(&a, "fleet-bench-operator-0").await?;
    let led = op.wait_leading().await?;
    println!(
        "operator: leading and synced {:.2} s after start",
        led.as_secs_f64()
    );
    print_idle_cpu().await;

    let planning = Planning::measure(&client, &a, &op, &stages).await?;
    let steady = Steady::measure(&a, &op).await?;
    let restart = Restart::measure(&a, &mut op).await?;
    agent.abort();

    if let Some(path) = &a.json {
        let report = json_report(&a, fleet.len(), led, &planning, &steady, &restart);
        std::fs::write(path, serde_json::to_string_pretty(&report)?)?;
    }
    Ok(())
}

/// Creates the benchmark's namespace unless it is there.
async fn ensure_namespace(client: &Client) -> Result<()> {
    let nss: Api<Namespace> = Api::all(client.clone());
    if nss.get_opt(NS).await?.is_none() {
        nss.create(
            &PostParams::default(),
            &serde_json::from_value(json!({ "metadata": { "name": NS } }))?,
        )
        .await?;
    }
    Ok(())
}
