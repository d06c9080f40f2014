//! The snippet `layerwise bench`, `layerwise rates` and `engine/gpu-check` print of the rates
//! they measured (`AcceleratorRates::snippet`) is a DiffusionDeployment fragment: merged into
//! a deployment as a user pastes it, the CRD's type reads back the figures printed.

use crds::{AcceleratorRates, DiffusionDeployment};

const DEPLOYMENT: &str = "apiVersion: layerwise.dev/v1alpha1
kind: DiffusionDeployment
metadata:
  name: calibrated
spec:
  model:
    family: wan
    location:
      hostPath: /models/Wan2.1-T2V-14B-Diffusers
";

#[test]
fn a_pasted_snippet_parses_through_the_crd() {
    for measured in [
        AcceleratorRates::measured(612.345e12, 51.27e9, Some(356.2e9)),
        AcceleratorRates::measured(0.0912e12, 9.87e9, None),
    ] {
        let snippet = measured.snippet();
        // The snippet's `spec:` fragment, pasted under the deployment's own spec.
        let body = snippet
            .strip_prefix("spec:\n")
            .expect("the snippet starts at spec");
        let yaml = format!("{DEPLOYMENT}{body}");
        let dd: DiffusionDeployment =
            serde_saphyr::from_str(&yaml).unwrap_or_else(|e| panic!("{e}\n{yaml}"));
        assert_eq!(
            dd.spec.accelerator.rates.as_ref(),
            Some(&measured),
            "{yaml}"
        );
        // And on its own, as YAML.
        let v: serde_json::Value = serde_saphyr::from_str(&snippet).unwrap();
        let alone: AcceleratorRates =
            serde_json::from_value(v["spec"]["accelerator"]["rates"].clone()).unwrap();
        assert_eq!(alone, measured);
    }
}
