//! The `AutoencoderKLWan` decoder: the pipeline's normalised latents in, video frames in
//! [-1, 1] out. It follows `WanPipeline`'s denormalisation and `AutoencoderKLWan._decode`
//! (post-quant conv, then `WanDecoder3d` one latent frame at a time with the feature cache,
//! then the unpatchify and the clamp) op for op, so its output matches diffusers' to float
//! rounding (the parity tests hold it to that), for Wan 2.1's VAE and Wan 2.2's residual,
//! patchified one alike.
//!
//! Memory does not grow with the clip: each latent frame is decoded as its own chunk (one
//! frame out for the first, `temporal_upscale` after), the causal convolutions carry only
//! their last two input frames between chunks, and `decode_chunks` hands each chunk's
//! frames to the caller before the next is computed. Wan 2.2's shortcuts and the
//! unpatchify are per chunk and keep nothing.

use std::path::Path;

use candle_core::{DType, Tensor};

use super::layers::{
    clamp_unit, pointwise_matrix, to_f32, unpatchify, AttentionBlock, CausalConv3d, Conv2d, DupUp,
    FeatCache, Resample, ResidualBlock, RmsNorm, Slot,
};
use super::tiling::Grid;
use super::{Upsample, WanVaeConfig};
use crate::decode::{
    ConvScratch, DecodeCost, DecodeSetting, OutputSize, Tile, DECODE_ELEM_BYTES,
    DEFAULT_DECODE_BUDGET,
};
use crate::execution::family::Decoder;
use crate::execution::weights::Weights;
use crate::{Error, Result};

/// Fetches tensors by full name and checks their shapes; counts the cache slots handed out.
struct Loader<'a> {
    weights: &'a dyn Weights,
    origin: &'a Path,
    slots: usize,
}

impl Loader<'_> {
    fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let t = self
            .weights
            .get(name)
            .map_err(|e| Error::tensor(self.origin, name, e.to_string()))?;
        if t.dims() != shape {
            return Err(Error::tensor(
                self.origin,
                name,
                format!("expected shape {shape:?}, found {:?}", t.dims()),
            ));
        }
        Ok(t.to_dtype(DType::F32)?)
    }

    fn conv3d(
        &mut self,
        prefix: &str,
        cin: usize,
        cout: usize,
        k: [usize; 3],
    ) -> Result<CausalConv3d> {
        let weight = self.get(&format!("{prefix}.weight"), &[cout, cin, k[0], k[1], k[2]])?;
        let bias = self.get(&format!("{prefix}.bias"), &[cout])?;
        CausalConv3d::new(&weight, bias, &mut self.slots)
    }

    fn conv2d(&self, prefix: &str, cin: usize, cout: usize, k: usize) -> Result<Conv2d> {
        Conv2d::new(
            self.get(&format!("{prefix}.weight"), &[cout, cin, k, k])?,
            self.get(&format!("{prefix}.bias"), &[cout])?,
        )
    }

    fn rms(&self, prefix: &str, c: usize, images: bool) -> Result<RmsNorm> {
        let shape: &[usize] = if images { &[c, 1, 1] } else { &[c, 1, 1, 1] };
        RmsNorm::new(self.get(&format!("{prefix}.gamma"), shape)?)
    }

    fn residual(&mut self, prefix: &str, cin: usize, cout: usize) -> Result<ResidualBlock> {
        Ok(ResidualBlock {
            norm1: self.rms(&format!("{prefix}.norm1"), cin, false)?,
            conv1: self.conv3d(&format!("{prefix}.conv1"), cin, cout, [3, 3, 3])?,
            norm2: self.rms(&format!("{prefix}.norm2"), cout, false)?,
            conv2: self.conv3d(&format!("{prefix}.conv2"), cout, cout, [3, 3, 3])?,
            shortcut: if cin != cout {
                Some(self.conv3d(&format!("{prefix}.conv_shortcut"), cin, cout, [1, 1, 1])?)
            } else {
                None
            },
        })
    }

    fn attention(&self, prefix: &str, c: usize) -> Result<AttentionBlock> {
        let qkv = self.get(&format!("{prefix}.to_qkv.weight"), &[3 * c, c, 1, 1])?;
        Ok(AttentionBlock {
            norm: self.rms(&format!("{prefix}.norm"), c, true)?,
            qkv_t: pointwise_matrix(&qkv)?,
            qkv_bias: self
                .get(&format!("{prefix}.to_qkv.bias"), &[3 * c])?
                .reshape((1, 3 * c))?,
            proj: self.conv2d(&format!("{prefix}.proj"), c, c, 1)?,
        })
    }
}

