//! `workload.cache`: the step cache a deployment's engines run every request with (and
//! the most a request may ask for), in the engine's own words. Its parameters' ranges are
//! the engine's (`layerwise_core::step_cache`), written here as CEL rules, so
//! `kubectl apply` refuses what `layerwise serve --cache` would; the operator hands the
//! setting to the pods as that flag's environment variable ([`WorkloadCache::flag_value`]).

use kube::KubeSchema;
use serde::{Deserialize, Serialize};

use layerwise_core::step_cache as ranges;

/// A step cache: First-Block Cache, MagCache or TaylorSeer as diffusers defines them
/// (`first_block`, `mag`, `taylorseer`), each parameter unset taking diffusers' default.
/// Requests run with it unless they turn it off or ask for less skipping; the planner
/// reserves the memory it holds and counts the steps it skips.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.kind != 'mag' || has(self.ratios)").message("cache kind mag needs ratios: the model's magnitude ratios, recorded once by `layerwise generate --cache mag`"))]
#[x_kube(validation = Rule::new("!has(self.threshold) || self.kind in ['first_block', 'mag', 'sea']").message("cache.threshold applies to kinds first_block, mag and sea"))]
#[x_kube(validation = Rule::new("!(has(self.maxSkipSteps) || has(self.retentionRatio) || has(self.ratios)) || self.kind == 'mag'").message("cache.maxSkipSteps, retentionRatio and ratios apply to kind mag only"))]
#[x_kube(validation = Rule::new("!(has(self.cacheInterval) || has(self.disableCacheBeforeStep) || has(self.disableCacheAfterStep) || has(self.maxOrder)) || self.kind == 'taylorseer'").message("cache.cacheInterval, disableCacheBeforeStep, disableCacheAfterStep and maxOrder apply to kind taylorseer only"))]
pub struct WorkloadCache {
    /// The cache: one the engine's build knows (a kind the model's family cannot honour
    /// is refused by the engine at start, by name).
    #[schemars(schema_with = "kind_schema")]
    pub kind: String,
    /// First-Block Cache: the relative change of the first block's residual above which
    /// the other blocks run (default 0.05). MagCache: the accumulated error within which
    /// steps are skipped (default 0.06).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new(ranges::THRESHOLD.cel()).message(ranges::THRESHOLD.cel_message().as_str()))]
    pub threshold: Option<f64>,
    /// MagCache: most steps skipped in a row (default 3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new(ranges::MAX_SKIP_STEPS.cel()).message(ranges::MAX_SKIP_STEPS.cel_message().as_str()))]
    pub max_skip_steps: Option<u64>,
    /// MagCache: the share of the first steps always computed (default 0.2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new(ranges::RETENTION_RATIO.cel()).message(ranges::RETENTION_RATIO.cel_message().as_str()))]
    pub retention_ratio: Option<f64>,
    /// MagCache: the model's magnitude ratios per step (interpolated to a request's
    /// steps), as `layerwise generate --cache mag` prints them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "ratios_schema")]
    pub ratios: Option<Vec<f64>>,
    /// TaylorSeer: the blocks run once every this many steps (default 5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new(ranges::CACHE_INTERVAL.cel()).message(ranges::CACHE_INTERVAL.cel_message().as_str()))]
    pub cache_interval: Option<u64>,
    /// TaylorSeer: the first steps, always computed (default 3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new(ranges::DISABLE_BEFORE.cel()).message(ranges::DISABLE_BEFORE.cel_message().as_str()))]
    pub disable_cache_before_step: Option<u64>,
    /// TaylorSeer: from this step on every step is computed (default: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new(ranges::DISABLE_AFTER.cel()).message(ranges::DISABLE_AFTER.cel_message().as_str()))]
    pub disable_cache_after_step: Option<u64>,
    /// TaylorSeer: the Taylor series' order (default 1); each order keeps one more
    /// output-sized tensor per request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new(ranges::MAX_ORDER.cel()).message(ranges::MAX_ORDER.cel_message().as_str()))]
    pub max_order: Option<u64>,
}

/// `kind`'s schema: the engine's cache kinds, as its flag spells them.
fn kind_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let names: Vec<&str> = layerwise_engine::cache::CacheKind::ALL
        .iter()
        .map(|k| k.name())
        .collect();
    schemars::json_schema!({ "type": "string", "enum": names })
}

/// `ratios`' schema: one or more, each in the engine's range, at most one per step.
fn ratios_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "array",
        "minItems": 1,
        "maxItems": ranges::RATIO_COUNT,
        "items": { "type": "number", "minimum": ranges::RATIO.min, "maximum": ranges::RATIO.max },
    })
}

