//! The one memory model, across the boundary: the planner's device bytes per rank for a
//! plan are exactly what the engine needs to run that plan. For each of the four strategies
//! a synthetic model runs on the CPU backend (which enforces its device budget as a GPU
//! would) with device memory capped at exactly the planner's figure, and runs; with one
//! byte less the engine refuses to start, naming both figures, and the planner refuses the
//! same node. Where the pods decode on the device (NVIDIA GPUs), the decoder's weights and
//! largest decode are in both figures; where they decode on the host, in neither.

use std::path::Path;

use crds::{DiffusionDeployment, Plan, Profile, Strategy, StrategyChoice};
use layerwise_core::checkpoint::F32_BYTES;
use layerwise_core::contract::{ResidentBlocks, SlotsChoice};
use layerwise_core::decode::{DecodeChoice, DecodeSite, DecoderBytes};
use layerwise_core::memory::Placement;
use layerwise_engine::engine::Model;
use layerwise_engine::execution::cuda::DeviceChoice;
use layerwise_engine::execution::rank::EngineOptions;
use layerwise_engine::execution::work::{Condition, Request};
use layerwise_engine::tools::synth::{synth, SynthOptions};
use layerwise_operator::planner::{self, Limits, NodeShape, Overrides, Shortage};
use layerwise_operator::resources;
use safetensors::Dtype;

const GIB: u64 = 1 << 30;

/// A deployment of `family` at a small workload, with the strategy (and dp, K) fixed, on
/// the default accelerator (NVIDIA GPUs).
fn deployment(family: &str, strategy: Strategy, dp: u32, frames: u64) -> DiffusionDeployment {
    deployment_sp(family, strategy, dp, 1, frames)
}

/// As [`deployment`], with `sp` ranks per request.
fn deployment_sp(
    family: &str,
    strategy: Strategy,
    dp: u32,
    sp: u32,
    frames: u64,
) -> DiffusionDeployment {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "layerwise.dev/v1alpha1",
        "kind": "DiffusionDeployment",
        "metadata": { "name": "budget", "namespace": "default" },
        "spec": {
            "model": { "family": family, "location": { "hostPath": "/models/m" } },
            "workload": {
                "maxWidth": 32, "maxHeight": 32, "maxFrames": frames, "maxSteps": 2,
                "maxBatch": 1, "guidance": true
            },
            "strategy": StrategyChoice::Fixed(strategy),
            "dp": dp,
            "sp": sp,
            "slots": 2,
        }
    }))
    .unwrap()
}

fn node(device_bytes: u64) -> NodeShape {
    NodeShape {
        name: "n".into(),
        devices: 4,
        device_bytes,
        host_bytes: 64 * GIB,
        fast_peer_link: true,
        warm: true,
        rates: layerwise_core::timing::Rates::DEFAULT,
        rates_from: "the default rates".into(),
    }
}

fn plan_on(
    profile: &Profile,
    dd: &DiffusionDeployment,
    device_bytes: u64,
) -> Result<Plan, planner::Refusal> {
    planner::plan(
        profile,
        &[node(device_bytes)],
        &dd.spec.workload,
        &Overrides::of(&dd.spec),
        &Limits::default().for_spec(&dd.spec),
    )
}

/// The profile as an agent reports it: through the DiffusionNode's JSON.
fn profile(dir: &Path) -> Profile {
    let p = layerwise_engine::families::profile(dir).unwrap();
    serde_json::from_value(serde_json::to_value(p).unwrap()).unwrap()
}

