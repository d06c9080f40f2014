//! The AutoencoderKL decoder: sampler latents in, images in [-1, 1] out. It follows
//! diffusers' `Decoder`, `UNetMidBlock2D`, `ResnetBlock2D`, `Attention` and `Upsample2D`
//! op for op so that its output matches diffusers' to float rounding (the parity test
//! under `tests/` holds it to that). The VAE is small next to the transformer, so it stays
//! resident and is loaded once through `Weights`.

use std::path::Path;

use candle_core::{DType, Module, Tensor};
use candle_nn::{GroupNorm, Linear};

use crate::components::autoencoder_kl::{
    legacy_attention_alias, shape_compatible, VaeConfig, NORM_EPS,
};
use crate::execution::weights::Weights;
use crate::{Error, Result};

/// Fetches tensors by full name, checks their shapes, and falls back to legacy names.
struct Loader<'a> {
    weights: &'a dyn Weights,
    origin: &'a Path,
}

impl Loader<'_> {
    fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let tensor = match self.weights.get(name) {
            Ok(t) => t,
            Err(first) => {
                let Some(legacy) = legacy_attention_alias(name) else {
                    return Err(first);
                };
                self.weights.get(&legacy).map_err(|second| {
                    Error::tensor(
                        self.origin,
                        name,
                        format!("{first}; legacy name `{legacy}`: {second}"),
                    )
                })?
            }
        };
        if !shape_compatible(shape, tensor.dims()) {
            return Err(Error::tensor(
                self.origin,
                name,
                format!("expected shape {shape:?}, found {:?}", tensor.dims()),
            ));
        }
        // A legacy 1×1-conv projection becomes the linear weight it is.
        Ok(tensor.reshape(shape)?.to_dtype(DType::F32)?)
    }

    fn conv(&self, prefix: &str, cin: usize, cout: usize, k: usize) -> Result<Conv> {
        Ok(Conv {
            weight: self.get(&format!("{prefix}.weight"), &[cout, cin, k, k])?,
            bias: self
                .get(&format!("{prefix}.bias"), &[cout])?
                .reshape((1, cout, 1, 1))?,
            padding: k / 2,
        })
    }

    fn norm(&self, prefix: &str, c: usize, groups: usize) -> Result<GroupNorm> {
        let weight = self.get(&format!("{prefix}.weight"), &[c])?;
        let bias = self.get(&format!("{prefix}.bias"), &[c])?;
        Ok(GroupNorm::new(weight, bias, c, groups, NORM_EPS)?)
    }

    fn linear(&self, prefix: &str, c: usize) -> Result<Linear> {
        let weight = self.get(&format!("{prefix}.weight"), &[c, c])?;
        let bias = self.get(&format!("{prefix}.bias"), &[c])?;
        Ok(Linear::new(weight, Some(bias)))
    }

    fn resnet(&self, prefix: &str, cin: usize, cout: usize, groups: usize) -> Result<ResnetBlock> {
        Ok(ResnetBlock {
            norm1: self.norm(&format!("{prefix}.norm1"), cin, groups)?,
            conv1: self.conv(&format!("{prefix}.conv1"), cin, cout, 3)?,
            norm2: self.norm(&format!("{prefix}.norm2"), cout, groups)?,
            conv2: self.conv(&format!("{prefix}.conv2"), cout, cout, 3)?,
            shortcut: if cin != cout {
                Some(self.conv(&format!("{prefix}.conv_shortcut"), cin, cout, 1)?)
            } else {
                None
            },
        })
    }

    fn attention(&self, prefix: &str, c: usize, groups: usize) -> Result<Attention> {
        Ok(Attention {
            norm: self.norm(&format!("{prefix}.group_norm"), c, groups)?,
            to_q: self.linear(&format!("{prefix}.to_q"), c)?,
            to_k: self.linear(&format!("{prefix}.to_k"), c)?,
            to_v: self.linear(&format!("{prefix}.to_v"), c)?,
            to_out: self.linear(&format!("{prefix}.to_out.0"), c)?,
            scale: 1.0 / (c as f64).sqrt(),
        })
    }
}

/// A stride-1 convolution with bias and "same" padding (kernels are 1 or 3).
struct Conv {
    weight: Tensor,
    bias: Tensor,
    padding: usize,
}

impl Conv {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.conv2d(&self.weight, self.padding, 1, 1, 1)?
            .broadcast_add(&self.bias)?)
    }
}

/// diffusers' `ResnetBlock2D` without a time embedding, output scale 1, dropout off.
struct ResnetBlock {
    norm1: GroupNorm,
    conv1: Conv,
    norm2: GroupNorm,
    conv2: Conv,
    shortcut: Option<Conv>,
}

