//! What `synth` writes, as the families describe it: a [`SynthPipeline`] (one family's
//! configs for every component of its folder, and how to write them), the named
//! [`SynthPreset`]s each family lists in its registry entry, and the [`SynthOptions`]
//! every pipeline is written under. Kept apart from the preset lookup so that the family
//! registry can name these types without importing the registry's readers.

use std::any::Any;
use std::path::Path;

use safetensors::Dtype;

use crate::Result;

/// One family's pipeline to write: the configs of its components, which the options'
/// setters edit, and the writer of its folder.
pub trait SynthPipeline: AnyPipeline + std::fmt::Debug + Send + Sync + Any {
    /// Writes every file of the folder under `out` (which exists); returns the weight
    /// files' bytes and how many files were written.
    fn write(&self, out: &Path, opts: &SynthOptions) -> Result<(u64, usize)>;

    /// The transformer's sizes that the options' setters change: fields of its config.
    fn knobs(&mut self) -> Knobs<'_>;

    /// The transformer's feed-forward width, where it is a field of its own (not a fixed
    /// multiple of the hidden size).
    fn ffn_dim(&mut self) -> Option<&mut usize> {
        self.knobs().ffn_dim
    }

    /// The latent sample size, where the config fixes one (DiT).
    fn sample_size(&mut self) -> Option<&mut usize> {
        self.knobs().sample_size
    }
}

/// The sizes of a family's transformer that `synth`'s options set, as the fields of its
/// config they are.
#[derive(Debug)]
pub struct Knobs<'a> {
    /// The depth of the (first) transformer, which its twin expert shares.
    pub layers: &'a mut usize,
    /// The attention heads and their width.
    pub heads: &'a mut usize,
    pub head_dim: &'a mut usize,
    /// The feed-forward width, where it is a field of its own (not a fixed multiple of the
    /// hidden size).
    pub ffn_dim: Option<&'a mut usize>,
    /// The latent sample size, where the config fixes one (DiT).
    pub sample_size: Option<&'a mut usize>,
}

impl<'a> Knobs<'a> {
    /// A transformer's depth, heads and head width; no feed-forward width or sample size of
    /// their own.
    pub fn new(layers: &'a mut usize, heads: &'a mut usize, head_dim: &'a mut usize) -> Self {
        Knobs {
            layers,
            heads,
            head_dim,
            ffn_dim: None,
            sample_size: None,
        }
    }
}

/// What every [`SynthPipeline`] gets from being `Clone` and `'static`: copies of the boxed
/// pipeline, and its family's own type for a caller that knows the family.
pub trait AnyPipeline {
    fn clone_box(&self) -> Box<dyn SynthPipeline>;
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

impl<T: SynthPipeline + Clone> AnyPipeline for T {
    fn clone_box(&self) -> Box<dyn SynthPipeline> {
        Box::new(self.clone())
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

/// A name `synth --preset` takes, and the pipeline it writes.
#[derive(Clone, Copy)]
pub struct SynthPreset {
    pub name: &'static str,
    /// The pipeline and the weight dtype of its streamed components.
    pub make: fn() -> (Box<dyn SynthPipeline>, Dtype),
}

impl std::fmt::Debug for SynthPreset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}

/// What to write.
#[derive(Debug)]
pub struct SynthOptions {
    pub model: Box<dyn SynthPipeline>,
    pub seed: u64,
    /// Weight dtype of the streamed components (the VAE is always f32, as diffusers ships
    /// it; Wan's bf16 transformers keep what diffusers keeps in f32).
    pub dtype: Dtype,
    /// Split each streamed component into files of at most this many bytes (with an index).
    pub max_shard_bytes: Option<u64>,
    /// Write headers over sparse files instead of weights.
    pub sparse: bool,
}

impl Clone for SynthOptions {
    fn clone(&self) -> Self {
        SynthOptions {
            model: self.model.clone_box(),
            seed: self.seed,
            dtype: self.dtype,
            max_shard_bytes: self.max_shard_bytes,
            sparse: self.sparse,
        }
    }
}

impl SynthOptions {
    /// Options for `model` with the defaults a preset starts from.
    pub fn of(model: Box<dyn SynthPipeline>, dtype: Dtype) -> Self {
        SynthOptions {
            model,
            seed: 0,
            dtype,
            max_shard_bytes: None,
            sparse: false,
        }
    }

    /// The pipeline as the family's own type `T`, when it is one.
    pub fn model_mut<T: SynthPipeline>(&mut self) -> Option<&mut T> {
        self.model.as_any_mut().downcast_mut()
    }

    /// Sets the depth of the (first) transformer, and of its twin expert.
    pub fn set_layers(&mut self, n: usize) {
        *self.model.knobs().layers = n;
    }

    /// Sets the transformer's attention heads and, if given, their width.
    pub fn set_heads(&mut self, heads: Option<usize>, head_dim: Option<usize>) {
        let k = self.model.knobs();
        if let Some(v) = heads {
            *k.heads = v;
        }
        if let Some(v) = head_dim {
            *k.head_dim = v;
        }
    }
}

/// What was written.
#[derive(Debug, Clone)]
pub struct SynthReport {
    pub bytes: u64,
    pub files: usize,
    pub seconds: f64,
}
