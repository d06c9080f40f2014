//! What the tests of the documented plans share: checkpoints of published shapes (the
//! engine's `synth` preset written sparse: headers and configs at full size, no weight
//! bytes) with their profile as an agent reports it, and the check that
//! docs/operations.md shows the planner's figures, and the check that a plan fits the engine's
//! own accounting.

use crds::{DiffusionDeployment, Plan};
use layerwise_core::contract::SlotsChoice;
use layerwise_core::decode::{DecodeChoice, DecodeSite};
use layerwise_core::memory::Placement;
use layerwise_core::slots::{choose_slots, DeviceNeeds};
use layerwise_engine::engine::Model;
use layerwise_engine::execution::cuda::plan::budget_capacity;
use layerwise_engine::execution::cuda::DeviceChoice;
use layerwise_operator::planner::NodeShape;
use layerwise_operator::resources;

mod sparse;
pub use sparse::published;

const MIB: u64 = 1 << 20;

/// The YAML of the DiffusionDeployment example of `doc` (docs/operations.md) that holds
/// `needle` (a line such as `family: wan\n`), as the doc writes it.
pub fn yaml_block<'a>(doc: &'a str, needle: &str) -> &'a str {
    doc.split("```yaml\n")
        .skip(1)
        .filter_map(|b| b.split_once("```").map(|(yaml, _)| yaml))
        .find(|yaml| yaml.contains(needle))
        .unwrap_or_else(|| panic!("docs/operations.md has a DiffusionDeployment with `{needle}`"))
}

/// [`yaml_block`] read as a DiffusionDeployment.
pub fn documented(doc: &str, needle: &str) -> DiffusionDeployment {
    serde_saphyr::from_str(yaml_block(doc, needle))
        .expect("the documented DiffusionDeployment parses")
}

/// Panics unless `doc` holds every one of `expected`, naming those it lacks.
pub fn assert_documented(doc: &str, expected: &[String]) {
    let missing: Vec<&str> = expected
        .iter()
        .map(String::as_str)
        .filter(|e| !doc.contains(e))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/operations.md lacks the planner's figures:\n{}",
        missing.join("\n")
    );
}

/// Checks `plan` against the engine's own accounting of the run it starts (`--dp`, `--sp`):
/// `Model::open` of the same folder, its block layouts sharded over dp × sp ranks, the
/// activations per rank its start check counts at the plan's sp, the decoder beside each
/// rank, and the slot choice the engine makes at start on a device of `node`'s size under
/// the plan's `LAYERWISE_DEVICE_MEMORY_MIB`.
/// Returns the engine's device bytes for weights.
pub fn engine_fits(model: &Model, dd: &DiffusionDeployment, node: &NodeShape, plan: &Plan) -> u64 {
    let strategy = plan.strategy;
    let groups = model.group_bytes().unwrap();
    let placement = Placement {
        resident_blocks: plan.resident_blocks,
        ..Placement::new(strategy, u64::from(plan.devices()), 0, groups.len())
            .with_resident_components(&groups, &plan.resident_components())
    }
    .with_component_blocks(&groups, &plan.resident_blocks_by_component);
    // The ranks of `serve` never hold the decoder: it runs beside them.
    let outside = model.family.resident_bytes(false);
    let needs = DeviceNeeds::of(&groups, &placement, outside);
    let k = u64::from(plan.slots);
    let b = &plan.device_breakdown;
    // A slot is the same bytes on both sides: one padded block of any streamed group.
    assert_eq!(k * needs.slot, b.slots, "{plan:?}");
    // Weights kept on the device: the engine charges exactly what the planner reserved.
    let weights = needs.fixed + k * needs.slot;
    let reserved = b.block_weights + b.slots + b.resident_weights;
    assert_eq!(weights, reserved, "engine {weights} vs planned {reserved}");
    // Activations of a request at the pod's bounds: the engine's formula gives the planner's.
    let act = resources::request_bounds(&dd.spec.workload)
        .activation_bytes_per_rank(
            &model.checkpoint.activation_cost(),
            u64::from(plan.sp),
            gpu_element(model),
        )
        .unwrap();
    assert_eq!(act, b.activations);
    // The decoder beside each rank where the plan has room for it: the engine's figure,
    // from the site the operator passes, is the planner's.
    let site = resources::decode_site(plan);
    let (_, decoder) = layerwise_engine::server::decode_placement(
        model,
        DecodeChoice::Fixed(site),
        DeviceChoice::Cpu,
        plan.devices() as usize,
        &resources::request_bounds(&dd.spec.workload),
        // The budget the pod's contract names (none: the engine's default).
        resources::engine_contract(&dd.spec, plan)
            .decode_budget
            .unwrap_or(layerwise_core::decode::DEFAULT_DECODE_BUDGET),
    )
    .unwrap();
    assert_eq!(decoder.total(), b.decoder);
    assert_eq!(
        site == DecodeSite::Device,
        decoder.weights > 0 && decoder.peak > 0
    );
    assert!(weights + act + b.overhead + b.decoder <= plan.device_bytes_per_rank);
    assert!(plan.device_bytes_per_rank <= node.device_bytes);
    // The engine starts: on a device of this size, free but for the decoder's weights
    // (loaded before the ranks measure), under the cap the operator passes, the plan's K
    // fits (the engine refuses to start otherwise).
    let cap = plan.device_bytes_per_rank.div_ceil(MIB) * MIB;
    let weights_cap = cap - act - b.overhead - decoder.total();
    let free = node.device_bytes - decoder.weights;
    let capacity = budget_capacity(
        free,
        node.device_bytes,
        Some(weights_cap),
        act + decoder.peak,
    );
    let k_engine = choose_slots(
        SlotsChoice::Fixed(plan.slots as usize),
        strategy,
        needs,
        capacity,
    )
    .unwrap_or_else(|e| panic!("the engine would not start {plan:?}: {e}"));
    assert_eq!(k_engine as u64, k);
    weights
}

/// The element the engine's ranks compute `model` in on a GPU under `--compute-dtype auto`,
/// from the engine's own layouts and family (the planner reads the profile's copies).
fn gpu_element(model: &Model) -> layerwise_core::compute_dtype::ComputeElement {
    layerwise_core::compute_dtype::ComputeElement::auto(
        layerwise_core::compute_dtype::Backend::Gpu,
        &model.group_bytes().unwrap(),
        model.checkpoint.compute_dtypes(),
    )
}
