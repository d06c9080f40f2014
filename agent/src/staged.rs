//! A requested model whose source the agent copies into its node model cache (`s3`): the
//! task stages it ([`crate::cache::stage`]), reporting each try's progress and failure to
//! the node loop, retrying with backoff until the copy is published, then profiles and warms
//! the published copy as [`models::prepare`] does any folder on the node. It sits above the
//! cache and the model task so that neither knows the other.

use std::path::PathBuf;
use std::sync::Arc;

use crds::{ModelRequest, S3Source, StagingState, StagingStatus};
use kube::Client;
use tokio::sync::mpsc;
use tracing::{info, warn};

use crate::cache::stage::{self, Stager};
use crate::models::{self, Settings, Update};
use crate::{Error, Result};

/// The namespace of a request's DiffusionDeployment (its id is `<namespace>/<name>`), where
/// its credentials Secret is.
pub fn namespace(id: &str) -> Result<&str> {
    match id.split_once('/') {
        Some((ns, name)) if !ns.is_empty() && !name.is_empty() => Ok(ns),
        _ => Err(Error::Model {
            id: id.into(),
            msg: "the request's id is not <namespace>/<name>: no namespace to read the credentials Secret from".into(),
        }),
    }
}

/// The S3 sources of `requests`, whose copies the cache keeps.
pub fn sources(requests: &[ModelRequest]) -> Vec<&S3Source> {
    requests
        .iter()
        .filter_map(|r| r.location.s3.as_deref())
        .collect()
}

/// Stages `request`'s source into the cache, then profiles and warms the copy, reporting
/// to `tx` as task `task`. Runs until the copy is staged (a failed try is reported and
/// retried after [`stage::retry_after`]) or the task is aborted.
pub async fn prepare(
    request: ModelRequest,
    task: u64,
    stager: Arc<Stager>,
    client: Client,
    settings: Arc<Settings>,
    tx: mpsc::Sender<Update>,
) {
    let id = request.id.clone();
    let Some(spec) = request.location.s3.clone() else {
        return;
    };
    let ns = match namespace(&id) {
        Ok(ns) => ns.to_string(),
        Err(error) => {
            let _ = tx.send(Update::Failed { id, task, error }).await;
            return;
        }
    };
    let key = crate::cache::fill::key_of(&spec);
    let mut failures = 0u32;
    let dir: PathBuf = loop {
        let mut last = (0, 0);
        let report = |status: StagingStatus| {
            last = (status.bytes, status.total_bytes);
            // Progress is advisory: dropped rather than waited for when the loop is busy.
            let _ = tx.try_send(Update::Staging {
                id: id.clone(),
                task,
                status,
            });
        };
        let tried = stager.try_once(&client, &ns, &spec, report).await;
        match tried {
            Ok(dir) => break dir,
            Err(e) => {
                failures += 1;
                let wait = stage::retry_after(e.fault, failures);
                warn!(model = %id, source = %spec.describe(), reason = e.fault.reason(), error = %e.msg, retry_in_s = wait.as_secs(), "staging failed");
                let status = stage::failed(&e, failures, last.0, last.1);
                // A failure is a state change: waited for, never dropped.
                let _ = tx
                    .send(Update::Staging {
                        id: id.clone(),
                        task,
                        status,
                    })
                    .await;
                tokio::time::sleep(wait).await;
            }
        }
    };
    let total = stager
        .cache()
        .manifest(&key)
        .map(|m| m.bytes())
        .unwrap_or_default();
    let path = stager.host_path(&key);
    info!(model = %id, source = %spec.describe(), bytes = total, path = %path.display(), "staged");
    let _ = tx
        .send(Update::Staging {
            id: id.clone(),
            task,
            status: StagingStatus {
                state: StagingState::Staged,
                bytes: total,
                total_bytes: total,
                path: Some(path.display().to_string()),
                failures,
                ..Default::default()
            },
        })
        .await;
    models::prepare(id, task, dir, request.family, settings, tx).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_namespace_is_the_ids_first_part() {
        assert_eq!(namespace("team-a/wan").unwrap(), "team-a");
        for bad in ["wan", "/wan", "team-a/"] {
            let e = namespace(bad).unwrap_err().to_string();
            assert!(e.contains(bad) && e.contains("<namespace>/<name>"), "{e}");
        }
    }
}
