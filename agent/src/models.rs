//! One requested model's life on the node: resolve its folder, profile the checkpoint from
//! its headers, warm its files, and judge the result. The task here reports through a
//! channel to the node loop ([`crate::node`]), which owns every model's status.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crds::{ModelLocation, ModelState, Profile};
use layerwise_core::checkpoint::hf_cache;
use tokio::sync::mpsc;

use crate::cgroup::PrewarmCgroup;
use crate::pagecache::{self, Identity, Residency};
use crate::prewarm::{Options, Outcome};
use crate::profiler;
use crate::worker::{self, Job};
use crate::{Error, Result};

/// Residency at or above this fraction of the files counts as warm (the kernel may drop a
/// few pages of a large model at any time).
pub const WARM_FRACTION: f64 = 0.99;

/// How the node prepares models.
pub struct Settings {
    /// Prefix for host paths (where the node's root is mounted in the agent's container).
    pub model_root: Option<PathBuf>,
    /// Host folders models may be read from (empty: any).
    pub model_roots: Vec<String>,
    /// The binary that runs prewarm and profile jobs (this one).
    pub worker_exe: PathBuf,
    /// What the profiler process may use.
    pub profiler: profiler::Limits,
    pub options: Options,
    pub cgroup: Option<Arc<PrewarmCgroup>>,
    /// The page-cache budget, when one is set.
    pub budget: Option<u64>,
    /// The node model cache's folder as this process reads it, when the agent has one: its
    /// staged copies are read like folders inside the model roots.
    pub model_cache: Option<PathBuf>,
}

impl Settings {
    /// The folders a model's files may be read from: the model roots and the model cache
    /// (none where the roots are unset: any folder).
    pub fn roots(&self) -> Vec<PathBuf> {
        let mut roots = root_dirs(self.model_root.as_deref(), &self.model_roots);
        if !roots.is_empty() {
            roots.extend(self.model_cache.clone());
        }
        roots
    }
}

/// What a model task tells the node loop. `task` is the task's number, so reports from a
/// task that has since been replaced are ignored.
#[derive(Debug)]
pub enum Update {
    State {
        id: String,
        task: u64,
        state: ModelState,
    },
    Profiled {
        id: String,
        task: u64,
        profile: Box<Profile>,
        files: Vec<(PathBuf, Identity)>,
        residency: Residency,
    },
    Progress {
        id: String,
        task: u64,
        bytes: u64,
    },
    /// How the copy into the node model cache goes ([`crate::staged`]).
    Staging {
        id: String,
        task: u64,
        status: crds::StagingStatus,
    },
    Warmed {
        id: String,
        task: u64,
        outcome: Outcome,
        residency: Residency,
    },
    Failed {
        id: String,
        task: u64,
        error: Error,
    },
}

/// A host path as this process sees it: under the node prefix, when there is one.
fn on_node(model_root: Option<&Path>, p: &Path) -> PathBuf {
    match model_root {
        Some(root) => root.join(p.strip_prefix("/").unwrap_or(p)),
        None => p.to_path_buf(),
    }
}

/// The model roots as this process sees them: host paths under the node prefix, or as
/// given (a pod's mounts are at the host paths; a test harness may hand them over prefixed).
pub fn root_dirs(model_root: Option<&Path>, roots: &[String]) -> Vec<PathBuf> {
    roots
        .iter()
        .flat_map(|r| [on_node(model_root, Path::new(r)), PathBuf::from(r)])
        .collect()
}

/// The folder of a model request on this node: its pipeline folder, or, for a Hugging Face
/// hub cache repository (a `revision`), the repository's snapshot at that revision (whose
/// links into the repository's `blobs/` the profiler and warmer follow inside the roots).
///
/// With `roots` (the chart's `agent.modelRoots`), the path must lie inside one of them, and
/// so must the folder it leads to once its symlinks are followed: a DiffusionDeployment
/// cannot make the agent read any other host folder.
pub fn resolve(
    id: &str,
    location: &ModelLocation,
    model_root: Option<&Path>,
    roots: &[String],
) -> Result<PathBuf> {
    let dir = folder(id, location, model_root, roots)?;
    let Some(revision) = &location.revision else {
        return Ok(dir);
    };
    hf_cache::snapshot(&dir, revision).map_err(|e| Error::Model {
        id: id.into(),
        msg: format!("location {}: {e}", location.describe()),
    })
}

