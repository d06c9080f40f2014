//! The engine Deployment, Service and PodDisruptionBudget a DiffusionDeployment runs as,
//! built from its spec, its plan and what the platform gives every engine pod
//! ([`EnginePods`]). Pure: the controller applies what these return.

use std::collections::BTreeMap;

use crds::{DiffusionDeployment, DiffusionDeploymentSpec, Plan, Strategy, Workload};
use k8s_openapi::api::apps::v1::{
    Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment,
};
use k8s_openapi::api::core::v1::{
    Affinity, Capabilities, Container, ContainerPort, EmptyDirVolumeSource, EnvVar, EnvVarSource,
    HTTPGetAction, HostPathVolumeSource, Lifecycle, LifecycleHandler, LocalObjectReference,
    NodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, ObjectFieldSelector,
    PersistentVolumeClaimVolumeSource, PodResourceClaim, PodSecurityContext, PodSpec,
    PodTemplateSpec, PreferredSchedulingTerm, Probe, ResourceClaim, ResourceRequirements,
    SeccompProfile, Secret, SecretKeySelector, SecurityContext, Service, ServicePort, ServiceSpec,
    SleepAction, Toleration, TopologySpreadConstraint, Volume, VolumeMount,
};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::{Resource, ResourceExt};
use layerwise_core::bounds::{self, RequestBounds};
use layerwise_core::decode::{self, DecodeSite};

/// The port the engine serves HTTP (requests, `/metrics`, probes) on.
pub const ENGINE_PORT: i32 = 8080;
/// Where the model volume is mounted in the engine container.
pub const MODEL_MOUNT: &str = "/model";
/// Seconds a deleted engine pod keeps serving before it is sent SIGTERM: load balancers and
/// Service endpoints take a moment to stop sending it requests, and the engine stops
/// accepting on SIGTERM. Queued and running work then gets the engine's grace period.
pub const DRAIN_DELAY_SECONDS: i64 = 5;
/// The pod template annotation that records the plan (so a new plan rolls the pods).
pub const PLAN_ANNOTATION: &str = "layerwise.dev/plan";
const HOSTNAME: &str = "kubernetes.io/hostname";

/// What the platform gives every engine pod, whatever DiffusionDeployment it runs: the
/// chart's values, passed to the operator. Per-model settings are in the spec's `engine`
/// and `accelerator`; see [`deployment`] for how the two combine.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EnginePods {
    /// Secrets every engine pod pulls its image with (the chart's `imagePullSecrets`; each
    /// must exist in the namespace of the DiffusionDeployment).
    pub image_pull_secrets: Vec<String>,
    /// RuntimeClass of engine pods whose spec names none.
    pub runtime_class_name: Option<String>,
    /// Tolerations every engine pod carries (the taints of the platform's accelerator
    /// nodes), beside the spec's `accelerator.tolerations`.
    pub tolerations: Vec<Toleration>,
}

impl EnginePods {
    /// From the operator's flags as the chart passes them: secret names (empty ones
    /// dropped), a RuntimeClass (empty: none) and tolerations as a JSON list (empty: none).
    /// A toleration list that is not one is an error naming the flag.
    pub fn from_flags(
        image_pull_secrets: &[String],
        runtime_class_name: Option<&str>,
        tolerations: Option<&str>,
    ) -> Result<EnginePods, String> {
        let tolerations = match tolerations.map(str::trim).filter(|t| !t.is_empty()) {
            Some(json) => serde_json::from_str(json).map_err(|e| {
                format!("--engine-tolerations is not a JSON list of tolerations: {e}")
            })?,
            None => Vec::new(),
        };
        Ok(EnginePods {
            image_pull_secrets: image_pull_secrets
                .iter()
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect(),
            runtime_class_name: runtime_class_name
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(String::from),
            tolerations,
        })
    }
}

/// `a` then what of `b` is not in it already.
fn union<T: Clone + PartialEq>(a: &[T], b: &[T]) -> Vec<T> {
    let mut all = a.to_vec();
    for x in b {
        if !all.contains(x) {
            all.push(x.clone());
        }
    }
    all
}

/// What an engine Deployment's pod template was scheduled by: the plan summary it records,
/// the nodes it requires and the (warm) nodes it prefers; `None` when it has no plan.
pub fn scheduling_of(d: &Deployment) -> Option<(String, Vec<String>, Vec<String>)> {
    let template = &d.spec.as_ref()?.template;
    let summary = template
        .metadata
        .as_ref()?
        .annotations
        .as_ref()?
        .get(PLAN_ANNOTATION)?
        .clone();
    let affinity = template
        .spec
        .as_ref()?
        .affinity
        .as_ref()?
        .node_affinity
        .as_ref()?;
    let hostnames = |term: &NodeSelectorTerm| -> Vec<String> {
        term.match_expressions
            .iter()
            .flatten()
            .filter(|r| r.key == HOSTNAME && r.operator == "In")
            .flat_map(|r| r.values.clone().unwrap_or_default())
            .collect()
    };
    let required = affinity
        .required_during_scheduling_ignored_during_execution
        .as_ref()?
        .node_selector_terms
        .iter()
        .flat_map(&hostnames)
        .collect();
    let preferred = affinity
        .preferred_during_scheduling_ignored_during_execution
        .iter()
        .flatten()
        .flat_map(|t| hostnames(&t.preference))
        .collect();
    Some((summary, required, preferred))
}

