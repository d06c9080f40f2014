//! The layer layout of `AutoencoderKLWan` as diffusers 0.42.1 builds it from its config, and
//! from that layout the name and shape of every tensor its checkpoint holds. The decoder
//! builds itself from the same layout, so the names it loads and the names checked here
//! cannot drift apart.

use super::config::WanVaeConfig;
use layerwise_core::family::TensorSpec;

/// How an up block's resampler scales.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Upsample {
    /// `upsample2d`: nearest 2× in space, then a 3×3 conv that halves the channels.
    Spatial,
    /// `upsample3d`: first a causal time conv that doubles the frames, then as `Spatial`.
    SpatioTemporal,
}

/// One `WanUpBlock` (Wan 2.1) or `WanResidualUpBlock` (Wan 2.2): `num_res_blocks + 1`
/// residual blocks, then maybe a resampler, and for Wan 2.2 a shortcut around them all.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpBlockLayout {
    /// (in, out) channels of each residual block.
    pub resnets: Vec<(usize, usize)>,
    /// The block's width (its resnets' output).
    pub dim: usize,
    pub upsample: Option<Upsample>,
    /// The block's output width: the resampler's, which halves `dim` for Wan 2.1 and keeps
    /// it for Wan 2.2; `dim` without a resampler.
    pub out: usize,
    /// Wan 2.2's `DupUp3D`, on every block with a resampler.
    pub shortcut: Option<DupUpLayout>,
}

/// `DupUp3D`: the residual decoder's weightless shortcut from an up block's input to its
/// output, which repeats each of `cin` channels so that the copies fill `cout` channels of
/// `factor_t` frames × 2×2 pixels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DupUpLayout {
    pub cin: usize,
    pub cout: usize,
    /// 2 where the block upsamples in time, else 1.
    pub factor_t: usize,
}

impl DupUpLayout {
    /// Output values per input value's position: frames × pixels.
    pub fn factor(&self) -> usize {
        self.factor_t * 4
    }
}

/// `WanDecoder3d`: conv_in to `mid` channels, the mid block, the up blocks, the head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecoderLayout {
    pub z_dim: usize,
    pub mid: usize,
    pub up_blocks: Vec<UpBlockLayout>,
    /// Width of the head (the last up block's).
    pub head: usize,
    /// The head's output: `patch`² pixels of every channel of the frames.
    pub out_channels: usize,
    /// The side of the pixel patch the head's channels unfold into (1: none).
    pub patch: usize,
    /// Wan 2.2's blocks, whose resampler diffusers names `upsampler` (Wan 2.1's:
    /// `upsamplers.0`).
    pub residual: bool,
}

impl DecoderLayout {
    /// The tensor prefix of up block `i`'s resampler.
    pub fn upsampler_prefix(&self, i: usize) -> String {
        if self.residual {
            format!("decoder.up_blocks.{i}.upsampler")
        } else {
            format!("decoder.up_blocks.{i}.upsamplers.0")
        }
    }
}

/// One `WanResidualDownBlock` of Wan 2.2's encoder (`encoder.down_blocks.{i}`):
/// `num_res_blocks` residual blocks, maybe a downsampler, and a weightless `AvgDown3D`
/// shortcut that averages groups of its input's channels, frames and pixels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResidualDownBlockLayout {
    pub cin: usize,
    pub cout: usize,
    pub resnets: Vec<(usize, usize)>,
    /// `Some(temporal)`: `downsample3d` when true, `downsample2d` when false.
    pub downsample: Option<bool>,
}

impl ResidualDownBlockLayout {
    /// Input values the shortcut averages per output position (times the group size).
    pub fn factor(&self) -> usize {
        match self.downsample {
            None => 1,
            Some(false) => 4,
            Some(true) => 8,
        }
    }
}

