//! The operator and the engine agree on what a plan tells an engine: for plans of every
//! strategy, with and without sequence parallelism, kept blocks, resident components and a
//! decoder on the device, the engine container the operator writes is read back by the
//! engine's own arguments (its command line, and its environment through the flags that
//! read each name), and what they parse is the contract the operator rendered.

mod world;

use std::collections::BTreeMap;

use crds::{
    ComponentPlacement, ComponentPlan, DiffusionDeployment, MemoryBreakdown, Plan, Strategy,
};
use k8s_openapi::api::core::v1::Container;
use layerwise_core::contract::{parse_container, EngineContract, SlotsChoice};
use layerwise_core::decode::{DecodeChoice, DecodeSite};
use layerwise_operator::resources::{self, EnginePods};
use serde_json::json;
use world::deployment_manifest;

fn dd(workload: serde_json::Value, env: serde_json::Value) -> DiffusionDeployment {
    let extra = json!({ "workload": workload, "engine": { "env": env } });
    serde_json::from_value(deployment_manifest("wan", extra)).unwrap()
}

fn component(name: &str, placement: ComponentPlacement) -> ComponentPlan {
    ComponentPlan {
        name: name.into(),
        placement,
        block_bytes: 1 << 30,
    }
}

fn plan(strategy: Strategy, dp: u32, sp: u32, slots: u32) -> Plan {
    Plan {
        strategy,
        dp,
        sp,
        predicted_latency_seconds: None,
        latency_bound_met: None,
        resource_claim_template: None,
        slots,
        fast_peer_link: true,
        device_bytes_per_rank: (10 << 30) + 1,
        host_bytes_per_pod: 80 << 30,
        host_bytes_per_node: 60 << 30,
        resident_blocks: 0,
        resident_blocks_by_component: BTreeMap::new(),
        device_breakdown: MemoryBreakdown::default(),
        nodes: vec!["n0".into()],
        rates: None,
        components: vec![component("transformer", ComponentPlacement::Streamed)],
        reasons: Vec::new(),
        rejected: Vec::new(),
    }
}

/// The engine container the operator writes for `dd` under `plan`.
fn container(dd: &DiffusionDeployment, plan: &Plan) -> Container {
    let d = resources::deployment(dd, plan, 1, "engine:latest", &EnginePods::default(), &[]);
    let pod = d.spec.unwrap().template.spec.unwrap();
    pod.containers.into_iter().next().unwrap()
}

/// What the engine parses out of `c`: its command line and the environment entries with a
/// value (the job key and the pod's IP come from elsewhere and are no part of the plan).
fn parsed(c: &Container) -> EngineContract {
    let env: Vec<(String, String)> = c
        .env
        .iter()
        .flatten()
        .filter_map(|e| Some((e.name.clone(), e.value.clone()?)))
        .collect();
    parse_container(c.args.as_deref().unwrap(), &env)
        .unwrap_or_else(|e| panic!("the engine refuses {:?} {env:?}: {e}", c.args))
}

#[test]
fn the_engine_parses_the_contract_the_operator_renders() {
    let workload = json!({ "maxWidth": 832, "maxHeight": 480, "maxFrames": 81, "maxSteps": 40 });
    let unguided =
        json!({ "maxWidth": 1024, "maxHeight": 1024, "guidance": false, "maxPromptTokens": 226 });

    // Streaming with kept blocks, a component kept whole and the decoder on the device.
    let mut kept = plan(Strategy::OffloadSharded, 8, 1, 4);
    kept.resident_blocks = 3;
    kept.resident_blocks_by_component = BTreeMap::from([("transformer_2".into(), 20)]);
    kept.components
        .push(component("text_encoder", ComponentPlacement::Resident));
    kept.device_breakdown = MemoryBreakdown {
        decoder: 1 << 30,
        overhead: (1 << 30) + 5,
        ..MemoryBreakdown::default()
    };
    // Everything resident: no slots, decoding on the host.
    let resident = plan(Strategy::Resident, 2, 1, 0);
    // Sequence parallelism under offload, and sharded groups of sp ranks.
    let offload_sp = plan(Strategy::Offload, 1, 4, 3);
    let sharded_sp = plan(Strategy::Sharded, 4, 2, 2);

    let cases = [
        (dd(workload.clone(), json!([])), kept),
        (dd(unguided.clone(), json!([])), resident),
        (
            dd(
                workload,
                json!([{ "name": "LAYERWISE_LOG", "value": "debug" }]),
            ),
            offload_sp,
        ),
        (dd(unguided, json!([])), sharded_sp),
    ];
    for (dd, plan) in &cases {
        let rendered = resources::engine_contract(&dd.spec, plan);
        let c = container(dd, plan);
        assert_eq!(parsed(&c), rendered, "{:?}", plan.strategy);
    }

    // The contract is the plan's, not the engine's defaults.
    let (dd, plan) = &cases[0];
    let c = parsed(&container(dd, plan));
    assert_eq!(c.strategy, Strategy::OffloadSharded);
    assert_eq!(
        (c.run.dp, c.run.sp, c.run.slots),
        (8, 1, SlotsChoice::Fixed(4))
    );
    assert_eq!(c.run.resident_components, ["text_encoder"]);
    assert_eq!(c.run.device_memory_mib, Some(10 * 1024 + 1));
    assert_eq!(c.run.device_overhead_mib, 1025);
    assert_eq!(c.kept.resident_blocks_by_component.0["transformer_2"], 20);
    assert_eq!(c.decode, DecodeChoice::Fixed(DecodeSite::Device));
    assert_eq!(c.bounds.max_width, Some(832));
    assert_eq!(
        c.roots.model_roots,
        [std::path::PathBuf::from(resources::MODEL_MOUNT)]
    );
    let (dd, plan) = &cases[2];
    let c = parsed(&container(dd, plan));
    assert_eq!((c.strategy, c.run.sp), (Strategy::Offload, 4));
    assert_eq!(c.decode, DecodeChoice::Fixed(DecodeSite::Host));
    let (dd, plan) = &cases[3];
    assert!(!parsed(&container(dd, plan)).bounds.guidance_allowed);
}

/// A flag on the command line wins over the same value in the environment, as it does for
/// the engine: the spec's extra arguments can override what the plan set.
#[test]
fn the_command_line_wins_over_the_environment() {
    let dd = dd(json!({}), json!([]));
    let plan = plan(Strategy::Offload, 1, 1, 2);
    let mut c = container(&dd, &plan);
    c.args
        .as_mut()
        .unwrap()
        .extend(["--max-steps".into(), "7".into()]);
    assert_eq!(parsed(&c).bounds.max_steps, 7);
}
