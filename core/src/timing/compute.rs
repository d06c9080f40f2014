//! What each group computes when the profile does not say: a profile written by an agent
//! that predates the families' declaration ([`GroupCompute`]) is timed with a count of its
//! weights from their bytes.

use crate::family::{experts, GroupCompute};
use crate::memory::GroupBytes;

/// [`GroupCompute::of_params`] for each of `groups`, their weights counted from their bytes
/// by dtype: what a profile whose agent predates the families' declaration is timed with.
pub fn default_compute(groups: &[GroupBytes]) -> Vec<GroupCompute> {
    let experts = experts(groups.iter().map(|g| g.component.as_str()));
    groups
        .iter()
        .map(|g| {
            let blocks = g.blocks().max(1) as u64;
            let params: u64 = g
                .blocks_by_dtype
                .iter()
                .map(|(d, b)| b.iter().sum::<u64>() / dtype_bytes(d))
                .sum();
            GroupCompute::of_params(&g.component, params / blocks, experts)
        })
        .collect()
}

/// Bytes of one element of a safetensors dtype named `d` (1 for the 8-bit ones).
fn dtype_bytes(d: &str) -> u64 {
    match d {
        "F64" | "I64" | "U64" => 8,
        "F32" | "I32" | "U32" => 4,
        "F16" | "BF16" | "I16" | "U16" => 2,
        _ => 1,
    }
}
