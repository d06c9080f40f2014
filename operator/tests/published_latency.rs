//! The step-time model against published GPU measurements of the same models: the table of
//! docs/operations.md ("Predicted latency against published measurements"), each row
//! computed here from the model's published shapes (a sparse `synth --preset` folder's
//! profile, as an agent reports it), the product table's rates for the GPU measured (the
//! operator's `NodeShape::rates_for`) and the request measured (`Work::at_bounds` of its
//! workload), with the one step-time model the planner uses (`timing::predict_for`).
//!
//! The doc must show exactly these rows, so it cannot drift from the model: when the model
//! changes (a family's declared FLOPs, the product table), this test fails with the rows it
//! expects; `LAYERWISE_UPDATE_DOCS=1 cargo test -p layerwise-operator --test
//! published_latency` writes them into the doc.

#[path = "published/sparse.rs"]
mod sparse;

use std::path::Path;

use crds::Workload;
use layerwise_core::memory::Placement;
use layerwise_core::timing::{self, Work};
use layerwise_core::topology::Topology;
use layerwise_core::Strategy;
use layerwise_operator::planner::NodeShape;
use layerwise_operator::resources;

const BEGIN: &str =
    "<!-- published-latency:begin (operator/tests/published_latency.rs writes this table) -->";
const END: &str = "<!-- published-latency:end -->";

/// One published measurement: the model (its synth preset), the request, the GPU (as NVML
/// names it) and how many ran it, the seconds published, and the source.
struct Measured {
    model: &'static str,
    preset: &'static str,
    width: u64,
    height: u64,
    frames: u64,
    steps: u64,
    gpu: &'static str,
    gpus: usize,
    published_seconds: f64,
    source: &'static str,
}

const MEASURED: &[Measured] = &[
    Measured {
        model: "Wan 2.1 14B",
        preset: "wan2.1-14b",
        width: 832,
        height: 480,
        frames: 81,
        steps: 40,
        gpu: "NVIDIA H200",
        gpus: 1,
        published_seconds: 366.0,
        source: "[LightX2V benchmark](https://github.com/ModelTC/LightX2V/blob/main/docs/EN/source/getting_started/benchmark_source.md), H200, \"Wan2.1 Official\", I2V-14B-480P",
    },
    Measured {
        model: "Wan 2.1 14B",
        preset: "wan2.1-14b",
        width: 1280,
        height: 720,
        frames: 81,
        steps: 40,
        gpu: "NVIDIA H200",
        gpus: 1,
        published_seconds: 974.0,
        source: "[LightX2V benchmark](https://github.com/ModelTC/LightX2V/blob/main/docs/EN/source/getting_started/benchmark_source.md), H200, \"Wan2.1 Official\", I2V-14B-720P",
    },
    Measured {
        model: "Wan 2.1 1.3B",
        preset: "wan2.1-1.3b",
        width: 832,
        height: 480,
        frames: 81,
        steps: 50,
        gpu: "NVIDIA GeForce RTX 4090",
        gpus: 1,
        published_seconds: 240.0,
        source: "[Wan 2.1 README / model card](https://github.com/Wan-Video/Wan2.1#readme): \"a 5-second 480P video on an RTX 4090 in about 4 minutes\"",
    },
];

/// The request of `m`: one guided output at its size, Wan's 512 prompt tokens.
fn workload(m: &Measured) -> Workload {
    Workload {
        max_width: m.width,
        max_height: m.height,
        max_frames: m.frames,
        max_steps: m.steps,
        max_batch: 1,
        guidance: true,
        max_prompt_tokens: 512,
        ..Workload::default()
    }
}

/// The table's rows: the model's prediction of each measurement, resident on its GPUs
/// (the request split over them where more than one ran it).
fn rows(dir: &Path) -> Vec<String> {
    let mut profiles = std::collections::BTreeMap::new();
    MEASURED
        .iter()
        .map(|m| {
            let profile = profiles
                .entry(m.preset)
                .or_insert_with(|| sparse::published(dir, m.preset).1);
            let (rates, from) = NodeShape::rates_for(m.gpu, None);
            assert!(!from.fallback(), "{}: {from}", m.gpu);
            let work = Work::at_bounds(
                &profile.activation,
                &resources::request_bounds(&workload(m)),
            );
            let groups = &profile.groups;
            let placement = Placement::new(Strategy::Resident, m.gpus as u64, 0, groups.len());
            let predicted = timing::predict_for(
                groups,
                &profile.group_compute(),
                &work,
                &placement,
                &rates,
                Topology::new(1, m.gpus).unwrap(),
            )
            .request;
            let label = layerwise_core::timing::Product::find(m.gpu).unwrap().label;
            format!(
                "| {} | {}×{}×{}, {} steps, guidance | {} × {label} | {:.0} s | {:.0} s | {:.2} | {} |",
                m.model,
                m.width,
                m.height,
                m.frames,
                m.steps,
                m.gpus,
                m.published_seconds,
                predicted,
                predicted / m.published_seconds,
                m.source
            )
        })
        .collect()
}

fn table(rows: &[String]) -> String {
    let mut t = String::from(
        "| model | request | GPUs | published | predicted | predicted / published | source |\n|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        t.push_str(r);
        t.push('\n');
    }
    t
}

#[test]
fn the_doc_shows_the_models_prediction_beside_each_published_measurement() {
    let dir = tempfile::tempdir().unwrap();
    let expected = table(&rows(dir.path()));
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/operations.md");
    let doc = std::fs::read_to_string(&path).unwrap();
    let (Some(b), Some(e)) = (doc.find(BEGIN), doc.find(END)) else {
        panic!("docs/operations.md has no {BEGIN} ... {END} block");
    };
    let shown = doc[b + BEGIN.len()..e].trim_start_matches('\n');
    if shown == expected {
        return;
    }
    if std::env::var_os("LAYERWISE_UPDATE_DOCS").is_some() {
        let updated = format!("{}{BEGIN}\n{expected}{}", &doc[..b], &doc[e..]);
        std::fs::write(&path, updated).unwrap();
        return;
    }
    panic!(
        "docs/operations.md's published-latency table differs from the model's figures; \
         rerun with LAYERWISE_UPDATE_DOCS=1 to write them. Expected:\n{expected}"
    );
}