/// One `WanUpBlock`, or with a shortcut a `WanResidualUpBlock`.
struct UpBlock {
    resnets: Vec<ResidualBlock>,
    resample: Option<Resample>,
    shortcut: Option<DupUp>,
}

impl UpBlock {
    /// Takes its input by value: without a shortcut nothing needs it after the first
    /// residual block, so it is freed there.
    fn forward(&self, x: Tensor, cache: &mut FeatCache, first_chunk: bool) -> Result<Tensor> {
        let (mut h, input) = match self.shortcut {
            Some(_) => (x.clone(), Some(x)),
            None => (x, None),
        };
        for resnet in &self.resnets {
            h = resnet.forward(&h, cache)?;
        }
        if let Some(resample) = &self.resample {
            h = resample.forward(h, cache)?;
        }
        match (&self.shortcut, input) {
            (Some(shortcut), Some(x)) => Ok((h + shortcut.forward(&x, first_chunk)?)?),
            _ => Ok(h),
        }
    }
}

/// The decoding half of an `AutoencoderKLWan`, resident on the device its weights are on.
pub struct WanVaeDecoder {
    z_dim: usize,
    /// Channels of the frames, after the unpatchify.
    out_channels: usize,
    patch: usize,
    upscale: usize,
    temporal_upscale: usize,
    /// [1, z, 1, 1] each: the pipeline's `latents_mean` and `1 / latents_std`.
    mean: Tensor,
    inv_std: Tensor,
    post_quant_conv: CausalConv3d,
    conv_in: CausalConv3d,
    mid_in: ResidualBlock,
    mid_attention: AttentionBlock,
    mid_out: ResidualBlock,
    up_blocks: Vec<UpBlock>,
    norm_out: RmsNorm,
    conv_out: CausalConv3d,
    /// Causal convs with a temporal kernel, each with a cache slot.
    slots: usize,
    /// What a decode holds at its peak per split ([`WanVaeConfig::decode_cost`]), and the
    /// bytes a decode may hold: each output is split by the largest setting within them.
    cost: DecodeCost,
    budget: u64,
}

impl WanVaeDecoder {
    /// Loads `post_quant_conv.*` and `decoder.*` by their full diffusers names. Errors name
    /// the tensor under the label `vae`; `load_from` names the checkpoint instead.
    pub fn load(cfg: &WanVaeConfig, w: &dyn Weights) -> Result<Self> {
        Self::load_from(cfg, w, Path::new("vae"))
    }

    /// Loads the decoder's tensors (f32) from the mapped `vae` folder onto `device`: what
    /// every family that decodes through this VAE does.
    pub fn from_mapped(
        vae: &crate::checkpoint::Mapped,
        cfg: &WanVaeConfig,
        device: &candle_core::Device,
    ) -> Result<Self> {
        let w = crate::execution::weights::load(
            vae,
            cfg.decoder_names().into_iter(),
            device,
            DType::F32,
        )?;
        Self::load(cfg, &w)
    }

