use super::*;

#[test]
fn a_profile_of_another_family_is_refused_naming_both() {
    let mut p = layerwise_e2e::fixtures::dit_profile(4, 1 << 20, 0, 0);
    let status = |state, profile: Option<Profile>, error: Option<&str>| NodeModelStatus {
        id: "ns/m".into(),
        state,
        profile,
        error: error.map(Into::into),
        ..Default::default()
    };
    let warm = status(ModelState::Warm, Some(p.clone()), None);
    assert_eq!(node_profile("dit", &warm), Ok(Some(&p)));
    let why = node_profile("wan", &warm).unwrap_err();
    assert!(
        why.contains("names family `wan`") && why.contains("a `dit` pipeline"),
        "{why}"
    );
    p.family = "wan".into();
    let warm = status(ModelState::Warming, Some(p.clone()), None);
    assert_eq!(node_profile("wan", &warm), Ok(Some(&p)));
    let failed = status(ModelState::Failed, Some(p), Some("bad header"));
    assert_eq!(node_profile("wan", &failed), Err("bad header".into()));
    let pending = status(ModelState::Profiling, None, None);
    assert_eq!(node_profile("wan", &pending), Ok(None));
}

fn inventory(node: dra::NodeDevices, named: Option<u32>) -> dra::Inventory {
    dra::Inventory {
        class: "gpu.nvidia.com".into(),
        link_attribute: crds::DeviceAllocation::DEFAULT_LINK_ATTRIBUTE.into(),
        named: named.map(|n| ("mine".to_string(), n)),
        nodes: [("n".to_string(), node)].into(),
        memory_published: true,
    }
}

#[test]
fn the_slices_figures_win_and_the_agents_fill_in_what_they_leave_out() {
    let agent = crds::AcceleratorInventory {
        resource_name: "nvidia.com/gpu".into(),
        product: "NVIDIA-H100-80GB-HBM3".into(),
        count: 8,
        memory_bytes: 1 << 30,
        fast_peer_link: true,
    };
    // No DRA: the agent's figures, bounded by what the Node offers.
    assert_eq!(
        accelerators(Some(&agent), None, "n", 4),
        Some((4, 1 << 30, agent.product.clone(), true))
    );
    assert_eq!(accelerators(None, None, "n", 4), None);
    // DRA: the slices' memory and product, a pod's ranks on one link group.
    let full = dra::NodeDevices {
        count: 8,
        memory_bytes: Some(80 << 30),
        product: Some("NVIDIA H100 80GB HBM3".into()),
        linked: 4,
    };
    let inv = inventory(full.clone(), None);
    assert_eq!(
        accelerators(Some(&agent), Some(&inv), "n", 8),
        Some((4, 80 << 30, "NVIDIA H100 80GB HBM3".into(), true))
    );
    // A node the slices do not list is no candidate under DRA.
    assert_eq!(accelerators(Some(&agent), Some(&inv), "other", 8), None);
    // Slices without memory, product or link: the agent's memory and product, every
    // device, no fast link; and without the agent, no memory to plan with.
    let bare = inventory(
        dra::NodeDevices {
            count: 8,
            ..Default::default()
        },
        None,
    );
    assert_eq!(
        accelerators(Some(&agent), Some(&bare), "n", 8),
        Some((8, 1 << 30, agent.product.clone(), false))
    );
    assert_eq!(accelerators(None, Some(&bare), "n", 8), None);
}

#[test]
fn a_named_templates_device_count_fixes_dp_times_sp() {
    let spec = |extra: serde_json::Value| -> crds::DiffusionDeploymentSpec {
        let mut v = serde_json::json!({
            "model": { "family": "wan", "location": { "hostPath": "/m" } },
        });
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        serde_json::from_value(v).unwrap()
    };
    let four = inventory(dra::NodeDevices::default(), Some(4));
    let o = overrides(&spec(serde_json::json!({})), Some(&four)).unwrap();
    assert_eq!((o.dp, o.sp), (Some(4), Some(1)));
    let o = overrides(&spec(serde_json::json!({ "sp": 2 })), Some(&four)).unwrap();
    assert_eq!((o.dp, o.sp), (Some(2), Some(2)));
    for bad in [
        serde_json::json!({ "sp": 3 }),
        serde_json::json!({ "dp": 2 }),
        serde_json::json!({ "sp": 8 }),
    ] {
        let why = overrides(&spec(bad.clone()), Some(&four)).unwrap_err();
        assert!(
            why.contains("ResourceClaimTemplate mine claims 4 device(s)"),
            "{bad}: {why}"
        );
    }
    // A generated template, or none: the spec's own overrides.
    let gen = inventory(dra::NodeDevices::default(), None);
    let o = overrides(&spec(serde_json::json!({ "dp": 3 })), Some(&gen)).unwrap();
    assert_eq!((o.dp, o.sp), (Some(3), None));
    assert_eq!(
        overrides(&spec(serde_json::json!({})), None).unwrap().dp,
        None
    );
}
