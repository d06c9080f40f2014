//! Model families: what a family's checkpoint must contain (names, shapes), how each
//! component splits into prologue, blocks and epilogue, what its activations cost, and
//! (with the `runtime` feature) its math. Metadata is always built, without tensor math,
//! so the node agent can profile checkpoints.

pub mod attention;
pub mod autoencoder_kl;
pub mod dit;
#[cfg(feature = "runtime")]
pub mod fused;
pub mod umt5;
pub mod wan;

/// One tensor a family expects, by full name and shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
}

impl TensorSpec {
    pub fn new(name: impl Into<String>, shape: &[usize]) -> Self {
        TensorSpec {
            name: name.into(),
            shape: shape.to_vec(),
        }
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A group of structurally similar blocks in one component, streamed block by block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockGroup {
    /// What the group is: `transformer`, `text_encoder`, `transformer_2`.
    pub name: String,
    /// Block i's tensors are called `{prefix}{i}.{spec name}`.
    pub prefix: String,
    pub count: usize,
    /// One block's tensors, named relative to the block's prefix.
    pub block: Vec<TensorSpec>,
}

impl BlockGroup {
    pub fn block_prefix(&self, i: usize) -> String {
        format!("{}{i}.", self.prefix)
    }

    /// Every block's tensors with their full names, block after block.
    pub fn tensor_specs(&self) -> Vec<TensorSpec> {
        (0..self.count)
            .flat_map(|i| {
                let pre = self.block_prefix(i);
                self.block
                    .iter()
                    .map(move |s| TensorSpec::new(format!("{pre}{}", s.name), &s.shape))
            })
            .collect()
    }

    /// The block index a tensor name of this group's component belongs to, if any.
    pub fn block_of(&self, name: &str) -> Option<usize> {
        let rest = name.strip_prefix(&self.prefix)?;
        let (idx, _) = rest.split_once('.')?;
        idx.parse().ok()
    }
}

/// The family a pipeline folder holds, with its checked configs and component headers.
#[derive(Debug, Clone)]
pub enum Family {
    Dit(Box<dit::DitCheckpoint>),
    Wan(Box<wan::WanCheckpoint>),
}

/// A pipeline folder opened and checked from its headers and configs alone, whatever
/// its family: `model_index.json`'s `_class_name` chooses the family.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    pub root: std::path::PathBuf,
    pub family: Family,
}

/// Pipelines this build runs, by the `_class_name` diffusers writes in `model_index.json`.
pub const PIPELINES: [&str; 2] = ["DiTPipeline", "WanPipeline"];

/// The families this build opens, by the short name a profile's `family` and a
/// DiffusionDeployment's `model.family` use ([`Checkpoint::name`]), in the order of
/// [`PIPELINES`]. The node agent profiles exactly these.
pub const NAMES: [&str; 2] = ["dit", "wan"];

impl Checkpoint {
    pub fn open(root: &std::path::Path) -> crate::Result<Checkpoint> {
        let folder = crate::checkpoint::ModelFolder::new(root)?;
        let family = match folder.class_name.as_deref() {
            // Folders written before the class name was checked carry none: DiT's layout.
            Some("DiTPipeline") | None => Family::Dit(Box::new(dit::DitCheckpoint::open(root)?)),
            Some("WanPipeline") => Family::Wan(Box::new(wan::WanCheckpoint::open(root)?)),
            Some(other) => {
                return Err(crate::Error::config(
                    root.join("model_index.json"),
                    "_class_name",
                    format!(
                        "`{other}` is not a pipeline this engine runs (it runs {})",
                        PIPELINES.join(", ")
                    ),
                ))
            }
        };
        Ok(Checkpoint {
            root: root.to_path_buf(),
            family,
        })
    }

    /// The family's short name (`dit`, `wan`): one of [`NAMES`].
    pub fn name(&self) -> &'static str {
        match &self.family {
            Family::Dit(_) => NAMES[0],
            Family::Wan(_) => NAMES[1],
        }
    }

    /// Every component with weights, by its folder name, in pipeline order.
    pub fn components(&self) -> Vec<(&'static str, &crate::checkpoint::Component)> {
        match &self.family {
            Family::Dit(c) => vec![("transformer", &c.transformer), ("vae", &c.vae)],
            Family::Wan(c) => c.components(),
        }
    }

    /// The groups of blocks that stream, each with the name of the component it is in.
    pub fn groups(&self) -> Vec<(&'static str, BlockGroup)> {
        match &self.family {
            Family::Dit(c) => vec![("transformer", c.config.block_group())],
            Family::Wan(c) => c.groups(),
        }
    }

    /// Bytes outside the streamed blocks that every rank keeps on its device (prologues
    /// and epilogues; not the decoder). The engine charges exactly this.
    pub fn resident_device_bytes(&self) -> u64 {
        match &self.family {
            Family::Dit(c) => c.resident_device_bytes(),
            Family::Wan(c) => c.resident_device_bytes(),
        }
    }

    /// Bytes of the VAE decoder's weights, which every rank that decodes keeps on its
    /// device. The engine charges exactly this.
    pub fn decoder_bytes(&self) -> u64 {
        match &self.family {
            Family::Dit(c) => c.decoder_bytes(),
            Family::Wan(c) => c.decoder_bytes(),
        }
    }

    /// The size the model was trained at, `(width, height)` in pixels.
    pub fn native_size(&self) -> (usize, usize) {
        match &self.family {
            Family::Dit(c) => c.native_size(),
            Family::Wan(c) => c.native_size(),
        }
    }

    /// What a request costs in activations: the formula the planner and the engine share.
    pub fn activation_cost(&self) -> crate::checkpoint::ActivationCost {
        match &self.family {
            Family::Dit(c) => c.activation_cost(),
            Family::Wan(c) => c.activation_cost(),
        }
    }

    /// Every weight byte in the folder.
    pub fn total_bytes(&self) -> u64 {
        self.components()
            .iter()
            .map(|(_, c)| c.tensor_bytes())
            .sum()
    }

    /// The family's runtime over this folder, its components mapped.
    #[cfg(feature = "runtime")]
    pub fn runtime(&self) -> crate::Result<Box<dyn crate::execution::family::FamilyRuntime>> {
        Ok(match &self.family {
            Family::Dit(c) => Box::new(dit::runtime::DitRuntime::new((**c).clone())?),
            Family::Wan(c) => Box::new(wan::runtime::WanRuntime::new((**c).clone())?),
        })
    }
}
