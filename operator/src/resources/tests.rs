//! The engine objects as the controller applies them: what each pod runs, schedules by,
//! mounts and enforces, and the objects a DiffusionDeployment owns beside them.

use std::collections::BTreeMap;

use super::*;
use crds::{
    ComponentPlacement, ComponentPlan, DiffusionDeployment, MemoryBreakdown, Plan, Strategy,
};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{LocalObjectReference, PodSpec, Toleration};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::ResourceExt;
use layerwise_core::bounds::{self, RequestBounds};
use layerwise_core::bounds::{
    ENV_GUIDANCE_ALLOWED, ENV_MAX_FRAMES, ENV_MAX_HEIGHT, ENV_MAX_N, ENV_MAX_PROMPT_TOKENS,
    ENV_MAX_STEPS, ENV_MAX_WIDTH,
};
use layerwise_core::contract::{DEFAULT_GRACE_SECONDS, ENV_GRACE_SECONDS};
use layerwise_core::decode;
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

pub(super) fn plan() -> Plan {
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
        rates: None,
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
    let read: layerwise_core::contract::BlocksByComponent = by.parse().unwrap();
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
fn pods_are_placed_by_node_name_not_the_hostname_label() {
    let mut p = plan();
    p.nodes = vec!["ip-10-0-0-1.ec2.internal".into(), "n1".into()];
    let d = deployment(
        &dd(json!({})),
        &p,
        1,
        "img",
        &EnginePods::default(),
        &["n1".into()],
    );
    let affinity = serde_json::to_value(
        d.spec
            .unwrap()
            .template
            .spec
            .unwrap()
            .affinity
            .unwrap()
            .node_affinity
            .unwrap(),
    )
    .unwrap();
    // One term per node (Kubernetes takes one value per field requirement); terms are ORed.
    let by_name = |n: &str| json!({ "matchFields": [{ "key": "metadata.name", "operator": "In", "values": [n] }] });
    assert_eq!(
        affinity,
        json!({
            "requiredDuringSchedulingIgnoredDuringExecution": { "nodeSelectorTerms": [
                by_name("ip-10-0-0-1.ec2.internal"), by_name("n1")
            ] },
            "preferredDuringSchedulingIgnoredDuringExecution": [
                { "weight": 100, "preference": by_name("n1") }
            ],
        })
    );
    assert!(!affinity.to_string().contains("kubernetes.io/hostname"));
}

#[test]
fn a_template_made_with_the_hostname_label_still_reads_back_its_nodes() {
    let mut d = deployment(
        &dd(json!({})),
        &plan(),
        1,
        "img",
        &EnginePods::default(),
        &[],
    );
    let legacy = json!({ "requiredDuringSchedulingIgnoredDuringExecution": { "nodeSelectorTerms": [
        { "matchExpressions": [{ "key": "kubernetes.io/hostname", "operator": "In", "values": ["a", "b"] }] }
    ] } });
    let spec = d.spec.as_mut().unwrap().template.spec.as_mut().unwrap();
    spec.affinity.as_mut().unwrap().node_affinity = Some(serde_json::from_value(legacy).unwrap());
    assert_eq!(
        scheduling_of(&d).unwrap().1,
        vec!["a".to_string(), "b".to_string()]
    );
}

#[test]
fn pods_of_more_than_one_rank_get_a_memory_backed_dev_shm_sized_by_their_ranks() {
    let shm_of = |dp: u32, sp: u32| {
        let mut p = plan();
        (p.dp, p.sp) = (dp, sp);
        let pod = deployment(&dd(json!({})), &p, 1, "img", &EnginePods::default(), &[])
            .spec
            .unwrap()
            .template
            .spec
            .unwrap();
        let volume = pod.volumes.unwrap().into_iter().find(|v| v.name == "dshm");
        let mounted = pod.containers[0]
            .volume_mounts
            .iter()
            .flatten()
            .any(|m| m.name == "dshm" && m.mount_path == "/dev/shm");
        volume.map(|v| {
            assert!(mounted);
            let e = v.empty_dir.unwrap();
            assert_eq!(e.medium.as_deref(), Some("Memory"));
            e.size_limit.unwrap().0.parse::<u64>().unwrap()
        })
    };
    assert_eq!(shm_of(1, 1), None);
    let two = shm_of(2, 1).unwrap();
    assert_eq!(shm_of(1, 2), Some(two));
    assert_eq!(shm_of(4, 2).unwrap() - two, 6 * SHM_BYTES_PER_RANK);
}

#[test]
fn the_drain_grace_holds_the_largest_requests_predicted_latency_and_sets_the_pods() {
    let with = |latency: Option<f64>| {
        let mut p = plan();
        p.predicted_latency_seconds = latency;
        p
    };
    assert_eq!(drain::grace_seconds(&with(None)), DEFAULT_GRACE_SECONDS);
    assert_eq!(
        drain::grace_seconds(&with(Some(2.0))),
        DEFAULT_GRACE_SECONDS
    );
    assert_eq!(
        drain::grace_seconds(&with(Some(f64::NAN))),
        DEFAULT_GRACE_SECONDS
    );
    // A 5-minute video: 460 s, the engine's work part of which (three quarters) holds it.
    let video = drain::grace_seconds(&with(Some(300.0)));
    assert_eq!(video, 460);
    assert!(video as f64 * 0.75 >= 300.0);
    // The pod: the grace in the engine's environment, the termination grace after the
    // preStop delay and a margin.
    let d = deployment(
        &dd(json!({})),
        &with(Some(300.0)),
        1,
        "img",
        &EnginePods::default(),
        &[],
    );
    let pod = d.spec.unwrap().template.spec.unwrap();
    let env = pod.containers[0].env.clone().unwrap();
    let grace = env
        .iter()
        .find(|e| e.name == ENV_GRACE_SECONDS)
        .expect("the grace");
    assert_eq!(grace.value.as_deref(), Some("460"));
    assert_eq!(
        pod.termination_grace_period_seconds,
        Some(DRAIN_DELAY_SECONDS + 460 + 5)
    );
}

#[test]
fn the_engine_image_is_kept_across_operator_upgrades_until_the_user_asks() {
    use super::image::{engine_image, FOLLOW_OPERATOR};
    let plain = dd(json!({}));
    // A new deployment takes the operator's default; after that the recorded one stays
    // whatever the operator's default becomes.
    assert_eq!(engine_image(&plain, None, None, "engine:v2"), "engine:v2");
    assert_eq!(
        engine_image(&plain, Some("engine:v1"), None, "engine:v2"),
        "engine:v1"
    );
    // Made before the status recorded it: the image its pods run now.
    let running = deployment(&plain, &plan(), 1, "engine:v1", &EnginePods::default(), &[]);
    assert_eq!(
        engine_image(&plain, None, Some(&running), "engine:v2"),
        "engine:v1"
    );
    // The user asks: the annotation follows the operator, the spec names its own.
    let mut follows = plain.clone();
    follows
        .annotations_mut()
        .insert(FOLLOW_OPERATOR.into(), "true".into());
    assert_eq!(
        engine_image(&follows, Some("engine:v1"), None, "engine:v2"),
        "engine:v2"
    );
    let mut pinned = plain.clone();
    pinned.spec.engine.image = Some("mine:1".into());
    assert_eq!(
        engine_image(&pinned, Some("engine:v1"), None, "engine:v2"),
        "mine:1"
    );
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
    own.spec.accelerator.tolerations = vec![toleration("dedicated"), toleration("nvidia.com/gpu")];
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

#[test]
fn engine_pods_log_as_the_operator_does_unless_their_spec_says_otherwise() {
    use layerwise_engine::logging::{LogFormat, ENV_LOG_FORMAT};
    let env_of = |d: &DiffusionDeployment, format: LogFormat| {
        let platform = EnginePods {
            log_format: format,
            ..EnginePods::default()
        };
        let dep = deployment(d, &plan(), 1, "img", &platform, &[]);
        let pod = dep.spec.unwrap().template.spec.unwrap();
        let env = pod.containers[0].env.clone().unwrap_or_default();
        env.into_iter()
            .filter(|e| e.name == ENV_LOG_FORMAT)
            .map(|e| e.value.unwrap_or_default())
            .collect::<Vec<_>>()
    };
    let d = dd(json!({}));
    assert_eq!(env_of(&d, LogFormat::Json), ["json"]);
    assert_eq!(env_of(&d, LogFormat::Text), ["text"]);
    // The spec's own environment comes after the platform's: the last of a name wins.
    let mut d = dd(json!({}));
    d.spec.engine.env = vec![k8s_openapi::api::core::v1::EnvVar {
        name: ENV_LOG_FORMAT.into(),
        value: Some("text".into()),
        ..Default::default()
    }];
    assert_eq!(env_of(&d, LogFormat::Json), ["json", "text"]);
}
