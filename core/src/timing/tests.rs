use std::collections::BTreeMap;

use super::*;
use crate::bounds::RequestBounds;
use crate::checkpoint::ActivationCost;
use crate::memory::{GroupBytes, Placement};
use crate::topology::Topology;
use crate::Strategy;

const GB: u64 = 1_000_000_000;

fn group(component: &str, blocks: usize, bytes: u64) -> GroupBytes {
    let mut m = BTreeMap::new();
    m.insert("BF16".to_string(), vec![bytes; blocks]);
    GroupBytes {
        component: component.into(),
        blocks_by_dtype: m,
    }
}

/// Round figures: 1 s of compute per TFLOP, 1 GB/s from the host, 10 GB/s between peers.
fn rates() -> Rates {
    Rates {
        device_flops: 1e12,
        host_to_device: 1e9,
        peer: 10e9,
        overlap: 1.0,
    }
}

fn work(tokens: u64, steps: u64) -> Work {
    Work {
        tokens,
        text_tokens: 100,
        steps,
        samples: 1,
        passes_per_step: 1,
        sp: 1,
        exchange_bytes_per_token: 0,
    }
}

/// A transformer of `blocks` blocks of 1 GB (1 s to copy at [`rates`]) whose blocks
/// compute for `compute` seconds each at [`work`]`(1000, _)`.
fn transformer(blocks: usize, compute: f64) -> (Vec<GroupBytes>, Vec<GroupCompute>) {
    let c = GroupCompute {
        component: "transformer".into(),
        runs: Runs::PerStep,
        tokens: Tokens::Latent,
        flops_per_token: (compute * 1e12 / 1000.0) as u64,
        ..GroupCompute::default()
    };
    (vec![group("transformer", blocks, GB)], vec![c])
}