/// Labels that select a deployment's engine pods.
pub fn selector_labels(dd: &DiffusionDeployment) -> BTreeMap<String, String> {
    BTreeMap::from([
        (
            "app.kubernetes.io/name".to_string(),
            "layerwise-engine".to_string(),
        ),
        (crate::stores::INSTANCE.to_string(), dd.name_any()),
    ])
}

/// The selector as a string, for the `/scale` subresource and list calls.
pub fn selector_string(dd: &DiffusionDeployment) -> String {
    selector_labels(dd)
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

fn labels(dd: &DiffusionDeployment) -> BTreeMap<String, String> {
    let mut l = selector_labels(dd);
    let (key, value) = crate::stores::MANAGED_BY;
    l.insert(key.into(), value.into());
    l
}

/// A one-line summary of the plan, recorded on the pod template. `sp` only where the plan
/// splits requests: the template of a plan without sequence parallelism is what it was
/// before sp existed, so an operator upgrade rolls no engine pod.
pub fn plan_summary(plan: &Plan) -> String {
    let sp = if plan.sp > 1 {
        format!(" sp={}", plan.sp)
    } else {
        String::new()
    };
    format!(
        "{} dp={}{sp} slots={}",
        plan.strategy.as_str(),
        plan.dp,
        plan.slots
    )
}

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

fn env(name: &str, value: impl ToString) -> EnvVar {
    EnvVar {
        name: name.into(),
        value: Some(value.to_string()),
        ..Default::default()
    }
}

fn http_probe(path: &str, period: i32, failures: i32) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.into()),
            port: IntOrString::String("http".into()),
            ..Default::default()
        }),
        period_seconds: Some(period),
        failure_threshold: Some(failures),
        timeout_seconds: Some(5),
        ..Default::default()
    }
}

/// The engine Deployment for `dd` under `plan`, with `replicas` pods, preferring `warm` nodes.
///
/// What the platform gives every engine pod (`platform`) and what the spec asks for this
/// model combine so: image pull secrets and tolerations are the platform's and then the
/// spec's (each once); the spec's RuntimeClass wins over the platform's; topology spread is
/// the spec's alone, a constraint without a label selector counting this model's pods.
pub fn deployment(
    dd: &DiffusionDeployment,
    plan: &Plan,
    replicas: i32,
    default_image: &str,
    platform: &EnginePods,
    warm: &[String],
) -> Deployment {
    let spec = &dd.spec;
    let engine = &spec.engine;
    let (volume, sub_path) = model_volume(spec);
    let mut pod_labels = engine.pod_labels.clone();
    pod_labels.extend(labels(dd));
    let mut pod_annotations = engine.pod_annotations.clone();
    pod_annotations.insert(PLAN_ANNOTATION.into(), plan_summary(plan));

    let container = engine_container(dd, plan, default_image, sub_path);

    let pull_secrets: Vec<LocalObjectReference> = union(
        &platform
            .image_pull_secrets
            .iter()
            .map(|name| LocalObjectReference { name: name.clone() })
            .collect::<Vec<_>>(),
        &engine.image_pull_secrets,
    );
    let tolerations = union(&platform.tolerations, &spec.accelerator.tolerations);
    let spread = topology_spread(dd);

    Deployment {
        metadata: owned_meta(dd),
        spec: Some(DeploymentSpec {
            replicas: Some(replicas),
            selector: LabelSelector {
                match_labels: Some(selector_labels(dd)),
                ..Default::default()
            },
            // Accelerators are scarce: replace pods one at a time without surging.
            strategy: Some(DeploymentStrategy {
                type_: Some("RollingUpdate".into()),
                rolling_update: Some(RollingUpdateDeployment {
                    max_surge: Some(IntOrString::Int(0)),
                    max_unavailable: Some(IntOrString::Int(1)),
                }),
            }),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(pod_labels),
                    annotations: Some(pod_annotations),
                    ..Default::default()
                }),
                spec: Some(PodSpec {
                    containers: vec![container],
                    volumes: Some(vec![
                        volume,
                        Volume {
                            name: "tmp".into(),
                            empty_dir: Some(EmptyDirVolumeSource::default()),
                            ..Default::default()
                        },
                    ]),
                    affinity: Some(Affinity {
                        node_affinity: Some(node_affinity(plan, warm)),
                        ..Default::default()
                    }),
                    node_selector: (!spec.accelerator.node_selector.is_empty())
                        .then(|| spec.accelerator.node_selector.clone()),
                    tolerations: (!tolerations.is_empty()).then_some(tolerations),
                    image_pull_secrets: (!pull_secrets.is_empty()).then_some(pull_secrets),
                    runtime_class_name: engine
                        .runtime_class_name
                        .clone()
                        .or_else(|| platform.runtime_class_name.clone()),
                    topology_spread_constraints: (!spread.is_empty()).then_some(spread),
                    security_context: Some(PodSecurityContext {
                        run_as_non_root: Some(true),
                        run_as_user: Some(65532),
                        run_as_group: Some(65532),
                        seccomp_profile: Some(SeccompProfile {
                            type_: "RuntimeDefault".into(),
                            ..Default::default()
                        }),
                        ..Default::default()
                    }),
                    service_account_name: engine.service_account_name.clone(),
                    automount_service_account_token: Some(false),
                    priority_class_name: engine.priority_class_name.clone(),
                    resource_claims: device_claims(plan),
                    termination_grace_period_seconds: Some(60),
                    ..Default::default()
                }),
            },
            ..Default::default()
        }),
        status: None,
    }
}

