//! What one decode holds at its peak, as a function of how it is split (latent frames per
//! chunk, tile size), the output's size and the element size, and the choice of the split
//! that fits a budget: the one formula the engine decodes by and the planner charges.
//!
//! A family describes its decoder once ([`DecodeCost`], from its VAE's layout): for each
//! point of a chunk's pass where the live set may peak, the elements live there per latent
//! pixel of the tile being decoded, for the first chunk (one latent frame, which a causal
//! VAE decodes alone) and for a later chunk per latent frame in it; the convolution
//! scratch and the attention scores there; and the causal cache every tile keeps between
//! chunks. [`DecodeCost::peak`] adds what sits beside the tile's pass (the other tiles'
//! caches and decoded outputs, the chunk's latents) and the phases after it (blending the
//! tiles, the final unpatchify and clamp). [`DecodeCost::choose`] walks the settings from
//! the largest down and takes the first whose peak fits.

use serde::{Deserialize, Serialize};

use super::{DecodeSetting, Tile};

/// Rows of an im2col buffer CUDA's convolution may build at once, in elements: the engine
/// bands taller frames ([`ConvScratch::Device`]).
pub const IM2COL_BUDGET: u64 = 1 << 25;
/// Output pixels per task of the CPU convolution (candle's tiled im2col), each thread
/// holding one task's im2col and the matmul's packed copy of it.
pub const CPU_CONV_TILE: u64 = 512;

/// One point of a chunk's pass where its live set may peak.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct PeakPoint {
    /// Elements live per latent pixel of the tile at the first chunk (one frame).
    pub first: u64,
    /// In a later chunk, per latent pixel: elements per latent frame of the chunk ...
    pub per_latent_frame: u64,
    /// ... and elements whatever its length (the two past frames a causal conv reads).
    pub fixed: u64,
    /// Channels × kernel taps of the im2col a convolution here builds (0: none).
    pub im2col_channels: u64,
    /// Pixels here per latent pixel (4 per 2× upsampling so far).
    pub pixels_per_latent: u64,
    /// Frames here per latent frame of a later chunk (2 per temporal upsampling so far).
    pub frames_per_latent: u64,
    /// Attention over the pixels runs here: its scores, two copies of a block of query
    /// rows against every pixel, each frame at once.
    #[serde(default)]
    pub attention: bool,
}

/// A decoder's peak, described from its layout (elements, to be multiplied by the
/// element size it computes in).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct DecodeCost {
    /// Output pixels per latent pixel, per side.
    pub upscale: u64,
    /// Output frames per latent frame after the first (1: an image VAE).
    pub temporal_upscale: u64,
    /// Latent channels (the chunk's latents, held while it decodes).
    pub latent_channels: u64,
    /// Channels of the decoded frames (3).
    pub out_channels: u64,
    /// Query rows per block of the attention's scores.
    pub attention_block: u64,
    /// Elements of causal cache each tile keeps after its first chunk, per latent pixel.
    pub cache_first: u64,
    /// The same after a later chunk (two frames in every causal conv).
    pub cache: u64,
    pub points: Vec<PeakPoint>,
}

/// How the convolutions' scratch is sized: the CPU's per thread, a GPU's im2col per
/// convolution (banded at [`IM2COL_BUDGET`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConvScratch {
    Cpu { threads: u64 },
    Device,
}

/// An output of `width × height` pixels and `frames` frames (1: an image).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutputSize {
    pub width: u64,
    pub height: u64,
    pub frames: u64,
}

/// The tiles of one frame, in latent pixels.
struct Tiles {
    /// The largest tile.
    tile: u128,
    /// All tiles together (the overlaps counted in each).
    covered: u128,
    /// The latent frame.
    frame: u128,
    /// Whether the frame is cut at all.
    tiled: bool,
}

impl DecodeCost {
    fn latent(&self, out: &OutputSize) -> (u64, u64, u64) {
        let up = self.upscale.max(1);
        let t = (out.frames.max(1) - 1) / self.temporal_upscale.max(1) + 1;
        (out.height.div_ceil(up), out.width.div_ceil(up), t)
    }

    fn tiles(&self, out: &OutputSize, tile: Option<Tile>) -> Tiles {
        let (h, w, _) = self.latent(out);
        let frame = h as u128 * w as u128;
        let whole = Tiles {
            tile: frame,
            covered: frame,
            frame,
            tiled: false,
        };
        let Some(tile) = tile else { return whole };
        let up = self.upscale.max(1);
        let (size, stride) = (tile.size / up, (tile.stride / up).max(1));
        if h <= size && w <= size {
            return whole;
        }
        // Each side's tiles start every stride and are clipped at the edge.
        let side = |n: u64| -> u128 {
            (0..n)
                .step_by(stride as usize)
                .map(|s| size.min(n - s) as u128)
                .sum()
        };
        Tiles {
            tile: size.min(h) as u128 * size.min(w) as u128,
            covered: side(h) * side(w),
            frame,
            tiled: true,
        }
    }

