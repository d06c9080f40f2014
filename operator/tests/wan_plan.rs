//! The video examples of docs/operations.md (Wan 2.2 A14B, Cosmos3-Super): each
//! DiffusionDeployment, planned from the real profile of a sparse `synth --preset ... --sparse`
//! folder (headers only, no weights read) on the node shapes the doc names. The doc's figures
//! are the planner's, and the engine's own accounting of the run each plan starts fits in what
//! the planner reserved.

mod published;

use std::path::{Path, PathBuf};

use crds::{ComponentPlacement, DiffusionDeployment, Plan, Profile, Strategy, StrategyChoice};
use layerwise_engine::engine::Model;
use layerwise_engine::tools::synth::{synth, SynthOptions};
use layerwise_operator::planner::{self, Limits, NodeShape, Overrides, Refusal, Shortage};
use layerwise_operator::resources;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn doc_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/operations.md")
}

/// The doc's Wan example: the YAML block that names `family: wan`.
fn documented_deployment(doc: &str) -> DiffusionDeployment {
    documented(doc, "wan")
}

/// The doc's example of `family`: the YAML block that names it.
fn documented(doc: &str, family: &str) -> DiffusionDeployment {
    published::documented(doc, &format!("family: {family}\n"))
}

/// The node shapes the doc plans on, as their agents report them.
fn nodes() -> [(NodeShape, &'static str); 2] {
    [
        (
            NodeShape {
                name: "a100-80gb".into(),
                devices: 8,
                // NVML's total for an A100-SXM4-80GB: 81,920 MiB.
                device_bytes: 81_920 * MIB,
                host_bytes: 1000 * GIB,
                fast_peer_link: true,
                warm: true,
                rates: NodeShape::rates_for("NVIDIA A100-SXM4-80GB", None).0,
                rates_from: NodeShape::rates_for("NVIDIA A100-SXM4-80GB", None).1,
            },
            "8 × A100-SXM4-80GB (81,920 MiB each, NVLink), 1000 GiB host",
        ),
        (
            NodeShape {
                name: "l4-24gb".into(),
                devices: 8,
                // NVML's total for an L4: 23,034 MiB; PCIe only.
                device_bytes: 23_034 * MIB,
                host_bytes: 384 * GIB,
                fast_peer_link: false,
                warm: true,
                rates: NodeShape::rates_for("NVIDIA L4", None).0,
                rates_from: NodeShape::rates_for("NVIDIA L4", None).1,
            },
            "8 × L4 (23,034 MiB each, PCIe only), 384 GiB host",
        ),
    ]
}

/// The 64 GB node the Cosmos3 example also plans on, as its agent reports it.
fn node_64gb() -> (NodeShape, &'static str) {
    (
        NodeShape {
            name: "accel-64gb".into(),
            devices: 8,
            device_bytes: 65_536 * MIB,
            host_bytes: 1536 * GIB,
            fast_peer_link: true,
            warm: true,
            rates: NodeShape::rates_for("accelerator", None).0,
            rates_from: NodeShape::rates_for("accelerator", None).1,
        },
        "8 × 64 GB accelerators (65,536 MiB each, fast peer link), 1536 GiB host",
    )
}

/// `1234567` as `1,234,567`.
fn grouped(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn bytes(n: u64) -> String {
    format!("{} ({:.2} GiB)", grouped(n), n as f64 / GIB as f64)
}

/// The doc's table row for `plan` of a `w`×`h`×`frames` workload on `node`, with the pods
/// of that plan one node holds (by accelerators and by host memory requests).
fn row(dd: &DiffusionDeployment, node: &NodeShape, label: &str, plan: &Plan) -> String {
    let w = &dd.spec.workload;
    // One page-cache copy of the model per node, then each pod's own bytes.
    let pods = (node.devices / plan.devices()).min(
        (node.host_bytes.saturating_sub(plan.host_bytes_per_node) / plan.host_bytes_per_pod) as u32,
    );
    format!(
        "| {}×{}×{} | {label} | `{}` | {} | {} | {} | {} | {pods} |",
        w.max_width,
        w.max_height,
        w.max_frames,
        plan.strategy.as_str(),
        dp_cell(plan),
        plan.slots,
        bytes(plan.device_bytes_per_rank),
        bytes(plan.host_bytes_per_pod)
    )
}

/// A plan's dp as the doc's tables print it: `dp × sp N` where it splits requests.
fn dp_cell(plan: &Plan) -> String {
    if plan.sp > 1 {
        format!("{} × sp {}", plan.dp, plan.sp)
    } else {
        plan.dp.to_string()
    }
}

/// The first two cells of the doc's per-plan rows: `dd`'s workload and `plan`'s shape.
fn plan_cells(dd: &DiffusionDeployment, plan: &Plan) -> String {
    let w = &dd.spec.workload;
    format!(
        "| {}×{}×{} | `{}` dp={}, {} slots |",
        w.max_width,
        w.max_height,
        w.max_frames,
        plan.strategy.as_str(),
        dp_cell(plan),
        plan.slots
    )
}

/// The doc's row of where `plan` keeps each component for `dd`'s workload.
fn placements(dd: &DiffusionDeployment, plan: &Plan) -> String {
    let names = |p: ComponentPlacement| {
        let v: Vec<String> = plan
            .components
            .iter()
            .filter(|c| c.placement == p)
            .map(|c| format!("`{}`", c.name))
            .collect();
        if v.is_empty() {
            "none".to_string()
        } else {
            v.join(", ")
        }
    };
    // Blocks kept per component where the counts differ, else the one count for all.
    let kept = if plan.resident_blocks_by_component.is_empty() {
        plan.resident_blocks.to_string()
    } else {
        let v: Vec<String> = plan
            .resident_blocks_by_component
            .iter()
            .map(|(c, n)| format!("`{c}` {n}"))
            .collect();
        v.join(", ")
    };
    format!(
        "{} {} | {} | {kept} |",
        plan_cells(dd, plan),
        names(ComponentPlacement::Resident),
        names(ComponentPlacement::Streamed),
    )
}

/// The doc's breakdown row (GiB) of `plan` for `dd`'s workload.
fn breakdown(dd: &DiffusionDeployment, plan: &Plan) -> String {
    let b = &plan.device_breakdown;
    let gib = |n: u64| format!("{:.2}", n as f64 / GIB as f64);
    format!(
        "{} {} | {} | {} | {} | {} | {} | {} |",
        plan_cells(dd, plan),
        gib(b.block_weights),
        gib(b.slots),
        gib(b.resident_weights),
        gib(b.activations),
        gib(b.overhead),
        gib(b.decoder),
        gib(plan.device_bytes_per_rank)
    )
}

/// Plans `dd` on `node` the way the controller does (the spec's overrides and allowances,
/// the operator's default limits).
fn plan_on(profile: &Profile, dd: &DiffusionDeployment, node: &NodeShape) -> Result<Plan, Refusal> {
    let spec = &dd.spec;
    planner::plan(
        profile,
        std::slice::from_ref(node),
        &spec.workload,
        &Overrides::of(spec),
        &Limits::default().for_spec(spec),
    )
}

#[test]
fn the_documented_wan_a14b_plans_are_the_planners_and_fit_the_engines_accounting() {
    let doc = std::fs::read_to_string(doc_path()).unwrap();
    let dd = documented_deployment(&doc);
    assert_eq!(dd.spec.model.family, "wan");
    let w = &dd.spec.workload;
    assert_eq!(
        (w.max_width, w.max_height, w.max_frames, w.max_steps),
        (1280, 720, 81, 50)
    );
    // The doc's second workload: the same deployment at 480p.
    let mut p480 = dd.clone();
    (p480.spec.workload.max_width, p480.spec.workload.max_height) = (832, 480);
    // And at 480p with `strategy: offload-sharded`: one pod over all of a node's devices.
    let mut p480_sharded = p480.clone();
    p480_sharded.spec.strategy = StrategyChoice::Fixed(Strategy::OffloadSharded);

    let dir = tempfile::tempdir().unwrap();
    let (out, profile) = published::published(dir.path(), "wan2.2-a14b");
    assert_eq!(profile.family, "wan");
    let model = Model::open(&out).unwrap();
    let mut expected = vec![
        format!("| `totalBytes` | {} |", grouped(profile.total_bytes)),
        format!(
            "{} × {}",
            profile.blocks,
            grouped(profile.largest_block_bytes)
        ),
        format!(
            "| `outsideBlockBytes` | {} |",
            grouped(profile.outside_block_bytes)
        ),
    ];

    let [a100, l4] = nodes();
    expected.extend(documented_rows(
        &model,
        &profile,
        &[
            (&dd, &a100, Some((Strategy::Sharded, 2, 2))),
            // Its activations exceed an L4, but a request split over 4 ranks fits, two
            // such groups sharding the blocks.
            (&dd, &l4, Some((Strategy::Sharded, 2, 2))),
            (&p480, &a100, Some((Strategy::Sharded, 2, 2))),
            (&p480, &l4, Some((Strategy::Offload, 1, 2))),
            (&p480_sharded, &l4, Some((Strategy::OffloadSharded, 8, 2))),
        ],
    ));
    published::assert_documented(&doc, &expected);
}

/// A workload beyond what the model itself runs is refused by the plan, as `serve` refuses
/// such bounds at start: the tiny Wan's rotary tables hold 32 positions per axis (512 px,
/// 125 frames), read by the agent into the profile. Both sides find the bound through the
/// one check (`RequestBounds::beyond`) and say the same thing; within it the plan is made.
#[test]
fn a_workload_beyond_the_models_position_tables_is_refused_as_the_engine_refuses_it() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("wan-tiny");
    synth(&out, &SynthOptions::preset("wan-tiny").unwrap()).unwrap();
    let profile = layerwise_engine::families::profile(&out).unwrap();
    assert_eq!(profile.limits.max_width, Some(512), "{:?}", profile.limits);
    let mut dd = documented_deployment(&std::fs::read_to_string(doc_path()).unwrap());
    let node = &nodes()[0].0;
    for (w, h, frames, field, flag) in [
        (1280, 512, 17, "maxWidth", "max-width"),
        (512, 720, 17, "maxHeight", "max-height"),
        (256, 256, 129, "maxFrames", "max-frames"),
    ] {
        let wl = &mut dd.spec.workload;
        (wl.max_width, wl.max_height, wl.max_frames) = (w, h, frames);
        let r = plan_on(&profile, &dd, node).unwrap_err();
        assert_eq!(r.shortage, Shortage::Spec, "{r}");
        assert_eq!(r.shortage.reason(), "InvalidSpec");
        let planned = r.to_string();
        assert!(
            planned.contains(&format!("workload.{field}")) && planned.contains("rope_max_seq_len"),
            "{planned}"
        );
        // The engine, given the bounds the operator would pass, refuses the same bound.
        let bounds = resources::request_bounds(&dd.spec.workload);
        let beyond = bounds.beyond(&profile.limits).unwrap();
        assert_eq!(beyond.dimension.flag(), flag);
        assert!(planned.contains(&beyond.to_string()), "{planned}");
    }
    let wl = &mut dd.spec.workload;
    (wl.max_width, wl.max_height, wl.max_frames) = (512, 512, 125);
    plan_on(&profile, &dd, node).unwrap();
}

/// A documented plan: its deployment, its node, and the plan expected (`None`: refused).
type Case<'a> = (
    &'a DiffusionDeployment,
    &'a (NodeShape, &'static str),
    Option<(Strategy, u32, u32)>,
);

