//! A DiT pipeline folder opened and checked from its headers and configs alone: the
//! transformer and VAE configs, and every tensor's name, shape and dtype against what
//! the configs imply. Nothing here reads weight data.

use std::path::{Path, PathBuf};

use crate::checkpoint::check::check_tensors;
use crate::checkpoint::{Component, ModelFolder};
use crate::families::autoencoder_kl::{legacy_attention_alias, VaeConfig};
use crate::families::dit::DitConfig;
use crate::{Error, Result};

/// A checked DiT pipeline folder.
#[derive(Debug, Clone)]
pub struct DitCheckpoint {
    pub folder: ModelFolder,
    pub config: DitConfig,
    pub vae_config: VaeConfig,
    pub transformer: Component,
    pub vae: Component,
}

impl DitCheckpoint {
    /// Opens `root` and checks every tensor against the configs.
    pub fn open(root: &Path) -> Result<DitCheckpoint> {
        let folder = ModelFolder::new(root)?;
        let config = DitConfig::load(&folder.transformer().join("config.json"))?;
        let vae_config = VaeConfig::load(&folder.vae().join("config.json"))?;
        let transformer = Component::open(&folder.transformer())?;
        let vae = Component::open(&folder.vae())?;
        check_block_count(&transformer, &config)?;
        check_tensors(&transformer, &config.all_specs(), |_| None)?;
        check_tensors(&vae, &vae_config.tensor_specs(), legacy_attention_alias)?;
        Ok(DitCheckpoint {
            folder,
            config,
            vae_config,
            transformer,
            vae,
        })
    }

    pub fn root(&self) -> &PathBuf {
        &self.folder.root
    }
}

/// A config whose depth disagrees with the weights gets one clear message, rather than
/// a missing-tensor error for the first absent block.
fn check_block_count(c: &Component, cfg: &DitConfig) -> Result<()> {
    let found = c
        .index
        .keys()
        .filter_map(|n| DitConfig::block_of(n))
        .max()
        .map_or(0, |m| m + 1);
    if found != cfg.num_layers {
        return Err(Error::config(
            c.dir.join("config.json"),
            "num_layers",
            format!(
                "says {} but the weights hold {found} blocks",
                cfg.num_layers
            ),
        ));
    }
    Ok(())
}
