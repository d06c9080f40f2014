use crds::Strategy as Planned;
use crds::StrategyChoice as Mode;
use proptest::prelude::*;
use proptest::strategy::Strategy;

use super::*;
use layerwise_core::memory::Placement;

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
    // 1/2 of every streamed block, the blocks kept whole with the memory left, and K full
    // slots; one more kept block would not fit.
    let n = p.resident_blocks;
    assert!(n > 0, "{:?}", p.reasons);
    assert_eq!(
        p.device_breakdown.block_weights,
        (100 - n) * GB / 2 + n * GB
    );
    assert_eq!(p.device_breakdown.slots, u64::from(p.slots) * GB);
    assert!(
        p.device_bytes_per_rank + GB / 2 > 80 * GB,
        "{:?}",
        p.device_breakdown
    );
    assert!(
        p.reasons.iter().any(|r| r.contains(&format!(
            "{n} of transformer's 100 blocks stay on the device"
        ))),
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
fn slots_grow_to_the_cap_when_memory_allows_and_not_beyond() {
    let p = plan(&huge(), &[a100("a")], &wl(), &auto(), &Limits::default()).unwrap();
    assert_eq!(p.slots, 4, "{:?}", p.reasons);
    // A device with room for exactly 3 slots gets 3.
    let limits = Limits::default();
    let act = activation_bytes(&huge(), &wl()).unwrap();
    let three = need(
        &huge(),
        act,
        decoder_bytes(&huge(), &wl(), limits.decode).unwrap(),
        &Placement::new(Planned::OffloadSharded, 8, 3, 1),
        &limits,
    )
    .device
    .total();
    let mut n = a100("tight");
    n.device_bytes = three + GB / 2;
    let p = plan(&huge(), &[n], &wl(), &auto(), &limits).unwrap();
    assert_eq!((p.strategy, p.slots), (Planned::OffloadSharded, 3));
    assert_eq!(p.device_bytes_per_rank, three);
}

#[test]
fn fixed_settings_are_honoured() {
    let o = Overrides {
        strategy: Mode::Fixed(Planned::OffloadSharded),
        dp: Some(4),
        slots: Some(2),
    };
    let p = plan(&medium(), &[a100("a")], &wl(), &o, &Limits::default()).unwrap();
    assert_eq!((p.strategy, p.dp, p.slots), (Planned::OffloadSharded, 4, 2));
    let o = Overrides {
        strategy: Mode::Auto,
        dp: Some(4),
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
            let expected = need(&p, act, decoder, &Placement { resident_blocks: plan.resident_blocks, ..Placement::new(plan.strategy, u64::from(plan.dp), u64::from(plan.slots), 1) }, &limits);
            prop_assert_eq!(&plan.device_breakdown, &expected.device);
            prop_assert_eq!(plan.host_bytes_per_node, p.total_bytes, "one copy of the model per node");
            prop_assert_eq!(plan.host_bytes_per_pod, expected.host_per_pod);
            for name in &plan.nodes {
                let n = nodes.iter().find(|n| &n.name == name).unwrap();
                prop_assert!(plan.dp <= n.devices);
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
        };
        let fixed = Overrides {
            strategy: match s {
                Planned::Resident => Mode::Fixed(Planned::Resident),
                Planned::Sharded => Mode::Fixed(Planned::Sharded),
                Planned::Offload => Mode::Fixed(Planned::Offload),
                Planned::OffloadSharded => Mode::Fixed(Planned::OffloadSharded),
            },
            dp: Some(dp),
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
