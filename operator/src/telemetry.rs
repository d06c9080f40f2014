//! What the operator reports about itself: its Prometheus metrics, registered once into the
//! registry `/metrics` serves, and the state its probes read (leading or standing by, the
//! leader's stores synced). One [`Telemetry`] per process, shared by the election loop, the
//! controller, the client layer that counts API requests and the HTTP endpoints.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StrategyLabels {
    pub strategy: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DeploymentLabels {
    /// `<namespace>/<name>` of the DiffusionDeployment.
    pub deployment: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// get, list, watch, create, update, patch, delete, deletecollection.
    pub verb: String,
    /// The resource (with its subresource: `diffusiondeployments/status`).
    pub resource: String,
}

/// The operator's metrics (prefix `layerwise_operator_`).
pub struct Metrics {
    registry: Registry,
    /// Reconciles run, whatever their outcome.
    pub reconciles: Counter,
    pub reconcile_duration: Histogram,
    /// Reconciles that failed, by the error's label ([`crate::Error::metric_label`]).
    pub errors: Family<ReasonLabels, Counter>,
    /// Reconciles that stopped short of running the deployment, by the condition reason
    /// they recorded ([`crate::report::Stop::reason`]).
    pub stops: Family<ReasonLabels, Counter>,
    /// Plans recorded (a new or changed plan), by strategy.
    pub plans: Family<StrategyLabels, Counter>,
    /// Engine pods whose load the builtin autoscaler could not read.
    pub scrape_failures: Family<DeploymentLabels, Counter>,
    /// 1 while this replica holds the lease and runs the controller.
    pub leader: Gauge,
    /// Requests this process sent the Kubernetes API.
    pub api_requests: Family<RequestLabels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut m = Metrics {
            registry: Registry::with_prefix("layerwise_operator"),
            reconciles: Counter::default(),
            // 1 ms to ~33 s.
            reconcile_duration: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            errors: Family::default(),
            stops: Family::default(),
            plans: Family::default(),
            scrape_failures: Family::default(),
            leader: Gauge::default(),
            api_requests: Family::default(),
        };
        let r = &mut m.registry;
        r.register(
            "reconciles",
            "Reconciles of DiffusionDeployments run",
            m.reconciles.clone(),
        );
        r.register(
            "reconcile_duration_seconds",
            "Time one reconcile took",
            m.reconcile_duration.clone(),
        );
        r.register(
            "reconcile_errors",
            "Reconciles that failed, by error",
            m.errors.clone(),
        );
        r.register(
            "reconcile_stops",
            "Reconciles that stopped before running the deployment, by condition reason",
            m.stops.clone(),
        );
        r.register("plans", "Plans recorded, by strategy", m.plans.clone());
        r.register(
            "autoscaler_scrape_failures",
            "Engine pods whose /metrics the builtin autoscaler could not read",
            m.scrape_failures.clone(),
        );
        r.register(
            "leader",
            "1 while this replica holds the lease and reconciles",
            m.leader.clone(),
        );
        r.register(
            "api_requests",
            "Requests sent to the Kubernetes API, by verb and resource",
            m.api_requests.clone(),
        );
        r.register(
            "build",
            "The operator's version and source revision",
            Info::new(layerwise_core::metric_names::build_info_labels()),
        );
        m
    }

    /// Counts one reconcile that took `took` and ended with `error` (its metric label).
    pub fn reconciled(&self, took: Duration, error: Option<&str>) {
        self.reconciles.inc();
        self.reconcile_duration.observe(took.as_secs_f64());
        if let Some(reason) = error {
            self.errors
                .get_or_create(&ReasonLabels {
                    reason: reason.into(),
                })
                .inc();
        }
    }

    pub fn stopped(&self, reason: &str) {
        self.stops
            .get_or_create(&ReasonLabels {
                reason: reason.into(),
            })
            .inc();
    }

    pub fn planned(&self, strategy: &str) {
        self.plans
            .get_or_create(&StrategyLabels {
                strategy: strategy.into(),
            })
            .inc();
    }

    pub fn scrape_failed(&self, deployment: &str, pods: u64) {
        self.scrape_failures
            .get_or_create(&DeploymentLabels {
                deployment: deployment.into(),
            })
            .inc_by(pods);
    }

    /// Forgets a deployment's series (it is gone).
    pub fn forget(&self, deployment: &str) {
        self.scrape_failures.remove(&DeploymentLabels {
            deployment: deployment.into(),
        });
    }

    pub fn api_request(&self, verb: &str, resource: &str) {
        self.api_requests
            .get_or_create(&RequestLabels {
                verb: verb.into(),
                resource: resource.into(),
            })
            .inc();
    }

    /// Requests sent so far with `verb` on `resource`.
    pub fn api_requests_of(&self, verb: &str, resource: &str) -> u64 {
        self.api_requests
            .get_or_create(&RequestLabels {
                verb: verb.into(),
                resource: resource.into(),
            })
            .get()
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }
}

