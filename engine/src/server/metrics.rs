//! The server's Prometheus metrics, registered once into the registry `/metrics` serves.
//! The names are `crate::metric_names`', which the operator's autoscaler reads too: it
//! scrapes `layerwise_queue_depth` and `layerwise_running_requests` from here; both count
//! images (the unit ranks work in).

use std::sync::atomic::AtomicU64;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

use super::kind::Kind;
use crate::execution::pipeline::PipelineStats;
use crate::execution::work::PassReport;
use crate::metric_names as names;

type Labels = Vec<(String, String)>;

type FCounter = Counter<f64, AtomicU64>;
type FGauge = Gauge<f64, AtomicU64>;

fn rank_label(rank: usize) -> Labels {
    vec![("rank".into(), rank.to_string())]
}

/// Every metric the server exports.
pub struct Metrics {
    registry: Registry,
    started: Instant,
    pub queue_depth: Gauge,
    pub running: Gauge,
    pub ready: Gauge,
    finished: Family<Labels, Counter>,
    rejected: Family<Labels, Counter>,
    forwarded: Family<Labels, Counter>,
    pub request_seconds: Histogram,
    pub queue_wait_seconds: Histogram,
    pub step_seconds: Histogram,
    stall_seconds: Family<Labels, FCounter>,
    copied_bytes: Family<Labels, Counter>,
    gathered_bytes: Family<Labels, Counter>,
    device_bytes: Family<Labels, Gauge>,
    phase_peak_bytes: Family<Labels, Gauge>,
    busy_seconds: Family<Labels, FCounter>,
    busy_ratio: Family<Labels, FGauge>,
    requested: Family<Labels, Counter>,
    frames: Counter,
    video_seconds: FCounter,
    /// Per rank: pipeline counters at the last report, to export deltas.
    last: Mutex<Vec<(PipelineStats, f64)>>,
}

impl Metrics {
    pub fn new(dp: usize) -> Metrics {
        let mut registry = Registry::with_prefix(names::PREFIX);
        let m = Metrics {
            registry: Registry::default(),
            started: Instant::now(),
            queue_depth: Gauge::default(),
            running: Gauge::default(),
            ready: Gauge::default(),
            finished: Family::default(),
            rejected: Family::default(),
            forwarded: Family::default(),
            request_seconds: Histogram::new(names::LATENCY_BUCKETS),
            queue_wait_seconds: Histogram::new(names::LATENCY_BUCKETS),
            step_seconds: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            stall_seconds: Family::default(),
            copied_bytes: Family::default(),
            gathered_bytes: Family::default(),
            device_bytes: Family::default(),
            phase_peak_bytes: Family::default(),
            busy_seconds: Family::default(),
            busy_ratio: Family::default(),
            requested: Family::default(),
            frames: Counter::default(),
            video_seconds: FCounter::default(),
            last: Mutex::new(vec![(PipelineStats::default(), 0.0); dp]),
        };
        m.register_outputs(&mut registry);
        m.register_requests(&mut registry);
        m.register_ranks(&mut registry);
        registry.register(
            names::ENGINE_BUILD.short,
            "The engine's version and source revision",
            Info::new(names::build_info_labels()),
        );
        Metrics { registry, ..m }
    }

    /// What was asked for and made: outputs, frames and seconds of video.
    fn register_outputs(&self, registry: &mut Registry) {
        registry.register(
            names::OUTPUTS_REQUESTED.short,
            "Images and videos asked for, by modality",
            self.requested.clone(),
        );
        registry.register(
            names::FRAMES_GENERATED.short,
            "Frames decoded into finished outputs (an image is one frame)",
            self.frames.clone(),
        );
        registry.register(
            names::GENERATED_VIDEO_SECONDS.short,
            "Seconds of video finished (frames over the clip's frame rate)",
            self.video_seconds.clone(),
        );
    }

