//! The layer layout of `AutoencoderKLWan` as diffusers 0.42.1 builds it from its config, and
//! from that layout the name and shape of every tensor its checkpoint holds. The decoder
//! builds itself from the same layout, so the names it loads and the names checked here
//! cannot drift apart.

use super::WanVaeConfig;
use crate::families::TensorSpec;

/// How an up block's resampler scales.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Upsample {
    /// `upsample2d`: nearest 2× in space, then a 3×3 conv that halves the channels.
    Spatial,
    /// `upsample3d`: first a causal time conv that doubles the frames, then as `Spatial`.
    SpatioTemporal,
}

/// One `WanUpBlock`: `num_res_blocks + 1` residual blocks, then maybe a resampler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpBlockLayout {
    /// (in, out) channels of each residual block.
    pub resnets: Vec<(usize, usize)>,
    /// The block's width (its resnets' output); the resampler halves it.
    pub dim: usize,
    pub upsample: Option<Upsample>,
}

/// `WanDecoder3d`: conv_in to `mid` channels, the mid block, the up blocks, the head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecoderLayout {
    pub z_dim: usize,
    pub mid: usize,
    pub up_blocks: Vec<UpBlockLayout>,
    /// Width of the head (the last up block's).
    pub head: usize,
    pub out_channels: usize,
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
    /// The decoder's layers (diffusers' non-residual `WanDecoder3d`).
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
        let mut up_blocks = Vec::with_capacity(n);
        for i in 0..n {
            // Every block after the first takes the previous resampler's halved output.
            let mut cin = if i > 0 { dims[i] / 2 } else { dims[i] };
            let dim = dims[i + 1];
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
            up_blocks.push(UpBlockLayout {
                resnets,
                dim,
                upsample,
            });
        }
        DecoderLayout {
            z_dim: self.z_dim,
            mid: dims[0],
            head: dims[n],
            up_blocks,
            out_channels: self.out_channels,
        }
    }

    /// The encoder's `down_blocks` entries, in order (diffusers' non-residual encoder).
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
        for (i, layer) in self.encoder_layers().iter().enumerate() {
            let prefix = format!("encoder.down_blocks.{i}");
            match *layer {
                EncoderLayer::Residual { cin, cout } => residual(&mut out, &prefix, cin, cout),
                EncoderLayer::Attention { dim } => attention(&mut out, &prefix, dim),
                EncoderLayer::Downsample { dim, temporal } => {
                    conv2d(&mut out, &format!("{prefix}.resample.1"), dim, dim);
                    if temporal {
                        conv3d(
                            &mut out,
                            &format!("{prefix}.time_conv"),
                            dim,
                            dim,
                            [3, 1, 1],
                        );
                    }
                }
            }
        }
        mid_block(&mut out, "encoder.mid_block", top);
        rms(&mut out, "encoder.norm_out", top, false);
        conv3d(&mut out, "encoder.conv_out", top, z2, [3, 3, 3]);
        conv3d(&mut out, "quant_conv", z2, z2, [1, 1, 1]);
        out.extend(self.decoder_specs());
        out
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
                let up = format!("{prefix}.upsamplers.0");
                conv2d(
                    &mut out,
                    &format!("{up}.resample.1"),
                    block.dim,
                    block.dim / 2,
                );
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

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, HashSet};

    use super::*;

    fn map(specs: &[TensorSpec]) -> BTreeMap<&str, &[usize]> {
        specs
            .iter()
            .map(|s| (s.name.as_str(), s.shape.as_slice()))
            .collect()
    }

    #[test]
    fn wan21_matches_the_published_checkpoint() {
        // diffusers 0.42.1's AutoencoderKLWan() state dict: 194 tensors, 126,892,531
        // parameters (the Wan2.1 VAE's 127M).
        let cfg = WanVaeConfig::wan21();
        let specs = cfg.tensor_specs();
        assert_eq!(specs.len(), 194);
        assert_eq!(
            specs.iter().map(TensorSpec::numel).sum::<usize>(),
            126_892_531
        );
        let names: HashSet<_> = specs.iter().map(|s| &s.name).collect();
        assert_eq!(names.len(), specs.len(), "names are unique");
        let m = map(&specs);
        for (name, shape) in [
            ("encoder.conv_in.weight", &[96, 3, 3, 3, 3][..]),
            ("encoder.down_blocks.2.resample.1.weight", &[96, 96, 3, 3]),
            (
                "encoder.down_blocks.3.conv_shortcut.weight",
                &[192, 96, 1, 1, 1],
            ),
            (
                "encoder.down_blocks.5.time_conv.weight",
                &[192, 192, 3, 1, 1],
            ),
            ("encoder.down_blocks.10.norm2.gamma", &[384, 1, 1, 1]),
            ("encoder.conv_out.weight", &[32, 384, 3, 3, 3]),
            ("quant_conv.weight", &[32, 32, 1, 1, 1]),
            ("post_quant_conv.weight", &[16, 16, 1, 1, 1]),
            ("decoder.conv_in.weight", &[384, 16, 3, 3, 3]),
            ("decoder.mid_block.attentions.0.norm.gamma", &[384, 1, 1]),
            (
                "decoder.mid_block.attentions.0.to_qkv.weight",
                &[1152, 384, 1, 1],
            ),
            (
                "decoder.up_blocks.0.upsamplers.0.time_conv.weight",
                &[768, 384, 3, 1, 1],
            ),
            (
                "decoder.up_blocks.0.upsamplers.0.resample.1.weight",
                &[192, 384, 3, 3],
            ),
            (
                "decoder.up_blocks.1.resnets.0.conv1.weight",
                &[384, 192, 3, 3, 3],
            ),
            (
                "decoder.up_blocks.1.resnets.0.conv_shortcut.weight",
                &[384, 192, 1, 1, 1],
            ),
            (
                "decoder.up_blocks.2.upsamplers.0.resample.1.weight",
                &[96, 192, 3, 3],
            ),
            (
                "decoder.up_blocks.3.resnets.2.conv2.weight",
                &[96, 96, 3, 3, 3],
            ),
            ("decoder.norm_out.gamma", &[96, 1, 1, 1]),
            ("decoder.conv_out.weight", &[3, 96, 3, 3, 3]),
        ] {
            assert_eq!(m.get(name).copied(), Some(shape), "{name}");
        }
        for absent in [
            "encoder.down_blocks.2.time_conv.weight",
            "decoder.up_blocks.2.upsamplers.0.time_conv.weight",
            "decoder.up_blocks.3.upsamplers.0.resample.1.weight",
            "decoder.up_blocks.0.resnets.0.conv_shortcut.weight",
        ] {
            assert!(!m.contains_key(absent), "{absent}");
        }
        // The decoder's part: post_quant_conv and decoder.* only, all of them.
        let dec = cfg.decoder_specs();
        assert!(dec
            .iter()
            .all(|s| s.name.starts_with("decoder.") || s.name.starts_with("post_quant_conv.")));
        let in_full = specs
            .iter()
            .filter(|s| s.name.starts_with("decoder.") || s.name.starts_with("post_quant_conv."))
            .count();
        assert_eq!(dec.len(), in_full);
    }

    #[test]
    fn tiny_matches_diffusers_test_config() {
        // 146 tensors, 13,861 parameters in diffusers 0.42.1.
        let specs = WanVaeConfig::tiny().tensor_specs();
        assert_eq!(specs.len(), 146);
        assert_eq!(specs.iter().map(TensorSpec::numel).sum::<usize>(), 13_861);
        let m = map(&specs);
        assert_eq!(
            m["decoder.up_blocks.1.resnets.0.norm1.gamma"],
            &[1, 1, 1, 1]
        );
        assert_eq!(
            m["decoder.up_blocks.0.upsamplers.0.resample.1.weight"],
            &[1, 3, 3, 3]
        );
    }

    #[test]
    fn attention_scales_and_decoder_width_follow_diffusers() {
        // AutoencoderKLWan(base_dim=4, z_dim=4, dim_mult=[1,2,2], num_res_blocks=1,
        // attn_scales=[0.5, 1.0], temperal_downsample=[True, False]): 128 tensors, 41,971
        // parameters; with decoder_base_dim=8, num_res_blocks=2, no attention: 154 and
        // 150,747.
        let cfg = WanVaeConfig {
            base_dim: 4,
            z_dim: 4,
            dim_mult: vec![1, 2, 2],
            num_res_blocks: 1,
            attn_scales: vec![0.5, 1.0],
            temperal_downsample: vec![true, false],
            latents_mean: vec![0.0; 4],
            latents_std: vec![1.0; 4],
            scale_factor_spatial: Some(4),
            scale_factor_temporal: Some(2),
            ..WanVaeConfig::wan21()
        };
        cfg.validate(std::path::Path::new("config.json")).unwrap();
        let specs = cfg.tensor_specs();
        assert_eq!(specs.len(), 128);
        assert_eq!(specs.iter().map(TensorSpec::numel).sum::<usize>(), 41_971);
        let m = map(&specs);
        assert_eq!(m["encoder.down_blocks.1.to_qkv.weight"], &[12, 4, 1, 1]);
        assert_eq!(
            m["encoder.down_blocks.2.time_conv.weight"],
            &[4, 4, 3, 1, 1]
        );
        assert_eq!(m["encoder.down_blocks.4.to_qkv.weight"], &[24, 8, 1, 1]);
        assert_eq!(
            m["decoder.up_blocks.1.upsamplers.0.time_conv.weight"],
            &[16, 8, 3, 1, 1]
        );

        let wide = WanVaeConfig {
            decoder_base_dim: Some(8),
            num_res_blocks: 2,
            attn_scales: vec![],
            ..cfg
        };
        let specs = wide.tensor_specs();
        assert_eq!(specs.len(), 154);
        assert_eq!(specs.iter().map(TensorSpec::numel).sum::<usize>(), 150_747);
        assert_eq!(map(&specs)["decoder.conv_in.weight"], &[16, 4, 3, 3, 3]);
    }
}
