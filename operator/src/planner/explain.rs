//! The explanation: the plan's reasons and its rejected strategies, in words, written from
//! what the search recorded ([`Account`], [`SpAccount`]). Only text is made here; every
//! figure it prints was decided, measured or predicted by the search, and the operator's
//! tests compare these words.

use crds::Strategy;
use layerwise_core::timing;

use super::candidates::{rank, Option_, PREFERENCE};
use super::need::{device_total, Need, GIB};
use super::record::{Account, ComponentVerdict, KeptBlocks, SpAccount, Streaming};
use layerwise_core::decode::DecodeSite;

/// Why the plan is what it is, in order: its memory, why its sp (`sp`, where the family
/// splits its sequence or the spec or a bound asked about sp), the copies of the model it
/// holds, its strategy, its predicted time, what it keeps on the device, its slots, the
/// nodes it fits, whether the spec fixed it, and where the pods decode on the host why.
pub(super) fn reasons(a: &Account, sp: Option<&SpAccount>) -> Vec<String> {
    let o = &a.option;
    let mut reasons = vec![memory_reason(o, &a.need, a.decode)];
    reasons.extend(sp.map(sp_reason));
    reasons.extend(copies_reason(a));
    reasons.push(strategy_reason(a));
    reasons.extend(fallback_reason(a));
    if let Some(s) = &a.streaming {
        reasons.push(timing_reason(s));
        reasons.extend(s.components.iter().map(component_note));
        reasons.extend(s.kept.iter().map(kept_blocks_reason));
    }
    reasons.extend(a.slots.map(|s| {
        if s.k > s.min {
            format!(
                "{} slots (cap {}): they predict a shorter request than fewer, by more than the tie",
                s.k, s.cap
            )
        } else {
            format!(
                "{} slots: more predict no shorter request (or do not fit), so their memory stays free",
                s.k
            )
        }
    }));
    reasons.push(format!(
        "fits {} of {} candidate nodes: {}",
        a.fits.len(),
        a.candidates,
        a.fits.join(", ")
    ));
    if a.fixed {
        reasons.push("strategy, dp, sp or slots fixed by the spec".into());
    }
    if let Some(r) = &a.device_decode_refused {
        reasons.push(format!(
            "the pods decode on the host's CPU: no option fits with the VAE decoder beside the ranks on the device ({r})"
        ));
    }
    reasons
}

/// Where the nodes report different copies of the model, which ones and which the plan
/// holds.
fn copies_reason(a: &Account) -> Option<String> {
    (a.copies.len() > 1).then(|| {
        format!(
            "the nodes report different copies of the model ({}): the plan holds the largest, {}",
            a.copies
                .iter()
                .map(|(b, name)| format!("{:.2} GiB on {name}", *b as f64 / GIB))
                .collect::<Vec<_>>()
                .join(", "),
            a.largest
        )
    })
}

/// Where the node's product has no row in the product table: whose figures stood in.
fn fallback_reason(a: &Account) -> Option<String> {
    a.rates_from.fallback().then(|| {
        format!(
            "timed with {}: set spec.accelerator.rates from engine/gpu-check's measured rates for a prediction of this product",
            a.rates_from
        )
    })
}

/// Why the chosen strategy: for `sharded`, whether fewer ranks would fit too.
fn strategy_reason(a: &Account) -> String {
    let o = &a.option;
    match o.strategy {
        Strategy::Resident => {
            "the whole model and activations fit one device: nothing moves per step".into()
        }
        Strategy::Sharded => match a.fewer_groups_fit {
            Some(dp) => format!(
                "1/{} of the blocks plus slots fit each device; {} ranks would fit too, but {} divides the node's accelerators, so its pods leave none idle",
                o.ranks(),
                dp * o.sp,
                o.ranks()
            ),
            None => format!(
                "1/{} of the blocks plus slots fit each device; the fewest ranks that fit",
                o.ranks()
            ),
        },
        Strategy::OffloadSharded => format!(
            "weights stream from the host, each of {} ranks copies 1/{} of a block and all-gathers",
            o.ranks(),
            o.ranks()
        ),
        Strategy::Offload => "weights stream from the host, each rank copies whole blocks".into(),
    }
}

