//! What the node has: accelerators (NVML, loaded at run time), host memory, and the pods'
//! cgroup limit. NVML needs no privilege: the NVIDIA container toolkit (or a CDI spec, or a
//! DRA driver) injects the driver library and the device nodes it opens into the agent's
//! container. Where NVML cannot be used (nothing injected), the accelerators come from the
//! Node's GPU Feature Discovery labels instead, with the fast peer link from
//! [`FAST_PEER_LINK_LABEL`] (GPU Feature Discovery says nothing about NVLink); a node with
//! neither reports no accelerators and keeps working.

use std::collections::BTreeMap;

use crds::AcceleratorInventory;

use crate::cgroup::{self, CgroupMemory};
use crate::meminfo::{self, MemInfo};

/// The extended resource NVIDIA's device plugin advertises.
pub const NVIDIA_RESOURCE: &str = "nvidia.com/gpu";

/// NVLink links probed per device (the most any current part has).
const NVLINK_LINKS: u32 = 18;

/// One accelerator device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Device {
    pub index: u32,
    /// Product name as GPU Feature Discovery spells it (spaces as dashes).
    pub product: String,
    pub memory_total: u64,
    pub memory_free: u64,
    pub fast_peer_link: bool,
}

/// A snapshot of the node.
#[derive(Debug, Clone, Default)]
pub struct Inventory {
    pub devices: Vec<Device>,
    /// Why there are no devices, when NVML could not be used.
    pub accelerator_note: Option<String>,
    /// Accelerators read from the Node's labels, used when NVML found no devices.
    pub labelled: Vec<AcceleratorInventory>,
    pub host: MemInfo,
    /// The pods' cgroup, when a path was given and it could be read.
    pub pods_cgroup: Option<CgroupMemory>,
    pub pods_cgroup_note: Option<String>,
}

impl Inventory {
    /// Reads the node now. Failures become notes; the inventory itself never fails.
    pub fn read(pods_cgroup: Option<&str>) -> Inventory {
        let (devices, accelerator_note) = match nvml_devices() {
            Ok(d) => (d, None),
            Err(e) => (Vec::new(), Some(e)),
        };
        let host = meminfo::read().unwrap_or_default();
        let (pods_cgroup, pods_cgroup_note) = match pods_cgroup.map(cgroup::memory) {
            None => (None, None),
            Some(Ok(m)) => (Some(m), None),
            Some(Err(e)) => (None, Some(e.to_string())),
        };
        Inventory {
            devices,
            accelerator_note,
            labelled: Vec::new(),
            host,
            pods_cgroup,
            pods_cgroup_note,
        }
    }

    /// Accelerators as the `DiffusionNode` status lists them: NVML's devices, else what the
    /// Node's labels say.
    pub fn accelerators(&self) -> Vec<AcceleratorInventory> {
        if self.devices.is_empty() {
            return self.labelled.clone();
        }
        group(&self.devices)
    }
}

/// GPU Feature Discovery's labels: product (dashes for spaces), device count and per-device
/// memory in MiB.
pub const GFD_PRODUCT: &str = "nvidia.com/gpu.product";
pub const GFD_COUNT: &str = "nvidia.com/gpu.count";
pub const GFD_MEMORY_MIB: &str = "nvidia.com/gpu.memory";
/// Whether the node's devices share a fast peer link (NVLink, NVSwitch), `"true"` or
/// `"false"`, where the agent cannot read it from NVML: put there by whoever knows the
/// hardware (a Node Feature Discovery rule, the node pool's labels). Absent: no link.
pub const FAST_PEER_LINK_LABEL: &str = "layerwise.dev/fast-peer-link";

