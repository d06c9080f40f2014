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

/// Writes the methods every one-group transformer config here has alike, from its
/// `num_attention_heads`, `attention_head_dim`, `num_layers`, `resident_specs()` and
/// `block_specs()`: `hidden`, `block_of` (the index after `prefix`), `block_group` (the
/// `transformer` group of `num_layers` blocks under `prefix`), `all_specs` ([`all_specs`]
/// of the two), `parameter_count`, `to_json` ([`with_fields`] with the `json` fields set
/// on top) and, for tests, `assert_specs_cover_once`.
macro_rules! transformer_specs {
    ($config:ty, prefix: $prefix:expr, json: [$(($field:expr, $value:expr)),* $(,)?] $(,)?) => {
        impl $config {
            /// The model width: heads × head width.
            pub fn hidden(&self) -> usize {
                self.num_attention_heads * self.attention_head_dim
            }

            /// The block index a tensor name of this component belongs to, if any.
            pub fn block_of(name: &str) -> Option<usize> {
                let rest = name.strip_prefix($prefix)?;
                let (idx, _) = rest.split_once('.')?;
                idx.parse().ok()
            }

            /// The blocks as a streamed group called `transformer` (a family with a second
            /// expert renames its copy).
            pub fn block_group(&self) -> layerwise_core::family::BlockGroup {
                layerwise_core::family::BlockGroup {
                    name: "transformer".into(),
                    prefix: $prefix.into(),
                    count: self.num_layers,
                    block: self.block_specs(),
                }
            }

            /// Every tensor of the transformer with its full name.
            pub fn all_specs(&self) -> Vec<layerwise_core::family::TensorSpec> {
                $crate::components::config_json::all_specs(
                    self.resident_specs(),
                    &self.block_group(),
                )
            }

            /// The transformer's parameters as diffusers counts them: every tensor's
            /// elements.
            pub fn parameter_count(&self) -> usize {
                self.all_specs()
                    .iter()
                    .map(layerwise_core::family::TensorSpec::numel)
                    .sum()
            }

            /// The JSON diffusers writes for this config, so that a folder written with it
            /// loads in diffusers.
            pub fn to_json(&self) -> serde_json::Value {
                $crate::components::config_json::with_fields(
                    self,
                    &[$(($field, $value.into())),*],
                )
            }

            /// Asserts that [`Self::all_specs`] holds every block's tensors (as
            /// [`Self::block_of`] places them) and the resident ones, each once.
            #[cfg(test)]
            pub fn assert_specs_cover_once(&self) {
                let all = self.all_specs();
                let in_blocks = all
                    .iter()
                    .filter(|s| Self::block_of(&s.name).is_some())
                    .count();
                assert_eq!(in_blocks, self.num_layers * self.block_specs().len());
                assert_eq!(all.len() - in_blocks, self.resident_specs().len());
            }
        }
    };
}
pub(crate) use transformer_specs;
