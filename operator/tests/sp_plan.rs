//! The sequence-parallelism example of docs/operations.md: one 1280×720×121-frame Wan 2.1
//! 14B request on a node of 80 GB devices, planned from the real profile of a sparse
//! `synth --preset wan2.1-14b --sparse` folder (headers only). The doc's figures for sp 1
//! and for the sp the planner chooses are the planner's, and the chosen plan's memory per
//! rank is the engine's own accounting of the run it starts: the activations per rank by
//! the engine's checkpoint and the formula its start check calls with `--sp`, the weights
//! by the engine's block layouts sharded over dp × sp ranks, and K by the engine's slot
//! choice under the budget the operator passes.

mod published;

use std::path::{Path, PathBuf};

use crds::{DiffusionDeployment, Plan, Profile};
use layerwise_engine::engine::Model;
use layerwise_operator::planner::{self, Limits, NodeShape, Overrides, Refusal};

const MIB: u64 = 1 << 20;
const GIB: f64 = (1u64 << 30) as f64;

fn doc() -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/operations.md"))
        .unwrap()
}

/// The doc's sequence-parallel example: the YAML block that sets `maxLatencySeconds`.
fn documented(doc: &str) -> DiffusionDeployment {
    published::documented(doc, "maxLatencySeconds:")
}

/// The node the doc plans on, as its agent reports it.
fn h100_node() -> NodeShape {
    let (rates, rates_from) = NodeShape::rates_for("NVIDIA H100 80GB HBM3", None);
    NodeShape {
        name: "h100-80gb".into(),
        devices: 8,
        // NVML's total for an H100 80GB HBM3: 81,559 MiB.
        device_bytes: 81_559 * MIB,
        host_bytes: 1000 << 30,
        fast_peer_link: true,
        warm: true,
        rates,
        rates_from,
    }
}

fn wan_14b(dir: &Path) -> (PathBuf, Profile) {
    published::published(dir, "wan2.1-14b")
}

fn plan_on(profile: &Profile, dd: &DiffusionDeployment, node: &NodeShape) -> Result<Plan, Refusal> {
    planner::plan(
        profile,
        std::slice::from_ref(node),
        &dd.spec.workload,
        &Overrides::of(&dd.spec),
        &Limits::default().for_spec(&dd.spec),
    )
}

/// The doc's row for one plan.
fn row(label: &str, p: &Plan) -> String {
    format!(
        "| {label} | `{}` | {} | {} | {} | {:.2} GiB | {:.2} GiB | {:.0} s | {} |",
        p.strategy.as_str(),
        p.dp,
        p.sp,
        p.slots,
        p.device_breakdown.activations as f64 / GIB,
        p.device_bytes_per_rank as f64 / GIB,
        p.predicted_latency_seconds.unwrap(),
        match p.latency_bound_met {
            Some(true) => "yes",
            Some(false) => "no",
            None => "no bound",
        }
    )
}

#[test]
fn the_documented_sequence_parallel_plan_is_the_planners_and_fits_the_engines_accounting() {
    let d = doc();
    let dd = documented(&d);
    let w = &dd.spec.workload;
    assert_eq!(dd.spec.model.family, "wan");
    assert_eq!(
        (w.max_width, w.max_height, w.max_frames, w.max_steps),
        (1280, 720, 121, 50)
    );
    assert_eq!(dd.spec.sp, None, "the example leaves sp to the planner");
    let bound = w
        .max_latency_seconds
        .expect("the example sets a latency bound");
    let dir = tempfile::tempdir().unwrap();
    let (out, profile) = wan_14b(dir.path());
    assert!(planner::splits_sequence(&profile));
    let model = Model::open(&out).unwrap();
    let node = h100_node();

    // The planner's choice: the fewest ranks per request that meet the bound.
    let chosen = plan_on(&profile, &dd, &node).unwrap();
    assert_eq!(chosen.sp, 2, "{:?}", chosen.reasons);
    assert_eq!(chosen.latency_bound_met, Some(true));
    assert!(chosen.predicted_latency_seconds.unwrap() <= bound);
    published::engine_fits(&model, &dd, &node, &chosen);
    // Without the bound: one rank per request (its activations fit one device), slower
    // than the bound.
    let mut unbounded = dd.clone();
    unbounded.spec.workload.max_latency_seconds = None;
    let alone = plan_on(&profile, &unbounded, &node).unwrap();
    assert_eq!(alone.sp, 1, "{:?}", alone.reasons);
    assert!(alone.predicted_latency_seconds.unwrap() > bound);
    published::engine_fits(&model, &unbounded, &node, &alone);
    // Each sp fixed, for the doc's comparison.
    let mut rows = vec![
        row("sp 1 (no bound)", &alone),
        row("auto, the bound", &chosen),
    ];
    for sp in [4, 8] {
        let mut fixed = dd.clone();
        fixed.spec.sp = Some(sp);
        let p = plan_on(&profile, &fixed, &node).unwrap();
        assert_eq!(p.sp, sp);
        published::engine_fits(&model, &fixed, &node, &p);
        rows.push(row(&format!("sp {sp} fixed"), &p));
    }
    let mut expected = rows;
    expected.push(format!("> {}", chosen.reasons[1]));
    published::assert_documented(&d, &expected);
}
