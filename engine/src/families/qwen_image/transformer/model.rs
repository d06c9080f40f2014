//! Qwen-Image's transformer forward pass, split the way the pipeline streams it: a
//! prologue (input projections, text norm, timestep embedder, rotary tables) and an
//! epilogue (output modulation and projection) on resident weights, and one function per
//! double-stream block that takes the block's weights from wherever they are. Follows
//! diffusers 0.42.1's `QwenImageTransformer2DModel.forward` with
//! `encoder_hidden_states_mask=None` (the pipeline passes none when the prompt has no
//! padding, which a batch of one never has), in f32 throughout.
//!
//! A block keeps two streams, image and text, each with its own modulation, norms,
//! projections and feed-forward; they meet only in attention, which runs once over the
//! joined sequence [text, image].

use candle_core::{Device, Tensor, D};

use super::config::{QwenImageTransformerConfig, EPS, TIMESTEP_DIM, TIMESTEP_SCALE};
use super::rope;
use crate::components::attention::attention;
use crate::components::fused;
use crate::execution::weights::Weights;
use crate::{Error, Result};

fn linear(w: &dyn Weights, name: &str, x: &Tensor) -> Result<Tensor> {
    let weight = w.get(&format!("{name}.weight"))?;
    let bias = w.get(&format!("{name}.bias"))?;
    fused::linear(x, &weight, Some(&bias))
}

/// RMSNorm over the last dimension with a learned scale, as diffusers' `RMSNorm`.
fn rms_norm(x: &Tensor, weight: &Tensor) -> Result<Tensor> {
    Ok(candle_nn::ops::rms_norm(
        &x.contiguous()?,
        weight,
        EPS as f32,
    )?)
}

/// diffusers' `Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0, scale=1000)`
/// of one timestep: [cos | sin] of `1000 · t · 10000^(-i / 128)`, [1, 256]. Every product
/// is formed in f32 in torch's order; exp, sin and cos go through f64 so they round once.
pub fn timestep_embedding(t: f32, device: &Device) -> Result<Tensor> {
    let half = TIMESTEP_DIM / 2;
    let args: Vec<f64> = (0..half)
        .map(|i| {
            let exponent = -(10000f64.ln() as f32) * i as f32 / half as f32;
            let freq = (exponent as f64).exp() as f32;
            (TIMESTEP_SCALE * (t * freq)) as f64
        })
        .collect();
    let mut out: Vec<f32> = args.iter().map(|a| a.cos() as f32).collect();
    out.extend(args.iter().map(|a| a.sin() as f32));
    Ok(Tensor::from_vec(out, (1, TIMESTEP_DIM), device)?)
}

/// One request's activations while its blocks run (batch 1).
pub struct QwenImageState {
    /// Image stream [1, S_img, D].
    pub img: Tensor,
    /// Text stream [1, M, D].
    pub txt: Tensor,
    /// SiLU of the timestep embedding [1, D]: the input of every modulation.
    temb_silu: Tensor,
    /// Rotary tables of the joined sequence [M + S_img, head_dim / 2], text rows first.
    cos: Tensor,
    sin: Tensor,
    /// The patch grid (frames, rows, columns).
    pub grid: (usize, usize, usize),
}

/// One stream's modulation for a block: (shift, scale, gate) before attention and before
/// the feed-forward, each [1, D].
struct Modulation {
    attn: [Tensor; 3],
    ffn: [Tensor; 3],
}

/// The transformer's shape and its resident (non-streamed) weights.
pub struct QwenImageTransformer {
    pub cfg: QwenImageTransformerConfig,
    resident: Box<dyn Weights + Send + Sync>,
}

impl QwenImageTransformer {
    pub fn new(cfg: QwenImageTransformerConfig, resident: Box<dyn Weights + Send + Sync>) -> Self {
        QwenImageTransformer { cfg, resident }
    }

    /// Embeds packed latents [1, S_img, in_channels] (2 × 2 latent patches, frame-major
    /// then row then column, as the pipeline packs them) at `timestep` (exactly what the
    /// pipeline passes the transformer: t / 1000) with prompt embeddings
    /// [1, M, joint_attention_dim] (no padding), for a patch grid `(frames, rows,
    /// columns)` (the pipeline's `img_shapes` entry) whose product is S_img. Builds the
    /// rotary tables every block uses. A grid or prompt beyond the rotary tables is an
    /// invalid request; shapes that disagree are the engine's bug.
    pub fn prologue(
        &self,
        latents: &Tensor,
        timestep: f32,
        text: &Tensor,
        grid: (usize, usize, usize),
    ) -> Result<QwenImageState> {
        let cfg = &self.cfg;
        let (b, s, c) = latents.dims3()?;
        let (gf, gh, gw) = grid;
        if b != 1 || c != cfg.in_channels || s == 0 || gf * gh * gw != s {
            return Err(Error::bug(format!(
                "latents: shape [{b}, {s}, {c}] for a {gf} × {gh} × {gw} patch grid: want \
                 [1, {}, {}]",
                gf * gh * gw,
                cfg.in_channels
            )));
        }
        let (tb, m, td) = text.dims3()?;
        if tb != 1 || td != cfg.joint_attention_dim || m == 0 {
            return Err(Error::bug(format!(
                "text embeddings: shape [{tb}, {m}, {td}]: want [1, tokens ≥ 1, {}]",
                cfg.joint_attention_dim
            )));
        }
        let dev = latents.device();
        let (cos, sin) = rope::tables(cfg, grid, m, dev)?;

        let r = self.resident.as_ref();
        let img = linear(r, "img_in", latents)?;
        let txt = rms_norm(text, &r.get("txt_norm.weight")?)?;
        let txt = linear(r, "txt_in", &txt)?;
        let t_proj = timestep_embedding(timestep, dev)?;
        let temb = linear(r, "time_text_embed.timestep_embedder.linear_1", &t_proj)?.silu()?;
        let temb = linear(r, "time_text_embed.timestep_embedder.linear_2", &temb)?;
        Ok(QwenImageState {
            img,
            txt,
            temb_silu: temb.silu()?,
            cos,
            sin,
            grid,
        })
    }

