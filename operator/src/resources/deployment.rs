//! The engine Deployment: its pod template (the container, its probes and restricted
//! security, where it schedules and what it records of its plan) and the ClusterIP Service
//! in front of its pods.

use crds::{DiffusionDeployment, Plan};
use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{
    Affinity, Capabilities, Container, ContainerPort, HTTPGetAction, Lifecycle, LifecycleHandler,
    LocalObjectReference, NodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm,
    PodSecurityContext, PodSpec, PodTemplateSpec, PreferredSchedulingTerm, Probe, SeccompProfile,
    SecurityContext, Service, ServicePort, ServiceSpec, SleepAction, TopologySpreadConstraint,
    VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::claims::{device_claims, engine_resources};
use super::contract::{engine_args, engine_env, ENGINE_PORT};
use super::drain::{self, DRAIN_DELAY_SECONDS};
use super::objects::{labels, owned_meta, selector_labels};
use super::platform::{union, EnginePods};
use super::rollout;
use super::volumes::{shm, volumes};

/// The pod template annotation that records the plan (so a new plan rolls the pods).
pub const PLAN_ANNOTATION: &str = "layerwise.dev/plan";

/// The field a node selector term names a node by: its name, which the
/// `kubernetes.io/hostname` label need not equal (cloud providers and autoscalers set them
/// apart). Kubernetes takes one value per field requirement, so each node is a term of its
/// own (terms are ORed).
const NODE_NAME_FIELD: &str = "metadata.name";
/// The label templates made before pods were placed by node name used; read back so such a
/// template's nodes are still understood.
const LEGACY_HOSTNAME: &str = "kubernetes.io/hostname";

/// The term that matches node `name` by its name.
fn named(name: &str) -> NodeSelectorTerm {
    NodeSelectorTerm {
        match_fields: Some(vec![NodeSelectorRequirement {
            key: NODE_NAME_FIELD.into(),
            operator: "In".into(),
            values: Some(vec![name.to_string()]),
        }]),
        ..Default::default()
    }
}

/// The nodes a term names: by name, or (templates made before) by the hostname label.
fn names_in(term: &NodeSelectorTerm) -> Vec<String> {
    let fields = term
        .match_fields
        .iter()
        .flatten()
        .filter(|r| r.key == NODE_NAME_FIELD);
    let legacy = term
        .match_expressions
        .iter()
        .flatten()
        .filter(|r| r.key == LEGACY_HOSTNAME);
    fields
        .chain(legacy)
        .filter(|r| r.operator == "In")
        .flat_map(|r| r.values.clone().unwrap_or_default())
        .collect()
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
    let required = affinity
        .required_during_scheduling_ignored_during_execution
        .as_ref()?
        .node_selector_terms
        .iter()
        .flat_map(names_in)
        .collect();
    let preferred = affinity
        .preferred_during_scheduling_ignored_during_execution
        .iter()
        .flatten()
        .flat_map(|t| names_in(&t.preference))
        .collect();
    Some((summary, required, preferred))
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
    let (mut volumes, mut mounts) = volumes(spec);
    if let Some((volume, mount)) = shm(plan) {
        volumes.push(volume);
        mounts.push(mount);
    }
    let mut pod_labels = engine.pod_labels.clone();
    pod_labels.extend(labels(dd));
    let mut pod_annotations = engine.pod_annotations.clone();
    pod_annotations.insert(PLAN_ANNOTATION.into(), plan_summary(plan));

    let mut container = engine_container(dd, plan, default_image, mounts);
    let env = container.env.get_or_insert_with(Vec::new);
    env.splice(0..0, platform.env());

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
            // What the spec asks; the deploy phase falls back to no surge where no planned
            // node has room for a surge pod (see `crate::surge`).
            strategy: Some(rollout::strategy(rollout::spec_update(engine))),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(pod_labels),
                    annotations: Some(pod_annotations),
                    ..Default::default()
                }),
                spec: Some(PodSpec {
                    containers: vec![container],
                    volumes: Some(volumes),
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
                    termination_grace_period_seconds: Some(drain::termination_grace_seconds(
                        drain::grace_seconds(plan),
                    )),
                    ..Default::default()
                }),
            },
            ..Default::default()
        }),
        status: None,
    }
}

/// Pods go only to the plan's nodes, by name, preferring those where the model is already
/// `warm`.
fn node_affinity(plan: &Plan, warm: &[String]) -> NodeAffinity {
    NodeAffinity {
        required_during_scheduling_ignored_during_execution: Some(NodeSelector {
            node_selector_terms: plan.nodes.iter().map(|n| named(n)).collect(),
        }),
        preferred_during_scheduling_ignored_during_execution: (!warm.is_empty()).then(|| {
            warm.iter()
                .map(|n| PreferredSchedulingTerm {
                    weight: 100,
                    preference: named(n),
                })
                .collect()
        }),
    }
}

/// The engine container: the image, command, environment, probes, the model and /tmp
/// mounts, and the restricted security context.
fn engine_container(
    dd: &DiffusionDeployment,
    plan: &Plan,
    default_image: &str,
    mounts: Vec<VolumeMount>,
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
        env: Some(engine_env(dd, plan)),
        ports: Some(vec![ContainerPort {
            name: Some("http".into()),
            container_port: ENGINE_PORT,
            ..Default::default()
        }]),
        resources: Some(engine_resources(spec, plan)),
        volume_mounts: Some(mounts),
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