/// What the pod's decoder keeps on each rank's device: the engine's own figure
/// (`serve`'s), at the site the operator passes for the plan.
fn engine_decoder(model: &Model, dd: &DiffusionDeployment, plan: &Plan) -> DecoderBytes {
    let env: DecodeChoice = resources::decode_site(plan).to_string().parse().unwrap();
    layerwise_engine::server::decode_placement(
        model,
        env,
        DeviceChoice::Cpu,
        plan.dp as usize,
        &resources::request_bounds(&dd.spec.workload),
        // The budget the pod's contract names (none: the engine's default).
        resources::engine_contract(&dd.spec, plan)
            .decode_budget
            .unwrap_or(layerwise_core::decode::DEFAULT_DECODE_BUDGET),
    )
    .unwrap()
    .1
}

/// The engine options the operator's pod would start with for `plan`, with the device
/// budget `device_memory` in bytes.
fn engine_options(
    model: &Model,
    dd: &DiffusionDeployment,
    plan: &Plan,
    device_memory: u64,
) -> EngineOptions {
    let act = resources::request_bounds(&dd.spec.workload)
        .activation_bytes_per_rank(
            &model.checkpoint.activation_cost(),
            plan.sp as u64,
            gpu_element(model),
        )
        .unwrap();
    EngineOptions {
        decoder: engine_decoder(model, dd, plan),
        strategy: plan.strategy,
        dp: plan.dp as usize,
        sp: plan.sp as usize,
        slots: SlotsChoice::Fixed(plan.slots.max(2) as usize),
        device_memory,
        activations: act,
        overhead: plan.device_breakdown.overhead,
        resident_components: plan.resident_components(),
        resident_blocks: ResidentBlocks::Fixed(plan.resident_blocks as usize),
        resident_blocks_by_component: plan.resident_blocks_by_component.clone(),
        decode: false,
        ..EngineOptions::default()
    }
}

/// A request at the workload's bounds.
fn request(family: &str, frames: usize) -> Request {
    let condition = match family {
        "wan" => Condition::Prompt {
            prompt: "a red fox in the snow".into(),
            negative: None,
        },
        _ => Condition::Class(3),
    };
    Request {
        steps: 2,
        guidance: 3.0,
        frames,
        ..Request::image(condition, 32, 32)
    }
}

/// Plans `dd` for the model at `dir`, runs the plan at exactly its budget and one byte
/// under it, and checks the planner refuses one byte under it. Returns the plan.
fn exact_budget(dir: &Path, family: &str, dd: &DiffusionDeployment, frames: usize) -> Plan {
    let profile = profile(dir);
    let model = Model::open(dir).unwrap();
    let plan = plan_on(&profile, dd, 1 << 40).unwrap();
    let want = dd.spec.strategy;
    assert_eq!(
        plan.strategy.as_str(),
        serde_json::to_value(want).unwrap().as_str().unwrap()
    );
    let budget = plan.device_bytes_per_rank;
    let b = &plan.device_breakdown;
    assert_eq!(budget, b.total());
    // The decoder term: the engine's figure is the planner's, and there exactly when the
    // pods decode on the device.
    let decoder = engine_decoder(&model, dd, &plan);
    assert_eq!(b.decoder, decoder.total());
    let on_device = DecodeSite::for_resource(dd.spec.accelerator.resource()) == DecodeSite::Device;
    assert_eq!(b.decoder > 0, on_device, "{:?}", b);

    // At exactly the plan's bytes the engine runs, and its device accounting is the
    // plan's weights to the byte.
    let opts = engine_options(&model, dd, &plan, budget);
    let (_, stats) = model
        .run(vec![request(family, frames)], &opts)
        .unwrap_or_else(|e| panic!("{plan:?}: the engine refused the planned budget: {e}"));
    assert_eq!(
        stats.peak_device_bytes,
        b.block_weights + b.slots + b.resident_weights,
        "{} {:?}",
        plan.strategy.as_str(),
        stats.peak_device_bytes_by_kind
    );

    // One byte less: the engine refuses to start, naming its need and the budget.
    let e = model
        .run(
            vec![request(family, frames)],
            &engine_options(&model, dd, &plan, budget - 1),
        )
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("device-memory")
            && e.contains(&budget.to_string())
            && e.contains(&(budget - 1).to_string()),
        "{e}"
    );

    // And the planner refuses the node one byte short of this plan: nothing it would plan
    // there is this plan.
    match plan_on(&profile, dd, budget - 1) {
        Err(r) => assert_eq!(r.shortage, Shortage::DeviceMemory, "{r}"),
        Ok(p) => {
            assert_ne!(
                (
                    &p.components,
                    p.resident_blocks,
                    &p.resident_blocks_by_component,
                    p.slots,
                    p.device_breakdown.decoder
                ),
                (
                    &plan.components,
                    plan.resident_blocks,
                    &plan.resident_blocks_by_component,
                    plan.slots,
                    plan.device_breakdown.decoder
                ),
                "the same plan one byte short"
            );
            assert!(p.device_bytes_per_rank < budget);
        }
    }
    plan
}