/// Plans each of `cases` (a workload, a node, and the plan expected or `None` for a refusal
/// for lack of device memory), checks every plan against the engine's accounting, and returns
/// the doc lines the planner's figures make.
fn documented_rows(model: &Model, profile: &Profile, cases: &[Case]) -> Vec<String> {
    let mut expected = Vec::new();
    for (dd, (node, label), want) in cases {
        match (plan_on(profile, dd, node), want) {
            (Ok(plan), Some(want)) => {
                assert_eq!(
                    (plan.strategy, plan.dp, plan.slots),
                    *want,
                    "{label}: {:?}",
                    plan.reasons
                );
                let weights = published::engine_fits(model, dd, node, &plan);
                println!(
                    "{}\n{}\n  engine weights {weights} bytes per rank",
                    row(dd, node, label, &plan),
                    breakdown(dd, &plan)
                );
                println!("{}\n  {:?}", placements(dd, &plan), plan.reasons);
                expected.push(row(dd, node, label, &plan));
                expected.push(breakdown(dd, &plan));
                expected.push(placements(dd, &plan));
            }
            (Err(refusal), None) => {
                assert_eq!(refusal.shortage, Shortage::DeviceMemory, "{refusal}");
                println!("{label}: {refusal}");
                expected.push(refusal.to_string());
            }
            (got, want) => panic!("{label}: expected {want:?}, planned {got:?}"),
        }
    }
    expected
}

