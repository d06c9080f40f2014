//! Model families: what a family's checkpoint must contain (names, shapes), how each
//! component splits into prologue, blocks and epilogue, what its activations cost, and
//! (with the `runtime` feature) its math. Metadata is always built, without tensor math,
//! so the node agent can profile checkpoints.

pub mod attention;
pub mod autoencoder_kl;
#[cfg(feature = "runtime")]
pub mod checks;
pub mod cosmos3;
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

    /// The block index a tensor name of this group's component belongs to, if any: the
    /// name is the prefix, an index and one of the block's tensors (or an fp8 weight's
    /// scale). Two groups may share a prefix with disjoint tensors (Cosmos3's pathways).
    pub fn block_of(&self, name: &str) -> Option<usize> {
        let rest = name.strip_prefix(&self.prefix)?;
        let (idx, tensor) = rest.split_once('.')?;
        let index = idx.parse().ok()?;
        let mine = self.block.iter().any(|s| {
            s.name == tensor
                || crate::checkpoint::fp8::scale_names(&s.name)
                    .iter()
                    .any(|n| n == tensor)
        });
        mine.then_some(index)
    }
}

/// A pipeline folder of one family, opened and checked from its headers and configs alone:
/// what the profile, the planner's memory model and the engine read of any family. Each
/// family implements it once, for its own checkpoint type, and registers how to recognise
/// and open its folders ([`FamilyEntry`]); nothing outside the family names its type.
pub trait FamilyCheckpoint: std::fmt::Debug + Send + Sync {
    /// Every component with weights, by its folder name, in pipeline order.
    fn components(&self) -> Vec<(&'static str, &crate::checkpoint::Component)>;
    /// The groups of blocks that stream, each with the name of the component it is in.
    fn groups(&self) -> Vec<(&'static str, BlockGroup)>;
    /// Bytes outside the streamed blocks that every rank keeps on its device (prologues
    /// and epilogues; not the decoder). The engine charges exactly this.
    fn resident_device_bytes(&self) -> u64;
    /// Bytes of the VAE decoder's weights, which every rank that decodes keeps on its
    /// device. The engine charges exactly this.
    fn decoder_bytes(&self) -> u64;
    /// The size the model was trained at, `(width, height)` in pixels.
    fn native_size(&self) -> (usize, usize);
    /// The largest request the model itself can run (its position tables); none but
    /// memory by default.
    fn limits(&self) -> crate::bounds::ModelLimits {
        crate::bounds::ModelLimits::default()
    }
    /// What a request costs in activations: the formula the planner and the engine share.
    fn activation_cost(&self) -> crate::checkpoint::ActivationCost;
    /// The family's runtime over this folder, its components mapped.
    #[cfg(feature = "runtime")]
    fn runtime(&self) -> crate::Result<Box<dyn crate::execution::family::FamilyRuntime>>;
    /// The family's own checkpoint type, for code of that family (and its tests).
    fn as_any(&self) -> &dyn std::any::Any;
}

/// One family as the registry knows it: its name and how its folders are recognised and
/// opened. Adding a family is one module with one of these, listed in [`FAMILIES`].
#[derive(Clone, Copy)]
pub struct FamilyEntry {
    /// The short name a profile's `family` and a DiffusionDeployment's `model.family` use.
    pub name: &'static str,
    /// The `_class_name`s diffusers writes in `model_index.json` for its pipelines.
    pub pipelines: &'static [&'static str],
    /// Whether a folder whose `model_index.json` names no class is this family's (folders
    /// written before the class name was checked carry none: DiT's layout).
    pub unnamed: bool,
    /// Opens and checks a folder of this family.
    pub open: fn(&std::path::Path) -> crate::Result<std::sync::Arc<dyn FamilyCheckpoint>>,
}

impl std::fmt::Debug for FamilyEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FamilyEntry")
            .field("name", &self.name)
            .field("pipelines", &self.pipelines)
            .finish()
    }
}

/// The families this build runs. The node agent profiles exactly these.
pub const FAMILIES: &[FamilyEntry] = &[dit::FAMILY, wan::FAMILY, cosmos3::FAMILY];

/// The short names of [`FAMILIES`], in order.
pub fn names() -> Vec<&'static str> {
    FAMILIES.iter().map(|f| f.name).collect()
}

/// A pipeline folder opened and checked from its headers and configs alone, whatever
/// its family: `model_index.json`'s `_class_name` chooses the family.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    pub root: std::path::PathBuf,
    /// The family's short name (one of [`names`]).
    pub family: &'static str,
    /// The family's checked folder.
    pub inner: std::sync::Arc<dyn FamilyCheckpoint>,
}

impl Checkpoint {
    /// Opens `root` as the family of [`FAMILIES`] its `model_index.json` names.
    pub fn open(root: &std::path::Path) -> crate::Result<Checkpoint> {
        Self::open_in(root, FAMILIES)
    }

    /// Opens `root` as the family of `registry` its `model_index.json` names.
    pub fn open_in(root: &std::path::Path, registry: &[FamilyEntry]) -> crate::Result<Checkpoint> {
        let folder = crate::checkpoint::ModelFolder::new(root)?;
        let entry = registry
            .iter()
            .find(|f| match folder.class_name.as_deref() {
                Some(class) => f.pipelines.contains(&class),
                None => f.unnamed,
            });
        let Some(entry) = entry else {
            let runs: Vec<&str> = registry
                .iter()
                .flat_map(|f| f.pipelines.iter().copied())
                .collect();
            return Err(crate::Error::config(
                root.join("model_index.json"),
                "_class_name",
                match folder.class_name.as_deref() {
                    Some(other) => format!(
                        "`{other}` is not a pipeline this engine runs (it runs {})",
                        runs.join(", ")
                    ),
                    None => format!(
                        "missing: name the pipeline (this engine runs {})",
                        runs.join(", ")
                    ),
                },
            ));
        };
        Ok(Checkpoint {
            root: root.to_path_buf(),
            family: entry.name,
            inner: (entry.open)(root)?,
        })
    }

    /// The family's short name (`dit`, `wan`): one of [`names`].
    pub fn name(&self) -> &'static str {
        self.family
    }

    /// Every component with weights, by its folder name, in pipeline order.
    pub fn components(&self) -> Vec<(&'static str, &crate::checkpoint::Component)> {
        self.inner.components()
    }

    /// The groups of blocks that stream, each with the name of the component it is in.
    pub fn groups(&self) -> Vec<(&'static str, BlockGroup)> {
        self.inner.groups()
    }

    /// [`FamilyCheckpoint::resident_device_bytes`].
    pub fn resident_device_bytes(&self) -> u64 {
        self.inner.resident_device_bytes()
    }

    /// [`FamilyCheckpoint::decoder_bytes`].
    pub fn decoder_bytes(&self) -> u64 {
        self.inner.decoder_bytes()
    }

    /// The size the model was trained at, `(width, height)` in pixels.
    pub fn native_size(&self) -> (usize, usize) {
        self.inner.native_size()
    }

    /// The largest request the model itself can run (its position tables), whatever the
    /// memory: what the server's bounds and the planner's workload are checked against.
    pub fn limits(&self) -> crate::bounds::ModelLimits {
        self.inner.limits()
    }

    /// What a request costs in activations: the formula the planner and the engine share.
    pub fn activation_cost(&self) -> crate::checkpoint::ActivationCost {
        self.inner.activation_cost()
    }

    /// The family's own checkpoint type, when it is `T`.
    pub fn downcast<T: 'static>(&self) -> Option<&T> {
        self.inner.as_any().downcast_ref()
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
        self.inner.runtime()
    }
}
