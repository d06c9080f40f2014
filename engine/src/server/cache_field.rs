//! The `cache` field of the image and video requests: how it is read (a name, or an
//! object of a kind and its parameters; a form's text may hold either) and how the
//! OpenAPI document describes it. What a value means on this server (its setting is the
//! default and the bound) is [`crate::cache::bound`]'s.

use serde::de::{Deserialize, Deserializer, Error as _};
use serde_json::Value;
use utoipa::openapi::schema::{ArrayBuilder, ObjectBuilder, OneOfBuilder, Schema, Type};

use super::field::AnyValue;
use crate::cache::bound::OFF;
use crate::cache::CacheKind;
use layerwise_core::step_cache::{self as ranges, ParamRange};

/// A `cache` value: a string or an object (`null` as absent); anything else is refused.
pub fn setting<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    struct Setting(Value);
    impl<'de> Deserialize<'de> for Setting {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            match d.deserialize_any(AnyValue)? {
                v @ (Value::String(_) | Value::Object(_)) => Ok(Setting(v)),
                v => Err(D::Error::custom(format!(
                    "{v}: expected \"{OFF}\", a cache kind's name or an object with `kind`"
                ))),
            }
        }
    }
    Ok(Option::<Setting>::deserialize(d)?.map(|s| s.0))
}

/// The document's `cache`: a name or an object, its parameters with the ranges every
/// party checks ([`layerwise_core::step_cache`]).
pub fn schema() -> Schema {
    let names: Vec<&str> = std::iter::once(OFF)
        .chain(CacheKind::ALL.iter().map(|k| k.name()))
        .collect();
    let number = |r: ParamRange| {
        ObjectBuilder::new()
            .schema_type(if r.integer {
                Type::Integer
            } else {
                Type::Number
            })
            .minimum(Some(r.min))
            .maximum(Some(r.max))
    };
    let object = ObjectBuilder::new()
        .schema_type(Type::Object)
        .property(
            "kind",
            ObjectBuilder::new()
                .schema_type(Type::String)
                .enum_values(Some(names.clone())),
        )
        .required("kind")
        .property("threshold", number(ranges::THRESHOLD))
        .property("max_skip_steps", number(ranges::MAX_SKIP_STEPS))
        .property("retention_ratio", number(ranges::RETENTION_RATIO))
        .property(
            "ratios",
            ArrayBuilder::new()
                .items(number(ranges::RATIO))
                .min_items(Some(1)),
        )
        .property("cache_interval", number(ranges::CACHE_INTERVAL))
        .property("disable_cache_before_step", number(ranges::DISABLE_BEFORE))
        .property("disable_cache_after_step", number(ranges::DISABLE_AFTER))
        .property("max_order", number(ranges::MAX_ORDER))
        .examples([serde_json::json!({"kind": "first_block", "threshold": 0.05})]);
    OneOfBuilder::new()
        .item(
            ObjectBuilder::new()
                .schema_type(Type::String)
                .enum_values(Some(names)),
        )
        .item(object)
        .description(Some(
            "Extension: the step cache this request runs with (First-Block Cache, MagCache, \
             TaylorSeer as diffusers defines them). Absent or null: the server's setting \
             (--cache, a deployment's workload.cache). \"off\": none. A kind's name or an \
             object with `kind` and some parameters (the rest are the server's): only the \
             server's kind, with parameters that skip no more steps and hold no more memory \
             than its setting (threshold, max_skip_steps, cache_interval, \
             disable_cache_after_step and max_order at most the server's; retention_ratio \
             and disable_cache_before_step at least; MagCache's ratios the server's). \
             Anything else is a 422 naming `cache` or `cache.<parameter>`.",
        ))
        .into()
}