impl ResnetBlock {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.conv1.forward(&self.norm1.forward(x)?.silu()?)?;
        let h = self.conv2.forward(&self.norm2.forward(&h)?.silu()?)?;
        let skip = match &self.shortcut {
            Some(conv) => conv.forward(x)?,
            None => x.clone(),
        };
        Ok((skip + h)?)
    }
}

/// diffusers' `Attention` as the VAE mid block builds it: one head as wide as the
/// channels, a GroupNorm in front, every pixel attending to every pixel, residual added.
struct Attention {
    norm: GroupNorm,
    to_q: Linear,
    to_k: Linear,
    to_v: Linear,
    to_out: Linear,
    scale: f64,
}

impl Attention {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (b, c, h, w) = x.dims4()?;
        // [B, C, H, W] -> [B, HW, C]: one token per pixel.
        let tokens = self
            .norm
            .forward(x)?
            .reshape((b, c, h * w))?
            .transpose(1, 2)?
            .contiguous()?;
        let q = self.to_q.forward(&tokens)?;
        let k = self.to_k.forward(&tokens)?;
        let v = self.to_v.forward(&tokens)?;
        let scores = (q.matmul(&k.t()?)? * self.scale)?;
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        let out = self.to_out.forward(&probs.matmul(&v)?)?;
        let out = out.transpose(1, 2)?.reshape((b, c, h, w))?;
        Ok((out + x)?)
    }
}

/// diffusers' `UpDecoderBlock2D`: resnets, then (except the last) a nearest 2× upsample
/// followed by a 3×3 conv.
struct UpBlock {
    resnets: Vec<ResnetBlock>,
    upsample: Option<Conv>,
}

impl UpBlock {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut x = x.clone();
        for resnet in &self.resnets {
            x = resnet.forward(&x)?;
        }
        if let Some(conv) = &self.upsample {
            let (_, _, h, w) = x.dims4()?;
            x = conv.forward(&x.upsample_nearest2d(2 * h, 2 * w)?)?;
        }
        Ok(x)
    }
}

/// The decoding half of an AutoencoderKL, resident on the compute device.
pub struct VaeDecoder {
    latent_channels: usize,
    out_channels: usize,
    upscale: usize,
    scaling_factor: f64,
    shift_factor: f64,
    post_quant_conv: Option<Conv>,
    conv_in: Conv,
    mid_resnet_in: ResnetBlock,
    mid_attention: Option<Attention>,
    mid_resnet_out: ResnetBlock,
    up_blocks: Vec<UpBlock>,
    norm_out: GroupNorm,
    conv_out: Conv,
}

impl VaeDecoder {
    /// Loads `post_quant_conv.*` and `decoder.*` by their full diffusers names. Errors name
    /// the tensor under the label `vae`; use `load_from` to name the checkpoint instead.
    pub fn load(cfg: &VaeConfig, w: &dyn Weights) -> Result<Self> {
        Self::load_from(cfg, w, Path::new("vae"))
    }

    /// As `load`, with `origin` (the checkpoint's path) labelling errors.
    pub fn load_from(cfg: &VaeConfig, w: &dyn Weights, origin: &Path) -> Result<Self> {
        let config_path = origin.join("config.json");
        cfg.validate(&config_path)?;
        let l = Loader { weights: w, origin };
        let g = cfg.norm_num_groups;
        let blocks = &cfg.block_out_channels;
        let (first, last) = (blocks[0], blocks[blocks.len() - 1]);
        let latent = cfg.latent_channels;

        let post_quant_conv = if cfg.use_post_quant_conv {
            Some(l.conv("post_quant_conv", latent, latent, 1)?)
        } else {
            None
        };
        let mid_attention = if cfg.mid_block_add_attention {
            Some(l.attention("decoder.mid_block.attentions.0", last, g)?)
        } else {
            None
        };
        let mut up_blocks = Vec::with_capacity(blocks.len());
        let mut channels = last;
        for (i, &c) in blocks.iter().rev().enumerate() {
            let resnets = (0..=cfg.layers_per_block)
                .map(|j| {
                    let cin = if j == 0 { channels } else { c };
                    l.resnet(&format!("decoder.up_blocks.{i}.resnets.{j}"), cin, c, g)
                })
                .collect::<Result<Vec<_>>>()?;
            let upsample = if i + 1 < blocks.len() {
                Some(l.conv(&format!("decoder.up_blocks.{i}.upsamplers.0.conv"), c, c, 3)?)
            } else {
                None
            };
            up_blocks.push(UpBlock { resnets, upsample });
            channels = c;
        }
        Ok(VaeDecoder {
            latent_channels: latent,
            out_channels: cfg.out_channels,
            upscale: cfg.upscale(),
            scaling_factor: cfg.scaling_factor,
            shift_factor: cfg.shift_factor.unwrap_or(0.0),
            post_quant_conv,
            conv_in: l.conv("decoder.conv_in", latent, last, 3)?,
            mid_resnet_in: l.resnet("decoder.mid_block.resnets.0", last, last, g)?,
            mid_attention,
            mid_resnet_out: l.resnet("decoder.mid_block.resnets.1", last, last, g)?,
            up_blocks,
            norm_out: l.norm("decoder.conv_norm_out", first, g)?,
            conv_out: l.conv("decoder.conv_out", first, cfg.out_channels, 3)?,
        })
    }

