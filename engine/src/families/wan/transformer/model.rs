//! Wan's transformer forward pass, split the way the pipeline streams it: a prologue
//! (patch embedding, rotary tables, timestep and text embedders) and an epilogue (output
//! modulation, projection, unpatchify) on resident weights, and one function per block
//! that takes the block's weights from wherever they are. Follows diffusers 0.42.1's
//! `WanTransformer3DModel.forward` operation for operation, in f32 throughout (diffusers
//! keeps the norms, the modulation tables and the time embedder in f32 beside bf16
//! weights; here every weight arrives as f32).

use candle_core::{Tensor, D};

use super::config::WanTransformerConfig;
use super::rope;
use crate::components::attention::attention;
use crate::components::fused;
use crate::components::layers::timestep_embedding;
use crate::execution::seq::Split;
use crate::execution::weights::Weights;
use crate::{Error, Result};

fn linear(w: &dyn Weights, name: &str, x: &Tensor) -> Result<Tensor> {
    linear_share(w, name, x, None)
}

/// [`linear`] of a rank's share of the tokens, of `whole` rows in all
/// ([`fused::linear_share`]).
fn linear_share(w: &dyn Weights, name: &str, x: &Tensor, whole: Option<usize>) -> Result<Tensor> {
    let weight = w.get(&format!("{name}.weight"))?;
    let bias = w.get(&format!("{name}.bias"))?;
    fused::linear_share(x, &weight, Some(&bias), whole)
}

/// LayerNorm over the last dimension without affine parameters (biased variance), as
/// diffusers' `FP32LayerNorm(elementwise_affine=False)`.
fn layer_norm(x: &Tensor, eps: f64) -> Result<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    Ok(xc.broadcast_div(&(var + eps)?.sqrt()?)?)
}

/// RMSNorm over the last dimension (all heads together) with a learned scale.
fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    Ok(x.broadcast_div(&(ms + eps)?.sqrt()?)?
        .broadcast_mul(weight)?)
}

/// `x * (1 + scale) + shift` with `scale`, `shift` of shape [B, 1, D].
fn modulate(x: &Tensor, shift: &Tensor, scale: &Tensor) -> Result<Tensor> {
    Ok(x.broadcast_mul(&(scale + 1.0)?)?.broadcast_add(shift)?)
}

/// `modulate(layer_norm(x))`: one fused pass for f32 on the CPU, else the composed ops.
fn norm_modulate(x: &Tensor, shift: &Tensor, scale: &Tensor, eps: f64) -> Result<Tensor> {
    if fused::fast(&[x, shift, scale]) {
        return fused::layer_norm_modulate(x, &shift.squeeze(1)?, &scale.squeeze(1)?, eps);
    }
    modulate(&layer_norm(x, eps)?, shift, scale)
}

/// `x + y * gate` with `gate` of shape [B, 1, D].
fn gated(x: &Tensor, y: &Tensor, gate: &Tensor) -> Result<Tensor> {
    fused::gated_residual(x, y, &gate.squeeze(1)?)
}

/// Which attention a block runs.
enum Attend<'a> {
    /// Over the latent tokens, with their rotary tables; split across `split`'s group,
    /// whose whole sequence has `tokens` tokens.
    SelfAttention {
        cos: &'a Tensor,
        sin: &'a Tensor,
        split: &'a mut Split,
        tokens: usize,
    },
    /// To the projected text.
    Cross(&'a Tensor),
}

/// One request's activations while its blocks run: on a rank of a sequence-parallel
/// group, its share of the tokens ([`Split`]).
pub struct WanState {
    /// Hidden states [B, tokens, D] (this rank's share of the tokens).
    pub x: Tensor,
    /// Tokens of the whole sequence.
    tokens: usize,
    /// Rows (samples × tokens) of the whole sequence when `x` holds a share of it: the
    /// token-wise products take the whole's path ([`fused::linear_share`]).
    whole: Option<usize>,
    /// Projected text [B, text tokens, D], the cross-attention's keys and values.
    text: Tensor,
    /// Timestep embedding [B, D] (the output modulation's input).
    temb: Tensor,
    /// The blocks' modulation from the timestep, [B, 6, D].
    time_proj: Tensor,
    /// Rotary tables [tokens, head_dim / 2] of this rank's tokens.
    cos: Tensor,
    sin: Tensor,
    /// The patch grid (frames, rows, columns).
    pub grid: (usize, usize, usize),
}

