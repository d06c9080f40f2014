//! The layers of diffusers' `WanDecoder3d`, op for op: `WanCausalConv3d` (as sums of 2D
//! convolutions over its temporal taps), `WanRMS_norm`, `WanResidualBlock`,
//! `WanAttentionBlock` and `WanResample`'s upsamplers, with the feature cache that lets the
//! decoder run one latent frame at a time.
//!
//! Activations are laid out [frames, channels, height, width] (one chunk's frames as the
//! batch), which is diffusers' [1, C, T, H, W] with the batch of one dropped and time moved
//! first, so 2D convolutions and per-frame attention apply directly.

use candle_core::{DType, Tensor};

use super::budget::ATTENTION_QUERY_BLOCK;
use crate::Result;

/// diffusers' `CACHE_T`: frames of its input a causal conv keeps for the next chunk.
pub const CACHE_T: usize = 2;
/// `F.normalize`'s floor on the norm.
const NORMALIZE_EPS: f64 = 1e-12;
/// Largest im2col buffer (elements) one 2D convolution may build; taller inputs are split
/// into bands of rows, so memory stays bounded at any frame size.
pub const IM2COL_BUDGET: usize = 1 << 25;

/// What one causal conv remembers between chunks (diffusers' `feat_cache[idx]`).
#[derive(Debug, Clone, Default)]
pub enum Slot {
    /// Nothing decoded yet (`None`).
    #[default]
    Empty,
    /// An `upsample3d` time conv after the first chunk, which it skips (`"Rep"`).
    Rep,
    /// The last (up to `CACHE_T`) input frames.
    Frames(Tensor),
}

/// The caches of every causal conv in the decoder, one slot each.
pub struct FeatCache {
    pub slots: Vec<Slot>,
}

/// A 2D convolution with bias, stride 1, "same" padding.
pub struct Conv2d {
    weight: Tensor,
    /// [1, C_out, 1, 1].
    bias: Tensor,
    padding: usize,
}

