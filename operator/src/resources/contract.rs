//! What an engine pod tells the engine: its plan as the engine's own contract
//! ([`EngineContract`]), rendered into the container's command line and environment, beside
//! the job routing every pod of a deployment shares and the spec's own arguments and
//! environment. No flag or environment name is written here: the contract renders them.

use std::net::{Ipv4Addr, SocketAddr};

use crds::{DiffusionDeployment, DiffusionDeploymentSpec, Plan, Workload};
use k8s_openapi::api::core::v1::{EnvVar, EnvVarSource, ObjectFieldSelector, SecretKeySelector};
use layerwise_core::bounds::RequestBounds;
use layerwise_core::contract::{
    self, BlocksByComponent, EngineContract, KeptArgs, ResidentBlocks, RootsArgs, RunArgs,
    SlotsChoice,
};
use layerwise_core::decode::{DecodeChoice, DecodeSite};

use super::objects::{job_key_secret_name, JOB_KEY};
use super::volumes::{model_path, MODEL_MOUNT};

/// The port the engine serves HTTP (requests, `/metrics`, probes) on.
pub const ENGINE_PORT: i32 = 8080;

/// The request bounds an engine pod enforces: the workload the planner sized it for.
pub fn request_bounds(w: &Workload) -> RequestBounds {
    RequestBounds {
        max_width: w.max_width,
        max_height: w.max_height,
        max_frames: w.max_frames,
        max_steps: w.max_steps,
        max_n: w.max_batch,
        guidance: w.guidance,
        max_prompt_tokens: w.max_prompt_tokens,
    }
}

/// Where `plan`'s pods decode: on the device exactly when it reserved the decoder there
/// ([`crate::planner::decoder_bytes`]).
pub fn decode_site(plan: &Plan) -> DecodeSite {
    if plan.device_breakdown.decoder > 0 {
        DecodeSite::Device
    } else {
        DecodeSite::Host
    }
}

/// What `spec`'s pods under `plan` tell the engine: the model at its mount, which its
/// files may not link out of; the plan's strategy, dp, sp, slots and kept blocks; the
/// workload's request bounds (the engine refuses requests beyond what the plan was sized
/// for); the plan's device budget and its terms (the engine checks its own need, the same
/// memory model, against it at start); and where the pods decode, the planner's decision,
/// which the budget reserves the decoder's bytes for (its `decoder` term is 0 where they
/// decode on the host).
pub fn engine_contract(spec: &DiffusionDeploymentSpec, plan: &Plan) -> EngineContract {
    EngineContract {
        run: RunArgs {
            model: model_path(spec),
            dp: plan.dp as usize,
            sp: plan.sp as usize,
            // A plan that streams nothing runs no slots: the engine's default stands.
            slots: if plan.strategy.streams() {
                SlotsChoice::Fixed(plan.slots as usize)
            } else {
                SlotsChoice::default()
            },
            device_memory_mib: Some(plan.device_bytes_per_rank.div_ceil(1 << 20)),
            device_overhead_mib: plan.device_breakdown.overhead.div_ceil(1 << 20),
            resident_components: plan.resident_components(),
        },
        kept: KeptArgs {
            resident_blocks: ResidentBlocks::Fixed(plan.resident_blocks as usize),
            resident_blocks_by_component: BlocksByComponent(
                plan.resident_blocks_by_component.clone(),
            ),
        },
        strategy: plan.strategy,
        bounds: request_bounds(&spec.workload).into(),
        decode: DecodeChoice::Fixed(decode_site(plan)),
        // The plan offered the decode the default budget and charged the split the
        // engine takes within it ([`layerwise_core::decode::device_decode`], both sides).
        decode_budget: None,
        roots: RootsArgs {
            model_roots: vec![MODEL_MOUNT.into()],
        },
        listen: SocketAddr::from((Ipv4Addr::UNSPECIFIED, ENGINE_PORT as u16)),
    }
}

/// The engine's command line: the contract's, then the spec's extra arguments.
pub(super) fn engine_args(spec: &DiffusionDeploymentSpec, plan: &Plan) -> Vec<String> {
    let mut args = engine_contract(spec, plan).argv();
    args.extend(spec.engine.extra_args.iter().cloned());
    args
}

/// The engine's environment: the job routing, the contract's, the drain grace (which the
/// pod's termination grace follows), the workload's step cache, then the spec's own.
pub(super) fn engine_env(dd: &DiffusionDeployment, plan: &Plan) -> Vec<EnvVar> {
    let spec = &dd.spec;
    let contract = engine_contract(spec, plan).env();
    let grace = (
        contract::ENV_GRACE_SECONDS,
        super::drain::grace_seconds(plan).to_string(),
    );
    // The workload's step cache, as `serve --cache` reads it.
    let cache = spec
        .workload
        .cache
        .as_ref()
        .map(|c| (layerwise_core::step_cache::ENV_CACHE, c.flag_value()));
    job_routing_env(dd)
        .into_iter()
        .chain(
            contract
                .into_iter()
                .chain([grace])
                .chain(cache)
                .map(|(name, value)| EnvVar {
                    name: name.into(),
                    value: Some(value),
                    ..Default::default()
                }),
        )
        .chain(spec.engine.env.iter().cloned())
        .collect()
}

/// The engine's job routing: the deployment's key from its Secret, and the pod's IP (what
/// the ids of its jobs name; the other replicas send requests for them there).
fn job_routing_env(dd: &DiffusionDeployment) -> [EnvVar; 2] {
    [
        EnvVar {
            name: contract::ENV_JOB_KEY.into(),
            value_from: Some(EnvVarSource {
                secret_key_ref: Some(SecretKeySelector {
                    name: job_key_secret_name(dd),
                    key: JOB_KEY.into(),
                    optional: Some(false),
                }),
                ..Default::default()
            }),
            ..Default::default()
        },
        EnvVar {
            name: contract::ENV_POD_IP.into(),
            value_from: Some(EnvVarSource {
                field_ref: Some(ObjectFieldSelector {
                    field_path: "status.podIP".into(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        },
    ]
}
