//! What the step caches' parity tests read of a reference that diffusers' hooks wrote: the
//! decisions per step and guidance row, and MagCache's calibrated ratios.

use std::collections::HashMap;

use candle_core::Tensor;
use layerwise_engine::cache::CacheReport;

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
/// `name` under `cache`'s kind, with its `blocks_saved`) took the reference's decision at
/// every step and row, ended within `tolerance` of its latents (`latents` maps the output to
/// the reference's layout), saved every block of the steps no row computed (all but block
/// 0 of `layers` under First-Block Cache), left a trace beyond the tolerance against the
/// `plain` run where it skipped, and calibrated the reference's ratios. Returns whether it
/// skipped.
#[allow(clippy::too_many_arguments)]
pub fn check_case(
    name: &str,
    first_block: bool,
    out: &layerwise_engine::execution::work::Output,
    blocks_saved: u64,
    layers: u64,
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
    assert!(e <= 1e-4, "{name}: latents {e}");
    let skipped = want.iter().filter(|row| row.iter().all(|c| !c)).count() as u64;
    let head = u64::from(first_block);
    assert_eq!(
        blocks_saved,
        skipped * (layers - head),
        "{name}: blocks saved"
    );
    check_calibration(name, report, tensors);
    if skipped == 0 {
        return false;
    }
    // The skips must have left a trace larger than the tolerance, or the comparison
    // proves nothing.
    let moved = super::rel_err(&ours, &latents(&plain()));
    eprintln!("{name}: {moved:.2e} from the uncached latents");
    assert!(moved > 1e-3, "{name}: skips left no trace ({moved})");
    true
}
