//! What a step cache really holds against what the memory model counts for it: each cache
//! runs its passes over Wan's real hidden width (two guidance rows, both experts of a
//! two-expert model keeping their own state), with the counting allocator installed, and
//! the heap bytes its state keeps between passes are set beside the model's figure for
//! the tensors held ([`CacheHold`] over the checkpoint's activation cost). The tensors a
//! pass keeps alive beside its blocks (the stack's input, the first block's output) are
//! references to tensors the pass made, not allocations of the cache's, so they are
//! counted by the model from the code ([`StepCache::hold`]) and not measured here.
//! Its own test binary, so no other test's allocations share the heap.

mod common;

use candle_core::{Device, Tensor};
use layerwise_engine::cache::{StepCache, StepCacheRun};
use layerwise_engine::engine::Model;
use layerwise_engine::measure::alloc;
use layerwise_engine::measure::CountingAlloc;
use layerwise_engine::tools::synth::{synth, SynthOptions};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

const ROWS: usize = 2;
const TOKENS: usize = 512;
const STEPS: usize = 8;

/// The most heap bytes `cfg`'s state holds after any pass of `STEPS` steps over both
/// experts, the pass's own tensors dropped (MagCache lets its residual go after the last
/// step, so the end holds less).
fn held(cfg: &StepCache, hidden: usize, out_per_token: usize, experts: usize) -> u64 {
    let before = alloc::live();
    let mut run = StepCacheRun::new(cfg, STEPS, 1).unwrap();
    let mut most = 0;
    for step in 0..STEPS {
        for group in 0..experts {
            let seed = (step * experts + group) as f64;
            let x = Tensor::randn(seed as f32, 1.0, (ROWS, TOKENS, hidden), &Device::Cpu).unwrap();
            run.begin(group, &x).unwrap();
            let mut h = x.clone();
            for block in 0..3 {
                if run.runs(block) {
                    h = ((&h * 0.9).unwrap() + 0.01 * (block + 1) as f64).unwrap();
                    run.after_block(block, &h).unwrap();
                }
            }
            run.end_blocks(&mut h).unwrap();
            // The transformer's output (its values do not matter to what is held).
            let out = Tensor::randn(
                seed as f32,
                1.0,
                (ROWS, TOKENS, out_per_token),
                &Device::Cpu,
            )
            .unwrap();
            let kept = run.output(out).unwrap();
            drop((x, h, kept));
            most = most.max(alloc::live().saturating_sub(before));
        }
    }
    most
}

/// Wan at its real hidden width, then the other families that run step caches at the
/// widths of the components diffusers saved: what each holds is counted (a family stating
/// no widths would reserve nothing). One test, so no other thread allocates meanwhile.
#[test]
fn the_bytes_a_cache_holds_are_the_models_figure() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("wan");
    let mut o = SynthOptions::preset("wan-tiny").unwrap();
    o.set_layers(1);
    o.sparse = true;
    o.dtype = safetensors::Dtype::F32;
    synth(&out, &o).unwrap();
    holds_the_models_figure(&Model::open(&out).unwrap());
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    for name in ["cosmos3-tiny", "qwen-image-tiny"] {
        let model = Model::open(&fixtures.join(name)).unwrap();
        assert!(!model.family.step_caches().is_empty(), "{name}");
        holds_the_models_figure(&model);
    }
}

fn holds_the_models_figure(model: &Model) {
    assert!(alloc::installed());
    let cost = model.checkpoint.activation_cost();
    let hidden = (cost.hidden_bytes_per_token / 4) as usize;
    let out_per_token = (cost.output_bytes_per_token / 4) as usize;
    let experts = cost.cache_states as usize;
    assert!(hidden > 0 && out_per_token > 0, "{cost:?}");
    let settings = [
        StepCache::FirstBlock { threshold: 0.05 },
        StepCache::parse("c", r#"{"kind":"mag","ratios":[1.0,0.99,0.98]}"#).unwrap(),
        StepCache::Taylorseer {
            cache_interval: 3,
            disable_cache_before_step: 1,
            disable_cache_after_step: None,
            max_order: 2,
        },
    ];
    for cfg in &settings {
        let hold = cfg.hold();
        let measured = held(cfg, hidden, out_per_token, experts);
        // The model's held tensors: every row's, in every expert that keeps its own state.
        let model_held = ROWS as u64
            * experts as u64
            * TOKENS as u64
            * (cost.hidden_bytes_per_token * hold.held_hidden
                + cost.output_bytes_per_token * hold.held_outputs);
        println!(
            "{} {}: holds {measured} B measured / {model_held} B counted by the memory model",
            model.family.name(),
            cfg.kind()
        );
        // The tensors' bytes, beside a few kilobytes of bookkeeping (the states' maps,
        // the tensors' headers, the report).
        let off = (measured as f64 - model_held as f64).abs() / model_held as f64;
        assert!(
            off <= 0.02,
            "{}: measured {measured} B, the model counts {model_held} B",
            cfg.kind()
        );
    }
}