/// The folder a request's host path names on this node, checked against the roots.
fn folder(
    id: &str,
    location: &ModelLocation,
    model_root: Option<&Path>,
    roots: &[String],
) -> Result<PathBuf> {
    if let Some(s3) = &location.s3 {
        return Err(Error::Model {
            id: id.into(),
            msg: format!(
                "source {}: this agent has no node model cache to stage it into (its --model-cache flag, the chart's agent.modelCache)",
                s3.describe()
            ),
        });
    }
    let Some(host) = &location.host_path else {
        return Err(Error::Model {
            id: id.into(),
            msg: format!(
                "location {}: the agent reads host paths only; mount the volume at a hostPath",
                location.describe()
            ),
        });
    };
    let p = Path::new(host);
    if !p.is_absolute() || p.components().any(|c| c == std::path::Component::ParentDir) {
        return Err(Error::Model {
            id: id.into(),
            msg: format!("hostPath `{host}` must be absolute without `..`"),
        });
    }
    let dir = on_node(model_root, p);
    if roots.is_empty() {
        return Ok(dir);
    }
    let root_dirs = root_dirs(model_root, roots);
    if !root_dirs.iter().any(|r| dir.starts_with(r)) {
        return Err(Error::Model {
            id: id.into(),
            msg: format!(
                "hostPath `{host}` is outside this agent's model roots ({})",
                roots.join(", ")
            ),
        });
    }
    // A folder that does not exist fails later, naming what is missing.
    let Ok(real) = dir.canonicalize() else {
        return Ok(dir);
    };
    let inside = root_dirs
        .iter()
        .any(|r| r.canonicalize().is_ok_and(|r| real.starts_with(r)));
    if !inside {
        return Err(Error::Model {
            id: id.into(),
            msg: format!(
                "hostPath `{host}` leads outside this agent's model roots ({}) through a symlink",
                roots.join(", ")
            ),
        });
    }
    Ok(dir)
}

/// The state and message a model gets after a warm: warm only when its files are resident;
/// otherwise it stays `Warming` with a message saying why it is not warm (a budget too small
/// for the model, a floor that stopped it, pages evicted since).
pub fn verdict(
    residency: Residency,
    budget: Option<u64>,
    stopped: Option<&str>,
) -> (ModelState, Option<String>) {
    if let Some(b) = budget.filter(|b| residency.total > *b) {
        return (
            ModelState::Warming,
            Some(format!(
                "prewarm budget too small: the model's files are {} bytes but the page-cache budget is {b} bytes; {} bytes ({:.0}%) resident. Raise the agent's cache budget",
                residency.total,
                residency.resident,
                residency.percent()
            )),
        );
    }
    if let Some(why) = stopped {
        return (
            ModelState::Warming,
            Some(format!(
                "warming stopped: {why}; {} of {} bytes resident",
                residency.resident, residency.total
            )),
        );
    }
    if residency.resident as f64 >= residency.total as f64 * WARM_FRACTION {
        (ModelState::Warm, None)
    } else {
        (
            ModelState::Warming,
            Some(format!(
                "only {:.0}% resident after warming ({} of {} bytes): pages were evicted, the node is short of memory",
                residency.percent(),
                residency.resident,
                residency.total
            )),
        )
    }
}

/// Files whose identity differs from when they were warmed (or that are gone).
pub fn changed(files: &[(PathBuf, Identity)]) -> Vec<PathBuf> {
    files
        .iter()
        .filter(|(p, id)| Identity::of(p).ok().as_ref() != Some(id))
        .map(|(p, _)| p.clone())
        .collect()
}

/// Checks that the checkpoint profiled at `dir` is of the family the request names, so a
/// deployment never plans (or warms) a model its engine would open as another family.
pub fn check_family(id: &str, named: &str, dir: &Path, profile: &Profile) -> Result<()> {
    if profile.family == named {
        return Ok(());
    }
    Err(Error::Model {
        id: id.into(),
        msg: format!(
            "the DiffusionDeployment names family `{named}`, but the checkpoint at {} is a `{}` pipeline (model_index.json); set model.family to `{}` or point model.location at a `{named}` checkpoint",
            dir.display(),
            profile.family,
            profile.family
        ),
    })
}

