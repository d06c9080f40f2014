//! What a reconcile tells people, and the one path it takes: conditions set on a
//! [`Report`] as the phases go, events queued beside them, and one [`Report::commit`] that
//! publishes the events and then writes the status (only when it changed): whoever sees a
//! status finds the events that explain it. A new plan is written before the engine objects
//! are applied ([`Report::record`]). A phase that cannot
//! go on returns a typed [`Stop`]; [`Report::stop`] turns it into its condition, `Degraded`
//! and a warning event, the same way for every reason.

use std::time::Duration;

use crds::{DiffusionDeployment, DiffusionDeploymentStatus};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::runtime::events::{Event, EventType};
use kube::{Api, Resource, ResourceExt};
use serde_json::json;
use tracing::{info, warn};

use crate::conditions::{self as cond, set};
use crate::context::{Context, API_VERSION, MANAGER};
use crate::error::{kube, Result};
use crate::requests::model_id;

/// Why a reconcile stopped before running the deployment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stop {
    /// The model's hostPath lies outside the roots the operator serves from.
    ModelOutsideRoots { path: String, roots: Vec<String> },
    /// No node with a DiffusionNode matches the selector and offers the accelerator (and,
    /// for a model on a node-bound volume, is one of the volume's nodes).
    NoCandidateNodes {
        resource: String,
        volume: Option<String>,
    },
    /// The model's PersistentVolumeClaim cannot be served: `reason` names why
    /// ([`crate::volume::locate_claim`]).
    ClaimUnusable {
        reason: &'static str,
        message: String,
    },
    /// The devices `spec.accelerator.dra` asks for cannot be planned: `reason` names why
    /// ([`crate::dra::observe`]).
    DevicesUnusable {
        reason: &'static str,
        message: String,
    },
    /// No candidate node has a complete copy of a staged model: `reason` is
    /// [`crate::staging::STAGING`] while some may still finish, or
    /// [`crate::staging::STAGING_FAILED`] when none can.
    Staging {
        reason: &'static str,
        message: String,
    },
    /// The nodes asked have not reported a profile yet.
    WaitingForProfile { nodes: usize, location: String },
    /// Every node asked failed to profile the model.
    ProfileFailed { failures: Vec<String> },
    /// The planner refused: `reason` is its shortage's condition reason.
    Unplannable {
        reason: &'static str,
        message: String,
    },
}

