//! The UMT5 encoder's forward pass, split the way the pipeline streams it: the embedding
//! rows gathered from the mapped table in host memory (the XXL table is 2 GB in bf16 and
//! only S rows of it are needed), a prologue that prepares the position buckets and the
//! padding mask, one function per block, and the final norm. Follows transformers'
//! `UMT5EncoderModel` operation for operation: T5's RMS norm (no mean, no bias),
//! attention without 1/√d scaling plus a per-layer relative position bias, padded keys
//! masked with the most negative f32, and a gated tanh-GELU feed-forward.

use candle_core::{DType, Device, Tensor, D};
use safetensors::Dtype;

use crate::checkpoint::Mapped;
use crate::components::umt5::{Umt5Config, FINAL_NORM};
use crate::components::{flops, fused};
use crate::execution::weights::Weights;
use crate::{Error, Result};

fn linear(w: &dyn Weights, name: &str, x: &Tensor) -> Result<Tensor> {
    fused::linear(x, &w.get(name)?, None)
}

/// T5's layer norm: `weight · x / √(mean(x²) + eps)`, in f32.
fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let var = x.sqr()?.mean_keepdim(D::Minus1)?;
    let x = x.broadcast_div(&(var + eps)?.sqrt()?)?;
    Ok(x.broadcast_mul(weight)?)
}

/// The bucket of a key `rel = key − query` positions away, bidirectional, as transformers
/// computes it: offsets below `max_exact` have a bucket each, larger ones share
/// log-spaced buckets up to `max_distance`; the log is taken in f32 as torch does, so the
/// boundaries fall where its truncation puts them.
pub fn relative_position_bucket(cfg: &Umt5Config, rel: i64) -> usize {
    let half = cfg.relative_attention_num_buckets / 2;
    let base = if rel > 0 { half } else { 0 };
    let n = rel.unsigned_abs() as usize;
    let exact = cfg.max_exact();
    if n < exact {
        return base + n;
    }
    let span = (cfg.relative_attention_max_distance as f64 / exact as f64).ln() as f32;
    let ratio = (n as f32 / exact as f32).ln() / span * (half - exact) as f32;
    base + (exact + ratio as usize).min(half - 1)
}

/// One batch of prompts' activations while the blocks run.
pub struct Umt5State {
    /// Hidden states [B, S, d_model].
    pub x: Tensor,
    /// Bucket of every (query, key) pair, row-major [S·S] u32.
    buckets: Tensor,
    /// 0 for real keys, f32::MIN for padding [B, 1, 1, S].
    mask_bias: Tensor,
    seq: usize,
}

/// The encoder's shape and its resident final norm.
pub struct Umt5Encoder {
    pub cfg: Umt5Config,
    final_norm: Tensor,
}

impl Umt5Encoder {
    /// Takes the final norm from the resident weights (`encoder.final_layer_norm.weight`).
    pub fn new(cfg: Umt5Config, resident: &dyn Weights) -> Result<Self> {
        let final_norm = resident.get(FINAL_NORM)?;
        if final_norm.dims() != [cfg.d_model] {
            return Err(Error::invalid(
                FINAL_NORM,
                format!("shape {:?}, expected [{}]", final_norm.dims(), cfg.d_model),
            ));
        }
        Ok(Umt5Encoder { cfg, final_norm })
    }