/// What the probes read.
#[derive(Debug, Default)]
pub struct Health {
    leader: AtomicBool,
    synced: AtomicBool,
}

impl Health {
    /// Whether this replica leads (holds the lease and runs the controller).
    pub fn is_leader(&self) -> bool {
        self.leader.load(Ordering::SeqCst)
    }

    /// Whether the leader's stores hold their first full list.
    pub fn is_synced(&self) -> bool {
        self.synced.load(Ordering::SeqCst)
    }

    /// Ready to do its part: a standby is (it only waits for the lease), a leader once its
    /// stores are synced (before that it would plan from an empty fleet).
    pub fn ready(&self) -> Result<&'static str, &'static str> {
        match (self.is_leader(), self.is_synced()) {
            (false, _) => Ok("standby: another replica holds the lease\n"),
            (true, true) => Ok("leading\n"),
            (true, false) => Err("leading, stores not synced yet\n"),
        }
    }
}

/// One per process.
#[derive(Default)]
pub struct Telemetry {
    pub metrics: Metrics,
    pub health: Health,
}

impl Telemetry {
    /// Records that this replica starts or stops leading.
    pub fn lead(&self, leading: bool) {
        self.health.leader.store(leading, Ordering::SeqCst);
        if !leading {
            self.health.synced.store(false, Ordering::SeqCst);
        }
        self.metrics.leader.set(i64::from(leading));
    }

    /// Records that the leader's stores are synced.
    pub fn synced(&self) {
        self.health.synced.store(true, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_every_family_under_the_prefix() {
        let t = Telemetry::default();
        t.metrics.reconciled(Duration::from_millis(3), None);
        t.metrics.reconciled(Duration::from_millis(5), Some("kube"));
        t.metrics.stopped("NoCandidateNodes");
        t.metrics.planned("offload-sharded");
        t.metrics.scrape_failed("ns/a", 2);
        t.metrics.api_request("list", "nodes");
        t.metrics
            .api_request("patch", "diffusiondeployments/status");
        t.metrics
            .api_request("patch", "diffusiondeployments/status");
        t.lead(true);
        let text = t.metrics.encode();
        for want in [
            "layerwise_operator_reconciles_total 2",
            "layerwise_operator_reconcile_duration_seconds_count 2",
            "layerwise_operator_reconcile_errors_total{reason=\"kube\"} 1",
            "layerwise_operator_reconcile_stops_total{reason=\"NoCandidateNodes\"} 1",
            "layerwise_operator_plans_total{strategy=\"offload-sharded\"} 1",
            "layerwise_operator_autoscaler_scrape_failures_total{deployment=\"ns/a\"} 2",
            "layerwise_operator_leader 1",
            "layerwise_operator_api_requests_total{verb=\"list\",resource=\"nodes\"} 1",
        ] {
            assert!(text.contains(want), "no `{want}` in\n{text}");
        }
        assert_eq!(
            t.metrics
                .api_requests_of("patch", "diffusiondeployments/status"),
            2
        );
        t.metrics.forget("ns/a");
        assert!(!t.metrics.encode().contains("ns/a"));
    }

    #[test]
    fn a_standby_is_ready_a_leader_only_once_synced() {
        let t = Telemetry::default();
        assert!(t.health.ready().is_ok(), "standby");
        t.lead(true);
        assert!(t.health.ready().is_err(), "leading, not synced");
        t.synced();
        assert!(t.health.ready().is_ok(), "leading, synced");
        t.lead(false);
        assert!(!t.health.is_synced(), "stepping down forgets the sync");
        assert_eq!(t.metrics.leader.get(), 0);
    }
}
