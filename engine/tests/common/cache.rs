//! What the step caches' parity tests read of a reference that diffusers' hooks wrote: the
//! decisions per step and guidance row, and MagCache's calibrated ratios.

use std::collections::HashMap;
use std::path::Path;

use candle_core::Tensor;
use layerwise_engine::cache::{CacheReport, StepCache};
use layerwise_engine::engine::{Model, RunStats};
use layerwise_engine::execution::work::{Output, Request};
use layerwise_engine::Strategy;

/// A reference that a cache script wrote: its description and its tensors.
pub struct Reference {
    pub desc: serde_json::Value,
    pub tensors: HashMap<String, Tensor>,
}

impl Reference {
    /// `tests/fixtures/{stem}.json` and `.safetensors`.
    pub fn load(stem: &str) -> Reference {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
        let desc =
            serde_json::from_slice(&std::fs::read(dir.join(format!("{stem}.json"))).unwrap())
                .unwrap();
        let tensors = super::read_safetensors(&dir.join(format!("{stem}.safetensors")));
        Reference { desc, tensors }
    }

    /// Case `name`'s cache setting.
    pub fn cache(&self, name: &str) -> StepCache {
        serde_json::from_value(self.desc["cases"][name]["cache"].clone()).unwrap()
    }
}

/// `reqs` under `strategy` at `dp`, two slots, no decoding.
pub fn run(
    model: &Model,
    reqs: Vec<Request>,
    strategy: Strategy,
    dp: usize,
) -> (Vec<Output>, RunStats) {
    model
        .run(reqs, &super::opts(strategy, dp, 2, false))
        .unwrap()
}

/// The bytes (copied, gathered) a run moves whatever its steps, and those each step moves,
/// from the same requests at `steps` (`a`) and one step more (`b`).
pub fn bytes_per_step(a: &RunStats, b: &RunStats, steps: usize) -> ((u64, u64), (u64, u64)) {
    let step = (
        b.bytes_copied - a.bytes_copied,
        b.bytes_gathered - a.bytes_gathered,
    );
    let fixed = (
        a.bytes_copied - steps as u64 * step.0,
        a.bytes_gathered - steps as u64 * step.1,
    );
    (fixed, step)
}

/// The reference's `[steps, rows]` decisions as rows of booleans per step.
pub fn decisions(t: &Tensor) -> Vec<Vec<bool>> {
    t.to_dtype(candle_core::DType::F32)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap()
        .into_iter()
        .map(|r| r.into_iter().map(|x| x == 1.0).collect())
        .collect()
}

/// Case `name`'s calibration, where the reference recorded one (`{name}.ratios`), is the
/// report's first, within float32 rounding.
pub fn check_calibration(name: &str, report: &CacheReport, tensors: &HashMap<String, Tensor>) {
    let Some(ratios) = tensors.get(&format!("{name}.ratios")) else {
        return;
    };
    let ours = &report.calibration[0];
    let theirs: Vec<f64> = ratios
        .to_vec1::<f32>()
        .unwrap()
        .into_iter()
        .map(f64::from)
        .collect();
    assert_eq!(ours.len(), theirs.len(), "{name}: calibration length");
    for (a, b) in ours.iter().zip(&theirs) {
        assert!(
            (a - b).abs() < 1e-4 * b.abs().max(1.0),
            "{name}: ratios {ours:?} vs {theirs:?}"
        );
    }
}

/// One case of a family's parity against diffusers' hooks: `out` (the cached run of case
/// `name`, with its `blocks_saved`) took the reference's decision at every step and row,
/// ended within the family's `tolerance` of its latents (`latents` maps the output to the
/// reference's layout), saved every block of the steps no row computed (all but block 0 of
/// `layers` under First-Block Cache), left a trace beyond twice the tolerance (and 1e-3)
/// against the `plain` run where it skipped, and calibrated the reference's ratios.
/// Returns whether it skipped.
#[allow(clippy::too_many_arguments)]
pub fn check_case(
    name: &str,
    first_block: bool,
    out: &Output,
    blocks_saved: u64,
    (layers, tolerance): (u64, f32),
    tensors: &HashMap<String, Tensor>,
    latents: impl Fn(&Tensor) -> Tensor,
    plain: impl FnOnce() -> Tensor,
) -> bool {
    let report = out.cache.as_ref().expect("a cached run reports");
    let want = decisions(&tensors[&format!("{name}.computed")]);
    assert_eq!(report.computed, want, "{name}: decisions per step and row");
    let ours = latents(&out.latents);
    let e = super::rel_err(&ours, &tensors[&format!("{name}.latents")]);
    eprintln!("{name}: latents {e:.2e} (max rel), computed {want:?}");
    assert!(e <= tolerance, "{name}: latents {e}");
    let skipped = want.iter().filter(|row| row.iter().all(|c| !c)).count() as u64;
    let head = u64::from(first_block);
    assert_eq!(
        blocks_saved,
        skipped * (layers - head),
        "{name}: blocks saved"
    );
    check_calibration(name, report, tensors);
    if !want.iter().flatten().any(|c| !c) {
        return false;
    }
    // The skips must have left a trace larger than the tolerance, or the comparison
    // proves nothing.
    let moved = super::rel_err(&ours, &latents(&plain()));
    eprintln!("{name}: {moved:.2e} from the uncached latents");
    let trace = (2.0 * tolerance).max(1e-3);
    assert!(moved > trace, "{name}: skips left no trace ({moved})");
    true
}
