//! What `layerwise-operator plan` prints: the planner's typed record ([`Recorded`]: the
//! [`Plan`] the operator writes into `status.plan`, and the step it predicts) in words,
//! or as JSON; and what serving with it gives a node, in outputs per hour. A refusal is
//! printed with its condition reason and the message the `Planned` condition would carry.
//!
//! [`Recorded`]: crate::planner::Recorded

use crds::{AcceleratorRates, ComponentPlacement, Plan};
use serde_json::{json, Value};

use super::planned::Planned;
use crate::planner::NodeShape;

const GIB: f64 = (1u64 << 30) as f64;

/// Engine pods of `plan` one `node` holds: as many as its accelerators allow
/// (dp × sp each) and its host memory (the model's page-cache copy once, then each pod's
/// own bytes), and which of the two bounds it.
pub fn pods_per_node(plan: &Plan, node: &NodeShape) -> (u32, &'static str) {
    let by_devices = node.devices / plan.devices();
    let by_host =
        node.host_bytes.saturating_sub(plan.host_bytes_per_node) / plan.host_bytes_per_pod.max(1);
    let by_host = u32::try_from(by_host).unwrap_or(u32::MAX);
    if by_host < by_devices {
        (by_host, "host memory")
    } else {
        (by_devices, "accelerators")
    }
}

/// Outputs (images or clips) one node serves an hour at the workload's bounds: each of its
/// pods runs dp requests of `batch` outputs at once, each taking the predicted latency.
pub fn outputs_per_hour(plan: &Plan, node: &NodeShape, batch: u64) -> Option<f64> {
    let latency = plan.predicted_latency_seconds.filter(|l| *l > 0.0)?;
    let (pods, _) = pods_per_node(plan, node);
    Some(f64::from(pods) * f64::from(plan.dp) * batch as f64 * 3600.0 / latency)
}

/// The record as JSON: the inputs as the planner saw them, and the plan as the operator
/// writes it into `status.plan` (with the step and the outputs per hour beside it), or the
/// refusal with its condition reason and message.
pub fn record(p: &Planned) -> Value {
    let n = &p.node;
    let mut out = json!({
        "model": {
            "source": p.model.display().to_string(),
            "family": p.profile.family,
            "totalBytes": p.profile.total_bytes,
            "blocks": p.profile.blocks,
        },
        "node": {
            "name": n.name,
            "product": p.product,
            "devices": n.devices,
            "deviceBytes": n.device_bytes,
            "hostBytes": n.host_bytes,
            "fastPeerLink": n.fast_peer_link,
            "rates": rates(n),
            "ratesFrom": n.rates_from.to_string(),
        },
        "workload": p.spec.workload,
    });
    match &p.outcome {
        Ok(r) => {
            let (pods, bound) = pods_per_node(&r.plan, n);
            out["plan"] = serde_json::to_value(&r.plan).expect("a plan serializes");
            out["predictedStepSeconds"] = json!(r.step_seconds);
            out["podsPerNode"] = json!(pods);
            out["podsPerNodeBoundBy"] = json!(bound);
            out["outputsPerHourPerNode"] =
                json!(outputs_per_hour(&r.plan, n, p.spec.workload.max_batch));
        }
        Err(refusal) => {
            out["refusal"] = json!({
                "reason": refusal.shortage.reason(),
                "message": refusal.for_workload(&p.spec.workload),
                "node": refusal.node,
                "needed": refusal.needed,
                "available": refusal.available,
            });
        }
    }
    out
}

/// `n`'s rates in the form `spec.accelerator.rates` takes.
fn rates(n: &NodeShape) -> AcceleratorRates {
    AcceleratorRates {
        device_tflops: Some(n.rates.device_flops / 1e12),
        host_to_device_gbps: Some(n.rates.host_to_device / 1e9),
        peer_gbps: Some(n.rates.peer / 1e9),
    }
}

