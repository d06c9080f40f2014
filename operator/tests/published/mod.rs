//! What the tests of the documented plans share: checkpoints of published shapes (the
//! engine's `synth` preset written sparse: headers and configs at full size, no weight
//! bytes) with their profile as an agent reports it, and the check that
//! docs/operations.md shows the planner's figures.

use std::path::{Path, PathBuf};

use crds::Profile;
use layerwise_engine::tools::synth::{synth, SynthOptions};

/// `preset` written sparse under `dir`, and its profile through the DiffusionNode's JSON.
pub fn published(dir: &Path, preset: &str) -> (PathBuf, Profile) {
    let out = dir.join(preset);
    let mut o = SynthOptions::preset(preset).unwrap();
    o.sparse = true;
    synth(&out, &o).unwrap();
    let profile: Profile = serde_json::from_value(
        serde_json::to_value(layerwise_engine::families::profile(&out).unwrap()).unwrap(),
    )
    .unwrap();
    (out, profile)
}

/// Panics unless `doc` holds every one of `expected`, naming those it lacks.
pub fn assert_documented(doc: &str, expected: &[String]) {
    let missing: Vec<&str> = expected
        .iter()
        .map(String::as_str)
        .filter(|e| !doc.contains(e))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/operations.md lacks the planner's figures:\n{}",
        missing.join("\n")
    );
}
