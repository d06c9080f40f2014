use crds::Strategy as Planned;
use crds::StrategyChoice as Mode;
use proptest::prelude::*;
use proptest::strategy::Strategy;

use std::collections::BTreeMap;

use crds::{Plan, Profile, Workload};
use layerwise_core::decode::{DecodeSite, DecoderBytes};
use layerwise_core::memory::{GroupBytes, Placement};
use layerwise_core::timing::{GroupCompute, Rates, Runs, Tokens};

use super::need::device_total;
use super::*;

const GB: u64 = 1 << 30;

/// A profile of `blocks` bf16 blocks of `block` bytes, `outside` bytes outside them, a VAE
/// of `vae` bytes and a DiT-like activation cost.
fn profile(blocks: usize, block: u64, outside: u64, vae: u64) -> Profile {
    layerwise_e2e::fixtures::dit_profile(blocks, block, outside, vae)
}

fn node(name: &str, devices: u32, device_gib: u64, host_gib: u64, fast: bool) -> NodeShape {
    NodeShape {
        name: name.into(),
        devices,
        device_bytes: device_gib * GB,
        host_bytes: host_gib * GB,
        fast_peer_link: fast,
        warm: false,
        rates: Rates::DEFAULT,
        rates_from: "the test's rates".into(),
    }
}

/// Host memory well beyond the largest test model's mapping and its pods' staging rings.
fn a100(name: &str) -> NodeShape {
    node(name, 8, 80, 2000, true)
}

fn auto() -> Overrides {
    Overrides::default()
}

fn wl() -> Workload {
    Workload::default()
}

/// A 12B-ish model: 57 blocks of 400 MiB, 1 GiB outside, 160 MiB VAE (~23.5 GiB).
fn medium() -> Profile {
    profile(57, 400 << 20, GB, 160 << 20)
}

/// About 100 GiB of blocks: too big for one 80 GiB device.
fn large() -> Profile {
    profile(100, GB, 2 * GB, 320 << 20)
}

/// About 768 GiB of blocks: too big even sharded eight ways over 80 GiB devices.
fn huge() -> Profile {
    profile(96, 8 * GB, 4 * GB, 320 << 20)
}

#[test]
fn resident_when_the_model_fits_one_device() {
    let p = plan(&medium(), &[a100("a")], &wl(), &auto(), &Limits::default()).unwrap();
    assert_eq!((p.strategy, p.dp, p.slots), (Planned::Resident, 1, 0));
    assert_eq!(p.device_breakdown.block_weights, 57 * (400 << 20));
    assert_eq!(p.device_bytes_per_rank, p.device_breakdown.total());
    assert!(
        p.rejected.iter().any(|r| r.starts_with("sharded")),
        "{:?}",
        p.rejected
    );
}

#[test]
fn sharded_with_the_fewest_ranks_that_fit() {
    let p = plan(&large(), &[a100("a")], &wl(), &auto(), &Limits::default()).unwrap();
    assert_eq!((p.strategy, p.dp), (Planned::Sharded, 2));
    assert!(
        p.rejected[0].starts_with("resident: device memory per rank short by"),
        "{:?}",
        p.rejected
    );
    // 1/2 of every block and two full slots: each block's gather over the peer link
    // (2 ms) hides behind its compute (45 ms), so no block is kept and K stays at 2,
    // though memory would hold more of both (before the step-time model, the plan filled
    // the memory left with kept blocks and slots that bought nothing).
    assert_eq!(p.resident_blocks, 0, "{:?}", p.reasons);
    assert_eq!(p.device_breakdown.block_weights, 100 * GB / 2);
    assert_eq!(p.device_breakdown.slots, 2 * GB);
    assert!(
        p.reasons.iter().any(|r| r.contains(
            "no block of transformer's 100 stays on the device: one more saves 2 ms per request, within the 2% tie"
        )),
        "{:?}",
        p.reasons
    );
    assert!(
        p.reasons
            .iter()
            .any(|r| r.contains("every streamed copy hides behind compute")),
        "{:?}",
        p.reasons
    );
}

#[test]
fn offload_sharded_when_shards_do_not_fit() {
    let p = plan(&huge(), &[a100("a")], &wl(), &auto(), &Limits::default()).unwrap();
    assert_eq!((p.strategy, p.dp), (Planned::OffloadSharded, 8));
    // Nothing but the blocks kept with the memory left after the slots.
    assert_eq!(p.device_breakdown.block_weights, p.resident_blocks * 8 * GB);
    assert!(p.fast_peer_link);
}

#[test]
fn offload_without_a_fast_peer_link_or_with_one_device() {
    let slow = node("pcie", 8, 80, 2000, false);
    let p = plan(&huge(), &[slow], &wl(), &auto(), &Limits::default()).unwrap();
    assert_eq!((p.strategy, p.dp), (Planned::Offload, 1));
    let single = node("one", 1, 80, 2000, true);
    let p = plan(&huge(), &[single], &wl(), &auto(), &Limits::default()).unwrap();
    assert_eq!((p.strategy, p.dp), (Planned::Offload, 1));
}

