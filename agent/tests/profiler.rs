//! Profiling runs in a child process of the real agent binary, bounded in memory and time
//! and confined to the model roots: a checkpoint whose header expands past the memory
//! limit, one that takes longer than the time limit, and one whose files lead outside the
//! roots each fail their own model with an error naming the cause, and the same agent
//! then profiles a good model.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crds::ModelState;
use layerwise_agent::models::{prepare, Settings, Update};
use layerwise_agent::prewarm::Options;
use layerwise_agent::profiler::{self, Job, Limits};
use layerwise_engine::tools::synth::{synth, SynthOptions};
use tokio::sync::mpsc;

const AGENT: &str = env!("CARGO_BIN_EXE_layerwise-agent");
const MIB: u64 = 1 << 20;

/// A sparse pipeline folder of `preset` (headers only) under `dir`.
fn model(dir: &Path, preset: &str) -> PathBuf {
    let out = dir.join(preset);
    let mut o = SynthOptions::preset(preset).unwrap();
    o.sparse = true;
    synth(&out, &o).unwrap();
    out
}

/// Replaces the transformer's weights with a valid safetensors file of `n` one-element
/// tensors: a header of about 60 bytes a tensor that the reader must parse whole.
fn expanding_weights(model: &Path, n: usize) -> u64 {
    let mut json = String::from("{");
    for i in 0..n {
        if i > 0 {
            json.push(',');
        }
        json.push_str(&format!(
            r#""t{i}":{{"dtype":"F32","shape":[1],"data_offsets":[{},{}]}}"#,
            4 * i,
            4 * i + 4
        ));
    }
    json.push('}');
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(json.as_bytes());
    bytes.resize(bytes.len() + 4 * n, 0);
    let path = model.join("transformer/diffusion_pytorch_model.safetensors");
    std::fs::write(&path, &bytes).unwrap();
    json.len() as u64
}

fn settings(limits: Limits, roots: &[&Path]) -> Arc<Settings> {
    Arc::new(Settings {
        model_root: None,
        model_roots: roots.iter().map(|r| r.display().to_string()).collect(),
        worker_exe: PathBuf::from(AGENT),
        profiler: limits,
        options: Options::default(),
        cgroup: None,
        budget: None,
        model_cache: None,
    })
}

/// Runs `prepare` for `dir` to its first `Failed` or `Profiled`, returning every update.
async fn prepared(dir: &Path, family: &str, settings: Arc<Settings>) -> Vec<Update> {
    let (tx, mut rx) = mpsc::channel(1024);
    prepare(
        "ns/m".into(),
        1,
        dir.to_path_buf(),
        family.into(),
        settings,
        tx,
    )
    .await;
    let mut updates = Vec::new();
    while let Ok(u) = rx.try_recv() {
        updates.push(u);
    }
    updates
}

fn failure(updates: &[Update]) -> String {
    assert!(
        !updates.iter().any(|u| matches!(u, Update::Profiled { .. })),
        "{updates:?}"
    );
    match updates.last() {
        Some(Update::Failed { error, .. }) => {
            assert_eq!(error.metric_label(), "checkpoint", "{error}");
            error.to_string()
        }
        other => panic!("no failure: {other:?}"),
    }
}

fn profiled(updates: &[Update]) -> bool {
    updates.iter().any(|u| matches!(u, Update::Profiled { .. }))
}

/// A limit the good model profiles under (it needs under 64 MiB of address space), and the
/// expanding header does not (it needs over 256 MiB; about 310 MiB resident at its peak).
const LIMIT: Limits = Limits {
    memory_bytes: 128 * MIB,
    timeout: Duration::from_secs(60),
};

#[tokio::test]
async fn a_header_that_expands_past_the_memory_limit_fails_its_model_not_the_agent() {
    let d = tempfile::tempdir().unwrap();
    let good = model(d.path(), "tiny");
    let bad_dir = d.path().join("bad");
    std::fs::create_dir(&bad_dir).unwrap();
    let bad = model(&bad_dir, "tiny");
    // Just under the reader's 16 MiB header cap: accepted by size, large to parse.
    let header = expanding_weights(&bad, 235_000);
    assert!(header < 16 * MIB, "{header}");

    // With room enough, the reader gets to the end of the header and refuses it for what
    // it holds; under the limit, the process dies while parsing and the cause is named.
    let roomy = Limits {
        memory_bytes: 16 << 30,
        ..LIMIT
    };
    let job = Job {
        dir: bad.clone(),
        roots: Vec::new(),
    };
    let e = profiler::run(Path::new(AGENT), &job, roomy)
        .await
        .unwrap_err()
        .to_string();
    assert!(!e.contains("memory limit"), "{e}");
    println!("header of {header} bytes, with 16 GiB: {e}");

    let e = failure(&prepared(&bad, "dit", settings(LIMIT, &[])).await);
    println!("with {} MiB: {e}", LIMIT.memory_bytes / MIB);
    assert!(
        e.contains(&bad.display().to_string())
            && e.contains(&format!("{}-byte memory limit", LIMIT.memory_bytes)),
        "{e}"
    );
    // The same agent goes on: the good model profiles under the same limit.
    assert!(profiled(
        &prepared(&good, "dit", settings(LIMIT, &[])).await
    ));
}