    /// As `load`, with `origin` (the component folder) labelling errors.
    pub fn load_from(cfg: &WanVaeConfig, w: &dyn Weights, origin: &Path) -> Result<Self> {
        cfg.validate(&origin.join("config.json"))?;
        let layout = cfg.decoder_layout();
        let mut l = Loader {
            weights: w,
            origin,
            slots: 0,
        };
        let z = layout.z_dim;
        let post_quant_conv = l.conv3d("post_quant_conv", z, z, [1, 1, 1])?;
        let conv_in = l.conv3d("decoder.conv_in", z, layout.mid, [3, 3, 3])?;
        let mid_in = l.residual("decoder.mid_block.resnets.0", layout.mid, layout.mid)?;
        let mid_attention = l.attention("decoder.mid_block.attentions.0", layout.mid)?;
        let mid_out = l.residual("decoder.mid_block.resnets.1", layout.mid, layout.mid)?;
        let mut up_blocks = Vec::with_capacity(layout.up_blocks.len());
        for (i, block) in layout.up_blocks.iter().enumerate() {
            let prefix = format!("decoder.up_blocks.{i}");
            let resnets = block
                .resnets
                .iter()
                .enumerate()
                .map(|(j, &(cin, cout))| l.residual(&format!("{prefix}.resnets.{j}"), cin, cout))
                .collect::<Result<Vec<_>>>()?;
            let resample = match block.upsample {
                None => None,
                Some(mode) => {
                    let up = layout.upsampler_prefix(i);
                    let d = block.dim;
                    // diffusers runs the time conv before the spatial conv, and numbers its
                    // cache slots in that order; ours are per conv, so order is immaterial.
                    let time_conv = match mode {
                        Upsample::SpatioTemporal => {
                            Some(l.conv3d(&format!("{up}.time_conv"), d, 2 * d, [3, 1, 1])?)
                        }
                        Upsample::Spatial => None,
                    };
                    let conv = l.conv2d(&format!("{up}.resample.1"), d, block.out, 3)?;
                    Some(Resample { time_conv, conv })
                }
            };
            let shortcut = block.shortcut.map(|s| DupUp {
                out: s.cout,
                factor_t: s.factor_t,
            });
            up_blocks.push(UpBlock {
                resnets,
                resample,
                shortcut,
            });
        }
        let norm_out = l.rms("decoder.norm_out", layout.head, false)?;
        let conv_out = l.conv3d(
            "decoder.conv_out",
            layout.head,
            layout.out_channels,
            [3, 3, 3],
        )?;
        let device = post_quant_conv.device().clone();
        let per_channel = |values: Vec<f32>| -> Result<Tensor> {
            Ok(Tensor::from_vec(values, (1, z, 1, 1), &device)?)
        };
        // As WanPipeline builds them: float32 tensors of the config's numbers, and the
        // reciprocal of the std taken in float32.
        let mean = per_channel(cfg.latents_mean.iter().map(|&m| m as f32).collect())?;
        let inv_std = per_channel(cfg.latents_std.iter().map(|&s| 1.0 / s as f32).collect())?;
        Ok(WanVaeDecoder {
            z_dim: z,
            out_channels: cfg.video_channels(),
            patch: layout.patch,
            upscale: cfg.upscale(),
            temporal_upscale: cfg.temporal_upscale(),
            mean,
            inv_std,
            post_quant_conv,
            conv_in,
            mid_in,
            mid_attention,
            mid_out,
            up_blocks,
            norm_out,
            conv_out,
            slots: l.slots,
            cost: cfg.decode_cost(),
            budget: DEFAULT_DECODE_BUDGET,
        })
    }

    /// Latent channels `decode` expects.
    pub fn z_dim(&self) -> usize {
        self.z_dim
    }

    /// Channels of the decoded frames (3: RGB).
    pub fn out_channels(&self) -> usize {
        self.out_channels
    }

    /// Output pixels per latent, per side (the patch's included).
    pub fn upscale(&self) -> usize {
        self.upscale
    }

    /// Output frames per latent frame after the first.
    pub fn temporal_upscale(&self) -> usize {
        self.temporal_upscale
    }

    /// Decodes within `budget` bytes at the peak from now on (the plan's decode budget).
    pub fn set_decode_budget(&mut self, budget: u64) {
        self.budget = budget;
    }

    /// The split `decode_chunks` decodes `latents` [1, z, T, h, w] by: the largest whose
    /// peak fits the budget ([`DecodeCost::choose`]), counting the convolutions' scratch
    /// as the device the decoder is on builds it. A refusal names the budget.
    pub fn setting_for(&self, latents: &Tensor) -> Result<DecodeSetting> {
        let dims = latents.dims();
        let (t, h, w) = match dims {
            &[_, _, t, h, w] => (t, h, w),
            _ => return Ok(DecodeSetting::FRAME_BY_FRAME),
        };
        let out = OutputSize {
            width: (w * self.upscale) as u64,
            height: (h * self.upscale) as u64,
            frames: self.output_frames(t) as u64,
        };
        let scratch = if self.mean.device().is_cpu() {
            ConvScratch::Cpu {
                threads: rayon::current_num_threads() as u64,
            }
        } else {
            ConvScratch::Device
        };
        let (setting, _) = self
            .cost
            .choose(&out, DECODE_ELEM_BYTES, scratch, self.budget)?;
        Ok(setting)
    }

