//! The contracts of docs/architecture.md that the engine core owns: bit-identical outputs
//! across strategies, dp and K (also under randomly slowed transfers), and device memory
//! for weights bounded by K slots whatever the depth.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use layerwise_engine::contract::ResidentBlocks;
use layerwise_engine::contract::SlotsChoice;
use layerwise_engine::engine::Model;
use layerwise_engine::execution::dtype::ComputeDtype;
use layerwise_engine::execution::rank::EngineOptions;
use layerwise_engine::memory::{self, Placement};
use layerwise_engine::Strategy;
use safetensors::Dtype;

fn opts(strategy: Strategy, dp: usize, slots: usize) -> EngineOptions {
    EngineOptions {
        strategy,
        dp,
        slots: SlotsChoice::Fixed(slots),
        decode: false,
        timeout: Duration::from_secs(60),
        ..EngineOptions::default()
    }
}

#[test]
fn every_strategy_dp_and_k_gives_identical_latents() {
    let dir = tempfile::tempdir().unwrap();
    let model = Model::open(&common::tiny(dir.path(), 5)).unwrap();
    // Different step counts and guidance in one run: ranks finish at different passes
    // and idle ranks keep joining the collectives.
    let requests = vec![
        common::request(1, 3, 4.0),
        common::request(2, 2, 1.0),
        common::request(3, 4, 1.5),
        common::request(4, 1, 0.0),
    ];
    let (reference, _) = model
        .run(requests.clone(), &opts(Strategy::Resident, 1, 2))
        .unwrap();
    let reference: Vec<Vec<u32>> = reference.iter().map(|o| common::bits(&o.latents)).collect();
    let mut runs = 0;
    for strategy in Strategy::ALL {
        for dp in 1..=3 {
            for k in 2..=3 {
                for slow in [false, true] {
                    let mut o = opts(strategy, dp, k);
                    if slow {
                        o.hook = Some(common::jitter(dp as u64 * 10 + k as u64));
                    }
                    let (out, stats) = model.run(requests.clone(), &o).unwrap();
                    let got: Vec<Vec<u32>> = out.iter().map(|o| common::bits(&o.latents)).collect();
                    assert_eq!(got, reference, "{strategy} dp={dp} K={k} slowed={slow}");
                    assert!(
                        (0.0..=1.0).contains(&stats.stall_fraction),
                        "stall fraction {}",
                        stats.stall_fraction
                    );
                    // sharded at dp = 1 holds the whole model in its shard store: nothing crosses.
                    if strategy.streams() && !(strategy == Strategy::Sharded && dp == 1) {
                        assert!(stats.bytes_copied + stats.bytes_gathered > 0);
                    }
                    runs += 1;
                }
            }
        }
    }
    assert_eq!(runs, 48);
}

#[test]
fn blocks_kept_on_the_device_give_identical_latents_and_cut_the_copies_by_n_over_l() {
    let dir = tempfile::tempdir().unwrap();
    let layers = 6u64;
    let model = Model::open(&common::tiny(dir.path(), layers as usize)).unwrap();
    let requests = vec![common::request(1, 3, 4.0), common::request(2, 2, 1.0)];
    let (reference, _) = model
        .run(requests.clone(), &opts(Strategy::Resident, 1, 2))
        .unwrap();
    let reference: Vec<Vec<u32>> = reference.iter().map(|o| common::bits(&o.latents)).collect();
    for (strategy, dp) in [
        (Strategy::Sharded, 2),
        (Strategy::Offload, 1),
        (Strategy::OffloadSharded, 2),
    ] {
        let mut moved = Vec::new();
        for n in [0u64, 1, 3, 5] {
            let mut o = opts(strategy, dp, 2);
            o.resident_blocks = ResidentBlocks::Fixed(n as usize);
            o.hook = Some(common::jitter(n + 3));
            let (out, stats) = model.run(requests.clone(), &o).unwrap();
            let got: Vec<Vec<u32>> = out.iter().map(|o| common::bits(&o.latents)).collect();
            assert_eq!(got, reference, "{strategy} dp={dp} N={n}");
            moved.push(stats.bytes_copied + stats.bytes_gathered);
            assert!(n == 5 || stats.bytes_copied_per_step + stats.bytes_gathered_per_step > 0);
            assert_eq!(
                stats
                    .peak_device_bytes_by_kind
                    .contains_key("resident_blocks"),
                n > 0,
                "{strategy} N={n}"
            );
        }
        // Uniform blocks: what still moves is (L − N)/L of what moved with none kept.
        for (i, n) in [1u64, 3, 5].into_iter().enumerate() {
            assert_eq!(
                moved[i + 1] * layers,
                moved[0] * (layers - n),
                "{strategy} N={n}: {moved:?}"
            );
        }
    }
    // auto keeps as many as the budget holds after the slots, and says it needs a budget.
    let mut o = opts(Strategy::Offload, 1, 2);
    o.resident_blocks = ResidentBlocks::Auto;
    let e = model.run(requests.clone(), &o).err().unwrap().to_string();
    assert!(e.contains("--device-memory-mib"), "{e}");
    let groups = model.group_bytes().unwrap();
    let outside = model.family.resident_bytes(false);
    let with = |n| {
        let p = Placement {
            resident_blocks: n,
            ..Placement::new(Strategy::Offload, 1, 2, groups.len())
        };
        memory::device_bytes(&groups, &p, outside, 0, 0).weights()
    };
    o.device_memory = with(4);
    let (out, stats) = model.run(requests, &o).unwrap();
    assert_eq!(common::bits(&out[0].latents), reference[0]);
    assert_eq!(stats.peak_device_bytes, with(4), "auto kept 4 of 6 blocks");
}

