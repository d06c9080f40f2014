//! Cosmos3's synthetic folders (`synth --preset cosmos3-tiny`, `cosmos3-nano`,
//! `cosmos3-super`): a synthesized Qwen tokenizer with its chat template, the transformer,
//! the Wan 2.2 VAE and a UniPC scheduler.

use std::path::Path;

use safetensors::Dtype;

use super::Cosmos3Config;
use crate::components::qwen2_5_vl::synth::{synth_tokenizer_files, SYNTH_VOCAB};
use crate::components::wan_vae::WanVaeConfig;
use crate::samplers::flow::{FlowScheduler, UniPcConfig};
use crate::tools::synth::pipeline::{Knobs, SynthOptions, SynthPipeline, SynthPreset};
use crate::tools::synth::write::{
    keeping_f32, write_components, write_json, write_texts, ComponentFiles, HERE,
};
use crate::Result;

/// A Cosmos3 pipeline to write.
#[derive(Debug, Clone)]
pub struct Cosmos3Synth {
    pub transformer: Cosmos3Config,
    pub vae: WanVaeConfig,
    /// The UniPC scheduler's flow shift.
    pub flow_shift: f64,
}

fn preset(
    transformer: Cosmos3Config,
    vae: WanVaeConfig,
    dtype: Dtype,
) -> (Box<dyn SynthPipeline>, Dtype) {
    let c = Cosmos3Synth {
        transformer,
        vae,
        flow_shift: 5.0,
    };
    (Box::new(c), dtype)
}

/// Cosmos3's presets: `cosmos3-tiny` (the parity fixture's shapes over a byte-level
/// tokenizer) and the published shapes (bf16).
pub const PRESETS: &[SynthPreset] = &[
    SynthPreset {
        name: "cosmos3-tiny",
        make: || {
            let t = Cosmos3Config::tiny(SYNTH_VOCAB);
            preset(t, WanVaeConfig::tiny22(), Dtype::F32)
        },
    },
    SynthPreset {
        name: "cosmos3-nano",
        make: || preset(Cosmos3Config::nano(), WanVaeConfig::wan22(), Dtype::BF16),
    },
    SynthPreset {
        name: "cosmos3-super",
        make: || preset(Cosmos3Config::super_(), WanVaeConfig::wan22(), Dtype::BF16),
    },
];

/// Whether diffusers keeps a Cosmos3 transformer tensor in f32 beside bf16 weights (its
/// `_keep_in_fp32_modules`: the time embedder).
fn cosmos3_keeps_f32(name: &str) -> bool {
    name.starts_with("time_embedder.")
}

impl SynthPipeline for Cosmos3Synth {
    fn write(&self, out: &Path, opts: &SynthOptions) -> Result<(u64, usize)> {
        let c = self;
        let config = Path::new(HERE);
        let mut check = c.transformer.clone();
        check.class_name = super::config::CLASS_NAME.into();
        write_json(
            &out.join("model_index.json"),
            &serde_json::json!({
                "_class_name": "Cosmos3OmniPipeline",
                "_diffusers_version": "0.42.1",
                "default_use_system_prompt": true,
                "enable_safety_checker": false,
                "safety_checker": [null, null],
                "scheduler": ["diffusers", "UniPCMultistepScheduler"],
                "sound_tokenizer": [null, null],
                "text_tokenizer": ["transformers", "Qwen2Tokenizer"],
                "transformer": ["diffusers", "Cosmos3OmniTransformer"],
                "use_native_flow_schedule": false,
                "vae": ["diffusers", "AutoencoderKLWan"],
            }),
        )?;
        c.vae.validate(config)?;
        write_texts(out, "text_tokenizer", &synth_tokenizer_files())?;
        // What is written opens as diffusers would read it: the config's own checks
        // first, before any weights are written.
        let tdir = out.join("transformer");
        crate::tools::synth::write::mkdir(&tdir)?;
        write_json(&tdir.join("config.json"), &check.to_json())?;
        Cosmos3Config::load(&tdir.join("config.json"))?;
        let dtype = keeping_f32(opts.dtype, cosmos3_keeps_f32);
        let specs = check.all_specs();
        let folders = vec![
            ComponentFiles::transformer("transformer", check.to_json(), specs, &dtype, 3),
            ComponentFiles::vae(c.vae.to_json(), c.vae.tensor_specs()),
        ];
        let scheduler = FlowScheduler::UniPc(UniPcConfig::wan(c.flow_shift)).to_json();
        write_components(out, opts, folders, &scheduler)
    }

    fn knobs(&mut self) -> Knobs<'_> {
        let t = &mut self.transformer;
        Knobs {
            ffn_dim: Some(&mut t.intermediate_size),
            ..Knobs::new(&mut t.num_hidden_layers, &mut t.num_attention_heads, &mut t.head_dim)
        }
    }
}