#[test]
fn slots_stay_at_two_where_more_predict_no_shorter_request() {
    // Offload-sharded over 8 ranks: a rank copies 1 GiB of each 8 GiB block (43 ms) and
    // gathers the rest (33 ms) behind 360 ms of compute: more slots would only hold
    // memory (before the step-time model, K grew to the cap, 4).
    let p = plan(&huge(), &[a100("a")], &wl(), &auto(), &Limits::default()).unwrap();
    assert_eq!(
        (p.strategy, p.slots, p.resident_blocks),
        (Planned::OffloadSharded, 2, 0)
    );
    assert!(
        p.reasons
            .iter()
            .any(|r| r.contains("2 slots: more predict no shorter request")),
        "{:?}",
        p.reasons
    );
    // A fixed K is the spec's.
    let o = Overrides {
        slots: Some(3),
        ..auto()
    };
    let p = plan(&huge(), &[a100("a")], &wl(), &o, &Limits::default()).unwrap();
    assert_eq!(p.slots, 3);
}

#[test]
fn fixed_settings_are_honoured() {
    let o = Overrides {
        strategy: Mode::Fixed(Planned::OffloadSharded),
        dp: Some(4),
        sp: None,
        slots: Some(2),
    };
    let p = plan(&medium(), &[a100("a")], &wl(), &o, &Limits::default()).unwrap();
    assert_eq!((p.strategy, p.dp, p.slots), (Planned::OffloadSharded, 4, 2));
    let o = Overrides {
        strategy: Mode::Auto,
        dp: Some(4),
        sp: None,
        slots: None,
    };
    let p = plan(&large(), &[a100("a")], &wl(), &o, &Limits::default()).unwrap();
    assert_eq!((p.strategy, p.dp), (Planned::Sharded, 4));
}

#[test]
fn the_best_plan_is_kept_to_the_nodes_it_fits() {
    // 100 GiB: resident on a 141 GiB H200, only sharded on an 80 GiB A100.
    let h200 = node("h200", 4, 140, 1500, true);
    let p = plan(
        &large(),
        &[a100("a1"), h200, a100("a2")],
        &wl(),
        &auto(),
        &Limits::default(),
    )
    .unwrap();
    assert_eq!(p.strategy, Planned::Resident);
    assert_eq!(p.nodes, vec!["h200".to_string()]);
}

#[test]
fn refuses_short_device_memory_with_the_shortfall() {
    // 16k x 16k with guidance: activations far beyond 80 GiB.
    let w = Workload {
        max_width: 16384,
        max_height: 16384,
        ..wl()
    };
    let err = plan(&medium(), &[a100("a")], &w, &auto(), &Limits::default()).unwrap_err();
    assert_eq!(err.shortage, Shortage::DeviceMemory);
    assert_eq!(err.node.as_deref(), Some("a"));
    assert_eq!(err.available, 80 * GB);
    let act = activation_bytes(&medium(), &w).unwrap();
    // Refused with the decoder on the device and on the host: the host's figure, the
    // smaller.
    let cheapest = need(
        &medium(),
        act,
        DecoderBytes::default(),
        &Placement::new(Planned::Offload, 1, 2, 1),
        &Limits::default(),
    )
    .device
    .total();
    assert_eq!(err.needed, cheapest);
    assert_eq!(err.shortfall(), cheapest - 80 * GB);
    assert!(
        err.to_string().contains("device memory per rank short by"),
        "{err}"
    );
}

#[test]
fn refuses_short_host_memory() {
    let n = node("small-host", 8, 80, 16, true);
    let err = plan(&large(), &[n], &wl(), &auto(), &Limits::default()).unwrap_err();
    assert_eq!(err.shortage, Shortage::HostMemory);
    assert!(err.needed > large().total_bytes);
    assert_eq!(err.available, 16 * GB);
    assert!(
        err.to_string()
            .contains("host memory (the model's page-cache copy and one pod) short by"),
        "{err}"
    );
}

#[test]
fn refuses_too_few_accelerators() {
    let o = Overrides {
        dp: Some(16),
        sp: None,
        ..auto()
    };
    let err = plan(&medium(), &[a100("a")], &wl(), &o, &Limits::default()).unwrap_err();
    assert_eq!(
        (err.shortage, err.needed, err.available),
        (Shortage::Accelerators, 16, 8)
    );
}

#[test]
fn refuses_no_nodes_and_contradictory_settings() {
    let err = plan(&medium(), &[], &wl(), &auto(), &Limits::default()).unwrap_err();
    assert_eq!(err.shortage, Shortage::NoNodes);
    let o = Overrides {
        strategy: Mode::Fixed(Planned::Sharded),
        dp: Some(1),
        sp: None,
        slots: None,
    };
    let err = plan(&medium(), &[a100("a")], &wl(), &o, &Limits::default()).unwrap_err();
    assert_eq!(err.shortage, Shortage::Spec);
}

