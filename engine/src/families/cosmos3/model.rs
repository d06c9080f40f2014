//! Cosmos3's transformer, split the way the pipeline streams it, following diffusers
//! 0.42.1's `Cosmos3OmniTransformer.forward` in f32.
//!
//! The understanding pathway attends causally to itself only and never sees the latents
//! or the timestep, so its keys and values are the same at every denoising step: one pass
//! over its blocks per request ([`Cosmos3Transformer::understand`]) keeps each layer's keys
//! (normed and rotated as the generation pathway reads them) and values. Each step is then
//! one pass over the generation pathway's blocks alone, which attend to those and to their
//! own. The last layer's understanding attention output and MLP feed nothing a picture
//! needs (diffusers computes them and reads only the generation tokens), so they are not
//! computed.

use candle_core::{DType, Device, Tensor};

use super::config::Cosmos3Config;
use crate::components::attention::attention;
use crate::components::fused;
use crate::components::layers::{repeat_kv, rms_norm, rotate, timestep_embedding};
use crate::components::rotary::{f32_frequencies, rotated_causal_gqa, RotaryTables};
use crate::execution::seq::Split;
use crate::execution::weights::Weights;
use crate::{Error, Result};

/// One sequence's understanding pathway while its blocks run, and what it leaves.
pub struct Understanding {
    /// Hidden states [L, d] of the text tokens.
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    /// Per layer: keys [1, kv heads, L, head dim] as the generation pathway reads them,
    /// and values.
    pub kv: Vec<(Tensor, Tensor)>,
    /// The generation pathway's rotary tables after this text, made at its first step
    /// and kept for the others (their positions do not change), with what they were made
    /// for: the patch grid, the fps' bits and the frames per latent frame.
    vision: Option<(VisionKey, Tensor, Tensor)>,
}

type VisionKey = ((usize, usize, usize), u64, usize);

