//! A plan says whose step-time figures timed it: the product table's row for the product
//! the node reports, or, for a product the table lacks, the A100's as a fallback; in
//! `status.plan.rates` (typed) and in its reasons (words).

use crds::{Plan, PlanRates, Strategy, StrategyChoice, Workload};
use layerwise_operator::planner::{self, Limits, NodeShape, Overrides};

const GIB: u64 = 1 << 30;

/// One 80 GiB device of `product` on a roomy host, with the rates the operator gives it.
fn node(product: &str, spec: Option<&crds::AcceleratorRates>) -> NodeShape {
    let (rates, rates_from) = NodeShape::rates_for(product, spec);
    NodeShape {
        name: "n".into(),
        devices: 1,
        device_bytes: 80 * GIB,
        host_bytes: 2000 * GIB,
        fast_peer_link: false,
        warm: true,
        rates,
        rates_from,
    }
}

/// A DiT-shaped model streamed from the host, so the plan is timed.
fn plan_on(n: NodeShape) -> Plan {
    let profile = layerwise_e2e::fixtures::dit_profile(28, 400 << 20, GIB, 160 << 20);
    let overrides = Overrides {
        strategy: StrategyChoice::Fixed(Strategy::Offload),
        dp: Some(1),
        ..Overrides::default()
    };
    planner::plan(
        &profile,
        &[n],
        &Workload::default(),
        &overrides,
        &Limits::default(),
    )
    .unwrap()
}

#[test]
fn a_product_with_a_row_is_timed_with_its_figures() {
    let p = plan_on(node("NVIDIA-H20", None));
    assert_eq!(
        p.rates,
        Some(PlanRates {
            product: "NVIDIA-H20".into(),
            figures: "H20".into(),
            fallback: false,
            overridden: false,
        })
    );
    assert!(
        p.reasons.iter().all(|r| !r.contains("fallback")),
        "{:#?}",
        p.reasons
    );
    assert!(
        p.reasons
            .iter()
            .any(|r| r.starts_with("predicted at the H20 defaults (89 TFLOP/s")),
        "{:#?}",
        p.reasons
    );
    // Its own figures, not the A100's it used to fall back to: an H20 computes slower.
    let a100 = plan_on(node("NVIDIA A100-SXM4-80GB", None));
    assert!(
        p.predicted_latency_seconds.unwrap() > a100.predicted_latency_seconds.unwrap(),
        "{p:?}"
    );
}

#[test]
fn a_product_without_a_row_says_it_fell_back() {
    let p = plan_on(node("NVIDIA H800", None));
    let rates = p.rates.clone().unwrap();
    assert!(rates.fallback, "{rates:?}");
    assert_eq!(
        (rates.product.as_str(), rates.figures.as_str()),
        ("NVIDIA H800", "A100")
    );
    let reason = p
        .reasons
        .iter()
        .find(|r| r.starts_with("timed with "))
        .unwrap_or_else(|| panic!("no fallback reason: {:#?}", p.reasons));
    assert_eq!(
        reason,
        "timed with the A100 defaults, a fallback for an unknown product (\"NVIDIA H800\", not in the product table): set spec.accelerator.rates from engine/gpu-check's measured rates for a prediction of this product"
    );
    // The fallback's figures are the A100's to the second.
    let a100 = plan_on(node("NVIDIA A100-SXM4-80GB", None));
    assert_eq!(p.predicted_latency_seconds, a100.predicted_latency_seconds);
    // The status carries it as the API serves it.
    let json = serde_json::to_value(&p).unwrap();
    assert_eq!(json["rates"]["fallback"], true, "{json}");
    assert_eq!(json["rates"]["figures"], "A100", "{json}");
    // Measured figures over the fallback: still said, and marked as replaced.
    let measured = crds::AcceleratorRates {
        device_tflops: Some(400.0),
        ..Default::default()
    };
    let p = plan_on(node("NVIDIA H800", Some(&measured)));
    let rates = p.rates.unwrap();
    assert!(rates.fallback && rates.overridden, "{rates:?}");
    assert!(
        p.reasons.iter().any(|r| r
            .starts_with("predicted at spec.accelerator.rates over the A100 defaults, a fallback")),
        "{:#?}",
        p.reasons
    );
}