/// One entry of `WanEncoder3d.down_blocks`, in order (the index is the tensor prefix).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EncoderLayer {
    Residual {
        cin: usize,
        cout: usize,
    },
    Attention {
        dim: usize,
    },
    /// `downsample2d` (`temporal` false) or `downsample3d`.
    Downsample {
        dim: usize,
        temporal: bool,
    },
}

impl WanVaeConfig {
    /// The decoder's layers (diffusers' `WanDecoder3d`, either variant).
    pub fn decoder_layout(&self) -> DecoderLayout {
        let base = self.decoder_dim();
        let n = self.dim_mult.len();
        let last = self.dim_mult.last().copied().unwrap_or(1);
        // Widths from the latent side: the deepest level twice, then the levels reversed.
        let dims: Vec<usize> = std::iter::once(last)
            .chain(self.dim_mult.iter().rev().copied())
            .map(|m| base * m)
            .collect();
        let temperal_upsample = self.temperal_upsample();
        let mut up_blocks: Vec<UpBlockLayout> = Vec::with_capacity(n);
        for i in 0..n {
            // Every block after the first takes the previous one's output.
            let block_in = up_blocks.last().map_or(dims[0], |b| b.out);
            let dim = dims[i + 1];
            let mut cin = block_in;
            let resnets = (0..=self.num_res_blocks)
                .map(|_| {
                    let pair = (cin, dim);
                    cin = dim;
                    pair
                })
                .collect();
            let upsample = (i + 1 < n).then(|| {
                if temperal_upsample.get(i).copied().unwrap_or(false) {
                    Upsample::SpatioTemporal
                } else {
                    Upsample::Spatial
                }
            });
            let out = match upsample {
                Some(_) if !self.is_residual => dim / 2,
                _ => dim,
            };
            let shortcut = upsample
                .filter(|_| self.is_residual)
                .map(|mode| DupUpLayout {
                    cin: block_in,
                    cout: dim,
                    factor_t: if mode == Upsample::SpatioTemporal {
                        2
                    } else {
                        1
                    },
                });
            up_blocks.push(UpBlockLayout {
                resnets,
                dim,
                upsample,
                out,
                shortcut,
            });
        }
        DecoderLayout {
            z_dim: self.z_dim,
            mid: dims[0],
            head: dims[n],
            up_blocks,
            out_channels: self.out_channels,
            patch: self.patch(),
            residual: self.is_residual,
        }
    }

    /// Wan 2.2's encoder blocks, one per level (`is_residual` only; its encoder ignores
    /// `attn_scales`, as diffusers' does).
    pub fn residual_encoder_blocks(&self) -> Vec<ResidualDownBlockLayout> {
        if !self.is_residual {
            return Vec::new();
        }
        let base = self.base_dim;
        let n = self.dim_mult.len();
        let dims: Vec<usize> = std::iter::once(1)
            .chain(self.dim_mult.iter().copied())
            .map(|m| base * m)
            .collect();
        (0..n)
            .map(|i| {
                let (cin, cout) = (dims[i], dims[i + 1]);
                let mut width = cin;
                let resnets = (0..self.num_res_blocks)
                    .map(|_| {
                        let pair = (width, cout);
                        width = cout;
                        pair
                    })
                    .collect();
                let downsample =
                    (i + 1 < n).then(|| self.temperal_downsample.get(i).copied().unwrap_or(false));
                ResidualDownBlockLayout {
                    cin,
                    cout,
                    resnets,
                    downsample,
                }
            })
            .collect()
    }

