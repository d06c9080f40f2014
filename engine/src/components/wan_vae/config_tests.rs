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
fn wan22_presets_validate_and_scale_by_sixteen_and_four() {
    for cfg in [WanVaeConfig::tiny22(), WanVaeConfig::wan22()] {
        cfg.validate(path()).unwrap();
        // 8× from the three upsampling levels, 2× from the patch.
        assert_eq!(cfg.upscale(), 16);
        assert_eq!(cfg.temporal_upscale(), 4);
        assert_eq!(cfg.patch(), 2);
        assert_eq!(cfg.video_channels(), 3);
    }
    assert_eq!(WanVaeConfig::wan21().patch(), 1);
    assert_eq!(WanVaeConfig::wan21().video_channels(), 3);
}

/// `Wan-AI/Wan2.2-TI2V-5B-Diffusers`' `vae/config.json` (as Cosmos3's VAE also has it), with
/// its `clip_output`, which diffusers 0.42.1 does not know and ignores.
const WAN22_JSON: &str = r#"{
    "_class_name": "AutoencoderKLWan", "attn_scales": [], "base_dim": 160,
    "clip_output": false, "decoder_base_dim": 256, "dim_mult": [1, 2, 4, 4],
    "dropout": 0.0, "in_channels": 12, "is_residual": true,
    "latents_mean": [-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
                     -0.1382, 0.0542, 0.2813, 0.0891, 0.157, -0.0098, 0.0375, -0.1825,
                     -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
                     -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.123,
                     -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.052, 0.3748,
                     0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667],
    "latents_std": [0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.499, 0.4818, 0.5013,
                    0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
                    0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
                    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
                    0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
                    0.3971, 1.06, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744],
    "num_res_blocks": 2, "out_channels": 12, "patch_size": 2,
    "scale_factor_spatial": 16, "scale_factor_temporal": 4,
    "temperal_downsample": [false, true, true], "z_dim": 48
}"#;

#[test]
fn parses_the_published_wan22_config() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("config.json");
    std::fs::write(&file, WAN22_JSON).unwrap();
    assert_eq!(WanVaeConfig::load(&file).unwrap(), WanVaeConfig::wan22());
    // And writes it back with its clip_output.
    let json = WanVaeConfig::wan22().to_json();
    assert_eq!(json["clip_output"], serde_json::Value::Bool(false));
    assert_eq!(json["patch_size"], 2);
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
        r#"{"_class_name": "AutoencoderKLWan", "patch_size": 4}"#,
    )
    .unwrap();
    let err = WanVaeConfig::load(&file).unwrap_err().to_string();
    assert!(err.contains("`patch_size`"), "{err}");
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
            "patch_size",
            WanVaeConfig {
                patch_size: Some(4),
                ..WanVaeConfig::tiny22()
            },
        ),
        (
            "patch_size",
            WanVaeConfig {
                patch_size: Some(0),
                ..tiny()
            },
        ),
        (
            "patch_size",
            WanVaeConfig {
                patch_size: Some(usize::MAX),
                ..tiny()
            },
        ),
        // Three channels are no whole 2×2 patch.
        (
            "out_channels",
            WanVaeConfig {
                patch_size: Some(2),
                scale_factor_spatial: None,
                ..tiny()
            },
        ),
        (
            "out_channels",
            WanVaeConfig {
                out_channels: 6,
                ..WanVaeConfig::tiny22()
            },
        ),
        // The patch is part of the spatial scale: 16 with it, not 8.
        (
            "scale_factor_spatial",
            WanVaeConfig {
                scale_factor_spatial: Some(8),
                ..WanVaeConfig::tiny22()
            },
        ),
        // Widths of 3 next to 9: a shortcut would regroup 3 × 8 channels by 9.
        (
            "dim_mult",
            WanVaeConfig {
                dim_mult: vec![1, 1, 3, 3],
                ..WanVaeConfig::tiny22()
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
    // What is computed is accepted: the identity patch, an explicit clamp or the published
    // Wan 2.2 configs' `false` (0.42.1 clamps regardless), no scale factors (derived from
    // the layers), a separate decoder width, the residual blocks and the patch apart.
    for cfg in [
        WanVaeConfig {
            patch_size: Some(1),
            clip_output: Some(true),
            ..tiny()
        },
        WanVaeConfig {
            clip_output: Some(false),
            ..tiny()
        },
        WanVaeConfig {
            is_residual: true,
            ..tiny()
        },
        WanVaeConfig {
            is_residual: false,
            ..WanVaeConfig::tiny22()
        },
        WanVaeConfig {
            patch_size: None,
            out_channels: 3,
            scale_factor_spatial: None,
            ..WanVaeConfig::tiny22()
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