impl Stop {
    /// The condition reason (and the `reason` label of `layerwise_operator_reconcile_stops`).
    pub fn reason(&self) -> &'static str {
        match self {
            Stop::ModelOutsideRoots { .. } => "ModelOutsideRoots",
            Stop::NoCandidateNodes { .. } => "NoCandidateNodes",
            Stop::WaitingForProfile { .. } => "WaitingForProfile",
            Stop::ProfileFailed { .. } => "ProfileFailed",
            Stop::Unplannable { reason, .. }
            | Stop::Staging { reason, .. }
            | Stop::ClaimUnusable { reason, .. }
            | Stop::DevicesUnusable { reason, .. } => reason,
        }
    }

    /// The condition that turns False.
    pub fn condition(&self) -> &'static str {
        match self {
            Stop::ModelOutsideRoots { .. }
            | Stop::Unplannable { .. }
            | Stop::ClaimUnusable { .. }
            | Stop::DevicesUnusable { .. } => cond::PLANNED,
            Stop::NoCandidateNodes { .. }
            | Stop::WaitingForProfile { .. }
            | Stop::ProfileFailed { .. } => cond::MODEL_PROFILED,
            Stop::Staging { .. } => cond::MODEL_STAGED,
        }
    }

    /// Whether a person has to act (`Degraded` True and a warning event); waiting for the
    /// agents is progress, not a fault.
    pub fn degraded(&self) -> bool {
        !matches!(self, Stop::WaitingForProfile { .. })
            && !matches!(self, Stop::Staging { reason, .. } if *reason == crate::staging::STAGING)
    }

    /// When to look again without a change to the deployment or its nodes (which the
    /// watches bring at once); `None`: only on a change.
    pub fn retry(&self, resync: Duration) -> Option<Duration> {
        match self {
            Stop::ModelOutsideRoots { .. } => None,
            // A claim's binding and its volume are read, not watched: look again soon.
            Stop::NoCandidateNodes { .. }
            | Stop::ClaimUnusable { .. }
            | Stop::DevicesUnusable { .. } => {
                Some(Duration::from_secs(30).min(resync.max(Duration::from_secs(5))))
            }
            Stop::WaitingForProfile { .. } | Stop::ProfileFailed { .. } | Stop::Staging { .. } => {
                Some(resync.min(Duration::from_secs(5)))
            }
            Stop::Unplannable { .. } => Some(Duration::from_secs(60)),
        }
    }

    pub fn message(&self) -> String {
        match self {
            Stop::ModelOutsideRoots { path, roots } => format!(
                "model hostPath `{path}` is outside the model roots this operator serves from ({}); move the model under one of them, or add its folder to the chart's agent.modelRoots",
                roots.join(", ")
            ),
            Stop::NoCandidateNodes { resource, volume } => format!(
                "no node with a DiffusionNode matches the node selector and offers {resource}{}; check accelerator.nodeSelector and that the layerwise agent runs on the accelerator nodes",
                volume.as_ref().map(|v| format!(" among the nodes that hold {v}")).unwrap_or_default()
            ),
            Stop::WaitingForProfile { nodes, location } => {
                format!("waiting for {nodes} candidate node(s) to profile {location}")
            }
            Stop::ProfileFailed { failures } => format!(
                "every candidate node failed to profile the model: {}",
                failures.join("; ")
            ),
            Stop::Unplannable { message, .. }
            | Stop::Staging { message, .. }
            | Stop::ClaimUnusable { message, .. }
            | Stop::DevicesUnusable { message, .. } => message.clone(),
        }
    }
}

/// The status a reconcile builds, and the events it will publish.
pub struct Report {
    /// The status before this reconcile.
    pub old: DiffusionDeploymentStatus,
    pub status: DiffusionDeploymentStatus,
    pub now: Timestamp,
    generation: Option<i64>,
    events: Vec<Event>,
    /// The status this reconcile has written so far ([`Report::record`]), if any.
    written: Option<DiffusionDeploymentStatus>,
    /// The conditions this reconcile has set: the others of [`cond::STEPS`] were not
    /// reached when it stops ([`cond::unreached`]).
    reached: Vec<String>,
}

impl Report {
    pub fn new(dd: &DiffusionDeployment, now: Timestamp) -> Report {
        let old = dd.status.clone().unwrap_or_default();
        let mut status = old.clone();
        status.observed_generation = dd.metadata.generation;
        status.selector = crate::resources::selector_string(dd);
        Report {
            old,
            status,
            now,
            generation: dd.metadata.generation,
            events: Vec::new(),
            written: None,
            reached: Vec::new(),
        }
    }

    /// Sets condition `type_`.
    pub fn set(&mut self, type_: &str, ok: bool, reason: &str, message: impl Into<String>) {
        if !self.reached.iter().any(|t| t == type_) {
            self.reached.push(type_.into());
        }
        set(
            &mut self.status.conditions,
            type_,
            ok,
            reason,
            message,
            self.generation,
            self.now,
        );
    }

    /// Removes condition `type_` (it no longer applies).
    pub fn clear(&mut self, type_: &str) {
        self.status.conditions.retain(|c| c.type_ != type_);
    }

    /// The reason and message condition `type_` had before this reconcile.
    pub fn was(&self, type_: &str) -> Option<(&str, &str)> {
        self.old
            .conditions
            .iter()
            .find(|c| c.type_ == type_)
            .map(|c| (c.reason.as_str(), c.message.as_str()))
    }

    /// Whether condition `type_` was True before this reconcile.
    pub fn was_true(&self, type_: &str) -> bool {
        cond::is_true(&self.old.conditions, type_)
    }

