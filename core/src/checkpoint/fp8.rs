//! fp8 weights as published fp8 DiT checkpoints lay them out: a linear layer's
//! `<prefix>.weight` stored `F8_E4M3`, and beside it one F32 scale for the whole tensor,
//! `<prefix>.weight_scale` (what `layerwise quantize --fp8` writes) or
//! `<prefix>.scale_weight` (the other spelling in circulation). The value of an element
//! is `f32(fp8) × scale`. Header-only: which tensors may be fp8 and where their scales
//! are; the arithmetic is in `execution::dtype`.

use safetensors::Dtype;

use super::component::Component;
use crate::{Error, Result};

/// The scale's names, `<prefix>.` + each of these, in the order they are looked for.
pub const SCALE_SUFFIXES: [&str; 2] = ["weight_scale", "scale_weight"];

/// The largest finite E4M3 value: `quantize --fp8` maps each tensor's absmax onto it.
pub const E4M3_MAX: f32 = 448.0;

/// Whether a tensor of this name and shape is a linear layer's weight, the only kind that
/// may be stored fp8: 2-D, named `*.weight`, and not an embedding table (those are looked
/// up, not multiplied).
pub fn is_linear(name: &str, shape: &[usize]) -> bool {
    shape.len() == 2
        && name.ends_with(".weight")
        && !name.contains("embedding")
        && !name.contains("relative_attention_bias")
        && name != "shared.weight"
        && !name.ends_with("embed_tokens.weight")
}

/// The names a scale of weight `name` may have (none unless it ends in `.weight`).
pub fn scale_names(name: &str) -> Vec<String> {
    name.strip_suffix("weight")
        .map(|prefix| {
            SCALE_SUFFIXES
                .iter()
                .map(|s| format!("{prefix}{s}"))
                .collect()
        })
        .unwrap_or_default()
}

/// Whether `name` is spelled like a scale.
pub fn is_scale_name(name: &str) -> bool {
    SCALE_SUFFIXES
        .iter()
        .any(|s| name.strip_suffix(s).is_some_and(|p| p.ends_with('.')))
}

/// The name of fp8 weight `name`'s scale in `c`, checked: there is exactly one, F32, one
/// element (shape `[]` or `[1]`). Each failure names the tensor.
pub fn scale_of(c: &Component, name: &str) -> Result<String> {
    let found: Vec<String> = scale_names(name)
        .into_iter()
        .filter(|s| c.get(s).is_some())
        .collect();
    let scale = match found.as_slice() {
        [one] => one.clone(),
        [] => {
            return Err(Error::tensor(
                c.path_of(name),
                name,
                format!(
                    "stored F8_E4M3 without its scale: expected an F32 scalar `{}` beside it",
                    scale_names(name).join("` or `")
                ),
            ))
        }
        _ => {
            return Err(Error::tensor(
                c.path_of(name),
                name,
                format!("has two scales, `{}`: keep one", found.join("` and `")),
            ))
        }
    };
    let (h, info) = c.get(&scale).expect("found above");
    if info.dtype != Dtype::F32 || info.numel() != 1 || info.shape.len() > 1 {
        return Err(Error::tensor(
            &h.path,
            &scale,
            format!(
                "the scale of fp8 weight `{name}` must be one F32 element (shape [] or [1]), not {:?} {:?}",
                info.dtype, info.shape
            ),
        ));
    }
    Ok(scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(is_linear("blocks.0.attn.to_q.weight", &[8, 8]));
        assert!(!is_linear("blocks.0.attn.to_q.bias", &[8]));
        assert!(!is_linear("pos_embed.proj.weight", &[8, 4, 2, 2]));
        assert!(!is_linear("norm.weight", &[8]));
        assert!(!is_linear(
            "class_embedder.embedding_table.weight",
            &[10, 8]
        ));
        assert!(!is_linear("shared.weight", &[10, 8]));
        assert!(!is_linear("encoder.embed_tokens.weight", &[10, 8]));
        assert!(is_linear(
            "condition_embedder.time_embedder.linear_1.weight",
            &[8, 4]
        ));
        assert_eq!(
            scale_names("a.b.weight"),
            ["a.b.weight_scale", "a.b.scale_weight"]
        );
        assert!(scale_names("a.b.bias").is_empty());
        assert!(is_scale_name("a.weight_scale") && is_scale_name("a.scale_weight"));
        assert!(!is_scale_name("a.weight") && !is_scale_name("weight_scale"));
    }
}
