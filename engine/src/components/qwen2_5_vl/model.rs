//! The Qwen2.5-VL language model's forward pass over one prompt, split the way the
//! pipeline streams it, following transformers 5.24's `Qwen2_5_VLTextModel` in f32: the
//! embedding rows gathered from the mapped table in host memory, a prologue that makes the
//! rotary tables, one function per decoder layer (pre-norm causal self-attention with GQA
//! and q/k/v biases, then a pre-norm SiLU-gated MLP, each with a residual), and the final
//! RMS norm.
//!
//! Text alone puts the same position on all three multimodal rotary axes (time, height,
//! width), so whatever `mrope_section` says, every frequency sees position `i` of the
//! token: the rotary is ordinary RoPE (`rotate_half` form) over `0..T`.
//!
//! The epilogue's output is what `QwenImagePipeline` reads as `hidden_states[-1]`:
//! transformers 5.24 replaces the last recorded hidden state with `last_hidden_state`,
//! which is after the final norm (checked by `engine/parity/qwen2_5_vl_reference.py`).
//! Each state holds one unpadded sequence (batch 1): the pipeline encodes each prompt
//! alone, so there is no padding and no mask beyond causality.

use candle_core::{DType, Device, Tensor};

use super::config::{Qwen25VlConfig, TensorPrefix};
use crate::checkpoint::Mapped;
use crate::components::fused;
use crate::components::layers::rms_norm;
use crate::components::rotary::{f32_frequencies, rotated_causal_gqa, RotaryTables};
use crate::components::umt5::Umt5Encoder;
use crate::execution::weights::Weights;
use crate::{Error, Result};

/// One prompt's activations while the layers run.
pub struct Qwen25VlState {
    /// Hidden states [1, T, hidden_size], f32.
    pub x: Tensor,
    /// Rotary tables [T, head_dim].
    cos: Tensor,
    sin: Tensor,
}

impl Qwen25VlState {
    /// Tokens in the sequence.
    pub fn len(&self) -> usize {
        self.x.dim(1).unwrap_or(0)
    }

    /// Whether the sequence is empty (never, once a prologue accepted it).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// RoPE tables [T, head_dim] for positions `0..tokens`: frequency j is
/// `θ^(−2j / head_dim)` (in f32, as transformers' `inv_freq`), angles formed in f32 as
/// torch forms them, cos and sin through f64 so they round once; each half of the head
/// dim repeats the frequencies (`rotate_half` layout).
pub fn rotary(cfg: &Qwen25VlConfig, tokens: usize, dev: &Device) -> Result<(Tensor, Tensor)> {
    let hd = cfg.head_dim();
    let inv = f32_frequencies(hd, cfg.rope_theta);
    let mut t = RotaryTables::new(tokens, hd);
    for p in 0..tokens {
        let angles: Vec<f64> = inv.iter().map(|f| (p as f32 * f) as f64).collect();
        t.push_halves(&angles);
    }
    t.finish(dev)
}

/// The language model's shape and its resident final norm.
pub struct Qwen25VlEncoder {
    pub cfg: Qwen25VlConfig,
    final_norm: Tensor,
}

impl Qwen25VlEncoder {
    /// Takes the final norm (`{prefix}norm.weight`) from the resident weights, in f32.
    pub fn new(cfg: Qwen25VlConfig, prefix: TensorPrefix, resident: &dyn Weights) -> Result<Self> {
        let name = prefix.final_norm();
        let final_norm = resident.get(&name)?.to_dtype(DType::F32)?;
        if final_norm.dims() != [cfg.hidden_size] {
            return Err(Error::invalid(
                name,
                format!(
                    "shape {:?}, expected [{}]",
                    final_norm.dims(),
                    cfg.hidden_size
                ),
            ));
        }
        Ok(Qwen25VlEncoder { cfg, final_norm })
    }

    /// Rows of the mapped embedding table (`{prefix}embed_tokens.weight`, f32, f16 or bf16
    /// as stored) for one prompt's `ids`: [1, T, hidden_size] f32 on `device`. Only these
    /// rows are read; the table never leaves the host mapping.
    pub fn embed(
        mapped: &Mapped,
        prefix: TensorPrefix,
        ids: &[u32],
        device: &Device,
    ) -> Result<Tensor> {
        Umt5Encoder::embed(mapped, &prefix.embedding(), &[ids.to_vec()], device)
    }

    /// Starts a prompt: `embeddings` [1, T, hidden_size] from [`Self::embed`], T ≥ 1.
    pub fn prologue(&self, embeddings: Tensor) -> Result<Qwen25VlState> {
        let dims = embeddings.dims().to_vec();
        if dims.len() != 3 || dims[0] != 1 || dims[1] == 0 || dims[2] != self.cfg.hidden_size {
            return Err(Error::bug(format!(
                "prompt embeddings {dims:?}: want [1, tokens ≥ 1, {}] (one unpadded prompt)",
                self.cfg.hidden_size
            )));
        }
        let (cos, sin) = rotary(&self.cfg, dims[1], embeddings.device())?;
        Ok(Qwen25VlState {
            x: embeddings.to_dtype(DType::F32)?,
            cos,
            sin,
        })
    }

    /// `name`'s weight (and bias, for the attention's input projections) as f32.
    fn linear(w: &dyn Weights, name: &str, bias: bool, x: &Tensor) -> Result<Tensor> {
        let weight = w.get(&format!("{name}.weight"))?.to_dtype(DType::F32)?;
        let bias = if bias {
            Some(w.get(&format!("{name}.bias"))?.to_dtype(DType::F32)?)
        } else {
            None
        };
        fused::linear(x, &weight, bias.as_ref())
    }