/// Why the plan splits each request over the ranks it does: the activations per rank on
/// one device and on the chosen sp, the latency against the bound, and what the smaller
/// sp gave.
fn sp_reason(o: &SpAccount) -> String {
    let w = &o.workload;
    let gib = |b: Option<u64>| {
        b.map_or("more than any device holds".into(), |b| {
            format!("{:.2} GiB", b as f64 / GIB)
        })
    };
    let request = format!(
        "a {}x{}x{} request",
        w.max_width, w.max_height, w.max_frames
    );
    let (one, per_rank) = (o.one, o.per_rank);
    let bound = w.max_latency_seconds;
    let against = bound.map_or(String::new(), |b| {
        format!(
            "; it predicts {} a request against maxLatencySeconds {b}",
            secs(o.latency)
        )
    });
    let mut out = format!("sp {}: ", o.sp);
    if !o.splits {
        out += &format!(
            "the {} family does not split a request's sequence over ranks (sequence parallelism is for wan and cosmos3), so each request runs on one rank; {request} needs {} of activations{against}",
            o.family,
            gib(one)
        );
    } else if o.sp == 1 {
        out += &format!(
            "{request}'s {} of activations fit one device beside the weights{against}",
            gib(one)
        );
        if o.fixed {
            out += " (sp fixed by the spec)";
        }
    } else {
        out += &format!(
            "{request} needs {} of activations on one device; {} per rank with sp {} fits{against}",
            gib(one),
            gib(per_rank),
            o.sp
        );
        if o.fixed {
            out += " (sp fixed by the spec)";
        }
    }
    let smaller: Vec<String> = o
        .tried
        .iter()
        .filter(|t| t.sp != o.sp)
        .map(|t| match &t.outcome {
            Ok(l) => format!("sp {} predicts {}", t.sp, secs(*l)),
            Err(e) => format!(
                "sp {} does not fit ({} of activations per rank; {e})",
                t.sp,
                gib(t.activations)
            ),
        })
        .collect();
    if !smaller.is_empty() {
        out += &format!("; {}", smaller.join("; "));
    }
    if let (Some(b), false) = (bound, o.bound_met) {
        out += &format!(
            "; no sp that fits meets maxLatencySeconds {b}: the fastest, sp {}, is planned (predicted {})",
            o.sp,
            secs(o.latency)
        );
    }
    if o.sp > 1 {
        out += &format!(
            "; the profile carries no attention-head count, so the engine checks at start that the transformer has at least {} heads (cosmos3: key/value heads) and refuses to start otherwise",
            o.sp
        );
    }
    out
}

/// What `o` needs (`n`) per rank, term by term, and per pod and node on the host, with the
/// pods decoding at `decode`.
fn memory_reason(o: &Option_, n: &Need, decode: DecodeSite) -> String {
    format!(
        "{o}: {:.2} GiB per rank (block weights {:.2}, slots {:.2}, resident {:.2}, activations {:.2}, overhead {:.2}, decoder {:.2} decoding on the {}), {:.2} GiB host per pod beside the model's {:.2} GiB page-cache copy that the pods of a node share",
        device_total(&n.device) as f64 / GIB,
        n.device.block_weights as f64 / GIB,
        n.device.slots as f64 / GIB,
        n.device.resident_weights as f64 / GIB,
        n.device.activations as f64 / GIB,
        n.device.overhead as f64 / GIB,
        n.device.decoder as f64 / GIB,
        decode,
        n.host_per_pod as f64 / GIB,
        n.host_shared as f64 / GIB
    )
}

/// Seconds as the reasons print them.
fn secs(t: f64) -> String {
    if t < 1.0 {
        format!("{:.0} ms", t * 1e3)
    } else {
        format!("{t:.2} s")
    }
}

