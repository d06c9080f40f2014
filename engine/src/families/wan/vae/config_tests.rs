//! Tests of `WanVaeConfig`: parsing what diffusers writes, writing it back, presets, and
//! validation that names the field at fault.

use std::path::Path;

use super::*;

fn path() -> &'static Path {
    Path::new("vae/config.json")
}

#[test]
fn presets_validate_and_scale_by_eight_and_four() {
    for cfg in [WanVaeConfig::tiny(), WanVaeConfig::wan21()] {
        cfg.validate(path()).unwrap();
        assert_eq!(cfg.upscale(), 8);
        assert_eq!(cfg.temporal_upscale(), 4);
        assert_eq!(cfg.temperal_upsample(), vec![true, true, false]);
    }
}

#[test]
fn an_empty_config_means_the_wan21_vae() {
    let cfg: WanVaeConfig = serde_json::from_str(r#"{"_class_name": "AutoencoderKLWan"}"#).unwrap();
    assert_eq!(cfg, WanVaeConfig::wan21());
}

/// `AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1,1,1,1], num_res_blocks=1,
/// temperal_downsample=[False,True,True]).save_pretrained(...)` in diffusers 0.42.1.
const TINY_JSON: &str = r#"{
    "_class_name": "AutoencoderKLWan", "_diffusers_version": "0.42.1",
    "attn_scales": [], "base_dim": 3, "decoder_base_dim": null, "dim_mult": [1, 1, 1, 1],
    "dropout": 0.0, "in_channels": 3, "is_residual": false,
    "latents_mean": [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                     0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921],
    "latents_std": [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.916],
    "num_res_blocks": 1, "out_channels": 3, "patch_size": null,
    "scale_factor_spatial": 8, "scale_factor_temporal": 4,
    "temperal_downsample": [false, true, true], "z_dim": 16
}"#;

#[test]
fn parses_what_diffusers_writes_and_writes_it_back() {
    let cfg: WanVaeConfig = serde_json::from_str(TINY_JSON).unwrap();
    assert_eq!(cfg, WanVaeConfig::tiny());
    let ours = cfg.to_json();
    let theirs: serde_json::Value = serde_json::from_str(TINY_JSON).unwrap();
    assert_eq!(ours, theirs);
}

#[test]
fn load_reads_and_rejects_files() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("config.json");
    std::fs::write(&file, WanVaeConfig::wan21().to_json().to_string()).unwrap();
    assert_eq!(WanVaeConfig::load(&file).unwrap(), WanVaeConfig::wan21());
    std::fs::write(
        &file,
        r#"{"_class_name": "AutoencoderKLWan", "num_res_blocks": "two"}"#,
    )
    .unwrap();
    let err = WanVaeConfig::load(&file).unwrap_err().to_string();
    assert!(err.contains("config.json"), "{err}");
    std::fs::write(
        &file,
        r#"{"_class_name": "AutoencoderKLWan", "is_residual": true}"#,
    )
    .unwrap();
    let err = WanVaeConfig::load(&file).unwrap_err().to_string();
    assert!(err.contains("`is_residual`"), "{err}");
}

#[test]
fn validation_names_the_field() {
    let tiny = WanVaeConfig::tiny;
    let cases: Vec<(&str, WanVaeConfig)> = vec![
        (
            "_class_name",
            WanVaeConfig {
                class_name: "AutoencoderKL".into(),
                ..tiny()
            },
        ),
        (
            "is_residual",
            WanVaeConfig {
                is_residual: true,
                ..tiny()
            },
        ),
        (
            "patch_size",
            WanVaeConfig {
                patch_size: Some(2),
                ..tiny()
            },
        ),
        (
            "clip_output",
            WanVaeConfig {
                clip_output: Some(false),
                ..tiny()
            },
        ),
        (
            "base_dim",
            WanVaeConfig {
                base_dim: 0,
                ..tiny()
            },
        ),
        (
            "base_dim",
            WanVaeConfig {
                base_dim: 1,
                ..tiny()
            },
        ),
        (
            "decoder_base_dim",
            WanVaeConfig {
                decoder_base_dim: Some(1),
                ..tiny()
            },
        ),
        ("z_dim", WanVaeConfig { z_dim: 0, ..tiny() }),
        (
            "num_res_blocks",
            WanVaeConfig {
                num_res_blocks: 0,
                ..tiny()
            },
        ),
        (
            "out_channels",
            WanVaeConfig {
                out_channels: 0,
                ..tiny()
            },
        ),
        (
            "dim_mult",
            WanVaeConfig {
                dim_mult: vec![],
                ..tiny()
            },
        ),
        (
            "dim_mult",
            WanVaeConfig {
                dim_mult: vec![1, 0, 1, 1],
                ..tiny()
            },
        ),
        (
            "temperal_downsample",
            WanVaeConfig {
                temperal_downsample: vec![true],
                ..tiny()
            },
        ),
        (
            "attn_scales",
            WanVaeConfig {
                attn_scales: vec![f64::NAN],
                ..tiny()
            },
        ),
        (
            "dropout",
            WanVaeConfig {
                dropout: 2.0,
                ..tiny()
            },
        ),
        (
            "latents_mean",
            WanVaeConfig {
                latents_mean: vec![0.0; 4],
                ..tiny()
            },
        ),
        (
            "latents_std",
            WanVaeConfig {
                z_dim: 4,
                latents_mean: vec![0.0; 4],
                ..tiny()
            },
        ),
        (
            "latents_std",
            WanVaeConfig {
                latents_std: vec![0.0; 16],
                ..tiny()
            },
        ),
        (
            "scale_factor_spatial",
            WanVaeConfig {
                scale_factor_spatial: Some(16),
                ..tiny()
            },
        ),
        (
            "scale_factor_temporal",
            WanVaeConfig {
                temperal_downsample: vec![false, false, true],
                ..tiny()
            },
        ),
    ];
    for (field, cfg) in cases {
        let err = cfg.validate(path()).unwrap_err().to_string();
        assert!(err.contains(&format!("`{field}`")), "{field}: {err}");
    }
    // What is computed is accepted: the identity patch, an explicit clamp, no scale
    // factors (derived from the layers), a separate decoder width.
    for cfg in [
        WanVaeConfig {
            patch_size: Some(1),
            clip_output: Some(true),
            ..tiny()
        },
        WanVaeConfig {
            scale_factor_spatial: None,
            scale_factor_temporal: None,
            ..tiny()
        },
        WanVaeConfig {
            decoder_base_dim: Some(8),
            attn_scales: vec![1.0],
            ..tiny()
        },
    ] {
        cfg.validate(path()).unwrap();
    }
}