/// The transformer's shape and its resident (non-streamed) weights.
pub struct WanTransformer {
    pub cfg: WanTransformerConfig,
    resident: Box<dyn Weights + Send + Sync>,
}

impl WanTransformer {
    pub fn new(cfg: WanTransformerConfig, resident: Box<dyn Weights + Send + Sync>) -> Self {
        WanTransformer { cfg, resident }
    }

    /// Embeds latents [B, C, F, H, W] (B = 2 under guidance: conditional, then
    /// unconditional) at timestep `t` with text embeddings [B, S, text_dim]: the tokens of
    /// `split`'s share of the sequence.
    pub fn prologue(
        &self,
        latents: &Tensor,
        t: f32,
        text: &Tensor,
        split: &Split,
    ) -> Result<WanState> {
        let cfg = &self.cfg;
        let (b, c, f, h, w) = latents.dims5()?;
        let (pt, ph, pw) = cfg.patch();
        if c != cfg.in_channels || f % pt != 0 || h % ph != 0 || w % pw != 0 || f * h * w == 0 {
            return Err(Error::bug(format!(
                "latents: shape [{b}, {c}, {f}, {h}, {w}] does not fit this transformer: it takes \
                     {} channels and frames × height × width in whole {pt} × {ph} × {pw} patches",
                cfg.in_channels
            )));
        }
        let (tb, tl, td) = text.dims3()?;
        if tb != b || td != cfg.text_dim || tl == 0 {
            return Err(Error::bug(format!("text embeddings: shape [{tb}, {tl}, {td}]: want [{b}, tokens ≥ 1, {}] for {b} latents",
                    cfg.text_dim
                ),
            ));
        }
        let dev = latents.device();
        let grid = (f / pt, h / ph, w / pw);
        let tokens = grid.0 * grid.1 * grid.2;
        let share = split.share(tokens);
        let (cos, sin) = rope::tables(cfg, grid, dev)?;
        let (cos, sin) = if share.len() == tokens {
            (cos, sin)
        } else {
            (
                cos.narrow(0, share.start, share.len())?,
                sin.narrow(0, share.start, share.len())?,
            )
        };

        // Conv3d with kernel = stride = patch: one matrix product over the patches,
        // each flattened in the kernel's (channel, t, y, x) order, tokens frame-major.
        let (gf, gh, gw) = grid;
        let d = cfg.hidden();
        let patch = c * pt * ph * pw;
        let x = latents
            .reshape(vec![b, c, gf, pt, gh, ph, gw, pw])?
            .permute([0, 2, 4, 6, 1, 3, 5, 7])?
            .reshape((b, gf * gh * gw, patch))?;
        let x = if share.len() == tokens {
            x
        } else {
            x.narrow(1, share.start, share.len())?
        };
        let weight = self
            .resident
            .get("patch_embedding.weight")?
            .reshape((d, patch))?;
        let bias = self.resident.get("patch_embedding.bias")?;
        let whole = (share.len() < tokens).then_some(b * tokens);
        let x = fused::linear_share(&x, &weight, Some(&bias), whole)?;

        let r = self.resident.as_ref();
        let t_proj = timestep_embedding(&vec![t; b], cfg.freq_dim, dev)?;
        let temb = linear(r, "condition_embedder.time_embedder.linear_1", &t_proj)?.silu()?;
        let temb = linear(r, "condition_embedder.time_embedder.linear_2", &temb)?;
        let time_proj =
            linear(r, "condition_embedder.time_proj", &temb.silu()?)?.reshape((b, 6, d))?;
        let text = linear(r, "condition_embedder.text_embedder.linear_1", text)?.gelu()?;
        let text = linear(r, "condition_embedder.text_embedder.linear_2", &text)?;
        Ok(WanState {
            x,
            tokens,
            whole,
            text,
            temb,
            time_proj,
            cos,
            sin,
            grid,
        })
    }