    fn norm(&self, w: &dyn Weights, name: &str, x: &Tensor) -> Result<Tensor> {
        let weight = w.get(name)?.to_dtype(DType::F32)?;
        rms_norm(x, &weight, self.cfg.rms_norm_eps)
    }

    /// [1, T, heads × head_dim] to [1, heads, T, head_dim].
    fn heads(&self, x: &Tensor, heads: usize) -> Result<Tensor> {
        let t = x.dim(1)?;
        Ok(x.reshape((1, t, heads, self.cfg.head_dim()))?
            .transpose(1, 2)?
            .contiguous()?)
    }

    /// Causal self-attention on normed `h` [1, T, D]: rotated queries and keys, each
    /// key/value head serving its group of query heads, scaled by 1/√head_dim.
    fn attention(&self, w: &dyn Weights, h: &Tensor, st: &Qwen25VlState) -> Result<Tensor> {
        let cfg = &self.cfg;
        let q = self.heads(
            &Self::linear(w, "self_attn.q_proj", true, h)?,
            cfg.num_attention_heads,
        )?;
        let k = self.heads(
            &Self::linear(w, "self_attn.k_proj", true, h)?,
            cfg.num_key_value_heads,
        )?;
        let v = self.heads(
            &Self::linear(w, "self_attn.v_proj", true, h)?,
            cfg.num_key_value_heads,
        )?;
        let o = rotated_causal_gqa(
            [&q, &k, &v],
            (&st.cos, &st.sin),
            cfg.groups_per_kv(),
            cfg.head_dim(),
        )?;
        let t = o.dim(2)?;
        let o = o
            .transpose(1, 2)?
            .reshape((1, t, cfg.num_attention_heads * cfg.head_dim()))?;
        Self::linear(w, "self_attn.o_proj", false, &o)
    }

    /// Decoder layer `index`, its weights `w` named relative to `{prefix}layers.{index}.`.
    pub fn block(&self, index: usize, w: &dyn Weights, st: &mut Qwen25VlState) -> Result<()> {
        if index >= self.cfg.num_hidden_layers {
            return Err(Error::bug(format!(
                "block: {index} of a {}-layer language model",
                self.cfg.num_hidden_layers
            )));
        }
        let h = self.norm(w, "input_layernorm.weight", &st.x)?;
        let x = (&st.x + self.attention(w, &h, st)?)?;
        let h = self.norm(w, "post_attention_layernorm.weight", &x)?;
        let gate = Self::linear(w, "mlp.gate_proj", false, &h)?.silu()?;
        let up = Self::linear(w, "mlp.up_proj", false, &h)?;
        let m = Self::linear(w, "mlp.down_proj", false, &(gate * up)?)?;
        st.x = (x + m)?;
        Ok(())
    }

    /// The final norm: [1, T, hidden_size], the pipeline's `hidden_states[-1]`.
    pub fn epilogue(&self, st: Qwen25VlState) -> Result<Tensor> {
        rms_norm(&st.x, &self.final_norm, self.cfg.rms_norm_eps)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotary_is_plain_rope_over_token_positions() {
        let cfg = Qwen25VlConfig::tiny();
        let (cos, sin) = rotary(&cfg, 3, &Device::Cpu).unwrap();
        assert_eq!(cos.dims(), [3, cfg.head_dim()]);
        let cos: Vec<Vec<f32>> = cos.to_vec2().unwrap();
        let sin: Vec<Vec<f32>> = sin.to_vec2().unwrap();
        // Position 0 does not rotate; each half repeats the frequencies.
        assert!(cos[0].iter().all(|&c| c == 1.0) && sin[0].iter().all(|&s| s == 0.0));
        let half = cfg.head_dim() / 2;
        assert_eq!(cos[2][..half], cos[2][half..]);
        // Frequency 0 is 1 rad per position; frequency 1 is θ^(−2/8) = 1e6^(−1/4).
        assert!((sin[2][0] - 2f32.sin()).abs() < 1e-7);
        assert!((cos[1][1] - (1e6f64.powf(-0.25)).cos() as f32).abs() < 1e-7);
    }

    #[test]
    fn causal_prefix_is_independent_of_later_tokens() {
        use std::collections::HashMap;
        let cfg = Qwen25VlConfig::tiny();
        let dev = Device::Cpu;
        let mut resident = HashMap::new();
        let norm = TensorPrefix::Model.final_norm();
        resident.insert(
            norm,
            Tensor::ones(cfg.hidden_size, DType::F32, &dev).unwrap(),
        );
        let enc = Qwen25VlEncoder::new(cfg.clone(), TensorPrefix::Model, &resident).unwrap();
        let layer: HashMap<String, Tensor> = cfg
            .block_specs()
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let t = Tensor::randn(0f32, 0.3, s.shape.as_slice(), &dev).unwrap();
                (s.name.clone(), (t + 0.01 * i as f64).unwrap())
            })
            .collect();
        let x = Tensor::randn(0f32, 1.0, (1, 5, cfg.hidden_size), &dev).unwrap();
        let run = |x: Tensor| {
            let mut st = enc.prologue(x).unwrap();
            for i in 0..cfg.num_hidden_layers {
                enc.block(i, &layer, &mut st).unwrap();
            }
            enc.epilogue(st).unwrap()
        };
        let full = run(x.clone());
        let prefix = run(x.narrow(1, 0, 3).unwrap());
        let diff = (full.narrow(1, 0, 3).unwrap() - prefix)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(diff < 1e-5, "{diff}");
        assert!(enc.prologue(x.narrow(1, 0, 0).unwrap()).is_err());
        let mut st = enc.prologue(x).unwrap();
        assert!(enc.block(2, &layer, &mut st).is_err());
    }
}
