//! The layerwise operator: turns a `DiffusionDeployment` into prepare requests on
//! `DiffusionNode`s, a plan recorded in status, and an engine Deployment plus Service, and
//! scales the Deployment from the engines' queue depth.
//!
//! Decisions are pure functions ([`planner`], [`autoscaler`], [`resources`]); the
//! [`controller`] does the API calls around them.

pub mod autoscaler;
pub mod conditions;
pub mod controller;
pub mod error;
pub mod planner;
pub mod resources;

pub use controller::{run, Context, Settings};
pub use error::{Error, Result};
