//! Every family's declared FLOPs (`FamilyCheckpoint::group_compute`, the step-time model's
//! input) held to what one block of the engine's own CPU code executes, counted by
//! `components::flops` in the matrix products (2 per multiply-add; the elementwise work,
//! norms, softmax, rotary, biases and activations, is neither counted nor declared, so
//! the two must agree exactly).
//!
//! Each block runs at a tiny config of its family on T, 2T and 3T tokens: the second
//! difference of the counts is the attention's quadratic term, the first the linear one,
//! and what is left the prompt's and the timestep's, separated and compared with the
//! declaration term by term; the prompt's length varies too, at each token count. T is
//! 72, past the 65 query rows below which the CPU's attention pads its chunks with zero
//! queries (`attention::general_rows`), which executes more than the declaration (it
//! declares what a real request, thousands of tokens, computes).
//!
//! Then the published shapes: `layerwise inspect --json` of each family's published
//! preset (sparse: headers only) declares attention for every streamed group.

use std::collections::HashMap;

use candle_core::Tensor;
use layerwise_core::family::{GroupCompute, TensorSpec};
use layerwise_engine::components::flops::counted;
use layerwise_engine::execution::seq::Split;
use layerwise_engine::execution::weights::seeded_noise;

/// Seeded weights of a tenth-ish scale for `specs`.
fn weights(specs: &[TensorSpec], seed: u64) -> HashMap<String, Tensor> {
    specs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let t = (seeded_noise(seed + i as u64, &s.shape).unwrap() * 0.2).unwrap();
            (s.name.clone(), t)
        })
        .collect()
}

fn noise(seed: u64, shape: &[usize]) -> Tensor {
    seeded_noise(seed, shape).unwrap()
}

const T: u64 = 72;

/// Holds `g`'s declaration to `count(tokens, text)`, the FLOPs one block executed for
/// `samples` samples of `tokens` latent tokens beside `text` prompt tokens, at T, 2T and
/// 3T tokens and at each of `texts`: every count equals the declared polynomial, and its
/// linear, quadratic and remaining parts, separated from the three token counts, equal
/// the declaration's.
fn check(
    what: &str,
    g: &GroupCompute,
    samples: u64,
    texts: &[u64],
    mut count: impl FnMut(u64, u64) -> u64,
) {
    for &l in texts {
        let f: Vec<u64> = [T, 2 * T, 3 * T]
            .iter()
            .map(|&t| {
                let n = count(t, l);
                assert_eq!(n % samples, 0, "{what}: {n} FLOPs over {samples} samples");
                n / samples
            })
            .collect();
        for (i, &n) in f.iter().enumerate() {
            let t = (i as u64 + 1) * T;
            assert_eq!(
                n as f64,
                g.flops(t, t, l),
                "{what}: T {t}, L {l}: counted vs declared {g:?}"
            );
        }
        // F(T) = a·T + b·T² + c: the second difference over steps of T is 2·b·T².
        let quadratic = (f[2] + f[0] - 2 * f[1]) / (2 * T * T);
        let linear = (f[1] - f[0]) / T - 3 * quadratic * T;
        let rest = f[0] - linear * T - quadratic * T * T;
        println!("{what}: L {l}: counted per token {linear}, per pair {quadratic}, beside {rest}");
        assert_eq!(quadratic, g.flops_per_token_pair, "{what}: per pair, L {l}");
        assert_eq!(
            linear,
            g.flops_per_token + g.flops_per_cross_pair * l,
            "{what}: per token, L {l}"
        );
        assert_eq!(
            rest,
            g.flops_per_text_token * l + g.flops_per_text_pair * l * l + g.flops_per_sample,
            "{what}: beside the tokens, L {l}"
        );
    }
}

