//! What the operator's parts share, at the bottom of its module graph: how the operator runs
//! ([`Settings`], with leader [`Election`]), what every reconcile shares ([`Context`]), and
//! the names it writes under. The controller, its phases, the report and the leader read
//! these; this module reads none of them.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::runtime::events::Recorder;
use kube::Client;

use crate::autoscaler::LoadSource;
use crate::backoff::Backoff;
use crate::planner::Limits;
use crate::requests::Requests;
use crate::stores::{Applied, Stores};
use crate::telemetry::Telemetry;

/// Field manager of everything the operator writes.
pub const MANAGER: &str = "layerwise-operator";
pub(crate) const API_VERSION: &str = "layerwise.dev/v1alpha1";

/// How the operator runs; the CLI fills it from flags.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Engine image for deployments that name none.
    pub engine_image: String,
    /// What every engine pod gets from the platform (pull secrets, RuntimeClass,
    /// tolerations).
    pub engine_pods: crate::resources::EnginePods,
    /// Planner allowances (overhead, slot cap).
    pub limits: Limits,
    /// How often a deployment is looked at again (the autoscaler's period).
    pub resync: Duration,
    /// Only this namespace's deployments, or all when `None`.
    pub namespace: Option<String>,
    /// Host folders models may be served from; empty: any. The engine pods mount the model's
    /// hostPath, so without this anyone who may create a DiffusionDeployment could read any
    /// host folder through an image of their choosing.
    pub model_roots: Vec<String>,
    /// The fewest candidate nodes a deployment asks to prepare its model (more when its most
    /// replicas need more; see [`crate::placement`]).
    pub prepare_nodes: usize,
    /// Leader election; `None`: this process always leads (one replica, or tests).
    pub election: Option<Election>,
}

/// What every reconcile shares. No globals: tests build their own.
pub struct Context {
    pub client: Client,
    /// Publishes the events `kubectl describe` shows.
    pub recorder: Recorder,
    pub settings: Settings,
    /// Where the builtin autoscaler reads engine pods' load.
    pub load: Arc<dyn LoadSource>,
    /// Nodes and DiffusionNodes, kept by watches.
    pub stores: Stores,
    pub telemetry: Arc<Telemetry>,
    /// Deployments (by uid) whose job-key Secret this process has made or found, so it is
    /// created once, not tried on every reconcile.
    pub job_keys: Mutex<HashSet<String>>,
    /// Deployments (by uid) whose spec asks for no PodDisruptionBudget and that this process
    /// has made sure have none, so the delete is sent once, not on every reconcile.
    pub no_budget: Mutex<HashSet<String>>,
    /// Deployments (by uid) whose spec asks for no InferencePool and that this process has
    /// made sure have none (see [`crate::inference_pool`]), so that delete is sent once too.
    pub no_pool: Mutex<HashSet<String>>,
    /// What this process last applied of each engine Deployment and Service.
    pub applied: Applied,
    /// The prepare requests on DiffusionNodes, written by one writer per node.
    pub requests: Requests,
    /// How long each failing deployment waits before its next try.
    pub backoff: Backoff,
}

/// How this replica takes part in leader election.
#[derive(Debug, Clone)]
pub struct Election {
    /// The Lease's name.
    pub lease: String,
    /// The Lease's namespace (the operator's own).
    pub namespace: String,
    /// This replica's `holderIdentity`: unique per process.
    pub identity: String,
    /// How long the lease lasts after its last renewal.
    pub lease_seconds: u64,
    /// How long before expiry the holder renews; also the clock skew between replicas the
    /// lease tolerates. Less than `lease_seconds`.
    pub grace_seconds: u64,
}