/// The accelerators a Node's GPU Feature Discovery labels describe, with the device count
/// taken from the labels or else from the node's allocatable `nvidia.com/gpu`. GPU Feature
/// Discovery's labels say nothing about NVLink, so the fast peer link is
/// [`FAST_PEER_LINK_LABEL`]'s; without it, false: the planner then keeps `auto` off the
/// strategies that need a fast peer link, and an explicit strategy still works.
///
/// `Ok(None)` when the node carries no GPU labels; `Err` names a label that is there but
/// unreadable.
pub fn from_gfd_labels(
    labels: &BTreeMap<String, String>,
    allocatable_gpus: Option<u32>,
) -> Result<Option<AcceleratorInventory>, String> {
    let Some(memory) = labels.get(GFD_MEMORY_MIB) else {
        return Ok(None);
    };
    let mib: u64 = memory
        .trim()
        .parse()
        .map_err(|_| format!("node label {GFD_MEMORY_MIB}={memory:?} is not a number of MiB"))?;
    let count = match labels.get(GFD_COUNT) {
        Some(c) => c
            .trim()
            .parse::<u32>()
            .map_err(|_| format!("node label {GFD_COUNT}={c:?} is not a device count"))?,
        None => allocatable_gpus.ok_or_else(|| {
            format!("node has {GFD_MEMORY_MIB} but neither {GFD_COUNT} nor allocatable {NVIDIA_RESOURCE}")
        })?,
    };
    if count == 0 || mib == 0 {
        return Ok(None);
    }
    let fast_peer_link = match labels.get(FAST_PEER_LINK_LABEL).map(|v| v.trim()) {
        None | Some("false") => false,
        Some("true") => true,
        Some(other) => {
            return Err(format!(
                "node label {FAST_PEER_LINK_LABEL}={other:?} is neither \"true\" nor \"false\""
            ))
        }
    };
    Ok(Some(AcceleratorInventory {
        resource_name: NVIDIA_RESOURCE.into(),
        product: labels
            .get(GFD_PRODUCT)
            .cloned()
            .unwrap_or_else(|| "unknown".into()),
        count,
        memory_bytes: mib << 20,
        // A link between devices needs two of them.
        fast_peer_link: fast_peer_link && count > 1,
    }))
}

/// Groups devices by product: count, and the smallest memory of the group (a plan must fit
/// every device it may land on).
pub fn group(devices: &[Device]) -> Vec<AcceleratorInventory> {
    let mut by: BTreeMap<&str, AcceleratorInventory> = BTreeMap::new();
    for d in devices {
        let e = by
            .entry(&d.product)
            .or_insert_with(|| AcceleratorInventory {
                resource_name: NVIDIA_RESOURCE.into(),
                product: d.product.clone(),
                count: 0,
                memory_bytes: u64::MAX,
                fast_peer_link: true,
            });
        e.count += 1;
        e.memory_bytes = e.memory_bytes.min(d.memory_total);
        e.fast_peer_link &= d.fast_peer_link;
    }
    by.into_values()
        .map(|mut a| {
            a.fast_peer_link &= a.count > 1;
            a
        })
        .collect()
}

/// GPU Feature Discovery's spelling of a product name.
pub fn product_label(name: &str) -> String {
    name.split_whitespace().collect::<Vec<_>>().join("-")
}

