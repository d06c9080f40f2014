//! Qwen-Image's VAE, `AutoencoderKLQwenImage`: the Wan 2.1 VAE under another class name,
//! with the same tensors (names and shapes) and a smaller config (`input_channels` for both
//! ends, no patches, no residual blocks). It is read into a [`WanVaeConfig`] so that Wan's
//! specs and decoder serve it unchanged.

use std::path::Path;

use serde::Deserialize;

use crate::components::wan_vae::WanVaeConfig;
use crate::{Error, Result};

/// The class diffusers writes in `vae/config.json`.
pub const CLASS_NAME: &str = "AutoencoderKLQwenImage";

/// Every field `AutoencoderKLQwenImage` registers, with its defaults (the published model's).
#[derive(Debug, Deserialize)]
#[serde(default)]
struct QwenImageVaeConfig {
    #[serde(rename = "_class_name")]
    class_name: String,
    base_dim: usize,
    z_dim: usize,
    dim_mult: Vec<usize>,
    num_res_blocks: usize,
    attn_scales: Vec<f64>,
    temperal_downsample: Vec<bool>,
    dropout: f64,
    input_channels: usize,
    latents_mean: Option<Vec<f64>>,
    latents_std: Option<Vec<f64>>,
}

impl Default for QwenImageVaeConfig {
    fn default() -> Self {
        QwenImageVaeConfig {
            class_name: String::new(),
            base_dim: 96,
            z_dim: 16,
            dim_mult: vec![1, 2, 4, 4],
            num_res_blocks: 2,
            attn_scales: Vec::new(),
            temperal_downsample: vec![false, true, true],
            dropout: 0.0,
            input_channels: 3,
            latents_mean: None,
            latents_std: None,
        }
    }
}

/// Reads `vae/config.json` of a Qwen-Image folder as the Wan VAE config it is, and checks it
/// as Wan's is checked (errors name `path` and the field).
pub fn load(path: &Path) -> Result<WanVaeConfig> {
    let q: QwenImageVaeConfig = crate::checkpoint::read_json(path)?;
    if q.class_name != CLASS_NAME {
        return Err(Error::config(
            path,
            "_class_name",
            format!("expected {CLASS_NAME}, found {:?}", q.class_name),
        ));
    }
    let defaults = WanVaeConfig::wan21();
    let cfg = WanVaeConfig {
        base_dim: q.base_dim,
        decoder_base_dim: None,
        z_dim: q.z_dim,
        dim_mult: q.dim_mult,
        num_res_blocks: q.num_res_blocks,
        attn_scales: q.attn_scales,
        temperal_downsample: q.temperal_downsample,
        dropout: q.dropout,
        latents_mean: q.latents_mean.unwrap_or(defaults.latents_mean.clone()),
        latents_std: q.latents_std.unwrap_or(defaults.latents_std.clone()),
        is_residual: false,
        in_channels: q.input_channels,
        out_channels: q.input_channels,
        patch_size: None,
        // Not in this class's config: the layers say it, and the pipeline reads the layers.
        scale_factor_temporal: None,
        scale_factor_spatial: None,
        ..defaults
    };
    cfg.validate(path)?;
    Ok(cfg)
}

/// The `config.json` diffusers writes for an `AutoencoderKLQwenImage` of `cfg`'s shape (what
/// `synth` writes; [`load`] reads it back to `cfg`).
pub fn to_json(cfg: &WanVaeConfig) -> serde_json::Value {
    serde_json::json!({
        "_class_name": CLASS_NAME,
        "_diffusers_version": crate::components::wan_vae::DIFFUSERS_VERSION,
        "base_dim": cfg.base_dim,
        "z_dim": cfg.z_dim,
        "dim_mult": cfg.dim_mult,
        "num_res_blocks": cfg.num_res_blocks,
        "attn_scales": cfg.attn_scales,
        "temperal_downsample": cfg.temperal_downsample,
        "dropout": cfg.dropout,
        "input_channels": cfg.in_channels,
        "latents_mean": cfg.latents_mean,
        "latents_std": cfg.latents_std,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("layerwise-qvae-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d.join("config.json")
    }

    #[test]
    fn the_committed_vae_reads_as_wan_21_and_round_trips() {
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/qwen-image-tiny/vae/config.json");
        let cfg = load(&fixture).unwrap();
        assert_eq!((cfg.z_dim, cfg.base_dim, cfg.upscale()), (16, 8, 8));
        assert_eq!((cfg.in_channels, cfg.out_channels, cfg.patch()), (3, 3, 1));
        let p = dir("round");
        std::fs::write(&p, to_json(&cfg).to_string()).unwrap();
        assert_eq!(load(&p).unwrap(), cfg);
    }

    #[test]
    fn refusals_name_the_field() {
        let mut doc = to_json(&WanVaeConfig::wan21());
        doc["_class_name"] = "AutoencoderKLWan".into();
        let p = dir("class");
        std::fs::write(&p, doc.to_string()).unwrap();
        let e = load(&p).unwrap_err().to_string();
        assert!(e.contains("`_class_name`") && e.contains(CLASS_NAME), "{e}");
        let mut doc = to_json(&WanVaeConfig::wan21());
        doc["latents_mean"] = serde_json::json!([0.0, 1.0]);
        std::fs::write(&p, doc.to_string()).unwrap();
        let e = load(&p).unwrap_err().to_string();
        assert!(e.contains("`latents_mean`"), "{e}");
    }
}
