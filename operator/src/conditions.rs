//! Status conditions: the types a DiffusionDeployment reports, an upsert that keeps
//! `lastTransitionTime` while a condition's status does not change, and the summary
//! conditions GitOps tools read.
//!
//! The summary follows kstatus (the status convention Flux, Argo CD and `kubectl wait` read):
//! `Ready` True once the engines serve as planned, `Reconciling` True while the operator is
//! still getting there, `Stalled` True when it cannot get there without a person. They are
//! derived from the step conditions by one pure function, [`summarize`], so they never
//! disagree with them. A step the reconcile did not reach this time (it stopped earlier) is
//! `Unknown` rather than keeping a value observed for an older generation ([`unreached`]).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

pub const MODEL_PROFILED: &str = "ModelProfiled";
/// Only for a model the agents stage (`s3`): True once a candidate node has a complete copy
/// ([`crate::staging`]).
pub const MODEL_STAGED: &str = "ModelStaged";
pub const PLANNED: &str = "Planned";
pub const CACHE_WARM: &str = "CacheWarm";
pub const AVAILABLE: &str = "Available";
pub const PROGRESSING: &str = "Progressing";
pub const DEGRADED: &str = "Degraded";
/// Builtin autoscaling only: True while some engine pods' load cannot be read (the message
/// names them); those pods hold the replicas.
pub const SCRAPE_FAILED: &str = "ScrapeFailed";
/// Only while `spec.inferencePool.enabled`: True once the deployment's InferencePool is
/// applied; False (reason `InferencePoolUnavailable`) where the cluster does not serve the
/// InferencePool API.
pub const INFERENCE_POOL: &str = "InferencePool";
/// Whether a rollout starts each new engine pod before an old one goes: True (reason
/// `RoomForSurge`) where `spec.engine.rollout` asks for a surge and a planned node has room
/// for the surge pod; False with reason `NoRoomForSurge` (naming what each node lacks) where
/// none has, so rollouts take a pod away first, or `SurgeNotAsked` (see [`crate::surge`]).
pub const ROLLOUT_SURGE: &str = "RolloutSurge";
/// Summary: True when the engines serve as the spec asks (or it asks for zero replicas).
pub const READY: &str = "Ready";
/// Summary (kstatus' abnormal-true condition): True while the operator works towards
/// `Ready` and expects to get there.
pub const RECONCILING: &str = "Reconciling";
/// Summary (kstatus' abnormal-true condition): True when the operator cannot reach
/// `Ready` until a person changes something; the reason and message are the fault's.
pub const STALLED: &str = "Stalled";

/// The conditions a complete reconcile sets, in the order it reaches them. A reconcile
/// that stops earlier marks those it did not set `Unknown`.
pub const STEPS: [&str; 5] = [MODEL_PROFILED, PLANNED, AVAILABLE, PROGRESSING, CACHE_WARM];

/// Reason of a step condition the last reconcile did not reach.
pub const NOT_REACHED: &str = "NotReached";
/// Where an `Unknown` condition's message keeps the value it had before.
const BEFORE: &str = "; before: ";

/// Sets condition `type_` in `conds` (adding it when missing).
pub fn set(
    conds: &mut Vec<Condition>,
    type_: &str,
    status: bool,
    reason: &str,
    message: impl Into<String>,
    generation: Option<i64>,
    now: Timestamp,
) {
    let status = if status { "True" } else { "False" };
    put(
        conds,
        type_,
        status,
        reason,
        message.into(),
        generation,
        now,
    );
}

/// Sets condition `type_` to `status` ("True", "False" or "Unknown").
fn put(
    conds: &mut Vec<Condition>,
    type_: &str,
    status: &str,
    reason: &str,
    message: String,
    generation: Option<i64>,
    now: Timestamp,
) {
    match conds.iter_mut().find(|c| c.type_ == type_) {
        Some(c) => {
            if c.status != status {
                c.last_transition_time = Time(now);
            }
            c.status = status.into();
            c.reason = reason.into();
            c.message = message;
            c.observed_generation = generation;
        }
        None => conds.push(Condition {
            type_: type_.into(),
            status: status.into(),
            reason: reason.into(),
            message,
            observed_generation: generation,
            last_transition_time: Time(now),
        }),
    }
}

/// Whether condition `type_` is present and True.
pub fn is_true(conds: &[Condition], type_: &str) -> bool {
    conds.iter().any(|c| c.type_ == type_ && c.status == "True")
}