    /// The queue and the requests: what waits and runs, readiness, outcomes and latency.
    fn register_requests(&self, registry: &mut Registry) {
        registry.register(
            names::QUEUE_DEPTH.short,
            "Images waiting in the queue",
            self.queue_depth.clone(),
        );
        registry.register(
            names::RUNNING_REQUESTS.short,
            "Images being generated on a rank or decoded",
            self.running.clone(),
        );
        registry.register(
            names::READY.short,
            "1 when every rank can serve",
            self.ready.clone(),
        );
        registry.register(
            names::REQUESTS_FINISHED.short,
            "Requests finished, by outcome",
            self.finished.clone(),
        );
        registry.register(
            names::REQUESTS_REJECTED.short,
            "Requests refused before queueing, by reason",
            self.rejected.clone(),
        );
        registry.register(
            names::JOB_REQUESTS_FORWARDED.short,
            "Requests for a job another replica owns, sent on to it, by outcome",
            self.forwarded.clone(),
        );
        registry.register(
            names::REQUEST_DURATION_SECONDS.short,
            "End-to-end request latency (submit to last image)",
            self.request_seconds.clone(),
        );
        registry.register(
            names::QUEUE_WAIT_SECONDS.short,
            "Time an image waited in the queue before a rank took it",
            self.queue_wait_seconds.clone(),
        );
    }

    /// The ranks: steps, stalls, bytes moved and held, busy time.
    fn register_ranks(&self, registry: &mut Registry) {
        registry.register(
            names::STEP_DURATION_SECONDS.short,
            "Wall time of one denoising step on a rank",
            self.step_seconds.clone(),
        );
        registry.register(
            names::STALL_SECONDS.short,
            "Compute waiting for weights",
            self.stall_seconds.clone(),
        );
        registry.register(
            names::COPIED_BYTES.short,
            "Host-to-device weight bytes copied",
            self.copied_bytes.clone(),
        );
        registry.register(
            names::GATHERED_BYTES.short,
            "Weight bytes received by all-gather",
            self.gathered_bytes.clone(),
        );
        registry.register(
            names::DEVICE_BYTES.short,
            "Accounted device bytes per rank",
            self.device_bytes.clone(),
        );
        registry.register(
            names::PHASE_PEAK_BYTES.short,
            "Measured peak bytes of a phase above its start, per rank and phase (beside the activation reservation, layerwise_device_bytes)",
            self.phase_peak_bytes.clone(),
        );
        registry.register(
            names::RANK_BUSY_SECONDS.short,
            "Time a rank spent computing a request",
            self.busy_seconds.clone(),
        );
        registry.register(
            names::RANK_BUSY_RATIO.short,
            "Busy seconds over seconds since start, per rank",
            self.busy_ratio.clone(),
        );
    }

    pub fn finished(&self, outcome: &str) {
        self.finished
            .get_or_create(&vec![("outcome".into(), outcome.into())])
            .inc();
    }

    pub fn rejected(&self, reason: &str) {
        self.rejected
            .get_or_create(&vec![("reason".into(), reason.into())])
            .inc();
    }

    /// One request for another replica's job: `ok` (its answer came back, whatever its
    /// status), `replica_gone` or `replica_unreachable`.
    pub fn forwarded(&self, outcome: &str) {
        self.forwarded
            .get_or_create(&vec![("outcome".into(), outcome.into())])
            .inc();
    }