/// The design's own workload: Cosmos3-Super (124 GB of blocks, 128 of 930 MiB: each layer's
/// understanding and generation pathways) on 64 GB and 80 GB devices, for its three request
/// shapes (T2I 1024², T2V 832×480×29 and 1280×720×121).
#[test]
fn the_documented_cosmos3_super_plans_are_the_planners_and_fit_the_engines_accounting() {
    let doc = std::fs::read_to_string(doc_path()).unwrap();
    let dd = documented(&doc, "cosmos3");
    assert_eq!(dd.spec.model.family, "cosmos3");
    let w = &dd.spec.workload;
    assert_eq!((w.max_width, w.max_height, w.max_frames), (1280, 720, 121));
    let with = |width, height, frames| {
        let mut d = dd.clone();
        let wl = &mut d.spec.workload;
        (wl.max_width, wl.max_height, wl.max_frames) = (width, height, frames);
        d
    };
    let (t2i, t2v480) = (with(1024, 1024, 1), with(832, 480, 29));
    // The design's own strategy: weights in host memory, each rank copying 1/dp of a block.
    let mut streamed = dd.clone();
    streamed.spec.strategy = StrategyChoice::Fixed(Strategy::OffloadSharded);

    let dir = tempfile::tempdir().unwrap();
    let (out, profile) = published::published(dir.path(), "cosmos3-super");
    assert_eq!(profile.family, "cosmos3");
    assert_eq!(profile.blocks, 128);
    let model = Model::open(&out).unwrap();
    let mut expected = vec![
        format!("| `totalBytes` | {} |", grouped(profile.total_bytes)),
        format!(
            "{} × {}",
            profile.blocks,
            grouped(profile.largest_block_bytes)
        ),
        format!(
            "| `outsideBlockBytes` | {} |",
            grouped(profile.outside_block_bytes)
        ),
    ];
    let (a100, g64) = (nodes()[0].clone(), node_64gb());
    expected.extend(documented_rows(
        &model,
        &profile,
        &[
            (&t2i, &g64, COSMOS3_PLANS[0]),
            (&t2v480, &g64, COSMOS3_PLANS[1]),
            (&dd, &g64, COSMOS3_PLANS[2]),
            (&t2i, &a100, COSMOS3_PLANS[3]),
            (&t2v480, &a100, COSMOS3_PLANS[4]),
            (&dd, &a100, COSMOS3_PLANS[5]),
            (&streamed, &g64, COSMOS3_PLANS[6]),
            (&streamed, &a100, COSMOS3_PLANS[7]),
        ],
    ));
    published::assert_documented(&doc, &expected);
}

