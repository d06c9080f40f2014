//! `layerwise trace-svg`: draws a Chrome trace-event file of the pipeline as an SVG
//! timeline, one lane per rank and stream, so the overlap of copy, gather and compute
//! can be seen without a trace viewer.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::execution::trace::TraceFile;
use crate::{Error, Result};

const WIDTH: f64 = 1200.0;
const LEFT: f64 = 130.0;
const LANE: f64 = 22.0;
const TOP: f64 = 30.0;

fn color(cat: &str) -> &'static str {
    match cat {
        "copy" => "#4e79a7",
        "gather" => "#f28e2b",
        "compute" => "#59a14f",
        _ => "#9c9c9c",
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Renders the complete (`ph: "X"`) events of `json`, one lane per thread id.
pub fn render(json: &str) -> Result<String> {
    let f: TraceFile = serde_json::from_str(json)
        .map_err(|e| Error::invalid("trace", format!("not a trace-event file: {e}")))?;
    let mut names: BTreeMap<(u32, u32), String> = BTreeMap::new();
    for e in f
        .trace_events
        .iter()
        .filter(|e| e.ph == "M" && e.name == "thread_name")
    {
        if let Some(n) = e.args.get("name").and_then(|n| n.as_str()) {
            names.insert((e.pid, e.tid), n.to_string());
        }
    }
    let spans: Vec<_> = f.trace_events.iter().filter(|e| e.ph == "X").collect();
    if spans.is_empty() {
        return Err(Error::invalid(
            "trace",
            "no complete (\"X\") events to draw",
        ));
    }
    for s in &spans {
        names
            .entry((s.pid, s.tid))
            .or_insert_with(|| format!("pid {} tid {}", s.pid, s.tid));
    }
    let lanes: Vec<(u32, u32)> = names
        .keys()
        .copied()
        .filter(|k| spans.iter().any(|s| (s.pid, s.tid) == *k))
        .collect();
    let t0 = spans.iter().map(|s| s.ts).fold(f64::INFINITY, f64::min);
    let t1 = spans
        .iter()
        .map(|s| s.ts + s.dur.unwrap_or(0.0))
        .fold(f64::NEG_INFINITY, f64::max);
    let span_us = (t1 - t0).max(1.0);
    let x = |t: f64| LEFT + (t - t0) / span_us * (WIDTH - LEFT - 10.0);
    let height = TOP + LANE * lanes.len() as f64 + 30.0;
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        out,
        r##"<text x="{LEFT}" y="16">layerwise pipeline trace: {:.1} ms, {} spans (copy <tspan fill="{}">■</tspan> gather <tspan fill="{}">■</tspan> compute <tspan fill="{}">■</tspan>)</text>"##,
        span_us / 1e3,
        spans.len(),
        color("copy"),
        color("gather"),
        color("compute")
    );
    for (i, k) in lanes.iter().enumerate() {
        let y = TOP + LANE * i as f64;
        let fill = if i % 2 == 0 { "#f4f4f4" } else { "#ffffff" };
        let _ = writeln!(
            out,
            r#"<rect x="0" y="{y}" width="{WIDTH}" height="{LANE}" fill="{fill}"/>"#
        );
        let _ = writeln!(
            out,
            r#"<text x="6" y="{}">{}</text>"#,
            y + 15.0,
            escape(&names[k])
        );
    }
    for s in &spans {
        let i = lanes
            .iter()
            .position(|k| *k == (s.pid, s.tid))
            .expect("lane");
        let y = TOP + LANE * i as f64 + 3.0;
        let (a, b) = (x(s.ts), x(s.ts + s.dur.unwrap_or(0.0)));
        let _ = writeln!(
            out,
            r#"<rect x="{a:.2}" y="{y}" width="{:.2}" height="{}" fill="{}"><title>{} ({:.3} ms)</title></rect>"#,
            (b - a).max(0.5),
            LANE - 6.0,
            color(&s.cat),
            escape(&s.name),
            s.dur.unwrap_or(0.0) / 1e3
        );
    }
    let axis = TOP + LANE * lanes.len() as f64 + 14.0;
    for t in 0..=10 {
        let tu = t0 + span_us * t as f64 / 10.0;
        let _ = writeln!(
            out,
            r#"<text x="{:.1}" y="{axis}" text-anchor="middle">{:.1} ms</text>"#,
            x(tu),
            (tu - t0) / 1e3
        );
    }
    out.push_str("</svg>\n");
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::execution::trace::{Lane, Trace};

    #[test]
    fn one_lane_per_rank_and_stream() {
        let t = Trace::new(100);
        for r in 0..2 {
            for lane in Lane::ALL {
                t.record(r, lane, 0, t.now_us());
            }
        }
        let json = serde_json::to_string(&t.to_file()).unwrap();
        let svg = render(&json).unwrap();
        assert!(svg.starts_with("<svg"));
        for r in 0..2 {
            for l in ["copy", "gather", "compute"] {
                assert!(svg.contains(&format!(">rank {r} {l}</text>")), "{r} {l}");
            }
        }
        assert_eq!(svg.matches("<title>").count(), 6);
        assert!(render("{\"traceEvents\": []}").is_err());
    }
}
