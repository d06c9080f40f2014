//! The rates as a DiffusionDeployment states them (`spec.accelerator.rates`, the CRD's own
//! type): TFLOP/s and GB/s, each optional, each replacing the product's default where set;
//! and the snippet `layerwise bench` and `engine/gpu-check` print of the rates they measured,
//! rendered from this same type so what they print is what the CRD parses.

use serde::{Deserialize, Serialize};

use super::rates::Rates;

/// Sustained figures of one accelerator (not data-sheet peaks): what the planner predicts
/// step times from when it chooses the blocks and components to keep on the device.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct AcceleratorRates {
    /// Dense FLOP/s one device sustains in the compute dtype, in TFLOP/s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("x-kubernetes-validations" = [{"message": "deviceTflops must be positive", "rule": "self > 0.0"}]))
    )]
    pub device_tflops: Option<f64>,
    /// Host-to-device copy rate of one device, in GB/s (10^9 bytes).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "hostToDeviceGBps"
    )]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("x-kubernetes-validations" = [{"message": "hostToDeviceGBps must be positive", "rule": "self > 0.0"}]))
    )]
    pub host_to_device_gbps: Option<f64>,
    /// All-gather rate each rank receives over the peer link, in GB/s (10^9 bytes).
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "peerGBps")]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("x-kubernetes-validations" = [{"message": "peerGBps must be positive", "rule": "self > 0.0"}]))
    )]
    pub peer_gbps: Option<f64>,
}

impl AcceleratorRates {
    /// `defaults` with each figure set here in its place.
    pub fn over(&self, defaults: Rates) -> Rates {
        Rates {
            device_flops: self
                .device_tflops
                .map_or(defaults.device_flops, |t| t * 1e12),
            host_to_device: self
                .host_to_device_gbps
                .map_or(defaults.host_to_device, |g| g * 1e9),
            peer: self.peer_gbps.map_or(defaults.peer, |g| g * 1e9),
            overlap: defaults.overlap,
        }
    }

    /// Measured rates as the spec states them, to three significant figures (what a
    /// measurement supports); `peer` only where the machine has peers to gather from.
    pub fn measured(device_flops: f64, host_to_device: f64, peer: Option<f64>) -> Self {
        AcceleratorRates {
            device_tflops: Some(significant(device_flops / 1e12)),
            host_to_device_gbps: Some(significant(host_to_device / 1e9)),
            peer_gbps: peer.map(|p| significant(p / 1e9)),
        }
    }

    /// The YAML a user pastes into a DiffusionDeployment: `spec:` / `accelerator:` /
    /// `rates:` and each figure set, in the names serde gives this type.
    pub fn snippet(&self) -> String {
        let fields = match serde_json::to_value(self) {
            Ok(serde_json::Value::Object(m)) => m,
            _ => serde_json::Map::new(),
        };
        let mut out = String::from("spec:\n  accelerator:\n    rates:\n");
        for (name, value) in fields {
            out.push_str(&format!("      {name}: {value}\n"));
        }
        out
    }
}

/// `x` rounded to three significant figures.
fn significant(x: f64) -> f64 {
    if !x.is_finite() || x == 0.0 {
        return x;
    }
    let scale = 10f64.powi(2 - x.abs().log10().floor() as i32);
    (x * scale).round() / scale
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_snippet_names_every_figure_measured_in_the_spec_s_units() {
        let r = AcceleratorRates::measured(612.345e12, 24.987e9, Some(351.2e9));
        assert_eq!(
            r.snippet(),
            "spec:\n  accelerator:\n    rates:\n      deviceTflops: 612.0\n      hostToDeviceGBps: 25.0\n      peerGBps: 351.0\n"
        );
        let cpu = AcceleratorRates::measured(0.08765e12, 11.04e9, None);
        assert_eq!(cpu.device_tflops, Some(0.0877));
        assert!(!cpu.snippet().contains("peerGBps"), "{}", cpu.snippet());
    }

    #[test]
    fn figures_set_replace_the_defaults() {
        let r = AcceleratorRates {
            host_to_device_gbps: Some(12.5),
            ..Default::default()
        }
        .over(Rates::DEFAULT);
        assert_eq!(r.host_to_device, 12.5e9);
        assert_eq!(r.device_flops, Rates::DEFAULT.device_flops);
    }
}
