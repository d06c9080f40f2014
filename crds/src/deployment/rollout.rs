//! How a change to the engine pods' template replaces them: `spec.engine.rollout`, the
//! engine Deployment's rolling update, and how its numbers or percentages resolve to pods
//! (as the Deployment controller resolves them, so the operator and Kubernetes agree on how
//! many pods a rollout surges).

use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::KubeSchema;
use serde::{Deserialize, Serialize};

/// How many engine pods a rollout may start beyond `replicas` (`maxSurge`) and may take
/// away below it (`maxUnavailable`), a number or a percentage of `replicas` as a
/// Deployment's rolling update takes them. Unset: `maxSurge: 1, maxUnavailable: 0`, so a
/// one-replica model keeps serving while its pod is replaced, when a planned node has room
/// for one more pod; where none has, the operator rolls with `maxSurge: 0` and
/// `maxUnavailable` of at least 1 instead, and says so in the `RolloutSurge` condition.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!((has(self.maxSurge) && (type(self.maxSurge) == int ? self.maxSurge == 0 : self.maxSurge.matches('^0+%$'))) && (!has(self.maxUnavailable) || (type(self.maxUnavailable) == int ? self.maxUnavailable == 0 : self.maxUnavailable.matches('^0+%$'))))").message("rollout: maxSurge and maxUnavailable must not both be 0 (maxUnavailable defaults to 0): no pod could be replaced"))]
pub struct Rollout {
    /// Engine pods a rollout may start beyond `replicas` (a number, or a percentage such as
    /// `25%`, rounded up). Each needs its own accelerators on a planned node. Default 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("type(self) == int ? self >= 0 : self.matches('^[0-9]+%$')").message("rollout.maxSurge must be a number of at least 0 or a percentage such as 25%"))]
    pub max_surge: Option<IntOrString>,
    /// Engine pods a rollout may take away below `replicas` (a number, or a percentage up
    /// to `100%`, rounded down). Default 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("type(self) == int ? self >= 0 : self.matches('^(100|[0-9]{1,2})%$')").message("rollout.maxUnavailable must be a number of at least 0 or a percentage from 0% to 100%"))]
    pub max_unavailable: Option<IntOrString>,
}

impl Rollout {
    /// `maxSurge` when unset.
    pub const DEFAULT_MAX_SURGE: i32 = 1;
    /// `maxUnavailable` when unset.
    pub const DEFAULT_MAX_UNAVAILABLE: i32 = 0;

    /// `maxSurge` as written, or its default.
    pub fn max_surge(&self) -> IntOrString {
        self.max_surge
            .clone()
            .unwrap_or(IntOrString::Int(Self::DEFAULT_MAX_SURGE))
    }

    /// `maxUnavailable` as written, or its default.
    pub fn max_unavailable(&self) -> IntOrString {
        self.max_unavailable
            .clone()
            .unwrap_or(IntOrString::Int(Self::DEFAULT_MAX_UNAVAILABLE))
    }

    /// The pods `maxSurge` and `maxUnavailable` come to for `replicas`, as the Deployment
    /// controller resolves them: a surge percentage rounds up, an unavailable one down, and
    /// where both come to 0 one pod may be unavailable.
    pub fn resolve(&self, replicas: i32) -> (i32, i32) {
        let surge = pods(&self.max_surge(), replicas, true);
        let unavailable = pods(&self.max_unavailable(), replicas, false);
        if surge == 0 && unavailable == 0 {
            (0, 1)
        } else {
            (surge, unavailable)
        }
    }
}

/// The pods `v` comes to out of `replicas` (a percentage rounded up or down); an unreadable
/// value (the schema refuses them) counts as 0.
fn pods(v: &IntOrString, replicas: i32, round_up: bool) -> i32 {
    match v {
        IntOrString::Int(n) => (*n).max(0),
        IntOrString::String(s) => {
            let pct: i64 = s
                .strip_suffix('%')
                .and_then(|p| p.parse().ok())
                .unwrap_or(0);
            let scaled = pct.max(0) * i64::from(replicas.max(0));
            let n = if round_up {
                (scaled + 99) / 100
            } else {
                scaled / 100
            };
            i32::try_from(n).unwrap_or(i32::MAX)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(surge: Option<IntOrString>, unavailable: Option<IntOrString>) -> Rollout {
        Rollout {
            max_surge: surge,
            max_unavailable: unavailable,
        }
    }

    #[test]
    fn resolves_as_the_deployment_controller_does() {
        let pct = |s: &str| Some(IntOrString::String(s.into()));
        assert_eq!(Rollout::default().resolve(1), (1, 0));
        assert_eq!(Rollout::default().resolve(0), (1, 0));
        // 25% of 3: surge rounds up to 1, unavailable down to 0.
        assert_eq!(r(pct("25%"), pct("25%")).resolve(3), (1, 0));
        assert_eq!(r(pct("50%"), pct("50%")).resolve(4), (2, 2));
        // Both come to 0: one pod may go, as Kubernetes does.
        assert_eq!(r(pct("0%"), pct("10%")).resolve(3), (0, 1));
        assert_eq!(r(Some(IntOrString::Int(0)), pct("100%")).resolve(3), (0, 3));
        assert_eq!(r(pct("150%"), None).resolve(2), (3, 0));
    }
}