    /// Rows of the embedding table `table` of a mapped component for `ids` ([B][S]),
    /// gathered from the stored bytes (f32, f16 or bf16) and converted to f32 row by row:
    /// [B, S, d_model] on `device`.
    pub fn embed(
        mapped: &Mapped,
        table: &str,
        ids: &[Vec<u32>],
        device: &Device,
    ) -> Result<Tensor> {
        let component = &mapped.component;
        let (header, info) = component
            .get(table)
            .ok_or_else(|| Error::tensor(&component.dir, table, "missing from the checkpoint"))?;
        let bad = |msg: String| Error::tensor(&header.path, table, msg);
        let &[vocab, d] = info.shape.as_slice() else {
            return Err(bad(format!(
                "shape {:?} is not a [vocab, d_model] table",
                info.shape
            )));
        };
        let size = crate::checkpoint::header::dtype_size(info.dtype).unwrap_or(0);
        let row: fn(&[u8], &mut Vec<f32>) = match info.dtype {
            Dtype::F32 => |b, out| {
                out.extend(
                    b.chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
                )
            },
            Dtype::BF16 => |b, out| {
                out.extend(
                    b.chunks_exact(2)
                        .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()),
                )
            },
            Dtype::F16 => |b, out| {
                out.extend(
                    b.chunks_exact(2)
                        .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()),
                )
            },
            other => return Err(bad(format!("dtype {other:?} is not F32, F16 or BF16"))),
        };
        let bytes = mapped
            .bytes(table)
            .ok_or_else(|| bad("not in the mapping".into()))?;
        let seq = ids.first().map_or(0, Vec::len);
        let mut out = Vec::with_capacity(ids.len() * seq * d);
        for (b, prompt) in ids.iter().enumerate() {
            if prompt.len() != seq {
                return Err(Error::bug(format!(
                    "input_ids: prompt {b} has {} tokens, prompt 0 has {seq}",
                    prompt.len()
                )));
            }
            for &id in prompt {
                let id = id as usize;
                if id >= vocab {
                    return Err(Error::bug(format!(
                        "input_ids: token id {id} is past the {vocab} rows of `{table}`"
                    )));
                }
                row(&bytes[id * d * size..(id + 1) * d * size], &mut out);
            }
        }
        Ok(Tensor::from_vec(out, (ids.len(), seq, d), device)?)
    }

    /// Prepares a batch: `embeddings` [B, S, d_model] from [`Self::embed`], `mask` [B][S]
    /// (non-zero for real tokens) from the tokenizer.
    pub fn prologue(&self, embeddings: Tensor, mask: &[Vec<u32>]) -> Result<Umt5State> {
        let (b, s, d) = embeddings.dims3()?;
        if d != self.cfg.d_model || mask.len() != b || mask.iter().any(|m| m.len() != s) {
            return Err(Error::bug(format!("prompt embeddings: [{b}, {s}, {d}] with a mask of {} rows does not fit d_model {} \
                     (one mask row of {s} per prompt)",
                    mask.len(),
                    self.cfg.d_model
                ),
            ));
        }
        let dev = embeddings.device();
        let buckets: Vec<u32> = (0..s as i64)
            .flat_map(|q| (0..s as i64).map(move |k| (q, k)))
            .map(|(q, k)| relative_position_bucket(&self.cfg, k - q) as u32)
            .collect();
        let bias: Vec<f32> = mask
            .iter()
            .flatten()
            .map(|&m| if m != 0 { 0.0 } else { f32::MIN })
            .collect();
        Ok(Umt5State {
            x: embeddings.to_dtype(DType::F32)?,
            buckets: Tensor::from_vec(buckets, s * s, dev)?,
            mask_bias: Tensor::from_vec(bias, (b, 1, 1, s), dev)?,
            seq: s,
        })
    }

    /// Self-attention with this layer's relative position bias, on normed `h`.
    fn attention(&self, w: &dyn Weights, h: &Tensor, st: &Umt5State) -> Result<Tensor> {
        let (b, s, _) = h.dims3()?;
        let (heads, dk) = (self.cfg.num_heads, self.cfg.d_kv);
        let split = |name: &str| -> Result<Tensor> {
            Ok(linear(w, name, h)?
                .reshape((b, s, heads, dk))?
                .transpose(1, 2)?
                .contiguous()?)
        };
        let q = split("layer.0.SelfAttention.q.weight")?;
        let k = split("layer.0.SelfAttention.k.weight")?;
        let v = split("layer.0.SelfAttention.v.weight")?;
        let table = w.get("layer.0.SelfAttention.relative_attention_bias.weight")?;
        let position = table
            .index_select(&st.buckets, 0)?
            .reshape((st.seq, st.seq, heads))?
            .permute((2, 0, 1))?
            .unsqueeze(0)?;
        // No 1/√d_kv: T5's initialisation folds it into the query weights.
        let scores = flops::matmul(&q, &k.t()?)?
            .broadcast_add(&position)?
            .broadcast_add(&st.mask_bias)?;
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        let o = flops::matmul(&probs, &v)?
            .transpose(1, 2)?
            .reshape((b, s, heads * dk))?;
        linear(w, "layer.0.SelfAttention.o.weight", &o)
    }

    /// Block `index`: attention and feed-forward, each pre-normed with a residual.
    pub fn block(&self, index: usize, w: &dyn Weights, st: &mut Umt5State) -> Result<()> {
        if index >= self.cfg.num_layers {
            return Err(Error::bug(format!(
                "block: {index} of a {}-layer encoder",
                self.cfg.num_layers
            )));
        }
        let eps = self.cfg.layer_norm_epsilon;
        let h = rms_norm(&st.x, &w.get("layer.0.layer_norm.weight")?, eps)?;
        let x = (&st.x + self.attention(w, &h, st)?)?;
        let h = rms_norm(&x, &w.get("layer.1.layer_norm.weight")?, eps)?;
        // Gated GELU, tanh form ("gelu_new"), times the linear branch.
        let gate = linear(w, "layer.1.DenseReluDense.wi_0.weight", &h)?.gelu()?;
        let up = linear(w, "layer.1.DenseReluDense.wi_1.weight", &h)?;
        let f = linear(w, "layer.1.DenseReluDense.wo.weight", &(gate * up)?)?;
        st.x = (x + f)?;
        Ok(())
    }

    /// The final norm: `last_hidden_state` [B, S, d_model]. Padded positions hold what the
    /// encoder computed for them; [`zero_padding`] is the pipeline's masking.
    pub fn epilogue(&self, st: Umt5State) -> Result<Tensor> {
        rms_norm(&st.x, &self.final_norm, self.cfg.layer_norm_epsilon)
    }
}

