//! The committed CRD YAML (under `crds/` and the Helm chart's `crds/`) is what the Rust
//! types generate; run `cargo run -p layerwise-crds --bin crdgen` after changing them.

use std::path::Path;

#[test]
fn committed_crds_match_the_types() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for (file, crd) in crds::all() {
        let generated = crds::to_yaml(&crd).unwrap();
        for dir in [root.to_path_buf(), root.join("../charts/layerwise/crds")] {
            let path = dir.join(file);
            let committed = std::fs::read_to_string(&path).unwrap_or_default();
            assert!(
                committed == generated,
                "{} differs from what the types generate; run `cargo run -p layerwise-crds --bin crdgen`",
                path.display()
            );
        }
    }
}

#[test]
fn the_deployment_kind_has_scale_status_and_printer_columns() {
    use kube::CustomResourceExt;
    let crd = crds::DiffusionDeployment::crd();
    let v = &crd.spec.versions[0];
    let sub = v.subresources.as_ref().unwrap();
    assert!(sub.status.is_some());
    let scale = sub.scale.as_ref().unwrap();
    assert_eq!(scale.spec_replicas_path, ".spec.replicas");
    assert_eq!(
        scale.label_selector_path.as_deref(),
        Some(".status.selector")
    );
    let cols: Vec<&str> = v
        .additional_printer_columns
        .as_ref()
        .unwrap()
        .iter()
        .map(|c| c.name.as_str())
        .collect();
    assert_eq!(
        cols,
        ["Strategy", "DP", "SP", "Replicas", "Ready", "Queue", "Age"]
    );
    assert_eq!(crd.spec.scope, "Namespaced");
    assert_eq!(crds::DiffusionNode::crd().spec.scope, "Cluster");
}

#[test]
fn the_node_status_embeds_the_engine_profile() {
    let yaml = crds::to_yaml(&<crds::DiffusionNode as kube::CustomResourceExt>::crd()).unwrap();
    for field in [
        "maxBlockBytesByDtype",
        "outsideBlockBytes",
        "bytesPerTokenPair",
        "vaeBytesPerPixel",
    ] {
        assert!(yaml.contains(field), "DiffusionNode schema lacks {field}");
    }
}

/// `model.family` takes exactly the engine's registered families: the schema is made from
/// the registry, so the apiserver refuses a family no engine here runs.
#[test]
fn the_model_family_is_one_of_the_registrys() {
    use kube::CustomResourceExt;
    let crd = serde_json::to_value(crds::DiffusionDeployment::crd()).unwrap();
    let family = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
        ["properties"]["model"]["properties"]["family"];
    assert_eq!(
        family["enum"],
        serde_json::json!(layerwise_engine::families::names()),
        "{family}"
    );
    assert_eq!(family["type"], "string");
}
