//! DiT's synthetic folders (`synth --preset tiny`, `xl`): a transformer, an AutoencoderKL
//! and a DDIM scheduler, with `id2label` naming ImageNet's first classes.

use std::path::Path;

use safetensors::Dtype;

use super::DitConfig;
use crate::components::autoencoder_kl::VaeConfig;
use crate::samplers::ddim::DdimConfig;
use crate::tools::synth::pipeline::{Knobs, SynthOptions, SynthPipeline, SynthPreset};
use crate::tools::synth::write::{write_components, write_json, ComponentFiles, HERE};
use crate::Result;

/// A DiT pipeline to write.
#[derive(Debug, Clone)]
pub struct DitSynth {
    pub dit: DitConfig,
    pub vae: VaeConfig,
}

fn preset(dit: DitConfig, vae: VaeConfig) -> (Box<dyn SynthPipeline>, Dtype) {
    (Box::new(DitSynth { dit, vae }), Dtype::F32)
}

/// DiT's presets: `tiny` (runs end to end in about a second) and `xl` (DiT-XL/2).
pub const PRESETS: &[SynthPreset] = &[
    SynthPreset {
        name: "tiny",
        make: || preset(DitConfig::tiny(), VaeConfig::tiny()),
    },
    SynthPreset {
        name: "xl",
        make: || preset(DitConfig::xl(), VaeConfig::sd()),
    },
];

/// ImageNet's names for the first classes (its synset glosses, as DiT checkpoints carry them
/// in `id2label`), so a synthesized class-conditional model can be asked for "goldfish".
const IMAGENET_FIRST_CLASSES: [&str; 16] = [
    "tench, Tinca tinca",
    "goldfish, Carassius auratus",
    "great white shark, white shark, man-eater, man-eating shark, Carcharodon carcharias",
    "tiger shark, Galeocerdo cuvieri",
    "hammerhead, hammerhead shark",
    "electric ray, crampfish, numbfish, torpedo",
    "stingray",
    "cock",
    "hen",
    "ostrich, Struthio camelus",
    "brambling, Fringilla montifringilla",
    "goldfinch, Carduelis carduelis",
    "house finch, linnet, Carpodacus mexicanus",
    "junco, snowbird",
    "indigo bunting, indigo finch, indigo bird, Passerina cyanea",
    "robin, American robin, Turdus migratorius",
];

/// `id2label` for a model of `classes` classes: ImageNet's names where this project lists
/// them, the rest left unnamed (a request gives them by label).
fn imagenet_names(classes: usize) -> serde_json::Value {
    IMAGENET_FIRST_CLASSES
        .iter()
        .take(classes)
        .enumerate()
        .map(|(i, n)| (i.to_string(), serde_json::Value::from(*n)))
        .collect::<serde_json::Map<_, _>>()
        .into()
}

impl SynthPipeline for DitSynth {
    fn write(&self, out: &Path, opts: &SynthOptions) -> Result<(u64, usize)> {
        let (dit, vae) = (&self.dit, &self.vae);
        dit.validate(Path::new(HERE))?;
        vae.validate(Path::new(HERE))?;
        write_json(
            &out.join("model_index.json"),
            &serde_json::json!({
                "_class_name": "DiTPipeline",
                "_diffusers_version": "0.30.0",
                "id2label": imagenet_names(dit.num_classes()),
                "scheduler": ["diffusers", "DDIMScheduler"],
                "transformer": ["diffusers", "DiTTransformer2DModel"],
                "vae": ["diffusers", "AutoencoderKL"],
            }),
        )?;
        let same = |_: &str| opts.dtype;
        let folders = vec![
            ComponentFiles::transformer("transformer", dit.to_json(), dit.all_specs(), &same, 0),
            ComponentFiles::vae(vae.to_config_json(), vae.tensor_specs()),
        ];
        write_components(out, opts, folders, &DdimConfig::dit().to_json())
    }

    fn knobs(&mut self) -> Knobs<'_> {
        let t = &mut self.dit;
        Knobs {
            sample_size: Some(&mut t.sample_size),
            ..Knobs::new(&mut t.num_layers, &mut t.num_attention_heads, &mut t.attention_head_dim)
        }
    }
}
