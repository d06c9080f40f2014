//! What a model family declares about its checkpoint, read from headers and configs alone:
//! the tensors it expects ([`TensorSpec`]), the groups of blocks that stream
//! ([`BlockGroup`]), what each group's blocks compute ([`GroupCompute`], the step-time
//! model's input), and the [`FamilyCheckpoint`] trait every family implements for its
//! folder. The families themselves, their registry and their math are the engine's.

/// How often a streamed group runs in a request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "kebab-case")]
pub enum Runs {
    /// Once per request, before the steps (a text encoder).
    PerRequest,
    /// Once per denoising step (a transformer).
    #[default]
    PerStep,
    /// On its share of the steps: the experts of a two-expert model split the steps
    /// evenly, in pipeline order.
    ExpertSteps,
}

/// Which tokens a group's blocks run on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "kebab-case")]
pub enum Tokens {
    /// The prompt's tokens (a text encoder).
    Text,
    /// The latent's tokens (a transformer).
    #[default]
    Latent,
}

/// What one block of a streamed group computes, as the family declares it
/// (`FamilyCheckpoint::group_compute`): the FLOPs of its matrix products (2 per
/// multiply-add) per sample, as a polynomial in the tokens it runs on ([`Self::flops`]).
/// A group on the latent may also see the prompt (cross-attention, a text stream beside
/// the image's, keys and values an understanding pathway left); the text terms count
/// that, at the prompt's tokens as the transformer receives them (the request's
/// `max_sequence_length`: padded to it by the families that pad, Wan; the prompt's own
/// tokens, at most it, by the others). Elementwise work (norms, softmax, rotary,
/// activations) is left out. The engine counts what its blocks execute and a test holds
/// every family's declaration to that count (`engine/tests/flops.rs`).
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct GroupCompute {
    /// The component the group belongs to, as in [`GroupBytes::component`].
    pub component: String,
    pub runs: Runs,
    pub tokens: Tokens,
    /// FLOPs per token per sample of one block: 2 per weight of the linear layers a token
    /// goes through.
    pub flops_per_token: u64,
    /// FLOPs per (query, key) pair of the group's own tokens per sample of one block: its
    /// self-attention's q·kᵀ and p·v, 4 × the attention width (heads × head width). 0
    /// leaves attention out, which underestimates compute on long sequences (the model
    /// then keeps more blocks than it needs, never fewer).
    #[serde(default)]
    pub flops_per_token_pair: u64,
    /// FLOPs per prompt token per sample of one block of a latent group: the linear layers
    /// the prompt goes through in it (Wan's cross-attention keys and values, Qwen-Image's
    /// text stream).
    #[serde(default)]
    pub flops_per_text_token: u64,
    /// FLOPs per (latent token, prompt token) pair per sample of one block: cross-attention
    /// (4 × its width), or both directions of a joint attention (8 × its width).
    #[serde(default)]
    pub flops_per_cross_pair: u64,
    /// FLOPs per (prompt token, prompt token) pair per sample of one block of a latent
    /// group: the prompt attending to itself inside a joint attention.
    #[serde(default)]
    pub flops_per_text_pair: u64,
    /// FLOPs per sample of one block whatever its tokens: products of the timestep's
    /// embedding (a block's own modulation from it).
    #[serde(default)]
    pub flops_per_sample: u64,
}

impl GroupCompute {
    /// The declaration every family gets unless it makes its own: 2 FLOPs per weight per
    /// token, attention left out, and the group's role from its component's name (a
    /// `text_encoder*` runs once per request on the prompt; a `transformer*` once per
    /// step on the latent, or on its share of the steps where `experts` > 1).
    pub fn of_params(component: &str, params: u64, experts: usize) -> GroupCompute {
        let text = component.starts_with("text_encoder");
        GroupCompute {
            component: component.to_string(),
            runs: if text {
                Runs::PerRequest
            } else if experts > 1 && component.starts_with("transformer") {
                Runs::ExpertSteps
            } else {
                Runs::PerStep
            },
            tokens: if text { Tokens::Text } else { Tokens::Latent },
            flops_per_token: 2 * params,
            ..GroupCompute::default()
        }
    }