/// The engine's command line: `serve` under the plan's strategy, dp, sp and slots, then
/// the spec's extra arguments. `--sp` is passed where the plan splits requests (sp > 1):
/// an engine without sequence parallelism then refuses to start rather than run one rank
/// per request against a budget sized for a share of the activations.
fn engine_args(spec: &DiffusionDeploymentSpec, plan: &Plan) -> Vec<String> {
    let engine = &spec.engine;
    let mut args = vec![
        "serve".to_string(),
        "--model".into(),
        MODEL_MOUNT.into(),
        // A file of the model that links out of its mount (to the container's own files)
        // is refused.
        "--model-roots".into(),
        MODEL_MOUNT.into(),
        "--strategy".into(),
        plan.strategy.as_str().into(),
        "--dp".into(),
        plan.dp.to_string(),
    ];
    if plan.sp > 1 {
        args.extend(["--sp".into(), plan.sp.to_string()]);
    }
    if plan.strategy != Strategy::Resident {
        args.extend(["--slots".into(), plan.slots.to_string()]);
    }
    args.extend(["--listen".into(), format!("0.0.0.0:{ENGINE_PORT}")]);
    args.extend(engine.extra_args.iter().cloned());
    args
}

/// The engine's environment: the workload's request bounds, the plan's device budget and
/// its decisions (decode site, resident components and blocks), then the spec's own.
fn engine_env(spec: &DiffusionDeploymentSpec, plan: &Plan) -> Vec<EnvVar> {
    let engine = &spec.engine;
    // The engine refuses requests beyond the workload the plan was sized for.
    let mut envs: Vec<EnvVar> = request_bounds(&spec.workload)
        .env()
        .iter()
        .map(|(name, value)| env(name, value))
        .collect();
    // The plan's device budget and its terms: the engine checks its own need (the same
    // memory model) against it at start and refuses to start if it is larger.
    envs.push(env(
        bounds::ENV_DEVICE_MEMORY_MIB,
        plan.device_bytes_per_rank.div_ceil(1 << 20),
    ));
    envs.push(env(
        bounds::ENV_DEVICE_OVERHEAD_MIB,
        plan.device_breakdown.overhead.div_ceil(1 << 20),
    ));
    // Where the pods decode: the planner's decision, which the budget above reserves the
    // decoder's bytes for (its `decoder` term is 0 where they decode on the host).
    envs.push(env(decode::ENV_DECODE, decode_site(plan)));
    let resident = plan.resident_components();
    if !resident.is_empty() {
        envs.push(env(bounds::ENV_RESIDENT_COMPONENTS, resident.join(",")));
    }
    if plan.resident_blocks > 0 {
        envs.push(env(bounds::ENV_RESIDENT_BLOCKS, plan.resident_blocks));
    }
    if !plan.resident_blocks_by_component.is_empty() {
        envs.push(env(
            bounds::ENV_RESIDENT_BLOCKS_BY_COMPONENT,
            layerwise_core::memory::format_component_blocks(&plan.resident_blocks_by_component),
        ));
    }
    envs.extend(engine.env.iter().cloned());
    envs
}

/// The name of an engine pod's claim on its devices (where it claims them by Dynamic
/// Resource Allocation), and of the one device request of the templates the operator
/// generates ([`crate::dra`]).
pub const DEVICE_CLAIM: &str = "accelerators";

/// The engine container's resources: the spec's, with the plan's accelerators and memory
/// in place of anything it says for them. Where the pods claim their devices by DRA
/// (the plan names a ResourceClaimTemplate), the container takes the pod's claim instead
/// of an extended resource.
fn engine_resources(spec: &DiffusionDeploymentSpec, plan: &Plan) -> ResourceRequirements {
    let engine = &spec.engine;
    let resource = spec.accelerator.resource().to_string();
    let claimed = plan.resource_claim_template.is_some();
    // The plan's accelerators and memory win over anything the spec says for them.
    let mut res = engine.resources.clone().unwrap_or_default();
    // The request is what the pod needs of its own; the model's page-cache copy is one per
    // node, shared by its pods (the planner checks the node holds it). The limit leaves room
    // for the mapped pages a pod faults in itself (a cold cache), which are charged to it.
    // dp groups of sp ranks, one accelerator each.
    let accel = Quantity(plan.devices().to_string());
    let requests = res.requests.get_or_insert_with(BTreeMap::new);
    requests
        .entry("cpu".into())
        .or_insert_with(|| Quantity("1".into()));
    requests.insert(
        "memory".into(),
        Quantity(plan.host_bytes_per_pod.to_string()),
    );
    if claimed {
        requests.remove(&resource);
    } else {
        requests.insert(resource.clone(), accel.clone());
    }
    let limits = res.limits.get_or_insert_with(BTreeMap::new);
    limits.insert(
        "memory".into(),
        Quantity(
            plan.host_bytes_per_pod
                .saturating_add(plan.host_bytes_per_node)
                .to_string(),
        ),
    );
    if claimed {
        limits.remove(&resource);
        res.claims = Some(vec![ResourceClaim {
            name: DEVICE_CLAIM.into(),
            request: None,
        }]);
    } else {
        limits.insert(resource, accel);
    }
    res
}