/// Profiles the model at `dir` from its headers, checks it is of `family`, then warms its
/// files, reporting to `tx`. A broken checkpoint ends as `Failed` with the reader's message
/// (file and tensor); one of another family, with both families named.
pub async fn prepare(
    id: String,
    task: u64,
    dir: PathBuf,
    family: String,
    settings: Arc<Settings>,
    tx: mpsc::Sender<Update>,
) {
    let send = |u: Update| {
        let tx = tx.clone();
        async move {
            let _ = tx.send(u).await;
        }
    };
    send(Update::State {
        id: id.clone(),
        task,
        state: ModelState::Profiling,
    })
    .await;
    // The headers are parsed in a process of its own, bounded in memory and time, and
    // confined to the model roots: a hostile checkpoint fails its model, not the agent.
    let job = profiler::Job {
        dir: dir.clone(),
        roots: settings.roots(),
    };
    let profiled = match profiler::run(&settings.worker_exe, &job, settings.profiler).await {
        Ok((profile, files)) => {
            let (d, pid) = (dir.clone(), id.clone());
            tokio::task::spawn_blocking(move || -> Result<_> {
                check_family(&pid, &family, &d, &profile)?;
                let ids = files
                    .iter()
                    .map(|p| Ok((p.clone(), Identity::of(p)?)))
                    .collect::<Result<Vec<_>>>()?;
                let residency = pagecache::residency_of(&files)?;
                Ok((profile, ids, residency))
            })
            .await
            .expect("profile task panicked")
        }
        Err(e) => Err(e),
    };
    let (profile, files, residency) = match profiled {
        Ok(x) => x,
        Err(error) => return send(Update::Failed { id, task, error }).await,
    };
    let paths: Vec<PathBuf> = files.iter().map(|(p, _)| p.clone()).collect();
    send(Update::Profiled {
        id: id.clone(),
        task,
        profile: Box::new(profile),
        files,
        residency,
    })
    .await;
    warm(id, task, paths, settings, tx).await
}