    /// Frames `latent_frames` latent frames decode to: `1 + temporal_upscale (T - 1)`.
    pub fn output_frames(&self, latent_frames: usize) -> usize {
        1 + self.temporal_upscale * latent_frames.saturating_sub(1)
    }

    /// Decodes latents [1, z_dim, T, h, w], exactly as the pipeline holds them at the end of
    /// denoising (normalised), into video [1 + temporal_upscale (T - 1), out_channels,
    /// upscale h, upscale w] in [-1, 1].
    pub fn decode(&self, latents: &Tensor) -> Result<Tensor> {
        let mut frames = Vec::new();
        self.decode_chunks(latents, |chunk| {
            frames.push(chunk);
            Ok(())
        })?;
        Ok(Tensor::cat(&frames, 0)?)
    }

    /// As `decode`, handing each latent frame's decoded frames ([1, C, H, W] for the first
    /// latent frame, [temporal_upscale, C, H, W] after) to `f` as soon as they exist, so a
    /// caller can stream them out and only one chunk's frames are ever held here.
    /// The chunk and tiles are [`Self::setting_for`] the latents.
    pub fn decode_chunks(
        &self,
        latents: &Tensor,
        f: impl FnMut(Tensor) -> Result<()>,
    ) -> Result<()> {
        self.decode_chunks_with(latents, &self.setting_for(latents)?, f)
    }

    /// As `decode_chunks`, `setting.chunk` latent frames at a time after the first (which
    /// decodes alone, as diffusers' first chunk), in `setting.tile`s when the frame is
    /// larger than one (diffusers' `enable_tiling`: each tile keeps its own causal cache
    /// across the chunks, and a chunk's tiles are blended before its frames go to `f`).
    /// Causal convolutions over a chunk of frames compute what they compute frame by frame,
    /// so the chunk changes the peak and the speed, never the frames.
    pub fn decode_chunks_with(
        &self,
        latents: &Tensor,
        setting: &DecodeSetting,
        mut f: impl FnMut(Tensor) -> Result<()>,
    ) -> Result<()> {
        let dims = latents.dims();
        if dims.len() != 5 || dims[0] != 1 || dims[1] != self.z_dim || dims[2..].contains(&0) {
            return Err(Error::bug(format!("latents: expected [1, {}, frames, height, width] with none of them 0, found {dims:?}",
                    self.z_dim
                ),
            ));
        }
        if setting.chunk == 0 {
            return Err(Error::invalid(
                "chunk",
                "a decode chunk of 0 latent frames decodes nothing",
            ));
        }
        let (t, h, w) = (dims[2], dims[3], dims[4]);
        let grid = self.grid((h, w), setting.tile)?;
        // One causal cache per tile, carried from chunk to chunk.
        let mut caches: Vec<FeatCache> = (0..grid.as_ref().map_or(1, Grid::len))
            .map(|_| FeatCache {
                slots: vec![Slot::Empty; self.slots],
            })
            .collect();
        let latents = to_f32(&latents.to_device(self.mean.device())?)?.squeeze(0)?;
        let mut start = 0;
        while start < t {
            let first = start == 0;
            let len = if first {
                1
            } else {
                (setting.chunk as usize).min(t - start)
            };
            // [len, z, h, w]: these latent frames, denormalised as the pipeline does.
            let z = latents
                .narrow(1, start, len)?
                .transpose(0, 1)?
                .contiguous()?;
            let z = z.broadcast_div(&self.inv_std)?.broadcast_add(&self.mean)?;
            let x = match &grid {
                None => self.decode_chunk(&z, &mut caches[0], first)?,
                Some(g) => {
                    let mut tiles = Vec::with_capacity(g.len());
                    for (((r, rows), (c, cols)), cache) in g.tiles().zip(caches.iter_mut()) {
                        let zt = z.narrow(2, r, rows)?.narrow(3, c, cols)?.contiguous()?;
                        tiles.push(self.decode_chunk(&zt, cache, first)?);
                    }
                    g.assemble(tiles)?
                }
            };
            drop(z);
            // The decoder's output freed once unpatchified: two copies of the frames live.
            let frames = unpatchify(&x, self.patch)?;
            drop(x);
            f(clamp_unit(frames)?)?;
            start += len;
        }
        Ok(())
    }

