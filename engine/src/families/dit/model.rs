//! DiT forward pass, split the way the pipeline streams it: a prologue (patch and
//! position embedding) and epilogue (final adaLN layer, unpatchify) on resident weights,
//! and one function per block that takes the block's weights from wherever they are.
//! Follows diffusers' `DiTTransformer2DModel` operation for operation.
//!
//! Computes in the dtype of its weights (the run's compute dtype): activations are cast
//! to it on entry, the normalisation statistics and the attention softmax are taken in f32
//! and cast back (as PyTorch's half-precision kernels accumulate in f32), and the output
//! leaves in f32 for the sampler.

use candle_core::{DType, Device, Tensor};

use crate::components::{flops, fused};
use crate::execution::dtype::product;
use crate::execution::weights::Weights;
use crate::families::dit::{DitConfig, TIMESTEP_CHANNELS};
use crate::{Error, Result};

/// eps of the LayerNorm inside adaLN-Zero and of the final norm (fixed in diffusers).
const ADA_EPS: f64 = 1e-6;

fn linear(w: &dyn Weights, name: &str, x: &Tensor) -> Result<Tensor> {
    let weight = w.get(&format!("{name}.weight"))?;
    match w.get(&format!("{name}.bias")).ok() {
        Some(bias) => product(&[x, &weight, &bias], |t| {
            fused::linear(&t[0], &t[1], Some(&t[2]))
        }),
        None => product(&[x, &weight], |t| fused::linear(&t[0], &t[1], None)),
    }
}

/// diffusers' `get_timestep_embedding` with flip_sin_to_cos=True, downscale_freq_shift=1.
pub fn timestep_embedding(t: &[f32], device: &Device) -> Result<Tensor> {
    let half = TIMESTEP_CHANNELS / 2;
    let freqs: Vec<f32> = (0..half)
        .map(|i| (-(10000f64.ln() as f32) * i as f32 / (half as f32 - 1.0)).exp())
        .collect();
    let mut out = Vec::with_capacity(t.len() * TIMESTEP_CHANNELS);
    for &ts in t {
        let args: Vec<f32> = freqs.iter().map(|f| ts * f).collect();
        out.extend(args.iter().map(|a| a.cos()));
        out.extend(args.iter().map(|a| a.sin()));
    }
    Ok(Tensor::from_vec(out, (t.len(), TIMESTEP_CHANNELS), device)?)
}

fn sincos_1d(dim: usize, pos: f64, out: &mut Vec<f64>) {
    let half = dim / 2;
    let omega: Vec<f64> = (0..half)
        .map(|i| 1.0 / 10000f64.powf(i as f64 / (dim as f64 / 2.0)))
        .collect();
    out.extend(omega.iter().map(|o| (pos * o).sin()));
    out.extend(omega.iter().map(|o| (pos * o).cos()));
}

/// diffusers' 2-D sin-cos position embedding for an `h × w` patch grid: the first half
/// of the channels encodes the column, the second the row, scaled to `base` patches.
pub fn pos_embedding(
    dim: usize,
    h: usize,
    w: usize,
    base: usize,
    device: &Device,
) -> Result<Tensor> {
    let mut v = Vec::with_capacity(h * w * dim);
    for row in 0..h {
        for col in 0..w {
            let gw = col as f32 / (w as f32 / base as f32);
            let gh = row as f32 / (h as f32 / base as f32);
            sincos_1d(dim / 2, gw as f64, &mut v);
            sincos_1d(dim / 2, gh as f64, &mut v);
        }
    }
    let v: Vec<f32> = v.into_iter().map(|x| x as f32).collect();
    Ok(Tensor::from_vec(v, (1, h * w, dim), device)?)
}

/// One request's activations while its blocks run.
pub struct DitState {
    /// Hidden states [B, T, D].
    pub x: Tensor,
    /// Sinusoidal timestep projections [B, 256].
    t_proj: Tensor,
    /// Class labels [B] (u32), the null class for the unconditional half.
    labels: Tensor,
    /// Block 0's conditioning, reused by the final layer (as diffusers does).
    cond0: Option<Tensor>,
    grid: (usize, usize),
}

/// The DiT's shape and its resident (non-streamed) weights.
pub struct Dit {
    pub cfg: DitConfig,
    resident: Box<dyn Weights + Send + Sync>,
}

impl Dit {
    pub fn new(cfg: DitConfig, resident: Box<dyn Weights + Send + Sync>) -> Self {
        Dit { cfg, resident }
    }