    /// FLOPs of one block per sample on a rank that computes `share` of the group's
    /// `tokens` (all of them without sequence parallelism) beside `text` prompt tokens:
    /// its tokens' linear layers and their attention to every key (`share · tokens`
    /// pairs), their cross-attention to the prompt, and what the prompt and the timestep
    /// cost, which every rank computes whole. A group on the prompt itself
    /// ([`Tokens::Text`]) has `tokens` the prompt's and no text terms.
    pub fn flops(&self, tokens: u64, share: u64, text: u64) -> f64 {
        let (t, s, l) = (tokens as f64, share as f64, text as f64);
        self.flops_per_token as f64 * s
            + self.flops_per_token_pair as f64 * t * s
            + self.flops_per_cross_pair as f64 * s * l
            + self.flops_per_text_token as f64 * l
            + self.flops_per_text_pair as f64 * l * l
            + self.flops_per_sample as f64
    }

    /// Whether attention is declared: a pair term of either kind.
    pub fn declares_attention(&self) -> bool {
        self.flops_per_token_pair > 0 || self.flops_per_cross_pair > 0
    }
}

/// [`FamilyCheckpoint::group_compute`]'s default for `ck`'s groups, which a family's own
/// declaration may start from: [`GroupCompute::of_params`] of each group's block weights.
pub fn default_group_compute<C: FamilyCheckpoint + ?Sized>(ck: &C) -> Vec<GroupCompute> {
    let groups = ck.groups();
    let experts = experts(groups.iter().map(|(c, _)| *c));
    groups
        .iter()
        .map(|(c, g)| {
            let params = g.block.iter().map(|s| s.numel() as u64).sum();
            GroupCompute::of_params(c, params, experts)
        })
        .collect()
}

/// How many distinct `transformer*` components `components` names.
pub fn experts<'a>(components: impl Iterator<Item = &'a str>) -> usize {
    let mut seen: Vec<&str> = components
        .filter(|c| c.starts_with("transformer"))
        .collect();
    seen.sort();
    seen.dedup();
    seen.len()
}

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
    /// [`Self::resident_device_bytes`] once loaded at `elem` bytes per element (a bf16
    /// checkpoint computed in f32 holds its prologue at twice its file size).
    fn resident_stored_bytes(&self, elem: u64) -> u64;
    /// [`Self::decoder_bytes`] once loaded at `elem` bytes per element.
    fn decoder_stored_bytes(&self, elem: u64) -> u64;
    /// The size the model was trained at, `(width, height)` in pixels.
    fn native_size(&self) -> (usize, usize);
    /// The largest request the model itself can run (its position tables); none but
    /// memory by default.
    fn limits(&self) -> crate::bounds::ModelLimits {
        crate::bounds::ModelLimits::default()
    }
    /// What a request costs in activations: the formula the planner and the engine share.
    fn activation_cost(&self) -> crate::checkpoint::ActivationCost;
    /// The dtypes its blocks compute in ([`crate::compute_dtype`]): f32 only unless the
    /// family's forward passes run in half precision too. `--compute-dtype auto` and the
    /// activation term of every plan read it.
    fn compute_dtypes(&self) -> &'static [crate::compute_dtype::ComputeElement] {
        crate::compute_dtype::F32_ONLY
    }
    /// What the VAE decoder holds at its peak, per split of a decode
    /// ([`crate::decode::DecodeCost`]); `None` where the family does not describe it.
    fn decode_cost(&self) -> Option<crate::decode::DecodeCost> {
        None
    }
    /// What one block of each of [`Self::groups`] computes, in the same order: the
    /// step-time model's input ([`crate::timing`]). By default 2 FLOPs per weight of the
    /// block's tensors per token, attention left out, and each group's role from its
    /// component's name ([`GroupCompute::of_params`]), timed by [`crate::timing`]; a family whose
    /// blocks do otherwise (two streams that each see part of the tokens, attention that
    /// dominates) declares its own.
    fn group_compute(&self) -> Vec<GroupCompute> {
        default_group_compute(self)
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