    /// Queues an event (published by [`Report::commit`]).
    pub fn event(&mut self, type_: EventType, reason: &str, action: &str, note: String) {
        self.events.push(Event {
            type_,
            reason: reason.into(),
            note: Some(truncate(note, 1000)),
            action: action.into(),
            secondary: None,
        });
    }

    /// Sets condition `type_` False for `why` with a warning event when that is news: the
    /// one way a fault is reported, by [`Report::stop`] and by phases that go on past it.
    pub fn fault(&mut self, type_: &str, reason: &str, action: &str, message: &str) {
        if self.was(type_) != Some((reason, message)) {
            self.event(EventType::Warning, reason, action, message.to_string());
        }
        self.set(type_, false, reason, message);
    }

    /// Records that the reconcile stops for `stop`: its condition False, `Degraded` as the
    /// stop says, and a warning event when the reason or message is new.
    pub fn stop(&mut self, stop: &Stop) {
        let (condition, reason, message) = (stop.condition(), stop.reason(), stop.message());
        if stop.degraded() {
            self.fault(condition, reason, "Plan", &message);
        } else {
            self.set(condition, false, reason, &message);
        }
        self.set(cond::DEGRADED, stop.degraded(), reason, message);
        let reached = std::mem::take(&mut self.reached);
        cond::unreached(
            &mut self.status.conditions,
            |t| reached.iter().any(|r| r == t),
            condition,
            reason,
            self.generation,
            self.now,
        );
        self.reached = reached;
    }

    /// Publishes the events queued so far and writes the status as it stands now, if it
    /// changed; the reconcile goes on. A new plan is recorded this way as soon as it is made:
    /// applying the engine objects after it can wait seconds on a busy control plane (the
    /// apiserver hands out one Service ClusterIP at a time), and the plan is a decision
    /// people read whether or not its pods exist yet.
    pub async fn record(&mut self, ctx: &Context, dd: &DiffusionDeployment) -> Result<()> {
        self.summarize(true);
        publish(ctx, dd, std::mem::take(&mut self.events)).await;
        self.write_if_changed(ctx, dd).await
    }

    /// Publishes the queued events, then writes the status if it changed.
    pub async fn commit(mut self, ctx: &Context, dd: &DiffusionDeployment) -> Result<()> {
        self.summarize(false);
        publish(ctx, dd, std::mem::take(&mut self.events)).await;
        self.write_if_changed(ctx, dd).await
    }

    /// Sets the summary conditions from the step conditions ([`cond::summarize`]).
    fn summarize(&mut self, deploying: bool) {
        cond::summarize(
            &mut self.status.conditions,
            deploying,
            self.generation,
            self.now,
        );
    }

    /// Writes the status unless it is what this reconcile last wrote (or, before any
    /// write, what the deployment already had).
    async fn write_if_changed(&mut self, ctx: &Context, dd: &DiffusionDeployment) -> Result<()> {
        if self.written.as_ref().unwrap_or(&self.old) != &self.status {
            write_status(ctx, dd, &self.status).await?;
            self.written = Some(self.status.clone());
        }
        Ok(())
    }

    /// Publishes the queued events and drops the status (the reconcile failed part way).
    pub async fn abandon(self, ctx: &Context, dd: &DiffusionDeployment) {
        publish(ctx, dd, self.events).await;
    }
}

