//! Models the node agents copy into their node model caches (`spec.model.location.s3`):
//! whether the candidate nodes have a complete copy, from the staging status each agent
//! reports in its `DiffusionNode`. Planning goes on from the nodes whose copy is published
//! (the agents profile only a complete copy, so only those nodes are planned and the engine
//! pods are held to them); while none is, the deployment waits with the nodes' progress, and
//! when every candidate has failed with a fault a person must fix, it says why on each node.
//! The engine pods mount the published copy's folder read-only, as a hostPath model
//! ([`staged_view`]).

use crds::{DiffusionDeployment, ModelState, StagingState, StagingStatus};

/// The reason of `ModelStaged` once a node has a complete copy.
pub const STAGED: &str = "Staged";
/// The reason while no node has one yet.
pub const STAGING: &str = "Staging";
/// The reason when no candidate node can stage the model without a person's help.
pub const STAGING_FAILED: &str = "StagingFailed";

/// Where the candidate nodes are with the copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Copies are complete on `nodes`, at `path` on each node.
    Staged {
        path: String,
        nodes: Vec<String>,
        message: String,
    },
    /// No complete copy yet; some node is still at it.
    Waiting { message: String },
    /// Every candidate failed with a fault a person must fix.
    Failed { message: String },
}

/// One node's line: its state, its progress, or its fault.
fn line(node: &str, s: Option<&StagingStatus>, failed: Option<&str>) -> String {
    if let Some(error) = failed {
        return format!("{node}: {error}");
    }
    let Some(s) = s else {
        return format!("{node}: not started");
    };
    let pct = |s: &StagingStatus| {
        if s.total_bytes == 0 {
            String::new()
        } else {
            format!(
                " {:.0}% of {} bytes",
                s.bytes as f64 * 100.0 / s.total_bytes as f64,
                s.total_bytes
            )
        }
    };
    match s.state {
        StagingState::Retrying | StagingState::Failed => format!(
            "{node}: {} ({}), try {} failed",
            s.reason.as_deref().unwrap_or("failed"),
            s.message.as_deref().unwrap_or(""),
            s.failures
        ),
        StagingState::Downloading => format!(
            "{node}: downloading{}{}",
            pct(s),
            s.eta_seconds
                .map(|e| format!(", {e}s left at {} bytes/s", s.bytes_per_second))
                .unwrap_or_default()
        ),
        state => format!("{node}: {state:?}{}", pct(s)),
    }
}

/// Judges the copy on the candidate nodes, given each one's name and its status of the
/// model (`None`: not reported yet).
pub fn judge(nodes: &[(String, Option<&crds::NodeModelStatus>)]) -> Verdict {
    let mut staged: Vec<(String, String)> = nodes
        .iter()
        .filter_map(|(n, m)| {
            let s = (*m)?.staging.as_ref()?;
            (s.state == StagingState::Staged)
                .then(|| Some((n.clone(), s.path.clone()?)))
                .flatten()
        })
        .collect();
    staged.sort();
    let lines: Vec<String> = nodes
        .iter()
        .map(|(n, m)| {
            let failed = m
                .filter(|m| m.state == ModelState::Failed && m.staging.is_none())
                .map(|m| m.error.as_deref().unwrap_or("failed"));
            line(n, m.and_then(|m| m.staging.as_ref()), failed)
        })
        .collect();
    if let Some((_, path)) = staged.first() {
        // Every agent of a cluster shares the chart's cache folder; a node whose agent uses
        // another is left out rather than given a pod that mounts the wrong folder.
        let on: Vec<String> = staged
            .iter()
            .filter(|(_, p)| p == path)
            .map(|(n, _)| n.clone())
            .collect();
        return Verdict::Staged {
            path: path.clone(),
            message: format!(
                "complete on {} of {} candidate node(s): {}",
                on.len(),
                nodes.len(),
                lines.join("; ")
            ),
            nodes: on,
        };
    }
    let stuck = |m: &Option<&crds::NodeModelStatus>| {
        m.is_some_and(|m| {
            m.state == ModelState::Failed
                || m.staging
                    .as_ref()
                    .is_some_and(|s| s.state == StagingState::Failed)
        })
    };
    if !nodes.is_empty() && nodes.iter().all(|(_, m)| stuck(m)) {
        return Verdict::Failed {
            message: format!(
                "the model cannot be staged on any candidate node: {}",
                lines.join("; ")
            ),
        };
    }
    Verdict::Waiting {
        message: format!(
            "no candidate node has a complete copy yet: {}",
            lines.join("; ")
        ),
    }
}

