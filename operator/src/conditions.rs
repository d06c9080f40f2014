//! Status conditions: the types a DiffusionDeployment reports, and an upsert that keeps
//! `lastTransitionTime` while a condition's status does not change.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

pub const MODEL_PROFILED: &str = "ModelProfiled";
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
    let status = if status { "True" } else { "False" }.to_string();
    let message = message.into();
    match conds.iter_mut().find(|c| c.type_ == type_) {
        Some(c) => {
            if c.status != status {
                c.last_transition_time = Time(now);
            }
            c.status = status;
            c.reason = reason.into();
            c.message = message;
            c.observed_generation = generation;
        }
        None => conds.push(Condition {
            type_: type_.into(),
            status,
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
}