/// The pod's claim on its devices, where the plan names the ResourceClaimTemplate it
/// claims them through.
fn device_claims(plan: &Plan) -> Option<Vec<PodResourceClaim>> {
    let template = plan.resource_claim_template.as_ref()?;
    Some(vec![PodResourceClaim {
        name: DEVICE_CLAIM.into(),
        resource_claim_template_name: Some(template.clone()),
        resource_claim_name: None,
    }])
}

/// The model's volume (its hostPath, or its claim read-only) and the sub-path mounted.
fn model_volume(spec: &DiffusionDeploymentSpec) -> (Volume, Option<String>) {
    match (
        &spec.model.location.host_path,
        &spec.model.location.persistent_volume_claim,
    ) {
        (Some(path), _) => (
            Volume {
                name: "model".into(),
                host_path: Some(HostPathVolumeSource {
                    path: path.clone(),
                    type_: Some("Directory".into()),
                }),
                ..Default::default()
            },
            None,
        ),
        (None, pvc) => {
            let pvc = pvc.clone().unwrap_or_default();
            (
                Volume {
                    name: "model".into(),
                    persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                        claim_name: pvc.claim_name,
                        read_only: Some(true),
                    }),
                    ..Default::default()
                },
                pvc.sub_path,
            )
        }
    }
}

/// Pods go only to the plan's nodes, preferring those where the model is already `warm`.
fn node_affinity(plan: &Plan, warm: &[String]) -> NodeAffinity {
    let mut affinity = NodeAffinity {
        required_during_scheduling_ignored_during_execution: Some(NodeSelector {
            node_selector_terms: vec![NodeSelectorTerm {
                match_expressions: Some(vec![NodeSelectorRequirement {
                    key: HOSTNAME.into(),
                    operator: "In".into(),
                    values: Some(plan.nodes.clone()),
                }]),
                ..Default::default()
            }],
        }),
        ..Default::default()
    };
    if !warm.is_empty() {
        affinity.preferred_during_scheduling_ignored_during_execution =
            Some(vec![PreferredSchedulingTerm {
                weight: 100,
                preference: NodeSelectorTerm {
                    match_expressions: Some(vec![NodeSelectorRequirement {
                        key: HOSTNAME.into(),
                        operator: "In".into(),
                        values: Some(warm.to_vec()),
                    }]),
                    ..Default::default()
                },
            }]);
    }
    affinity
}

