//! The AutoencoderKL config's presets, parsing, checks and tensor names.

use std::path::Path;

use layerwise_core::family::TensorSpec;

use super::*;

fn path() -> &'static Path {
    Path::new("vae/config.json")
}

#[test]
fn presets_validate_and_upscale_by_eight() {
    for cfg in [VaeConfig::tiny(), VaeConfig::sd()] {
        cfg.validate(path()).unwrap();
        assert_eq!(cfg.upscale(), 8);
    }
}

#[test]
fn sd_preset_matches_the_released_checkpoint() {
    // sd-vae-ft-ema: 83,653,863 parameters in 248 tensors, 49,490,199 of them in
    // post_quant_conv + decoder.
    let specs = VaeConfig::sd().tensor_specs();
    assert_eq!(specs.len(), 248);
    assert_eq!(
        specs.iter().map(TensorSpec::numel).sum::<usize>(),
        83_653_863
    );
    let dec = VaeConfig::sd().decoder_tensor_specs();
    assert_eq!(dec.iter().map(TensorSpec::numel).sum::<usize>(), 49_490_199);
    let find = |n: &str| specs.iter().find(|s| s.name == n).map(|s| s.shape.clone());
    assert_eq!(find("decoder.conv_in.weight"), Some(vec![512, 4, 3, 3]));
    assert_eq!(
        find("decoder.up_blocks.2.resnets.0.conv_shortcut.weight"),
        Some(vec![256, 512, 1, 1])
    );
    assert_eq!(
        find("decoder.up_blocks.3.resnets.2.conv2.weight"),
        Some(vec![128, 128, 3, 3])
    );
    assert_eq!(find("decoder.up_blocks.3.upsamplers.0.conv.weight"), None);
    assert_eq!(
        find("encoder.down_blocks.1.resnets.0.conv_shortcut.weight"),
        Some(vec![256, 128, 1, 1])
    );
    assert_eq!(
        find("encoder.down_blocks.3.downsamplers.0.conv.weight"),
        None
    );
    assert_eq!(find("encoder.conv_out.weight"), Some(vec![8, 512, 3, 3]));
    assert_eq!(find("quant_conv.weight"), Some(vec![8, 8, 1, 1]));
    assert_eq!(
        find("decoder.mid_block.attentions.0.to_out.0.weight"),
        Some(vec![512, 512])
    );
}

#[test]
fn names_are_unique() {
    let specs = VaeConfig::sd().tensor_specs();
    let names: std::collections::HashSet<_> = specs.iter().map(|s| &s.name).collect();
    assert_eq!(names.len(), specs.len());
}

#[test]
fn optional_parts_follow_the_flags() {
    let cfg = VaeConfig {
        use_quant_conv: false,
        use_post_quant_conv: false,
        mid_block_add_attention: false,
        ..VaeConfig::tiny()
    };
    let specs = cfg.tensor_specs();
    assert!(specs
        .iter()
        .all(|s| !s.name.contains("quant_conv") && !s.name.contains("attentions")));
}

#[test]
fn parses_a_diffusers_config_and_ignores_unknown_fields() {
    let json = r#"{
        "_class_name": "AutoencoderKL", "_diffusers_version": "0.12.0",
        "act_fn": "silu", "block_out_channels": [128, 256, 512, 512],
        "down_block_types": ["DownEncoderBlock2D", "DownEncoderBlock2D", "DownEncoderBlock2D", "DownEncoderBlock2D"],
        "in_channels": 3, "latent_channels": 4, "layers_per_block": 2, "norm_num_groups": 32,
        "out_channels": 3, "sample_size": 256, "force_upcast": true,
        "up_block_types": ["UpDecoderBlock2D", "UpDecoderBlock2D", "UpDecoderBlock2D", "UpDecoderBlock2D"]
    }"#;
    let cfg: VaeConfig = serde_json::from_str(json).unwrap();
    assert_eq!(cfg, VaeConfig::sd());
    let rect: VaeConfig =
        serde_json::from_str(r#"{"_class_name": "AutoencoderKL", "sample_size": [64, 96]}"#)
            .unwrap();
    assert_eq!(rect.sample_size, SampleSize::HeightWidth(vec![64, 96]));
}

#[test]
fn config_json_round_trips() {
    let value = VaeConfig::tiny().to_config_json();
    assert_eq!(value["_class_name"], "AutoencoderKL");
    assert!(value["_diffusers_version"].is_string());
    let back: VaeConfig = serde_json::from_value(value).unwrap();
    assert_eq!(back, VaeConfig::tiny());
}