/// The record in words: the inputs, then the plan term by term with its reasons and why
/// each alternative lost, or the refusal.
pub fn text(p: &Planned) -> String {
    let (n, w, prof) = (&p.node, &p.spec.workload, &p.profile);
    let gib = |b: u64| format!("{:.2} GiB", b as f64 / GIB);
    let mut out = vec![
        format!(
            "model      {} ({}, {} in {} streamed blocks, largest {})",
            p.model.display(),
            prof.family,
            gib(prof.total_bytes),
            prof.blocks,
            gib(prof.largest_block_bytes)
        ),
        format!(
            "node       {} × {} ({} each, {}), {} host",
            n.devices,
            p.product,
            gib(n.device_bytes),
            if n.fast_peer_link {
                "fast peer link"
            } else {
                "no fast peer link"
            },
            gib(n.host_bytes)
        ),
        format!(
            "rates      {} ({:.0} TFLOP/s, {:.0} GB/s host to device, {:.0} GB/s between peers)",
            n.rates_from,
            n.rates.device_flops / 1e12,
            n.rates.host_to_device / 1e9,
            n.rates.peer / 1e9
        ),
        format!(
            "workload   {}x{}x{}, {} steps, batch {}, {}, prompts up to {} tokens{}",
            w.max_width,
            w.max_height,
            w.max_frames,
            w.max_steps,
            w.max_batch,
            if w.guidance {
                "guidance"
            } else {
                "no guidance"
            },
            w.max_prompt_tokens,
            w.max_latency_seconds
                .map_or(String::new(), |b| format!(", at most {b} s a request"))
        ),
        String::new(),
    ];
    let r = match &p.outcome {
        Ok(r) => r,
        Err(refusal) => {
            out.push(format!(
                "refused    {}: {}",
                refusal.shortage.reason(),
                refusal.for_workload(w)
            ));
            return out.join("\n");
        }
    };
    let plan = &r.plan;
    out.push(format!(
        "plan       {} dp {} × sp {}, {} slots: {} accelerator(s) a pod{}",
        plan.strategy.as_str(),
        plan.dp,
        plan.sp,
        plan.slots,
        plan.devices(),
        match plan.latency_bound_met {
            Some(true) => "; meets maxLatencySeconds",
            Some(false) => "; no plan meets maxLatencySeconds (LatencyBoundNotMet)",
            None => "",
        }
    ));
    for c in &plan.components {
        let placement = match c.placement {
            ComponentPlacement::Resident => "whole on every device".to_string(),
            ComponentPlacement::Streamed => {
                let kept = plan
                    .resident_blocks_by_component
                    .get(&c.name)
                    .copied()
                    .unwrap_or(plan.resident_blocks);
                format!("streamed, {kept} block(s) kept on the device")
            }
        };
        out.push(format!(
            "           {:<14} {} of blocks, {placement}",
            c.name,
            gib(c.block_bytes)
        ));
    }
    let b = &plan.device_breakdown;
    out.push(format!(
        "device     {} per rank",
        gib(plan.device_bytes_per_rank)
    ));
    for (term, bytes) in [
        ("block weights", b.block_weights),
        ("slots", b.slots),
        ("resident", b.resident_weights),
        ("activations", b.activations),
        ("overhead", b.overhead),
        ("decoder", b.decoder),
    ] {
        out.push(format!("             {term:<14} {:>10}", gib(bytes)));
    }
    out.push(format!(
        "host       {} per pod, beside the model's {} page-cache copy the pods of a node share",
        gib(plan.host_bytes_per_pod),
        gib(plan.host_bytes_per_node)
    ));
    let latency = plan.predicted_latency_seconds.unwrap_or_default();
    out.push(format!(
        "predicted  {:.3} s a step, {:.3} s a request at the bounds",
        r.step_seconds, latency
    ));
    let (pods, bound) = pods_per_node(plan, n);
    out.push(format!(
        "serves     {pods} pod(s) a node (bound by its {bound}), {} request(s) at once: {} outputs an hour a node",
        pods * plan.dp,
        outputs_per_hour(plan, n, w.max_batch).map_or("no".into(), |o| format!("{o:.1}"))
    ));
    out.push(String::new());
    out.push("reasons".into());
    out.extend(plan.reasons.iter().map(|r| format!("  - {r}")));
    out.push("alternatives".into());
    out.extend(plan.rejected.iter().map(|r| format!("  - {r}")));
    out.join("\n")
}
