//! Tests of the layouts and tensor specs: the names, shapes and counts diffusers 0.42.1's
//! `AutoencoderKLWan` state dict has for the published VAEs and the test configs.

use std::collections::{BTreeMap, HashSet};

use super::*;
use layerwise_core::family::TensorSpec;

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
fn wan22_matches_the_published_checkpoint() {
    // diffusers 0.42.1's AutoencoderKLWan(**Wan2.2-TI2V-5B's config) state dict: 196
    // tensors, 704,688,668 parameters; the decoder's part 110 and 555,051,580.
    let cfg = WanVaeConfig::wan22();
    let specs = cfg.tensor_specs();
    assert_eq!(specs.len(), 196);
    assert_eq!(
        specs.iter().map(TensorSpec::numel).sum::<usize>(),
        704_688_668
    );
    let names: HashSet<_> = specs.iter().map(|s| &s.name).collect();
    assert_eq!(names.len(), specs.len(), "names are unique");
    let dec = cfg.decoder_specs();
    assert_eq!(dec.len(), 110);
    assert_eq!(
        dec.iter().map(TensorSpec::numel).sum::<usize>(),
        555_051_580
    );
    let m = map(&specs);
    for (name, shape) in [
        ("encoder.conv_in.weight", &[160, 12, 3, 3, 3][..]),
        (
            "encoder.down_blocks.0.resnets.1.conv2.weight",
            &[160, 160, 3, 3, 3],
        ),
        (
            "encoder.down_blocks.0.downsampler.resample.1.weight",
            &[160, 160, 3, 3],
        ),
        (
            "encoder.down_blocks.1.downsampler.time_conv.weight",
            &[320, 320, 3, 1, 1],
        ),
        (
            "encoder.down_blocks.1.resnets.0.conv_shortcut.weight",
            &[320, 160, 1, 1, 1],
        ),
        (
            "encoder.down_blocks.3.resnets.1.norm2.gamma",
            &[640, 1, 1, 1],
        ),
        ("encoder.conv_out.weight", &[96, 640, 3, 3, 3]),
        ("quant_conv.weight", &[96, 96, 1, 1, 1]),
        ("post_quant_conv.weight", &[48, 48, 1, 1, 1]),
        ("decoder.conv_in.weight", &[1024, 48, 3, 3, 3]),
        (
            "decoder.mid_block.attentions.0.to_qkv.weight",
            &[3072, 1024, 1, 1],
        ),
        (
            "decoder.up_blocks.0.upsampler.time_conv.weight",
            &[2048, 1024, 3, 1, 1],
        ),
        // The residual resampler keeps the width.
        (
            "decoder.up_blocks.0.upsampler.resample.1.weight",
            &[1024, 1024, 3, 3],
        ),
        (
            "decoder.up_blocks.1.upsampler.time_conv.weight",
            &[2048, 1024, 3, 1, 1],
        ),
        (
            "decoder.up_blocks.2.upsampler.resample.1.weight",
            &[512, 512, 3, 3],
        ),
        (
            "decoder.up_blocks.2.resnets.0.conv_shortcut.weight",
            &[512, 1024, 1, 1, 1],
        ),
        (
            "decoder.up_blocks.3.resnets.0.conv_shortcut.weight",
            &[256, 512, 1, 1, 1],
        ),
        (
            "decoder.up_blocks.3.resnets.2.conv2.weight",
            &[256, 256, 3, 3, 3],
        ),
        ("decoder.norm_out.gamma", &[256, 1, 1, 1]),
        // Four pixels of RGB per position.
        ("decoder.conv_out.weight", &[12, 256, 3, 3, 3]),
    ] {
        assert_eq!(m.get(name).copied(), Some(shape), "{name}");
    }
    for absent in [
        "decoder.up_blocks.0.upsamplers.0.resample.1.weight",
        "decoder.up_blocks.2.upsampler.time_conv.weight",
        "decoder.up_blocks.3.upsampler.resample.1.weight",
        "decoder.up_blocks.0.resnets.0.conv_shortcut.weight",
        "encoder.down_blocks.0.downsampler.time_conv.weight",
        "encoder.down_blocks.3.downsampler.resample.1.weight",
        "encoder.down_blocks.1.resnets.0.to_qkv.weight",
    ] {
        assert!(!m.contains_key(absent), "{absent}");
    }
    let layout = cfg.decoder_layout();
    let shortcuts: Vec<_> = layout.up_blocks.iter().map(|b| b.shortcut).collect();
    let dup = |cin, cout, factor_t| {
        Some(DupUpLayout {
            cin,
            cout,
            factor_t,
        })
    };
    assert_eq!(
        shortcuts,
        vec![
            dup(1024, 1024, 2),
            dup(1024, 1024, 2),
            dup(1024, 512, 1),
            None
        ]
    );
    assert_eq!(layout.patch, 2);
}

#[test]
fn tiny22_matches_diffusers_test_config() {
    // 140 tensors, 34,146 parameters in diffusers 0.42.1; the decoder 82 and 12,633.
    let cfg = WanVaeConfig::tiny22();
    let specs = cfg.tensor_specs();
    assert_eq!(specs.len(), 140);
    assert_eq!(specs.iter().map(TensorSpec::numel).sum::<usize>(), 34_146);
    let dec = cfg.decoder_specs();
    assert_eq!(dec.len(), 82);
    assert_eq!(dec.iter().map(TensorSpec::numel).sum::<usize>(), 12_633);
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
