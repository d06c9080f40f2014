//! The engine Deployment's rolling update: what `spec.engine.rollout` asks for, and the
//! fallback the operator rolls with where no planned node has room for a surge pod (see
//! [`crate::surge`]): no pod beyond `replicas`, and at least one taken away at a time, so
//! the rollout goes on instead of waiting on a pod no node can take.

use crds::{EngineSpec, Rollout};
use k8s_openapi::api::apps::v1::{DeploymentStrategy, RollingUpdateDeployment};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

/// The spec's rollout, its defaults filled in.
pub fn asked(engine: &EngineSpec) -> Rollout {
    engine.rollout.clone().unwrap_or_default()
}

/// The rolling update `spec.engine.rollout` asks for, as written (defaults: `maxSurge: 1`,
/// `maxUnavailable: 0`).
pub fn spec_update(engine: &EngineSpec) -> RollingUpdateDeployment {
    let r = asked(engine);
    RollingUpdateDeployment {
        max_surge: Some(r.max_surge()),
        max_unavailable: Some(r.max_unavailable()),
    }
}

/// The rolling update without a surge pod: `maxSurge: 0`, and the spec's `maxUnavailable`
/// where it comes to at least one pod of `replicas`, else 1.
pub fn without_surge(engine: &EngineSpec, replicas: i32) -> RollingUpdateDeployment {
    let r = asked(engine);
    // With a surge beside it, what `maxUnavailable` comes to on its own (no fence-post).
    let unavailable = Rollout {
        max_surge: Some(IntOrString::Int(1)),
        max_unavailable: Some(r.max_unavailable()),
    };
    let max_unavailable = if unavailable.resolve(replicas).1 >= 1 {
        r.max_unavailable()
    } else {
        IntOrString::Int(1)
    };
    RollingUpdateDeployment {
        max_surge: Some(IntOrString::Int(0)),
        max_unavailable: Some(max_unavailable),
    }
}

/// The Deployment strategy of a rolling `update`.
pub fn strategy(update: RollingUpdateDeployment) -> DeploymentStrategy {
    DeploymentStrategy {
        type_: Some("RollingUpdate".into()),
        rolling_update: Some(update),
    }
}

/// Whether `update` starts pods beyond `replicas`.
pub fn surges(update: &RollingUpdateDeployment, replicas: i32) -> bool {
    let r = Rollout {
        max_surge: update.max_surge.clone(),
        max_unavailable: update.max_unavailable.clone(),
    };
    r.resolve(replicas.max(1)).0 > 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine(surge: Option<IntOrString>, unavailable: Option<IntOrString>) -> EngineSpec {
        EngineSpec {
            rollout: Some(Rollout {
                max_surge: surge,
                max_unavailable: unavailable,
            }),
            ..EngineSpec::default()
        }
    }

    #[test]
    fn the_default_surges_one_pod_and_takes_none_away() {
        let u = spec_update(&EngineSpec::default());
        assert_eq!(u.max_surge, Some(IntOrString::Int(1)));
        assert_eq!(u.max_unavailable, Some(IntOrString::Int(0)));
        assert!(surges(&u, 1));
    }

    #[test]
    fn without_a_surge_at_least_one_pod_goes_at_a_time() {
        let pct = |s: &str| Some(IntOrString::String(s.into()));
        let u = without_surge(&EngineSpec::default(), 1);
        assert_eq!(u.max_surge, Some(IntOrString::Int(0)));
        assert_eq!(u.max_unavailable, Some(IntOrString::Int(1)));
        assert!(!surges(&u, 1));
        // The spec's maxUnavailable stands where it comes to a pod...
        let u = without_surge(&engine(pct("50%"), pct("50%")), 4);
        assert_eq!(u.max_unavailable, pct("50%"));
        // ...and not where it rounds down to none.
        let u = without_surge(&engine(pct("50%"), pct("25%")), 3);
        assert_eq!(u.max_unavailable, Some(IntOrString::Int(1)));
    }
}