impl Conv2d {
    pub fn new(weight: Tensor, bias: Tensor) -> Result<Self> {
        let (cout, _, kh, _) = weight.dims4()?;
        Ok(Conv2d {
            bias: bias.reshape((1, cout, 1, 1))?,
            padding: kh / 2,
            weight,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(conv2d_bounded(x, &self.weight, self.padding)?.broadcast_add(&self.bias)?)
    }
}

/// `x.conv2d(w, padding)` (no bias) computed in bands of output rows when the whole
/// frame's im2col buffer would exceed `IM2COL_BUDGET`, on devices whose convolution builds
/// one (CUDA's); the CPU's builds a few hundred pixels' worth per thread at a time, so
/// bands would only add their concatenation.
fn conv2d_bounded(x: &Tensor, w: &Tensor, padding: usize) -> Result<Tensor> {
    if x.device().is_cpu() {
        return Ok(x.conv2d(w, padding, 1, 1, 1)?);
    }
    conv2d_banded(x, w, padding, IM2COL_BUDGET)
}

fn conv2d_banded(x: &Tensor, w: &Tensor, padding: usize, budget: usize) -> Result<Tensor> {
    let (n, cin, h, width) = x.dims4()?;
    let (_, _, kh, kw) = w.dims4()?;
    let per_row = n * (width + 2 * padding) * cin * kh * kw;
    if kh == 1 && kw == 1 || per_row * h <= budget {
        return Ok(x.conv2d(w, padding, 1, 1, 1)?);
    }
    let rows = (budget / per_row.max(1)).max(1);
    let x = x
        .pad_with_zeros(2, padding, padding)?
        .pad_with_zeros(3, padding, padding)?;
    let out_h = h + 2 * padding + 1 - kh;
    let mut bands = Vec::with_capacity(out_h.div_ceil(rows));
    let mut r = 0;
    while r < out_h {
        let len = rows.min(out_h - r);
        bands.push(x.narrow(2, r, len + kh - 1)?.conv2d(w, 0, 1, 1, 1)?);
        r += len;
    }
    Ok(Tensor::cat(&bands, 2)?)
}

/// `WanCausalConv3d`: a 3D convolution padded in time only on the past side (by twice the
/// temporal padding), whose past is the cached frames of the previous chunk, zeros before
/// the first.
pub struct CausalConv3d {
    /// One [C_out, C_in, kh, kw] kernel per temporal tap, oldest frame first.
    taps: Vec<Tensor>,
    bias: Tensor,
    padding: usize,
    /// Index into `FeatCache::slots`; `None` for a single-tap conv, which keeps no past.
    slot: Option<usize>,
}

impl CausalConv3d {
    /// `weight` [C_out, C_in, kt, kh, kw] with kt 1 or 3; a conv with kt 3 takes cache slot
    /// `*next_slot` (then incremented).
    pub fn new(weight: &Tensor, bias: Tensor, next_slot: &mut usize) -> Result<Self> {
        let (cout, _, kt, kh, _) = weight.dims5()?;
        let taps = (0..kt)
            .map(|k| Ok(weight.narrow(2, k, 1)?.squeeze(2)?.contiguous()?))
            .collect::<Result<Vec<_>>>()?;
        let slot = (kt > 1).then(|| {
            *next_slot += 1;
            *next_slot - 1
        });
        Ok(CausalConv3d {
            taps,
            bias: bias.reshape((1, cout, 1, 1))?,
            padding: kh / 2,
            slot,
        })
    }

    /// The convolution of `x` [T, C, H, W] preceded by `past` (at most kt - 1 frames; zero
    /// frames make up the rest), giving T frames.
    pub fn forward(&self, x: &Tensor, past: Option<&Tensor>) -> Result<Tensor> {
        let kt = self.taps.len();
        let (t, c, h, w) = x.dims4()?;
        let past_len = past.map_or(Ok(0), |p| p.dim(0))?;
        let mut parts = Vec::with_capacity(3);
        let zeros = (kt - 1).saturating_sub(past_len);
        if zeros > 0 {
            parts.push(Tensor::zeros((zeros, c, h, w), x.dtype(), x.device())?);
        }
        if let Some(p) = past {
            parts.push(p.clone());
        }
        parts.push(x.clone());
        let seq = if parts.len() == 1 {
            x.clone()
        } else {
            Tensor::cat(&parts, 0)?
        };
        // The zero frames are in `seq` now: free them before the taps run.
        drop(parts);
        let mut out: Option<Tensor> = None;
        for (k, tap) in self.taps.iter().enumerate() {
            let y = conv2d_bounded(&seq.narrow(0, k, t)?, tap, self.padding)?;
            out = Some(match out {
                Some(acc) => (acc + y)?,
                None => y,
            });
        }
        let out = out.expect("a conv has at least one tap");
        Ok(out.broadcast_add(&self.bias)?)
    }

    /// `forward` with this conv's cache: the past is what the previous chunk left, and the
    /// cache becomes the last `CACHE_T` frames of (past, x), as diffusers keeps them.
    pub fn forward_cached(&self, x: &Tensor, cache: &mut FeatCache) -> Result<Tensor> {
        let Some(slot) = self.slot else {
            return self.forward(x, None);
        };
        let past = match &cache.slots[slot] {
            Slot::Frames(p) => Some(p.clone()),
            _ => None,
        };
        let next = tail(past.as_ref(), x)?;
        let out = self.forward(x, past.as_ref())?;
        cache.slots[slot] = Slot::Frames(next);
        Ok(out)
    }

    fn slot(&self) -> Option<usize> {
        self.slot
    }

    /// Where the weights live.
    pub fn device(&self) -> &candle_core::Device {
        self.bias.device()
    }
}

/// diffusers' `cache_x`: the last `CACHE_T` frames of `x`, preceded by the previous cache's
/// last frame when `x` alone is shorter. Copied, so the chunk's activations can be freed.
fn tail(past: Option<&Tensor>, x: &Tensor) -> Result<Tensor> {
    let t = x.dim(0)?;
    let own = x.narrow(0, t.saturating_sub(CACHE_T), t.min(CACHE_T))?;
    let frames = match past {
        Some(p) if own.dim(0)? < CACHE_T => {
            let n = p.dim(0)?;
            Tensor::cat(&[p.narrow(0, n - 1, 1)?, own], 0)?
        }
        _ => own,
    };
    Ok(frames.force_contiguous()?)
}

/// `WanRMS_norm`: `F.normalize` over channels (x / max(‖x‖₂, 1e-12)), times √C, times a
/// learned per-channel gain; no bias.
pub struct RmsNorm {
    /// [1, C, 1, 1].
    gamma: Tensor,
    scale: f64,
}

impl RmsNorm {
    pub fn new(gamma: Tensor) -> Result<Self> {
        let c = gamma.dim(0)?;
        Ok(RmsNorm {
            gamma: gamma.reshape((1, c, 1, 1))?,
            scale: (c as f64).sqrt(),
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let norm = x.sqr()?.sum_keepdim(1)?.sqrt()?.maximum(NORMALIZE_EPS)?;
        let normalized = x.broadcast_div(&norm)?;
        Ok((normalized * self.scale)?.broadcast_mul(&self.gamma)?)
    }
}

/// `WanResidualBlock` (dropout is the identity in eval): RMS norm, SiLU, causal conv, twice,
/// plus the input through a 1×1×1 conv where the width changes.
pub struct ResidualBlock {
    pub norm1: RmsNorm,
    pub conv1: CausalConv3d,
    pub norm2: RmsNorm,
    pub conv2: CausalConv3d,
    pub shortcut: Option<CausalConv3d>,
}

impl ResidualBlock {
    pub fn forward(&self, x: &Tensor, cache: &mut FeatCache) -> Result<Tensor> {
        let skip = match &self.shortcut {
            Some(conv) => conv.forward(x, None)?,
            None => x.clone(),
        };
        // Each step replaces `h`, so only one intermediate is alive beside the next.
        let mut h = self.norm1.forward(x)?.silu()?;
        h = self.conv1.forward_cached(&h, cache)?;
        h = self.norm2.forward(&h)?.silu()?;
        h = self.conv2.forward_cached(&h, cache)?;
        Ok((h + skip)?)
    }
}

/// `WanAttentionBlock`: per-frame single-head self-attention over the pixels, with an RMS
/// norm in front, a fused 1×1 qkv projection, a 1×1 output projection and the residual.
pub struct AttentionBlock {
    pub norm: RmsNorm,
    /// [C, 3C] and [1, 3C]: the 1×1 conv as a matmul on pixel tokens.
    pub qkv_t: Tensor,
    pub qkv_bias: Tensor,
    pub proj: Conv2d,
}

impl AttentionBlock {
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (t, c, h, w) = x.dims4()?;
        let hw = h * w;
        let tokens = self
            .norm
            .forward(x)?
            .reshape((t, c, hw))?
            .transpose(1, 2)?
            .contiguous()?;
        let qkv = tokens
            .broadcast_matmul(&self.qkv_t)?
            .broadcast_add(&self.qkv_bias)?;
        let q = qkv.narrow(2, 0, c)?.contiguous()?;
        let k_t = qkv.narrow(2, c, c)?.transpose(1, 2)?.contiguous()?;
        let v = qkv.narrow(2, 2 * c, c)?.contiguous()?;
        let out = attend(&q, &k_t, &v, 1.0 / (c as f64).sqrt(), ATTENTION_QUERY_BLOCK)?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((t, c, h, w))?;
        Ok((self.proj.forward(&out)? + x)?)
    }
}

/// softmax(q kᵀ · scale) v for q [T, N, C], k_t [T, C, N], v [T, N, C], `block` query rows
/// at a time (softmax is per row, so the blocks are exact).
fn attend(q: &Tensor, k_t: &Tensor, v: &Tensor, scale: f64, block: usize) -> Result<Tensor> {
    let n = q.dim(1)?;
    let mut outs = Vec::with_capacity(n.div_ceil(block));
    let mut start = 0;
    while start < n {
        let len = block.min(n - start);
        let scores = (q.narrow(1, start, len)?.matmul(k_t)? * scale)?;
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        outs.push(probs.matmul(v)?);
        start += len;
    }
    Ok(Tensor::cat(&outs, 1)?)
}

/// `WanResample` in `upsample2d` / `upsample3d` mode: for 3D, a causal time conv to twice the
/// channels whose halves become two frames (skipped on the first chunk, so the first latent
/// frame decodes to one frame); then nearest-exact 2× in space and a 3×3 conv.
pub struct Resample {
    pub time_conv: Option<CausalConv3d>,
    pub conv: Conv2d,
}

impl Resample {
    pub fn forward(&self, x: Tensor, cache: &mut FeatCache) -> Result<Tensor> {
        let mut x = x;
        if let Some(time_conv) = &self.time_conv {
            x = self.upsample_time(time_conv, &x, cache)?;
        }
        let (_, _, h, w) = x.dims4()?;
        // At an exact 2× scale nearest-exact and nearest pick the same source pixels.
        let up = x.upsample_nearest2d(2 * h, 2 * w)?;
        drop(x);
        self.conv.forward(&up)
    }

    fn upsample_time(
        &self,
        time_conv: &CausalConv3d,
        x: &Tensor,
        cache: &mut FeatCache,
    ) -> Result<Tensor> {
        let slot = time_conv.slot().expect("a time conv has three taps");
        let (past, rep) = match &cache.slots[slot] {
            Slot::Empty => {
                cache.slots[slot] = Slot::Rep;
                return Ok(x.clone());
            }
            Slot::Rep => (None, true),
            Slot::Frames(p) => (Some(p.clone()), false),
        };
        let (t, c, h, w) = x.dims4()?;
        let mut next = tail(past.as_ref(), x)?;
        if rep && next.dim(0)? < CACHE_T {
            // After the skipped first chunk diffusers remembers a zero frame, not that chunk.
            let zeros = Tensor::zeros((1, c, h, w), x.dtype(), x.device())?;
            next = Tensor::cat(&[zeros, next], 0)?;
        }
        let y = time_conv.forward(x, past.as_ref())?;
        cache.slots[slot] = Slot::Frames(next);
        // [T, 2C] → frames (t, 0), (t, 1), ...: channel half j becomes frame 2t + j.
        Ok(y.reshape((t, 2, c, h, w))?.reshape((2 * t, c, h, w))?)
    }
}

/// `DupUp3D`, Wan 2.2's weightless shortcut around a residual up block: each input channel
/// repeated `repeats` times, the copies read as `out` channels of `factor_t` frames × 2×2
/// pixels (copy k of the repeated channels is channel k / repeats of the input). On the
/// first chunk the leading `factor_t - 1` frames are dropped, matching the resampler, which
/// skips its time conv there and so makes one frame of one.
pub struct DupUp {
    pub out: usize,
    pub factor_t: usize,
}

impl DupUp {
    /// `x` [T, C_in, H, W] to [factor_t T (less the dropped frames), out, 2H, 2W].
    pub fn forward(&self, x: &Tensor, first_chunk: bool) -> Result<Tensor> {
        let (t, cin, h, w) = x.dims4()?;
        let ft = self.factor_t;
        let repeats = self.out * ft * 4 / cin;
        let y = x
            .unsqueeze(2)?
            .broadcast_as((t, cin, repeats, h, w))?
            // [T, out, frame, row offset, column offset, H, W] ...
            .reshape(vec![t, self.out, ft, 2, 2, h, w])?
            // ... to [T, frame, out, H, row offset, W, column offset].
            .permute(vec![0, 2, 1, 5, 3, 6, 4])?
            .reshape((t * ft, self.out, 2 * h, 2 * w))?;
        if first_chunk && ft > 1 {
            return Ok(y.narrow(0, ft - 1, t * ft - (ft - 1))?);
        }
        Ok(y)
    }
}

/// diffusers' `unpatchify`: [T, C p², H, W] to [T, C, p H, p W], where channel c p² + j p + i
/// holds the pixel at row offset i and column offset j of each p × p patch.
pub fn unpatchify(x: &Tensor, p: usize) -> Result<Tensor> {
    if p == 1 {
        return Ok(x.clone());
    }
    let (t, cpp, h, w) = x.dims4()?;
    let c = cpp / (p * p);
    Ok(x.reshape(vec![t, c, p, p, h, w])?
        // [T, C, column offset, row offset, H, W] to [T, C, H, row offset, W, column offset].
        .permute(vec![0, 1, 4, 3, 5, 2])?
        .reshape((t, c, p * h, p * w))?)
}

/// A 1×1 conv weight [C_out, C_in, 1, 1] as the [C_in, C_out] matrix tokens multiply by.
pub fn pointwise_matrix(weight: &Tensor) -> Result<Tensor> {
    let (cout, cin, _, _) = weight.dims4()?;
    Ok(weight.reshape((cout, cin))?.t()?.contiguous()?)
}

/// Values outside [-1, 1] clamped, as `AutoencoderKLWan._decode` does. Takes the frames
/// by value so that each of the two steps frees its input: two copies live, not three.
pub fn clamp_unit(x: Tensor) -> Result<Tensor> {
    let x = x.maximum(-1f32)?;
    Ok(x.minimum(1f32)?)
}

/// The tensor as f32 (weights arrive as f32 already; latents may not).
pub fn to_f32(x: &Tensor) -> Result<Tensor> {
    Ok(x.to_dtype(DType::F32)?)
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, IndexOp};

    use super::*;
    use crate::execution::weights::seeded_noise;
    use crate::testing::max_abs_diff;

    #[test]
    fn banded_convolution_equals_the_whole_one() {
        let x = seeded_noise(1, &[2, 3, 11, 7]).unwrap();
        let w = seeded_noise(2, &[4, 3, 3, 3]).unwrap();
        let whole = x.conv2d(&w, 1, 1, 1, 1).unwrap();
        // A budget of three rows' worth: bands of 3, 3, 3 and 2 rows.
        let per_row = 2 * 9 * 3 * 9;
        let banded = conv2d_banded(&x, &w, 1, 3 * per_row).unwrap();
        assert_eq!(banded.dims(), whole.dims());
        assert!(max_abs_diff(&banded, &whole) < 1e-5);
        let one_row = conv2d_banded(&x, &w, 1, 1).unwrap();
        assert!(max_abs_diff(&one_row, &whole) < 1e-5);
    }

    #[test]
    fn blocked_attention_equals_the_whole_one() {
        let q = seeded_noise(3, &[2, 10, 4]).unwrap();
        let k_t = seeded_noise(4, &[2, 4, 10]).unwrap();
        let v = seeded_noise(5, &[2, 10, 4]).unwrap();
        let whole = attend(&q, &k_t, &v, 0.5, 10).unwrap();
        let blocked = attend(&q, &k_t, &v, 0.5, 3).unwrap();
        assert!(max_abs_diff(&blocked, &whole) < 1e-6);
    }

    #[test]
    fn causal_conv_over_chunks_equals_one_pass_over_the_clip() {
        let w = seeded_noise(6, &[2, 3, 3, 3, 3]).unwrap();
        let b = seeded_noise(7, &[2]).unwrap();
        let mut slots = 0;
        let conv = CausalConv3d::new(&w, b, &mut slots).unwrap();
        assert_eq!(slots, 1);
        let clip = seeded_noise(8, &[6, 3, 5, 4]).unwrap();
        let whole = conv.forward(&clip, None).unwrap();
        let mut cache = FeatCache {
            slots: vec![Slot::Empty],
        };
        let mut parts = Vec::new();
        for (start, len) in [(0, 1), (1, 1), (2, 3), (5, 1)] {
            let chunk = clip.narrow(0, start, len).unwrap();
            parts.push(conv.forward_cached(&chunk, &mut cache).unwrap());
        }
        let chunked = Tensor::cat(&parts, 0).unwrap();
        assert!(max_abs_diff(&chunked, &whole) < 1e-5);
        match &cache.slots[0] {
            Slot::Frames(f) => assert_eq!(f.dims(), &[2, 3, 5, 4]),
            other => panic!("cache {other:?}"),
        }
    }

    /// [T, C, H, W] filled with t·10⁴ + c·100 + h·10 + w, so every value says where it is.
    fn positions(dims: [usize; 4]) -> Tensor {
        let [t, c, h, w] = dims;
        let values: Vec<f32> = (0..t * c * h * w)
            .map(|i| {
                let (wi, hi, ci, ti) = (i % w, i / w % h, i / (w * h) % c, i / (w * h * c));
                (ti * 10_000 + ci * 100 + hi * 10 + wi) as f32
            })
            .collect();
        Tensor::from_vec(values, (t, c, h, w), &Device::Cpu).unwrap()
    }

    fn at(x: &Tensor, i: [usize; 4]) -> f32 {
        x.i((i[0], i[1], i[2], i[3])).unwrap().to_scalar().unwrap()
    }

    #[test]
    fn unpatchify_puts_channel_c_p2_plus_j_p_plus_i_at_row_i_column_j() {
        let x = positions([2, 12, 2, 3]);
        let y = unpatchify(&x, 2).unwrap();
        assert_eq!(y.dims(), &[2, 3, 4, 6]);
        for (t, c, h, w, i, j) in [(0, 0, 0, 0, 0, 0), (1, 2, 1, 2, 1, 0), (0, 1, 0, 1, 0, 1)] {
            let channel = c * 4 + j * 2 + i;
            assert_eq!(
                at(&y, [t, c, 2 * h + i, 2 * w + j]),
                at(&x, [t, channel, h, w]),
                "t {t} c {c} h {h} w {w} row offset {i} column offset {j}"
            );
        }
        assert_eq!(max_abs_diff(&unpatchify(&x, 1).unwrap(), &x), 0.0);
    }

    #[test]
    fn dup_up_spreads_each_channel_over_frames_and_pixels() {
        // 16 channels to 2 of 2 frames × 2×2 pixels: one copy each, so output (frame a, row
        // offset b, column offset c) of channel o is input channel ((2o + a) 2 + b) 2 + c.
        let x = positions([3, 16, 2, 2]);
        let up = DupUp {
            out: 2,
            factor_t: 2,
        };
        let y = up.forward(&x, false).unwrap();
        assert_eq!(y.dims(), &[6, 2, 4, 4]);
        for (t, o, h, w, a, b, c) in [
            (0, 0, 0, 0, 0, 0, 0),
            (2, 1, 1, 1, 1, 1, 1),
            (1, 0, 1, 0, 1, 0, 1),
            (0, 1, 0, 1, 0, 1, 0),
        ] {
            let k = ((2 * o + a) * 2 + b) * 2 + c;
            assert_eq!(
                at(&y, [2 * t + a, o, 2 * h + b, 2 * w + c]),
                at(&x, [t, k, h, w]),
                "t {t} o {o} h {h} w {w} a {a} b {b} c {c}"
            );
        }
        // The first chunk keeps the second of each pair of frames.
        let first = up.forward(&x.narrow(0, 0, 1).unwrap(), true).unwrap();
        assert_eq!(first.dims(), &[1, 2, 4, 4]);
        assert_eq!(max_abs_diff(&first, &y.narrow(0, 1, 1).unwrap()), 0.0);
        // 2 channels to 4 in space only: 8 copies each, so channels 0, 1 repeat input
        // channel 0 and 2, 3 input channel 1; without time upsampling nothing is dropped.
        let x = positions([3, 2, 2, 2]);
        let y = DupUp {
            out: 4,
            factor_t: 1,
        }
        .forward(&x, true)
        .unwrap();
        assert_eq!(y.dims(), &[3, 4, 4, 4]);
        assert_eq!(at(&y, [2, 1, 3, 2]), at(&x, [2, 0, 1, 1]));
        assert_eq!(at(&y, [1, 2, 0, 3]), at(&x, [1, 1, 0, 1]));
    }

    #[test]
    fn rms_norm_of_zero_is_zero_and_scales_by_root_channels() {
        let norm =
            RmsNorm::new(Tensor::ones((4, 1, 1, 1), DType::F32, &Device::Cpu).unwrap()).unwrap();
        let zero = Tensor::zeros((1, 4, 2, 2), DType::F32, &Device::Cpu).unwrap();
        assert_eq!(max_abs_diff(&norm.forward(&zero).unwrap(), &zero), 0.0);
        // A unit vector along the channels comes out at length √4 = 2.
        let x = Tensor::new(&[3f32, 0., 4., 0.], &Device::Cpu)
            .unwrap()
            .reshape((1, 4, 1, 1))
            .unwrap();
        let y = norm.forward(&x).unwrap().flatten_all().unwrap();
        let y: Vec<f32> = y.to_vec1().unwrap();
        assert!(
            (y[0] - 1.2).abs() < 1e-6 && (y[2] - 1.6).abs() < 1e-6,
            "{y:?}"
        );
    }
}
