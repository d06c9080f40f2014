//! What a request asks of the step caches: the kind and its parameters, with diffusers
//! 0.42's defaults (`FirstBlockCacheConfig`, `MagCacheConfig`, `TaylorSeerCacheConfig`),
//! checked once here so the flag, the API field and the deployment's setting refuse the
//! same things with the same words.

use layerwise_core::step_cache::CacheHold;
use serde::{Deserialize, Serialize};

use super::schedule::{taylor_schedule, MagAcc, MagParams};
use crate::{Error, Result};

/// The step caches by name, as flags, the API and the CRD spell them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheKind {
    /// diffusers' First-Block Cache.
    FirstBlock,
    /// diffusers' MagCache.
    Mag,
    /// diffusers' TaylorSeer, in its lite form (whole block stack skipped, the
    /// transformer's output predicted).
    Taylorseer,
    /// diffusers' SeaCache (applied to Cosmos3 there).
    Sea,
}

impl CacheKind {
    pub const ALL: [CacheKind; 4] = [
        CacheKind::FirstBlock,
        CacheKind::Mag,
        CacheKind::Taylorseer,
        CacheKind::Sea,
    ];

    pub fn name(self) -> &'static str {
        match self {
            CacheKind::FirstBlock => "first_block",
            CacheKind::Mag => "mag",
            CacheKind::Taylorseer => "taylorseer",
            CacheKind::Sea => "sea",
        }
    }

    pub fn parse(s: &str) -> Option<CacheKind> {
        CacheKind::ALL.into_iter().find(|k| k.name() == s)
    }
}

impl std::fmt::Display for CacheKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One request's step cache and its parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum StepCache {
    /// The other blocks run when the first block's residual moved by more than
    /// `threshold` (relative mean absolute change) since the last step that ran them.
    FirstBlock {
        #[serde(default = "defaults::fbc_threshold")]
        threshold: f64,
    },
    /// Skips the block stack while the accumulated error of the magnitude ratios stays
    /// within `threshold`, at most `max_skip_steps` in a row, never in the first
    /// `retention_ratio` of the steps. `ratios` are the model's (interpolated to the
    /// request's steps); `calibrate` runs every step and records them instead.
    Mag {
        #[serde(default = "defaults::mag_threshold")]
        threshold: f64,
        #[serde(default = "defaults::mag_max_skip_steps")]
        max_skip_steps: usize,
        #[serde(default = "defaults::mag_retention_ratio")]
        retention_ratio: f64,
        #[serde(default)]
        ratios: Option<Vec<f64>>,
        #[serde(default)]
        calibrate: bool,
    },
    /// Runs the blocks in the first `disable_cache_before_step` steps, then once every
    /// `cache_interval` steps (and from `disable_cache_after_step` on), predicting the
    /// transformer's output between them from a Taylor series of order `max_order`.
    Taylorseer {
        #[serde(default = "defaults::ts_interval")]
        cache_interval: usize,
        #[serde(default = "defaults::ts_before")]
        disable_cache_before_step: usize,
        #[serde(default)]
        disable_cache_after_step: Option<usize>,
        #[serde(default = "defaults::ts_order")]
        max_order: usize,
    },
    /// Skips the decoder stack while the accumulated relative change of the latents'
    /// SEA indicator stays under `threshold`, never in the first `retention_steps` nor
    /// the last `cache_end_steps`, at most `max_consecutive_cached` in a row (0: no
    /// limit), predicting its residual at `residual_order` 0 (the last) or 1 (the line
    /// through the last two).
    Sea {
        #[serde(default = "defaults::sea_threshold")]
        threshold: f64,
        #[serde(default = "defaults::one")]
        residual_order: usize,
        #[serde(default = "defaults::one")]
        retention_steps: usize,
        #[serde(default = "defaults::one")]
        cache_end_steps: usize,
        #[serde(default = "defaults::sea_max_consecutive")]
        max_consecutive_cached: usize,
        #[serde(default = "defaults::sea_power_exp")]
        power_exp: f64,
    },
}