    /// A stream's six modulation vectors from its `{stream}_mod` of block `index`.
    fn modulation(
        &self,
        index: usize,
        w: &dyn Weights,
        stream: &str,
        temb_silu: &Tensor,
    ) -> Result<Modulation> {
        let m = linear(w, &format!("{stream}_mod.1"), temb_silu)?.chunk(6, 1)?;
        let Ok([shift1, scale1, gate1, shift2, scale2, gate2]) = <[Tensor; 6]>::try_from(m) else {
            return Err(Error::bug(format!(
                "weights: block {index}: {stream}_mod.1 does not split into 6 vectors"
            )));
        };
        Ok(Modulation {
            attn: [shift1, scale1, gate1],
            ffn: [shift2, scale2, gate2],
        })
    }

    /// One stream's queries, keys and values [1, tokens, H, head_dim], q and k RMS-normed
    /// per head. `names` are its projections (q, k, v) and q/k norms.
    fn qkv(&self, w: &dyn Weights, x: &Tensor, names: [&str; 5]) -> Result<[Tensor; 3]> {
        let (_, s, _) = x.dims3()?;
        let (h, hd) = (self.cfg.num_attention_heads, self.cfg.attention_head_dim);
        let [q, k, v, nq, nk] = names;
        let proj = |name: &str| -> Result<Tensor> {
            Ok(linear(w, &format!("attn.{name}"), x)?.reshape((1, s, h, hd))?)
        };
        let norm = |t: Tensor, name: &str| rms_norm(&t, &w.get(&format!("attn.{name}.weight"))?);
        Ok([norm(proj(q)?, nq)?, norm(proj(k)?, nk)?, proj(v)?])
    }

    /// Joint attention of both streams: each stream's (already modulated) input projected
    /// to q, k, v, joined as [text, image], rotated, attended over the whole sequence, split
    /// back and projected out per stream. Returns (image, text) outputs.
    fn joint_attention(
        &self,
        w: &dyn Weights,
        img: &Tensor,
        txt: &Tensor,
        st: &QwenImageState,
    ) -> Result<(Tensor, Tensor)> {
        let (s, m) = (img.dim(1)?, txt.dim(1)?);
        let d = self.cfg.hidden();
        let img_qkv = self.qkv(w, img, ["to_q", "to_k", "to_v", "norm_q", "norm_k"])?;
        let txt_qkv = self.qkv(
            w,
            txt,
            [
                "add_q_proj",
                "add_k_proj",
                "add_v_proj",
                "norm_added_q",
                "norm_added_k",
            ],
        )?;
        let [q, k, v] = [0, 1, 2].map(|i| -> Result<Tensor> {
            Ok(Tensor::cat(&[&txt_qkv[i], &img_qkv[i]], 1)?
                .transpose(1, 2)?
                .contiguous()?)
        });
        drop((img_qkv, txt_qkv));
        let q = rope::apply(&q?, &st.cos, &st.sin)?;
        let k = rope::apply(&k?, &st.cos, &st.sin)?;
        let scale = 1.0 / (self.cfg.attention_head_dim as f64).sqrt();
        let o = attention(&q, &k, &v?, scale)?;
        drop((q, k));
        let o = o.transpose(1, 2)?.reshape((1, m + s, d))?;
        let img_o = linear(w, "attn.to_out.0", &o.narrow(1, m, s)?)?;
        let txt_o = linear(w, "attn.to_add_out", &o.narrow(1, 0, m)?)?;
        Ok((img_o, txt_o))
    }

