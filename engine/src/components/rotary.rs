//! The rotary tables the transformers build (Wan, Qwen-Image, Cosmos3, Qwen2.5-VL): each
//! model decides the positions and how it forms an angle (diffusers forms Wan's in f64,
//! the others in f32); this module owns the f32 frequencies, rounding each angle's cosine
//! and sine to f32 once, laying them out as tables (interleaved pairs or `rotate_half`
//! halves), rotating q or k by the interleaved ones, and the causal grouped-query
//! attention of q and k rotated by the halves.

use candle_core::{Device, Tensor};

use crate::components::attention::causal_attention;
use crate::components::layers::{repeat_kv, rotate};
use crate::Result;

/// The frequencies of a rotary part of width `dim`, `1 / theta^(2j / dim)`, formed in f32
/// as transformers' `inv_freq` and diffusers' Qwen tables form them.
pub fn f32_frequencies(dim: usize, theta: f64) -> Vec<f32> {
    (0..dim / 2)
        .map(|j| {
            let exponent = (2 * j) as f32 / dim as f32;
            1.0 / (theta.powf(exponent as f64) as f32)
        })
        .collect()
}

/// Cosines and sines of every (token, channel pair), pushed token by token, pair by pair.
pub struct RotaryTables {
    tokens: usize,
    width: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RotaryTables {
    /// Room for `tokens` tokens of `width` entries each: head_dim / 2 pairs pushed one by
    /// one, or head_dim entries pushed as halves.
    pub fn new(tokens: usize, width: usize) -> Self {
        RotaryTables {
            tokens,
            width,
            cos: Vec::with_capacity(tokens * width),
            sin: Vec::with_capacity(tokens * width),
        }
    }

    /// The next pair's rotation by `angle`: its cosine and sine go through f64 and round once.
    pub fn push(&mut self, angle: f64) {
        self.cos.push(angle.cos() as f32);
        self.sin.push(angle.sin() as f32);
    }

    /// The next token's rotation in the `rotate_half` layout: its `angles` (one per
    /// frequency) for the first half of the head, then again for the second.
    pub fn push_halves(&mut self, angles: &[f64]) {
        for _ in 0..2 {
            self.cos.extend(angles.iter().map(|a| a.cos() as f32));
            self.sin.extend(angles.iter().map(|a| a.sin() as f32));
        }
    }

    /// The two tables [tokens, width] (cosines, sines).
    pub fn finish(self, device: &Device) -> Result<(Tensor, Tensor)> {
        let shape = (self.tokens, self.width);
        Ok((
            Tensor::from_vec(self.cos, shape, device)?,
            Tensor::from_vec(self.sin, shape, device)?,
        ))
    }
}

/// Causal attention of q over k and v [1, heads, S, head_dim] (k and v of heads / `groups`
/// heads, shared by each group of queries) after q and k rotate by `rotate_half` tables,
/// scaled by 1/√head_dim: how the Qwen2-style decoders (Qwen2.5-VL, Cosmos3's
/// understanding pathway) attend.
pub fn rotated_causal_gqa(
    [q, k, v]: [&Tensor; 3],
    (cos, sin): (&Tensor, &Tensor),
    groups: usize,
    head_dim: usize,
) -> Result<Tensor> {
    let q = rotate(q, cos, sin)?;
    let k = rotate(k, cos, sin)?;
    causal_attention(
        &q,
        &repeat_kv(&k, groups)?,
        &repeat_kv(v, groups)?,
        1.0 / (head_dim as f64).sqrt(),
    )
}

/// Rotates q or k [B, H, tokens, head_dim] by the tables: channels (2i, 2i + 1) form
/// pair i (diffusers' interleaved real/imaginary layout, its complex view of the last
/// dimension).
pub fn apply(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    Ok(candle_nn::rotary_emb::rope_i(&x.contiguous()?, cos, sin)?)
}