/// diffusers 0.42's defaults.
mod defaults {
    pub fn fbc_threshold() -> f64 {
        0.05
    }
    pub fn mag_threshold() -> f64 {
        0.06
    }
    pub fn mag_max_skip_steps() -> usize {
        3
    }
    pub fn mag_retention_ratio() -> f64 {
        0.2
    }
    pub fn ts_interval() -> usize {
        5
    }
    pub fn ts_before() -> usize {
        3
    }
    pub fn ts_order() -> usize {
        1
    }
    pub fn sea_threshold() -> f64 {
        0.25
    }
    pub fn one() -> usize {
        1
    }
    pub fn sea_max_consecutive() -> usize {
        2
    }
    pub fn sea_power_exp() -> f64 {
        3.0
    }
}

impl StepCache {
    /// `kind` with diffusers' default parameters (MagCache without ratios calibrates).
    pub fn default_of(kind: CacheKind) -> StepCache {
        match kind {
            CacheKind::FirstBlock => StepCache::FirstBlock {
                threshold: defaults::fbc_threshold(),
            },
            CacheKind::Mag => StepCache::Mag {
                threshold: defaults::mag_threshold(),
                max_skip_steps: defaults::mag_max_skip_steps(),
                retention_ratio: defaults::mag_retention_ratio(),
                ratios: None,
                calibrate: true,
            },
            CacheKind::Taylorseer => StepCache::Taylorseer {
                cache_interval: defaults::ts_interval(),
                disable_cache_before_step: defaults::ts_before(),
                disable_cache_after_step: None,
                max_order: defaults::ts_order(),
            },
            CacheKind::Sea => StepCache::Sea {
                threshold: defaults::sea_threshold(),
                residual_order: 1,
                retention_steps: 1,
                cache_end_steps: 1,
                max_consecutive_cached: defaults::sea_max_consecutive(),
                power_exp: defaults::sea_power_exp(),
            },
        }
    }

    pub fn kind(&self) -> CacheKind {
        match self {
            StepCache::FirstBlock { .. } => CacheKind::FirstBlock,
            StepCache::Mag { .. } => CacheKind::Mag,
            StepCache::Taylorseer { .. } => CacheKind::Taylorseer,
            StepCache::Sea { .. } => CacheKind::Sea,
        }
    }

    /// Whether the decision reads the whole sequence at every step (First-Block Cache,
    /// MagCache's calibration), which a rank of a split sequence does not hold.
    pub fn reads_whole_sequence(&self) -> bool {
        matches!(
            self,
            StepCache::FirstBlock { .. }
                | StepCache::Mag {
                    calibrate: true,
                    ..
                }
        )
    }

    /// `--cache`'s value (`generate` and `serve` read it alike), refused with the flag's
    /// name and what is wrong.
    pub fn parse_flag(s: &str) -> std::result::Result<StepCache, String> {
        StepCache::parse("--cache", s).map_err(|e| e.to_string())
    }

    /// Reads `field` (a flag or an API field: the name errors carry) as JSON
    /// (`{"kind":"mag","ratios":[..]}`) or a kind's name alone (its defaults).
    pub fn parse(field: &str, s: &str) -> Result<StepCache> {
        let s = s.trim();
        if let Some(k) = CacheKind::parse(s) {
            let c = StepCache::default_of(k);
            c.check(field)?;
            return Ok(c);
        }
        let c: StepCache = serde_json::from_str(s).map_err(|e| {
            Error::invalid(
                field,
                format!(
                    "`{s}` is neither a cache kind ({}) nor a JSON cache setting: {e}",
                    kinds()
                ),
            )
        })?;
        c.check(field)?;
        Ok(c)
    }