#[test]
fn offload_sharded_moves_one_copy_per_rank_share() {
    let dir = tempfile::tempdir().unwrap();
    let model = Model::open(&common::tiny(dir.path(), 4)).unwrap();
    let reqs = vec![common::request(1, 2, 1.0), common::request(2, 2, 1.0)];
    let (_, one) = model
        .run(reqs.clone(), &opts(Strategy::Offload, 2, 2))
        .unwrap();
    let (_, shared) = model
        .run(reqs, &opts(Strategy::OffloadSharded, 2, 2))
        .unwrap();
    // offload: every rank copies whole blocks; offload-sharded: each copies 1/dp and
    // gathers the rest, so host traffic halves.
    assert_eq!(one.bytes_gathered, 0);
    assert!(
        shared.bytes_copied * 2 <= one.bytes_copied + 2 * 256 * 4 * 2 * 2,
        "{} vs {}",
        shared.bytes_copied,
        one.bytes_copied
    );
    assert_eq!(shared.bytes_copied, shared.bytes_gathered);
}

#[test]
fn device_weights_stay_within_k_slots_whatever_the_depth() {
    let dir = tempfile::tempdir().unwrap();
    let mut peaks = Vec::new();
    for layers in [8, 32] {
        let model = Model::open(&common::tiny(dir.path(), layers)).unwrap();
        for (strategy, dp, k) in [
            (Strategy::OffloadSharded, 2, 2),
            (Strategy::Offload, 1, 3),
            (Strategy::OffloadSharded, 3, 3),
        ] {
            let (_, s) = model
                .run(vec![common::request(5, 2, 4.0)], &opts(strategy, dp, k))
                .unwrap();
            let outside = s.peak_device_bytes_by_kind["resident_outside_blocks"];
            let weights =
                s.peak_device_bytes - s.peak_device_bytes_by_kind.get("vae").copied().unwrap_or(0);
            let bound = k as u64 * s.largest_padded_block_bytes + outside;
            assert!(
                weights <= bound,
                "{strategy} dp={dp} K={k} L={layers}: {weights} > {bound}"
            );
            assert_eq!(
                s.peak_device_bytes_by_kind["slots"],
                k as u64 * s.largest_padded_block_bytes
            );
            peaks.push((strategy, dp, k, s.peak_device_bytes));
        }
    }
    // The same configuration holds the same bytes at 8 and at 32 blocks.
    let (shallow, deep) = peaks.split_at(3);
    for (a, b) in shallow.iter().zip(deep) {
        assert_eq!(a, b);
    }
}

#[test]
fn resident_and_sharded_hold_what_they_promise() {
    let dir = tempfile::tempdir().unwrap();
    let model = Model::open(&common::tiny(dir.path(), 6)).unwrap();
    let block: u64 = model.layouts(2).unwrap()[0]
        .blocks
        .iter()
        .map(|b| b.padded_bytes())
        .sum();
    let (_, r) = model
        .run(
            vec![common::request(1, 1, 1.0)],
            &opts(Strategy::Resident, 2, 2),
        )
        .unwrap();
    assert_eq!(r.peak_device_bytes_by_kind["resident_blocks"], block);
    let (_, s) = model
        .run(
            vec![common::request(1, 1, 1.0)],
            &opts(Strategy::Sharded, 2, 2),
        )
        .unwrap();
    assert_eq!(
        s.peak_device_bytes_by_kind["resident_shards"],
        model.layouts(2).unwrap()[0]
            .region_capacity
            .iter()
            .sum::<u64>()
            / 2
            * 6
    );
}

