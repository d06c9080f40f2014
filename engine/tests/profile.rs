//! The header-only profile: right figures on a real layout, and nothing but headers read
//! on a 100+ GB sparse checkpoint.

mod common;

use layerwise_engine::checkpoint::{ActivationCost, RequestShape};
use layerwise_engine::tools::synth::{synth, SynthOptions};

/// Bytes this process has read through read(2)-like calls so far.
fn rchar() -> u64 {
    std::fs::read_to_string("/proc/self/io")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("rchar:").map(|v| v.trim().parse().unwrap()))
        })
        .unwrap_or(0)
}

#[test]
fn profile_of_a_tiny_checkpoint_adds_up() {
    let d = tempfile::tempdir().unwrap();
    let m = common::tiny(d.path(), 6);
    let p = layerwise_engine::families::profile(&m).unwrap();
    assert_eq!(p.blocks, 6);
    assert_eq!(p.block_bytes.len(), 6);
    assert!(p.block_bytes.iter().all(|&b| b == p.largest_block_bytes));
    assert_eq!(
        p.transformer_bytes,
        p.outside_block_bytes + 6 * p.largest_block_bytes
    );
    assert_eq!(p.total_bytes, p.transformer_bytes + p.vae_bytes);
    assert_eq!(p.bytes_by_dtype.values().sum::<u64>(), p.total_bytes);
    assert_eq!(p.slot_bytes(1), p.largest_block_bytes.div_ceil(256) * 256);
    let at = |side: u64| {
        p.activation.bytes(&RequestShape {
            width: side,
            height: side,
            frames: 1,
            batch: 1,
            guidance: true,
            text_tokens: 0,
            cache: Default::default(),
        })
    };
    assert!(at(128) > at(64));
}

/// Wan's figure counts its prompt: the text keys and values beside every block's latent
/// tokens, and the text encoder's own pass (prompt and negative prompt together, scores
/// of every head), which for a long prompt at a small size is the peak. A class-conditional
/// DiT has no such term.
#[test]
fn a_text_familys_activations_grow_with_its_prompt() {
    let d = tempfile::tempdir().unwrap();
    let wan = d.path().join("wan");
    synth(&wan, &SynthOptions::preset("wan-tiny").unwrap()).unwrap();
    let a = layerwise_engine::families::profile(&wan)
        .unwrap()
        .activation;
    assert!(
        a.bytes_per_text_token > 0 && a.encoder_bytes_per_token_pair > 0,
        "{a:?}"
    );
    let shape = |text_tokens: u64, guidance: bool| RequestShape {
        width: 32,
        height: 32,
        frames: 1,
        batch: 1,
        guidance,
        text_tokens,
        cache: Default::default(),
    };
    let (short, long) = (a.bytes(&shape(16, true)), a.bytes(&shape(4096, true)));
    assert!(long > short, "{short} {long}");
    // 4096 tokens: the encoder peaks at its attention, whose scores are quadratic in the
    // prompt (above its feed-forward), twice over under guidance (the negative prompt
    // encodes beside the prompt).
    let encoder =
        |t: u64| a.encoder_attention_bytes_per_token * t + a.encoder_bytes_per_token_pair * t * t;
    assert!(a.encoder_attention_bytes_per_token > 0, "{a:?}");
    assert!(encoder(4096) > a.encoder_bytes_per_token * 4096, "{a:?}");
    assert_eq!(long, 2 * encoder(4096));
    assert_eq!(a.bytes(&shape(4096, false)), encoder(4096));
    let guided_once = ActivationCost {
        guidance_samples: 1,
        ..a.clone()
    };
    assert_eq!(guided_once.bytes(&shape(4096, true)), encoder(4096));
    let dit = d.path().join("dit");
    synth(&dit, &SynthOptions::preset("tiny").unwrap()).unwrap();
    let c = layerwise_engine::families::profile(&dit)
        .unwrap()
        .activation;
    assert_eq!(c.bytes(&shape(0, true)), c.bytes(&shape(4096, true)));
}

#[test]
fn profile_of_a_sparse_120_gb_checkpoint_reads_only_headers() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("huge");
    let mut o = SynthOptions::preset("xl").unwrap();
    o.set_heads(Some(32), Some(128));
    o.set_layers(96);
    o.sparse = true;
    o.max_shard_bytes = Some(10 << 30);
    synth(&out, &o).unwrap();
    let before = rchar();
    let t = std::time::Instant::now();
    let p = layerwise_engine::families::profile(&out).unwrap();
    let took = t.elapsed();
    let read = rchar() - before;
    println!(
        "profiled {} bytes in {} files: {:?}, {read} bytes read",
        p.total_bytes, p.files, took
    );
    assert!(p.total_bytes > 100_000_000_000, "{}", p.total_bytes);
    assert_eq!(p.blocks, 96);
    assert!(p.files > 10);
    // Headers and configs only: a few hundred KB, not the 100+ GB behind them.
    assert!(read < 4 << 20, "read {read} bytes");
}