    /// Output pixels per latent, per side.
    pub fn upscale(&self) -> usize {
        self.upscale
    }

    /// Channels `decode` expects.
    pub fn latent_channels(&self) -> usize {
        self.latent_channels
    }

    /// Channels `decode` returns (3 for RGB).
    pub fn out_channels(&self) -> usize {
        self.out_channels
    }

    /// Decodes the sampler's latents [B, latent_channels, h, w] into images
    /// [B, out_channels, h·upscale, w·upscale], roughly in [-1, 1] and not clamped. The
    /// latents are in the sampler's space; this undoes `scaling_factor` (and adds
    /// `shift_factor`) itself, as diffusers' pipelines do before `vae.decode`.
    pub fn decode(&self, latents: &Tensor) -> Result<Tensor> {
        let dims = latents.dims();
        if dims.len() != 4 || dims[1] != self.latent_channels || dims[2] == 0 || dims[3] == 0 {
            return Err(Error::bug(format!(
                "latents: expected [batch, {}, height, width], found {dims:?}",
                self.latent_channels
            )));
        }
        let z = latents
            .to_dtype(DType::F32)?
            .affine(1.0 / self.scaling_factor, self.shift_factor)?;
        let z = match &self.post_quant_conv {
            Some(conv) => conv.forward(&z)?,
            None => z,
        };
        let mut x = self.conv_in.forward(&z)?;
        x = self.mid_resnet_in.forward(&x)?;
        if let Some(attention) = &self.mid_attention {
            x = attention.forward(&x)?;
        }
        x = self.mid_resnet_out.forward(&x)?;
        for block in &self.up_blocks {
            x = block.forward(&x)?;
        }
        self.conv_out.forward(&self.norm_out.forward(&x)?.silu()?)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use candle_core::Device;
    use rand::rngs::StdRng;
    use rand::SeedableRng;
    use rand_distr::{Distribution, Normal};

    use super::*;
    use crate::components::autoencoder_kl::current_attention_name;
    use layerwise_core::family::TensorSpec;

    /// Seeded weights that keep activations near unit scale through the whole decoder.
    fn random_weights(specs: &[TensorSpec], seed: u64) -> HashMap<String, Tensor> {
        let mut rng = StdRng::seed_from_u64(seed);
        specs
            .iter()
            .map(|spec| {
                let is_norm = spec.name.contains("norm");
                let (mean, std) = match spec.shape.len() {
                    1 if is_norm && spec.name.ends_with(".weight") => (1.0, 0.1),
                    1 => (0.0, 0.05),
                    _ => (
                        0.0,
                        1.0 / (spec.numel() as f64 / spec.shape[0] as f64).sqrt(),
                    ),
                };
                let normal = Normal::new(mean as f32, std as f32).unwrap();
                let data: Vec<f32> = (0..spec.numel()).map(|_| normal.sample(&mut rng)).collect();
                let t = Tensor::from_vec(data, spec.shape.as_slice(), &Device::Cpu).unwrap();
                (spec.name.clone(), t)
            })
            .collect()
    }

    fn latents(cfg: &VaeConfig, b: usize, h: usize, w: usize) -> Tensor {
        let mut rng = StdRng::seed_from_u64(7);
        let normal = Normal::new(0.0f32, 1.0).unwrap();
        let data: Vec<f32> = (0..b * cfg.latent_channels * h * w)
            .map(|_| normal.sample(&mut rng))
            .collect();
        Tensor::from_vec(data, (b, cfg.latent_channels, h, w), &Device::Cpu).unwrap()
    }

    use crate::testing::max_abs_diff;

    #[test]
    fn decodes_to_the_upscaled_shape_deterministically() {
        let cfg = VaeConfig::tiny();
        let w = random_weights(&cfg.decoder_tensor_specs(), 1);
        let vae = VaeDecoder::load(&cfg, &w).unwrap();
        let z = latents(&cfg, 2, 8, 6);
        let a = vae.decode(&z).unwrap();
        assert_eq!(a.dims(), &[2, 3, 64, 48]);
        let again = VaeDecoder::load(&cfg, &w).unwrap().decode(&z).unwrap();
        assert_eq!(max_abs_diff(&a, &again), 0.0);
        let values: Vec<f32> = a.flatten_all().unwrap().to_vec1().unwrap();
        assert!(values.iter().all(|v| v.is_finite()));
        // Seeded weights must give a non-trivial image, or the other tests prove nothing.
        let spread = values.iter().cloned().fold(f32::MIN, f32::max)
            - values.iter().cloned().fold(f32::MAX, f32::min);
        assert!(spread > 0.1, "spread {spread}");
    }

    #[test]
    fn batch_items_decode_independently() {
        let cfg = VaeConfig::tiny();
        let vae = VaeDecoder::load(&cfg, &random_weights(&cfg.decoder_tensor_specs(), 2)).unwrap();
        let z = latents(&cfg, 2, 4, 4);
        let both = vae.decode(&z).unwrap();
        let second = vae.decode(&z.narrow(0, 1, 1).unwrap()).unwrap();
        assert!(max_abs_diff(&both.narrow(0, 1, 1).unwrap(), &second) < 1e-5);
    }

    #[test]
    fn scaling_and_shift_are_applied_before_decoding() {
        let cfg = VaeConfig {
            shift_factor: Some(0.25),
            scaling_factor: 0.5,
            ..VaeConfig::tiny()
        };
        let w = random_weights(&cfg.decoder_tensor_specs(), 3);
        let shifted = VaeDecoder::load(&cfg, &w).unwrap();
        let plain = VaeDecoder::load(
            &VaeConfig {
                shift_factor: None,
                scaling_factor: 1.0,
                ..cfg.clone()
            },
            &w,
        )
        .unwrap();
        let z = latents(&cfg, 1, 4, 4);
        let expected = plain
            .decode(&((&z * 2.0).unwrap() + 0.25).unwrap())
            .unwrap();
        assert!(max_abs_diff(&shifted.decode(&z).unwrap(), &expected) < 1e-5);
    }

    #[test]
    fn legacy_attention_names_decode_the_same() {
        let cfg = VaeConfig::tiny();
        let current = random_weights(&cfg.decoder_tensor_specs(), 4);
        let legacy: HashMap<String, Tensor> = current
            .iter()
            .map(|(name, t)| match legacy_attention_alias(name) {
                // Weights as 1×1 convs, biases as they are: both legacy forms at once.
                Some(old) if t.rank() == 2 => (old, t.unsqueeze(2).unwrap().unsqueeze(3).unwrap()),
                Some(old) => (old, t.clone()),
                None => (name.clone(), t.clone()),
            })
            .collect();
        assert!(legacy.keys().any(|n| current_attention_name(n).is_some()));
        let z = latents(&cfg, 1, 8, 8);
        let a = VaeDecoder::load(&cfg, &current)
            .unwrap()
            .decode(&z)
            .unwrap();
        let b = VaeDecoder::load(&cfg, &legacy).unwrap().decode(&z).unwrap();
        assert_eq!(max_abs_diff(&a, &b), 0.0);
    }

    #[test]
    fn a_bad_shape_names_the_tensor() {
        let cfg = VaeConfig::tiny();
        let mut w = random_weights(&cfg.decoder_tensor_specs(), 5);
        let name = "decoder.up_blocks.3.resnets.0.conv_shortcut.weight";
        w.insert(
            name.into(),
            Tensor::zeros((8, 16, 3, 3), DType::F32, &Device::Cpu).unwrap(),
        );
        let err = VaeDecoder::load(&cfg, &w)
            .err()
            .expect("bad shape must fail")
            .to_string();
        assert!(err.contains(name) && err.contains("[8, 16, 1, 1]"), "{err}");
    }

    #[test]
    fn a_missing_tensor_names_both_names() {
        let cfg = VaeConfig::tiny();
        let mut w = random_weights(&cfg.decoder_tensor_specs(), 6);
        w.remove("decoder.mid_block.attentions.0.to_k.bias");
        let err = VaeDecoder::load(&cfg, &w)
            .err()
            .expect("missing tensor must fail")
            .to_string();
        assert!(
            err.contains("to_k.bias") && err.contains("key.bias"),
            "{err}"
        );
    }

    #[test]
    fn bad_latents_are_rejected() {
        let cfg = VaeConfig::tiny();
        let vae = VaeDecoder::load(&cfg, &random_weights(&cfg.decoder_tensor_specs(), 7)).unwrap();
        let z = Tensor::zeros((1, 3, 4, 4), DType::F32, &Device::Cpu).unwrap();
        let err = vae.decode(&z).unwrap_err().to_string();
        assert!(err.contains("latents"), "{err}");
    }
}