/// The deployment as the later phases see it once the copy is staged at `path`: its model
/// a folder on the nodes, so the engine pods mount that folder read-only (a hostPath) and
/// open it like any other.
pub fn staged_view(dd: &DiffusionDeployment, path: &str) -> DiffusionDeployment {
    let mut view = dd.clone();
    let loc = &mut view.spec.model.location;
    loc.s3 = None;
    loc.persistent_volume_claim = None;
    loc.revision = None;
    loc.host_path = Some(path.to_string());
    view
}

#[cfg(test)]
mod tests {
    use super::*;
    use crds::NodeModelStatus;

    fn model(state: ModelState, s: Option<StagingStatus>) -> NodeModelStatus {
        NodeModelStatus {
            id: "ns/m".into(),
            state,
            staging: s,
            ..Default::default()
        }
    }

    fn st(state: StagingState, bytes: u64, path: Option<&str>) -> StagingStatus {
        StagingStatus {
            state,
            bytes,
            total_bytes: 200,
            path: path.map(String::from),
            ..Default::default()
        }
    }

    #[test]
    fn a_complete_copy_is_planned_and_the_rest_are_reported() {
        let a = model(
            ModelState::Warm,
            Some(st(StagingState::Staged, 200, Some("/c/ready/k"))),
        );
        let b = model(
            ModelState::Staging,
            Some(st(StagingState::Downloading, 50, None)),
        );
        let v = judge(&[
            ("b".into(), Some(&b)),
            ("a".into(), Some(&a)),
            ("c".into(), None),
        ]);
        let Verdict::Staged {
            path,
            nodes,
            message,
        } = v
        else {
            panic!("{v:?}")
        };
        assert_eq!(
            (path.as_str(), nodes),
            ("/c/ready/k", vec!["a".to_string()])
        );
        assert!(
            message.contains("1 of 3")
                && message.contains("b: downloading 25% of 200 bytes")
                && message.contains("c: not started"),
            "{message}"
        );
    }

    #[test]
    fn it_waits_while_any_node_may_still_finish_and_fails_when_none_can() {
        let mut full = st(StagingState::Failed, 0, None);
        full.reason = Some("CacheFull".into());
        full.message = Some("the model needs 900 more bytes".into());
        full.failures = 2;
        let mut moving = st(StagingState::Retrying, 10, None);
        moving.reason = Some("ObjectChanged".into());
        let a = model(ModelState::Staging, Some(full));
        let b = model(ModelState::Staging, Some(moving));
        let v = judge(&[("a".into(), Some(&a)), ("b".into(), Some(&b))]);
        assert!(matches!(v, Verdict::Waiting { .. }), "{v:?}");
        let mut no_cache = model(ModelState::Failed, None);
        no_cache.error = Some("this agent has no node model cache".into());
        let v = judge(&[("a".into(), Some(&a)), ("b".into(), Some(&no_cache))]);
        let Verdict::Failed { message } = v else {
            panic!("{v:?}")
        };
        assert!(
            message.contains("cannot be staged on any candidate node")
                && message.contains("a: CacheFull (the model needs 900 more bytes), try 2 failed")
                && message.contains("b: this agent has no node model cache"),
            "{message}"
        );
        assert!(matches!(judge(&[]), Verdict::Waiting { .. }));
    }

    #[test]
    fn the_staged_view_mounts_the_copy_as_a_folder() {
        let dd: DiffusionDeployment = serde_json::from_value(serde_json::json!({
            "apiVersion": "layerwise.dev/v1alpha1",
            "kind": "DiffusionDeployment",
            "metadata": { "name": "m", "namespace": "ns" },
            "spec": { "model": { "family": "dit", "location": { "s3": { "bucket": "models" } } } },
        }))
        .unwrap();
        let view = staged_view(&dd, "/var/cache/ready/k");
        let loc = &view.spec.model.location;
        assert_eq!(loc.host_path.as_deref(), Some("/var/cache/ready/k"));
        assert!(loc.s3.is_none());
    }
}