    /// Folds one rank's pass into the counters (rank threads call this).
    pub fn pass(&self, rank: usize, r: &PassReport) {
        let l = rank_label(rank);
        let mut last = self.last.lock().expect("metrics lock");
        let (prev, busy_total) = &mut last[rank];
        self.stall_seconds
            .get_or_create(&l)
            .inc_by(r.pipeline.stall.saturating_sub(prev.stall).as_secs_f64());
        self.copied_bytes
            .get_or_create(&l)
            .inc_by(r.pipeline.bytes_copied - prev.bytes_copied);
        self.gathered_bytes
            .get_or_create(&l)
            .inc_by(r.pipeline.bytes_gathered - prev.bytes_gathered);
        *prev = r.pipeline.clone();
        self.device_bytes
            .get_or_create(&l)
            .set(r.device_bytes as i64);
        for (phase, bytes) in &r.phase_peaks.0 {
            let mut l = rank_label(rank);
            l.push(("phase".into(), phase.name().into()));
            self.phase_peak_bytes.get_or_create(&l).set(*bytes as i64);
        }
        if r.busy {
            *busy_total += r.elapsed.as_secs_f64();
            self.busy_seconds
                .get_or_create(&l)
                .inc_by(r.elapsed.as_secs_f64());
        }
        let up = self.started.elapsed().as_secs_f64().max(1e-9);
        self.busy_ratio.get_or_create(&l).set(*busy_total / up);
    }

    /// A request for `n` outputs of `kind` was queued.
    pub fn requested(&self, kind: Kind, n: usize) {
        self.requested
            .get_or_create(&vec![("modality".into(), kind.label().into())])
            .inc_by(n as u64);
    }

    /// One output of `kind` with `frames` frames was finished.
    pub fn generated(&self, kind: Kind, frames: usize) {
        self.frames.inc_by(frames as u64);
        if let Kind::Video { fps } = kind {
            let seconds = frames as f64 / fps;
            self.video_seconds.inc_by(seconds);
        }
    }

    pub fn step(&self, took: Duration) {
        self.step_seconds.observe(took.as_secs_f64());
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exports_exactly_the_named_metrics() {
        // A scraper that matches `metric_names` finds every metric this registry holds
        // (a family is rendered once it has a series).
        let m = Metrics::new(1);
        m.finished("succeeded");
        m.rejected("queue_full");
        m.forwarded("ok");
        m.requested(Kind::Image, 1);
        let stats = PipelineStats::default();
        let mut peaks = crate::measure::PhasePeaks::default();
        peaks.record(crate::measure::PhaseKind::Transformer, 1);
        m.pass(
            0,
            &PassReport {
                busy: true,
                elapsed: Duration::from_millis(1),
                pipeline: &stats,
                device_bytes: 1,
                phase_peaks: &peaks,
            },
        );
        let text = m.render();
        let exported: std::collections::BTreeSet<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# HELP ")?.split(' ').next())
            .collect();
        let named: std::collections::BTreeSet<&str> = names::ALL.iter().map(|m| m.full).collect();
        assert_eq!(exported, named);
        assert_eq!(
            crate::exposition::lint(&text),
            Vec::<String>::new(),
            "{text}"
        );
    }

    #[test]
    fn renders_the_autoscaler_gauges_and_rank_counters() {
        let m = Metrics::new(2);
        m.queue_depth.set(3);
        m.finished("succeeded");
        let stats = PipelineStats {
            bytes_copied: 100,
            ..PipelineStats::default()
        };
        let mut peaks = crate::measure::PhasePeaks::default();
        peaks.record(crate::measure::PhaseKind::Transformer, 7);
        let r = PassReport {
            busy: true,
            elapsed: Duration::from_millis(5),
            pipeline: &stats,
            device_bytes: 42,
            phase_peaks: &peaks,
        };
        m.pass(1, &r);
        m.pass(1, &r);
        let text = m.render();
        assert!(text.contains("layerwise_queue_depth 3"), "{text}");
        assert!(text.contains("layerwise_running_requests 0"), "{text}");
        assert!(
            text.contains("layerwise_requests_finished_total{outcome=\"succeeded\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("layerwise_phase_peak_bytes{rank=\"1\",phase=\"transformer\"} 7"),
            "{text}"
        );
        assert!(
            text.contains("layerwise_copied_bytes_total{rank=\"1\"} 100"),
            "deltas, not sums: {text}"
        );
        assert!(
            text.contains("layerwise_device_bytes{rank=\"1\"} 42"),
            "{text}"
        );
    }
}