/// The engine container: the image, command, environment, probes, the model and /tmp
/// mounts, and the restricted security context.
fn engine_container(
    dd: &DiffusionDeployment,
    plan: &Plan,
    default_image: &str,
    sub_path: Option<String>,
) -> Container {
    let spec = &dd.spec;
    let engine = &spec.engine;
    Container {
        name: "engine".into(),
        image: Some(
            engine
                .image
                .clone()
                .unwrap_or_else(|| default_image.to_string()),
        ),
        image_pull_policy: engine.image_pull_policy.clone(),
        command: Some(vec!["layerwise".into()]),
        args: Some(engine_args(spec, plan)),
        env: Some(
            job_routing_env(dd)
                .into_iter()
                .chain(engine_env(spec, plan))
                .collect(),
        ),
        ports: Some(vec![ContainerPort {
            name: Some("http".into()),
            container_port: ENGINE_PORT,
            ..Default::default()
        }]),
        resources: Some(engine_resources(spec, plan)),
        volume_mounts: Some(vec![
            VolumeMount {
                name: "model".into(),
                mount_path: MODEL_MOUNT.into(),
                read_only: Some(true),
                sub_path,
                ..Default::default()
            },
            VolumeMount {
                name: "tmp".into(),
                mount_path: "/tmp".into(),
                ..Default::default()
            },
        ]),
        readiness_probe: Some(http_probe("/readyz", 5, 3)),
        liveness_probe: Some(http_probe("/healthz", 10, 3)),
        // Mapping and (for resident/sharded) uploading a large model takes a while.
        startup_probe: Some(http_probe("/healthz", 5, 360)),
        lifecycle: Some(Lifecycle {
            pre_stop: Some(LifecycleHandler {
                sleep: Some(SleepAction {
                    seconds: DRAIN_DELAY_SECONDS,
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            privileged: Some(false),
            read_only_root_filesystem: Some(true),
            run_as_non_root: Some(true),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".into()]),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The spec's topology spread, a constraint without a label selector counting this model's
/// pods.
fn topology_spread(dd: &DiffusionDeployment) -> Vec<TopologySpreadConstraint> {
    dd.spec
        .engine
        .topology_spread_constraints
        .iter()
        .map(|c| TopologySpreadConstraint {
            label_selector: c.label_selector.clone().or_else(|| {
                Some(LabelSelector {
                    match_labels: Some(selector_labels(dd)),
                    ..Default::default()
                })
            }),
            ..c.clone()
        })
        .collect()
}

/// Metadata of an object the DiffusionDeployment owns: same name and namespace, its
/// labels, and a controller owner reference so deleting it collects the object.
pub(crate) fn owned_meta(dd: &DiffusionDeployment) -> ObjectMeta {
    ObjectMeta {
        name: Some(dd.name_any()),
        namespace: dd.namespace(),
        labels: Some(labels(dd)),
        owner_references: dd.controller_owner_ref(&()).map(|o| vec![o]),
        ..Default::default()
    }
}

/// The PodDisruptionBudget of `dd`'s engine pods, when its spec asks for one: same name,
/// owned by the DiffusionDeployment, selecting the engine pods.
pub fn disruption_budget(dd: &DiffusionDeployment) -> Option<PodDisruptionBudget> {
    let budget = dd.spec.engine.disruption_budget.as_ref()?;
    Some(PodDisruptionBudget {
        metadata: owned_meta(dd),
        spec: Some(PodDisruptionBudgetSpec {
            min_available: budget.min_available.clone(),
            max_unavailable: budget.max_unavailable.clone(),
            selector: Some(LabelSelector {
                match_labels: Some(selector_labels(dd)),
                ..Default::default()
            }),
            ..Default::default()
        }),
        status: None,
    })
}

/// The key in the job-key Secret that holds the key.
pub const JOB_KEY: &str = "job-key";

/// The Secret that holds a deployment's job-id key (`<name>-job-key`).
pub fn job_key_secret_name(dd: &DiffusionDeployment) -> String {
    format!("{}-job-key", dd.name_any())
}

/// The Secret with a deployment's job-id key, `key` (the same in every engine pod of the
/// deployment, so any of them can check an id another made and send the request to its
/// owner). Immutable, and owned by the DiffusionDeployment so that deleting it collects the
/// Secret; the controller creates it once and never rewrites it.
pub fn job_key_secret(dd: &DiffusionDeployment, key: String) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(job_key_secret_name(dd)),
            ..owned_meta(dd)
        },
        immutable: Some(true),
        type_: Some("Opaque".into()),
        string_data: Some(BTreeMap::from([(JOB_KEY.to_string(), key)])),
        ..Default::default()
    }
}

/// The engine's job routing: the deployment's key from its Secret, and the pod's IP (what
/// the ids of its jobs name; the other replicas send requests for them there).
fn job_routing_env(dd: &DiffusionDeployment) -> [EnvVar; 2] {
    [
        EnvVar {
            name: "LAYERWISE_JOB_KEY".into(),
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
            name: "LAYERWISE_POD_IP".into(),
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

/// The ClusterIP Service in front of the engine pods.
pub fn service(dd: &DiffusionDeployment) -> Service {
    Service {
        metadata: owned_meta(dd),
        spec: Some(ServiceSpec {
            selector: Some(selector_labels(dd)),
            ports: Some(vec![ServicePort {
                name: Some("http".into()),
                port: ENGINE_PORT,
                target_port: Some(IntOrString::String("http".into())),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        status: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crds::{ComponentPlacement, ComponentPlan, MemoryBreakdown};
    use layerwise_core::bounds::{
        ENV_GUIDANCE_ALLOWED, ENV_MAX_FRAMES, ENV_MAX_HEIGHT, ENV_MAX_N, ENV_MAX_PROMPT_TOKENS,
        ENV_MAX_STEPS, ENV_MAX_WIDTH,
    };
    use serde_json::json;

    fn dd(workload: serde_json::Value) -> DiffusionDeployment {
        serde_json::from_value(json!({
            "apiVersion": "layerwise.dev/v1alpha1",
            "kind": "DiffusionDeployment",
            "metadata": { "name": "wan", "namespace": "ns" },
            "spec": {
                "model": { "family": "wan", "location": { "hostPath": "/models/wan" } },
                "workload": workload,
            },
        }))
        .unwrap()
    }

    fn plan() -> Plan {
        Plan {
            strategy: Strategy::OffloadSharded,
            dp: 8,
            sp: 1,
            predicted_latency_seconds: None,
            latency_bound_met: None,
            resource_claim_template: None,
            slots: 4,
            fast_peer_link: true,
            device_bytes_per_rank: (10 << 30) + 1,
            host_bytes_per_pod: 80 << 30,
            host_bytes_per_node: 60 << 30,
            resident_blocks: 3,
            resident_blocks_by_component: BTreeMap::from([("transformer_2".into(), 20)]),
            device_breakdown: MemoryBreakdown {
                decoder: 1 << 30,
                ..MemoryBreakdown::default()
            },
            nodes: vec!["n0".into()],
            components: vec![
                ComponentPlan {
                    name: "text_encoder".into(),
                    placement: ComponentPlacement::Resident,
                    block_bytes: 10 << 30,
                },
                ComponentPlan {
                    name: "transformer".into(),
                    placement: ComponentPlacement::Streamed,
                    block_bytes: 50 << 30,
                },
            ],
            reasons: Vec::new(),
            rejected: Vec::new(),
        }
    }

    fn envs(d: &Deployment) -> Vec<(String, String)> {
        let pod = d.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
        pod.containers[0]
            .env
            .iter()
            .flatten()
            .map(|e| (e.name.clone(), e.value.clone().unwrap_or_default()))
            .collect()
    }

    /// The engine reads the model only inside its mount: a file that links out of it is
    /// refused (the engine's `--model-roots`).
    #[test]
    fn pods_of_a_dra_plan_claim_through_its_template_instead_of_the_extended_resource() {
        let d = dd(json!({}));
        let mut p = plan();
        p.resource_claim_template = Some("wan-0a1b2c3d".into());
        let dep = deployment(&d, &p, 1, "img", &EnginePods::default(), &[]);
        let pod = dep.spec.unwrap().template.spec.unwrap();
        let claims = pod.resource_claims.unwrap();
        assert_eq!(claims.len(), 1);
        assert_eq!(claims[0].name, DEVICE_CLAIM);
        assert_eq!(
            claims[0].resource_claim_template_name.as_deref(),
            Some("wan-0a1b2c3d")
        );
        let res = pod.containers[0].resources.clone().unwrap();
        assert_eq!(res.claims.unwrap()[0].name, DEVICE_CLAIM);
        for q in [res.requests.unwrap(), res.limits.unwrap()] {
            assert!(!q.contains_key("nvidia.com/gpu"), "{q:?}");
            assert!(q.contains_key("memory"));
        }
        // Without a template: the extended resource, no claim.
        let dep = deployment(&d, &plan(), 1, "img", &EnginePods::default(), &[]);
        let pod = dep.spec.unwrap().template.spec.unwrap();
        assert!(pod.resource_claims.is_none());
        assert_eq!(
            pod.containers[0]
                .resources
                .as_ref()
                .unwrap()
                .limits
                .as_ref()
                .unwrap()["nvidia.com/gpu"]
                .0,
            "8"
        );
    }

    #[test]
    fn engine_pods_confine_the_model_to_its_mount() {
        let d = dd(json!({}));
        let dep = deployment(&d, &plan(), 1, "engine:test", &EnginePods::default(), &[]);
        let pod = dep.spec.unwrap().template.spec.unwrap();
        let args = pod.containers[0].args.clone().unwrap();
        let after = |flag: &str| args.windows(2).find(|w| w[0] == flag).map(|w| w[1].clone());
        assert_eq!(after("--model").as_deref(), Some(MODEL_MOUNT), "{args:?}");
        assert_eq!(
            after("--model-roots").as_deref(),
            Some(MODEL_MOUNT),
            "{args:?}"
        );
    }

    /// A plan of dp groups of sp ranks: the engine gets `--dp` and `--sp`, the pod dp × sp
    /// accelerators; without sequence parallelism no `--sp` at all.
    #[test]
    fn engine_pods_run_dp_groups_of_sp_ranks_on_dp_times_sp_accelerators() {
        let d = dd(json!({}));
        let split = Plan {
            dp: 2,
            sp: 4,
            ..plan()
        };
        for (p, sp, gpus) in [(split, Some("4"), "8"), (plan(), None, "8")] {
            let dep = deployment(&d, &p, 1, "engine:test", &EnginePods::default(), &[]);
            let pod = dep.spec.unwrap().template.spec.unwrap();
            let c = &pod.containers[0];
            let args = c.args.clone().unwrap();
            let after = |flag: &str| args.windows(2).find(|w| w[0] == flag).map(|w| w[1].clone());
            assert_eq!(after("--dp"), Some(p.dp.to_string()), "{args:?}");
            assert_eq!(after("--sp").as_deref(), sp, "{args:?}");
            let res = c.resources.as_ref().unwrap();
            for q in [&res.requests, &res.limits] {
                assert_eq!(q.as_ref().unwrap()["nvidia.com/gpu"].0, gpus, "{res:?}");
            }
        }
        assert_eq!(
            plan_summary(&Plan {
                sp: 4,
                dp: 2,
                ..plan()
            }),
            "offload-sharded dp=2 sp=4 slots=4"
        );
        assert_eq!(plan_summary(&plan()), "offload-sharded dp=8 slots=4");
    }

    #[test]
    fn engine_pods_enforce_every_workload_bound_under_the_engines_names() {
        let d = dd(json!({
            "maxWidth": 1280,
            "maxHeight": 720,
            "maxFrames": 81,
            "maxSteps": 40,
            "maxBatch": 2,
            "maxPromptTokens": 300,
        }));
        let env = envs(&deployment(
            &d,
            &plan(),
            1,
            "engine:test",
            &EnginePods::default(),
            &[],
        ));
        let bounds: Vec<(&str, &str)> = env
            .iter()
            .filter(|(n, _)| n.starts_with("LAYERWISE_MAX_"))
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        assert_eq!(
            bounds,
            [
                (ENV_MAX_WIDTH, "1280"),
                (ENV_MAX_HEIGHT, "720"),
                (ENV_MAX_FRAMES, "81"),
                (ENV_MAX_STEPS, "40"),
                (ENV_MAX_N, "2"),
                (ENV_MAX_PROMPT_TOKENS, "300"),
            ]
        );
        assert!(
            env.contains(&("LAYERWISE_DEVICE_MEMORY_MIB".into(), "10241".into())),
            "{env:?}"
        );
        // The plan's component placement reaches the engine; only the resident ones.
        assert!(
            env.contains(&(
                bounds::ENV_RESIDENT_COMPONENTS.into(),
                "text_encoder".into()
            )),
            "{env:?}"
        );
        assert!(
            env.contains(&(bounds::ENV_DEVICE_OVERHEAD_MIB.into(), "0".into())),
            "{env:?}"
        );
        assert!(
            env.contains(&(bounds::ENV_RESIDENT_BLOCKS.into(), "3".into())),
            "{env:?}"
        );
        // The counts per component reach the engine in the form its flag reads: the
        // engine's own parser gives back the plan's map.
        let (_, by) = env
            .iter()
            .find(|(k, _)| k == bounds::ENV_RESIDENT_BLOCKS_BY_COMPONENT)
            .expect("counts per component");
        let read: layerwise_engine::execution::cuda::plan::BlocksByComponent = by.parse().unwrap();
        assert_eq!(read.0, plan().resident_blocks_by_component);
        // The plan reserved the decoder on the device: the pods decode there; a plan
        // that did not has them decode on the host.
        assert!(
            env.contains(&(decode::ENV_DECODE.into(), "device".into())),
            "{env:?}"
        );
        let mut host = plan();
        host.device_breakdown.decoder = 0;
        let host_env = envs(&deployment(
            &d,
            &host,
            1,
            "engine:test",
            &EnginePods::default(),
            &[],
        ));
        assert!(
            host_env.contains(&(decode::ENV_DECODE.into(), "host".into())),
            "{host_env:?}"
        );
        assert!(
            env.contains(&(ENV_GUIDANCE_ALLOWED.into(), "true".into())),
            "{env:?}"
        );
        let unguided = envs(&deployment(
            &dd(json!({ "guidance": false })),
            &plan(),
            1,
            "engine:test",
            &EnginePods::default(),
            &[],
        ));
        assert!(
            unguided.contains(&(ENV_GUIDANCE_ALLOWED.into(), "false".into())),
            "{unguided:?}"
        );
    }

    #[test]
    fn a_template_reads_back_the_plan_and_nodes_it_was_scheduled_by() {
        let d = deployment(
            &dd(json!({})),
            &plan(),
            1,
            "img",
            &EnginePods::default(),
            &["n0".into()],
        );
        let (summary, required, preferred) = scheduling_of(&d).expect("a planned template");
        assert_eq!(summary, plan_summary(&plan()));
        assert_eq!(
            (required, preferred),
            (vec!["n0".into()], vec!["n0".into()])
        );
        let cold = deployment(
            &dd(json!({})),
            &plan(),
            1,
            "img",
            &EnginePods::default(),
            &[],
        );
        assert_eq!(scheduling_of(&cold).unwrap().2, Vec::<String>::new());
    }

    #[test]
    fn request_bounds_default_to_one_frame_images() {
        let b = request_bounds(&dd(json!({})).spec.workload);
        assert_eq!(
            b,
            RequestBounds {
                max_width: 1024,
                max_height: 1024,
                max_frames: 1,
                max_steps: 50,
                max_n: 1,
                guidance: true,
                max_prompt_tokens: 512,
            }
        );
    }

    #[test]
    fn engine_pods_take_the_job_key_from_the_deployments_own_secret() {
        let mut d = dd(json!({}));
        d.metadata.uid = Some("uid-1".into());
        let secret = job_key_secret(&d, "ab".repeat(32));
        assert_eq!(secret.metadata.name.as_deref(), Some("wan-job-key"));
        assert_eq!(secret.metadata.namespace.as_deref(), Some("ns"));
        assert_eq!(secret.immutable, Some(true));
        let owner = &secret.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str(), owner.controller),
            ("DiffusionDeployment", "uid-1", Some(true))
        );
        let deploy = deployment(&d, &plan(), 1, "engine:test", &EnginePods::default(), &[]);
        let pod = deploy.spec.unwrap().template.spec.unwrap();
        let env = pod.containers[0].env.clone().unwrap();
        let from = |name: &str| {
            env.iter()
                .find(|e| e.name == name)
                .and_then(|e| e.value_from.clone())
                .unwrap_or_else(|| panic!("{name} not in {env:?}"))
        };
        let key = from("LAYERWISE_JOB_KEY").secret_key_ref.unwrap();
        assert_eq!(
            (key.name.as_str(), key.key.as_str()),
            ("wan-job-key", JOB_KEY)
        );
        assert_eq!(
            from("LAYERWISE_POD_IP").field_ref.unwrap().field_path,
            "status.podIP"
        );
    }

    fn pod_of(d: &Deployment) -> PodSpec {
        d.spec.clone().unwrap().template.spec.unwrap()
    }

    fn toleration(key: &str) -> Toleration {
        Toleration {
            key: Some(key.into()),
            operator: Some("Exists".into()),
            effect: Some("NoSchedule".into()),
            ..Default::default()
        }
    }

    /// The platform's pull secrets and tolerations come first, then the spec's, each once;
    /// the spec's RuntimeClass wins over the platform's.
    #[test]
    fn engine_pods_take_the_platforms_settings_and_then_the_models() {
        let platform = EnginePods::from_flags(
            &["regcred".into(), " ".into()],
            Some("nvidia"),
            Some(r#"[{"key":"nvidia.com/gpu","operator":"Exists","effect":"NoSchedule"}]"#),
        )
        .unwrap();
        assert_eq!(platform.image_pull_secrets, ["regcred"]);
        assert_eq!(platform.tolerations, [toleration("nvidia.com/gpu")]);

        let plain = pod_of(&deployment(
            &dd(json!({})),
            &plan(),
            1,
            "img",
            &platform,
            &[],
        ));
        let names = |p: &PodSpec| -> Vec<String> {
            p.image_pull_secrets
                .iter()
                .flatten()
                .map(|s| s.name.clone())
                .collect()
        };
        assert_eq!(names(&plain), ["regcred"]);
        assert_eq!(plain.runtime_class_name.as_deref(), Some("nvidia"));
        assert_eq!(plain.tolerations, Some(vec![toleration("nvidia.com/gpu")]));
        assert_eq!(plain.topology_spread_constraints, None);

        let mut own = dd(json!({}));
        own.spec.engine.image_pull_secrets = vec![
            LocalObjectReference {
                name: "model-registry".into(),
            },
            LocalObjectReference {
                name: "regcred".into(),
            },
        ];
        own.spec.engine.runtime_class_name = Some("kata-nvidia".into());
        own.spec.accelerator.tolerations =
            vec![toleration("dedicated"), toleration("nvidia.com/gpu")];
        let pod = pod_of(&deployment(&own, &plan(), 1, "img", &platform, &[]));
        assert_eq!(names(&pod), ["regcred", "model-registry"]);
        assert_eq!(pod.runtime_class_name.as_deref(), Some("kata-nvidia"));
        assert_eq!(
            pod.tolerations,
            Some(vec![toleration("nvidia.com/gpu"), toleration("dedicated")])
        );

        // Nothing from the platform and nothing in the spec: none of these fields at all.
        let bare = pod_of(&deployment(
            &dd(json!({})),
            &plan(),
            1,
            "img",
            &EnginePods::default(),
            &[],
        ));
        assert_eq!(
            (
                bare.image_pull_secrets,
                bare.runtime_class_name,
                bare.tolerations
            ),
            (None, None, None)
        );
    }

    #[test]
    fn tolerations_that_are_not_a_list_are_refused_naming_the_flag() {
        let err = EnginePods::from_flags(&[], None, Some(r#"{"key":"x"}"#)).unwrap_err();
        assert!(err.contains("--engine-tolerations"), "{err}");
        let empty = EnginePods::from_flags(&["".into()], Some(""), Some("")).unwrap();
        assert_eq!(empty, EnginePods::default());
    }

    /// A spread constraint without a selector counts this model's engine pods; one with a
    /// selector keeps it.
    #[test]
    fn topology_spread_counts_the_models_pods_unless_told_otherwise() {
        let mut d = dd(json!({}));
        d.spec.engine.topology_spread_constraints = serde_json::from_value(json!([
            { "maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
              "whenUnsatisfiable": "ScheduleAnyway" },
            { "maxSkew": 2, "topologyKey": "kubernetes.io/hostname",
              "whenUnsatisfiable": "DoNotSchedule",
              "labelSelector": { "matchLabels": { "team": "ml" } } },
        ]))
        .unwrap();
        let pod = pod_of(&deployment(
            &d,
            &plan(),
            1,
            "img",
            &EnginePods::default(),
            &[],
        ));
        let spread = pod.topology_spread_constraints.unwrap();
        assert_eq!(spread.len(), 2);
        assert_eq!(spread[0].topology_key, "topology.kubernetes.io/zone");
        assert_eq!(spread[0].when_unsatisfiable, "ScheduleAnyway");
        assert_eq!(
            spread[0].label_selector.as_ref().unwrap().match_labels,
            Some(selector_labels(&d))
        );
        assert_eq!(spread[1].max_skew, 2);
        assert_eq!(
            spread[1].label_selector.as_ref().unwrap().match_labels,
            Some(BTreeMap::from([("team".into(), "ml".into())]))
        );
    }

    #[test]
    fn a_disruption_budget_is_made_only_when_the_spec_asks_and_selects_the_engine_pods() {
        let mut d = dd(json!({}));
        d.metadata.uid = Some("uid-1".into());
        assert!(disruption_budget(&d).is_none());
        d.spec.engine.disruption_budget = Some(crds::DisruptionBudget {
            min_available: None,
            max_unavailable: Some(IntOrString::String("25%".into())),
        });
        let pdb = disruption_budget(&d).unwrap();
        assert_eq!(
            (
                pdb.metadata.name.as_deref(),
                pdb.metadata.namespace.as_deref()
            ),
            (Some("wan"), Some("ns"))
        );
        let owner = &pdb.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.uid.as_str(), owner.controller),
            ("uid-1", Some(true))
        );
        let spec = pdb.spec.unwrap();
        assert_eq!(
            spec.max_unavailable,
            Some(IntOrString::String("25%".into()))
        );
        assert_eq!(spec.min_available, None);
        // It selects exactly what the Deployment's selector selects.
        let dep = deployment(&d, &plan(), 1, "img", &EnginePods::default(), &[]);
        assert_eq!(
            spec.selector.unwrap().match_labels,
            dep.spec.unwrap().selector.match_labels
        );
    }
}
