//! What every model config here does the same way with its JSON and its tensors: the
//! `config.json` it writes (serde's fields with a few set on top, such as
//! `_diffusers_version`), and its every tensor (the resident ones, then each streamed
//! block's under its full name).

use layerwise_core::family::{BlockGroup, TensorSpec};
use serde::Serialize;

/// `config` as serde writes it, with `fields` set on top, in order.
pub fn with_fields<T: Serialize>(
    config: &T,
    fields: &[(&str, serde_json::Value)],
) -> serde_json::Value {
    let mut v = serde_json::to_value(config).expect("config serialises");
    let m = v.as_object_mut().expect("a config serialises to an object");
    for (k, x) in fields {
        m.insert((*k).into(), x.clone());
    }
    v
}

/// A model's every tensor: `resident`, then each block of `blocks` under its full name.
pub fn all_specs(resident: Vec<TensorSpec>, blocks: &BlockGroup) -> Vec<TensorSpec> {
    let mut v = resident;
    v.extend(blocks.tensor_specs());
    v
}
