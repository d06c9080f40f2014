//! The engine Deployment, Service and PodDisruptionBudget a DiffusionDeployment runs as,
//! built from its spec, its plan and what the platform gives every engine pod
//! ([`EnginePods`]). Pure: the controller applies what these return.
//!
//! - [`contract`]: what a pod tells the engine, its plan as the engine's own contract;
//! - [`deployment`]: the Deployment's pod template and the Service in front of its pods;
//! - [`claims`]: the container's accelerators and memory, and its claim on devices;
//! - [`volumes`]: the model, scratch and shared-memory volumes and their mounts;
//! - [`objects`]: the labels and the other objects a DiffusionDeployment owns;
//! - [`platform`]: what the platform gives every engine pod;
//! - [`rollout`]: how a rollout replaces the pods (`spec.engine.rollout`, or no surge).

mod claims;
mod contract;
mod deployment;
pub mod drain;
pub mod image;
mod objects;
mod platform;
pub mod rollout;
mod volumes;

#[cfg(test)]
mod cache_tests;
#[cfg(test)]
mod model_mount_tests;
#[cfg(test)]
mod tests;

pub use claims::DEVICE_CLAIM;
pub use contract::{decode_site, engine_contract, request_bounds, ENGINE_PORT};
pub use deployment::{deployment, plan_summary, scheduling_of, service, PLAN_ANNOTATION};
pub use drain::DRAIN_DELAY_SECONDS;
pub(crate) use objects::owned_meta;
pub use objects::{
    disruption_budget, job_key_secret, job_key_secret_name, selector_labels, selector_string,
    JOB_KEY,
};
pub use platform::EnginePods;
pub use volumes::{model_path, MODEL_MOUNT, SHM_BYTES_PER_RANK};
