//! Wan's synthetic folders (`synth --preset wan-tiny`, `wan2.1-1.3b`, `wan2.1-14b`,
//! `wan2.2-a14b`): a synthesized UMT5 tokenizer, the UMT5 text encoder, one or two expert
//! transformers, the Wan VAE and a UniPC scheduler.

use std::path::Path;

use safetensors::Dtype;

use super::transformer::WanTransformerConfig;
use crate::components::umt5::{synth_tokenizer_config, synth_tokenizer_json, Umt5Config};
use crate::components::wan_vae::WanVaeConfig;
use crate::samplers::flow::{FlowScheduler, UniPcConfig};
use crate::tools::synth::pipeline::{Knobs, SynthOptions, SynthPipeline, SynthPreset};
use crate::tools::synth::write::{
    keeping_f32, write_components, write_json, write_texts, ComponentFiles, HERE,
};
use crate::Result;

/// A Wan pipeline to write.
#[derive(Debug, Clone)]
pub struct WanSynth {
    pub text_encoder: Umt5Config,
    pub transformer: WanTransformerConfig,
    /// Wan 2.2: a second expert of the same shape, taking the steps below this boundary.
    pub boundary_ratio: Option<f64>,
    pub vae: WanVaeConfig,
    /// The UniPC scheduler's flow shift (3.0 for 480p, 5.0 for 720p).
    pub flow_shift: f64,
}

fn preset(
    text_encoder: Umt5Config,
    transformer: WanTransformerConfig,
    boundary_ratio: Option<f64>,
    vae: WanVaeConfig,
    flow_shift: f64,
    dtype: Dtype,
) -> (Box<dyn SynthPipeline>, Dtype) {
    let w = WanSynth {
        text_encoder,
        transformer,
        boundary_ratio,
        vae,
        flow_shift,
    };
    (Box::new(w), dtype)
}

/// Wan's presets: `wan-tiny` (two experts that run in seconds) and the published shapes
/// (bf16; with `sparse` for the large ones).
pub const PRESETS: &[SynthPreset] = &[
    SynthPreset {
        name: "wan-tiny",
        make: || {
            let (te, t, vae) = (
                Umt5Config::tiny(),
                WanTransformerConfig::tiny(),
                WanVaeConfig::tiny(),
            );
            preset(te, t, Some(0.875), vae, 3.0, Dtype::F32)
        },
    },
    SynthPreset {
        name: "wan2.1-1.3b",
        make: || {
            let t = WanTransformerConfig::wan21_1_3b();
            preset(
                Umt5Config::umt5_xxl(),
                t,
                None,
                WanVaeConfig::wan21(),
                3.0,
                Dtype::BF16,
            )
        },
    },
    SynthPreset {
        name: "wan2.1-14b",
        make: || {
            let t = WanTransformerConfig::wan21_14b();
            preset(
                Umt5Config::umt5_xxl(),
                t,
                None,
                WanVaeConfig::wan21(),
                5.0,
                Dtype::BF16,
            )
        },
    },
    SynthPreset {
        name: "wan2.2-a14b",
        make: || {
            let t = WanTransformerConfig::wan22_a14b();
            let vae = WanVaeConfig::wan21();
            preset(
                Umt5Config::umt5_xxl(),
                t,
                Some(0.875),
                vae,
                12.0,
                Dtype::BF16,
            )
        },
    },
];

/// Whether diffusers keeps a Wan transformer tensor in f32 beside bf16 weights (its
/// `_keep_in_fp32_modules`: the time embedder, the modulation tables and `norm2`).
fn wan_keeps_f32(name: &str) -> bool {
    name.starts_with("condition_embedder.time_embedder.")
        || name.ends_with("scale_shift_table")
        || name.contains(".norm2.")
}

impl SynthPipeline for WanSynth {
    fn write(&self, out: &Path, opts: &SynthOptions) -> Result<(u64, usize)> {
        let w = self;
        let here = Path::new(HERE);
        w.text_encoder.validate(here)?;
        w.transformer.validate(here)?;
        w.vae.validate(here)?;
        let two = w.boundary_ratio.is_some();
        write_json(
            &out.join("model_index.json"),
            &serde_json::json!({
                "_class_name": "WanPipeline",
                "_diffusers_version": "0.42.1",
                "boundary_ratio": w.boundary_ratio,
                "expand_timesteps": false,
                "scheduler": ["diffusers", "UniPCMultistepScheduler"],
                "text_encoder": ["transformers", "UMT5EncoderModel"],
                "tokenizer": ["transformers", "T5TokenizerFast"],
                "transformer": ["diffusers", "WanTransformer3DModel"],
                "transformer_2": if two { serde_json::json!(["diffusers", "WanTransformer3DModel"]) } else { serde_json::json!([null, null]) },
                "vae": ["diffusers", "AutoencoderKLWan"],
            }),
        )?;
        write_texts(
            out,
            "tokenizer",
            &[
                ("tokenizer.json", synth_tokenizer_json(opts.seed)),
                ("tokenizer_config.json", synth_tokenizer_config()),
            ],
        )?;
        let same = |_: &str| opts.dtype;
        let mut folders = vec![ComponentFiles::text_encoder(
            w.text_encoder.to_json(),
            w.text_encoder.all_specs(),
            &same,
        )];
        let experts: &[&str] = if two {
            &["transformer", "transformer_2"]
        } else {
            &["transformer"]
        };
        let dtype = keeping_f32(opts.dtype, wan_keeps_f32);
        for (i, name) in experts.iter().enumerate() {
            folders.push(ComponentFiles::transformer(
                name,
                w.transformer.to_json(),
                w.transformer.all_specs(),
                &dtype,
                3 + i as u64,
            ));
        }
        folders.push(ComponentFiles::vae(w.vae.to_json(), w.vae.tensor_specs()));
        let scheduler = FlowScheduler::UniPc(UniPcConfig::wan(w.flow_shift)).to_json();
        write_components(out, opts, folders, &scheduler)
    }

    fn knobs(&mut self) -> Knobs<'_> {
        let t = &mut self.transformer;
        Knobs {
            ffn_dim: Some(&mut t.ffn_dim),
            ..Knobs::new(&mut t.num_layers, &mut t.num_attention_heads, &mut t.attention_head_dim)
        }
    }
}