/// What the planner chooses for the Cosmos3 example's rows (strategy, dp, slots).
const COSMOS3_PLANS: [Option<(Strategy, u32, u32)>; 8] = [
    Some((Strategy::Sharded, 4, 2)),
    Some((Strategy::Sharded, 4, 2)),
    Some((Strategy::Sharded, 8, 2)),
    Some((Strategy::Sharded, 4, 2)),
    Some((Strategy::Sharded, 4, 2)),
    Some((Strategy::Sharded, 4, 2)),
    Some((Strategy::OffloadSharded, 8, 2)),
    Some((Strategy::OffloadSharded, 8, 2)),
];

/// The Qwen-Image example (`crds/examples/qwen-image.yaml`, in docs/operations.md): 60
/// transformer blocks of 648 MiB every step and a 15 GB text encoder once per request, for
/// 1024² images at 50 guided steps, on 80, 48 and 24 GB devices. The 80 GB device holds the
/// whole model; on the 48 GB one the memory left by the slots holds more transformer blocks
/// than the text encoder would buy back, so the plan streams the text encoder and keeps
/// transformer blocks: the step-time model's choice, with its reasons.
#[test]
fn the_documented_qwen_image_plans_are_the_planners_and_fit_the_engines_accounting() {
    let doc = std::fs::read_to_string(doc_path()).unwrap();
    let dd = documented(&doc, "qwen-image");
    let example: DiffusionDeployment = serde_saphyr::from_str(
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../crds/examples/qwen-image.yaml"),
        )
        .unwrap(),
    )
    .unwrap();
    assert_eq!(dd.spec, example.spec, "the doc shows the shipped example");
    let dir = tempfile::tempdir().unwrap();
    let (out, profile) = published::published(dir.path(), "qwen-image");
    assert_eq!(profile.family, "qwen-image");
    let model = Model::open(&out).unwrap();
    let [a100, l4] = nodes();
    let l40s = node_l40s();
    let mut expected = vec![format!(
        "| `totalBytes` | {} |",
        grouped(profile.total_bytes)
    )];
    expected.extend(documented_rows(
        &model,
        &profile,
        &[
            (&dd, &a100, QWEN_IMAGE_PLANS[0]),
            (&dd, &l40s, QWEN_IMAGE_PLANS[1]),
            (&dd, &l4, QWEN_IMAGE_PLANS[2]),
        ],
    ));
    let plan = plan_on(&profile, &dd, &l40s.0).unwrap();
    let kept = |c: &str| {
        plan.resident_blocks_by_component
            .get(c)
            .copied()
            .unwrap_or(plan.resident_blocks)
    };
    assert!(
        !plan
            .resident_components()
            .contains(&"text_encoder".to_string())
            && kept("transformer") > 0,
        "{:?}",
        plan.reasons
    );
    expected.extend(plan.reasons.iter().map(|r| format!("- `{r}`")));
    published::assert_documented(&doc, &expected);
}

/// What the planner chooses for the Qwen-Image example's rows (strategy, dp, slots).
const QWEN_IMAGE_PLANS: [Option<(Strategy, u32, u32)>; 3] = [
    Some((Strategy::Resident, 1, 0)),
    Some((Strategy::Sharded, 2, 2)),
    Some((Strategy::Sharded, 8, 2)),
];

/// A 48 GB PCIe node the Qwen-Image example also plans on, as its agent reports it.
fn node_l40s() -> (NodeShape, &'static str) {
    (
        NodeShape {
            name: "l40s-48gb".into(),
            devices: 8,
            // NVML's total for an L40S: 46,068 MiB; PCIe only.
            device_bytes: 46_068 * MIB,
            host_bytes: 512 * GIB,
            fast_peer_link: false,
            warm: true,
            rates: NodeShape::rates_for("NVIDIA L40S", None).0,
            rates_from: NodeShape::rates_for("NVIDIA L40S", None).1,
        },
        "8 × L40S (46,068 MiB each, PCIe only), 512 GiB host",
    )
}
