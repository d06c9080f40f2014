//! The mid-block attention's two spellings (today's `to_q`… and the `query`… older
//! checkpoints such as DiT-XL/2's still store) and the 1×1-conv shapes those may carry.

/// Mid-block attention projections: today's name, and the name older checkpoints (among
/// them the DiT-XL/2 releases) still store, which diffusers renames at load time.
pub(super) const ATTENTION_PROJECTIONS: [(&str, &str); 4] = [
    ("to_q", "query"),
    ("to_k", "key"),
    ("to_v", "value"),
    ("to_out.0", "proj_attn"),
];

/// Splits `…attentions.N.<proj>.<weight|bias>` into (`…attentions.N`, proj, param).
fn split_attention_name(name: &str) -> Option<(&str, &str, &str)> {
    let (rest, param) = name.rsplit_once('.')?;
    if param != "weight" && param != "bias" {
        return None;
    }
    let at = rest.find(".attentions.")?;
    let index_start = at + ".attentions.".len();
    let index_len = rest[index_start..].find('.')?;
    let block_end = index_start + index_len;
    if index_len == 0
        || !rest[index_start..block_end]
            .bytes()
            .all(|b| b.is_ascii_digit())
    {
        return None;
    }
    Some((&rest[..block_end], &rest[block_end + 1..], param))
}

/// The legacy name of a current mid-block attention tensor
/// (`….attentions.0.to_q.weight` → `….attentions.0.query.weight`); `None` for any other name.
pub fn legacy_attention_alias(name: &str) -> Option<String> {
    let (block, proj, param) = split_attention_name(name)?;
    let (_, legacy) = ATTENTION_PROJECTIONS
        .iter()
        .find(|(current, _)| *current == proj)?;
    Some(format!("{block}.{legacy}.{param}"))
}

/// The current name of a legacy mid-block attention tensor (inverse of
/// `legacy_attention_alias`), for checking a checkpoint's listing against `tensor_specs`.
pub fn current_attention_name(legacy_name: &str) -> Option<String> {
    let (block, proj, param) = split_attention_name(legacy_name)?;
    let (current, _) = ATTENTION_PROJECTIONS
        .iter()
        .find(|(_, legacy)| *legacy == proj)?;
    Some(format!("{block}.{current}.{param}"))
}

/// Whether a stored shape serves for an expected one. Legacy attention projections may be
/// stored as 1×1 convolutions ([C, C, 1, 1]) where a linear weight ([C, C]) is expected.
pub fn shape_compatible(expected: &[usize], stored: &[usize]) -> bool {
    expected == stored
        || (expected.len() == 2
            && stored.len() == 4
            && stored[..2] == *expected
            && stored[2..] == [1, 1])
}