#[test]
fn load_reads_and_rejects_files() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("config.json");
    std::fs::write(&file, VaeConfig::sd().to_config_json().to_string()).unwrap();
    assert_eq!(VaeConfig::load(&file).unwrap(), VaeConfig::sd());

    std::fs::write(
        &file,
        r#"{"_class_name": "AutoencoderKL", "layers_per_block": "two"}"#,
    )
    .unwrap();
    let err = VaeConfig::load(&file).unwrap_err().to_string();
    assert!(err.contains("layers_per_block"), "{err}");
    assert!(err.contains("config.json"), "{err}");

    let err = VaeConfig::load(&dir.path().join("missing.json"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("missing.json"), "{err}");
}

#[test]
fn validation_names_the_field() {
    let cases: Vec<(&str, VaeConfig)> = vec![
        (
            "_class_name",
            VaeConfig {
                class_name: "AutoencoderTiny".into(),
                ..VaeConfig::tiny()
            },
        ),
        (
            "act_fn",
            VaeConfig {
                act_fn: "gelu".into(),
                ..VaeConfig::tiny()
            },
        ),
        (
            "block_out_channels",
            VaeConfig {
                norm_num_groups: 32,
                ..VaeConfig::tiny()
            },
        ),
        (
            "block_out_channels",
            VaeConfig {
                block_out_channels: vec![],
                ..VaeConfig::tiny()
            },
        ),
        (
            "up_block_types",
            VaeConfig {
                up_block_types: vec!["UpDecoderBlock2D".into()],
                ..VaeConfig::tiny()
            },
        ),
        (
            "down_block_types",
            VaeConfig {
                down_block_types: vec!["AttnDownEncoderBlock2D".into(); 4],
                ..VaeConfig::tiny()
            },
        ),
        (
            "scaling_factor",
            VaeConfig {
                scaling_factor: 0.0,
                ..VaeConfig::tiny()
            },
        ),
        (
            "shift_factor",
            VaeConfig {
                shift_factor: Some(f64::NAN),
                ..VaeConfig::tiny()
            },
        ),
        (
            "layers_per_block",
            VaeConfig {
                layers_per_block: 0,
                ..VaeConfig::tiny()
            },
        ),
        (
            "sample_size",
            VaeConfig {
                sample_size: SampleSize::HeightWidth(vec![1]),
                ..VaeConfig::tiny()
            },
        ),
    ];
    for (field, cfg) in cases {
        let err = cfg.validate(path()).unwrap_err().to_string();
        assert!(err.contains(&format!("`{field}`")), "{field}: {err}");
    }
    let missing: VaeConfig = serde_json::from_str("{}").unwrap();
    let err = missing.validate(path()).unwrap_err().to_string();
    assert!(err.contains("_class_name"), "{err}");
}

#[test]
fn legacy_attention_names_map_both_ways() {
    let cases = [
        (
            "decoder.mid_block.attentions.0.to_q.weight",
            "decoder.mid_block.attentions.0.query.weight",
        ),
        (
            "decoder.mid_block.attentions.0.to_k.bias",
            "decoder.mid_block.attentions.0.key.bias",
        ),
        (
            "encoder.mid_block.attentions.0.to_v.weight",
            "encoder.mid_block.attentions.0.value.weight",
        ),
        (
            "decoder.mid_block.attentions.0.to_out.0.bias",
            "decoder.mid_block.attentions.0.proj_attn.bias",
        ),
    ];
    for (current, legacy) in cases {
        assert_eq!(legacy_attention_alias(current).as_deref(), Some(legacy));
        assert_eq!(current_attention_name(legacy).as_deref(), Some(current));
    }
    for other in [
        "decoder.mid_block.attentions.0.group_norm.weight",
        "decoder.conv_in.weight",
        "decoder.mid_block.attentions.x.to_q.weight",
        "to_q.weight",
    ] {
        assert_eq!(legacy_attention_alias(other), None, "{other}");
        assert_eq!(current_attention_name(other), None, "{other}");
    }
}

#[test]
fn shape_compatibility_accepts_one_by_one_convs_for_linears() {
    assert!(shape_compatible(&[16, 16], &[16, 16]));
    assert!(shape_compatible(&[16, 16], &[16, 16, 1, 1]));
    assert!(!shape_compatible(&[16, 16], &[16, 16, 3, 3]));
    assert!(!shape_compatible(&[16, 16, 1, 1], &[16, 16]));
    assert!(!shape_compatible(&[16], &[8]));
}