/// Warms `paths` (in the worker process, in the prewarm cgroup) and reports the result.
pub async fn warm(
    id: String,
    task: u64,
    paths: Vec<PathBuf>,
    settings: Arc<Settings>,
    tx: mpsc::Sender<Update>,
) {
    let _ = tx
        .send(Update::State {
            id: id.clone(),
            task,
            state: ModelState::Warming,
        })
        .await;
    let job = Job {
        files: paths.clone(),
        options: settings.options.clone(),
    };
    let progress_tx = tx.clone();
    let pid = id.clone();
    let result = worker::run(
        &settings.worker_exe,
        settings.cgroup.as_deref(),
        &job,
        move |bytes| {
            // Progress is advisory: drop it rather than wait when the loop is busy.
            let _ = progress_tx.try_send(Update::Progress {
                id: pid.clone(),
                task,
                bytes,
            });
        },
    )
    .await;
    let update = match result {
        Ok(outcome) => {
            match tokio::task::spawn_blocking(move || pagecache::residency_of(&paths))
                .await
                .expect("residency task panicked")
            {
                Ok(residency) => Update::Warmed {
                    id,
                    task,
                    outcome,
                    residency,
                },
                Err(error) => Update::Failed { id, task, error },
            }
        }
        Err(error) => Update::Failed { id, task, error },
    };
    let _ = tx.send(update).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(p: &str) -> ModelLocation {
        ModelLocation {
            host_path: Some(p.into()),
            ..Default::default()
        }
    }

    #[test]
    fn resolves_host_paths_under_the_root() {
        assert_eq!(
            resolve("a/b", &at("/models/x"), None, &[]).unwrap(),
            PathBuf::from("/models/x")
        );
        assert_eq!(
            resolve("a/b", &at("/models/x"), Some(Path::new("/host")), &[]).unwrap(),
            PathBuf::from("/host/models/x")
        );
        let e = resolve("a/b", &at("/models/../etc"), None, &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("a/b") && e.contains(".."), "{e}");
        let pvc = ModelLocation {
            host_path: None,
            persistent_volume_claim: Some(crds::PvcSource {
                claim_name: "weights".into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert!(resolve("a/b", &pvc, None, &[])
            .unwrap_err()
            .to_string()
            .contains("pvc:weights"));
    }

    #[test]
    fn model_roots_cannot_be_left_by_path_or_by_symlink() {
        let d = tempfile::tempdir().unwrap();
        let node = d.path();
        std::fs::create_dir_all(node.join("models/wan")).unwrap();
        std::fs::create_dir_all(node.join("etc/secrets")).unwrap();
        std::os::unix::fs::symlink(node.join("etc/secrets"), node.join("models/escape")).unwrap();
        let roots = vec!["/models".to_string()];
        assert_eq!(
            resolve("a/b", &at("/models/wan"), Some(node), &roots).unwrap(),
            node.join("models/wan")
        );
        let e = resolve("a/b", &at("/etc/secrets"), Some(node), &roots)
            .unwrap_err()
            .to_string();
        assert!(e.contains("outside this agent's model roots"), "{e}");
        let e = resolve("a/b", &at("/models/escape"), Some(node), &roots)
            .unwrap_err()
            .to_string();
        assert!(e.contains("through a symlink"), "{e}");
    }

    /// A hub cache repository under the model roots: the request names the repository and
    /// a revision, and the agent profiles and warms its snapshot, whose files link into the
    /// repository's blobs (inside the roots); a revision the repository lacks is named.
    #[test]
    fn a_hub_cache_revision_resolves_to_its_snapshot_inside_the_roots() {
        use layerwise_engine::tools::synth::hub_cache::into_hub_cache;
        let d = tempfile::tempdir().unwrap();
        let node = d.path();
        let repo = node.join("models/hub/models--org--tiny");
        let commit = "0123456789abcdef0123456789abcdef01234567";
        let snapshot = into_hub_cache(&synth(node, "tiny"), &repo, commit).unwrap();
        let roots = vec!["/models".to_string()];
        let location = |rev: &str| ModelLocation {
            host_path: Some("/models/hub/models--org--tiny".into()),
            revision: Some(rev.into()),
            ..Default::default()
        };
        for rev in ["main", commit] {
            let dir = resolve("a/b", &location(rev), Some(node), &roots).unwrap();
            assert_eq!(dir, snapshot);
        }
        let profile = layerwise_engine::families::profile(&snapshot).unwrap();
        assert_eq!(profile.family, "dit");
        let files = profiler::model_files(&snapshot, &root_dirs(Some(node), &roots)).unwrap();
        assert!(
            files.iter().any(|f| f.ends_with("transformer/config.json")),
            "{files:?}"
        );
        let e = resolve("a/b", &location("v9"), Some(node), &roots)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("a/b") && e.contains("@v9") && e.contains("refs/v9"),
            "{e}"
        );
    }

    /// A sparse pipeline folder of `preset` (headers only) under `dir`.
    fn synth(dir: &Path, preset: &str) -> PathBuf {
        use layerwise_engine::tools::synth::{synth, SynthOptions};
        let out = dir.join(preset);
        let mut o = SynthOptions::preset(preset).unwrap();
        o.sparse = true;
        synth(&out, &o).unwrap();
        out
    }

    #[test]
    fn every_family_the_reader_profiles_is_accepted_and_must_match_the_request() {
        let d = tempfile::tempdir().unwrap();
        for (preset, family) in [("tiny", "dit"), ("wan-tiny", "wan")] {
            let dir = synth(d.path(), preset);
            let p = layerwise_engine::families::profile(&dir).unwrap();
            assert_eq!(p.family, family);
            assert!(
                layerwise_engine::families::names().contains(&family),
                "{family}"
            );
            check_family("ns/m", family, &dir, &p).unwrap();
        }
        let dir = d.path().join("wan-tiny");
        let p = layerwise_engine::families::profile(&dir).unwrap();
        let e = check_family("ns/m", "dit", &dir, &p).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("ns/m")
                && msg.contains("names family `dit`")
                && msg.contains("is a `wan` pipeline")
                && msg.contains(&dir.display().to_string()),
            "{msg}"
        );
        assert_eq!(e.metric_label(), "model");
    }

    #[test]
    fn verdicts() {
        let r = |resident, total| Residency { resident, total };
        assert_eq!(
            verdict(r(100, 100), Some(200), None),
            (ModelState::Warm, None)
        );
        assert_eq!(verdict(r(100, 100), None, None).0, ModelState::Warm);
        let (s, m) = verdict(r(50, 100), Some(60), None);
        assert_eq!(s, ModelState::Warming);
        assert!(m.unwrap().contains("budget too small"));
        let (s, m) = verdict(
            r(10, 100),
            None,
            Some("node MemAvailable fell below the floor"),
        );
        assert_eq!(s, ModelState::Warming);
        assert!(m.unwrap().contains("floor"));
        let (s, m) = verdict(r(50, 100), None, None);
        assert_eq!(s, ModelState::Warming);
        assert!(m.unwrap().contains("50%"));
    }
}