    /// The tiles of a `latent` (height, width) frame under `tile` (output pixels), with
    /// diffusers' arithmetic: latent tile and stride the sample ones over the upscale, the
    /// blend and the kept stride in the decoder's (patched) output. `None` (untiled) when
    /// there is no tile or the frame fits in one, as diffusers decodes it.
    fn grid(&self, latent: (usize, usize), tile: Option<Tile>) -> Result<Option<Grid>> {
        let Some(tile) = tile else { return Ok(None) };
        let (size, stride) = (tile.size as usize, tile.stride as usize);
        if stride > size {
            return Err(Error::invalid(
                "tile",
                format!("a tile stride of {stride} pixels beyond its size {size} leaves gaps"),
            ));
        }
        let lat = size / self.upscale;
        if latent.0 <= lat && latent.1 <= lat {
            return Ok(None);
        }
        let p = self.patch;
        let grid = Grid::new(
            latent,
            lat,
            stride / self.upscale,
            size / p - stride / p,
            stride / p,
            (latent.0 * self.upscale / p, latent.1 * self.upscale / p),
        )?;
        Ok(Some(grid))
    }

    /// `WanDecoder3d.forward` on one chunk [T, z, h, w] (`first_chunk` for the clip's
    /// first), with the post-quant conv before: the decoder's output, patched and unclamped.
    fn decode_chunk(&self, z: &Tensor, cache: &mut FeatCache, first_chunk: bool) -> Result<Tensor> {
        // Each step replaces `x`, so at most one activation is alive beside the next.
        let mut x = self.post_quant_conv.forward(z, None)?;
        x = self.conv_in.forward_cached(&x, cache)?;
        x = self.mid_in.forward(&x, cache)?;
        x = self.mid_attention.forward(&x)?;
        x = self.mid_out.forward(&x, cache)?;
        for block in &self.up_blocks {
            x = block.forward(x, cache, first_chunk)?;
        }
        x = self.norm_out.forward(&x)?.silu()?;
        self.conv_out.forward_cached(&x, cache)
    }
}

/// The Wan VAE as the runtime's [`Decoder`] (Wan, Cosmos3 and Qwen-Image all decode
/// through it): [1, C, T, h, w] latents to [F, 3, H, W] frames.
impl Decoder for WanVaeDecoder {
    fn decode(&self, latents: &Tensor) -> Result<Tensor> {
        WanVaeDecoder::decode(self, latents)
    }

    fn decode_frames(
        &self,
        latents: &Tensor,
        f: &mut dyn FnMut(Tensor) -> Result<()>,
    ) -> Result<()> {
        self.decode_chunks(latents, f)
    }

    fn set_decode_budget(&mut self, budget: u64) {
        WanVaeDecoder::set_decode_budget(self, budget)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::path::PathBuf;

    use candle_core::{Device, Tensor};

    use super::*;
    use crate::execution::weights::seeded_noise;
    use crate::testing::max_abs_diff;

    fn fixture() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/wan-vae-tiny")
    }

    fn weights() -> HashMap<String, Tensor> {
        candle_core::safetensors::load(
            fixture().join("diffusion_pytorch_model.safetensors"),
            &Device::Cpu,
        )
        .unwrap()
    }

    fn tiny() -> WanVaeDecoder {
        WanVaeDecoder::load(&WanVaeConfig::tiny(), &weights()).unwrap()
    }

    /// The chunks `decode_chunks` streams for `latents`, and their shapes.
    fn chunks(vae: &WanVaeDecoder, latents: &Tensor) -> (Vec<Vec<usize>>, Vec<Tensor>) {
        let mut parts = Vec::new();
        vae.decode_chunks(latents, |chunk| {
            parts.push(chunk);
            Ok(())
        })
        .unwrap();
        (parts.iter().map(|c| c.dims().to_vec()).collect(), parts)
    }

    #[test]
    fn chunks_stream_one_frame_then_four_and_make_up_decode() {
        let vae = tiny();
        let latents = seeded_noise(11, &[1, 16, 3, 2, 3]).unwrap();
        let (sizes, parts) = chunks(&vae, &latents);
        assert_eq!(
            sizes,
            vec![vec![1, 3, 16, 24], vec![4, 3, 16, 24], vec![4, 3, 16, 24]]
        );
        let whole = vae.decode(&latents).unwrap();
        assert_eq!(whole.dims(), &[9, 3, 16, 24]);
        assert_eq!(vae.output_frames(3), 9);
        assert_eq!(max_abs_diff(&Tensor::cat(&parts, 0).unwrap(), &whole), 0.0);
        let max = max_abs_diff(&whole, &whole.zeros_like().unwrap());
        assert!(
            max <= 1.0 && max > 0.1,
            "frames in [-1, 1] and not flat: {max}"
        );
    }