#[test]
fn wan_blocks_execute_what_they_declare() {
    use layerwise_engine::components::umt5::model::Umt5Encoder;
    use layerwise_engine::components::umt5::{Umt5Config, FINAL_NORM};
    use layerwise_engine::families::wan::flops::transformer_block;
    use layerwise_engine::families::wan::transformer::model::WanTransformer;
    use layerwise_engine::families::wan::transformer::WanTransformerConfig;

    let cfg = WanTransformerConfig::tiny();
    let g = transformer_block(&cfg, GroupCompute::default());
    assert!(g.declares_attention());
    let model = WanTransformer::new(cfg.clone(), Box::new(weights(&cfg.resident_specs(), 1)));
    let w = weights(&cfg.block_specs(), 100);
    // Guidance's batch of two; frames of 6 × 6 patches (2 × 2 latent pixels each).
    check("wan transformer", &g, 2, &[8, 16, 24], |t, l| {
        let latents = noise(2, &[2, 16, t as usize / 36, 12, 12]);
        let text = noise(3, &[2, l as usize, cfg.text_dim]);
        let split = &mut Split::whole();
        let mut st = model.prologue(&latents, 500.0, &text, split).unwrap();
        counted(|| model.block(0, &w, &mut st, split).unwrap()).1
    });

    let te = Umt5Config::tiny();
    let g = layerwise_engine::components::umt5::flops::encoder_block(&te, GroupCompute::default());
    let norm = Tensor::ones(
        te.d_model,
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    );
    let resident: HashMap<String, Tensor> = [(FINAL_NORM.to_string(), norm.unwrap())].into();
    let encoder = Umt5Encoder::new(te.clone(), &resident).unwrap();
    let w = weights(&te.block_specs(), 200);
    check("umt5 encoder", &g, 2, &[0], |t, _| {
        let s = t as usize;
        let st = encoder.prologue(noise(4, &[2, s, te.d_model]), &[vec![1; s], vec![1; s]]);
        let mut st = st.unwrap();
        counted(|| encoder.block(0, &w, &mut st).unwrap()).1
    });
}

#[test]
fn qwen_image_blocks_execute_what_they_declare() {
    use layerwise_engine::components::qwen2_5_vl::{Qwen25VlConfig, Qwen25VlEncoder, TensorPrefix};
    use layerwise_engine::families::qwen_image::flops::transformer_block;
    use layerwise_engine::families::qwen_image::transformer::model::QwenImageTransformer;
    use layerwise_engine::families::qwen_image::transformer::QwenImageTransformerConfig;

    let cfg = QwenImageTransformerConfig::tiny();
    let g = transformer_block(&cfg, GroupCompute::default());
    assert!(g.declares_attention() && g.flops_per_text_pair > 0);
    let model = QwenImageTransformer::new(cfg.clone(), Box::new(weights(&cfg.resident_specs(), 1)));
    let w = weights(&cfg.block_specs(), 100);
    // The prompt and the negative prompt run one at a time: one sample a pass.
    check("qwen-image transformer", &g, 1, &[5, 10, 15], |t, l| {
        let rows = t as usize / 8;
        let latents = noise(2, &[1, t as usize, cfg.in_channels]);
        let text = noise(3, &[1, l as usize, cfg.joint_attention_dim]);
        let mut st = model.prologue(&latents, 0.5, &text, (1, rows, 8)).unwrap();
        counted(|| model.block(0, &w, &mut st).unwrap()).1
    });

    let te = Qwen25VlConfig::tiny();
    let g = layerwise_engine::components::qwen2_5_vl::flops::encoder_block(
        &te,
        GroupCompute::default(),
    );
    let prefix = TensorPrefix::Model;
    let encoder = Qwen25VlEncoder::new(
        te.clone(),
        prefix,
        &weights(&te.resident_specs(prefix), 300),
    )
    .unwrap();
    let w = weights(&te.block_specs(), 400);
    check("qwen2.5-vl encoder", &g, 1, &[0], |t, _| {
        let mut st = encoder
            .prologue(noise(4, &[1, t as usize, te.hidden_size]))
            .unwrap();
        counted(|| encoder.block(0, &w, &mut st).unwrap()).1
    });
}