/// Marks `Unknown` each of [`STEPS`] that `reached` says this reconcile did not set, because
/// it stopped at condition `at` for `reason`. What the condition said before stays in the
/// message (the engines of an earlier plan may well still run), but not as a current value.
pub fn unreached(
    conds: &mut Vec<Condition>,
    reached: impl Fn(&str) -> bool,
    at: &str,
    reason: &str,
    generation: Option<i64>,
    now: Timestamp,
) {
    for step in STEPS.into_iter().filter(|s| !reached(s)) {
        let before = conds.iter().find(|c| c.type_ == step).and_then(|c| {
            if c.status == "Unknown" {
                c.message.split_once(BEFORE).map(|(_, b)| b.to_string())
            } else {
                Some(format!("{} ({}): {}", c.status, c.reason, c.message))
            }
        });
        let mut message = format!("not evaluated: the reconcile stops at {at} ({reason})");
        if let Some(before) = before {
            message = format!("{message}{BEFORE}{before}");
        }
        put(
            conds,
            step,
            "Unknown",
            NOT_REACHED,
            message,
            generation,
            now,
        );
    }
}

/// Sets [`READY`], [`RECONCILING`] and [`STALLED`] from the step conditions. `deploying`:
/// the reconcile has a new plan and has not applied it yet, so what runs is not what the
/// spec asks, whatever the step conditions of the old plan say.
///
/// Stalled (`Degraded` True, or an InferencePool the cluster cannot hold) wins; else the
/// first step not yet where it should be keeps `Ready` False and `Reconciling` True with its
/// reason and message; else `Ready` True. `CacheWarm` does not hold `Ready` back: engines
/// serve from cold pages too. A deployment scaled to zero is Ready: it is as asked.
pub fn summarize(
    conds: &mut Vec<Condition>,
    deploying: bool,
    generation: Option<i64>,
    now: Timestamp,
) {
    let find = |t: &str| conds.iter().find(|c| c.type_ == t);
    let why = |c: &Condition| (c.reason.clone(), c.message.clone());
    let stalled = find(DEGRADED)
        .filter(|c| c.status == "True")
        .or_else(|| find(INFERENCE_POOL).filter(|c| c.status == "False"))
        .map(why);
    let waiting = if deploying {
        Some((
            "Deploying".to_string(),
            "applying the new plan's engine objects".to_string(),
        ))
    } else {
        let pending = |t: &str, done: &dyn Fn(&Condition) -> bool| match find(t) {
            Some(c) if done(c) => None,
            Some(c) => Some(why(c)),
            None => Some((
                NOT_REACHED.to_string(),
                format!("{t} has not been evaluated yet"),
            )),
        };
        pending(MODEL_PROFILED, &|c| c.status == "True")
            .or_else(|| pending(PLANNED, &|c| c.status == "True"))
            .or_else(|| {
                pending(AVAILABLE, &|c| {
                    c.status == "True" || c.reason == "ScaledToZero"
                })
            })
            .or_else(|| pending(PROGRESSING, &|c| c.status == "False"))
    };
    let ready = find(AVAILABLE).map(why);
    let (g, n) = (generation, now);
    match (stalled, waiting) {
        (Some((reason, message)), _) => {
            set(conds, READY, false, &reason, message.clone(), g, n);
            set(conds, STALLED, true, &reason, message, g, n);
            set(
                conds,
                RECONCILING,
                false,
                "Stalled",
                "a person must act; see Stalled",
                g,
                n,
            );
        }
        (None, Some((reason, message))) => {
            set(conds, READY, false, &reason, message.clone(), g, n);
            set(conds, RECONCILING, true, &reason, message, g, n);
            set(
                conds,
                STALLED,
                false,
                "Progressing",
                "nothing blocks the reconcile",
                g,
                n,
            );
        }
        (None, None) => {
            // Available's own reason: `EnginesReady`, or `ScaledToZero`.
            let (reason, message) = ready.unwrap_or_default();
            set(conds, READY, true, &reason, message, g, n);
            set(
                conds,
                RECONCILING,
                false,
                "Reconciled",
                "the engines run as planned",
                g,
                n,
            );
            set(
                conds,
                STALLED,
                false,
                "Reconciled",
                "the engines run as planned",
                g,
                n,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transition_time_moves_only_when_status_changes() {
        let t0 = Timestamp::from_second(1000).unwrap();
        let t1 = Timestamp::from_second(2000).unwrap();
        let mut c = Vec::new();
        set(&mut c, PLANNED, true, "Planned", "a", Some(1), t0);
        set(&mut c, PLANNED, true, "Planned", "b", Some(2), t1);
        assert_eq!(
            (c.len(), c[0].last_transition_time.0, c[0].message.as_str()),
            (1, t0, "b")
        );
        set(
            &mut c,
            PLANNED,
            false,
            "InsufficientDeviceMemory",
            "c",
            Some(3),
            t1,
        );
        assert_eq!(c[0].last_transition_time.0, t1);
        assert!(!is_true(&c, PLANNED));
    }

    fn status<'a>(c: &'a [Condition], t: &str) -> (&'a str, &'a str) {
        let c = c.iter().find(|c| c.type_ == t).unwrap();
        (c.status.as_str(), c.reason.as_str())
    }

    fn running() -> Vec<Condition> {
        let t = Timestamp::UNIX_EPOCH;
        let mut c = Vec::new();
        set(&mut c, MODEL_PROFILED, true, "Profiled", "p", Some(1), t);
        set(
            &mut c,
            PLANNED,
            true,
            "Planned",
            "offload-sharded dp=2",
            Some(1),
            t,
        );
        set(
            &mut c,
            AVAILABLE,
            true,
            "EnginesReady",
            "2 of 2",
            Some(1),
            t,
        );
        set(
            &mut c,
            PROGRESSING,
            false,
            "RolloutComplete",
            "2 of 2",
            Some(1),
            t,
        );
        set(&mut c, CACHE_WARM, false, "Warming", "1 of 2", Some(1), t);
        set(&mut c, DEGRADED, false, "AsPlanned", "ok", Some(1), t);
        c
    }

    #[test]
    fn ready_when_the_engines_run_as_planned_even_cold() {
        let mut c = running();
        summarize(&mut c, false, Some(1), Timestamp::UNIX_EPOCH);
        assert_eq!(status(&c, READY), ("True", "EnginesReady"));
        assert_eq!(status(&c, RECONCILING).0, "False");
        assert_eq!(status(&c, STALLED).0, "False");
        // A new plan not applied yet: not Ready, whatever the old plan's pods say.
        summarize(&mut c, true, Some(2), Timestamp::UNIX_EPOCH);
        assert_eq!(status(&c, READY), ("False", "Deploying"));
        assert_eq!(status(&c, RECONCILING), ("True", "Deploying"));
    }

    #[test]
    fn rolling_out_is_reconciling_and_a_fault_is_stalled() {
        let t = Timestamp::UNIX_EPOCH;
        let mut c = running();
        set(
            &mut c,
            PROGRESSING,
            true,
            "RollingOut",
            "1 of 2",
            Some(2),
            t,
        );
        summarize(&mut c, false, Some(2), t);
        assert_eq!(status(&c, READY), ("False", "RollingOut"));
        assert_eq!(status(&c, RECONCILING), ("True", "RollingOut"));
        assert_eq!(status(&c, STALLED).0, "False");

        set(
            &mut c,
            DEGRADED,
            true,
            "InsufficientDeviceMemory",
            "short",
            Some(3),
            t,
        );
        summarize(&mut c, false, Some(3), t);
        assert_eq!(status(&c, READY), ("False", "InsufficientDeviceMemory"));
        assert_eq!(status(&c, STALLED), ("True", "InsufficientDeviceMemory"));
        assert_eq!(status(&c, RECONCILING).0, "False");

        // Scaled to zero is as asked.
        let mut c = running();
        set(
            &mut c,
            AVAILABLE,
            false,
            "ScaledToZero",
            "0 of 0",
            Some(1),
            t,
        );
        summarize(&mut c, false, Some(1), t);
        assert_eq!(status(&c, READY), ("True", "ScaledToZero"));
        // Nothing evaluated yet: reconciling.
        let mut c = Vec::new();
        summarize(&mut c, false, Some(1), t);
        assert_eq!(status(&c, READY), ("False", NOT_REACHED));
        assert_eq!(status(&c, RECONCILING).0, "True");
    }

    #[test]
    fn steps_not_reached_are_unknown_and_remember_what_they_were() {
        let t = Timestamp::UNIX_EPOCH;
        let mut c = running();
        set(
            &mut c,
            MODEL_PROFILED,
            false,
            "WaitingForProfile",
            "w",
            Some(2),
            t,
        );
        unreached(
            &mut c,
            |s| s == MODEL_PROFILED,
            MODEL_PROFILED,
            "WaitingForProfile",
            Some(2),
            t,
        );
        for step in [PLANNED, AVAILABLE, PROGRESSING, CACHE_WARM] {
            assert_eq!(status(&c, step), ("Unknown", NOT_REACHED), "{step}");
        }
        let available = c.iter().find(|c| c.type_ == AVAILABLE).unwrap().clone();
        assert!(
            available
                .message
                .ends_with("before: True (EnginesReady): 2 of 2"),
            "{}",
            available.message
        );
        assert_eq!(available.observed_generation, Some(2));
        // Again: the same message, so nothing to write.
        unreached(
            &mut c,
            |s| s == MODEL_PROFILED,
            MODEL_PROFILED,
            "WaitingForProfile",
            Some(2),
            t,
        );
        assert_eq!(c.iter().find(|c| c.type_ == AVAILABLE), Some(&available));
        summarize(&mut c, false, Some(2), t);
        assert_eq!(status(&c, READY), ("False", "WaitingForProfile"));
        assert_eq!(status(&c, RECONCILING).0, "True");
    }
}
