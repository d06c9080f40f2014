//! The run's figures as JSON (`--json FILE`).

use std::time::Duration;

use serde_json::json;

use super::args::Args;
use super::planning::Planning;
use super::steady::{Restart, Steady};

/// The `--json` report of a run over `nodes` nodes whose first operator led after `led`.
pub(super) fn json_report(
    a: &Args,
    nodes: usize,
    led: Duration,
    planning: &Planning,
    steady: &Steady,
    restart: &Restart,
) -> serde_json::Value {
    let planned = &planning.planned;
    json!({
        "nodes": nodes,
        "deployments": a.deployments,
        "resync_seconds": a.resync_seconds,
        "operator_lead_seconds": led.as_secs_f64(),
        "engine_replica_sets": planning.replica_sets,
        "operator_cpu_seconds_planning": planning.cpu_seconds,
        "all_planned_seconds": planned.last().copied().unwrap_or_default().as_secs_f64(),
        "median_planned_seconds": planned[planned.len() / 2].as_secs_f64(),
        "available": planning.available,
        "last_available_seconds": planning.last_available.as_secs_f64(),
        "planning": planning.requests.json(),
        "steady": steady.requests.json(),
        "restart_reconciled_all_seconds": restart.reconciled_all.as_secs_f64(),
        "restart": restart.requests.json(),
        "rss_bytes": { "planned": planning.memory.0, "steady": steady.memory.0, "restart": restart.memory.0 },
        "hwm_bytes": steady.memory.1.max(planning.memory.1),
    })
}