    /// The encoder's `down_blocks` entries, in order (diffusers' non-residual encoder; see
    /// `residual_encoder_blocks` for Wan 2.2's).
    pub fn encoder_layers(&self) -> Vec<EncoderLayer> {
        let base = self.base_dim;
        let dims: Vec<usize> = std::iter::once(1)
            .chain(self.dim_mult.iter().copied())
            .map(|m| base * m)
            .collect();
        let mut out = Vec::new();
        let mut scale = 1.0f64;
        for i in 0..self.dim_mult.len() {
            let (mut cin, cout) = (dims[i], dims[i + 1]);
            for _ in 0..self.num_res_blocks {
                out.push(EncoderLayer::Residual { cin, cout });
                // diffusers tests membership with float equality on exact halvings.
                if self.attn_scales.contains(&scale) {
                    out.push(EncoderLayer::Attention { dim: cout });
                }
                cin = cout;
            }
            if i + 1 < self.dim_mult.len() {
                out.push(EncoderLayer::Downsample {
                    dim: cout,
                    temporal: self.temperal_downsample.get(i).copied().unwrap_or(false),
                });
                scale /= 2.0;
            }
        }
        out
    }

    /// Every tensor of the full VAE (encoder, quant convs, decoder) under the names
    /// diffusers' `save_pretrained` writes.
    pub fn tensor_specs(&self) -> Vec<TensorSpec> {
        let mut out = Vec::new();
        let base = self.base_dim;
        let top = base * self.dim_mult.last().copied().unwrap_or(1);
        let z2 = 2 * self.z_dim;
        conv3d(
            &mut out,
            "encoder.conv_in",
            self.in_channels,
            base,
            [3, 3, 3],
        );
        if self.is_residual {
            self.residual_encoder_specs(&mut out);
        } else {
            self.encoder_layer_specs(&mut out);
        }
        mid_block(&mut out, "encoder.mid_block", top);
        rms(&mut out, "encoder.norm_out", top, false);
        conv3d(&mut out, "encoder.conv_out", top, z2, [3, 3, 3]);
        conv3d(&mut out, "quant_conv", z2, z2, [1, 1, 1]);
        out.extend(self.decoder_specs());
        out
    }

    /// Wan 2.1's `encoder.down_blocks.*`: one entry per layer.
    fn encoder_layer_specs(&self, out: &mut Vec<TensorSpec>) {
        for (i, layer) in self.encoder_layers().iter().enumerate() {
            let prefix = format!("encoder.down_blocks.{i}");
            match *layer {
                EncoderLayer::Residual { cin, cout } => residual(out, &prefix, cin, cout),
                EncoderLayer::Attention { dim } => attention(out, &prefix, dim),
                EncoderLayer::Downsample { dim, temporal } => {
                    conv2d(out, &format!("{prefix}.resample.1"), dim, dim);
                    if temporal {
                        conv3d(out, &format!("{prefix}.time_conv"), dim, dim, [3, 1, 1]);
                    }
                }
            }
        }
    }

    /// Wan 2.2's `encoder.down_blocks.*`: one block per level (the shortcut has no weights).
    fn residual_encoder_specs(&self, out: &mut Vec<TensorSpec>) {
        for (i, block) in self.residual_encoder_blocks().iter().enumerate() {
            let prefix = format!("encoder.down_blocks.{i}");
            for (j, &(cin, cout)) in block.resnets.iter().enumerate() {
                residual(out, &format!("{prefix}.resnets.{j}"), cin, cout);
            }
            if let Some(temporal) = block.downsample {
                let down = format!("{prefix}.downsampler");
                let d = block.cout;
                conv2d(out, &format!("{down}.resample.1"), d, d);
                if temporal {
                    conv3d(out, &format!("{down}.time_conv"), d, d, [3, 1, 1]);
                }
            }
        }
    }

