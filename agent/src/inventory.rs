//! What the node has: accelerators (NVML, loaded at run time), host memory, and the pods'
//! cgroup limit. A node without the NVML library reports no accelerators and keeps working.

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
            host,
            pods_cgroup,
            pods_cgroup_note,
        }
    }

    /// Accelerators as the `DiffusionNode` status lists them.
    pub fn accelerators(&self) -> Vec<AcceleratorInventory> {
        group(&self.devices)
    }
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
