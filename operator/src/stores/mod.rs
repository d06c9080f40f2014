//! The leader's view of the fleet: reflector stores of Nodes and DiffusionNodes that every
//! reconcile reads instead of listing them, and the reconciles their changes cause; and
//! stores of the engine Deployments and Services the operator made, which a reconcile reads
//! instead of getting them (their changes reconcile their owner, as `Controller::owns`
//! does), with what it last applied of each ([`Applied`]) so an unchanged object is not
//! applied again; and a store of the engine pods, which the builtin autoscaler's scrape and
//! the unschedulable check read instead of listing them.
//!
//! Each kind is watched once. Its watch stream fills the store and, past the first full
//! list, turns a change that matters into reconciles of the deployments it concerns:
//! - a Node whose labels, allocatable resources or schedulability change (or that goes):
//!   the deployments whose node selector matches it, and those that asked it to prepare;
//! - a DiffusionNode whose model requests or reports change: the deployments they name;
//!   when its inventory (accelerators, memory) changes, or it is new: also the deployments
//!   whose selector matches its Node;
//! - an engine pod the scheduler turns away, or that it places after all (or that goes while
//!   turned away): its deployment. Nothing else about a pod reconciles: its readiness
//!   reaches the deployment through its engine Deployment's status.
//!
//! The agents' periodic rewrites (`updatedAt`) and kubelet heartbeats change nothing that
//! matters and cause nothing. Stored objects are trimmed to what placement reads.
//!
//! The stores a reconcile reads are in [`view`], what was last applied in [`applied`], the
//! watches in [`watch`](mod@watch) and which changes reconcile what in [`triggers`]; this
//! file only declares them and names their items for the rest of the operator.

mod applied;
mod triggers;
mod view;
mod watch;

pub use applied::Applied;
pub use triggers::{dn_refs, node_refs, unschedulable, INSTANCE};
pub use view::{Stores, MANAGED_BY};
pub use watch::{watch, Touched, Watches};

#[cfg(test)]
mod tests;