    /// The parameters' bounds ([`layerwise_core::step_cache`]'s ranges, which the
    /// DiffusionDeployment's CEL rules state too), each error naming `field.parameter`.
    pub fn check(&self, field: &str) -> Result<()> {
        use layerwise_core::step_cache as r;
        let bad = |p: &str, msg: &str| Err(Error::invalid(format!("{field}.{p}"), msg));
        match self {
            StepCache::FirstBlock { threshold } => r::THRESHOLD.check(field, *threshold)?,
            StepCache::Sea {
                threshold,
                residual_order,
                power_exp,
                ..
            } => {
                r::THRESHOLD.check(field, *threshold)?;
                if *residual_order > 1 {
                    return bad("residual_order", "must be 0 or 1");
                }
                if !power_exp.is_finite() || *power_exp <= 0.0 {
                    return bad("power_exp", "must be finite and above 0");
                }
            }
            StepCache::Mag {
                threshold,
                max_skip_steps,
                retention_ratio,
                ratios,
                calibrate,
            } => {
                r::THRESHOLD.check(field, *threshold)?;
                r::MAX_SKIP_STEPS.check(field, *max_skip_steps as f64)?;
                r::RETENTION_RATIO.check(field, *retention_ratio)?;
                match ratios {
                    None if !calibrate => {
                        return bad(
                            "ratios",
                            "MagCache needs the model's magnitude ratios; run once with \
                             \"calibrate\": true to record them",
                        )
                    }
                    Some(v) if v.is_empty() => {
                        return bad("ratios", "must be one or more finite ratios above 0")
                    }
                    Some(v) => v.iter().try_for_each(|x| r::RATIO.check(field, *x))?,
                    None => {}
                }
            }
            StepCache::Taylorseer {
                cache_interval,
                disable_cache_before_step,
                disable_cache_after_step,
                max_order,
            } => {
                r::CACHE_INTERVAL.check(field, *cache_interval as f64)?;
                r::DISABLE_BEFORE.check(field, *disable_cache_before_step as f64)?;
                if let Some(after) = disable_cache_after_step {
                    r::DISABLE_AFTER.check(field, *after as f64)?;
                }
                r::MAX_ORDER.check(field, *max_order as f64)?;
            }
        }
        Ok(())
    }
}

impl StepCache {
    /// What this setting holds on a rank per guidance row ([`CacheHold`]), which the
    /// memory model counts in a request's activations: tensors as
    /// [`super::run::StepCacheRun`] keeps them per row and transformer. First-Block Cache
    /// keeps the first block's and the tail's residuals, and a pass holds the stack's
    /// input and the first block's output beside its blocks; MagCache keeps the stack's
    /// residual, and a pass its input; TaylorSeer keeps `max_order + 1` divided
    /// differences of the transformer's output.
    pub fn hold(&self) -> CacheHold {
        let (held_hidden, pass_hidden, held_outputs) = match self {
            StepCache::FirstBlock { .. } => (2, 2, 0),
            StepCache::Mag { .. } => (1, 1, 0),
            StepCache::Taylorseer { max_order, .. } => (0, 0, *max_order as u64 + 1),
            // The last `residual_order + 1` residuals of the decoder stack, its input
            // during a pass, and the previous step's SEA indicator (latent-shaped).
            StepCache::Sea { residual_order, .. } => (*residual_order as u64 + 1, 1, 1),
        };
        CacheHold {
            held_hidden,
            pass_hidden,
            held_outputs,
        }
    }

