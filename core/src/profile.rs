//! The checkpoint profile the node agent publishes: everything a planner needs to size a
//! deployment, computed from headers and configs only (no weight bytes are read), so it
//! costs milliseconds on a checkpoint of any size. A module of its own above the family,
//! layout, memory and timing models it is built from, which themselves read checkpoints:
//! inside `checkpoint` it would close a loop through them.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::checkpoint::ActivationCost;
use crate::family::FamilyCheckpoint;
use crate::layout::GroupLayout;
use crate::memory::{self, GroupBytes, Placement};
use crate::{Error, Result};

/// One component's share of the checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct ComponentProfile {
    /// Its folder in the pipeline (`text_encoder`, `transformer`, `transformer_2`, `vae`).
    pub name: String,
    pub bytes: u64,
    /// Blocks streamed from this component (0: it stays resident or is the decoder).
    pub blocks: usize,
    pub largest_block_bytes: u64,
}

/// What a checkpoint costs to hold and to run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct Profile {
    pub family: String,
    /// Every weight byte in the folder (all components).
    pub total_bytes: u64,
    /// Bytes of the transformer components (both experts of a two-expert model).
    pub transformer_bytes: u64,
    pub vae_bytes: u64,
    /// Each component with weights, in pipeline order.
    #[serde(default)]
    pub components: Vec<ComponentProfile>,
    pub files: usize,
    /// Streamed blocks over every group (text encoder, transformers).
    pub blocks: usize,
    /// Bytes of each block, group after group.
    pub block_bytes: Vec<u64>,
    pub largest_block_bytes: u64,
    /// Per dtype, the most bytes any block of any group holds of it (sizes a slot for
    /// any dp: every group streams through the same slots).
    pub max_block_bytes_by_dtype: BTreeMap<String, u64>,
    /// Bytes outside the blocks that stay resident on the device (prologues and
    /// epilogues; not the decoder, which is `vae_bytes`).
    pub outside_block_bytes: u64,
    pub bytes_by_dtype: BTreeMap<String, u64>,
    /// The image size the model was trained at.
    pub native_width: u64,
    pub native_height: u64,
    pub activation: ActivationCost,
    /// Bytes of the VAE decoder's weights, which every rank that decodes keeps on its
    /// device (the rest of the VAE, its encoder, is never loaded).
    #[serde(default)]
    pub decoder_bytes: u64,
    /// What the decoder holds at its peak as a function of how a decode is split
    /// ([`crate::decode::DecodeCost`]); absent for a decoder the family does not describe
    /// (and in profiles of agents that predate it), which is charged the activation
    /// formula's reservation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode: Option<crate::decode::DecodeCost>,
    /// Each streamed group's block bytes by dtype (text encoder, transformers), which the
    /// memory model lays out for any dp ([`crate::memory`]).
    #[serde(default)]
    pub groups: Vec<GroupBytes>,
    /// The largest request the model itself can run (its position tables): the planner
    /// refuses a workload beyond it, as the engine refuses such bounds at start. Empty
    /// (no limit but memory) in profiles of agents that predate it.
    #[serde(default)]
    pub limits: crate::bounds::ModelLimits,
    /// What one block of each of `groups` computes (same order), as the family declares
    /// it: the step-time model's input ([`crate::timing`]). Empty in profiles of agents
    /// that predate it ([`Self::group_compute`] then derives it from the bytes).
    #[serde(default)]
    pub compute: Vec<crate::family::GroupCompute>,
    /// The dtypes the family's blocks compute in ([`crate::compute_dtype`]), which with
    /// the backend and `groups`' dtypes decide the element the activation term is
    /// charged in ([`Self::compute_element`]). f32 only in profiles of agents that
    /// predate it (what they were always charged).
    #[serde(default = "crate::compute_dtype::f32_only")]
    pub compute_dtypes: Vec<crate::compute_dtype::ComputeElement>,
}

