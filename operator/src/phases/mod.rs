//! One reconcile of a DiffusionDeployment, as phases in order: admit the spec, ask nodes
//! to prepare the model, collect their profiles, plan, size the replicas, apply the engine
//! Deployment and Service, report what runs, and keep the InferencePool the spec asks for.
//! A phase that cannot go on returns `ControlFlow::Break` with a typed [`Stop`], and
//! [`apply`] records every stop the same way ([`Report::stop`]); API errors are `Err` and
//! go to the controller's error policy.
//!
//! A module per phase ([`prepare`], [`plan`](mod@plan), [`scale`], [`deploy`], [`observe`]),
//! the sequence in [`reconcile`]; this file only declares them.
//!
//! [`Stop`]: crate::report::Stop
//! [`Report::stop`]: crate::report::Report::stop

mod deploy;
mod observe;
mod phase;
mod plan;
mod prepare;
mod reconcile;
mod scale;
mod stage;

pub use reconcile::apply;
