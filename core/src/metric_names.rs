//! The names of the engine server's Prometheus metrics, defined once: the server registers
//! each under its short name (the registry adds the `layerwise_` prefix), and whoever reads
//! a pod's `/metrics` (the operator's autoscaler, the soak tool, the tests) matches the full
//! name from here. Compiled without any feature, so the operator reads them without the
//! compute runtime. Counters are exported with `_total` after the full name, as
//! OpenMetrics names them.
//!
//! The names follow Prometheus' conventions, which [`crate::exposition::lint`] checks on
//! every binary's `/metrics`: the base unit is the suffix (before `_total` on a counter),
//! a share is a `_ratio`, and no gauge pre-computes a rate that `rate()` over a counter
//! gives. Renamed in this scheme (the old names are gone; docs/operations.md lists them):
//! `bytes_copied_total` → `copied_bytes_total`, `bytes_gathered_total` →
//! `gathered_bytes_total`, `video_seconds_generated_total` →
//! `generated_video_seconds_total`, `rank_busy_fraction` → `rank_busy_ratio`, and
//! `video_seconds_per_second` dropped for `rate(layerwise_generated_video_seconds_total[1m])`.

/// The prefix the server's registry puts before every name (with an underscore).
pub const PREFIX: &str = "layerwise";

/// One metric's name: as registered (`short`) and as exported (`full`, with the prefix).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetricName {
    pub short: &'static str,
    pub full: &'static str,
}

macro_rules! metric_names {
    ($($(#[$doc:meta])* $id:ident = $name:literal;)*) => {
        $(
            $(#[$doc])*
            pub const $id: MetricName = MetricName {
                short: $name,
                full: concat!("layerwise_", $name),
            };
        )*
        /// Every metric the server exports.
        pub const ALL: &[MetricName] = &[$($id),*];
    };
}

metric_names! {
    /// Images and videos asked for, by modality (counter).
    OUTPUTS_REQUESTED = "outputs_requested";
    /// Frames decoded into finished outputs (counter).
    FRAMES_GENERATED = "frames_generated";
    /// Seconds of video finished (counter); `rate()` of it is seconds of video per second.
    GENERATED_VIDEO_SECONDS = "generated_video_seconds";
    /// Images waiting in the queue (gauge): half of the autoscaler's load.
    QUEUE_DEPTH = "queue_depth";
    /// Images being generated on a rank or decoded (gauge): the other half.
    RUNNING_REQUESTS = "running_requests";
    /// 1 when every rank can serve (gauge).
    READY = "ready";
    /// Requests finished, by outcome (counter).
    REQUESTS_FINISHED = "requests_finished";
    /// Requests refused before queueing, by reason (counter).
    REQUESTS_REJECTED = "requests_rejected";
    /// Requests for a job another replica owns, sent on to it, by outcome (counter).
    JOB_REQUESTS_FORWARDED = "job_requests_forwarded";
    /// End-to-end request latency (histogram, buckets to an hour: [`LATENCY_BUCKETS`]).
    REQUEST_DURATION_SECONDS = "request_duration_seconds";
    /// Time an image waited in the queue before a rank took it (histogram, the same
    /// buckets).
    QUEUE_WAIT_SECONDS = "queue_wait_seconds";
    /// Wall time of one denoising step on a rank (histogram).
    STEP_DURATION_SECONDS = "step_duration_seconds";
    /// Compute waiting for weights, per rank (counter).
    STALL_SECONDS = "stall_seconds";
    /// Host-to-device weight bytes copied, per rank (counter).
    COPIED_BYTES = "copied_bytes";
    /// Weight bytes received by all-gather, per rank (counter).
    GATHERED_BYTES = "gathered_bytes";
    /// Accounted device bytes, per rank (gauge).
    DEVICE_BYTES = "device_bytes";
    /// The most bytes a phase (text encoding, a denoising pass, the decode) held above its
    /// start, per rank and phase, measured (gauge).
    PHASE_PEAK_BYTES = "phase_peak_bytes";
    /// Time a rank spent computing a request (counter).
    RANK_BUSY_SECONDS = "rank_busy_seconds";
    /// Busy seconds over seconds since start, per rank (gauge, 0 to 1).
    RANK_BUSY_RATIO = "rank_busy_ratio";
    /// The engine's version and revision as labels, value 1 (info: exported as
    /// `layerwise_engine_build_info`, beside `layerwise_operator_build_info` and
    /// `layerwise_agent_build_info`, all from [`build_info_labels`]).
    ENGINE_BUILD = "engine_build";
}

/// Bucket bounds, in seconds, of the request latency and queue wait histograms: from a
/// tenth of a second (a small image on a free rank) to an hour (a long video behind a
/// queue), at bounds a person reads at a glance. Past the last bound is `+Inf`.
pub const LATENCY_BUCKETS: [f64; 20] = [
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 180.0, 300.0, 450.0, 600.0,
    900.0, 1200.0, 1800.0, 2700.0, 3600.0,
];

/// The labels of each binary's `_build_info` metric: the workspace version, and the
/// source revision when the build set `LAYERWISE_REVISION` (the image scripts do).
pub fn build_info_labels() -> Vec<(String, String)> {
    vec![
        ("version".into(), env!("CARGO_PKG_VERSION").into()),
        (
            "revision".into(),
            option_env!("LAYERWISE_REVISION")
                .unwrap_or("unknown")
                .into(),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_names_are_the_prefixed_short_ones_and_unique() {
        let mut seen = std::collections::HashSet::new();
        for m in ALL {
            assert_eq!(m.full, format!("{PREFIX}_{}", m.short));
            assert!(seen.insert(m.short), "{} twice", m.short);
        }
    }

    #[test]
    fn latency_buckets_rise_to_an_hour() {
        assert!(LATENCY_BUCKETS.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(LATENCY_BUCKETS[LATENCY_BUCKETS.len() - 1], 3600.0);
    }
}
