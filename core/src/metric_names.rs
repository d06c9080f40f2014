//! The names of the engine server's Prometheus metrics, defined once: the server registers
//! each under its short name (the registry adds the `layerwise_` prefix), and whoever reads
//! a pod's `/metrics` (the operator's autoscaler, the soak tool, the tests) matches the full
//! name from here. Compiled without any feature, so the operator reads them without the
//! compute runtime. Counters are exported with `_total` after the full name, as
//! OpenMetrics names them.

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
    /// Seconds of video finished (counter).
    VIDEO_SECONDS_GENERATED = "video_seconds_generated";
    /// Seconds of video finished per second of wall time over the last minute (gauge).
    VIDEO_SECONDS_PER_SECOND = "video_seconds_per_second";
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
    /// End-to-end request latency (histogram).
    REQUEST_DURATION_SECONDS = "request_duration_seconds";
    /// Wall time of one denoising step on a rank (histogram).
    STEP_DURATION_SECONDS = "step_duration_seconds";
    /// Compute waiting for weights, per rank (counter).
    STALL_SECONDS = "stall_seconds";
    /// Host-to-device weight bytes copied, per rank (counter).
    BYTES_COPIED = "bytes_copied";
    /// Weight bytes received by all-gather, per rank (counter).
    BYTES_GATHERED = "bytes_gathered";
    /// Accounted device bytes, per rank (gauge).
    DEVICE_BYTES = "device_bytes";
    /// The most bytes a phase (text encoding, a denoising pass, the decode) held above its
    /// start, per rank and phase, measured (gauge).
    PHASE_PEAK_BYTES = "phase_peak_bytes";
    /// Time a rank spent computing a request (counter).
    RANK_BUSY_SECONDS = "rank_busy_seconds";
    /// Busy seconds over seconds since start, per rank (gauge).
    RANK_BUSY_FRACTION = "rank_busy_fraction";
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
}