/// What the step-time model predicts of the plan (`s`): per step, compute against copy
/// and what of the copy is exposed; each per-request group's pass; the request.
fn timing_reason(s: &Streaming) -> String {
    let (p, r, w, sp, rates_from) = (&s.prediction, &s.rates, &s.work, s.sp, &s.rates_from);
    let split = if sp > 1 {
        format!(
            ", each of {sp} ranks computing {} of them",
            layerwise_core::topology::largest_share(w.tokens, u64::from(sp))
        )
    } else {
        String::new()
    };
    let hidden = if p.step_exposed <= 1e-3 * p.step.max(1e-9) {
        "every streamed copy hides behind compute".to_string()
    } else {
        format!(
            "{} of copy per step is exposed (the copies outrun the compute)",
            secs(p.step_exposed)
        )
    };
    let once: Vec<String> = p
        .groups
        .iter()
        .filter(|g| g.runs == timing::Runs::PerRequest)
        .map(|g| {
            format!(
                "{} once per request computes {}, copies {}, {} exposed",
                g.component,
                secs(g.compute),
                secs(g.copy),
                secs(g.exposed)
            )
        })
        .collect();
    format!(
        "predicted at {rates_from} ({:.0} TFLOP/s, {:.0} GB/s host to device, {:.0} GB/s between peers) for a request at the bounds ({} latent tokens x {} samples{split}, {} steps): a step computes {} and copies {} per rank, so {hidden}{}; a request {}",
        r.device_flops / 1e12,
        r.host_to_device / 1e9,
        r.peer / 1e9,
        w.tokens,
        w.samples,
        w.steps,
        secs(p.step_compute),
        secs(p.step_copy),
        if once.is_empty() {
            String::new()
        } else {
            format!("; {}", once.join("; "))
        },
        secs(p.request)
    )
}

/// Why a component stays whole or streams (`v`): against the best option that does the
/// other, or what keeping it whole would need.
fn component_note(v: &ComponentVerdict) -> String {
    let (c, t, gib) = (&v.component, v.request, |b: u64| b as f64 / GIB);
    match (v.whole, v.other, v.short) {
        (true, Some(o), _) => format!(
            "{c} stays whole on every device (copied once at start, never streamed): a request predicts {} against {} streaming it",
            secs(t),
            secs(o.request)
        ),
        (true, None, _) => format!(
            "{c} stays whole on every device (copied once at start, never streamed): it fits beside the slots"
        ),
        (false, Some(o), _) if o.request <= t * (1.0 + timing::TIE_TOLERANCE) => format!(
            "{c} streams: keeping it whole ({:.2} GiB more per rank) predicts {} a request against {}, within the {:.0}% tie, so its memory stays free",
            gib(o.extra_device_bytes),
            secs(o.request),
            secs(t),
            100.0 * timing::TIE_TOLERANCE
        ),
        (false, Some(o), _) => format!(
            "{c} streams: kept whole it predicts {} a request against {}: its memory saves more holding other blocks",
            secs(o.request),
            secs(t)
        ),
        (false, None, Some((needed, available))) => format!(
            "{c} streams: keeping it whole needs {needed} bytes per rank, the device has {available}"
        ),
        (false, None, None) => format!("{c} streams: keeping it whole does not fit"),
    }
}

/// Why a streamed component keeps the blocks it does (`k`): the predicted request time
/// with one fewer and one more.
fn kept_blocks_reason(k: &KeptBlocks) -> String {
    let (c, n, blocks, now) = (&k.component, k.kept, k.blocks, k.request);
    let fewer = k.fewer.map_or(String::new(), |f| {
        format!(", one fewer predicts {} more per request", secs(f - now))
    });
    let more = match k.more {
        None => "one more does not fit".to_string(),
        Some(m) if now - m <= 1e-6 * now => {
            "one more saves nothing (the remaining copies hide behind compute)".into()
        }
        Some(m) => format!(
            "one more saves {} per request, within the {:.0}% tie, so its memory stays free",
            secs(now - m),
            100.0 * timing::TIE_TOLERANCE
        ),
    };
    if n == 0 {
        format!("no block of {c}'s {blocks} stays on the device: {more}")
    } else {
        format!(
                    "{n} of {c}'s {blocks} blocks stay on the device, spread evenly (copied once, never streamed){fewer}; {more}"
                )
    }
}

/// Why the strategies other than the one kept lost: for each better-ranked one the closest
/// of its misses, for each worse one what it costs.
pub(super) fn rejected(a: &Account) -> Vec<String> {
    let (chosen, misses) = (a.option.strategy, &a.misses);
    let mut rejected = Vec::new();
    for s in PREFERENCE {
        if s == chosen {
            continue;
        }
        if rank(s) < rank(chosen) {
            let closest = misses
                .iter()
                .filter(|m| m.option.strategy == s)
                .min_by_key(|m| m.shortfall());
            match closest {
                Some(m) => rejected.push(format!("{}: {}", s.as_str(), m.refusal())),
                None => rejected.push(format!(
                    "{}: not applicable to these nodes or settings",
                    s.as_str()
                )),
            }
        } else {
            rejected.push(format!(
                "{}: moves more data per step than {}",
                s.as_str(),
                chosen.as_str()
            ));
        }
    }
    rejected
}
