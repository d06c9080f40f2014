//! The plan: the search run for each sp in turn until one meets the workload's latency
//! bound (or the fastest where none does), the pods decoding on the host where nothing fits
//! with the decoder on the device, and the [`Plan`] the operator records, its reasons
//! written from the search's record by [`super::explain`].

use crds::{
    ComponentPlacement, ComponentPlan, DiffusionDeploymentSpec, Plan, Profile, Strategy, Workload,
};
use layerwise_core::decode::DecodeSite;

use super::candidates::{sp_choices, splits_sequence, Option_};
use super::explain;
use super::inputs::{Candidate, Limits, NodeShape, Overrides};
use super::need::{activation_bytes_per_rank, device_total};
use super::record::{Account, SpAccount, SpTry};
use super::refusal::{check_overrides, Refusal, Shortage};
use super::search::search;

/// A plan of one sp, its reasons still to be written, the search's record of it, and the
/// seconds of one step it predicts.
type Planned = (Plan, Account, f64);

/// A plan as the operator records it, with what the step-time model predicts of one
/// denoising step under it (the record holds the request's latency, not the step's).
#[derive(Debug, Clone, PartialEq)]
pub struct Recorded {
    pub plan: Plan,
    /// Seconds of one step of a request at the workload's bounds, in the steady state.
    pub step_seconds: f64,
}

/// Plans a DiffusionDeployment of `spec` on `candidates` as the reconcile does: the spec's
/// workload, what it fixes (`overrides`: [`Overrides::of`] the spec, or what the devices it
/// claims fix), and the operator's `limits` with the spec's own allowances in their place.
/// The reconcile and `layerwise-operator plan` both call this.
pub fn plan_deployment(
    spec: &DiffusionDeploymentSpec,
    candidates: &[Candidate],
    overrides: &Overrides,
    limits: &Limits,
) -> Result<Recorded, Refusal> {
    plan_recorded(
        candidates,
        &spec.workload,
        overrides,
        &limits.for_spec(spec),
    )
}

/// Plans one replica of `profile` on the best of `nodes` (every node reporting the same
/// profile) for requests up to `workload`.
pub fn plan(
    profile: &Profile,
    nodes: &[NodeShape],
    workload: &Workload,
    overrides: &Overrides,
    limits: &Limits,
) -> Result<Plan, Refusal> {
    let candidates: Vec<Candidate> = nodes
        .iter()
        .map(|n| Candidate {
            node: n.clone(),
            profile,
        })
        .collect();
    plan_candidates(&candidates, workload, overrides, limits)
}

/// Plans one replica on the best of `candidates`, each sized with its own profile, for
/// requests up to `workload`. A plan's figures hold on every node it names. Where the pods
/// would decode on the device and no option fits with the decoder there, the pods decode
/// on the host instead (the plan's `decoder` term is then 0, and the operator tells the
/// engine so), and the reasons say why.
pub fn plan_candidates(
    candidates: &[Candidate],
    workload: &Workload,
    overrides: &Overrides,
    limits: &Limits,
) -> Result<Plan, Refusal> {
    plan_recorded(candidates, workload, overrides, limits).map(|r| r.plan)
}