#[test]
fn a_budget_too_small_for_the_slots_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let model = Model::open(&common::tiny(dir.path(), 4)).unwrap();
    let mut o = opts(Strategy::OffloadSharded, 2, 2);
    o.device_memory = 300_000;
    let e = model
        .run(vec![common::request(1, 1, 1.0)], &o)
        .err()
        .unwrap()
        .to_string();
    // Refused before any rank starts, with the need's terms and the budget.
    assert!(
        e.contains("device-memory") && e.contains("slots") && e.contains("budget is 300000 bytes"),
        "{e}"
    );
}

#[test]
fn sharded_files_and_half_precision_load() {
    let dir = tempfile::tempdir().unwrap();
    let single = Model::open(&common::tiny(dir.path(), 4)).unwrap();
    let split = common::tiny_with(&dir.path().join("split"), 4, |o| {
        o.max_shard_bytes = Some(200_000)
    });
    assert!(split
        .join("transformer/diffusion_pytorch_model.safetensors.index.json")
        .is_file());
    let split = Model::open(&split).unwrap();
    assert!(split.checkpoint.components()[0].1.files.len() > 3);
    let reqs = vec![common::request(9, 2, 4.0)];
    let a = single
        .run(reqs.clone(), &opts(Strategy::OffloadSharded, 2, 2))
        .unwrap()
        .0;
    let b = split
        .run(reqs.clone(), &opts(Strategy::OffloadSharded, 2, 2))
        .unwrap()
        .0;
    assert_eq!(common::bits(&a[0].latents), common::bits(&b[0].latents));
    let half = common::tiny_with(&dir.path().join("bf16"), 4, |o| {
        o.dtype = safetensors::Dtype::BF16
    });
    let half = Model::open(&half).unwrap();
    let r = half
        .run(reqs.clone(), &opts(Strategy::Resident, 1, 2))
        .unwrap()
        .0;
    let s = half
        .run(reqs, &opts(Strategy::OffloadSharded, 3, 2))
        .unwrap()
        .0;
    assert_eq!(common::bits(&r[0].latents), common::bits(&s[0].latents));
}

#[test]
fn images_decode_to_the_requested_size() {
    let dir = tempfile::tempdir().unwrap();
    let model = Model::open(&common::tiny(dir.path(), 2)).unwrap();
    let mut r = common::request(3, 2, 4.0);
    r.width = 96;
    r.height = 64;
    let mut o = opts(Strategy::OffloadSharded, 1, 2);
    o.decode = true;
    let (out, _) = model.run(vec![r], &o).unwrap();
    assert_eq!(out[0].image.as_ref().unwrap().dims(), &[3, 64, 96]);
    assert_eq!(out[0].latents.dims(), &[1, 4, 8, 12]);
}

#[test]
fn a_stalled_transfer_fails_the_run_with_a_clear_error_instead_of_hanging() {
    let dir = tempfile::tempdir().unwrap();
    let model = Model::open(&common::tiny(dir.path(), 4)).unwrap();
    for strategy in [
        Strategy::OffloadSharded,
        Strategy::Sharded,
        Strategy::Offload,
    ] {
        let calls = Arc::new(AtomicU64::new(0));
        let c = calls.clone();
        let mut o = opts(strategy, 2, 2);
        o.timeout = Duration::from_millis(300);
        // The seventh transfer of the run never finishes in time: a wedged copy engine.
        o.hook = Some(Arc::new(move |_| {
            if c.fetch_add(1, Ordering::SeqCst) == 6 {
                std::thread::sleep(Duration::from_secs(2));
            }
        }));
        let start = std::time::Instant::now();
        let err = model
            .run(
                vec![common::request(1, 3, 4.0), common::request(2, 3, 4.0)],
                &o,
            )
            .err()
            .unwrap_or_else(|| panic!("{strategy}: a stalled transfer went unnoticed"))
            .to_string();
        println!("{strategy}: {err}");
        assert!(err.contains("rank"), "{strategy}: {err}");
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{strategy}: took {:?}",
            start.elapsed()
        );
    }
}

