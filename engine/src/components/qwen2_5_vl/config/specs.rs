//! What the language model's config implies: head widths and per-token bytes, and the
//! names and shapes of its tensors (resident, per streamed layer), checked against a
//! checkpoint.

use super::prefix::{is_unused, TensorPrefix};
use super::text::Qwen25VlConfig;
use crate::checkpoint::check::check_tensors;
use crate::checkpoint::Component;
use crate::Result;
use layerwise_core::family::{BlockGroup, TensorSpec};

impl Qwen25VlConfig {
    /// Width of one attention head: `hidden_size / num_attention_heads`.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    /// Query heads per key/value head.
    pub fn groups_per_kv(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// Bytes per prompt token live at the peak of one decoder layer in f32 (the profile's
    /// `encoder_bytes_per_token`): the hidden states, their norm and the residual sum, the
    /// queries with their rotated copy and the attention output before and after its
    /// merge, the keys and values with the rotated keys, the keys and values repeated to
    /// every query head, and the MLP's two projections with their product. The causal
    /// attention's scores run in query chunks within
    /// [`crate::components::attention::ATTENTION_CHUNK_BYTES`], a fixed cost beside this.
    pub fn encoder_bytes_per_token(&self) -> u64 {
        let d = self.hidden_size as u64;
        let qw = (self.num_attention_heads * self.head_dim()) as u64;
        let kvw = (self.num_key_value_heads * self.head_dim()) as u64;
        let repeated = if self.groups_per_kv() > 1 { 2 * qw } else { 0 };
        let ff = self.intermediate_size as u64;
        4 * (3 * d + 4 * qw + 3 * kvw + repeated + 3 * ff)
    }

    /// The embedding table: read row by row from the host mapping, never loaded whole.
    pub fn embedding_spec(&self, prefix: TensorPrefix) -> TensorSpec {
        TensorSpec::new(prefix.embedding(), &[self.vocab_size, self.hidden_size])
    }

    /// Tensors that stay resident on the device: the final norm.
    pub fn resident_specs(&self, prefix: TensorPrefix) -> Vec<TensorSpec> {
        vec![TensorSpec::new(prefix.final_norm(), &[self.hidden_size])]
    }

    /// One decoder layer's tensors, named relative to its prefix `{prefix}layers.{i}.`:
    /// q/k/v projections with biases, the output projection without, the SiLU-gated MLP
    /// and the two RMS norms.
    pub fn block_specs(&self) -> Vec<TensorSpec> {
        let d = self.hidden_size;
        let q = self.num_attention_heads * self.head_dim();
        let kv = self.num_key_value_heads * self.head_dim();
        let ff = self.intermediate_size;
        vec![
            TensorSpec::new("input_layernorm.weight", &[d]),
            TensorSpec::new("self_attn.q_proj.weight", &[q, d]),
            TensorSpec::new("self_attn.q_proj.bias", &[q]),
            TensorSpec::new("self_attn.k_proj.weight", &[kv, d]),
            TensorSpec::new("self_attn.k_proj.bias", &[kv]),
            TensorSpec::new("self_attn.v_proj.weight", &[kv, d]),
            TensorSpec::new("self_attn.v_proj.bias", &[kv]),
            TensorSpec::new("self_attn.o_proj.weight", &[d, q]),
            TensorSpec::new("post_attention_layernorm.weight", &[d]),
            TensorSpec::new("mlp.gate_proj.weight", &[ff, d]),
            TensorSpec::new("mlp.up_proj.weight", &[ff, d]),
            TensorSpec::new("mlp.down_proj.weight", &[d, ff]),
        ]
    }

    /// The decoder layers as one streamed group, one block per layer.
    pub fn block_group(&self, prefix: TensorPrefix) -> BlockGroup {
        BlockGroup {
            name: "text_encoder".into(),
            prefix: prefix.layers(),
            count: self.num_hidden_layers,
            block: self.block_specs(),
        }
    }

    /// Every tensor of the language model with its full name: the embedding table, the
    /// final norm, the layers.
    pub fn all_specs(&self, prefix: TensorPrefix) -> Vec<TensorSpec> {
        let mut v = vec![self.embedding_spec(prefix)];
        v.extend(self.resident_specs(prefix));
        v.extend(self.block_group(prefix).tensor_specs());
        v
    }

    /// Checks a text encoder folder's tensors against this config and returns the prefix
    /// they use: the layer count, then every language-model tensor's name, shape and
    /// dtype, and nothing else beside them but what [`is_unused`] names.
    pub fn check(&self, c: &Component) -> Result<TensorPrefix> {
        let prefix = TensorPrefix::detect(c)?;
        let group = self.block_group(prefix);
        crate::components::config_checks::depth_matches(
            c,
            "num_hidden_layers",
            self.num_hidden_layers,
            |n| group.block_of(n),
            "layers",
        )?;
        let mut lm = c.clone();
        lm.index.retain(|name, _| !is_unused(name));
        check_tensors(&lm, &self.all_specs(prefix), |_| None)?;
        Ok(prefix)
    }
}