    /// Peak bytes of decoding one output of `out` split by `setting`, at `elem` bytes per
    /// element, with convolutions' scratch as `scratch` sizes it. Saturates at `u64::MAX`.
    pub fn peak(
        &self,
        setting: &DecodeSetting,
        out: &OutputSize,
        elem: u64,
        scratch: ConvScratch,
    ) -> u64 {
        let (_, _, t) = self.latent(out);
        let k = if t > 1 {
            setting.chunk.max(1).min(t - 1) as u128
        } else {
            0
        };
        let tiles = self.tiles(out, setting.tile);
        let px = tiles.tile;
        let conv = |p: &PeakPoint, frames: u128| -> u128 {
            match scratch {
                ConvScratch::Cpu { threads } => {
                    // The task's im2col and the matmul's packed copy of it.
                    threads as u128 * CPU_CONV_TILE as u128 * 2 * p.im2col_channels as u128
                }
                ConvScratch::Device => {
                    (p.im2col_channels as u128 * p.pixels_per_latent as u128 * px * frames)
                        .min(IM2COL_BUDGET as u128)
                }
            }
        };
        let scores = |p: &PeakPoint, frames: u128| -> u128 {
            if !p.attention {
                return 0;
            }
            let n = px * p.pixels_per_latent as u128;
            frames * 2 * n.min(self.attention_block.max(1) as u128) * n
        };
        // A tile's pass: the first chunk, and a later one of k latent frames.
        let (mut first, mut later) = (0u128, 0u128);
        for p in &self.points {
            first = first.max(p.first as u128 * px + conv(p, 1) + scores(p, 1));
            if k > 0 {
                let frames = p.frames_per_latent as u128 * k;
                later = later.max(
                    (p.per_latent_frame as u128 * k + p.fixed as u128) * px
                        + conv(p, frames)
                        + scores(p, frames),
                );
            }
        }
        let pixel = self.out_channels as u128 * self.upscale as u128 * self.upscale as u128;
        // A chunk's whole peak: its pass beside the other tiles' outputs (`frames` output
        // frames each), then the tiles, their blended copies and the assembled frame (its
        // bands, itself, its crop), then the decoder's output beside its unpatchified and
        // clamped copies; with every tile's cache and the chunk's latents (sliced, and
        // denormalised) beside all of it.
        let chunk = |pass: u128, frames: u128, cache: u64, latent_frames: u128| -> u128 {
            let decoded = |latent_px: u128| pixel * frames * latent_px;
            let mut phases = if tiles.tiled {
                (pass + decoded(tiles.covered - px))
                    .max(2 * decoded(tiles.covered) + 3 * decoded(tiles.frame))
            } else {
                pass
            };
            phases = phases.max(3 * decoded(tiles.frame));
            let latents = self.latent_channels as u128 * latent_frames * tiles.frame * 3;
            phases + cache as u128 * tiles.covered + latents
        };
        let mut total = chunk(first, 1, self.cache_first, 1);
        if k > 0 {
            let frames = self.temporal_upscale.max(1) as u128 * k;
            total = total.max(chunk(later, frames, self.cache, k));
        }
        (total * elem as u128).min(u64::MAX as u128) as u64
    }

    /// The settings [`Self::choose`] tries for `out`, largest first: whole frames, then
    /// tiles from the frame's longer side down (diffusers' 3/4 stride, in whole latent
    /// pixels, never below four latent pixels); at each, chunks from the clip's length
    /// down to one latent frame.
    pub fn settings(&self, out: &OutputSize) -> Vec<DecodeSetting> {
        let (h, w, t) = self.latent(out);
        let up = self.upscale.max(1);
        let mut tiles: Vec<Option<Tile>> = vec![None];
        let mut side = h.max(w);
        while side > 4 {
            side = (side * 3 / 4).max(4);
            let size = side * up;
            tiles.push(Some(Tile {
                size,
                stride: (side * 3 / 4).max(1) * up,
            }));
        }
        let chunks = t.saturating_sub(1).max(1);
        tiles
            .into_iter()
            .flat_map(|tile| {
                (1..=chunks)
                    .rev()
                    .map(move |chunk| DecodeSetting { chunk, tile })
            })
            .collect()
    }

    /// The largest setting whose peak fits `budget` bytes ([`Self::settings`]' order), or
    /// a refusal naming the budget and the least any setting needs.
    pub fn choose(
        &self,
        out: &OutputSize,
        elem: u64,
        scratch: ConvScratch,
        budget: u64,
    ) -> crate::Result<(DecodeSetting, u64)> {
        let mut least = u64::MAX;
        for s in self.settings(out) {
            let peak = self.peak(&s, out, elem, scratch);
            if peak <= budget {
                return Ok((s, peak));
            }
            least = least.min(peak);
        }
        Err(crate::Error::Invalid {
            field: "decode budget".into(),
            msg: format!(
                "decoding a {}x{} output of {} frame(s) needs at least {:.2} GiB at its smallest tile and chunk, beyond the decode budget of {:.2} GiB",
                out.width,
                out.height,
                out.frames,
                least as f64 / GIB,
                budget as f64 / GIB
            ),
        })
    }
}