/// Latents of `requests` under every strategy (dp 1 and 2, K 2 and 3, transfers slowed at
/// random) computed in `dtype`: asserts they are bit-identical and returns them.
fn identical_across_strategies(
    model: &Model,
    requests: &[layerwise_engine::execution::work::Request],
    dtype: ComputeDtype,
) -> Vec<Vec<u32>> {
    let mut reference: Option<Vec<Vec<u32>>> = None;
    for strategy in Strategy::ALL {
        for (dp, k) in [(1, 2), (2, 2), (2, 3)] {
            let mut o = opts(strategy, dp, k);
            o.compute_dtype = dtype;
            o.hook = Some(common::jitter(dp as u64 * 10 + k as u64));
            let (out, _) = model.run(requests.to_vec(), &o).unwrap();
            let got: Vec<Vec<u32>> = out.iter().map(|o| common::bits(&o.latents)).collect();
            match &reference {
                None => reference = Some(got),
                Some(r) => assert_eq!(&got, r, "{dtype}: {strategy} dp={dp} K={k}"),
            }
        }
    }
    reference.unwrap()
}

/// ‖a − b‖ / ‖b‖ over every latent of every request.
fn relative_difference(a: &[Vec<u32>], b: &[Vec<u32>]) -> f64 {
    let (mut d, mut n) = (0f64, 0f64);
    for (x, y) in a.iter().flatten().zip(b.iter().flatten()) {
        let (x, y) = (f32::from_bits(*x) as f64, f32::from_bits(*y) as f64);
        d += (x - y) * (x - y);
        n += y * y;
    }
    (d / n).sqrt()
}

#[test]
fn half_precision_compute_is_bit_identical_across_strategies_and_near_f32() {
    let requests = vec![common::request(1, 3, 4.0), common::request(2, 2, 1.0)];
    for stored in [Dtype::F32, Dtype::BF16] {
        let dir = tempfile::tempdir().unwrap();
        let model = Model::open(&common::tiny_with(dir.path(), 4, |o| o.dtype = stored)).unwrap();
        let f32 = identical_across_strategies(&model, &requests, ComputeDtype::F32);
        // The CPU's `auto` is f32.
        let (auto, _) = model
            .run(requests.clone(), &opts(Strategy::Offload, 1, 2))
            .unwrap();
        let auto: Vec<Vec<u32>> = auto.iter().map(|o| common::bits(&o.latents)).collect();
        assert_eq!(auto, f32, "{stored:?}: auto on the CPU is f32");
        for half in [ComputeDtype::Bf16, ComputeDtype::F16] {
            let got = identical_across_strategies(&model, &requests, half);
            // The half-precision path ran (the bits differ from f32) and computes the
            // same function: about 1.6 % off for bf16 (8 significant bits) and 0.2 % for
            // f16 (11 bits) on this model.
            let d = relative_difference(&got, &f32);
            println!("{stored:?} checkpoint, {half} compute: ‖latents − f32 latents‖ / ‖f32 latents‖ = {d:.5}");
            assert!(d > 0.0, "{stored:?} {half}: identical to f32, so f32 ran");
            let bound = if half == ComputeDtype::Bf16 {
                0.05
            } else {
                0.01
            };
            assert!(d < bound, "{stored:?} {half}: {d} from f32");
        }
    }
}

#[test]
fn generate_with_bf16_compute_writes_identical_latents_for_every_strategy() {
    let dir = tempfile::tempdir().unwrap();
    let model = common::tiny_with(dir.path(), 3, |o| o.dtype = Dtype::BF16);
    let mut latents = Vec::new();
    for strategy in Strategy::ALL {
        let file = dir.path().join(format!("{strategy}.safetensors"));
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_layerwise"))
            .args(["generate", "--model", model.to_str().unwrap()])
            .args(["--out", dir.path().join("x.png").to_str().unwrap()])
            .args(["--save-latents", file.to_str().unwrap()])
            .args([
                "--steps", "2", "--seed", "9", "--dp", "2", "--device", "cpu",
            ])
            .args([
                "--compute-dtype",
                "bf16",
                "--strategy",
                &strategy.to_string(),
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{strategy}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        latents.push((strategy, std::fs::read(&file).unwrap()));
    }
    for (strategy, bytes) in &latents[1..] {
        assert!(
            bytes == &latents[0].1,
            "{strategy} differs from {}",
            latents[0].0
        );
    }
    // And bf16 is not f32 under another name.
    let file = dir.path().join("f32.safetensors");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_layerwise"))
        .args(["generate", "--model", model.to_str().unwrap()])
        .args(["--out", dir.path().join("x.png").to_str().unwrap()])
        .args(["--save-latents", file.to_str().unwrap()])
        .args(["--steps", "2", "--seed", "9", "--device", "cpu"])
        .args(["--compute-dtype", "f32"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(std::fs::read(&file).unwrap() != latents[0].1);
}
