//! Reading a pipeline's `model_index.json`, as every diffusers family's checkpoint check
//! does: which optional components it lists.

use serde_json::Value;

/// Whether `model_index.json` lists a component (diffusers writes `[null, null]` for an
/// optional one that is absent).
pub fn listed(index: &Value, name: &str) -> bool {
    match index.get(name) {
        None | Some(Value::Null) => false,
        Some(Value::Array(a)) => a.iter().any(|v| !v.is_null()),
        Some(_) => true,
    }
}