const GIB: f64 = (1u64 << 30) as f64;

#[cfg(test)]
mod tests {
    use super::*;

    /// A decoder of one level at the latent's size and one at 4× its pixels, 2× its frames.
    fn cost() -> DecodeCost {
        DecodeCost {
            upscale: 8,
            temporal_upscale: 4,
            latent_channels: 16,
            out_channels: 3,
            attention_block: 4096,
            cache_first: 5,
            cache: 10,
            points: vec![
                PeakPoint {
                    first: 50,
                    per_latent_frame: 40,
                    fixed: 20,
                    im2col_channels: 27,
                    pixels_per_latent: 1,
                    frames_per_latent: 1,
                    attention: true,
                },
                PeakPoint {
                    first: 20000,
                    per_latent_frame: 40000,
                    fixed: 8000,
                    im2col_channels: 9,
                    pixels_per_latent: 4,
                    frames_per_latent: 2,
                    attention: false,
                },
            ],
        }
    }

    fn size(width: u64, height: u64, frames: u64) -> OutputSize {
        OutputSize {
            width,
            height,
            frames,
        }
    }

    const CPU: ConvScratch = ConvScratch::Cpu { threads: 2 };

    #[test]
    fn an_image_pays_one_frame_whatever_the_chunk() {
        let c = cost();
        let img = size(64, 32, 1);
        let one = c.peak(&DecodeSetting::FRAME_BY_FRAME, &img, 4, CPU);
        let six = DecodeSetting {
            chunk: 6,
            tile: None,
        };
        assert_eq!(c.peak(&six, &img, 4, CPU), one);
        // By hand: 8 x 4 latent pixels; the pass peaks at the second point (20000 a pixel,
        // scratch 2 threads x 512 x 9), or at the first with its scores (2 x 32 x 32).
        let px = 32u64;
        let pass = (20000 * px + 2 * 2 * 512 * 9).max(50 * px + 2 * 2 * 512 * 27 + 2 * 32 * 32);
        let out = 3 * 64 * px;
        let want = (pass.max(3 * out) + 5 * px + 16 * px * 3) * 4;
        assert_eq!(one, want);
        // A clip's later chunks grow with their length, up to the clip's.
        let clip = size(64, 32, 17);
        let peaks: Vec<u64> = (1..=6)
            .map(|chunk| c.peak(&DecodeSetting { chunk, tile: None }, &clip, 4, CPU))
            .collect();
        assert!(peaks.windows(2).all(|w| w[0] <= w[1]), "{peaks:?}");
        assert!(peaks[0] > one);
        assert_eq!(
            peaks[3], peaks[5],
            "17 frames are 5 latent frames: chunks stop at 4"
        );
    }

    #[test]
    fn tiles_bound_the_pass_by_the_tile_and_pay_for_the_overlaps() {
        let c = cost();
        let big = size(1024, 1024, 1);
        let whole = c.peak(&DecodeSetting::FRAME_BY_FRAME, &big, 4, ConvScratch::Device);
        let tile = |size, stride| DecodeSetting {
            chunk: 1,
            tile: Some(Tile { size, stride }),
        };
        let t256 = c.peak(&tile(256, 192), &big, 4, ConvScratch::Device);
        let t128 = c.peak(&tile(128, 96), &big, 4, ConvScratch::Device);
        assert!(t128 < t256 && t256 < whole, "{t128} {t256} {whole}");
        // A tile as large as the frame is no tiling.
        assert_eq!(
            c.peak(&tile(1024, 768), &big, 4, ConvScratch::Device),
            whole
        );
        // bf16 halves it.
        assert_eq!(
            c.peak(&tile(256, 192), &big, 2, ConvScratch::Device) * 2,
            t256
        );
    }

    #[test]
    fn the_choice_is_the_largest_split_that_fits_and_refuses_by_name() {
        let c = cost();
        let clip = size(256, 256, 21);
        let all = c.settings(&clip);
        assert_eq!(
            all[0],
            DecodeSetting {
                chunk: 5,
                tile: None
            }
        );
        let peaks: Vec<u64> = all.iter().map(|s| c.peak(s, &clip, 4, CPU)).collect();
        // A budget between two settings' peaks picks the first that fits.
        let budget = peaks[2];
        let (s, peak) = c.choose(&clip, 4, CPU, budget).unwrap();
        let first_fit = peaks.iter().position(|&p| p <= budget).unwrap();
        assert_eq!((s, peak), (all[first_fit], peaks[first_fit]));
        assert!(first_fit <= 2);
        let (s, _) = c.choose(&clip, 4, CPU, u64::MAX).unwrap();
        assert_eq!(s, all[0]);
        let least = *peaks.iter().min().unwrap();
        let (_, p) = c.choose(&clip, 4, CPU, least).unwrap();
        assert_eq!(p, least);
        let err = c.choose(&clip, 4, CPU, least - 1).unwrap_err().to_string();
        assert!(
            err.contains("decode budget") && err.contains("256x256"),
            "{err}"
        );
    }
}
