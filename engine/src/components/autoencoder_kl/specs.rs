//! The names and shapes of every tensor an AutoencoderKL checkpoint holds, as diffusers'
//! `save_pretrained` writes them: the encoder, the quant convs and the decoder.

use layerwise_core::family::TensorSpec;

use super::config::VaeConfig;
use super::names::ATTENTION_PROJECTIONS;

impl VaeConfig {
    /// Every tensor of the full AutoencoderKL (encoder, quant convs, decoder) under the
    /// names diffusers' `save_pretrained` writes today.
    pub fn tensor_specs(&self) -> Vec<TensorSpec> {
        let mut out = Vec::new();
        let blocks = &self.block_out_channels;
        let (first, last) = (blocks[0], blocks[blocks.len() - 1]);
        let latent = self.latent_channels;

        conv(&mut out, "encoder.conv_in", self.in_channels, first, 3);
        let mut channels = first;
        for (i, &c) in blocks.iter().enumerate() {
            for j in 0..self.layers_per_block {
                let cin = if j == 0 { channels } else { c };
                resnet(
                    &mut out,
                    &format!("encoder.down_blocks.{i}.resnets.{j}"),
                    cin,
                    c,
                );
            }
            if i + 1 < blocks.len() {
                conv(
                    &mut out,
                    &format!("encoder.down_blocks.{i}.downsamplers.0.conv"),
                    c,
                    c,
                    3,
                );
            }
            channels = c;
        }
        self.mid_block(&mut out, "encoder.mid_block", last);
        norm(&mut out, "encoder.conv_norm_out", last);
        // Mean and log-variance, hence twice the latent channels.
        conv(&mut out, "encoder.conv_out", last, 2 * latent, 3);
        if self.use_quant_conv {
            conv(&mut out, "quant_conv", 2 * latent, 2 * latent, 1);
        }
        self.decoder_specs_into(&mut out);
        out
    }

    /// The tensors decoding needs: `post_quant_conv` (when used) and `decoder.*`.
    pub fn decoder_tensor_specs(&self) -> Vec<TensorSpec> {
        let mut out = Vec::new();
        self.decoder_specs_into(&mut out);
        out
    }

    fn decoder_specs_into(&self, out: &mut Vec<TensorSpec>) {
        let blocks = &self.block_out_channels;
        let (first, last) = (blocks[0], blocks[blocks.len() - 1]);
        let latent = self.latent_channels;
        if self.use_post_quant_conv {
            conv(out, "post_quant_conv", latent, latent, 1);
        }
        conv(out, "decoder.conv_in", latent, last, 3);
        self.mid_block(out, "decoder.mid_block", last);
        let mut channels = last;
        for (i, &c) in blocks.iter().rev().enumerate() {
            for j in 0..=self.layers_per_block {
                let cin = if j == 0 { channels } else { c };
                resnet(out, &format!("decoder.up_blocks.{i}.resnets.{j}"), cin, c);
            }
            if i + 1 < blocks.len() {
                conv(
                    out,
                    &format!("decoder.up_blocks.{i}.upsamplers.0.conv"),
                    c,
                    c,
                    3,
                );
            }
            channels = c;
        }
        norm(out, "decoder.conv_norm_out", first);
        conv(out, "decoder.conv_out", first, self.out_channels, 3);
    }

    fn mid_block(&self, out: &mut Vec<TensorSpec>, prefix: &str, c: usize) {
        resnet(out, &format!("{prefix}.resnets.0"), c, c);
        if self.mid_block_add_attention {
            let attn = format!("{prefix}.attentions.0");
            norm(out, &format!("{attn}.group_norm"), c);
            for proj in ATTENTION_PROJECTIONS.iter().map(|(current, _)| current) {
                out.push(TensorSpec::new(format!("{attn}.{proj}.weight"), &[c, c]));
                out.push(TensorSpec::new(format!("{attn}.{proj}.bias"), &[c]));
            }
        }
        resnet(out, &format!("{prefix}.resnets.1"), c, c);
    }
}

fn conv(out: &mut Vec<TensorSpec>, prefix: &str, cin: usize, cout: usize, k: usize) {
    out.push(TensorSpec::new(
        format!("{prefix}.weight"),
        &[cout, cin, k, k],
    ));
    out.push(TensorSpec::new(format!("{prefix}.bias"), &[cout]));
}

fn norm(out: &mut Vec<TensorSpec>, prefix: &str, c: usize) {
    out.push(TensorSpec::new(format!("{prefix}.weight"), &[c]));
    out.push(TensorSpec::new(format!("{prefix}.bias"), &[c]));
}

fn resnet(out: &mut Vec<TensorSpec>, prefix: &str, cin: usize, cout: usize) {
    norm(out, &format!("{prefix}.norm1"), cin);
    conv(out, &format!("{prefix}.conv1"), cin, cout, 3);
    norm(out, &format!("{prefix}.norm2"), cout);
    conv(out, &format!("{prefix}.conv2"), cout, cout, 3);
    if cin != cout {
        conv(out, &format!("{prefix}.conv_shortcut"), cin, cout, 1);
    }
}