#[test]
fn dit_plans_run_at_exactly_their_budget_for_every_strategy() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("tiny");
    synth(&dir, &SynthOptions::preset("tiny").unwrap()).unwrap();
    for (strategy, dp) in [
        (Strategy::Resident, 1),
        (Strategy::Sharded, 2),
        (Strategy::Offload, 1),
        (Strategy::OffloadSharded, 2),
    ] {
        let dd = deployment("dit", strategy, dp, 1);
        let plan = exact_budget(&dir, "dit", &dd, 1);
        // One group: nothing to keep resident beyond what the strategy keeps.
        assert!(plan.resident_components().is_empty());
    }
}

#[test]
fn wan_plans_run_at_exactly_their_budget_with_components_kept_resident() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("wan");
    // bf16 weights beside the f32 tables and norms Wan keeps: two regions per block.
    let mut o = SynthOptions::preset("wan-tiny").unwrap();
    o.dtype = Dtype::BF16;
    synth(&dir, &o).unwrap();
    for (strategy, dp) in [
        (Strategy::Resident, 1),
        (Strategy::Sharded, 2),
        (Strategy::Offload, 1),
        (Strategy::OffloadSharded, 2),
    ] {
        let dd = deployment("wan", strategy, dp, 5);
        let plan = exact_budget(&dir, "wan", &dd, 5);
        if plan.strategy == Strategy::Resident {
            continue;
        }
        // Room to spare: the plan keeps what its predicted time asks for (on a model this
        // small, whatever ties with the least memory; before the step-time model, every
        // component but the last and all but one of its blocks), and the engine ran it at
        // exactly its budget above.
        assert!(
            !plan.resident_components().is_empty()
                || plan.resident_blocks > 0
                || !plan.resident_blocks_by_component.is_empty(),
            "{:?}",
            plan.reasons
        );
    }
}

/// A request split across the ranks of a group: the planner's bytes per rank (its share
/// of the activations, the weights sharded over dp × sp ranks) are what the engine needs
/// to run the plan with `--sp`, for every strategy; one byte less and both refuse.
#[test]
fn sequence_parallel_plans_run_at_exactly_their_budget() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("wan");
    synth(&dir, &SynthOptions::preset("wan-tiny").unwrap()).unwrap();
    let whole = {
        let dd = deployment_sp("wan", Strategy::Offload, 1, 1, 9);
        plan_on(&profile(&dir), &dd, 1 << 40).unwrap()
    };
    for (strategy, dp) in [
        (Strategy::Resident, 1),
        (Strategy::Sharded, 1),
        (Strategy::Offload, 1),
        (Strategy::OffloadSharded, 2),
    ] {
        let dd = deployment_sp("wan", strategy, dp, 2, 9);
        let plan = exact_budget(&dir, "wan", &dd, 9);
        assert_eq!((plan.dp, plan.sp), (dp, 2), "{:?}", plan.reasons);
        // A rank holds its share of the transformer pass's activations; the text encoder
        // and the decoder stay whole, so the request's peak (the largest phase) shrinks
        // only where the pass is that phase.
        assert!(
            plan.device_breakdown.activations <= whole.device_breakdown.activations,
            "{} per rank at sp 2, {} at sp 1",
            plan.device_breakdown.activations,
            whole.device_breakdown.activations
        );
        let shape = resources::request_bounds(&dd.spec.workload).shape();
        let cost = profile(&dir).activation;
        let phases = |sp| cost.checked_phases(&shape, sp, F32_BYTES).unwrap();
        assert!(
            phases(2).transformer < phases(1).transformer,
            "the pass holds {} per rank at sp 2, {} at sp 1",
            phases(2).transformer,
            phases(1).transformer
        );
        assert_eq!(phases(2).text_encoder, phases(1).text_encoder);
        assert_eq!(plan.device_breakdown.activations, phases(2).peak());
    }
}