#[test]
fn cosmos3_layers_execute_what_they_declare() {
    use layerwise_engine::families::cosmos3::flops::{generation_block, understanding_block};
    use layerwise_engine::families::cosmos3::model::Cosmos3Transformer;
    use layerwise_engine::families::cosmos3::Cosmos3Config;

    let cfg = Cosmos3Config::tiny(300);
    // Query heads wider than the model: the attention terms follow them, not the width.
    assert_ne!(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size);
    let model = Cosmos3Transformer::new(cfg.clone(), Box::new(weights(&cfg.resident_specs(), 1)));
    let und = weights(&cfg.understanding_group().block, 100);
    let gen = weights(&cfg.generation_group().block, 200);
    let g = understanding_block(&cfg, GroupCompute::default());
    // Layer 0 of 2: the last layer computes only its keys and values.
    check("cosmos3 understanding", &g, 1, &[0], |t, _| {
        let mut st = model
            .understand(noise(2, &[t as usize, cfg.hidden_size]))
            .unwrap();
        counted(|| model.understanding_block(0, &und, &mut st).unwrap()).1
    });
    let g = generation_block(&cfg, GroupCompute::default());
    assert!(g.declares_attention() && g.flops_per_cross_pair > 0);
    check("cosmos3 generation", &g, 1, &[6, 12, 18], |t, l| {
        let mut text = model
            .understand(noise(2, &[l as usize, cfg.hidden_size]))
            .unwrap();
        model.understanding_block(0, &und, &mut text).unwrap();
        let latents = noise(3, &[1, cfg.latent_channel, t as usize / 36, 12, 12]);
        let split = &mut Split::whole();
        let mut st = model
            .generate(&latents, 0.5, &mut text, 24.0, 4, split)
            .unwrap();
        counted(|| {
            model
                .generation_block(0, &gen, &text, &mut st, split)
                .unwrap()
        })
        .1
    });
}

#[test]
fn dit_blocks_execute_what_they_declare() {
    use layerwise_engine::families::dit::flops::transformer_block;
    use layerwise_engine::families::dit::model::Dit;
    use layerwise_engine::families::dit::DitConfig;

    let cfg = DitConfig::tiny();
    let g = transformer_block(&cfg, GroupCompute::default());
    assert!(g.declares_attention() && g.flops_per_sample > 0);
    let model = Dit::new(cfg.clone(), Box::new(weights(&cfg.resident_specs(), 1)));
    let w = weights(&cfg.block_specs(), 100);
    // A class and the null class; 9 patches of 2 × 2 a row.
    check("dit transformer", &g, 2, &[0], |t, _| {
        let rows = t as usize / 9;
        let latents = noise(2, &[2, cfg.in_channels, 2 * rows, 18]);
        let mut st = model.prologue(&latents, 500.0, &[3, 1000]).unwrap();
        counted(|| model.block(1, &w, &mut st).unwrap()).1
    });
}

/// The published presets, one or more per family: `inspect --json` of each (written
/// sparse) declares attention for every streamed group, and each group's FLOPs are those
/// its family's declaration gives for the preset's configs.
#[test]
fn published_presets_declare_attention_for_every_group() {
    use layerwise_engine::tools::synth::{synth, SynthOptions};
    let bin = env!("CARGO_BIN_EXE_layerwise");
    let d = tempfile::tempdir().unwrap();
    for preset in [
        "xl",
        "wan2.1-1.3b",
        "wan2.1-14b",
        "wan2.2-a14b",
        "cosmos3-nano",
        "cosmos3-super",
        "qwen-image",
    ] {
        let dir = d.path().join(preset);
        let mut o = SynthOptions::preset(preset).unwrap();
        o.sparse = true;
        synth(&dir, &o).unwrap();
        let out = std::process::Command::new(bin)
            .args(["inspect", "--json", dir.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{preset}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let compute = json["compute"].as_array().unwrap();
        assert!(!compute.is_empty(), "{preset}");
        for g in compute {
            let n = |k: &str| {
                g[k].as_u64()
                    .unwrap_or_else(|| panic!("{preset}: {k} in {g}"))
            };
            println!(
                "{preset} {}: per token {}, per pair {}, per text token {}, per cross pair {}, per text pair {}, per sample {}",
                g["component"],
                n("flopsPerToken"),
                n("flopsPerTokenPair"),
                n("flopsPerTextToken"),
                n("flopsPerCrossPair"),
                n("flopsPerTextPair"),
                n("flopsPerSample")
            );
            assert!(n("flopsPerTokenPair") > 0, "{preset}: {g}");
            assert!(n("flopsPerToken") > 0, "{preset}: {g}");
        }
        // The same figures the library's profile declares.
        let p = layerwise_engine::families::profile(&dir).unwrap();
        let parsed: Vec<GroupCompute> = serde_json::from_value(json["compute"].clone()).unwrap();
        assert_eq!(parsed, p.compute, "{preset}");
    }
}
