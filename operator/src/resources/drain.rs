//! How long an engine pod gets to drain: its grace (`--grace-seconds`, through the
//! environment) and the pod's `terminationGracePeriodSeconds`, which follows from it. A pod
//! told to stop finishes its running and queued jobs within the grace and keeps their
//! results readable (see the engine's `server::shutdown`); the grace is sized so the largest
//! request the workload allows, as the plan's step-time model predicts it, finishes inside
//! the part of the grace the engine gives to work.

use crds::Plan;
use layerwise_core::contract::DEFAULT_GRACE_SECONDS;

/// Seconds a deleted engine pod keeps serving before it is sent SIGTERM: load balancers and
/// Service endpoints take a moment to stop sending it requests. On SIGTERM the engine fails
/// readiness and refuses new jobs; queued and running work then gets its drain grace
/// (below).
pub const DRAIN_DELAY_SECONDS: i64 = 5;

/// The predicted latency is a model: the grace gives it half again...
const LATENCY_FACTOR: f64 = 1.5;
/// ...and this much more, for a request that waited behind another.
const LATENCY_MARGIN_SECONDS: f64 = 10.0;
/// What the kubelet waits past the grace before it kills the container: the engine exits
/// within its grace, this covers its last connections and the process's own exit.
const EXIT_MARGIN_SECONDS: i64 = 5;

/// The engine's drain grace under `plan`: the predicted latency of a request at the
/// workload's bounds, half again and 10 s more, and never less than the engine's default;
/// the default where the plan predicts nothing. With it the engine's work part of the grace
/// (its first three quarters at most) still holds the predicted latency.
pub fn grace_seconds(plan: &Plan) -> u64 {
    match plan.predicted_latency_seconds {
        Some(s) if s.is_finite() && s > 0.0 => {
            ((s * LATENCY_FACTOR + LATENCY_MARGIN_SECONDS).ceil() as u64).max(DEFAULT_GRACE_SECONDS)
        }
        _ => DEFAULT_GRACE_SECONDS,
    }
}

/// The pod's `terminationGracePeriodSeconds` for a drain grace of `grace` s: the preStop
/// delay (which counts against it, before SIGTERM), the grace, and a margin.
pub fn termination_grace_seconds(grace: u64) -> i64 {
    DRAIN_DELAY_SECONDS + i64::try_from(grace).unwrap_or(i64::MAX / 2) + EXIT_MARGIN_SECONDS
}
