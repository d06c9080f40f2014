//! Checkpoints of published shapes, as the documented plans and predictions use them: the
//! engine's `synth` preset written sparse (headers and configs at full size, no weight
//! bytes), with its profile as an agent reports it.

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
