//! Checking a component's tensors against what its config implies: every expected name
//! present with its shape and a float dtype, nothing unexpected beside them. A linear
//! weight may be stored fp8 with its scale beside it ([`super::fp8`]).

use std::collections::BTreeSet;

use safetensors::Dtype;

use super::{component::Component, fp8};
use crate::family::TensorSpec;
use crate::{Error, Result};

/// Dtypes the engine computes with (converted to f32 on the way into the math).
pub const WEIGHT_DTYPES: [Dtype; 3] = [Dtype::F32, Dtype::F16, Dtype::BF16];

/// Checks that `c` holds exactly `specs` (names, shapes, float dtypes). `alias` maps an
/// expected name to an older spelling that is accepted in its place.
pub fn check_tensors(
    c: &Component,
    specs: &[TensorSpec],
    alias: impl Fn(&str) -> Option<String>,
) -> Result<()> {
    let mut seen = BTreeSet::new();
    for spec in specs {
        let found = c
            .get(&spec.name)
            .map(|x| (spec.name.clone(), x))
            .or_else(|| alias(&spec.name).and_then(|a| c.get(&a).map(|x| (a, x))));
        let Some((name, (h, info))) = found else {
            return Err(Error::tensor(
                c.path_of(&spec.name),
                &spec.name,
                format!("missing (expected shape {:?})", spec.shape),
            ));
        };
        // Legacy 1×1-conv spellings of linear weights carry trailing unit dimensions.
        let squeezed: Vec<usize> = if name != spec.name {
            let mut s = info.shape.clone();
            while s.len() > spec.shape.len() && s.last() == Some(&1) {
                s.pop();
            }
            s
        } else {
            info.shape.clone()
        };
        if squeezed != spec.shape {
            return Err(Error::tensor(
                &h.path,
                &name,
                format!(
                    "shape {:?} disagrees with the config, which implies {:?}",
                    info.shape, spec.shape
                ),
            ));
        }
        if info.dtype == Dtype::F8_E4M3 {
            if !fp8::is_linear(&spec.name, &spec.shape) {
                return Err(Error::tensor(
                    &h.path,
                    &name,
                    "stored F8_E4M3 but is not a linear layer's weight; fp8 is supported on 2-D `.weight` tensors of linear layers only",
                ));
            }
            seen.insert(fp8::scale_of(c, &name)?);
        } else if !WEIGHT_DTYPES.contains(&info.dtype) {
            return Err(Error::tensor(
                &h.path,
                &name,
                format!(
                    "dtype {:?} is not a float weight dtype (F32, F16, BF16; F8_E4M3 with a scale on linear weights)",
                    info.dtype
                ),
            ));
        }
        seen.insert(name);
    }
    if let Some(extra) = c.index.keys().find(|n| !seen.contains(*n)) {
        if fp8::is_scale_name(extra) {
            return Err(Error::tensor(
                c.path_of(extra),
                extra,
                "a scale beside a weight that is not stored F8_E4M3 (or not expected)",
            ));
        }
        return Err(Error::tensor(
            c.path_of(extra),
            extra,
            "unexpected tensor: the config implies no such weight",
        ));
    }
    Ok(())
}