#[test]
fn refuses_activations_that_would_overflow() {
    let w = Workload {
        max_width: 16384,
        max_height: 16384,
        max_frames: 1024,
        max_batch: 64,
        ..wl()
    };
    let err = plan(&medium(), &[a100("a")], &w, &auto(), &Limits::default()).unwrap_err();
    assert_eq!(err.shortage, Shortage::DeviceMemory);
}

fn arb_profile() -> impl Strategy<Value = Profile> {
    (1usize..200, 1u64..(16 * GB), 0u64..(8 * GB), 0u64..GB)
        .prop_map(|(b, s, o, v)| profile(b, s, o, v))
}

fn arb_workload() -> impl Strategy<Value = Workload> {
    (8u64..4096, 8u64..4096, 1u64..4, 1u64..4, any::<bool>()).prop_map(|(w, h, f, b, g)| Workload {
        max_width: w,
        max_height: h,
        max_frames: f,
        max_steps: 50,
        max_batch: b,
        guidance: g,
        max_prompt_tokens: 512,
        max_latency_seconds: None,
        cache: None,
    })
}

fn arb_node() -> impl Strategy<Value = NodeShape> {
    (1u32..=8, 1u64..200, 1u64..2000, any::<bool>()).prop_map(|(d, m, h, f)| NodeShape {
        name: format!("n{d}-{m}-{h}"),
        devices: d,
        device_bytes: m * GB,
        host_bytes: h * GB,
        fast_peer_link: f,
        warm: false,
        rates: Rates::DEFAULT,
        rates_from: "the test's rates".into(),
    })
}

fn arb_overrides() -> impl Strategy<Value = Overrides> {
    let s = prop_oneof![
        Just(Mode::Auto),
        Just(Mode::Fixed(Planned::Resident)),
        Just(Mode::Fixed(Planned::Sharded)),
        Just(Mode::Fixed(Planned::Offload)),
        Just(Mode::Fixed(Planned::OffloadSharded))
    ];
    (
        s,
        proptest::option::of(1u32..=8),
        proptest::option::of(1u32..=6),
    )
        .prop_map(|(strategy, dp, slots)| Overrides {
            strategy,
            dp,
            sp: None,
            slots,
        })
}

