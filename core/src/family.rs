//! What a model family declares about its checkpoint, read from headers and configs alone:
//! the tensors it expects ([`TensorSpec`]), the groups of blocks that stream
//! ([`BlockGroup`]), and the [`FamilyCheckpoint`] trait every family implements for its
//! folder. The families themselves, their registry and their math are the engine's.

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
/// and open its folders (the engine's family registry); nothing outside the family names
/// its type.
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
    /// What one block of each of [`Self::groups`] computes, in the same order: the
    /// step-time model's input ([`crate::timing`]). By default 2 FLOPs per weight of the
    /// block's tensors per token, attention left out, and each group's role from its
    /// component's name ([`crate::timing::GroupCompute::of_params`]); a family whose
    /// blocks do otherwise (two streams that each see part of the tokens, attention that
    /// dominates) declares its own.
    fn group_compute(&self) -> Vec<crate::timing::GroupCompute> {
        let groups = self.groups();
        let experts = crate::timing::experts(groups.iter().map(|(c, _)| *c));
        groups
            .iter()
            .map(|(c, g)| {
                let params = g.block.iter().map(|s| s.numel() as u64).sum();
                crate::timing::GroupCompute::of_params(c, params, experts)
            })
            .collect()
    }
    /// Every weight byte in the folder.
    fn total_bytes(&self) -> u64 {
        self.components()
            .iter()
            .map(|(_, c)| c.tensor_bytes())
            .sum()
    }
    /// The family's own checkpoint type, for code of that family (and its tests).
    fn as_any(&self) -> &dyn std::any::Any;
}
