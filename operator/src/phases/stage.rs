//! The staging phase, for a model the agents copy into their node model caches
//! ([`crate::staging`]): `ModelStaged` from the candidates' reports, a wait or a refusal
//! while no copy is complete, and the deployment as the later phases see it once one is.

use std::ops::ControlFlow;

use crds::DiffusionDeployment;
use kube::runtime::events::EventType;

use crate::conditions as cond;
use crate::placement::Candidate;
use crate::report::{Report, Stop};
use crate::requests::model_id;
use crate::staging::{self, Verdict};

use super::phase::Phase;

/// `None` for a model the agents do not stage; otherwise the deployment with its model at
/// the published copy's folder, once a candidate node has one.
pub(super) fn staged(
    dd: &DiffusionDeployment,
    asked: &[Candidate],
    r: &mut Report,
) -> Phase<Option<DiffusionDeployment>> {
    if dd.spec.model.location.s3.is_none() {
        r.clear(cond::MODEL_STAGED);
        return ControlFlow::Continue(None);
    }
    let id = model_id(dd);
    let nodes: Vec<(String, Option<&crds::NodeModelStatus>)> = asked
        .iter()
        .map(|c| (c.name(), c.dn.status.as_ref().and_then(|s| s.model(&id))))
        .collect();
    match staging::judge(&nodes) {
        Verdict::Staged { path, message, .. } => {
            if !r.was_true(cond::MODEL_STAGED) {
                r.event(EventType::Normal, "ModelStaged", "Stage", message.clone());
            }
            r.set(cond::MODEL_STAGED, true, staging::STAGED, message);
            ControlFlow::Continue(Some(staging::staged_view(dd, &path)))
        }
        Verdict::Waiting { message } => ControlFlow::Break(Stop::Staging {
            reason: staging::STAGING,
            message,
        }),
        Verdict::Failed { message } => ControlFlow::Break(Stop::Staging {
            reason: staging::STAGING_FAILED,
            message,
        }),
    }
}
