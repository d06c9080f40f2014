//! `DiffusionDeployment`: one model served by a set of engine pods, sized by the operator.
//!
//! One module per part of the kind: the spec and its cross-field rules ([`spec`]), what
//! is served ([`model`]), where it runs ([`accelerator`]), how many pods
//! ([`autoscaling`]), the step cache ([`cache`]), the pods themselves ([`engine`]) and how a
//! rollout replaces them ([`rollout`]), routing through an InferencePool
//! ([`routing`]) and what the operator reports back ([`status`]). This file only declares
//! them and re-exports their names, so `crate::deployment::X` stays the one path.

pub mod accelerator;
pub mod autoscaling;
pub mod cache;
pub mod engine;
pub mod model;
pub mod rollout;
pub mod routing;
pub mod spec;
pub mod status;

pub use accelerator::{Accelerator, AcceleratorRates, DeviceAllocation};
pub use autoscaling::{Autoscaling, AutoscalingMode};
pub use cache::WorkloadCache;
pub use engine::{DisruptionBudget, EngineSpec};
pub use model::{ModelSpec, Workload};
pub use rollout::Rollout;
pub use routing::{EndpointPickerRef, FailureMode, InferencePoolRouting, PortNumber};
pub use spec::{DiffusionDeployment, DiffusionDeploymentSpec};
pub use status::{
    ComponentPlacement, ComponentPlan, DiffusionDeploymentStatus, MemoryBreakdown, Plan, PlanRates,
};