impl Understanding {
    /// Text tokens.
    pub fn len(&self) -> usize {
        self.x.dim(0).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One sequence's generation pathway while its blocks run: on a rank of a
/// sequence-parallel group, its share of the vision tokens ([`Split`]).
pub struct Generation {
    /// Hidden states [n, d] of this rank's vision tokens.
    x: Tensor,
    /// Vision tokens of the whole sequence.
    tokens: usize,
    /// `tokens` when `x` holds a share of them: the token-wise products take the whole's
    /// path ([`fused::linear_share`]).
    whole: Option<usize>,
    cos: Tensor,
    sin: Tensor,
    /// (latent frames, rows, columns) before padding to whole patches.
    latent: (usize, usize, usize),
    /// `x` has been through the pathway's final norm ([`Cosmos3Transformer::final_norm`]).
    normed: bool,
}

impl Generation {
    /// The hidden states [n, d] (for a step cache).
    pub fn hidden(&self) -> &Tensor {
        &self.x
    }

    /// Replaces the hidden states by a step cache's [n, d], at the same boundary.
    pub fn set_hidden(&mut self, x: Tensor) -> Result<()> {
        if x.dims() != self.x.dims() {
            return Err(Error::bug(format!(
                "step cache: hidden states {:?} for {:?}",
                x.dims(),
                self.x.dims()
            )));
        }
        self.x = x;
        Ok(())
    }
}

/// The transformer's shape and its resident weights.
pub struct Cosmos3Transformer {
    pub cfg: Cosmos3Config,
    resident: Box<dyn Weights + Send + Sync>,
}

/// 3D rotary tables [S, head dim] for positions [3][S] (time, rows, columns), frequencies
/// interleaved across the axes as Qwen3-VL does: frequency j takes the row position when
/// j ≡ 1 (mod 3) and j < 3 × rows' share, the column position when j ≡ 2 and j < 3 ×
/// columns' share, else the time position. Products are formed in f32 as torch forms
/// them; cos and sin go through f64 so they round once.
pub fn rotary(
    cfg: &Cosmos3Config,
    positions: &[Vec<f32>; 3],
    dev: &Device,
) -> Result<(Tensor, Tensor)> {
    let hd = cfg.head_dim;
    let half = hd / 2;
    let axes = cfg.axes();
    let inv = f32_frequencies(hd, cfg.rope_theta);
    let axis = |j: usize| {
        if j % 3 == 1 && j < 3 * axes[1] {
            1
        } else if j % 3 == 2 && j < 3 * axes[2] {
            2
        } else {
            0
        }
    };
    let n = positions[0].len();
    let mut tables = RotaryTables::new(n, hd);
    let [t, r, c] = positions;
    for ((t, r), c) in t.iter().zip(r).zip(c) {
        let at = [*t, *r, *c];
        let f: Vec<f64> = (0..half).map(|j| (at[axis(j)] * inv[j]) as f64).collect();
        tables.push_halves(&f);
    }
    tables.finish(dev)
}

/// Positions of `tokens` text tokens: 0, 1, ... on every axis.
pub fn text_positions(tokens: usize) -> [Vec<f32>; 3] {
    let ids: Vec<f32> = (0..tokens).map(|i| i as f32).collect();
    [ids.clone(), ids.clone(), ids]
}

/// Positions of a (t, h, w) patch grid after `text` text tokens, as the pipeline's
/// `get_3d_mrope_ids_vae_tokens` gives them: time from `text + margin`, rescaled to
/// `base_fps` when a clip has several latent frames and fps modulation is on; rows and
/// columns from 0 (or from the same offset).
pub fn vision_positions(
    cfg: &Cosmos3Config,
    text: usize,
    grid: (usize, usize, usize),
    fps: f64,
    frames_per_latent: usize,
) -> [Vec<f32>; 3] {
    let (t, h, w) = grid;
    let offset = (text + cfg.unified_3d_mrope_temporal_modality_margin) as f32;
    let modulated = cfg.enable_fps_modulation && t > 1;
    let tps = (fps / frames_per_latent as f64) as f32;
    let base_tps = (cfg.base_fps as f64 / frames_per_latent as f64) as f32;
    let spatial = if cfg.unified_3d_mrope_reset_spatial_ids {
        0.0
    } else {
        offset
    };
    let mut out: [Vec<f32>; 3] = Default::default();
    for f in 0..t {
        let time = if modulated {
            f as f32 / tps * base_tps + offset
        } else {
            f as f32 + offset
        };
        for r in 0..h {
            for c in 0..w {
                out[0].push(time);
                out[1].push(r as f32 + spatial);
                out[2].push(c as f32 + spatial);
            }
        }
    }
    out
}

impl Cosmos3Transformer {
    pub fn new(cfg: Cosmos3Config, resident: Box<dyn Weights + Send + Sync>) -> Self {
        Cosmos3Transformer { cfg, resident }
    }

    fn linear(&self, w: &dyn Weights, name: &str, x: &Tensor) -> Result<Tensor> {
        self.linear_share(w, name, x, None)
    }

    /// [`Self::linear`] of a rank's share of the tokens, of `whole` rows in all
    /// ([`fused::linear_share`]).
    fn linear_share(
        &self,
        w: &dyn Weights,
        name: &str,
        x: &Tensor,
        whole: Option<usize>,
    ) -> Result<Tensor> {
        let weight = w.get(&format!("{name}.weight"))?;
        let bias = if self.cfg.attention_bias && name.starts_with("self_attn.") {
            Some(w.get(&format!("{name}.bias"))?)
        } else {
            None
        };
        fused::linear_share(x, &weight, bias.as_ref(), whole)
    }

    /// [S, heads × D] to [1, heads, S, D].
    fn heads(&self, x: &Tensor, heads: usize) -> Result<Tensor> {
        let s = x.dim(0)?;
        Ok(x.reshape((1, s, heads, self.cfg.head_dim))?
            .transpose(1, 2)?
            .contiguous()?)
    }

    /// A per-head norm of `name` over [1, H, S, D], or none.
    fn head_norm(&self, w: &dyn Weights, name: &str, x: Tensor) -> Result<Tensor> {
        rms_norm(
            &x,
            &w.get(&format!("self_attn.{name}.weight"))?,
            self.cfg.rms_norm_eps,
        )
    }

    /// A layer's tail over its input `x` and attention output `o` [1, H, S, D]: the output
    /// projection `out` added to `x`, then the MLP `mlp` over that normed by `norm`, added
    /// in turn. The understanding and generation pathways differ only in the names.
    fn out_and_mlp(
        &self,
        w: &dyn Weights,
        x: &Tensor,
        o: &Tensor,
        [out, norm, mlp]: [&str; 3],
        whole: Option<usize>,
    ) -> Result<Tensor> {
        let h = (x + self.linear_share(w, out, &Self::merge(o)?, whole)?)?;
        let normed = rms_norm(&h, &w.get(norm)?, self.cfg.rms_norm_eps)?;
        let m = self.mlp(w, mlp, &normed, whole)?;
        Ok((h + m)?)
    }

    fn mlp(
        &self,
        w: &dyn Weights,
        prefix: &str,
        x: &Tensor,
        whole: Option<usize>,
    ) -> Result<Tensor> {
        let up = self.linear_share(w, &format!("{prefix}.up_proj"), x, whole)?;
        let hidden = if self.cfg.gated() {
            (self
                .linear_share(w, &format!("{prefix}.gate_proj"), x, whole)?
                .silu()?
                * up)?
        } else {
            up.relu()?.sqr()?
        };
        self.linear_share(w, &format!("{prefix}.down_proj"), &hidden, whole)
    }

    /// [1, H, S, D] to [S, H × D].
    fn merge(x: &Tensor) -> Result<Tensor> {
        let (_, h, s, d) = x.dims4()?;
        Ok(x.transpose(1, 2)?.reshape((s, h * d))?)
    }

    /// Starts the understanding pathway over text embeddings [L, d].
    pub fn understand(&self, embeddings: Tensor) -> Result<Understanding> {
        let l = embeddings.dim(0)?;
        if l == 0 || embeddings.dim(1)? != self.cfg.hidden_size {
            return Err(Error::bug(format!(
                "prompt: embeddings {:?}: want [tokens ≥ 1, {}]",
                embeddings.dims(),
                self.cfg.hidden_size
            )));
        }
        let (cos, sin) = rotary(&self.cfg, &text_positions(l), embeddings.device())?;
        Ok(Understanding {
            x: embeddings,
            cos,
            sin,
            kv: Vec::with_capacity(self.cfg.num_hidden_layers),
            vision: None,
        })
    }

    /// Layer `index`'s understanding pathway (its weights `w`, relative to `layers.{index}.`).
    pub fn understanding_block(
        &self,
        index: usize,
        w: &dyn Weights,
        st: &mut Understanding,
    ) -> Result<()> {
        let cfg = &self.cfg;
        let eps = cfg.rms_norm_eps;
        let x = rms_norm(&st.x, &w.get("input_layernorm.weight")?, eps)?;
        let q = self.heads(
            &self.linear(w, "self_attn.to_q", &x)?,
            cfg.num_attention_heads,
        )?;
        let k = self.heads(
            &self.linear(w, "self_attn.to_k", &x)?,
            cfg.num_key_value_heads,
        )?;
        let v = self.heads(
            &self.linear(w, "self_attn.to_v", &x)?,
            cfg.num_key_value_heads,
        )?;
        let (q, k) = if cfg.qk_norm_for_text {
            (
                self.head_norm(w, "norm_q", q)?,
                self.head_norm(w, "norm_k", k)?,
            )
        } else {
            (q, k)
        };
        let k_for_gen = if !cfg.qk_norm_for_text && cfg.use_und_k_norm_for_gen {
            self.head_norm(w, "k_norm_und_for_gen", k.clone())?
        } else {
            k.clone()
        };
        st.kv
            .push((rotate(&k_for_gen, &st.cos, &st.sin)?, v.clone()));
        if index + 1 == cfg.num_hidden_layers {
            // Nothing downstream reads the last layer's understanding output.
            return Ok(());
        }
        let o = rotated_causal_gqa(
            [&q, &k, &v],
            (&st.cos, &st.sin),
            cfg.groups_per_kv(),
            cfg.head_dim,
        )?;
        st.x = self.out_and_mlp(
            w,
            &st.x,
            &o,
            ["self_attn.to_out", "post_attention_layernorm.weight", "mlp"],
            None,
        )?;
        Ok(())
    }

    /// Starts the generation pathway for latents [1, C, T, H, W] at timestep `t` after
    /// `text`, for a clip at `fps` whose latent frames hold `frames_per_latent` frames, on
    /// `split`'s share of the vision tokens.
    pub fn generate(
        &self,
        latents: &Tensor,
        t: f32,
        text: &mut Understanding,
        fps: f64,
        frames_per_latent: usize,
        split: &Split,
    ) -> Result<Generation> {
        let cfg = &self.cfg;
        let (b, c, lt, lh, lw) = latents.dims5()?;
        if b != 1 || c != cfg.latent_channel || lt * lh * lw == 0 {
            return Err(Error::bug(format!(
                "latents: shape {:?}: want [1, {}, frames, rows, columns]",
                latents.dims(),
                cfg.latent_channel
            )));
        }
        let p = cfg.latent_patch_size;
        let (gh, gw) = (lh.div_ceil(p), lw.div_ceil(p));
        let x = latents.get(0)?;
        let x = if gh * p != lh || gw * p != lw {
            // Padded with zeros to whole patches, as the pipeline pads.
            x.pad_with_zeros(2, 0, gh * p - lh)?
                .pad_with_zeros(3, 0, gw * p - lw)?
        } else {
            x
        };
        // [C, T, gh, p, gw, p] to tokens (t, row, column) of (p, p, C) features.
        let x = x
            .reshape(vec![c, lt, gh, p, gw, p])?
            .permute([1, 2, 4, 3, 5, 0])?
            .reshape((lt * gh * gw, p * p * c))?;
        let tokens = lt * gh * gw;
        let share = split.share(tokens);
        let x = x.narrow(0, share.start, share.len())?;
        let whole = (share.len() < tokens).then_some(tokens);
        let r = self.resident.as_ref();
        let x = fused::linear_share(
            &x,
            &r.get("proj_in.weight")?,
            Some(&r.get("proj_in.bias")?),
            whole,
        )?;
        let scaled = t * cfg.timestep_scale as f32;
        let proj = timestep_embedding(&[scaled], 256, x.device())?;
        let layer = |name: &str, x: &Tensor| {
            let w = r.get(&format!("time_embedder.{name}.weight"))?;
            fused::linear(x, &w, Some(&r.get(&format!("time_embedder.{name}.bias"))?))
        };
        let temb = layer("linear_2", &layer("linear_1", &proj)?.silu()?)?;
        let x = x.broadcast_add(&temb)?;
        let key = ((lt, gh, gw), fps.to_bits(), frames_per_latent);
        let (cos, sin) = match &text.vision {
            Some((k, cos, sin)) if *k == key => (cos.clone(), sin.clone()),
            _ => {
                let pos = vision_positions(cfg, text.len(), (lt, gh, gw), fps, frames_per_latent);
                let (cos, sin) = rotary(cfg, &pos, x.device())?;
                text.vision = Some((key, cos.clone(), sin.clone()));
                (cos, sin)
            }
        };
        let (cos, sin) = (
            cos.narrow(0, share.start, share.len())?,
            sin.narrow(0, share.start, share.len())?,
        );
        Ok(Generation {
            x,
            tokens,
            whole,
            cos,
            sin,
            latent: (lt, lh, lw),
            normed: false,
        })
    }

    /// Layer `index`'s generation pathway over `text`'s keys and values. On a rank of a
    /// sequence-parallel group the projections, norms and rotary run on its tokens; an
    /// all-to-all gives it every token of its share of the key/value heads (with their
    /// query heads), which attend to the text's keys and values of those heads, and
    /// another gives the tokens back.
    pub fn generation_block(
        &self,
        index: usize,
        w: &dyn Weights,
        text: &Understanding,
        st: &mut Generation,
        split: &mut Split,
    ) -> Result<()> {
        let cfg = &self.cfg;
        let eps = cfg.rms_norm_eps;
        let (tk, tv) = text.kv.get(index).ok_or_else(|| {
            Error::bug(format!(
                "step: layer {index} before the understanding pathway reached it"
            ))
        })?;
        let x = rms_norm(&st.x, &w.get("input_layernorm_moe_gen.weight")?, eps)?;
        let whole = st.whole;
        let q = self.heads(
            &self.linear_share(w, "self_attn.add_q_proj", &x, whole)?,
            cfg.num_attention_heads,
        )?;
        let k = self.heads(
            &self.linear_share(w, "self_attn.add_k_proj", &x, whole)?,
            cfg.num_key_value_heads,
        )?;
        let v = self.heads(
            &self.linear_share(w, "self_attn.add_v_proj", &x, whole)?,
            cfg.num_key_value_heads,
        )?;
        let q = rotate(&self.head_norm(w, "norm_added_q", q)?, &st.cos, &st.sin)?;
        let k = rotate(&self.head_norm(w, "norm_added_k", k)?, &st.cos, &st.sin)?;
        let g = cfg.groups_per_kv();
        let scale = 1.0 / (cfg.head_dim as f64).sqrt();
        let o = if split.size() > 1 {
            let n = st.tokens;
            let (q, k, v) = (
                split.to_heads(&q, n, g)?,
                split.to_heads(&k, n, 1)?,
                split.to_heads(&v, n, 1)?,
            );
            let kv = split.share(cfg.num_key_value_heads);
            let (tk, tv) = (
                tk.narrow(1, kv.start, kv.len())?,
                tv.narrow(1, kv.start, kv.len())?,
            );
            let keys = repeat_kv(&Tensor::cat(&[&tk, &k], 2)?, g)?;
            let values = repeat_kv(&Tensor::cat(&[&tv, &v], 2)?, g)?;
            split.to_tokens(
                &attention(&q, &keys, &values, scale)?,
                cfg.num_attention_heads,
                g,
            )?
        } else {
            let keys = repeat_kv(&Tensor::cat(&[tk, &k], 2)?, g)?;
            let values = repeat_kv(&Tensor::cat(&[tv, &v], 2)?, g)?;
            attention(&q, &keys, &values, scale)?
        };
        st.x = self.out_and_mlp(
            w,
            &st.x,
            &o,
            [
                "self_attn.to_add_out",
                "post_attention_layernorm_moe_gen.weight",
                "mlp_moe_gen",
            ],
            whole,
        )?;
        Ok(())
    }

    /// The generation pathway's final norm (`norm_moe_gen`), where diffusers' SeaCache
    /// ends the residual it caches.
    pub fn final_norm(&self, st: &mut Generation) -> Result<()> {
        if !st.normed {
            let w = self.resident.get("norm_moe_gen.weight")?;
            st.x = rms_norm(&st.x, &w, self.cfg.rms_norm_eps)?;
            st.normed = true;
        }
        Ok(())
    }

    /// The velocity [1, C, T, H, W] from the generation pathway's last layer (every
    /// rank's tokens gathered first on a sequence-parallel group).
    pub fn velocity(&self, mut st: Generation, split: &mut Split) -> Result<Tensor> {
        let cfg = &self.cfg;
        let r = self.resident.as_ref();
        self.final_norm(&mut st)?;
        let x = st.x.clone();
        let x = fused::linear_share(
            &x,
            &r.get("proj_out.weight")?,
            Some(&r.get("proj_out.bias")?),
            st.whole,
        )?;
        let x = split.gather(&x, 0, st.tokens)?;
        let (lt, lh, lw) = st.latent;
        let (p, c) = (cfg.latent_patch_size, cfg.latent_channel);
        let (gh, gw) = (lh.div_ceil(p), lw.div_ceil(p));
        let x = x
            .reshape(vec![lt, gh, gw, p, p, c])?
            .permute([5, 0, 1, 3, 2, 4])?
            .reshape((c, lt, gh * p, gw * p))?
            .narrow(2, 0, lh)?
            .narrow(3, 0, lw)?
            .contiguous()?;
        Ok(x.unsqueeze(0)?.to_dtype(DType::F32)?)
    }
}