fn offload(k: u64, kept: u64) -> Placement {
    Placement {
        resident_blocks: kept,
        ..Placement::new(Strategy::Offload, 1, k, 1)
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-6 * b.abs().max(1.0)
}

#[test]
fn a_copy_bound_pass_takes_its_copies_and_a_compute_bound_one_its_compute() {
    // Copies of 1 s behind computes of 0.25 s: the steady pass is 10 copies long.
    let (g, c) = transformer(10, 0.25);
    let p = predict(&g, &c, &work(1000, 10), &offload(2, 0), &rates());
    assert!(close(p.step, 10.0), "{p:?}");
    assert!(
        close(p.step_compute, 2.5) && close(p.step_copy, 10.0),
        "{p:?}"
    );
    assert!(close(p.step_exposed, 7.5), "{p:?}");
    // Computes of 2 s: every copy hides, the first of the request's aside.
    let (g, c) = transformer(10, 2.0);
    let p = predict(&g, &c, &work(1000, 10), &offload(2, 0), &rates());
    assert!(close(p.step, 20.0) && close(p.step_exposed, 0.0), "{p:?}");
    assert!(close(p.request, 1.0 + 10.0 * 20.0), "{p:?}");
    // Resident: compute alone.
    let all = Placement::new(Strategy::Resident, 1, 0, 1);
    let p = predict(&g, &c, &work(1000, 10), &all, &rates());
    assert!(close(p.request, 200.0) && close(p.step_copy, 0.0), "{p:?}");
}

#[test]
fn kept_blocks_save_their_copies_until_the_rest_hide() {
    // 12 blocks, compute 0.5 s, copy 1 s: the streamed copies hide once 12·0.5 ≥ (12−n)·1,
    // at n = 6, given slots enough to copy ahead across the kept blocks' computes.
    let (g, c) = transformer(12, 0.5);
    let w = work(1000, 20);
    let step = |k, n| predict(&g, &c, &w, &offload(k, n), &rates()).step;
    assert!(close(step(2, 0), 12.0));
    assert!(close(step(4, 3), 9.0), "{}", step(4, 3));
    assert!(close(step(6, 6), 6.0), "{}", step(6, 6));
    assert!(close(step(6, 9), 6.0), "{}", step(6, 9));
    // Spread evenly, the kept blocks leave no run of copies that two slots cannot hide.
    assert!(close(step(2, 6), 6.0), "{}", step(2, 6));
    // The choice: the fewest blocks that reach the floor, not every block that fits.
    let fits = |p: &Placement| {
        let kept = p.blocks_kept(0);
        (kept <= 10).then_some(kept * GB)
    };
    let chosen = choose(&g, &c, &w, &offload(6, 0), &rates(), &fits).unwrap();
    assert_eq!(chosen.kept["transformer"], 6, "{chosen:?}");
    assert!(close(chosen.prediction.step, 6.0));
    // Where only 4 fit, 4.
    let tight = |p: &Placement| (p.blocks_kept(0) <= 4).then_some(p.blocks_kept(0) * GB);
    let chosen = choose(&g, &c, &w, &offload(6, 0), &rates(), &tight).unwrap();
    assert_eq!(chosen.kept["transformer"], 4);
}

#[test]
fn a_long_sequence_keeps_nothing_because_its_copies_already_hide() {
    let (g, c) = transformer(12, 0.5);
    let fits = |p: &Placement| Some(p.blocks_kept(0) * GB);
    // Ten times the tokens: 5 s of compute per block behind 1 s copies.
    let chosen = choose(&g, &c, &work(10_000, 20), &offload(2, 0), &rates(), &fits).unwrap();
    assert_eq!(chosen.kept["transformer"], 0, "{chosen:?}");
    assert!(chosen.prediction.step_exposed < 1e-9);
}

/// A Qwen-Image-shaped model at its request bounds: a 28-layer text encoder of 16.6 GB
/// that runs once per request, 60 transformer blocks of 0.67 GB run every step.
#[test]
fn a_text_encoder_streams_where_its_memory_saves_more_as_transformer_blocks() {
    let te = group("text_encoder", 28, 593_000_000);
    let tr = group("transformer", 60, 670_000_000);
    let groups = vec![te, tr];
    let compute = default_compute(&groups);
    assert_eq!(compute[0].runs, Runs::PerRequest);
    assert_eq!(compute[0].tokens, Tokens::Text);
    assert_eq!(compute[1].runs, Runs::PerStep);
    let w = Work {
        tokens: 4096,
        text_tokens: 512,
        steps: 50,
        samples: 2,
        passes_per_step: 1,
        sp: 1,
        exchange_bytes_per_token: 0,
    };
    let r = Rates::for_product("NVIDIA H100 80GB HBM3").0;
    // 40 GB of device memory for blocks, beside the slots.
    let budget = 40 * GB;
    let fits = |p: &Placement| {
        let b = crate::memory::device_bytes(&groups, p, 0, 0, 0).weights();
        (b <= budget).then_some(b)
    };
    let base = Placement::new(Strategy::Offload, 1, 2, 2);
    let streamed = choose(&groups, &compute, &w, &base, &r, &fits).unwrap();
    let te_kept = base
        .clone()
        .with_resident_components(&groups, &["text_encoder".to_string()]);
    let whole = choose(&groups, &compute, &w, &te_kept, &r, &fits).unwrap();
    assert!(
        streamed.prediction.request > whole.prediction.request,
        "streamed {:?}\nwhole {:?}",
        streamed.prediction,
        whole.prediction
    );
    // The text encoder whole saves 0.26 s of a 27.5 s request: a tie, which goes to the
    // option with the most memory left.
    let best = super::pick([streamed.clone(), whole.clone()]).unwrap();
    assert_eq!(best, streamed);
    // The memory goes to transformer blocks until their copies hide behind the step's
    // compute (0.55 s: 20 of the 60 blocks at 13.4 ms each), none to text-encoder layers.
    assert_eq!(streamed.kept["text_encoder"], 0, "{:?}", streamed.kept);
    assert_eq!(streamed.kept["transformer"], 20, "{:?}", streamed.kept);
    assert!(
        streamed.prediction.step_exposed < 1e-9,
        "{:?}",
        streamed.prediction
    );
}

#[test]
fn experts_share_the_steps() {
    let groups = vec![group("transformer", 4, GB), group("transformer_2", 4, GB)];
    let compute = default_compute(&groups);
    assert!(compute.iter().all(|c| c.runs == Runs::ExpertSteps));
    let w = work(1000, 10);
    let p = Placement::new(Strategy::Resident, 1, 0, 2);
    let pred = predict(&groups, &compute, &w, &p, &rates());
    assert_eq!(pred.groups[0].passes, 5);
    assert_eq!(pred.groups[1].passes, 5);
    // Ten steps of one 4-block expert each, not two.
    assert!(
        close(pred.request, 10.0 * pred.groups[0].compute * 1.0),
        "{pred:?}"
    );
}

#[test]
fn rates_by_product_and_work_at_bounds() {
    assert_eq!(Rates::for_product("NVIDIA H200").1, Some("H200"));
    assert_eq!(Rates::for_product("nvidia a100-sxm4-80gb").1, Some("A100"));
    assert_eq!(Rates::for_product("something new"), (Rates::DEFAULT, None));
    let cost = ActivationCost {
        pixels_per_token: 256,
        bytes_per_token: 0,
        attention_bytes_per_token: 0,
        bytes_per_token_pair: 0,
        attention_bytes: 0,
        vae_bytes_per_pixel: 0,
        frames_per_latent: 4,
        decoder_frames: 1,
        bytes_per_text_token: 0,
        template_tokens: 0,
        encoder_bytes_per_token: 0,
        encoder_attention_bytes_per_token: 0,
        encoder_bytes_per_token_pair: 0,
        guidance_samples: 2,
        samples_in_turn: false,
        waiting_bytes_per_token: 0,
        waiting_bytes_per_text_token: 0,
        encoder_waiting_bytes_per_token: 0,
        exchange_bytes_per_token: 0,
        hidden_bytes_per_token: 0,
        output_bytes_per_token: 0,
        cache_states: 1,
    };
    let b = RequestBounds {
        max_width: 1024,
        max_height: 1024,
        max_frames: 1,
        max_steps: 50,
        max_n: 1,
        guidance: true,
        max_prompt_tokens: 512,
    };
    let w = Work::at_bounds(&cost, &b);
    assert_eq!((w.tokens, w.samples, w.passes_per_step), (4096, 2, 1));
    assert_eq!(w.sp, 1);
    let split = Work::at_bounds(
        &ActivationCost {
            exchange_bytes_per_token: 64,
            ..cost.clone()
        },
        &b,
    )
    .with_sp(4);
    assert_eq!((split.sp, split.exchange_bytes_per_token), (4, 64));
    let video = Work::at_bounds(
        &ActivationCost {
            guidance_samples: 1,
            ..cost
        },
        &RequestBounds {
            max_frames: 81,
            ..b
        },
    );
    assert_eq!(
        (video.tokens, video.samples, video.passes_per_step),
        (21 * 4096, 1, 2)
    );
}

#[test]
fn copies_that_share_the_cores_add_to_compute() {
    // Compute 2 s, copy 1 s: on a GPU every copy hides; where copies take the compute's
    // cores they add up, and every kept block saves its copy.
    let (g, c) = transformer(10, 2.0);
    let w = work(1000, 10);
    let serial = Rates {
        overlap: 0.0,
        ..rates()
    };
    let step = |r: &Rates, n| predict(&g, &c, &w, &offload(2, n), r).step;
    assert!(close(step(&rates(), 0), 20.0));
    assert!(close(step(&serial, 0), 30.0), "{}", step(&serial, 0));
    assert!(close(step(&serial, 4), 26.0), "{}", step(&serial, 4));
    let p = predict(&g, &c, &w, &offload(2, 0), &serial);
    assert!(
        close(p.step_compute, 20.0) && close(p.step_copy, 10.0),
        "{p:?}"
    );
    let half = Rates {
        overlap: 0.5,
        ..rates()
    };
    assert!(step(&half, 0) > 20.0 && step(&half, 0) < 30.0);
}

/// A text encoder of 2 blocks (per request, on the prompt) before a transformer of 10
/// blocks of 1 GB that compute 2 s each on 1000 tokens, exchanging `exchange` bytes per
/// token per block under sequence parallelism.
fn encoded(exchange: u64) -> (Vec<GroupBytes>, Vec<GroupCompute>, Work) {
    let (mut g, mut c) = transformer(10, 2.0);
    g.insert(0, group("text_encoder", 2, GB));
    c.insert(
        0,
        GroupCompute {
            component: "text_encoder".into(),
            runs: Runs::PerRequest,
            tokens: Tokens::Text,
            flops_per_token: 10_000_000_000,
            ..GroupCompute::default()
        },
    );
    let w = Work {
        exchange_bytes_per_token: exchange,
        ..work(1000, 10)
    };
    (g, c, w)
}

#[test]
fn sequence_parallelism_shortens_a_long_sequence_on_fast_links() {
    let (g, c, w) = encoded(16 * 5120);
    let p = Placement::new(Strategy::OffloadSharded, 1, 2, 2);
    let fast = Rates {
        peer: 300e9,
        ..rates()
    };
    let at = |sp| predict_for(&g, &c, &w, &p, &fast, Topology::new(1, sp).unwrap());
    let (one, two, four) = (at(1), at(2), at(4));
    // Each rank computes half (a quarter) of the tokens, plus its all-to-alls: 500
    // tokens × 81 920 B × 1/2 at 300 GB/s per block.
    let exchange = 500.0 * 16.0 * 5120.0 * 0.5 / 300e9;
    assert!(
        close(two.groups[1].compute, 10.0 * (1.0 + exchange)),
        "{two:?}"
    );
    assert!(
        two.request < 0.6 * one.request,
        "{} vs {}",
        two.request,
        one.request
    );
    assert!(
        four.request < two.request,
        "{} vs {}",
        four.request,
        two.request
    );
    // The per-request text encoder is not split: the same compute on every rank.
    for t in [&two, &four] {
        assert!(close(t.groups[0].compute, one.groups[0].compute), "{t:?}");
        assert_eq!(t.groups[0].runs, Runs::PerRequest);
    }
}

#[test]
fn sequence_parallelism_never_speeds_a_per_request_pass_and_slow_links_undo_it() {
    // The text encoder alone: sp changes nothing of it.
    let (g, c, w) = encoded(16 * 5120);
    let p = Placement::new(Strategy::Resident, 1, 0, 2);
    for sp in [2, 4, 8] {
        let t = predict_for(&g, &c, &w, &p, &rates(), Topology::new(1, sp).unwrap());
        let one = predict_for(&g, &c, &w, &p, &rates(), Topology::default());
        assert!(
            t.groups[0].compute >= one.groups[0].compute,
            "sp {sp}: {t:?}"
        );
    }
    // A short sequence on a slow link: the all-to-alls cost more than the compute saved
    // (5 tokens × 80 KiB × 1/2 at 1 MB/s, 0.2 s, against 10 ms of compute per block).
    let slow = Rates {
        peer: 1e6,
        ..rates()
    };
    let short = Work { tokens: 10, ..w };
    let one = predict_for(&g, &c, &short, &p, &slow, Topology::default());
    let two = predict_for(&g, &c, &short, &p, &slow, Topology::new(1, 2).unwrap());
    assert!(
        two.request > one.request,
        "{} vs {}",
        two.request,
        one.request
    );
}

#[test]
fn weight_copies_shard_over_every_rank_of_the_process() {
    // offload-sharded over dp 1 × sp 2: each rank copies half a block from the host (0.5
    // s) and gathers the other half (0.05 s), as over dp 2 × sp 1.
    let (g, c) = transformer(10, 2.0);
    let p = Placement::new(Strategy::OffloadSharded, 1, 2, 1);
    let w = work(1000, 10);
    let sp = predict_for(&g, &c, &w, &p, &rates(), Topology::new(1, 2).unwrap());
    let dp = predict_for(&g, &c, &w, &p, &rates(), Topology::new(2, 1).unwrap());
    assert!(close(sp.groups[0].copy, 10.0 * 0.5), "{sp:?}");
    assert!(close(dp.groups[0].copy, sp.groups[0].copy), "{dp:?}");
    // Without exchange bytes declared only the compute halves.
    assert!(close(sp.groups[0].compute, 10.0), "{sp:?}");
    assert!(close(dp.groups[0].compute, 20.0), "{dp:?}");
}

#[test]
fn token_pairs_split_by_the_share_of_queries() {
    // Attention alone: T × t pairs per rank, t the largest share of an uneven split.
    let (g, mut c) = transformer(1, 0.0);
    c[0].flops_per_token_pair = 1_000_000;
    let w = work(1001, 1);
    let p = Placement::new(Strategy::Resident, 1, 0, 1);
    let t = predict_for(&g, &c, &w, &p, &rates(), Topology::new(1, 4).unwrap());
    assert!(close(t.request, 1001.0 * 251.0 * 1e6 / 1e12), "{t:?}");
}

#[test]
fn the_prompt_terms_count_whole_on_every_rank_and_cross_pairs_by_the_share() {
    // One block seeing a 100-token prompt (work's): cross pairs 1e6 each, prompt tokens
    // 1e9 each, joint prompt pairs 1e7 each, 1e10 per sample, two samples.
    let (g, mut c) = transformer(1, 0.0);
    c[0].flops_per_cross_pair = 1_000_000;
    c[0].flops_per_text_token = 1_000_000_000;
    c[0].flops_per_text_pair = 10_000_000;
    c[0].flops_per_sample = 10_000_000_000;
    let w = Work {
        samples: 2,
        ..work(1001, 1)
    };
    let whole = 100.0 * 1e9 + 100.0 * 100.0 * 1e7 + 1e10;
    let p = Placement::new(Strategy::Resident, 1, 0, 1);
    let one = predict_for(&g, &c, &w, &p, &rates(), Topology::default());
    assert!(
        close(one.request, 2.0 * (1001.0 * 100.0 * 1e6 + whole) / 1e12),
        "{one:?}"
    );
    let four = predict_for(&g, &c, &w, &p, &rates(), Topology::new(1, 4).unwrap());
    assert!(
        close(four.request, 2.0 * (251.0 * 100.0 * 1e6 + whole) / 1e12),
        "{four:?}"
    );
    // A group on the prompt itself has no prompt beside it: its text terms never count.
    c[0].tokens = Tokens::Text;
    let text = predict_for(&g, &c, &w, &p, &rates(), Topology::default());
    assert!(close(text.request, 2.0 * 1e10 / 1e12), "{text:?}");
}

#[test]
fn a_declaration_is_its_polynomial() {
    let c = GroupCompute {
        flops_per_token: 3,
        flops_per_token_pair: 5,
        flops_per_text_token: 7,
        flops_per_cross_pair: 11,
        flops_per_text_pair: 13,
        flops_per_sample: 17,
        ..GroupCompute::default()
    };
    // T = 10 whole, L = 4: 3·10 + 5·100 + 11·40 + 7·4 + 13·16 + 17.
    assert_eq!(c.flops(10, 10, 4), (30 + 500 + 440 + 28 + 208 + 17) as f64);
    // A share of 3 of the 10 queries: pairs and cross pairs by the share.
    assert_eq!(c.flops(10, 3, 4), (9 + 150 + 132 + 28 + 208 + 17) as f64);
    assert!(c.declares_attention());
    assert!(!GroupCompute::of_params("transformer", 1, 1).declares_attention());
}