    /// The share of a request's `steps` steps whose blocks run, for the time model: the
    /// schedule's own where it is known before the run (TaylorSeer's interval, MagCache's
    /// ratios), [`layerwise_core::step_cache::FIRST_BLOCK_EXPECTED_SHARE`] for First-Block
    /// Cache, whose decision reads the data (a conservative figure), and 1 for a
    /// calibration (which runs every step).
    pub fn computed_share(&self, steps: usize) -> f64 {
        let steps = steps.max(1);
        let computed = match self {
            StepCache::FirstBlock { .. } => {
                return layerwise_core::step_cache::FIRST_BLOCK_EXPECTED_SHARE
            }
            StepCache::Sea { .. } => steps,
            StepCache::Mag {
                threshold,
                max_skip_steps,
                retention_ratio,
                ratios,
                calibrate,
            } => {
                let mag = MagParams::new(
                    *threshold,
                    *max_skip_steps,
                    *retention_ratio,
                    ratios.as_deref(),
                    *calibrate,
                    steps,
                );
                (0..steps)
                    .filter(|&k| mag.peek_from(MagAcc::default(), false, k))
                    .count()
            }
            StepCache::Taylorseer {
                cache_interval,
                disable_cache_before_step,
                disable_cache_after_step,
                ..
            } => (0..steps as i64)
                .filter(|&k| {
                    taylor_schedule(
                        k,
                        *cache_interval,
                        *disable_cache_before_step,
                        *disable_cache_after_step,
                    )
                })
                .count(),
        };
        computed as f64 / steps as f64
    }
}

/// The kinds' names, for errors.
pub fn kinds() -> String {
    CacheKind::ALL.map(CacheKind::name).join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_alone_takes_diffusers_defaults_and_json_overrides_them() {
        assert_eq!(
            StepCache::parse("cache", "first_block").unwrap(),
            StepCache::FirstBlock { threshold: 0.05 }
        );
        assert_eq!(
            StepCache::parse("cache", "taylorseer").unwrap(),
            StepCache::Taylorseer {
                cache_interval: 5,
                disable_cache_before_step: 3,
                disable_cache_after_step: None,
                max_order: 1
            }
        );
        let m = StepCache::parse("cache", r#"{"kind":"mag","ratios":[1.0,0.9]}"#).unwrap();
        assert!(
            matches!(m, StepCache::Mag { threshold, max_skip_steps: 3, .. } if threshold == 0.06)
        );
        assert!(matches!(
            StepCache::parse("cache", "mag").unwrap(),
            StepCache::Mag {
                calibrate: true,
                ..
            }
        ));
    }

    #[test]
    fn the_share_computed_follows_the_schedule() {
        // TaylorSeer at diffusers' defaults over 50 steps: the first 3, then every 5th.
        let ts = StepCache::default_of(CacheKind::Taylorseer);
        let computed = (0..50i64).filter(|&k| k < 3 || (k - 4) % 5 == 0).count();
        assert_eq!(ts.computed_share(50), computed as f64 / 50.0);
        assert!(ts.computed_share(50) < 0.4);
        assert_eq!(ts.hold().held_outputs, 2);
        // A calibration runs every step; ratios of 1 accumulate no error and skip the most.
        assert_eq!(
            StepCache::default_of(CacheKind::Mag).computed_share(20),
            1.0
        );
        let flat = StepCache::parse("c", r#"{"kind":"mag","ratios":[1.0]}"#).unwrap();
        let share = flat.computed_share(20);
        // 4 retained steps, then one computed in every 4 (3 skipped in a row).
        assert_eq!(share, 8.0 / 20.0, "{share}");
    }

    #[test]
    fn bad_settings_name_the_parameter() {
        let e = |s: &str| StepCache::parse("--cache", s).unwrap_err().to_string();
        assert!(e("fastest").contains("--cache"), "{}", e("fastest"));
        assert!(e(r#"{"kind":"mag"}"#).contains("--cache.ratios"));
        assert!(e(r#"{"kind":"first_block","threshold":-1}"#).contains("--cache.threshold"));
        assert!(e(r#"{"kind":"taylorseer","cache_interval":0}"#).contains("cache_interval"));
        assert!(e(r#"{"kind":"mag","ratios":[1],"retention_ratio":2}"#).contains("retention_ratio"));
        assert!(e(r#"{"kind":"first_block","treshold":0.1}"#).contains("treshold"));
    }
}