    /// Multi-head attention of `x` to `context` with the q/k RMS norms of attention
    /// `prefix`: self-attention with rotary, or cross-attention without (diffusers passes
    /// none to `attn2`). Self-attention on a rank of a sequence-parallel group runs its
    /// norms and rotary on this rank's tokens; an all-to-all gives it every token of its
    /// share of the heads to attend over, and another gives the tokens back. `whole`: the
    /// rows of the whole sequence when `x` is a share of it.
    fn attention(
        &self,
        w: &dyn Weights,
        prefix: &str,
        x: &Tensor,
        attend: Attend,
        whole: Option<usize>,
    ) -> Result<Tensor> {
        let (context, rotary, mut ulysses) = match attend {
            Attend::SelfAttention {
                cos,
                sin,
                split,
                tokens,
            } => (x, Some((cos, sin)), Some((split, tokens))),
            Attend::Cross(text) => (text, None, None),
        };
        let (b, s, d) = x.dims3()?;
        let l = context.dim(1)?;
        let (h, hd, eps) = (
            self.cfg.num_attention_heads,
            self.cfg.attention_head_dim,
            self.cfg.eps,
        );
        let norm = |t: Tensor, which: &str| -> Result<Tensor> {
            rms_norm(&t, &w.get(&format!("{prefix}.{which}.weight"))?, eps)
        };
        let heads = |t: Tensor, n: usize| -> Result<Tensor> {
            Ok(t.reshape((b, n, h, hd))?.transpose(1, 2)?.contiguous()?)
        };
        // Self-attention's context is x itself, a share when x is one.
        let ctx = if rotary.is_some() { whole } else { None };
        let q = norm(
            linear_share(w, &format!("{prefix}.to_q"), x, whole)?,
            "norm_q",
        )?;
        let k = norm(
            linear_share(w, &format!("{prefix}.to_k"), context, ctx)?,
            "norm_k",
        )?;
        let v = linear_share(w, &format!("{prefix}.to_v"), context, ctx)?;
        let (mut q, mut k, mut v) = (heads(q, s)?, heads(k, l)?, heads(v, l)?);
        if let Some((cos, sin)) = rotary {
            q = rope::apply(&q, cos, sin)?;
            k = rope::apply(&k, cos, sin)?;
        }
        let scale = 1.0 / (hd as f64).sqrt();
        let o = match ulysses.as_mut() {
            Some((split, tokens)) if split.size() > 1 => {
                let tokens = *tokens;
                q = split.to_heads(&q, tokens, 1)?;
                k = split.to_heads(&k, tokens, 1)?;
                v = split.to_heads(&v, tokens, 1)?;
                split.to_tokens(&attention(&q, &k, &v, scale)?, h, 1)?
            }
            _ => attention(&q, &k, &v, scale)?,
        };
        let o = o.transpose(1, 2)?.reshape((b, s, d))?;
        linear_share(w, &format!("{prefix}.to_out.0"), &o, whole)
    }

    /// Block `index` with its weights `w` (named relative to `blocks.{index}.`), on
    /// `split`'s share of the tokens.
    pub fn block(
        &self,
        index: usize,
        w: &dyn Weights,
        st: &mut WanState,
        split: &mut Split,
    ) -> Result<()> {
        let eps = self.cfg.eps;
        let table = w.get("scale_shift_table")?;
        let m = table.broadcast_add(&st.time_proj)?.chunk(6, 1)?;
        let [shift, scale, gate, c_shift, c_scale, c_gate] = &m[..] else {
            return Err(Error::bug(format!(
                "weights: block {index}: scale_shift_table does not split into 6 rows"
            )));
        };
        let x = &st.x;
        let n = norm_modulate(x, shift, scale, eps)?;
        let attend = Attend::SelfAttention {
            cos: &st.cos,
            sin: &st.sin,
            split,
            tokens: st.tokens,
        };
        let a = self.attention(w, "attn1", &n, attend, st.whole)?;
        let x = gated(x, &a, gate)?;

        let n = if self.cfg.cross_attn_norm {
            layer_norm(&x, eps)?
                .broadcast_mul(&w.get("norm2.weight")?)?
                .broadcast_add(&w.get("norm2.bias")?)?
        } else {
            x.clone()
        };
        let x = (&x + self.attention(w, "attn2", &n, Attend::Cross(&st.text), st.whole)?)?;

        let n = norm_modulate(&x, c_shift, c_scale, eps)?;
        let f = fused::gelu_tanh(&linear_share(w, "ffn.net.0.proj", &n, st.whole)?)?;
        let f = linear_share(w, "ffn.net.2", &f, st.whole)?;
        st.x = gated(&x, &f, c_gate)?;
        Ok(())
    }

