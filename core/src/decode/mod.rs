//! Where `layerwise serve` turns finished latents into pixels, and what that costs on the
//! device: the one decision the server and the operator's planner both take, so that the
//! decoder's device bytes are counted on both sides or on neither.
//!
//! The server decodes beside the ranks (a decode thread, so the VAE never holds the other
//! ranks' collectives), never inside the lockstep. On a CUDA GPU that thread runs the VAE
//! on the device the ranks compute on: each rank's device holds one copy of the decoder,
//! loaded once at start, and decodes the outputs one at a time, so a device keeps the
//! decoder's weights and one decode's peak beside the rank's own bytes. Per rank rather
//! than on rank 0 alone: the memory model gives every rank of a pod the same budget, so a
//! decoder on rank 0 only would cost the pod the same per-device figure while making rank 0
//! the slowest rank of the lockstep for everyone's outputs; per rank, decoding keeps pace
//! with dp ranks finishing outputs and its interference is spread evenly. On the CPU
//! backend the host is the device: the decoder stays on the CPU, outside the ranks' budget,
//! as it always has.

mod peak;

use std::fmt;
use std::str::FromStr;

pub use peak::{
    ConvScratch, DecodeCost, DecodeSetting, OutputSize, PeakPoint, Tile, CPU_CONV_TILE,
    IM2COL_BUDGET,
};

use crate::bounds::RequestBounds;
use crate::checkpoint::ActivationCost;

/// Environment variable of `layerwise serve --decode` (the operator sets it from the
/// plan's decision).
pub const ENV_DECODE: &str = "LAYERWISE_DECODE";

/// Environment variable of `layerwise serve --decode-budget`: the bytes a decode may hold
/// at its peak, which the plan charged (the operator sets it from the plan).
pub const ENV_DECODE_BUDGET: &str = "LAYERWISE_DECODE_BUDGET";

/// The decode budget of a plan that names none: what the planner offers a decode before
/// it takes the largest setting that fits ([`DecodeCost::choose`]), and what an engine
/// started without a plan decodes within.
pub const DEFAULT_DECODE_BUDGET: u64 = 16 << 30;

/// Element size the VAE decoders compute in: they load their weights as f32 on every
/// device.
pub const DECODE_ELEM_BYTES: u64 = 4;

/// The kind of device the ranks compute on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// The CPU backend: device memory is host memory.
    Cpu,
    /// CUDA GPUs.
    Cuda,
}

impl DeviceKind {
    /// The backend an engine pod computes on when it is given devices of the extended
    /// resource `resource` (the DiffusionDeployment's `accelerator.resourceName`): CUDA for
    /// NVIDIA's (`nvidia.com/...`), the CPU backend for anything else, the engine having
    /// no other.
    pub fn of_resource(resource: &str) -> DeviceKind {
        if resource.starts_with("nvidia.com/") {
            DeviceKind::Cuda
        } else {
            DeviceKind::Cpu
        }
    }
}

impl DeviceKind {
    /// What ranks on devices of this kind compute on, which decides the element their
    /// activations are charged in ([`crate::compute_dtype`]).
    pub fn backend(self) -> crate::compute_dtype::Backend {
        match self {
            DeviceKind::Cuda => crate::compute_dtype::Backend::Gpu,
            DeviceKind::Cpu => crate::compute_dtype::Backend::Cpu,
        }
    }
}

/// Where the server's decoder runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeSite {
    /// On the host's CPU, outside the ranks' device budget.
    Host,
    /// On each rank's device, counted in that device's budget ([`DecoderBytes`]).
    Device,
}

impl DecodeSite {
    /// The one decision: on the ranks' devices when they are GPUs, on the host when the
    /// ranks compute on the CPU.
    pub fn for_device(kind: DeviceKind) -> DecodeSite {
        match kind {
            DeviceKind::Cuda => DecodeSite::Device,
            DeviceKind::Cpu => DecodeSite::Host,
        }
    }

    /// The decision for pods given devices of `resource` ([`DeviceKind::of_resource`]).
    pub fn for_resource(resource: &str) -> DecodeSite {
        Self::for_device(DeviceKind::of_resource(resource))
    }

    pub fn as_str(self) -> &'static str {
        match self {
            DecodeSite::Host => "host",
            DecodeSite::Device => "device",
        }
    }

    /// Device bytes the decoder takes on each rank's device when it runs at this site, for
    /// a decoder of `decoder_weights` bytes (the checkpoint's, [`crate::checkpoint::
    /// Profile::decoder_bytes`]) and outputs within `bounds`: nothing on the host. A
    /// decoder the family describes (`decode`) decodes the largest output at the largest
    /// split that fits `budget` ([`DecodeCost::choose`], on the device), and its peak is
    /// charged; one it does not is charged the activation formula's reservation. `None`
    /// when no split fits the budget or the reservation would overflow.
    pub fn decoder_bytes(
        self,
        decoder_weights: u64,
        cost: &ActivationCost,
        decode: Option<&DecodeCost>,
        budget: u64,
        bounds: &RequestBounds,
    ) -> Option<DecoderBytes> {
        match self {
            DecodeSite::Host => Some(DecoderBytes::default()),
            DecodeSite::Device => Some(DecoderBytes {
                weights: decoder_weights,
                peak: match decode {
                    Some(d) => device_decode(d, bounds, budget).ok()?.1,
                    None => cost.decode_bytes(bounds.max_width, bounds.max_height)?,
                },
            }),
        }
    }
}