    /// Block `index` with its weights `w` (named relative to `transformer_blocks.{index}.`).
    pub fn block(&self, index: usize, w: &dyn Weights, st: &mut QwenImageState) -> Result<()> {
        let img_mod = self.modulation(index, w, "img", &st.temb_silu)?;
        let txt_mod = self.modulation(index, w, "txt", &st.temb_silu)?;
        let norm_modulate = |x: &Tensor, [shift, scale, _]: &[Tensor; 3]| {
            fused::layer_norm_modulate(x, shift, scale, EPS)
        };

        let img_n = norm_modulate(&st.img, &img_mod.attn)?;
        let txt_n = norm_modulate(&st.txt, &txt_mod.attn)?;
        let (img_a, txt_a) = self.joint_attention(w, &img_n, &txt_n, st)?;
        drop((img_n, txt_n));
        st.img = fused::gated_residual(&st.img, &img_a, &img_mod.attn[2])?;
        st.txt = fused::gated_residual(&st.txt, &txt_a, &txt_mod.attn[2])?;
        drop((img_a, txt_a));

        // One stream's feed-forward at a time, so only one hidden [tokens, 4 D] is live.
        for (x, modulation, mlp) in [
            (&mut st.img, &img_mod.ffn, "img_mlp"),
            (&mut st.txt, &txt_mod.ffn, "txt_mlp"),
        ] {
            let n = norm_modulate(x, modulation)?;
            let f = fused::gelu_tanh(&linear(w, &format!("{mlp}.net.0.proj"), &n)?)?;
            let f = linear(w, &format!("{mlp}.net.2"), &f)?;
            *x = fused::gated_residual(x, &f, &modulation[2])?;
        }
        Ok(())
    }

    /// Output norm (`norm_out`, AdaLayerNormContinuous: scale first, then shift) and
    /// projection of the image stream: [1, S_img, patch_size² × out_channels], still
    /// packed as the latents came in.
    pub fn epilogue(&self, st: QwenImageState) -> Result<Tensor> {
        let r = self.resident.as_ref();
        let m = linear(r, "norm_out.linear", &st.temb_silu)?;
        let d = self.cfg.hidden();
        let (scale, shift) = (m.narrow(D::Minus1, 0, d)?, m.narrow(D::Minus1, d, d)?);
        let x = fused::layer_norm_modulate(&st.img, &shift, &scale, EPS)?;
        linear(r, "proj_out", &x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::components::layers::random_weights;
    use crate::execution::weights::seeded_noise;

    fn tiny() -> QwenImageTransformer {
        let cfg = QwenImageTransformerConfig::tiny();
        let resident = random_weights(&cfg.resident_specs(), 100);
        QwenImageTransformer::new(cfg, Box::new(resident))
    }

    #[test]
    fn timestep_embedding_scales_by_1000_and_is_cos_then_sin() {
        let e: Vec<Vec<f32>> = timestep_embedding(0.002, &Device::Cpu)
            .unwrap()
            .to_vec2()
            .unwrap();
        assert_eq!(e[0].len(), 256);
        // Frequency 0 is 1: the angle is 1000 × 0.002 = 2.
        assert!((e[0][0] - 2f64.cos() as f32).abs() < 1e-6);
        assert!((e[0][128] - 2f64.sin() as f32).abs() < 1e-6);
    }

    #[test]
    fn a_forward_keeps_the_packed_shape_and_refuses_misfits() {
        let model = tiny();
        let cfg = model.cfg.clone();
        let latents = seeded_noise(1, &[1, 24, 16]).unwrap();
        let text = seeded_noise(2, &[1, 5, 24]).unwrap();
        let mut st = model.prologue(&latents, 0.5, &text, (1, 4, 6)).unwrap();
        assert_eq!(st.img.dims(), &[1, 24, 32]);
        assert_eq!(st.txt.dims(), &[1, 5, 32]);
        for i in 0..cfg.num_layers {
            let w = random_weights(&cfg.block_specs(), 1000 * (i as u64 + 1));
            model.block(i, &w, &mut st).unwrap();
        }
        let out = model.epilogue(st).unwrap();
        assert_eq!(out.dims(), &[1, 24, 16]);

        let wide = seeded_noise(4, &[1, 5, 23]).unwrap();
        for (text, grid, want) in [
            (&text, (1, 5, 6), "latents"),
            (&wide, (1, 4, 6), "text embeddings"),
        ] {
            let e = model.prologue(&latents, 0.5, text, grid).err().unwrap();
            let e = e.to_string();
            assert!(e.contains(want), "{e}");
        }
        let two = seeded_noise(5, &[2, 24, 16]).unwrap();
        assert!(model.prologue(&two, 0.5, &text, (1, 4, 6)).is_err());
    }

    #[test]
    fn a_missing_block_tensor_is_named() {
        let model = tiny();
        let latents = seeded_noise(1, &[1, 4, 16]).unwrap();
        let text = seeded_noise(2, &[1, 3, 24]).unwrap();
        let mut st = model.prologue(&latents, 0.1, &text, (1, 2, 2)).unwrap();
        let mut w = random_weights(&model.cfg.block_specs(), 9);
        w.remove("attn.norm_added_k.weight");
        let e = model.block(0, &w, &mut st).unwrap_err().to_string();
        assert!(e.contains("attn.norm_added_k.weight"), "{e}");
    }
}