    /// Output norm and projection, unpatchified: [B, out_channels, F, H, W]. On a rank of
    /// a sequence-parallel group, every rank's projected tokens are gathered first, so
    /// each has the whole output.
    pub fn epilogue(&self, st: WanState, split: &mut Split) -> Result<Tensor> {
        let cfg = &self.cfg;
        let table = self.resident.get("scale_shift_table")?;
        let m = table.broadcast_add(&st.temb.unsqueeze(1)?)?;
        let (shift, scale) = (m.narrow(1, 0, 1)?, m.narrow(1, 1, 1)?);
        let x = norm_modulate(&st.x, &shift, &scale, cfg.eps)?;
        let x = linear_share(self.resident.as_ref(), "proj_out", &x, st.whole)?;
        let x = split.gather(&x, 1, st.tokens)?;
        let b = x.dim(0)?;
        let (gf, gh, gw) = st.grid;
        let (pt, ph, pw) = cfg.patch();
        let c = cfg.out();
        // Each token's outputs are (t, y, x, channel), channel fastest.
        let x = x
            .reshape(vec![b, gf, gh, gw, pt, ph, pw, c])?
            .permute([0, 7, 1, 4, 2, 5, 3, 6])?;
        Ok(x.reshape((b, c, gf * pt, gh * ph, gw * pw))?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::components::layers::random_weights;

    #[test]
    fn a_forward_keeps_the_latent_shape_and_refuses_misfits() {
        let cfg = WanTransformerConfig::tiny();
        let resident = random_weights(&cfg.resident_specs(), 100);
        let model = WanTransformer::new(cfg.clone(), Box::new(resident));
        let latents = crate::execution::weights::seeded_noise(1, &[2, 16, 3, 4, 6]).unwrap();
        let text = crate::execution::weights::seeded_noise(2, &[2, 5, 32]).unwrap();
        let whole = &mut Split::whole();
        let mut st = model.prologue(&latents, 500.0, &text, whole).unwrap();
        assert_eq!(st.x.dims(), &[2, 3 * 2 * 3, 24]);
        for i in 0..cfg.num_layers {
            let w = random_weights(&cfg.block_specs(), 1000 * (i as u64 + 1));
            model.block(i, &w, &mut st, whole).unwrap();
        }
        let out = model.epilogue(st, whole).unwrap();
        assert_eq!(out.dims(), &[2, 16, 3, 4, 6]);

        let odd = crate::execution::weights::seeded_noise(3, &[2, 16, 3, 5, 6]).unwrap();
        let wide = crate::execution::weights::seeded_noise(4, &[2, 5, 31]).unwrap();
        for (latents, text, want) in [
            (&odd, &text, "latents"),
            (&latents, &wide, "text embeddings"),
        ] {
            let e = model.prologue(latents, 1.0, text, whole).err().unwrap();
            let e = e.to_string();
            assert!(e.contains(want), "{e}");
        }
    }

    #[test]
    fn a_missing_block_tensor_is_named() {
        let cfg = WanTransformerConfig::tiny();
        let model = WanTransformer::new(
            cfg.clone(),
            Box::new(random_weights(&cfg.resident_specs(), 7)),
        );
        let latents = crate::execution::weights::seeded_noise(1, &[1, 16, 1, 2, 2]).unwrap();
        let text = crate::execution::weights::seeded_noise(2, &[1, 3, 32]).unwrap();
        let whole = &mut Split::whole();
        let mut st = model.prologue(&latents, 10.0, &text, whole).unwrap();
        let mut w = random_weights(&cfg.block_specs(), 9);
        w.remove("attn2.norm_k.weight");
        let e = model.block(0, &w, &mut st, whole).unwrap_err().to_string();
        assert!(e.contains("attn2.norm_k.weight"), "{e}");
    }
}