/// Blocks kept per component, as a plan names them, run in the engine with exactly the
/// device bytes the core's memory model gives the planner; a component the model does not
/// stream is refused, naming the flag.
#[test]
fn blocks_kept_per_component_cost_the_engine_what_the_planner_counts() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("wan");
    synth(&dir, &SynthOptions::preset("wan-tiny").unwrap()).unwrap();
    let model = Model::open(&dir).unwrap();
    let groups = model.group_bytes().unwrap();
    let by = layerwise_core::memory::parse_component_blocks("transformer=1").unwrap();
    let p =
        Placement::new(Strategy::Offload, 1, 2, groups.len()).with_component_blocks(&groups, &by);
    let outside = model.family.resident_bytes(false);
    let weights = layerwise_core::memory::device_bytes(&groups, &p, outside, 0, 0).weights();
    let uniform = Placement {
        resident_blocks: 1,
        ..Placement::new(Strategy::Offload, 1, 2, groups.len())
    };
    assert!(
        weights < layerwise_core::memory::device_bytes(&groups, &uniform, outside, 0, 0).weights()
    );
    let opts = |by: std::collections::BTreeMap<String, u64>| EngineOptions {
        strategy: Strategy::Offload,
        dp: 1,
        slots: SlotsChoice::Fixed(2),
        device_memory: weights,
        resident_blocks_by_component: by,
        decode: false,
        ..EngineOptions::default()
    };
    let (_, stats) = model
        .run(vec![request("wan", 5)], &opts(by.clone()))
        .unwrap();
    assert_eq!(
        stats.peak_device_bytes, weights,
        "{:?}",
        stats.peak_device_bytes_by_kind
    );
    let e = model
        .run(
            vec![request("wan", 5)],
            &opts(layerwise_core::memory::parse_component_blocks("vae=1").unwrap()),
        )
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("resident-blocks-by-component") && e.contains("vae"),
        "{e}"
    );
}

#[test]
fn a_plan_that_keeps_nothing_resident_also_runs_at_its_budget() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("wan");
    synth(&dir, &SynthOptions::preset("wan-tiny").unwrap()).unwrap();
    let dd = deployment("wan", Strategy::OffloadSharded, 2, 5);
    let profile = profile(&dir);
    // The smallest device the lean plan fits: the planner streams every component there.
    let lean = planner::need(
        &profile,
        planner::activation_bytes(&profile, &dd.spec.workload).unwrap(),
        planner::decoder_bytes(&profile, &dd.spec.workload, Limits::default().decode).unwrap(),
        &Placement::new(Strategy::OffloadSharded, 2, 2, profile.groups.len()),
        &Limits::default(),
    )
    .device
    .total();
    let plan = plan_on(&profile, &dd, lean).unwrap();
    assert!(plan.resident_components().is_empty(), "{:?}", plan.reasons);
    assert_eq!(plan.device_bytes_per_rank, lean);
    let model = Model::open(&dir).unwrap();
    model
        .run(
            vec![request("wan", 5)],
            &engine_options(&model, &dd, &plan, lean),
        )
        .unwrap();
    // One byte short, the decoder no longer fits beside the ranks: they decode on the host.
    let host = plan_on(&profile, &dd, lean - 1).unwrap();
    assert_eq!(host.device_breakdown.decoder, 0, "{:?}", host.reasons);
}

