//! Small tensor helpers more than one model shares, kept here so that no family reaches
//! into another's model for them: Qwen's RMS norm, rotary rotation and grouped key/value
//! repetition (the Qwen2.5-VL encoder and Cosmos3), and the sinusoidal timestep embedding
//! (Wan and Cosmos3). Each is written once because the parity tests pin its rounding.

use candle_core::{Device, Tensor, D};

use crate::Result;

/// Qwen's RMS norm over the last dimension, `weight · x / √(mean(x²) + eps)`.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    Ok(x.broadcast_mul(&(ms + eps)?.sqrt()?.recip()?)?
        .broadcast_mul(weight)?)
}

/// `x * cos + rotate_half(x) * sin` for x [1, H, S, D] and tables [S, D].
pub fn rotate(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let (a, b) = (
        x.narrow(D::Minus1, 0, half)?,
        x.narrow(D::Minus1, half, half)?,
    );
    let rotated = Tensor::cat(&[&b.neg()?, &a], D::Minus1)?;
    Ok((x.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?)?)
}

/// [1, kv heads, S, D] to [1, kv heads × groups, S, D], each key/value head serving the
/// `groups` query heads after it (torch's `enable_gqa`).
pub fn repeat_kv(x: &Tensor, groups: usize) -> Result<Tensor> {
    if groups == 1 {
        return Ok(x.clone());
    }
    let (b, h, s, d) = x.dims4()?;
    Ok(x.unsqueeze(2)?
        .broadcast_as((b, h, groups, s, d))?
        .contiguous()?
        .reshape((b, h * groups, s, d))?)
}

/// diffusers' `get_timestep_embedding` as Wan calls it (flip_sin_to_cos, shift 0):
/// [cos | sin] of `t · 10000^(-i / (dim / 2))`, [len(t), dim]. The exponent is formed in
/// f32 as torch forms it; exp, sin and cos go through f64 so they round once.
pub fn timestep_embedding(t: &[f32], dim: usize, device: &Device) -> Result<Tensor> {
    let half = dim / 2;
    let freqs: Vec<f32> = (0..half)
        .map(|i| {
            let exponent = -(10000f64.ln() as f32) * i as f32 / half as f32;
            (exponent as f64).exp() as f32
        })
        .collect();
    let mut out = Vec::with_capacity(t.len() * dim);
    for &ts in t {
        let args: Vec<f64> = freqs.iter().map(|f| (ts * f) as f64).collect();
        out.extend(args.iter().map(|a| a.cos() as f32));
        out.extend(args.iter().map(|a| a.sin() as f32));
    }
    Ok(Tensor::from_vec(out, (t.len(), dim), device)?)
}

/// Seeded weights of a tenth-ish scale for every tensor of `specs`, for the transformers'
/// unit tests (a forward over them stays finite).
#[cfg(test)]
pub fn random_weights(
    specs: &[layerwise_core::family::TensorSpec],
    seed: u64,
) -> std::collections::HashMap<String, Tensor> {
    specs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let t = crate::execution::weights::seeded_noise(seed + i as u64, &s.shape).unwrap();
            (s.name.clone(), (t * 0.2).unwrap())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestep_embedding_is_cos_then_sin_without_shift() {
        let e: Vec<Vec<f32>> = timestep_embedding(&[2.0], 8, &Device::Cpu)
            .unwrap()
            .to_vec2()
            .unwrap();
        // Frequencies 10000^(-i/4): 1, 0.1, 0.01, 0.001.
        for (i, f) in [1.0, 0.1, 0.01, 0.001f64].iter().enumerate() {
            assert!((e[0][i] - (2.0 * f).cos() as f32).abs() < 1e-6, "{i}");
            assert!((e[0][4 + i] - (2.0 * f).sin() as f32).abs() < 1e-6, "{i}");
        }
    }
}
