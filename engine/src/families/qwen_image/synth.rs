//! Qwen-Image's synthetic folders (`synth --preset qwen-image-tiny`, `qwen-image`): a
//! synthesized Qwen tokenizer, the Qwen2.5-VL text encoder (with its language head, as
//! transformers saves it), the transformer, the Wan 2.1 VAE under Qwen-Image's class and
//! a flow-matching Euler scheduler.

use std::path::Path;

use safetensors::Dtype;

use super::transformer::QwenImageTransformerConfig;
use crate::components::qwen2_5_vl::synth::synth_tokenizer_files;
use crate::components::qwen2_5_vl::{Qwen25VlConfig, TensorPrefix};
use crate::components::wan_vae::WanVaeConfig;
use crate::families::TensorSpec;
use crate::samplers::flow::{FlowMatchEulerConfig, FlowScheduler};
use crate::tools::synth::pipeline::{Knobs, SynthOptions, SynthPipeline, SynthPreset};
use crate::tools::synth::write::{
    write_components, write_json, write_texts, ComponentFiles, HERE,
};
use crate::Result;

/// A Qwen-Image pipeline to write.
#[derive(Debug, Clone)]
pub struct QwenImageSynth {
    pub text_encoder: Qwen25VlConfig,
    pub transformer: QwenImageTransformerConfig,
    pub vae: WanVaeConfig,
}

/// Qwen-Image's presets: `qwen-image-tiny` (the parity fixture's shapes over a byte-level
/// tokenizer) and the published shapes `qwen-image` (bf16; 58 GB, so with `sparse`).
pub const PRESETS: &[SynthPreset] = &[
    SynthPreset {
        name: "qwen-image-tiny",
        make: || {
            // The pipeline fixture's shapes: the tiny text encoder's width feeds the
            // tiny transformer, which reads the Wan VAE's 16 channels in 2×2 patches.
            let text_encoder = Qwen25VlConfig::tiny();
            let transformer = QwenImageTransformerConfig {
                in_channels: 64,
                out_channels: Some(16),
                joint_attention_dim: text_encoder.hidden_size,
                ..QwenImageTransformerConfig::tiny()
            };
            let q = QwenImageSynth {
                text_encoder,
                transformer,
                vae: WanVaeConfig::tiny(),
            };
            (Box::new(q), Dtype::F32)
        },
    },
    SynthPreset {
        name: "qwen-image",
        make: || {
            let q = QwenImageSynth {
                text_encoder: Qwen25VlConfig::qwen2_5_vl_7b(),
                transformer: QwenImageTransformerConfig::published(),
                vae: WanVaeConfig::wan21(),
            };
            (Box::new(q), Dtype::BF16)
        },
    },
];

/// The text encoder's language model as transformers saves it, with its (never read)
/// language head, so a synthesized folder weighs what a published one does but for the
/// vision tower.
fn qwen_text_encoder_specs(c: &Qwen25VlConfig) -> Vec<TensorSpec> {
    let mut specs = c.all_specs(TensorPrefix::Model);
    specs.push(TensorSpec::new(
        "lm_head.weight",
        &[c.vocab_size, c.hidden_size],
    ));
    specs
}

impl SynthPipeline for QwenImageSynth {
    fn write(&self, out: &Path, opts: &SynthOptions) -> Result<(u64, usize)> {
        let q = self;
        let here = Path::new(HERE);
        // What is written opens as transformers would read it: the config's own checks
        // first.
        Qwen25VlConfig::from_json(&q.text_encoder.to_json(), here)?;
        q.transformer.validate(here)?;
        q.vae.validate(here)?;
        write_json(
            &out.join("model_index.json"),
            &serde_json::json!({
                "_class_name": super::checkpoint::CLASS_NAME,
                "_diffusers_version": "0.42.1",
                "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
                "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
                "tokenizer": ["transformers", "Qwen2Tokenizer"],
                "transformer": ["diffusers", "QwenImageTransformer2DModel"],
                "vae": ["diffusers", "AutoencoderKLQwenImage"],
            }),
        )?;
        write_texts(out, "tokenizer", &synth_tokenizer_files())?;
        let same = |_: &str| opts.dtype;
        let (te, t) = (&q.text_encoder, &q.transformer);
        let folders = vec![
            ComponentFiles::text_encoder(te.to_json(), qwen_text_encoder_specs(te), &same),
            ComponentFiles::transformer("transformer", t.to_json(), t.all_specs(), &same, 3),
            ComponentFiles::vae(super::vae::to_json(&q.vae), q.vae.tensor_specs()),
        ];
        let scheduler = FlowScheduler::Euler(FlowMatchEulerConfig::qwen_image()).to_json();
        write_components(out, opts, folders, &scheduler)
    }

    fn knobs(&mut self) -> Knobs<'_> {
        let t = &mut self.transformer;
        Knobs::new(&mut t.num_layers, &mut t.num_attention_heads, &mut t.attention_head_dim)
    }
}
