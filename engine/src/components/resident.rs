//! Loading one component's share of a family's resident tensors. Families with several
//! streamed components (Wan, Qwen-Image) list what every rank keeps on its device as
//! (component, tensor name) pairs; each component's tensors load from its own mapping.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};

use crate::checkpoint::Mapped;
use crate::execution::weights;
use crate::Result;

/// The tensors of `names` that belong to `component`, read from `mapped` onto `device`.
pub fn load_component(
    mapped: &Mapped,
    names: &[(&str, String)],
    component: &str,
    device: &Device,
    dtype: DType,
) -> Result<HashMap<String, Tensor>> {
    let own = names
        .iter()
        .filter(|(c, _)| *c == component)
        .map(|(_, n)| n.clone());
    weights::load(mapped, own, device, dtype)
}
