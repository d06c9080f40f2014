//! What the step caches cost and what their parameters may be, stated once for every party
//! that reads a cache setting: the engine's `--cache` flag and the API's `cache` field
//! (`layerwise_engine::cache::StepCache::check`), the DiffusionDeployment's
//! `workload.cache` (whose CEL rules [`ParamRange::cel`] writes), the memory model (what a
//! request's cache holds, [`CacheHold`], counted in the activations) and the time model
//! (the share of the steps whose blocks run, `StepCache::computed_share`, which
//! [`crate::timing::Work::with_computed_share`] takes). The setting's
//! type lives with the engine's caches; this module holds only the figures both sides must
//! agree on, so `kubectl apply`, `layerwise serve` and the planner cannot drift.

use crate::{Error, Result};

/// Environment variable of `layerwise generate --cache` and `layerwise serve --cache`: what
/// the operator sets from a DiffusionDeployment's `workload.cache`.
pub const ENV_CACHE: &str = "LAYERWISE_CACHE";

/// The range of one cache parameter, inclusive: the engine refuses a value outside it
/// naming `<field>.<param>`, the CRD's CEL rule on `workload.cache.<crd_field>` refuses the
/// same values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ParamRange {
    /// The parameter as the engine and the API spell it (`retention_ratio`).
    pub param: &'static str,
    /// The parameter as the CRD spells it (`retentionRatio`).
    pub crd_field: &'static str,
    pub min: f64,
    pub max: f64,
    /// Whole numbers (CEL compares them as integers).
    pub integer: bool,
}

impl ParamRange {
    /// `value` when it lies in the range, else an error naming `field.param`.
    pub fn check(&self, field: &str, value: f64) -> Result<()> {
        if value.is_finite() && (self.min..=self.max).contains(&value) {
            return Ok(());
        }
        Err(Error::invalid(
            format!("{field}.{}", self.param),
            format!("{value}: expected {}..={}", self.min, self.max),
        ))
    }

    /// The CRD's CEL rule for the field.
    pub fn cel(&self) -> String {
        if self.integer {
            format!("self >= {} && self <= {}", self.min, self.max)
        } else {
            format!("self >= {:?} && self <= {:?}", self.min, self.max)
        }
    }

    /// The message `kubectl apply` shows when [`Self::cel`] fails.
    pub fn cel_message(&self) -> String {
        format!(
            "cache.{} must be between {} and {}",
            self.crd_field, self.min, self.max
        )
    }
}

/// The most steps any setting counts in (the request bound's own range).
const STEPS: f64 = crate::bounds::STEPS_RANGE.max as f64;

/// `threshold` of First-Block Cache, MagCache and SeaCache: a relative change (FBC,
/// SeaCache) or an accumulated error (MagCache); above 1 every step past the first would
/// be skipped, which is no cache a person means.
pub const THRESHOLD: ParamRange = ParamRange {
    param: "threshold",
    crd_field: "threshold",
    min: 0.0,
    max: 1.0,
    integer: false,
};
/// MagCache's `max_skip_steps`: skipped steps in a row.
pub const MAX_SKIP_STEPS: ParamRange = ParamRange {
    param: "max_skip_steps",
    crd_field: "maxSkipSteps",
    min: 0.0,
    max: STEPS,
    integer: true,
};
/// MagCache's `retention_ratio`: the share of the first steps always computed.
pub const RETENTION_RATIO: ParamRange = ParamRange {
    param: "retention_ratio",
    crd_field: "retentionRatio",
    min: 0.0,
    max: 1.0,
    integer: false,
};
/// MagCache's `ratios`: each a magnitude ratio above 0 (a ratio of norms; 10 is far beyond
/// any model's).
pub const RATIO: ParamRange = ParamRange {
    param: "ratios",
    crd_field: "ratios",
    min: 1e-6,
    max: 10.0,
    integer: false,
};
/// Most MagCache ratios a setting lists: one per step at most.
pub const RATIO_COUNT: u64 = crate::bounds::STEPS_RANGE.max;
/// TaylorSeer's `cache_interval`.
pub const CACHE_INTERVAL: ParamRange = ParamRange {
    param: "cache_interval",
    crd_field: "cacheInterval",
    min: 1.0,
    max: STEPS,
    integer: true,
};
/// TaylorSeer's `disable_cache_before_step`: a prediction needs a step computed before it.
pub const DISABLE_BEFORE: ParamRange = ParamRange {
    param: "disable_cache_before_step",
    crd_field: "disableCacheBeforeStep",
    min: 1.0,
    max: STEPS,
    integer: true,
};
/// TaylorSeer's `disable_cache_after_step`.
pub const DISABLE_AFTER: ParamRange = ParamRange {
    param: "disable_cache_after_step",
    crd_field: "disableCacheAfterStep",
    min: 0.0,
    max: STEPS,
    integer: true,
};
/// TaylorSeer's `max_order`: each order keeps one more output-sized tensor per row.
pub const MAX_ORDER: ParamRange = ParamRange {
    param: "max_order",
    crd_field: "maxOrder",
    min: 0.0,
    max: 4.0,
    integer: true,
};

/// Every range, for the tests that hold the CRD's rules to them.
pub const ALL: [ParamRange; 8] = [
    THRESHOLD,
    MAX_SKIP_STEPS,
    RETENTION_RATIO,
    RATIO,
    CACHE_INTERVAL,
    DISABLE_BEFORE,
    DISABLE_AFTER,
    MAX_ORDER,
];

/// The share of the steps First-Block Cache is expected to run the blocks past the first
/// on, for the time model: a conservative figure, as the decision reads the data. diffusers
/// and ParaAttention report 1.5-2x on Wan and Flux at the default threshold (a share of
/// 0.5-0.67); 0.8 assumes a fifth of that saving, so a plan sized by it is not slower than
/// predicted on prompts that move more.
pub const FIRST_BLOCK_EXPECTED_SHARE: f64 = 0.8;

pub use crate::checkpoint::CacheHold;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_refuse_outside_and_name_the_parameter() {
        for r in ALL {
            assert!(r.check("cache", r.min).is_ok() && r.check("cache", r.max).is_ok());
            let e = r.check("cache", r.max + 1.0).unwrap_err().to_string();
            assert!(e.contains(&format!("cache.{}", r.param)), "{e}");
            assert!(r.check("cache", f64::NAN).is_err());
        }
        assert_eq!(THRESHOLD.cel(), "self >= 0.0 && self <= 1.0");
        assert_eq!(MAX_ORDER.cel(), "self >= 0 && self <= 4");
    }
}