    /// Patch embedding of latents [B, C, H, W] for timestep `t` and `labels`.
    pub fn prologue(&self, latents: &Tensor, t: f32, labels: &[u32]) -> Result<DitState> {
        let (b, c, h, w) = latents.dims4()?;
        let p = self.cfg.patch();
        if c != self.cfg.in_channels || h % p != 0 || w % p != 0 || labels.len() != b {
            return Err(Error::bug(format!("latents: shape [{b}, {c}, {h}, {w}] with {} labels does not fit this DiT (in_channels {}, patch {p})", labels.len(), self.cfg.in_channels),
            ));
        }
        let dev = latents.device();
        let wt = self.resident.get("pos_embed.proj.weight")?;
        let bias = self.resident.get("pos_embed.proj.bias")?;
        let dtype = wt.dtype();
        let x = product(&[&latents.to_dtype(dtype)?, &wt], |t| {
            Ok(t[0].conv2d(&t[1], 0, p, 1, 1)?)
        })?
        .broadcast_add(&bias.reshape((1, (), 1, 1))?)?;
        let (gh, gw) = (h / p, w / p);
        let x = x.flatten_from(2)?.transpose(1, 2)?;
        let base = self.cfg.sample_size / p;
        let x = x
            .broadcast_add(&pos_embedding(self.cfg.hidden(), gh, gw, base, dev)?.to_dtype(dtype)?)?
            .contiguous()?;
        Ok(DitState {
            x,
            t_proj: timestep_embedding(&vec![t; b], dev)?.to_dtype(dtype)?,
            labels: Tensor::from_slice(labels, b, dev)?,
            cond0: None,
            grid: (gh, gw),
        })
    }

    /// Timestep + class conditioning of a block's own embedder.
    fn conditioning(&self, w: &dyn Weights, st: &DitState) -> Result<Tensor> {
        let t = linear(w, "norm1.emb.timestep_embedder.linear_1", &st.t_proj)?.silu()?;
        let t = linear(w, "norm1.emb.timestep_embedder.linear_2", &t)?;
        let table = w.get("norm1.emb.class_embedder.embedding_table.weight")?;
        let c = table.index_select(&st.labels, 0)?;
        Ok((t + c)?)
    }

    fn attention(&self, w: &dyn Weights, x: &Tensor) -> Result<Tensor> {
        let (b, t, d) = x.dims3()?;
        let (h, hd) = (self.cfg.num_attention_heads, self.cfg.attention_head_dim);
        let heads = |name: &str| -> Result<Tensor> {
            Ok(linear(w, name, x)?
                .reshape((b, t, h, hd))?
                .transpose(1, 2)?
                .contiguous()?)
        };
        let (q, k, v) = (
            heads("attn1.to_q")?,
            heads("attn1.to_k")?,
            heads("attn1.to_v")?,
        );
        let scores = product(&[&q, &k.t()?], |t| Ok(flops::matmul(&t[0], &t[1])?))?;
        let probs = fused::softmax_scaled(&scores, 1.0 / (hd as f64).sqrt())?;
        let o = product(&[&probs, &v], |t| Ok(flops::matmul(&t[0], &t[1])?))?
            .transpose(1, 2)?
            .reshape((b, t, d))?;
        linear(w, "attn1.to_out.0", &o)
    }

    /// One adaLN-Zero block.
    pub fn block(&self, index: usize, w: &dyn Weights, st: &mut DitState) -> Result<()> {
        let cond = self.conditioning(w, st)?;
        let ada = linear(w, "norm1.linear", &cond.silu()?)?;
        let m = ada.chunk(6, 1)?;
        let (shift_msa, scale_msa, gate_msa) = (&m[0], &m[1], &m[2]);
        let (shift_mlp, scale_mlp, gate_mlp) = (&m[3], &m[4], &m[5]);
        if index == 0 {
            st.cond0 = Some(cond);
        }
        let x = &st.x;
        let h = fused::layer_norm_modulate(x, shift_msa, scale_msa, ADA_EPS)?;
        let a = self.attention(w, &h)?;
        let x = fused::gated_residual(x, &a, gate_msa)?;
        let h = fused::layer_norm_modulate(&x, shift_mlp, scale_mlp, self.cfg.norm_eps)?;
        let h = linear(w, "ff.net.0.proj", &h)?;
        let h = if self.cfg.activation_fn == "gelu" {
            h.gelu_erf()?
        } else {
            fused::gelu_tanh(&h)?
        };
        let f = linear(w, "ff.net.2", &h)?;
        st.x = fused::gated_residual(&x, &f, gate_mlp)?;
        Ok(())
    }

    /// Final adaLN layer and unpatchify: [B, out_channels, H, W].
    pub fn epilogue(&self, st: DitState) -> Result<Tensor> {
        let cond = st
            .cond0
            .ok_or_else(|| Error::bug("pipeline: epilogue before block 0 ran"))?;
        let ss = linear(self.resident.as_ref(), "proj_out_1", &cond.silu()?)?;
        let m = ss.chunk(2, 1)?;
        let x = fused::layer_norm_modulate(&st.x, &m[0], &m[1], ADA_EPS)?;
        let x = linear(self.resident.as_ref(), "proj_out_2", &x)?;
        let (b, _, _) = x.dims3()?;
        let (p, c) = (self.cfg.patch(), self.cfg.out());
        let (gh, gw) = st.grid;
        let x = x
            .reshape((b, gh, gw, p, p, c))?
            .permute((0, 5, 1, 3, 2, 4))?;
        Ok(x.reshape((b, c, gh * p, gw * p))?.to_dtype(DType::F32)?)
    }
}