/// The split and the peak of decoding the largest output `bounds` admit on a device within
/// `budget`: the planner's charge and the engine's start check, one function.
pub fn device_decode(
    decode: &DecodeCost,
    bounds: &RequestBounds,
    budget: u64,
) -> crate::Result<(DecodeSetting, u64)> {
    decode.choose(
        &OutputSize::of_bounds(bounds),
        DECODE_ELEM_BYTES,
        ConvScratch::Device,
        budget,
    )
}

impl OutputSize {
    /// The largest output `bounds` admit.
    pub fn of_bounds(bounds: &RequestBounds) -> OutputSize {
        OutputSize {
            width: bounds.max_width,
            height: bounds.max_height,
            frames: bounds.max_frames.max(1),
        }
    }
}

impl fmt::Display for DecodeSite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `--decode`: a site, or `auto` ([`DecodeSite::for_device`] of the backend the ranks
/// resolve to).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DecodeChoice {
    #[default]
    Auto,
    Fixed(DecodeSite),
}

impl DecodeChoice {
    /// The site for ranks computing on `kind`.
    pub fn resolve(self, kind: DeviceKind) -> DecodeSite {
        match self {
            DecodeChoice::Auto => DecodeSite::for_device(kind),
            DecodeChoice::Fixed(site) => site,
        }
    }
}

impl FromStr for DecodeChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(DecodeChoice::Auto),
            "host" => Ok(DecodeChoice::Fixed(DecodeSite::Host)),
            "device" => Ok(DecodeChoice::Fixed(DecodeSite::Device)),
            other => Err(format!("`{other}`: want auto, host or device")),
        }
    }
}

impl fmt::Display for DecodeChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeChoice::Auto => f.write_str("auto"),
            DecodeChoice::Fixed(s) => s.fmt(f),
        }
    }
}

/// Device bytes of a decoder beside the ranks, on one rank's device: the memory model's
/// `decoder` term ([`crate::memory::DeviceBytes::decoder`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DecoderBytes {
    /// Its weights, loaded once at start.
    pub weights: u64,
    /// The peak of decoding the largest output the bounds admit, kept free while the
    /// rank computes (the decode runs beside the rank's passes, not between them).
    pub peak: u64,
}

impl DecoderBytes {
    pub fn total(&self) -> u64 {
        self.weights.saturating_add(self.peak)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cost() -> ActivationCost {
        ActivationCost {
            pixels_per_token: 256,
            bytes_per_token: 1000,
            attention_bytes_per_token: 0,
            bytes_per_token_pair: 0,
            attention_bytes: 0,
            vae_bytes_per_pixel: 3,
            frames_per_latent: 4,
            decoder_frames: 6,
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
        }
    }

    fn bounds(w: u64, h: u64, frames: u64) -> RequestBounds {
        RequestBounds {
            max_width: w,
            max_height: h,
            max_frames: frames,
            max_steps: 10,
            max_n: 2,
            guidance: true,
            max_prompt_tokens: 0,
        }
    }

    #[test]
    fn gpus_decode_on_the_device_and_the_cpu_on_the_host() {
        assert_eq!(DecodeSite::for_device(DeviceKind::Cuda), DecodeSite::Device);
        assert_eq!(DecodeSite::for_device(DeviceKind::Cpu), DecodeSite::Host);
        assert_eq!(
            DecodeSite::for_resource("nvidia.com/gpu"),
            DecodeSite::Device
        );
        assert_eq!(
            DecodeSite::for_resource("nvidia.com/mig-1g.10gb"),
            DecodeSite::Device
        );
        // The engine computes on no other accelerator: such pods run the CPU backend.
        assert_eq!(
            DecodeSite::for_resource("huawei.com/Ascend910"),
            DecodeSite::Host
        );
        for kind in [DeviceKind::Cpu, DeviceKind::Cuda] {
            assert_eq!(
                DecodeChoice::Auto.resolve(kind),
                DecodeSite::for_device(kind)
            );
            assert_eq!(
                DecodeChoice::Fixed(DecodeSite::Host).resolve(kind),
                DecodeSite::Host
            );
        }
        for s in ["auto", "host", "device"] {
            assert_eq!(s.parse::<DecodeChoice>().unwrap().to_string(), s);
        }
        assert!("gpu".parse::<DecodeChoice>().unwrap_err().contains("auto"));
    }

    #[test]
    fn the_decoder_term_is_its_weights_and_the_largest_decode_on_the_device_only() {
        let b = bounds(64, 32, 9);
        let host = DecodeSite::Host
            .decoder_bytes(500, &cost(), None, DEFAULT_DECODE_BUDGET, &b)
            .unwrap();
        assert_eq!(host, DecoderBytes::default());
        let dev = DecodeSite::Device
            .decoder_bytes(500, &cost(), None, DEFAULT_DECODE_BUDGET, &b)
            .unwrap();
        // 3 bytes per pixel for each of the 6 frames the chunked decoder holds at once.
        assert_eq!(dev.weights, 500);
        assert_eq!(dev.peak, 3 * 64 * 32 * 6);
        assert_eq!(dev.total(), 500 + 3 * 64 * 32 * 6);
        // The same peak as the activation formula's VAE term: one figure for the decode.
        assert_eq!(
            dev.peak,
            cost()
                .checked_bytes(&crate::checkpoint::RequestShape {
                    width: 64,
                    height: 32,
                    frames: 1,
                    ..Default::default()
                })
                .unwrap()
        );
        // Overflow: no device holds it.
        assert!(DecodeSite::Device
            .decoder_bytes(500, &cost(), None, 0, &bounds(u64::MAX, u64::MAX, 1))
            .is_none());
        assert!(DecodeSite::Host
            .decoder_bytes(500, &cost(), None, 0, &bounds(u64::MAX, u64::MAX, 1))
            .is_some());
    }
}
