//! Host memory: streaming strategies keep weights in the mapped page cache, so the
//! process's anonymous memory stays far below the checkpoint. Its own test binary, so no
//! other test's allocations share the process.

mod common;

use layerwise_engine::contract::SlotsChoice;
use layerwise_engine::engine::Model;
use layerwise_engine::execution::rank::EngineOptions;
use layerwise_engine::Strategy;

#[test]
fn offload_sharded_keeps_anonymous_memory_far_below_the_checkpoint() {
    let d = tempfile::tempdir().unwrap();
    // Deep and narrow: 64 blocks of ~5.7 MB, so K slots are a small part of the model.
    let m = common::tiny_with(d.path(), 64, |o| {
        o.set_heads(Some(4), Some(64));
    });
    let model = Model::open(&m).unwrap();
    let opts = EngineOptions {
        strategy: Strategy::OffloadSharded,
        dp: 2,
        slots: SlotsChoice::Fixed(2),
        decode: false,
        ..EngineOptions::default()
    };
    let reqs = vec![common::request(1, 2, 4.0), common::request(2, 2, 4.0)];
    let (_, s) = model.run(reqs, &opts).unwrap();
    println!(
        "checkpoint {} bytes, peak anon RSS {} bytes ({:.1}%), peak device {} bytes per rank",
        s.checkpoint_bytes,
        s.peak_anon_rss_bytes,
        100.0 * s.peak_anon_rss_bytes as f64 / s.checkpoint_bytes as f64,
        s.peak_device_bytes
    );
    assert!(s.checkpoint_bytes > 300 << 20);
    assert!(s.peak_anon_rss_bytes > 0, "RssAnon unreadable");
    assert!(
        s.peak_anon_rss_bytes < s.checkpoint_bytes / 4,
        "{} vs {}",
        s.peak_anon_rss_bytes,
        s.checkpoint_bytes
    );
}
