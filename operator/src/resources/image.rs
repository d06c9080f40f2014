//! Which engine image a deployment's pods run. The operator's default image follows its own
//! version, so taking it afresh on every reconcile would make every operator upgrade roll
//! every engine pod of the fleet. Instead the image is recorded in the deployment's status
//! (`status.engineImage`) when its pods are first made, and changes only when the user asks:
//! by `spec.engine.image`, or by the annotation [`FOLLOW_OPERATOR`] set to `"true"`, under
//! which the deployment takes the operator's default as it changes.

use crds::DiffusionDeployment;
use k8s_openapi::api::apps::v1::Deployment;
use kube::ResourceExt;

/// Annotation on a DiffusionDeployment: `"true"` makes its engine image follow the
/// operator's default (the chart's engine image), so an operator upgrade rolls its pods onto
/// the new engine. Set it to upgrade, remove it to stay on the image recorded then.
pub const FOLLOW_OPERATOR: &str = "layerwise.dev/engine-image-follows-operator";

/// The image `dd`'s pods run: the spec's, when it names one; the operator's `default` while
/// [`FOLLOW_OPERATOR`] is set; else the one `recorded` in the status, or (for deployments
/// made before the status recorded it) the one the `existing` engine Deployment runs; the
/// operator's `default` for a new deployment.
pub fn engine_image(
    dd: &DiffusionDeployment,
    recorded: Option<&str>,
    existing: Option<&Deployment>,
    default: &str,
) -> String {
    if let Some(image) = &dd.spec.engine.image {
        return image.clone();
    }
    if dd.annotations().get(FOLLOW_OPERATOR).map(String::as_str) == Some("true") {
        return default.to_string();
    }
    recorded
        .map(str::to_string)
        .or_else(|| existing.and_then(running_image))
        .unwrap_or_else(|| default.to_string())
}

/// The image of an engine Deployment's engine container.
fn running_image(d: &Deployment) -> Option<String> {
    d.spec
        .as_ref()?
        .template
        .spec
        .as_ref()?
        .containers
        .iter()
        .find(|c| c.name == "engine")?
        .image
        .clone()
}