    /// What decoding needs: `post_quant_conv.*` and `decoder.*`.
    pub fn decoder_specs(&self) -> Vec<TensorSpec> {
        let mut out = Vec::new();
        let l = self.decoder_layout();
        conv3d(&mut out, "post_quant_conv", l.z_dim, l.z_dim, [1, 1, 1]);
        conv3d(&mut out, "decoder.conv_in", l.z_dim, l.mid, [3, 3, 3]);
        mid_block(&mut out, "decoder.mid_block", l.mid);
        for (i, block) in l.up_blocks.iter().enumerate() {
            let prefix = format!("decoder.up_blocks.{i}");
            for (j, &(cin, cout)) in block.resnets.iter().enumerate() {
                residual(&mut out, &format!("{prefix}.resnets.{j}"), cin, cout);
            }
            if let Some(mode) = block.upsample {
                let up = l.upsampler_prefix(i);
                conv2d(&mut out, &format!("{up}.resample.1"), block.dim, block.out);
                if mode == Upsample::SpatioTemporal {
                    let d = block.dim;
                    conv3d(&mut out, &format!("{up}.time_conv"), d, 2 * d, [3, 1, 1]);
                }
            }
        }
        rms(&mut out, "decoder.norm_out", l.head, false);
        conv3d(
            &mut out,
            "decoder.conv_out",
            l.head,
            l.out_channels,
            [3, 3, 3],
        );
        out
    }

    /// The names of [`Self::decoder_specs`]: the tensors a rank that decodes keeps on its
    /// device.
    pub fn decoder_names(&self) -> Vec<String> {
        self.decoder_specs().into_iter().map(|s| s.name).collect()
    }
}

fn conv3d(out: &mut Vec<TensorSpec>, prefix: &str, cin: usize, cout: usize, k: [usize; 3]) {
    out.push(TensorSpec::new(
        format!("{prefix}.weight"),
        &[cout, cin, k[0], k[1], k[2]],
    ));
    out.push(TensorSpec::new(format!("{prefix}.bias"), &[cout]));
}

fn conv2d(out: &mut Vec<TensorSpec>, prefix: &str, cin: usize, cout: usize) {
    out.push(TensorSpec::new(
        format!("{prefix}.weight"),
        &[cout, cin, 3, 3],
    ));
    out.push(TensorSpec::new(format!("{prefix}.bias"), &[cout]));
}

/// `WanRMS_norm` has a gain only, shaped to broadcast over [C, T, H, W] (video) or
/// [C, H, W] (`images`, the attention's per-frame input).
fn rms(out: &mut Vec<TensorSpec>, prefix: &str, c: usize, images: bool) {
    let shape: &[usize] = if images { &[c, 1, 1] } else { &[c, 1, 1, 1] };
    out.push(TensorSpec::new(format!("{prefix}.gamma"), shape));
}

fn residual(out: &mut Vec<TensorSpec>, prefix: &str, cin: usize, cout: usize) {
    rms(out, &format!("{prefix}.norm1"), cin, false);
    conv3d(out, &format!("{prefix}.conv1"), cin, cout, [3, 3, 3]);
    rms(out, &format!("{prefix}.norm2"), cout, false);
    conv3d(out, &format!("{prefix}.conv2"), cout, cout, [3, 3, 3]);
    if cin != cout {
        conv3d(
            out,
            &format!("{prefix}.conv_shortcut"),
            cin,
            cout,
            [1, 1, 1],
        );
    }
}

fn attention(out: &mut Vec<TensorSpec>, prefix: &str, c: usize) {
    rms(out, &format!("{prefix}.norm"), c, true);
    out.push(TensorSpec::new(
        format!("{prefix}.to_qkv.weight"),
        &[3 * c, c, 1, 1],
    ));
    out.push(TensorSpec::new(format!("{prefix}.to_qkv.bias"), &[3 * c]));
    out.push(TensorSpec::new(
        format!("{prefix}.proj.weight"),
        &[c, c, 1, 1],
    ));
    out.push(TensorSpec::new(format!("{prefix}.proj.bias"), &[c]));
}

fn mid_block(out: &mut Vec<TensorSpec>, prefix: &str, c: usize) {
    attention(out, &format!("{prefix}.attentions.0"), c);
    residual(out, &format!("{prefix}.resnets.0"), c, c);
    residual(out, &format!("{prefix}.resnets.1"), c, c);
}
