use std::collections::BTreeMap;

use crds::{DeviceAllocation, DiffusionDeployment};
use k8s_openapi::api::resource::v1::{
    CELDeviceSelector, Device, DeviceAttribute, DeviceCapacity, DeviceClass, DeviceClassSpec,
    DeviceSelector, ResourceClaimTemplate, ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::ResourceExt;
use serde_json::json;

use super::inventory::*;
use super::selector::*;
use super::template::*;
use super::CLAIM;

fn class(exprs: &[&str]) -> DeviceClass {
    DeviceClass {
        metadata: ObjectMeta {
            name: Some("gpu.example.com".into()),
            ..Default::default()
        },
        spec: DeviceClassSpec {
            selectors: Some(
                exprs
                    .iter()
                    .map(|e| DeviceSelector {
                        cel: Some(CELDeviceSelector {
                            expression: e.to_string(),
                        }),
                    })
                    .collect(),
            ),
            ..Default::default()
        },
    }
}

fn device(name: &str, kind: &str, gib: Option<u64>, root: Option<&str>) -> Device {
    let mut attrs = BTreeMap::from([
        (
            "type".to_string(),
            DeviceAttribute {
                string: Some(kind.into()),
                ..Default::default()
            },
        ),
        (
            "productName".to_string(),
            DeviceAttribute {
                string: Some("NVIDIA H100 80GB HBM3".into()),
                ..Default::default()
            },
        ),
    ]);
    if let Some(r) = root {
        attrs.insert(
            DeviceAllocation::DEFAULT_LINK_ATTRIBUTE.into(),
            DeviceAttribute {
                string: Some(r.into()),
                ..Default::default()
            },
        );
    }
    Device {
        name: name.into(),
        attributes: Some(attrs),
        capacity: gib.map(|g| {
            BTreeMap::from([(
                "memory".to_string(),
                DeviceCapacity {
                    value: Quantity(format!("{g}Gi")),
                    ..Default::default()
                },
            )])
        }),
        ..Default::default()
    }
}

fn slice(node: &str, driver: &str, generation: i64, devices: Vec<Device>) -> ResourceSlice {
    ResourceSlice {
        metadata: ObjectMeta::default(),
        spec: ResourceSliceSpec {
            driver: driver.into(),
            node_name: Some(node.into()),
            pool: ResourcePool {
                name: node.into(),
                generation,
                resource_slice_count: 1,
            },
            devices: Some(devices),
            ..Default::default()
        },
    }
}

const NVIDIA: &str =
    "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'";

#[test]
fn the_classes_selectors_are_read_and_applied() {
    let s = Selector::of(&class(&[NVIDIA])).unwrap();
    assert_eq!(s.driver(), Some("gpu.nvidia.com"));
    assert!(s.selects("gpu.nvidia.com", &device("gpu-0", "gpu", Some(80), None)));
    assert!(!s.selects("gpu.nvidia.com", &device("mig-0", "mig", Some(10), None)));
    assert!(!s.selects("gpu.other.com", &device("gpu-0", "gpu", Some(80), None)));
    // Brackets, double quotes, parentheses, literals on the left, and several selectors.
    let s = Selector::of(&class(&[
        "(\"gpu.nvidia.com\" == device.driver)",
        "device.attributes[\"gpu.nvidia.com\"][\"type\"] == 'gpu' && true == true",
    ]));
    assert!(s.is_err(), "two literals compared: {s:?}");
    let s = Selector::of(&class(&[
        "(\"gpu.nvidia.com\" == device.driver)",
        "device.attributes[\"gpu.nvidia.com\"][\"type\"] == 'gpu'",
    ]))
    .unwrap();
    assert!(s.selects("gpu.nvidia.com", &device("gpu-0", "gpu", None, None)));
    // No selector: every device, of any driver.
    let any = Selector::of(&class(&[])).unwrap();
    assert!(any.selects("x", &device("a", "b", None, None)));
    assert_eq!(any.driver(), None);
}

#[test]
fn selectors_beyond_equalities_are_refused_quoting_them() {
    for e in [
        "device.driver == 'a' || device.driver == 'b'",
        "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0",
        "device.attributes['gpu.nvidia.com'].type != 'mig'",
        "device.driver == 'a' &",
        "device.driver == 'unclosed",
    ] {
        let why = Selector::of(&class(&[e])).unwrap_err();
        assert!(why.contains(e), "{why}");
    }
}

#[test]
fn the_inventory_counts_link_groups_memory_and_the_newest_pools() {
    let s = Selector::of(&class(&[NVIDIA])).unwrap();
    let link = DeviceAllocation::DEFAULT_LINK_ATTRIBUTE;
    let eight: Vec<Device> = (0..8)
        .map(|i| {
            device(
                &format!("gpu-{i}"),
                "gpu",
                Some(80),
                Some(if i < 4 { "pci0000:00" } else { "pci0000:80" }),
            )
        })
        .chain([device("mig-0", "mig", Some(10), Some("pci0000:00"))])
        .collect();
    let mut tainted = device("gpu-9", "gpu", Some(80), Some("pci0000:00"));
    tainted.taints = Some(vec![k8s_openapi::api::resource::v1::DeviceTaint {
        effect: "NoSchedule".into(),
        key: "broken".into(),
        ..Default::default()
    }]);
    let slices = vec![
        slice("a", "gpu.nvidia.com", 2, eight),
        // An older generation of the same pool: ignored.
        slice(
            "a",
            "gpu.nvidia.com",
            1,
            vec![device("gpu-7", "gpu", Some(40), Some("x"))],
        ),
        slice(
            "b",
            "gpu.nvidia.com",
            1,
            vec![device("gpu-0", "gpu", Some(48), None), tainted],
        ),
        slice(
            "c",
            "gpu.other.com",
            1,
            vec![device("gpu-0", "gpu", Some(48), None)],
        ),
    ];
    let (nodes, published) = inventory(&slices, &s, link);
    assert!(published);
    let a = &nodes["a"];
    assert_eq!((a.count, a.memory_bytes, a.linked), (8, Some(80 << 30), 4));
    assert_eq!(a.product.as_deref(), Some("NVIDIA H100 80GB HBM3"));
    assert_eq!(a.for_ranks(), (4, true));
    let b = &nodes["b"];
    assert_eq!(
        (b.count, b.linked),
        (1, 0),
        "the tainted device is left out"
    );
    assert_eq!(b.for_ranks(), (1, false));
    assert!(!nodes.contains_key("c"));
    // A device without memory: the figure is unknown (the agent's then).
    let slices = vec![slice(
        "a",
        "gpu.nvidia.com",
        1,
        vec![
            device("gpu-0", "gpu", Some(80), None),
            device("gpu-1", "gpu", None, None),
        ],
    )];
    let (nodes, published) = inventory(&slices, &s, link);
    assert!(!published);
    assert_eq!(nodes["a"].memory_bytes, None);
}

fn template_of(spec: serde_json::Value) -> ResourceClaimTemplate {
    serde_json::from_value(json!({
        "metadata": { "name": "mine" },
        "spec": { "spec": { "devices": spec } },
    }))
    .unwrap()
}

#[test]
fn a_named_template_gives_its_class_and_count_or_why_not() {
    let one = template_of(
        json!({ "requests": [{ "name": "g", "exactly": { "deviceClassName": "gpu.nvidia.com", "count": 4 } }] }),
    );
    assert_eq!(named_request(&one).unwrap(), ("gpu.nvidia.com".into(), 4));
    let all = template_of(
        json!({ "requests": [{ "name": "g", "exactly": { "deviceClassName": "c", "allocationMode": "All" } }] }),
    );
    assert!(named_request(&all)
        .unwrap_err()
        .contains("allocationMode All"));
    let two = template_of(json!({ "requests": [
        { "name": "g", "exactly": { "deviceClassName": "c" } },
        { "name": "h", "exactly": { "deviceClassName": "c" } }] }));
    assert!(named_request(&two)
        .unwrap_err()
        .contains("2 device requests"));
    let alt = template_of(
        json!({ "requests": [{ "name": "g", "firstAvailable": [{ "name": "a", "deviceClassName": "c" }] }] }),
    );
    assert!(named_request(&alt).unwrap_err().contains("not `exactly`"));
}

#[test]
fn the_generated_template_asks_for_the_plans_devices_memory_and_link() {
    let dd: DiffusionDeployment = serde_json::from_value(json!({
        "apiVersion": "layerwise.dev/v1alpha1", "kind": "DiffusionDeployment",
        "metadata": { "name": "wan", "namespace": "ns", "uid": "u-1" },
        "spec": { "model": { "family": "wan", "location": { "hostPath": "/m" } } },
    }))
    .unwrap();
    let inv = Inventory {
        class: "gpu.nvidia.com".into(),
        link_attribute: DeviceAllocation::DEFAULT_LINK_ATTRIBUTE.into(),
        named: None,
        nodes: BTreeMap::new(),
        memory_published: true,
    };
    let t = template(&dd, &inv, 4, 70 << 30, true);
    let v = serde_json::to_value(&t.spec.spec).unwrap();
    let req = &v["devices"]["requests"][0];
    assert_eq!(req["name"], CLAIM);
    assert_eq!(req["exactly"]["deviceClassName"], "gpu.nvidia.com");
    assert_eq!(req["exactly"]["count"], 4);
    assert_eq!(
        req["exactly"]["selectors"][0]["cel"]["expression"],
        format!(
            "device.capacity[device.driver].memory.compareTo(quantity('{}')) >= 0",
            70u64 << 30
        )
    );
    assert_eq!(
        v["devices"]["constraints"][0],
        json!({ "requests": [CLAIM], "matchAttribute": "resource.kubernetes.io/pcieRoot" })
    );
    let owner = &t.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!((owner.name.as_str(), owner.uid.as_str()), ("wan", "u-1"));
    // The name follows the contents: the same plan, the same name; another, another.
    assert_eq!(
        template(&dd, &inv, 4, 70 << 30, true).metadata.name,
        t.metadata.name
    );
    let other = template(&dd, &inv, 2, 70 << 30, true);
    assert_ne!(other.metadata.name, t.metadata.name);
    assert!(t.name_any().starts_with("wan-"));
    // One device, or no fast link: no constraint; no memory published: no selector.
    let lone = template(&dd, &inv, 1, 70 << 30, true);
    assert!(lone
        .spec
        .spec
        .devices
        .as_ref()
        .unwrap()
        .constraints
        .is_none());
    let bare = Inventory {
        memory_published: false,
        ..inv
    };
    let t = template(&dd, &bare, 4, 70 << 30, false);
    let d = t.spec.spec.devices.unwrap();
    assert!(d.constraints.is_none());
    assert!(d.requests.unwrap()[0]
        .exactly
        .as_ref()
        .unwrap()
        .selectors
        .is_none());
}
