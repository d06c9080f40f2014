//! Pipeline traces: every copy, gather and compute span of every rank, timed from inside
//! the streams' own work (host functions enqueued around the transfers, timestamps around
//! compute), written in Chrome's trace-event format so Perfetto opens them as they are.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The stream a span ran on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Lane {
    Copy,
    Gather,
    Compute,
}

impl Lane {
    pub const ALL: [Lane; 3] = [Lane::Copy, Lane::Gather, Lane::Compute];

    pub fn name(self) -> &'static str {
        match self {
            Lane::Copy => "copy",
            Lane::Gather => "gather",
            Lane::Compute => "compute",
        }
    }

    fn index(self) -> u32 {
        self as u32
    }
}

#[derive(Debug, Clone)]
struct Span {
    rank: u32,
    lane: Lane,
    block: u32,
    start_us: f64,
    dur_us: f64,
}

/// Collects spans from every rank and stream of one process (bounded: past `capacity`
/// spans it counts what it drops instead of growing).
pub struct Trace {
    origin: Instant,
    capacity: usize,
    spans: Mutex<Vec<Span>>,
    dropped: AtomicU64,
}

/// One trace event as Chrome's trace-event format writes it (the subset we use).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TraceEvent {
    pub name: String,
    #[serde(default)]
    pub cat: String,
    pub ph: String,
    #[serde(default)]
    pub ts: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dur: Option<f64>,
    pub pid: u32,
    pub tid: u32,
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub args: serde_json::Value,
}

/// A whole trace file.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TraceFile {
    pub trace_events: Vec<TraceEvent>,
    #[serde(default)]
    pub display_time_unit: String,
}

impl Trace {
    pub fn new(capacity: usize) -> Arc<Self> {
        Arc::new(Trace {
            origin: Instant::now(),
            capacity,
            spans: Mutex::new(Vec::new()),
            dropped: AtomicU64::new(0),
        })
    }

    /// Microseconds since the trace began.
    pub fn now_us(&self) -> f64 {
        self.origin.elapsed().as_secs_f64() * 1e6
    }

    /// Records a span that ran from `start_us` until now.
    pub fn record(&self, rank: usize, lane: Lane, block: usize, start_us: f64) {
        let end = self.now_us();
        let mut s = self.spans.lock().expect("trace lock");
        if s.len() >= self.capacity {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        s.push(Span {
            rank: rank as u32,
            lane,
            block: block as u32,
            start_us,
            dur_us: (end - start_us).max(0.0),
        });
    }

    pub fn len(&self) -> usize {
        self.spans.lock().expect("trace lock").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The spans so far in trace-event form: one process, one thread per rank and lane.
    pub fn to_file(&self) -> TraceFile {
        let spans = self.spans.lock().expect("trace lock").clone();
        let mut ranks: Vec<u32> = spans.iter().map(|s| s.rank).collect();
        ranks.sort_unstable();
        ranks.dedup();
        let mut events = Vec::new();
        for r in &ranks {
            for lane in Lane::ALL {
                events.push(TraceEvent {
                    name: "thread_name".into(),
                    cat: String::new(),
                    ph: "M".into(),
                    ts: 0.0,
                    dur: None,
                    pid: 0,
                    tid: r * 3 + lane.index(),
                    args: serde_json::json!({ "name": format!("rank {r} {}", lane.name()) }),
                });
            }
        }
        events.extend(spans.iter().map(|s| TraceEvent {
            name: format!("{} b{}", s.lane.name(), s.block),
            cat: s.lane.name().into(),
            ph: "X".into(),
            ts: s.start_us,
            dur: Some(s.dur_us),
            pid: 0,
            tid: s.rank * 3 + s.lane.index(),
            args: serde_json::json!({ "rank": s.rank, "block": s.block }),
        }));
        TraceFile {
            trace_events: events,
            display_time_unit: "ms".into(),
        }
    }

    /// Writes the trace as Chrome trace-event JSON.
    pub fn write(&self, path: &Path) -> Result<()> {
        let dropped = self.dropped.load(Ordering::Relaxed);
        if dropped > 0 {
            tracing::warn!(
                dropped,
                "trace capacity reached; later spans were not recorded"
            );
        }
        let json = serde_json::to_vec(&self.to_file())
            .map_err(|e| Error::internal("cannot serialise the trace", e))?;
        std::fs::write(path, json).map_err(|e| Error::io(path, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_become_complete_events_on_named_threads() {
        let t = Trace::new(2);
        let s = t.now_us();
        t.record(1, Lane::Gather, 3, s);
        t.record(0, Lane::Copy, 0, s);
        t.record(0, Lane::Copy, 1, s);
        let f = t.to_file();
        let x: Vec<_> = f.trace_events.iter().filter(|e| e.ph == "X").collect();
        assert_eq!(x.len(), 2, "capacity bounds the spans");
        assert_eq!(x[0].tid, 3 + 1);
        assert_eq!(x[0].name, "gather b3");
        assert!(f
            .trace_events
            .iter()
            .any(|e| e.ph == "M" && e.args["name"] == "rank 1 gather"));
        let back: TraceFile = serde_json::from_str(&serde_json::to_string(&f).unwrap()).unwrap();
        assert_eq!(back.trace_events.len(), f.trace_events.len());
    }
}
