//! The layerwise operator: turns a `DiffusionDeployment` into prepare requests on
//! `DiffusionNode`s, a plan recorded in status, and an engine Deployment plus Service, and
//! scales the Deployment from the engines' queue depth.
//!
//! Decisions are pure functions ([`planner`], [`placement`], [`autoscaler`], [`resources`]);
//! the [`controller`] runs a reconcile's [`phases`] over reflector [`stores`] with the
//! shared [`context`], writes prepare requests through one writer per node ([`requests`])
//! and reports through one path ([`report`]); [`leader`] decides which replica runs it;
//! [`telemetry`], [`http`] and the counting [`client`] say what it does; [`inference_pool`]
//! keeps the Gateway API inference extension's InferencePool a deployment may ask for; [`dra`]
//! reads the devices Dynamic Resource Allocation offers and claims them for the pods;
//! [`surge`] chooses whether a rollout may start a pod beyond the replicas, and
//! [`deletion_cost`] keeps each engine pod's deletion cost from its queue so a scale-down
//! removes the idlest;
//! [`plan_cli`] is the planner as a command (`layerwise-operator plan`), for sizing without
//! a cluster.

pub mod autoscaler;
pub mod backoff;
pub mod client;
pub mod conditions;
pub mod context;
pub mod controller;
pub mod deletion_cost;
pub mod dra;
pub mod error;
pub mod http;
pub mod inference_pool;
pub mod leader;
pub mod node_owner;
pub mod phases;
pub mod placement;
pub mod plan_cli;
pub mod planner;
pub mod report;
pub mod requests;
pub mod resources;
pub mod settle;
pub mod staging;
pub mod stores;
pub mod surge;
pub mod telemetry;
pub mod volume;

pub use context::{Context, Election, Settings};
pub use error::{Error, Result};
pub use leader::run;
pub use telemetry::Telemetry;
