//! The element type a rank's blocks compute in, decided once for the planner and the
//! engine. The activation formula's block terms scale with it
//! ([`crate::checkpoint::ActivationCost::checked_phases`]), so a plan that charged f32
//! activations for a rank computing in bf16 would reserve twice what the rank holds, and
//! one that charged bf16 for a family that computes in f32 only would reserve half. The
//! engine's `--compute-dtype auto` resolves through [`ComputeElement::auto`], and so do the
//! planner (for its accelerators) and the engine's start budget (for its device), from the
//! same inputs: the backend, the dtypes the streamed blocks are stored in (the
//! [`GroupBytes`] both hold) and the dtypes the family computes in.

use serde::{Deserialize, Serialize};

use crate::checkpoint::F32_BYTES;
use crate::memory::GroupBytes;

/// Where a rank computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// The CPU: no fast half-precision GEMM, so `auto` computes in f32.
    Cpu,
    /// A GPU (what the planner sizes): `auto` computes in the checkpoint's half dtype.
    Gpu,
}

/// A dtype blocks compute in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "lowercase")]
pub enum ComputeElement {
    F32,
    Bf16,
    F16,
}

/// What a family computes in when it declares nothing else: f32 only.
pub const F32_ONLY: &[ComputeElement] = &[ComputeElement::F32];

impl ComputeElement {
    /// Bytes of one element.
    pub fn bytes(self) -> u64 {
        match self {
            ComputeElement::F32 => F32_BYTES,
            ComputeElement::Bf16 | ComputeElement::F16 => 2,
        }
    }

    /// The name `--compute-dtype` uses.
    pub fn name(self) -> &'static str {
        match self {
            ComputeElement::F32 => "f32",
            ComputeElement::Bf16 => "bf16",
            ComputeElement::F16 => "f16",
        }
    }

    /// `auto` before the family has its say: f32 on the CPU; on a GPU the half-precision
    /// dtype the streamed blocks are stored in (bf16 before f16 when a checkpoint mixes
    /// them; f32 norms beside bf16 matrices are the usual mix and count as bf16; fp8
    /// weights count as bf16, the dtype they are dequantized into), else f32. `stored`
    /// names safetensors dtypes as the profile writes them (`BF16`, `F8_E4M3`).
    pub fn for_checkpoint<'a>(
        backend: Backend,
        stored: impl IntoIterator<Item = &'a str>,
    ) -> ComputeElement {
        if backend == Backend::Cpu {
            return ComputeElement::F32;
        }
        let stored: Vec<&str> = stored.into_iter().collect();
        if stored.iter().any(|d| *d == "BF16" || *d == "F8_E4M3") {
            ComputeElement::Bf16
        } else if stored.contains(&"F16") {
            ComputeElement::F16
        } else {
            ComputeElement::F32
        }
    }

    /// What `--compute-dtype auto` computes in on `backend` for streamed blocks of
    /// `groups`, of a family that computes in `family` dtypes: [`Self::for_checkpoint`]
    /// where the family computes in it, f32 where it does not. The one decision the
    /// planner's activation term and the engine's (its budget and its ranks) both read.
    pub fn auto(
        backend: Backend,
        groups: &[GroupBytes],
        family: &[ComputeElement],
    ) -> ComputeElement {
        let stored = groups
            .iter()
            .flat_map(|g| g.blocks_by_dtype.keys().map(String::as_str));
        let want = ComputeElement::for_checkpoint(backend, stored);
        if family.contains(&want) {
            want
        } else {
            ComputeElement::F32
        }
    }
}

/// Serde's default for a profile that predates the field: f32 only, which charges an
/// older agent's model the f32 activations it was always charged.
pub fn f32_only() -> Vec<ComputeElement> {
    F32_ONLY.to_vec()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn groups(dtypes: &[&str]) -> Vec<GroupBytes> {
        let blocks_by_dtype: BTreeMap<String, Vec<u64>> =
            dtypes.iter().map(|d| (d.to_string(), vec![1])).collect();
        vec![GroupBytes {
            component: "transformer".into(),
            blocks_by_dtype,
        }]
    }

    #[test]
    fn auto_is_the_half_dtype_on_a_gpu_where_the_family_computes_in_it() {
        use ComputeElement::*;
        let all = [F32, Bf16, F16];
        let gpu =
            |d: &[&str], f: &[ComputeElement]| ComputeElement::auto(Backend::Gpu, &groups(d), f);
        assert_eq!(gpu(&["F32", "BF16"], &all), Bf16);
        assert_eq!(gpu(&["F16"], &all), F16);
        assert_eq!(gpu(&["F16", "BF16"], &all), Bf16);
        assert_eq!(gpu(&["F32", "F8_E4M3"], &all), Bf16);
        assert_eq!(gpu(&["F32"], &all), F32);
        // A family that computes in f32 only is charged f32 on a GPU too.
        assert_eq!(gpu(&["BF16"], F32_ONLY), F32);
        // The CPU computes in f32 whatever the checkpoint holds.
        assert_eq!(
            ComputeElement::auto(Backend::Cpu, &groups(&["BF16"]), &all),
            F32
        );
        assert_eq!((F32.bytes(), Bf16.bytes(), F16.bytes()), (4, 2, 2));
    }

    #[test]
    fn reads_and_writes_the_flags_names() {
        for d in [
            ComputeElement::F32,
            ComputeElement::Bf16,
            ComputeElement::F16,
        ] {
            let json = serde_json::to_string(&d).unwrap();
            assert_eq!(json, format!("\"{}\"", d.name()));
            assert_eq!(serde_json::from_str::<ComputeElement>(&json).unwrap(), d);
        }
    }
}