/// Server-side applies `status` as the whole status of `dd`.
async fn write_status(
    ctx: &Context,
    dd: &DiffusionDeployment,
    status: &DiffusionDeploymentStatus,
) -> Result<()> {
    let api: Api<DiffusionDeployment> =
        Api::namespaced(ctx.client.clone(), &dd.namespace().unwrap_or_default());
    let patch =
        json!({ "apiVersion": API_VERSION, "kind": "DiffusionDeployment", "status": status });
    api.patch_status(
        &dd.name_any(),
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await
    .map_err(kube(format!("writing status of {}", model_id(dd))))?;
    Ok(())
}

/// Publishes `events` about `dd`; a failure is logged, never fatal.
pub async fn publish(ctx: &Context, dd: &DiffusionDeployment, events: Vec<Event>) {
    let reference = dd.object_ref(&());
    for ev in events {
        let note = ev.note.as_deref().unwrap_or_default();
        match ev.type_ {
            EventType::Warning => warn!(deployment = %model_id(dd), reason = %ev.reason, "{note}"),
            EventType::Normal => info!(deployment = %model_id(dd), reason = %ev.reason, "{note}"),
        }
        if let Err(err) = ctx.recorder.publish(&ev, &reference).await {
            warn!(deployment = %model_id(dd), error = %err, "publishing event {}", ev.reason);
        }
    }
}

fn truncate(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut cut = max;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dd() -> DiffusionDeployment {
        let mut dd: DiffusionDeployment = serde_json::from_value(json!({
            "apiVersion": "layerwise.dev/v1alpha1", "kind": "DiffusionDeployment",
            "metadata": { "name": "m", "namespace": "ns", "generation": 3 },
            "spec": {
                "model": { "family": "dit", "location": { "hostPath": "/models/m" } },
                "workload": { "maxWidth": 512, "maxHeight": 512 },
            },
        }))
        .unwrap();
        dd.status = Some(Default::default());
        dd
    }

    fn condition<'a>(r: &'a Report, type_: &str) -> (&'a str, &'a str) {
        let c = r
            .status
            .conditions
            .iter()
            .find(|c| c.type_ == type_)
            .unwrap();
        (c.status.as_str(), c.reason.as_str())
    }

    #[test]
    fn every_stop_sets_its_condition_degraded_and_a_warning_when_new() {
        let stops = [
            Stop::ModelOutsideRoots {
                path: "/etc".into(),
                roots: vec!["/models".into()],
            },
            Stop::NoCandidateNodes {
                resource: "nvidia.com/gpu".into(),
                volume: None,
            },
            Stop::ClaimUnusable {
                reason: "ClaimNotBound",
                message: "PersistentVolumeClaim store is Pending".into(),
            },
            Stop::ProfileFailed {
                failures: vec!["n1: bad header".into()],
            },
            Stop::Unplannable {
                reason: "InsufficientDeviceMemory",
                message: "short by 1 byte".into(),
            },
        ];
        for stop in stops {
            let mut r = Report::new(&dd(), Timestamp::UNIX_EPOCH);
            r.stop(&stop);
            assert_eq!(condition(&r, stop.condition()), ("False", stop.reason()));
            assert_eq!(condition(&r, cond::DEGRADED), ("True", stop.reason()));
            assert_eq!(r.events.len(), 1, "{stop:?}");
            assert_eq!(r.events[0].type_, EventType::Warning);
            assert_eq!(r.events[0].reason, stop.reason());
            // The same stop again: no second event.
            let mut again = dd();
            again.status = Some(r.status.clone());
            let mut r2 = Report::new(&again, Timestamp::UNIX_EPOCH);
            r2.stop(&stop);
            assert!(r2.events.is_empty(), "{stop:?}");
            assert_eq!(r2.status, r2.old, "nothing to write");
        }
    }

    #[test]
    fn waiting_for_profiles_is_not_degraded_and_sends_no_warning() {
        let mut r = Report::new(&dd(), Timestamp::UNIX_EPOCH);
        let stop = Stop::WaitingForProfile {
            nodes: 3,
            location: "/models/m".into(),
        };
        r.stop(&stop);
        assert_eq!(
            condition(&r, cond::MODEL_PROFILED),
            ("False", "WaitingForProfile")
        );
        assert_eq!(
            condition(&r, cond::DEGRADED),
            ("False", "WaitingForProfile")
        );
        assert!(r.events.is_empty());
        assert_eq!(
            stop.retry(Duration::from_secs(15)),
            Some(Duration::from_secs(5))
        );
        assert_eq!(r.status.observed_generation, Some(3));
    }
}