#[tokio::test]
async fn a_profile_that_takes_longer_than_the_time_limit_is_stopped_and_named() {
    let d = tempfile::tempdir().unwrap();
    let slow = model(d.path(), "tiny");
    expanding_weights(&slow, 235_000);
    let limits = Limits {
        memory_bytes: 16 << 30,
        timeout: Duration::from_millis(50),
    };
    let t = Instant::now();
    let e = failure(&prepared(&slow, "dit", settings(limits, &[])).await);
    let took = t.elapsed();
    println!("stopped after {took:?}: {e}");
    assert!(
        e.contains(&slow.display().to_string()) && e.contains("time limit"),
        "{e}"
    );
    // Stopped, not waited for: far sooner than the reader would need.
    assert!(took < Duration::from_secs(10), "{took:?}");
    let good = d.path().join("good");
    std::fs::create_dir(&good).unwrap();
    let good = model(&good, "tiny");
    assert!(profiled(
        &prepared(&good, "dit", settings(LIMIT, &[])).await
    ));
}

/// A file of an allowed model folder that leads outside the roots through a symlink is
/// refused by name, and the error shows neither its bytes nor where it points; a link that
/// stays inside the roots is followed.
#[tokio::test]
async fn files_that_link_out_of_the_model_roots_are_refused() {
    let d = tempfile::tempdir().unwrap();
    let roots = d.path().join("models");
    let outside = d.path().join("elsewhere");
    std::fs::create_dir_all(&roots).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    let m = model(&roots, "tiny");
    let config = m.join("vae/config.json");
    let inside = roots.join("shared-vae-config.json");
    std::fs::rename(&config, &inside).unwrap();
    std::os::unix::fs::symlink(&inside, &config).unwrap();
    // A link back up the folder: walked once, no loop.
    std::os::unix::fs::symlink(&m, m.join("vae/again")).unwrap();
    let updates = prepared(&m, "dit", settings(LIMIT, &[&roots])).await;
    let files = updates
        .iter()
        .find_map(|u| match u {
            Update::Profiled { files, .. } => Some(files.clone()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("{updates:?}"));
    // The linked config is warmed with the rest, and nothing is listed twice.
    let paths: Vec<&PathBuf> = files.iter().map(|(p, _)| p).collect();
    assert!(paths.contains(&&config), "{paths:?}");
    let mut unique = paths.clone();
    unique.dedup();
    assert_eq!(unique.len(), paths.len(), "{paths:?}");
    assert!(
        paths.iter().all(|p| !p.starts_with(m.join("vae/again"))),
        "{paths:?}"
    );

    // A file the reader never opens, linked outside: the model is refused all the same,
    // so nothing outside the roots is warmed.
    let secret = outside.join("secret.json");
    std::fs::write(&secret, b"hunter2!and the rest of a private file").unwrap();
    let notes = m.join("notes.txt");
    std::os::unix::fs::symlink(&secret, &notes).unwrap();
    let e = failure(&prepared(&m, "dit", settings(LIMIT, &[&roots])).await);
    assert!(
        e.contains("notes.txt")
            && e.contains("leads outside the model roots")
            && !e.contains("hunter2")
            && !e.contains("secret.json"),
        "{e}"
    );
    std::fs::remove_file(&notes).unwrap();

    // The weights linked outside: the confined reader refuses them before reading a byte.
    let weights = m.join("transformer/diffusion_pytorch_model.safetensors");
    std::fs::remove_file(&weights).unwrap();
    std::os::unix::fs::symlink(&secret, &weights).unwrap();
    let e = failure(&prepared(&m, "dit", settings(LIMIT, &[&roots])).await);
    let leaked = u64::from_le_bytes(*b"hunter2!").to_string();
    assert!(
        e.contains("diffusion_pytorch_model.safetensors")
            && e.contains("leads outside the model roots")
            && !e.contains("hunter2")
            && !e.contains(&leaked)
            && !e.contains("secret.json"),
        "{e}"
    );
}

#[tokio::test]
async fn a_checkpoint_of_another_family_fails_without_reporting_a_profile_or_warming() {
    let d = tempfile::tempdir().unwrap();
    let dir = model(d.path(), "wan-tiny");
    let updates = prepared(&dir, "dit", settings(LIMIT, &[])).await;
    assert!(
        matches!(
            &updates[..],
            [
                Update::State {
                    state: ModelState::Profiling,
                    ..
                },
                Update::Failed { .. }
            ]
        ),
        "{updates:?}"
    );
    let Update::Failed { error, .. } = &updates[1] else {
        unreachable!()
    };
    let msg = error.to_string();
    assert!(msg.contains("`dit`") && msg.contains("`wan`"), "{msg}");
}
