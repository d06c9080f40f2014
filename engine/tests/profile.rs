//! The header-only profile: right figures on a real layout, and nothing but headers read
//! on a 100+ GB sparse checkpoint.

mod common;

use layerwise_engine::checkpoint::Profile;
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
    let p = Profile::read(&m).unwrap();
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
    assert!(p.activation.bytes(128, 128, 1, 1, true) > p.activation.bytes(64, 64, 1, 1, true));
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
    let p = Profile::read(&out).unwrap();
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
