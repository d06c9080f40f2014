//! `--host-memory pin` on the CPU backend: copies from the host stage through a bounded
//! ring per rank, as on a GPU that cannot register the mapping. Pinned host bytes stay
//! within the ring whatever the model's depth, outputs stay bit-identical to copying from
//! the mapping, and a buffer is never refilled before the copy that reads it is done.

mod common;

use std::time::Duration;

use layerwise_engine::contract::SlotsChoice;
use layerwise_engine::engine::Model;
use layerwise_engine::execution::cuda::HostMode;
use layerwise_engine::execution::rank::EngineOptions;
use layerwise_engine::memory::{self, Placement};
use layerwise_engine::Strategy;

fn opts(strategy: Strategy, dp: usize, slots: usize, host: HostMode) -> EngineOptions {
    EngineOptions {
        strategy,
        dp,
        slots: SlotsChoice::Fixed(slots),
        host,
        decode: false,
        timeout: Duration::from_secs(60),
        ..EngineOptions::default()
    }
}

#[test]
fn pinned_host_bytes_stay_within_the_ring_whatever_the_depth() {
    let dir = tempfile::tempdir().unwrap();
    let requests = vec![common::request(5, 2, 4.0), common::request(6, 1, 1.0)];
    let mut rings = Vec::new();
    for layers in [8, 32] {
        let model = Model::open(&common::tiny(dir.path(), layers)).unwrap();
        let groups = model.group_bytes().unwrap();
        for (strategy, dp, k) in [
            (Strategy::OffloadSharded, 2, 2),
            (Strategy::Offload, 1, 3),
            (Strategy::Offload, 2, 2),
            (Strategy::OffloadSharded, 3, 3),
        ] {
            let what = format!("{strategy} dp={dp} K={k} L={layers}");
            let (direct, d) = model
                .run(requests.clone(), &opts(strategy, dp, k, HostMode::Auto))
                .unwrap();
            let (staged, s) = model
                .run(requests.clone(), &opts(strategy, dp, k, HostMode::Pin))
                .unwrap();
            for (a, b) in direct.iter().zip(&staged) {
                assert_eq!(common::bits(&a.latents), common::bits(&b.latents), "{what}");
            }
            assert_eq!(d.peak_pinned_host_bytes, 0, "{what}: auto pins nothing");
            assert_eq!(d.bytes_staged, 0, "{what}");
            // Every byte copied from the host went through the ring.
            assert!(s.bytes_copied > 0, "{what}");
            assert_eq!(s.bytes_staged, s.bytes_copied, "{what}");
            let p = Placement::new(strategy, dp as u64, k as u64, groups.len());
            let ring = memory::staging_ring_bytes(&groups, &p, memory::STAGING_BUFFERS);
            assert!(
                s.peak_pinned_host_bytes > 0 && s.peak_pinned_host_bytes <= ring,
                "{what}: {} pinned, ring {ring}",
                s.peak_pinned_host_bytes
            );
            // The pod's figure in the planner's model is dp rings.
            assert_eq!(memory::pinned_host_bytes(&groups, &p), dp as u64 * ring);
            // A pinned copy of what one rank streams would have grown with the depth.
            let per_rank_streamed = groups.iter().map(|g| g.bytes()).sum::<u64>()
                / if strategy == Strategy::OffloadSharded {
                    dp as u64
                } else {
                    1
                };
            if layers == 32 {
                assert!(
                    s.peak_pinned_host_bytes < per_rank_streamed,
                    "{what}: {} pinned for {per_rank_streamed} streamed",
                    s.peak_pinned_host_bytes
                );
            }
            rings.push((
                what.replace(&format!("L={layers}"), ""),
                s.peak_pinned_host_bytes,
            ));
        }
    }
    // The same configuration pins the same bytes at 8 and at 32 blocks.
    let (shallow, deep) = rings.split_at(rings.len() / 2);
    assert_eq!(shallow, deep);
}

#[test]
fn pin_gives_the_same_latents_for_every_strategy() {
    let dir = tempfile::tempdir().unwrap();
    let model = Model::open(&common::tiny(dir.path(), 5)).unwrap();
    let requests = vec![common::request(1, 2, 4.0), common::request(2, 1, 0.0)];
    let (reference, _) = model
        .run(
            requests.clone(),
            &opts(Strategy::Resident, 1, 2, HostMode::Auto),
        )
        .unwrap();
    let reference: Vec<Vec<u32>> = reference.iter().map(|o| common::bits(&o.latents)).collect();
    for strategy in Strategy::ALL {
        let (out, s) = model
            .run(requests.clone(), &opts(strategy, 2, 2, HostMode::Pin))
            .unwrap();
        let got: Vec<Vec<u32>> = out.iter().map(|o| common::bits(&o.latents)).collect();
        assert_eq!(got, reference, "{strategy}");
        // Resident and sharded copy from the host only at start: no ring.
        let rings = matches!(strategy, Strategy::Offload | Strategy::OffloadSharded);
        assert_eq!(s.peak_pinned_host_bytes > 0, rings, "{strategy}");
    }
}

/// Two buffers, more slots than buffers (so the pipeline issues further ahead than the
/// ring holds), and copies slowed at random: a fill that did not wait for the copy out of
/// its buffer would overwrite a block's shard before it reached the slot, and the latents
/// would differ.
#[test]
fn a_buffer_is_refilled_only_after_its_copy() {
    let dir = tempfile::tempdir().unwrap();
    let model = Model::open(&common::tiny(dir.path(), 7)).unwrap();
    let requests = vec![
        common::request(3, 3, 4.0),
        common::request(4, 2, 1.5),
        common::request(7, 2, 0.0),
    ];
    let (reference, _) = model
        .run(
            requests.clone(),
            &opts(Strategy::Resident, 1, 2, HostMode::Auto),
        )
        .unwrap();
    let reference: Vec<Vec<u32>> = reference.iter().map(|o| common::bits(&o.latents)).collect();
    for (strategy, dp, k, buffers) in [
        (Strategy::OffloadSharded, 2, 4, 2),
        (Strategy::OffloadSharded, 2, 3, 1),
        (Strategy::Offload, 1, 4, 2),
    ] {
        for seed in 0..3 {
            let mut o = opts(strategy, dp, k, HostMode::Pin);
            o.staging_buffers = buffers;
            o.hook = Some(common::jitter(seed * 7 + buffers as u64));
            let (out, s) = model.run(requests.clone(), &o).unwrap();
            let got: Vec<Vec<u32>> = out.iter().map(|o| common::bits(&o.latents)).collect();
            assert_eq!(
                got, reference,
                "{strategy} dp={dp} K={k} buffers={buffers} seed={seed}"
            );
            assert_eq!(s.bytes_staged, s.bytes_copied);
        }
    }
}

#[test]
fn an_empty_ring_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let model = Model::open(&common::tiny(dir.path(), 3)).unwrap();
    let mut o = opts(Strategy::OffloadSharded, 2, 2, HostMode::Pin);
    o.staging_buffers = 0;
    let e = model
        .run(vec![common::request(1, 1, 1.0)], &o)
        .err()
        .expect("an empty ring runs")
        .to_string();
    assert!(
        e.contains("staging") && e.contains("at least one buffer"),
        "{e}"
    );
}