impl WorkloadCache {
    /// The setting as `layerwise serve --cache` reads it (the engine's JSON, unset
    /// parameters left to its defaults).
    pub fn flag_value(&self) -> String {
        let mut o = serde_json::Map::new();
        o.insert("kind".into(), self.kind.clone().into());
        let mut put = |k: &str, v: Option<serde_json::Value>| {
            if let Some(v) = v {
                o.insert(k.into(), v);
            }
        };
        put("threshold", self.threshold.map(Into::into));
        put("max_skip_steps", self.max_skip_steps.map(Into::into));
        put("retention_ratio", self.retention_ratio.map(Into::into));
        put("ratios", self.ratios.clone().map(Into::into));
        put("cache_interval", self.cache_interval.map(Into::into));
        put(
            "disable_cache_before_step",
            self.disable_cache_before_step.map(Into::into),
        );
        put(
            "disable_cache_after_step",
            self.disable_cache_after_step.map(Into::into),
        );
        put("max_order", self.max_order.map(Into::into));
        serde_json::Value::Object(o).to_string()
    }

    /// What the setting holds per sample and the share of `steps` steps it computes, by
    /// the engine's own figures (`StepCache::hold`, `StepCache::computed_share`): what the
    /// planner reserves and times. A setting the engine would refuse (which the schema's
    /// rules keep out) counts as none: the engine refuses it at start, naming it.
    pub fn terms(&self, steps: u64) -> (layerwise_core::step_cache::CacheHold, f64) {
        match self.step_cache() {
            Ok(c) => (c.hold(), c.computed_share(steps as usize)),
            Err(_) => (layerwise_core::step_cache::CacheHold::NONE, 1.0),
        }
    }

    /// The engine's setting this names: what the planner reserves memory and counts
    /// steps for, read by the engine's own parser; an error names `workload.cache` and
    /// the parameter.
    pub fn step_cache(
        &self,
    ) -> Result<layerwise_engine::cache::StepCache, layerwise_engine::Error> {
        layerwise_engine::cache::StepCache::parse("workload.cache", &self.flag_value())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cache_schema() -> serde_json::Value {
        let crd = serde_json::to_value(&crate::all()[0].1).unwrap();
        crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
            ["workload"]["properties"]["cache"]
            .clone()
    }

    /// Each parameter's CEL rule is the range the engine checks `--cache` and a
    /// request's `cache` against, so `kubectl apply` and `layerwise serve` refuse the
    /// same values; `ratios` carries the same range in its items' schema.
    #[test]
    fn the_parameter_rules_are_the_engines_ranges() {
        let schema = cache_schema();
        let props = &schema["properties"];
        for r in ranges::ALL {
            let field = &props[r.crd_field];
            if r.crd_field == "ratios" {
                assert_eq!(field["items"]["minimum"], json!(r.min), "{field}");
                assert_eq!(field["items"]["maximum"], json!(r.max), "{field}");
                continue;
            }
            let rule = &field["x-kubernetes-validations"][0];
            assert_eq!(rule["rule"], r.cel().as_str(), "{}: {field}", r.param);
            assert_eq!(rule["message"], r.cel_message().as_str());
        }
        let kinds: Vec<&str> = layerwise_engine::cache::CacheKind::ALL
            .iter()
            .map(|k| k.name())
            .collect();
        assert_eq!(props["kind"]["enum"], json!(kinds));
        let rules = schema["x-kubernetes-validations"].as_array().unwrap();
        assert!(rules
            .iter()
            .any(|r| r["message"].as_str().unwrap().contains("mag needs ratios")));
    }

    /// What the CRD takes, the engine's parser reads as the same setting, unset
    /// parameters at diffusers' defaults; a value the rules would refuse, the engine
    /// refuses naming `workload.cache.<parameter>`.
    #[test]
    fn the_engine_reads_the_setting_with_its_own_parser() {
        let c: WorkloadCache = serde_json::from_value(
            json!({"kind": "taylorseer", "cacheInterval": 4, "maxOrder": 2}),
        )
        .unwrap();
        assert_eq!(
            c.step_cache().unwrap(),
            layerwise_engine::cache::StepCache::Taylorseer {
                cache_interval: 4,
                disable_cache_before_step: 3,
                disable_cache_after_step: None,
                max_order: 2,
            }
        );
        let bad: WorkloadCache =
            serde_json::from_value(json!({"kind": "first_block", "threshold": 1.5})).unwrap();
        let e = bad.step_cache().unwrap_err().to_string();
        assert!(e.contains("workload.cache.threshold"), "{e}");
        // The time model's share: TaylorSeer every fourth step after three.
        let (hold, share) = c.terms(50);
        assert_eq!(hold.held_outputs, 3);
        assert!(share > 0.2 && share < 0.4, "{share}");
    }
}
