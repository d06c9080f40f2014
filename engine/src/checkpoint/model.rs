//! A DiT pipeline folder opened and checked from its headers and configs alone: the
//! transformer and VAE configs, and every tensor's name, shape and dtype against what
//! the configs imply. Nothing here reads weight data.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use safetensors::Dtype;

use super::{Component, ModelFolder};
use crate::family::dit::DitConfig;
use crate::family::vae::{legacy_attention_alias, VaeConfig};
use crate::family::TensorSpec;
use crate::{Error, Result};

/// Dtypes the engine computes with (converted to f32 on the way into the math).
pub const WEIGHT_DTYPES: [Dtype; 3] = [Dtype::F32, Dtype::F16, Dtype::BF16];

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

/// Checks that `c` holds exactly `specs` (names, shapes, float dtypes). `alias` maps an
/// expected name to an older spelling that is accepted in its place.
pub fn check_tensors(
    c: &Component,
    specs: &[TensorSpec],
    alias: impl Fn(&str) -> Option<String>,
) -> Result<()> {
    let mut seen = BTreeSet::new();
    for spec in specs {
        let found = c
            .get(&spec.name)
            .map(|x| (spec.name.clone(), x))
            .or_else(|| alias(&spec.name).and_then(|a| c.get(&a).map(|x| (a, x))));
        let Some((name, (h, info))) = found else {
            return Err(Error::tensor(
                c.path_of(&spec.name),
                &spec.name,
                format!("missing (expected shape {:?})", spec.shape),
            ));
        };
        // Legacy 1×1-conv spellings of linear weights carry trailing unit dimensions.
        let squeezed: Vec<usize> = if name != spec.name {
            let mut s = info.shape.clone();
            while s.len() > spec.shape.len() && s.last() == Some(&1) {
                s.pop();
            }
            s
        } else {
            info.shape.clone()
        };
        if squeezed != spec.shape {
            return Err(Error::tensor(
                &h.path,
                &name,
                format!(
                    "shape {:?} disagrees with the config, which implies {:?}",
                    info.shape, spec.shape
                ),
            ));
        }
        if !WEIGHT_DTYPES.contains(&info.dtype) {
            return Err(Error::tensor(
                &h.path,
                &name,
                format!(
                    "dtype {:?} is not a float weight dtype (F32, F16, BF16)",
                    info.dtype
                ),
            ));
        }
        seen.insert(name);
    }
    if let Some(extra) = c.index.keys().find(|n| !seen.contains(*n)) {
        return Err(Error::tensor(
            c.path_of(extra),
            extra,
            "unexpected tensor: the config implies no such weight",
        ));
    }
    Ok(())
}
