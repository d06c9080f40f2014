//! The memory model the planner counts with: activation and decoder bytes of the largest
//! allowed request and each option's device bytes per rank and host bytes per pod, all by
//! the engine's own formulas ([`layerwise_core::memory`], [`RequestBounds`]), so the plan and
//! the engine's start check agree.

use crds::{MemoryBreakdown, Profile, Workload};
#[cfg(doc)]
use layerwise_core::bounds::RequestBounds;
use layerwise_core::compute_dtype::{Backend, ComputeElement};
use layerwise_core::decode::{DecodeSite, DecoderBytes};
use layerwise_core::memory::{self, Placement};

use super::inputs::Limits;

/// Bytes in a GiB, as the reasons and refusals print memory.
pub(super) const GIB: f64 = (1u64 << 30) as f64;

/// The memory one (strategy, dp, K) option needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Need {
    pub device: MemoryBreakdown,
    pub host_per_pod: u64,
    /// Host bytes one node holds once for every pod of the model: its page-cache copy.
    pub host_shared: u64,
}

/// Peak activation bytes for the largest allowed request, or `None` when the engine's formula
/// would overflow (a request no device could hold).
pub fn activation_bytes(profile: &Profile, w: &Workload) -> Option<u64> {
    activation_bytes_per_rank(profile, w, 1)
}

/// [`activation_bytes`] on each rank of a group of `sp` that splits the request's sequence:
/// the engine's own formula ([`RequestBounds::activation_bytes_per_rank`]), which its start
/// check calls with its `--sp`, in the element its ranks compute in ([`compute_element`]).
pub fn activation_bytes_per_rank(profile: &Profile, w: &Workload, sp: u32) -> Option<u64> {
    crate::resources::request_bounds(w).cached_activation_bytes_per_rank(
        &profile.activation,
        u64::from(sp),
        cache_hold(w),
        compute_element(profile),
    )
}

/// What the workload's step cache holds per sample (nothing without one).
pub fn cache_hold(w: &Workload) -> layerwise_core::step_cache::CacheHold {
    w.cache
        .as_ref()
        .map_or_else(Default::default, |c| c.terms(w.max_steps).0)
}

/// The element the engine pods' blocks compute in on the accelerators the planner sizes:
/// the engine's `--compute-dtype auto` on a GPU ([`Profile::compute_element`]), bf16 for a
/// bf16 checkpoint of a family that computes in half precision, f32 for one that does not.
pub fn compute_element(profile: &Profile) -> ComputeElement {
    profile.compute_element(Backend::Gpu)
}

/// What the engine pods' decoder keeps on each device where they decode (`site`): its
/// weights and the decode of the largest output `w` allows, by the engine's own
/// [`DecodeSite::decoder_bytes`]; nothing where they decode on the host. `None` when
/// that decode would overflow (an output no device could decode).
pub fn decoder_bytes(profile: &Profile, w: &Workload, site: DecodeSite) -> Option<DecoderBytes> {
    site.decoder_bytes(
        profile.decoder_bytes,
        &profile.activation,
        profile.decode.as_ref(),
        layerwise_core::decode::DEFAULT_DECODE_BUDGET,
        &crate::resources::request_bounds(w),
    )
}

/// Device bytes per rank and host bytes per pod for one option: the engine's memory model
/// ([`layerwise_core::memory`]) over the profile's groups, with `resident` marking the
/// groups kept whole on the device, and `decoder` beside the rank.
pub fn need(
    profile: &Profile,
    activations: u64,
    decoder: DecoderBytes,
    placement: &Placement,
    limits: &Limits,
) -> Need {
    let d = memory::device_bytes(
        &profile.groups,
        placement,
        profile.outside_block_bytes,
        activations,
        limits.device_overhead,
    )
    .with_decoder(decoder);
    let device = MemoryBreakdown {
        block_weights: d.block_weights,
        slots: d.slots,
        resident_weights: d.resident_weights,
        activations: d.activations,
        overhead: d.overhead,
        decoder: d.decoder,
    };
    Need {
        device,
        host_per_pod: memory::pod_host_bytes(&profile.groups, placement, limits.host_overhead),
        host_shared: profile.total_bytes,
    }
}

/// The device bytes per rank of `b`, summed without overflowing.
pub(super) fn device_total(b: &MemoryBreakdown) -> u64 {
    [
        b.block_weights,
        b.slots,
        b.resident_weights,
        b.activations,
        b.overhead,
        b.decoder,
    ]
    .into_iter()
    .fold(0u64, u64::saturating_add)
}