/// `WanPipeline`'s use of the hidden states: each prompt's first `sum(mask)` rows, zeros
/// after (its `prompt_embeds`).
pub fn zero_padding(hidden: &Tensor, mask: &[Vec<u32>]) -> Result<Tensor> {
    let (b, s, _) = hidden.dims3()?;
    if mask.len() != b || mask.iter().any(|m| m.len() != s) {
        return Err(Error::bug(format!(
            "attention mask: {} rows do not match hidden states [{b}, {s}, _]",
            mask.len()
        )));
    }
    let keep: Vec<f32> = mask
        .iter()
        .flat_map(|m| {
            let len = m.iter().filter(|&&v| v > 0).count();
            (0..s).map(move |i| if i < len { 1.0 } else { 0.0 })
        })
        .collect();
    let keep = Tensor::from_vec(keep, (b, s, 1), hidden.device())?;
    Ok(hidden.broadcast_mul(&keep)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_split_directions_and_space_far_offsets_logarithmically() {
        let cfg = Umt5Config::tiny();
        let b = |rel| relative_position_bucket(&cfg, rel);
        // Exact offsets (0..8 each way; keys after the query use the upper half).
        assert_eq!((b(0), b(-1), b(-7), b(1), b(7)), (0, 1, 7, 17, 23));
        // Log-spaced from 8 to 128 over 8 buckets, exact at the powers of two.
        assert_eq!((b(8), b(15), b(16), b(32), b(64)), (24, 25, 26, 28, 30));
        assert_eq!((b(-16), b(-127), b(-128), b(-10_000)), (10, 15, 15, 15));
        assert_eq!(b(10_000), 31);
    }

    #[test]
    fn zero_padding_keeps_each_prompts_rows() {
        let h = Tensor::ones((2, 3, 2), DType::F32, &Device::Cpu).unwrap();
        let z = zero_padding(&h, &[vec![1, 1, 0], vec![1, 0, 0]]).unwrap();
        let v: Vec<f32> = z.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(v, [1., 1., 1., 1., 0., 0., 1., 1., 0., 0., 0., 0.]);
        assert!(zero_padding(&h, &[vec![1, 1, 0]]).is_err());
    }
}