    #[test]
    fn the_residual_decoder_streams_rgb_at_sixteen_times_and_stays_causal() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/wan22-vae-tiny");
        let w = candle_core::safetensors::load(
            dir.join("diffusion_pytorch_model.safetensors"),
            &Device::Cpu,
        )
        .unwrap();
        let vae = WanVaeDecoder::load(&WanVaeConfig::tiny22(), &w).unwrap();
        assert_eq!(
            (vae.z_dim(), vae.out_channels(), vae.upscale()),
            (48, 3, 16)
        );
        let latents = seeded_noise(13, &[1, 48, 3, 1, 2]).unwrap();
        let (sizes, _) = chunks(&vae, &latents);
        assert_eq!(
            sizes,
            vec![vec![1, 3, 16, 32], vec![4, 3, 16, 32], vec![4, 3, 16, 32]]
        );
        let all = vae.decode(&latents).unwrap();
        let head = vae.decode(&latents.narrow(2, 0, 2).unwrap()).unwrap();
        assert_eq!(max_abs_diff(&all.narrow(0, 0, 5).unwrap(), &head), 0.0);
    }

    #[test]
    fn decoding_is_causal_in_time() {
        // A clip's first frames do not depend on its later latent frames.
        let vae = tiny();
        let latents = seeded_noise(12, &[1, 16, 3, 2, 2]).unwrap();
        let all = vae.decode(&latents).unwrap();
        let head = vae.decode(&latents.narrow(2, 0, 2).unwrap()).unwrap();
        assert_eq!(head.dim(0).unwrap(), 5);
        assert_eq!(max_abs_diff(&all.narrow(0, 0, 5).unwrap(), &head), 0.0);
        // And the later frames do depend on the earlier latent frames (the cache is used).
        let mut edited = latents.narrow(2, 0, 1).unwrap().affine(-1.0, 0.5).unwrap();
        edited = Tensor::cat(&[edited, latents.narrow(2, 1, 2).unwrap()], 2).unwrap();
        let other = vae.decode(&edited).unwrap();
        assert!(
            max_abs_diff(
                &other.narrow(0, 5, 4).unwrap(),
                &all.narrow(0, 5, 4).unwrap()
            ) > 1e-3
        );
    }

    #[test]
    fn bad_latents_are_refused() {
        let vae = tiny();
        for shape in [
            &[16, 3, 2, 2][..],
            &[2, 16, 3, 2, 2],
            &[1, 4, 3, 2, 2],
            &[1, 16, 0, 2, 2],
        ] {
            let z = Tensor::zeros(shape, candle_core::DType::F32, &Device::Cpu).unwrap();
            let err = vae.decode(&z).unwrap_err().to_string();
            assert!(err.contains("latents"), "{shape:?}: {err}");
        }
    }

    #[test]
    fn loading_names_a_missing_or_misshapen_tensor() {
        let name = "decoder.up_blocks.1.resnets.0.conv_shortcut.weight";
        let mut w = weights();
        w.remove(name);
        let err = WanVaeDecoder::load(&WanVaeConfig::tiny(), &w)
            .err()
            .expect("a missing tensor must fail")
            .to_string();
        assert!(err.contains(name), "{err}");

        let mut w = weights();
        w.insert(name.into(), seeded_noise(1, &[3, 1, 3, 3, 3]).unwrap());
        let err = WanVaeDecoder::load(&WanVaeConfig::tiny(), &w)
            .err()
            .expect("a misshapen tensor must fail")
            .to_string();
        assert!(
            err.contains(name) && err.contains("[3, 1, 1, 1, 1]"),
            "{err}"
        );

        let cfg = WanVaeConfig {
            patch_size: Some(3),
            ..WanVaeConfig::tiny()
        };
        let err = WanVaeDecoder::load(&cfg, &weights())
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("`patch_size`"), "{err}");
    }
}