impl Profile {
    /// Profiles a pipeline folder of `family` opened from its headers and configs (the
    /// engine's registry opens it: `layerwise_engine::families::profile`).
    pub fn of(family: &str, ck: &dyn FamilyCheckpoint) -> Result<Profile> {
        let mut by_dtype: BTreeMap<String, u64> = BTreeMap::new();
        let mut components = Vec::new();
        let (mut block_bytes, mut max_by_dtype) = (Vec::new(), BTreeMap::<String, u64>::new());
        let groups = ck.groups();
        for (name, c) in ck.components() {
            for h in &c.files {
                for t in &h.tensors {
                    *by_dtype.entry(format!("{:?}", t.dtype)).or_default() += t.len;
                }
            }
            let (mut blocks, mut largest) = (0, 0);
            for (_, g) in groups.iter().filter(|(comp, _)| *comp == name) {
                let mut bytes = vec![0u64; g.count];
                let mut dtypes: Vec<BTreeMap<String, u64>> = vec![BTreeMap::new(); g.count];
                for h in &c.files {
                    for t in &h.tensors {
                        if let Some(b) = g.block_of(&t.name).filter(|b| *b < g.count) {
                            bytes[b] += t.len;
                            *dtypes[b].entry(format!("{:?}", t.dtype)).or_default() += t.len;
                        }
                    }
                }
                for m in &dtypes {
                    for (k, v) in m {
                        let e = max_by_dtype.entry(k.clone()).or_default();
                        *e = (*e).max(*v);
                    }
                }
                blocks += g.count;
                largest = bytes.iter().copied().max().unwrap_or(0).max(largest);
                block_bytes.extend(bytes);
            }
            components.push(ComponentProfile {
                name: name.to_string(),
                bytes: c.tensor_bytes(),
                blocks,
                largest_block_bytes: largest,
            });
        }
        let sum = |pred: &dyn Fn(&str) -> bool| {
            components
                .iter()
                .filter(|c| pred(&c.name))
                .map(|c| c.bytes)
                .sum()
        };
        // Each group's bytes as the engine lays it out: one code path for both.
        let mut group_bytes = Vec::with_capacity(groups.len());
        for (name, g) in &groups {
            let (_, c) = ck
                .components()
                .into_iter()
                .find(|(n, _)| n == name)
                .ok_or_else(|| Error::invalid("profile", format!("no component {name}")))?;
            let layout = GroupLayout::new(c, &g.block, g.count, |i| g.block_prefix(i), 1)?;
            group_bytes.push(GroupBytes::of(name, &layout));
        }
        let (native_width, native_height) = ck.native_size();
        Ok(Profile {
            family: family.into(),
            total_bytes: ck.total_bytes(),
            transformer_bytes: sum(&|n| n.starts_with("transformer")),
            vae_bytes: sum(&|n| n == "vae"),
            files: ck.components().iter().map(|(_, c)| c.files.len()).sum(),
            blocks: block_bytes.len(),
            largest_block_bytes: block_bytes.iter().copied().max().unwrap_or(0),
            block_bytes,
            max_block_bytes_by_dtype: max_by_dtype,
            outside_block_bytes: ck.resident_device_bytes(),
            bytes_by_dtype: by_dtype,
            native_width: native_width as u64,
            native_height: native_height as u64,
            activation: ck.activation_cost(),
            components,
            decoder_bytes: ck.decoder_bytes(),
            decode: ck.decode_cost(),
            groups: group_bytes,
            limits: ck.limits(),
            compute: ck.group_compute(),
            compute_dtypes: ck.compute_dtypes().to_vec(),
        })
    }

    /// The element a rank on `backend` computes this model's blocks in under
    /// `--compute-dtype auto`: the engine's own decision
    /// ([`crate::compute_dtype::ComputeElement::auto`]).
    pub fn compute_element(
        &self,
        backend: crate::compute_dtype::Backend,
    ) -> crate::compute_dtype::ComputeElement {
        crate::compute_dtype::ComputeElement::auto(backend, &self.groups, &self.compute_dtypes)
    }

    /// What one block of each group computes: the family's declaration, or where the
    /// profile lacks one (an older agent's), the default derived from the groups' bytes
    /// ([`crate::timing::default_compute`]).
    pub fn group_compute(&self) -> Vec<crate::family::GroupCompute> {
        if self.compute.len() == self.groups.len() {
            self.compute.clone()
        } else {
            crate::timing::default_compute(&self.groups)
        }
    }

    /// Bytes of one device slot when blocks are split `dp` ways (padding included) and
    /// every group streams: the memory model's slot.
    pub fn slot_bytes(&self, dp: u64) -> u64 {
        let p = Placement::new(crate::Strategy::Offload, dp, 1, self.groups.len());
        memory::slot_bytes(&self.groups, &p)
    }
}