fn nvml_devices() -> Result<Vec<Device>, String> {
    let nvml = nvml_wrapper::Nvml::init().map_err(|e| format!("NVML unavailable: {e}"))?;
    let count = nvml
        .device_count()
        .map_err(|e| format!("NVML device count: {e}"))?;
    let mut out = Vec::new();
    for index in 0..count {
        let dev = nvml
            .device_by_index(index)
            .map_err(|e| format!("NVML device {index}: {e}"))?;
        let name = dev
            .name()
            .map_err(|e| format!("NVML device {index} name: {e}"))?;
        let mem = dev
            .memory_info()
            .map_err(|e| format!("NVML device {index} memory: {e}"))?;
        let fast_peer_link =
            (0..NVLINK_LINKS).any(|l| dev.link_wrapper_for(l).is_active().unwrap_or(false));
        out.push(Device {
            index,
            product: product_label(&name),
            memory_total: mem.total,
            memory_free: mem.free,
            fast_peer_link,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(index: u32, product: &str, total: u64, link: bool) -> Device {
        Device {
            index,
            product: product.into(),
            memory_total: total,
            memory_free: total / 2,
            fast_peer_link: link,
        }
    }

    #[test]
    fn groups_by_product_with_smallest_memory() {
        let g = group(&[
            dev(0, "NVIDIA-H200", 100, true),
            dev(1, "NVIDIA-H200", 90, true),
            dev(2, "NVIDIA-L4", 24, false),
        ]);
        assert_eq!(g.len(), 2);
        assert_eq!(
            (
                g[0].product.as_str(),
                g[0].count,
                g[0].memory_bytes,
                g[0].fast_peer_link
            ),
            ("NVIDIA-H200", 2, 90, true)
        );
        assert_eq!((g[1].count, g[1].fast_peer_link), (1, false));
    }

    #[test]
    fn gfd_labels_describe_the_devices() {
        let labels = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let a100 = labels(&[
            (GFD_PRODUCT, "NVIDIA-A100-SXM4-80GB"),
            (GFD_COUNT, "8"),
            (GFD_MEMORY_MIB, "81920"),
        ]);
        let acc = from_gfd_labels(&a100, Some(4)).unwrap().unwrap();
        assert_eq!(
            (
                acc.resource_name.as_str(),
                acc.product.as_str(),
                acc.count,
                acc.memory_bytes,
                acc.fast_peer_link
            ),
            (NVIDIA_RESOURCE, "NVIDIA-A100-SXM4-80GB", 8, 80 << 30, false)
        );
        // No count label: the allocatable count.
        let no_count = labels(&[(GFD_MEMORY_MIB, "143771")]);
        let acc = from_gfd_labels(&no_count, Some(4)).unwrap().unwrap();
        assert_eq!((acc.count, acc.product.as_str()), (4, "unknown"));
        // No GPU labels at all: nothing, and no error.
        assert_eq!(
            from_gfd_labels(&labels(&[("accelerator", "huawei-Ascend910B")]), None),
            Ok(None)
        );
        // Unreadable labels are named.
        let err = from_gfd_labels(&labels(&[(GFD_MEMORY_MIB, "80GB")]), Some(8)).unwrap_err();
        assert!(
            err.contains(GFD_MEMORY_MIB) && err.contains("80GB"),
            "{err}"
        );
        let err = from_gfd_labels(&no_count, None).unwrap_err();
        assert!(err.contains(GFD_COUNT), "{err}");
        // The fast peer link, where a label says so (and only between two devices or more).
        let mut linked = a100.clone();
        linked.insert(FAST_PEER_LINK_LABEL.into(), "true".into());
        assert!(
            from_gfd_labels(&linked, None)
                .unwrap()
                .unwrap()
                .fast_peer_link
        );
        linked.insert(GFD_COUNT.into(), "1".into());
        assert!(
            !from_gfd_labels(&linked, None)
                .unwrap()
                .unwrap()
                .fast_peer_link
        );
        linked.insert(FAST_PEER_LINK_LABEL.into(), "yes".into());
        let err = from_gfd_labels(&linked, None).unwrap_err();
        assert!(
            err.contains(FAST_PEER_LINK_LABEL) && err.contains("yes"),
            "{err}"
        );
        // The inventory uses the labels only when NVML found nothing.
        let mut inv = Inventory {
            labelled: vec![from_gfd_labels(&a100, None).unwrap().unwrap()],
            ..Inventory::default()
        };
        assert_eq!(inv.accelerators()[0].count, 8);
        inv.devices = vec![dev(0, "NVIDIA-L4", 24, false)];
        assert_eq!(inv.accelerators()[0].product, "NVIDIA-L4");
    }

    #[test]
    fn product_names_use_dashes() {
        assert_eq!(
            product_label("NVIDIA A100-SXM4-80GB"),
            "NVIDIA-A100-SXM4-80GB"
        );
    }

    #[test]
    fn no_nvml_means_no_devices_and_a_note() {
        // This machine has no NVIDIA library; the inventory still reads the host.
        let inv = Inventory::read(None);
        if inv.devices.is_empty() {
            assert!(inv.accelerator_note.is_some());
        }
        assert!(inv.host.total > 0);
    }
}