/// [`plan_candidates`], with the step the plan predicts.
fn plan_recorded(
    candidates: &[Candidate],
    workload: &Workload,
    overrides: &Overrides,
    limits: &Limits,
) -> Result<Recorded, Refusal> {
    check_overrides(overrides)?;
    let sps = sp_choices(candidates, overrides)?;
    let bound = workload.max_latency_seconds;
    // Each sp in turn, the fewest first: the first that fits and meets the bound wins;
    // where none meets it, the fastest that fits.
    let mut tried: Vec<(u32, Result<f64, Refusal>)> = Vec::new();
    let (mut met, mut fastest): (Option<Planned>, Option<Planned>) = (None, None);
    for &sp in &sps {
        let planned = match plan_sp(candidates, workload, overrides, sp, limits) {
            Ok(planned) => planned,
            Err(r) => {
                tried.push((sp, Err(r)));
                continue;
            }
        };
        let latency = planned.0.predicted_latency_seconds.unwrap_or(f64::INFINITY);
        tried.push((sp, Ok(latency)));
        if bound.is_none_or(|b| latency <= b) {
            met = Some(planned);
            break;
        }
        if fastest
            .as_ref()
            .is_none_or(|(f, _, _)| latency < f.predicted_latency_seconds.unwrap_or(f64::INFINITY))
        {
            fastest = Some(planned);
        }
    }
    let bound_met = met.is_some();
    let Some((mut plan, account, step_seconds)) = met.or(fastest) else {
        return Err(
            Refusal::furthest(tried.into_iter().filter_map(|(_, r)| r.err()))
                .expect("at least one sp is tried"),
        );
    };
    plan.latency_bound_met = bound.map(|_| bound_met);
    let profile = candidates
        .iter()
        .find(|c| plan.nodes.contains(&c.node.name))
        .map(|c| c.profile)
        .expect("a plan names the nodes it fits");
    // Why this sp: where the family splits its sequence, or where the spec or a latency
    // bound asked for something only sequence parallelism could give.
    let sp = (splits_sequence(profile) || overrides.sp.is_some() || bound.is_some()).then(|| {
        let act = |sp| activation_bytes_per_rank(profile, workload, sp, limits.backend);
        SpAccount {
            family: profile.family.clone(),
            splits: splits_sequence(profile),
            workload: workload.clone(),
            fixed: overrides.sp.is_some(),
            sp: plan.sp,
            latency: plan.predicted_latency_seconds.unwrap_or_default(),
            bound_met,
            one: act(1),
            per_rank: act(plan.sp),
            tried: tried
                .into_iter()
                .map(|(sp, outcome)| SpTry {
                    sp,
                    activations: act(sp),
                    outcome,
                })
                .collect(),
        }
    });
    plan.reasons = explain::reasons(&account, sp.as_ref());
    plan.rejected = explain::rejected(&account);
    Ok(Recorded { plan, step_seconds })
}

/// [`plan_candidates`] with groups of `sp` ranks, and the search's record of it. Where the
/// pods would decode on the device and no option fits with the decoder there, the pods
/// decode on the host instead (the plan's `decoder` term is then 0, and the operator tells
/// the engine so), and the record says why.
fn plan_sp(
    candidates: &[Candidate],
    workload: &Workload,
    overrides: &Overrides,
    sp: u32,
    limits: &Limits,
) -> Result<Planned, Refusal> {
    match plan_decoding(candidates, workload, overrides, sp, limits) {
        Err(r) if limits.decode == DecodeSite::Device && r.shortage == Shortage::DeviceMemory => {
            let host = Limits {
                decode: DecodeSite::Host,
                ..*limits
            };
            let (p, mut account, step) = plan_decoding(candidates, workload, overrides, sp, &host)?;
            account.device_decode_refused = Some(r);
            Ok((p, account, step))
        }
        r => r,
    }
}

/// [`plan_sp`] with the pods decoding where `limits` says: the plan's figures, its reasons
/// still to be written from the record.
fn plan_decoding(
    candidates: &[Candidate],
    workload: &Workload,
    overrides: &Overrides,
    sp: u32,
    limits: &Limits,
) -> Result<Planned, Refusal> {
    let found = search(candidates, workload, overrides, sp, limits)?;
    let a = found.account;
    let o = &a.option;
    let (resident_blocks, resident_blocks_by_component) = o.kept_blocks();
    let n = &a.need;
    let plan = Plan {
        components: components(o, found.profile),
        strategy: o.strategy,
        dp: o.dp,
        sp: o.sp,
        predicted_latency_seconds: Some((found.latency * 1e3).round() / 1e3),
        latency_bound_met: None,
        resource_claim_template: None,
        slots: o.k,
        fast_peer_link: found.fast_peer_link,
        device_bytes_per_rank: device_total(&n.device),
        host_bytes_per_pod: n.host_per_pod,
        host_bytes_per_node: n.host_shared,
        resident_blocks,
        resident_blocks_by_component,
        device_breakdown: n.device.clone(),
        nodes: a.fits.clone(),
        rates: crds::PlanRates::of(&a.rates_from),
        reasons: Vec::new(),
        rejected: Vec::new(),
    };
    Ok((plan, a, found.step))
}

/// Each component of `profile` under `o`: kept whole or streamed, and its block bytes over
/// all its groups.
fn components(o: &Option_, profile: &Profile) -> Vec<ComponentPlan> {
    let groups = o.resident_groups(profile);
    let mut components: Vec<ComponentPlan> = Vec::new();
    for (g, resident) in profile.groups.iter().zip(groups) {
        let placement = if resident || o.strategy == Strategy::Resident {
            ComponentPlacement::Resident
        } else {
            ComponentPlacement::Streamed
        };
        match components.iter_mut().find(|c| c.name == g.component) {
            Some(c) => c.block_bytes += g.bytes(),
            None => components.push(ComponentPlan {
                name: g.component.clone(),
                placement,
                block_bytes: g.bytes(),
            }),
        }
    }
    components
}
