//! Devices by Dynamic Resource Allocation (`spec.accelerator.dra`, `resource.k8s.io/v1`).
//!
//! Where a deployment asks for its devices through DRA, the nodes offer no extended resource:
//! their DRA driver publishes each device in a ResourceSlice, with its attributes (product,
//! PCIe root) and capacities (memory). The operator reads the DeviceClass the spec names (or
//! the one the spec's ResourceClaimTemplate requests), keeps the devices its selectors
//! select, and gives the planner each node's count, memory, product and the largest group
//! of devices that share one value of the link attribute ([`Inventory`]). Figures a slice
//! does not publish are the node agent's.
//!
//! A pod's ranks all-gather every block, so they must sit on devices that share a fast link:
//! the planner sizes a pod's ranks against the largest such group of a node, and the
//! ResourceClaimTemplate generated for a plan ([`template`](fn@template)) asks the scheduler for the
//! plan's dp × sp devices of the class, each with at least the plan's device memory, all
//! sharing one value of the link attribute. That template is named after its own contents,
//! so a new plan gets a new template and the pods roll onto it; the operator deletes its
//! earlier templates once no engine pod claims through them.
//!
//! The operator reads the part of CEL that device classes select devices with
//! ([`Selector`]): conjunctions of equalities between `device.driver` or a device attribute
//! and a literal. A class beyond that is refused with a condition that quotes it, rather
//! than planned against devices it may not select.
//!
//! What it reads is in [`selector`] and [`inventory`], what it builds in [`template`](mod@template); this
//! file only declares them and names their items for the rest of the operator.

mod inventory;
mod selector;
mod template;

/// The name of the pod's claim and of the template's one device request.
pub use crate::resources::DEVICE_CLAIM as CLAIM;

pub use inventory::{inventory, named_request, observe, Inventory, NodeDevices, Unusable};
pub use selector::Selector;
pub use template::{apply_template, for_plan, template};

#[cfg(test)]
mod tests;