fn arb_planned() -> impl Strategy<Value = Planned> {
    prop_oneof![
        Just(Planned::Resident),
        Just(Planned::Sharded),
        Just(Planned::Offload),
        Just(Planned::OffloadSharded)
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Whatever the inputs, a plan fits every node it names, in accelerators, device memory
    /// and host memory, and its figures are the honest sum of its parts.
    #[test]
    fn no_plan_exceeds_a_nodes_memory(
        p in arb_profile(),
        nodes in proptest::collection::vec(arb_node(), 1..5),
        w in arb_workload(),
        o in arb_overrides(),
    ) {
        let limits = Limits::default();
        if let Ok(plan) = plan(&p, &nodes, &w, &o, &limits) {
            prop_assert!(!plan.nodes.is_empty());
            prop_assert_eq!(plan.device_bytes_per_rank, plan.device_breakdown.total());
            let act = activation_bytes(&p, &w).unwrap();
            prop_assert_eq!(plan.device_breakdown.activations, act);
            let decoder = decoder_bytes(&p, &w, crate::resources::decode_site(&plan)).unwrap();
            let expected = need(&p, act, decoder, &Placement { resident_blocks: plan.resident_blocks, ..Placement::new(plan.strategy, u64::from(plan.devices()), u64::from(plan.slots), 1) }.with_component_blocks(&p.groups, &plan.resident_blocks_by_component), &limits);
            prop_assert_eq!(&plan.device_breakdown, &expected.device);
            prop_assert_eq!(plan.host_bytes_per_node, p.total_bytes, "one copy of the model per node");
            prop_assert_eq!(plan.host_bytes_per_pod, expected.host_per_pod);
            for name in &plan.nodes {
                let n = nodes.iter().find(|n| &n.name == name).unwrap();
                prop_assert!(plan.devices() <= n.devices);
                prop_assert!(plan.device_bytes_per_rank <= n.device_bytes);
                prop_assert!(plan.host_bytes_per_node + plan.host_bytes_per_pod <= n.host_bytes);
            }
        }
    }

    /// A node built to hold a given (strategy, dp, K) exactly is never refused, whether the
    /// spec fixes that option or leaves everything to the planner.
    #[test]
    fn a_feasible_request_is_never_refused(
        p in arb_profile(),
        w in arb_workload(),
        s in arb_planned(),
        dp in 1u32..=8,
        k in 2u32..=4,
        spare_devices in 0u32..4,
        fast in any::<bool>(),
    ) {
        let dp = if matches!(s, Planned::Sharded | Planned::OffloadSharded) { dp.max(2) } else { dp };
        let limits = Limits::default();
        let act = activation_bytes(&p, &w).unwrap();
        let n = need(&p, act, decoder_bytes(&p, &w, limits.decode).unwrap(), &Placement::new(s, u64::from(dp), if s.streams() { u64::from(k) } else { 0 }, 1), &limits);
        let node = NodeShape {
            name: "fits".into(),
            devices: dp + spare_devices,
            device_bytes: n.device.total(),
            host_bytes: n.host_shared + n.host_per_pod,
            fast_peer_link: fast,
            warm: false,
            rates: Rates::DEFAULT,
            rates_from: "the test's rates".into(),
        };
        let fixed = Overrides {
            strategy: match s {
                Planned::Resident => Mode::Fixed(Planned::Resident),
                Planned::Sharded => Mode::Fixed(Planned::Sharded),
                Planned::Offload => Mode::Fixed(Planned::Offload),
                Planned::OffloadSharded => Mode::Fixed(Planned::OffloadSharded),
            },
            dp: Some(dp),
            sp: None,
            slots: s.streams().then_some(k),
        };
        let got = plan(&p, std::slice::from_ref(&node), &w, &fixed, &limits);
        prop_assert!(got.is_ok(), "fixed {:?} refused: {}", fixed, got.unwrap_err());
        let got = plan(&p, std::slice::from_ref(&node), &w, &Overrides::default(), &limits);
        prop_assert!(got.is_ok(), "auto refused although {:?} dp={} K={} fits: {}", s, dp, k, got.unwrap_err());
    }
}

/// One slot is refused for every strategy, as the engine would refuse it at start: the
/// operator never makes pods that crash.
#[test]
fn fewer_than_the_engines_minimum_slots_is_refused() {
    for mode in [
        Mode::Fixed(Planned::Sharded),
        Mode::Fixed(Planned::Offload),
        Mode::Fixed(Planned::OffloadSharded),
        Mode::Auto,
    ] {
        let o = Overrides {
            strategy: mode,
            slots: Some(1),
            ..Overrides::default()
        };
        let err = plan(&large(), &[a100("a")], &wl(), &o, &Limits::default()).unwrap_err();
        assert_eq!(err.shortage, Shortage::Spec, "{mode:?}");
        assert!(err.to_string().contains("at least 2"), "{err}");
    }
}

#[test]
fn sharded_dp_divides_the_nodes_accelerators_so_none_stay_idle() {
    // A 115 GiB DiT at 1536² with guidance (32.5 GiB of activations): three ranks' shards
    // are the fewest that fit an 80 GiB device.
    let p = profile(48, 2_571_010_048, 269_271_104, 334_615_452);
    let w = Workload {
        max_width: 1536,
        max_height: 1536,
        guidance: true,
        ..wl()
    };
    // Pods that decode on the host, so the ranks' figures are the transformer's alone.
    let host = Limits {
        decode: DecodeSite::Host,
        ..Limits::default()
    };
    // On eight accelerators three ranks would strand two: four, which divides eight.
    let eight = plan(&p, &[a100("a")], &w, &auto(), &host).unwrap();
    assert_eq!((eight.strategy, eight.dp), (Planned::Sharded, 4));
    assert!(
        eight
            .reasons
            .iter()
            .any(|r| r.contains("3 ranks would fit too")),
        "{:?}",
        eight.reasons
    );
    // On six, three divides: the fewest that fit.
    let six = plan(&p, &[node("b", 6, 80, 2000, true)], &w, &auto(), &host).unwrap();
    assert_eq!((six.strategy, six.dp), (Planned::Sharded, 3));
    assert!(
        six.reasons
            .iter()
            .any(|r| r.contains("the fewest ranks that fit")),
        "{:?}",
        six.reasons
    );
    // A fixed dp is the spec's.
    let fixed = Overrides {
        dp: Some(3),
        sp: None,
        ..auto()
    };
    let three = plan(&p, &[a100("a")], &w, &fixed, &host).unwrap();
    assert_eq!(three.dp, 3);
}

#[test]
fn each_node_is_planned_with_its_own_profile() {
    // Two copies of a model that differ (a node holds a larger build): the plan holds the
    // larger need, on both nodes, and says why.
    let small = medium();
    let big = profile(57, 420 << 20, GB, 160 << 20);
    let cands = [
        Candidate {
            node: a100("a"),
            profile: &small,
        },
        Candidate {
            node: a100("b"),
            profile: &big,
        },
    ];
    let p = plan_candidates(&cands, &wl(), &auto(), &Limits::default()).unwrap();
    assert_eq!(p.strategy, Planned::Resident);
    assert_eq!(p.nodes, ["a", "b"]);
    assert_eq!(p.device_breakdown.block_weights, 57 * (420 << 20));
    assert_eq!(p.host_bytes_per_node, big.total_bytes);
    assert!(
        p.reasons
            .iter()
            .any(|r| r.contains("different copies of the model")),
        "{:?}",
        p.reasons
    );
    // A node whose copy does not fit the plan is left out of it.
    let mut tight = a100("tight");
    tight.device_bytes = device_total(&p.device_breakdown) - 1;
    let cands = [
        Candidate {
            node: a100("a"),
            profile: &small,
        },
        Candidate {
            node: tight,
            profile: &big,
        },
    ];
    let p = plan_candidates(&cands, &wl(), &auto(), &Limits::default()).unwrap();
    assert_eq!(p.nodes, ["a"]);
    assert_eq!(p.device_breakdown.block_weights, 57 * (400 << 20));
}

#[test]
fn the_page_cache_copy_is_counted_once_per_node() {
    let p = plan(&large(), &[a100("a")], &wl(), &auto(), &Limits::default()).unwrap();
    assert_eq!(p.host_bytes_per_node, large().total_bytes);
    // Sharded pins nothing: a pod needs only the host allowance of its own.
    assert_eq!(p.strategy, Planned::Sharded);
    assert_eq!(p.host_bytes_per_pod, Limits::default().host_overhead);
    // A node that holds the copy and one pod's bytes fits; one byte less does not.
    let mut n = a100("exact");
    n.host_bytes = p.host_bytes_per_node + p.host_bytes_per_pod;
    assert!(plan(&large(), &[n.clone()], &wl(), &auto(), &Limits::default()).is_ok());
    n.host_bytes -= 1;
    let e = plan(&large(), &[n], &wl(), &auto(), &Limits::default()).unwrap_err();
    assert_eq!(e.shortage, Shortage::HostMemory, "{e}");
}

fn bf16_group(component: &str, blocks: usize, bytes: u64) -> GroupBytes {
    GroupBytes {
        component: component.into(),
        blocks_by_dtype: BTreeMap::from([("BF16".to_string(), vec![bytes; blocks])]),
    }
}

/// A Qwen-Image-shaped profile: a text encoder of 28 layers of 593 MB (16.6 GB) that runs
/// once per request on the prompt, and 60 transformer blocks of 670 MB run every step.
/// Its blocks compute one FLOP per weight per image token (of a double-stream block's
/// weights, the image stream's half sees the image tokens), as the family declares.
fn qwen_image() -> Profile {
    let (te, tr) = (593_000_000u64, 670_000_000u64);
    let mut p = profile(60, tr, GB, 250 << 20);
    p.groups = vec![
        bf16_group("text_encoder", 28, te),
        bf16_group("transformer", 60, tr),
    ];
    p.components.insert(
        0,
        crds::ComponentProfile {
            name: "text_encoder".into(),
            bytes: 28 * te,
            blocks: 28,
            largest_block_bytes: te,
        },
    );
    p.total_bytes += 28 * te;
    p.blocks += 28;
    p.compute = vec![
        GroupCompute {
            component: "text_encoder".into(),
            runs: Runs::PerRequest,
            tokens: Tokens::Text,
            flops_per_token: te,
            ..Default::default()
        },
        GroupCompute {
            component: "transformer".into(),
            runs: Runs::PerStep,
            tokens: Tokens::Latent,
            flops_per_token: tr / 2,
            ..Default::default()
        },
    ];
    p
}

fn h100(name: &str, device_bytes: u64) -> NodeShape {
    let (rates, rates_from) = NodeShape::rates_for("NVIDIA H100 80GB HBM3", None);
    NodeShape {
        device_bytes,
        rates,
        rates_from,
        ..node(name, 1, 80, 2000, false)
    }
}

fn offload() -> Overrides {
    Overrides {
        strategy: Mode::Fixed(Planned::Offload),
        dp: Some(1),
        sp: None,
        slots: None,
    }
}

/// The transformer blocks whose copies (13.4 ms each at 50 GB/s) outrun a step's compute
/// (60 blocks x 4.6 ms at 600 TFLOP/s, 4096 tokens x 2 samples) unless kept: 60 − ⌊60 ·
/// 4.58 / 13.4⌋ = 40.
const QWEN_HIDING: u64 = 40;

#[test]
fn a_text_encoder_streams_where_its_memory_keeps_transformer_blocks() {
    let p = qwen_image();
    let limits = Limits::default();
    let w = wl();
    // A device that holds the slots, the activations and the transformer blocks that hide
    // the rest, and 10 GB more: not the text encoder beside them.
    let act = activation_bytes(&p, &w).unwrap();
    let dec = decoder_bytes(&p, &w, limits.decode).unwrap();
    let kept = Placement::new(Planned::Offload, 1, 2, 2).with_component_blocks(
        &p.groups,
        &BTreeMap::from([("transformer".into(), QWEN_HIDING)]),
    );
    let base = need(&p, act, dec, &kept, &limits).device.total();
    let got = plan(&p, &[h100("h", base + 10 * GB)], &w, &offload(), &limits).unwrap();
    assert_eq!(
        got.resident_components(),
        Vec::<String>::new(),
        "{:?}",
        got.reasons
    );
    assert_eq!(got.resident_blocks, 0, "{:?}", got.reasons);
    let n = got.resident_blocks_by_component["transformer"];
    assert!(n.abs_diff(QWEN_HIDING) <= 1, "{n} {:?}", got.reasons);
    assert!(!got
        .resident_blocks_by_component
        .contains_key("text_encoder"));
    let says = |s: &str| got.reasons.iter().any(|r| r.contains(s));
    assert!(
        says("text_encoder streams: kept whole it predicts"),
        "{:?}",
        got.reasons
    );
    assert!(
        says(&format!(
            "{n} of transformer's 60 blocks stay on the device"
        )),
        "{:?}",
        got.reasons
    );
    assert!(
        says("one fewer predicts 349 ms more per request"),
        "{:?}",
        got.reasons
    );
    assert!(
        says("no block of text_encoder's 28 stays on the device"),
        "{:?}",
        got.reasons
    );
    assert!(
        says("text_encoder once per request computes"),
        "{:?}",
        got.reasons
    );
    // The engine reads back what the pods are told.
    let by = layerwise_core::memory::format_component_blocks(&got.resident_blocks_by_component);
    assert_eq!(by, format!("transformer={n}"));
    // On a full 80 GB device the same transformer blocks, and the memory left keeps
    // text-encoder layers until the rest of its 0.33 s of copies per request is within
    // the tie: never the whole text encoder, whose last layers save least.
    let roomy = plan(&p, &[h100("h", 80 * GB)], &w, &offload(), &limits).unwrap();
    let by = &roomy.resident_blocks_by_component;
    assert_eq!(
        roomy.resident_components(),
        Vec::<String>::new(),
        "{:?}",
        roomy.reasons
    );
    assert!(
        by["transformer"].abs_diff(QWEN_HIDING) <= 1,
        "{:?}",
        roomy.reasons
    );
    assert!((1..28).contains(&by["text_encoder"]), "{:?}", roomy.reasons);
}

#[test]
fn a_long_sequence_keeps_fewer_blocks_because_its_copies_already_hide() {
    // One transformer of 40 blocks of 670 MB, no text encoder, streamed from the host.
    let mut p = profile(40, 670_000_000, GB, 250 << 20);
    // Attention in query chunks: a fixed cost, whatever the length.
    p.activation.bytes_per_token_pair = 0;
    p.activation.attention_bytes = 2 * GB;
    p.compute = vec![GroupCompute {
        component: "transformer".into(),
        runs: Runs::PerStep,
        tokens: Tokens::Latent,
        flops_per_token: 670_000_000 / 2,
        ..Default::default()
    }];
    let limits = Limits::default();
    let kept = |w: &Workload| {
        plan(&p, &[h100("h", 80 * GB)], w, &offload(), &limits)
            .unwrap()
            .resident_blocks
    };
    let image = kept(&Workload {
        max_width: 512,
        max_height: 512,
        ..wl()
    });
    let longer = kept(&wl());
    let video = kept(&Workload {
        max_width: 832,
        max_height: 480,
        max_frames: 33,
        ..wl()
    });
    assert!(image > longer && longer > video, "{image} {longer} {video}");
    assert_eq!(video, 0);
}

#[test]
fn spec_rates_replace_the_products_defaults() {
    let spec = crds::AcceleratorRates {
        host_to_device_gbps: Some(12.5),
        ..Default::default()
    };
    let (r, from) = NodeShape::rates_for("NVIDIA H100 80GB HBM3", Some(&spec));
    assert_eq!(r.host_to_device, 12.5e9);
    assert_eq!(r.device_flops, Rates::for_product("H100").0.device_flops);
    assert_eq!(
        from.to_string(),
        "spec.accelerator.rates over the H100 defaults"
    );
    let (r, from) = NodeShape::rates_for("Some New Part", None);
    assert_eq!(r, Rates::DEFAULT);
    assert!(from.to_string().contains("unknown product"), "{from}");
    // A slower host link keeps more blocks.
    let p = qwen_image();
    let at = |n: NodeShape| plan(&p, &[n], &wl(), &offload(), &Limits::default()).unwrap();
    let fast = at(h100("h", 80 * GB));
    let slow = at(NodeShape {
        rates: r_with_h2d(12.5e9),
        ..h100("h", 80 * GB)
    });
    let tr = |p: &Plan| p.resident_blocks_by_component["transformer"];
    assert!(tr(&slow) > tr(&fast), "{} {}", tr(&slow), tr(&fast));
}

fn r_with_h2d(h2d: f64) -> Rates {
    Rates {
        host_to_device: h2d,
        ..Rates::for_product("H100").0
    }
}

/// A Wan-14B-shaped video profile: 40 transformer blocks of 700 MB (28 GB, one device
/// holds it whole), a 4-frame temporal latent, activations of 400 kB per latent token per
/// sample and the all-to-all's 80 KiB per token under sequence parallelism.
fn video() -> Profile {
    let mut p = profile(40, 700_000_000, GB, 250 << 20);
    p.family = "wan".into();
    p.activation.bytes_per_token = 400_000;
    p.activation.bytes_per_token_pair = 0;
    p.activation.frames_per_latent = 4;
    p.activation.exchange_bytes_per_token = 4 * 4 * 5120;
    p
}

/// 1280×720×121 frames: 111,600 latent tokens, two guided samples.
fn hd_video() -> Workload {
    Workload {
        max_width: 1280,
        max_height: 720,
        max_frames: 121,
        ..wl()
    }
}

fn h100s(name: &str) -> NodeShape {
    let (rates, rates_from) = NodeShape::rates_for("NVIDIA H100 80GB HBM3", None);
    NodeShape {
        rates,
        rates_from,
        ..node(name, 8, 80, 2000, true)
    }
}

#[test]
fn activations_that_do_not_fit_one_device_split_the_sequence() {
    let (p, w) = (video(), hd_video());
    let one = activation_bytes(&p, &w).unwrap();
    assert!(one > 80 * GB, "{one}");
    let plan = plan(&p, &[h100s("a")], &w, &auto(), &Limits::default()).unwrap();
    assert_eq!(plan.sp, 2, "{:?}", plan.reasons);
    // The engine's per-rank formula, for the plan's sp, is what the plan reserves.
    assert_eq!(
        plan.device_breakdown.activations,
        activation_bytes_per_rank(&p, &w, 2).unwrap()
    );
    assert!(plan.device_breakdown.activations < one / 2 + one / 4);
    assert_eq!(plan.latency_bound_met, None);
    assert!(plan.predicted_latency_seconds.unwrap() > 0.0);
    assert!(plan.devices() <= 8);
    let why = &plan.reasons[1];
    assert!(
        why.starts_with("sp 2: a 1280x720x121 request needs")
            && why.contains("per rank with sp 2 fits")
            && why.contains("sp 1 does not fit")
            && why.contains("at least 2 heads"),
        "{why}"
    );
}

#[test]
fn a_latency_bound_splits_the_sequence_until_the_prediction_meets_it() {
    let p = video();
    let w = Workload {
        max_width: 832,
        max_height: 480,
        max_frames: 81,
        ..wl()
    };
    let free = plan(&p, &[h100s("a")], &w, &auto(), &Limits::default()).unwrap();
    assert_eq!(free.sp, 1, "{:?}", free.reasons);
    let alone = free.predicted_latency_seconds.unwrap();
    // Half of sp 1's time: sp 2 cannot (its all-to-alls cost beside the halved
    // compute), sp 4 can.
    let bounded = |bound: f64| Workload {
        max_latency_seconds: Some(bound),
        ..w.clone()
    };
    let half = plan(
        &p,
        &[h100s("a")],
        &bounded(alone / 2.0),
        &auto(),
        &Limits::default(),
    )
    .unwrap();
    assert_eq!(half.sp, 4, "{:?}", half.reasons);
    assert_eq!(half.latency_bound_met, Some(true));
    assert!(half.predicted_latency_seconds.unwrap() <= alone / 2.0);
    assert!(
        half.reasons[1].contains("sp 2 predicts") && half.reasons[1].contains("sp 1 predicts"),
        "{}",
        half.reasons[1]
    );
    // A bound no sp meets: the fastest is planned, and the plan says the bound is missed.
    let never = plan(
        &p,
        &[h100s("a")],
        &bounded(1.0),
        &auto(),
        &Limits::default(),
    )
    .unwrap();
    assert_eq!(never.latency_bound_met, Some(false));
    assert_eq!(never.sp, 8, "{:?}", never.reasons);
    assert!(never.predicted_latency_seconds.unwrap() > 1.0);
    assert!(
        never.reasons[1].contains("no sp that fits meets maxLatencySeconds 1"),
        "{}",
        never.reasons[1]
    );
    // A generous bound changes nothing.
    let loose = plan(
        &p,
        &[h100s("a")],
        &bounded(alone * 2.0),
        &auto(),
        &Limits::default(),
    )
    .unwrap();
    assert_eq!((loose.sp, loose.latency_bound_met), (1, Some(true)));
}

#[test]
fn a_fixed_sp_is_honoured_or_refused() {
    let p = video();
    let fixed = |sp| Overrides {
        sp: Some(sp),
        ..auto()
    };
    let four = plan(
        &p,
        &[h100s("a")],
        &hd_video(),
        &fixed(4),
        &Limits::default(),
    )
    .unwrap();
    assert_eq!(four.sp, 4);
    assert_eq!(
        four.device_breakdown.activations,
        activation_bytes_per_rank(&p, &hd_video(), 4).unwrap()
    );
    assert!(
        four.reasons[1].contains("sp fixed by the spec"),
        "{}",
        four.reasons[1]
    );
    // sp 1 fixed for a request whose activations need more: refused on device memory.
    let err = plan(
        &p,
        &[h100s("a")],
        &hd_video(),
        &fixed(1),
        &Limits::default(),
    )
    .unwrap_err();
    assert_eq!(err.shortage, Shortage::DeviceMemory, "{err}");
    // More ranks than the node has accelerators.
    let err = plan(
        &p,
        &[h100s("a")],
        &hd_video(),
        &fixed(16),
        &Limits::default(),
    )
    .unwrap_err();
    assert_eq!(err.shortage, Shortage::Accelerators, "{err}");
    assert!(err.to_string().contains("sp=16"), "{err}");
    // Beyond what the engine takes.
    let err = plan(
        &p,
        &[h100s("a")],
        &hd_video(),
        &fixed(17),
        &Limits::default(),
    )
    .unwrap_err();
    assert_eq!(err.shortage, Shortage::Spec, "{err}");
    assert!(err.to_string().contains("sp 17"), "{err}");
    // dp fixed beside it: dp groups of sp ranks, dp × sp accelerators.
    let both = Overrides {
        dp: Some(2),
        sp: Some(4),
        ..auto()
    };
    let p24 = plan(&p, &[h100s("a")], &hd_video(), &both, &Limits::default()).unwrap();
    assert_eq!((p24.dp, p24.sp, p24.devices()), (2, 4, 8));
    // sharded with one group splits its request to have ranks to shard over.
    let sharded = Overrides {
        strategy: Mode::Fixed(Planned::Sharded),
        dp: Some(1),
        ..auto()
    };
    let s = plan(&p, &[h100s("a")], &hd_video(), &sharded, &Limits::default()).unwrap();
    assert_eq!((s.strategy, s.dp), (Planned::Sharded, 1));
    assert!(s.sp >= 2, "{:?}", s.reasons);
}

#[test]
fn families_without_sequence_parallelism_are_never_split() {
    let mut qwen = qwen_image();
    qwen.family = "qwen-image".into();
    for p in [medium(), qwen] {
        let o = Overrides {
            sp: Some(2),
            ..auto()
        };
        let err = plan(&p, &[h100s("a")], &wl(), &o, &Limits::default()).unwrap_err();
        assert_eq!(err.shortage, Shortage::Spec, "{err}");
        assert!(
            err.to_string()
                .contains(&format!("sp 2: the {} family does not split", p.family)),
            "{err}"
        );
        // A latency bound nothing meets leaves it at one rank per request.
        let w = Workload {
            max_latency_seconds: Some(0.001),
            ..wl()
        };
        let planned = plan(&p, &[h100s("a")], &w, &auto(), &Limits::default()).unwrap();
        assert_eq!((planned.sp, planned.latency_bound_met), (1, Some(false)));
        assert!(
            planned.reasons[1].contains("does not split a request's sequence"),
            "{}",
            planned.reasons[1]
        );
        // sharded fixed at one group needs sp 2, which it cannot have.
        let o = Overrides {
            strategy: Mode::Fixed(Planned::Sharded),
            dp: Some(1),
            ..auto()
        };
        let err = plan(&p, &[h100s("a")], &wl(), &o, &Limits::default()).unwrap_err();
        assert_eq!(err.shortage, Shortage::Spec, "{err}");
        assert!(err.to_string().contains("needs sp >= 2"), "{err}");
    }
    // Activations beyond any device, with no sp to split them: refused as before.
    let w = Workload {
        max_width: 4096,
        max_height: 4096,
        max_frames: 3,
        max_batch: 4,
        ..wl()
    };
    let err = plan(&medium(), &[h100s("a")], &w, &auto(), &Limits::default()).unwrap_err();
    assert_eq!(err.shortage, Shortage::DeviceMemory, "{err}");
}

/// The activation term is charged in the element the engine pods compute in: f32 for a
/// family that computes in f32 only, the checkpoint's half dtype on a GPU for one that
/// computes in it. Where every live tensor is of that element (no f32 scores; the decoder
/// small beside a block), the bf16 plan's term is half the f32 plan's.
#[test]
fn a_gpu_plan_charges_activations_in_the_dtype_its_ranks_compute_in() {
    use layerwise_core::compute_dtype::ComputeElement::{Bf16, F16, F32};
    let mut f32_only = medium();
    f32_only.activation.bytes_per_token_pair = 0;
    f32_only.activation.attention_bytes = 0;
    f32_only.activation.vae_bytes_per_pixel = 1;
    let half = Profile {
        compute_dtypes: vec![F32, Bf16, F16],
        ..f32_only.clone()
    };
    assert_eq!(compute_element(&f32_only), F32);
    assert_eq!(compute_element(&half), Bf16);
    let act = |p: &Profile| {
        plan(p, &[a100("a")], &wl(), &auto(), &Limits::default())
            .unwrap()
            .device_breakdown
            .activations
    };
    let (full, halved) = (act(&f32_only), act(&half));
    let shape = crate::resources::request_bounds(&wl()).shape();
    let f32_phases = f32_only.activation.checked_phases(&shape, 1, 4).unwrap();
    assert_eq!(full, f32_phases.peak());
    assert_eq!(full, f32_phases.transformer, "the block's peak is the term");
    assert_eq!(halved * 2, full);
    // The checkpoint's dtype decides among the family's: f16 blocks compute in f16 (also
    // half), f32 blocks in f32.
    let stored = |d: &str| {
        let mut p = half.clone();
        for g in &mut p.groups {
            let blocks = g.blocks_by_dtype.values().next().unwrap().clone();
            g.blocks_by_dtype = BTreeMap::from([(d.to_string(), blocks)]);
        }
        p
    };
    assert_eq!(compute_element(&stored("F16")), F16);
    assert_eq!(act(&stored("F16")), halved);
    assert_eq!(compute_element(&stored("F32")), F32);
    assert_eq!(act(&stored("F32")), full);
}
