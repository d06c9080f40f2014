//! The agent's Prometheus metrics, registered once into the registry `/metrics` serves.

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

type FGauge = Gauge<f64, AtomicU64>;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabels {
    pub model: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    pub kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DeviceLabels {
    pub device: String,
    pub product: String,
}

pub struct Metrics {
    registry: Registry,
    pub bytes_warmed: Family<ModelLabels, Counter>,
    pub warm_throughput: Family<ModelLabels, FGauge>,
    pub resident_bytes: Family<ModelLabels, Gauge>,
    pub model_bytes: Family<ModelLabels, Gauge>,
    pub errors: Family<KindLabels, Counter>,
    pub host_available_bytes: Gauge,
    pub device_free_bytes: Family<DeviceLabels, Gauge>,
    pub pods_cgroup_usage_bytes: Gauge,
    pub prewarm_cgroup_usage_bytes: Gauge,
    /// Per model staged into the node model cache: bytes on disk, of the model, the rate,
    /// the ETA, and failed tries by reason.
    pub staged_bytes: Family<ModelLabels, Gauge>,
    pub staging_total_bytes: Family<ModelLabels, Gauge>,
    pub staging_rate: Family<ModelLabels, FGauge>,
    pub staging_eta_seconds: Family<ModelLabels, Gauge>,
    pub staging_failures: Family<ReasonLabels, Counter>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub model: String,
    pub reason: String,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut m = Metrics {
            registry: Registry::with_prefix("layerwise_agent"),
            bytes_warmed: Family::default(),
            warm_throughput: Family::default(),
            resident_bytes: Family::default(),
            model_bytes: Family::default(),
            errors: Family::default(),
            host_available_bytes: Gauge::default(),
            device_free_bytes: Family::default(),
            pods_cgroup_usage_bytes: Gauge::default(),
            prewarm_cgroup_usage_bytes: Gauge::default(),
            staged_bytes: Family::default(),
            staging_total_bytes: Family::default(),
            staging_rate: Family::default(),
            staging_eta_seconds: Family::default(),
            staging_failures: Family::default(),
        };
        let r = &mut m.registry;
        r.register(
            "warmed_bytes",
            "Bytes read into the page cache by prewarm",
            m.bytes_warmed.clone(),
        );
        r.register(
            "warm_throughput_bytes_per_second",
            "Throughput of the model's last prewarm",
            m.warm_throughput.clone(),
        );
        r.register(
            "resident_bytes",
            "Bytes of the model's files in the page cache (mincore)",
            m.resident_bytes.clone(),
        );
        r.register(
            "model_bytes",
            "Bytes of the model's files",
            m.model_bytes.clone(),
        );
        r.register("errors", "Errors by kind", m.errors.clone());
        r.register(
            "host_memory_available_bytes",
            "MemAvailable of the node",
            m.host_available_bytes.clone(),
        );
        r.register(
            "accelerator_memory_free_bytes",
            "Free memory per accelerator",
            m.device_free_bytes.clone(),
        );
        r.register(
            "pods_cgroup_usage_bytes",
            "Memory usage of the pods' cgroup",
            m.pods_cgroup_usage_bytes.clone(),
        );
        r.register(
            "prewarm_cgroup_usage_bytes",
            "Memory usage (page cache) of the prewarm cgroup",
            m.prewarm_cgroup_usage_bytes.clone(),
        );
        r.register(
            "staged_bytes",
            "Bytes of the model's copy in the node model cache",
            m.staged_bytes.clone(),
        );
        r.register(
            "staging_model_bytes",
            "Bytes of the model being staged, as the store lists them",
            m.staging_total_bytes.clone(),
        );
        r.register(
            "staging_rate_bytes_per_second",
            "Download rate of the model into the node model cache",
            m.staging_rate.clone(),
        );
        r.register(
            "staging_eta_seconds",
            "Seconds until the model's copy is complete, at the current rate",
            m.staging_eta_seconds.clone(),
        );
        r.register(
            "staging_failures",
            "Failed tries to stage the model, by reason",
            m.staging_failures.clone(),
        );
        r.register(
            "build",
            "The agent's version and source revision",
            Info::new(layerwise_core::metric_names::build_info_labels()),
        );
        m
    }

    pub fn model(id: &str) -> ModelLabels {
        ModelLabels {
            model: id.to_string(),
        }
    }

    /// Counts an error under its metric label.
    pub fn error(&self, e: &crate::Error) {
        self.errors
            .get_or_create(&KindLabels {
                kind: e.metric_label().into(),
            })
            .inc();
    }

    /// Records a model's staging status; a failed try counts once under its reason.
    pub fn staging(&self, id: &str, s: &crds::StagingStatus) {
        let l = Self::model(id);
        self.staged_bytes.get_or_create(&l).set(s.bytes as i64);
        self.staging_total_bytes
            .get_or_create(&l)
            .set(s.total_bytes as i64);
        self.staging_rate
            .get_or_create(&l)
            .set(s.bytes_per_second as f64);
        self.staging_eta_seconds
            .get_or_create(&l)
            .set(s.eta_seconds.unwrap_or(0) as i64);
        let failed = matches!(
            s.state,
            crds::StagingState::Retrying | crds::StagingState::Failed
        );
        if let (true, Some(reason)) = (failed, &s.reason) {
            self.staging_failures
                .get_or_create(&ReasonLabels {
                    model: id.into(),
                    reason: reason.clone(),
                })
                .inc();
        }
    }

    /// Forgets a model's series (it left the spec).
    pub fn remove_model(&self, id: &str) {
        let l = Self::model(id);
        self.staged_bytes.remove(&l);
        self.staging_total_bytes.remove(&l);
        self.staging_rate.remove(&l);
        self.staging_eta_seconds.remove(&l);
        self.bytes_warmed.remove(&l);
        self.warm_throughput.remove(&l);
        self.resident_bytes.remove(&l);
        self.model_bytes.remove(&l);
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_model_series_and_forgets_them() {
        let m = Metrics::new();
        m.bytes_warmed
            .get_or_create(&Metrics::model("ns/a"))
            .inc_by(42);
        m.error(&crate::Error::Worker("x".into()));
        let text = m.encode();
        assert!(
            text.contains("layerwise_agent_warmed_bytes_total{model=\"ns/a\"} 42"),
            "{text}"
        );
        assert!(
            text.contains("layerwise_agent_errors_total{kind=\"worker\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("layerwise_agent_build_info{version=\""),
            "{text}"
        );
        m.remove_model("ns/a");
        assert!(!m.encode().contains("ns/a"));
    }

    #[test]
    fn what_metrics_serves_passes_prometheus_rules() {
        // `/metrics` serves `encode()` as it is; every family gets a series first.
        let m = Metrics::new();
        let l = Metrics::model("ns/a");
        m.bytes_warmed.get_or_create(&l).inc_by(1);
        m.warm_throughput.get_or_create(&l).set(2.5);
        m.resident_bytes.get_or_create(&l).set(1);
        m.model_bytes.get_or_create(&l).set(1);
        m.staging(
            "ns/a",
            &crds::StagingStatus {
                state: crds::StagingState::Retrying,
                bytes: 10,
                total_bytes: 40,
                bytes_per_second: 5,
                eta_seconds: Some(6),
                reason: Some("AccessDenied".into()),
                ..Default::default()
            },
        );
        m.error(&crate::Error::Worker("x".into()));
        m.host_available_bytes.set(1);
        m.device_free_bytes
            .get_or_create(&DeviceLabels {
                device: "0".into(),
                product: "H100".into(),
            })
            .set(1);
        let text = m.encode();
        for series in [
            "layerwise_agent_staged_bytes{model=\"ns/a\"} 10",
            "layerwise_agent_staging_model_bytes{model=\"ns/a\"} 40",
            "layerwise_agent_staging_eta_seconds{model=\"ns/a\"} 6",
            "layerwise_agent_staging_failures_total{model=\"ns/a\",reason=\"AccessDenied\"} 1",
        ] {
            assert!(text.contains(series), "{series} in {text}");
        }
        assert_eq!(
            layerwise_core::exposition::lint(&text),
            Vec::<String>::new(),
            "{text}"
        );
    }
}