#[test]
fn pods_that_decode_on_the_host_reserve_nothing_for_the_decoder_on_either_side() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("tiny");
    synth(&dir, &SynthOptions::preset("tiny").unwrap()).unwrap();
    // An accelerator the engine has no backend for: its pods compute on the CPU backend,
    // which decodes on the host.
    let mut dd = deployment("dit", Strategy::OffloadSharded, 2, 1);
    dd.spec.accelerator.resource_name = Some("example.com/npu".into());
    assert_eq!(
        DecodeSite::for_resource(dd.spec.accelerator.resource()),
        DecodeSite::Host
    );
    let plan = exact_budget(&dir, "dit", &dd, 1);
    assert_eq!(plan.device_breakdown.decoder, 0);
    // The same deployment on NVIDIA GPUs: the decoder's bytes on top, and nothing else
    // changes.
    let gpu = exact_budget(
        &dir,
        "dit",
        &deployment("dit", Strategy::OffloadSharded, 2, 1),
        1,
    );
    let profile = profile(&dir);
    let want = planner::decoder_bytes(&profile, &dd.spec.workload, DecodeSite::Device).unwrap();
    assert_eq!(want.weights, profile.decoder_bytes);
    assert_eq!(gpu.device_breakdown.decoder, want.total());
    assert_eq!(
        gpu.device_bytes_per_rank,
        plan.device_bytes_per_rank + want.total()
    );
}

#[test]
fn where_the_decoder_does_not_fit_beside_the_ranks_the_pods_decode_on_the_host() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("tiny");
    synth(&dir, &SynthOptions::preset("tiny").unwrap()).unwrap();
    let dd = deployment("dit", Strategy::Offload, 1, 1);
    let profile = profile(&dir);
    let act = planner::activation_bytes(&profile, &dd.spec.workload).unwrap();
    let decoder = planner::decoder_bytes(&profile, &dd.spec.workload, DecodeSite::Device).unwrap();
    assert!(decoder.weights > 0 && decoder.peak > 0);
    // The leanest plan the spec allows (nothing kept on the device beyond two slots), with
    // and without the decoder beside the rank.
    let lean = |decoder| {
        planner::need(
            &profile,
            act,
            decoder,
            &Placement::new(Strategy::Offload, 1, 2, profile.groups.len()),
            &Limits::default(),
        )
        .device
        .total()
    };
    let gpu = plan_on(&profile, &dd, lean(decoder)).unwrap();
    assert_eq!(gpu.device_breakdown.decoder, decoder.total());
    assert_eq!(resources::decode_site(&gpu), DecodeSite::Device);
    // One byte short of it, the decoder does not fit beside the rank: the pods decode on
    // the host, and the reasons say why.
    let node = lean(decoder) - 1;
    let host = plan_on(&profile, &dd, node).unwrap();
    assert_eq!(host.device_breakdown.decoder, 0);
    assert_eq!(resources::decode_site(&host), DecodeSite::Host);
    assert!(host.device_bytes_per_rank <= node);
    assert!(
        host.reasons
            .iter()
            .any(|r| r.contains("decode on the host")),
        "{:?}",
        host.reasons
    );
    // And the engine runs it at exactly its budget, with nothing for the decoder.
    let model = Model::open(&dir).unwrap();
    let opts = engine_options(&model, &dd, &host, host.device_bytes_per_rank);
    assert_eq!(opts.decoder, DecoderBytes::default());
    model.run(vec![request("dit", 1)], &opts).unwrap();
    // Short of even that: refused.
    assert!(plan_on(&profile, &dd, lean(DecoderBytes::default()) - 1).is_err());
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
