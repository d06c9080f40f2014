//! The one memory model: how many device bytes a rank and how many host bytes a pod need
//! for a strategy, from the bytes of the streamed groups' blocks. The engine sizes its
//! allocations and checks its budget at start with these functions (over the layouts it
//! builds from the checkpoint), and the planner sizes a plan with them (over the same
//! figures carried in the node's [`crate::profile::Profile`]); built without the
//! compute runtime, so the agent, the crds and the operator use exactly this code.
//!
//! Device bytes of one rank, term by term (each is what the engine charges to its device
//! budget, see `execution::pipeline`):
//! - **block weights**: whole padded blocks of every resident group (all groups under
//!   `resident`; under a streaming strategy the components the plan keeps resident), and
//!   under `sharded` this rank's 1/dp of every padded block of the streamed groups;
//! - **slots**: K slots, each holding per dtype the largest padded region of any streamed
//!   group;
//! - **resident weights**: the prologues and epilogues outside the blocks, and the
//!   decoder;
//! - **activations**: the largest allowed request's peak
//!   ([`crate::checkpoint::ActivationCost::checked_bytes`]);
//! - **overhead**: the runtime's own (context, kernels, allocator slack), a fixed
//!   allowance;
//! - **decoder**: where `serve` decodes on the ranks' devices ([`crate::decode`]), the
//!   decoder's weights and the peak of decoding the largest allowed output, which runs
//!   beside the rank's passes; 0 where it decodes on the host.
//!
//! A region of a block is padded to a multiple of dp × [`ALIGN`] so it splits into dp
//! equal, aligned shards ([`crate::layout`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::layout::{GroupLayout, ALIGN};
use crate::Strategy;

/// One streamed group's bytes: per dtype, the unpadded bytes of each block. Enough to lay
/// the group out for any dp.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct GroupBytes {
    /// The pipeline component the group belongs to (`text_encoder`, `transformer`, ...).
    pub component: String,
    /// Per dtype (safetensors' name, e.g. `BF16`), each block's bytes of that dtype.
    pub blocks_by_dtype: BTreeMap<String, Vec<u64>>,
}

fn padded(bytes: u64, dp: u64) -> u64 {
    let unit = dp.max(1) * ALIGN;
    bytes.div_ceil(unit) * unit
}

impl GroupBytes {
    /// The bytes of `layout`'s blocks (its regions before padding).
    pub fn of(component: &str, layout: &GroupLayout) -> GroupBytes {
        let mut blocks_by_dtype = BTreeMap::new();
        for (r, d) in layout.dtypes.iter().enumerate() {
            let per_block = layout.blocks.iter().map(|b| b.regions[r].bytes).collect();
            blocks_by_dtype.insert(format!("{d:?}"), per_block);
        }
        GroupBytes {
            component: component.to_string(),
            blocks_by_dtype,
        }
    }

    /// Number of blocks.
    pub fn blocks(&self) -> usize {
        self.blocks_by_dtype
            .values()
            .map(Vec::len)
            .max()
            .unwrap_or(0)
    }

    /// Unpadded bytes of every block.
    pub fn bytes(&self) -> u64 {
        self.blocks_by_dtype.values().flatten().sum()
    }

    /// Per dtype, the largest padded region over the blocks (one slot region) for `dp`.
    pub fn region_capacity(&self, dp: u64) -> BTreeMap<&str, u64> {
        self.blocks_by_dtype
            .iter()
            .map(|(d, b)| {
                let cap = b.iter().map(|&x| padded(x, dp)).max().unwrap_or(0);
                (d.as_str(), cap)
            })
            .collect()
    }

    /// The blocks `kept` marks, whole and padded for `dp`: what a rank keeps of them.
    pub fn kept_bytes(&self, dp: u64, kept: &[bool]) -> u64 {
        self.blocks_by_dtype
            .values()
            .flat_map(|b| b.iter().enumerate())
            .filter(|(i, _)| kept.get(*i).copied().unwrap_or(false))
            .map(|(_, &x)| padded(x, dp))
            .sum()
    }

    /// Unpadded bytes of the blocks `kept` does not mark: what streams.
    pub fn streamed_bytes(&self, kept: &[bool]) -> u64 {
        self.blocks_by_dtype
            .values()
            .flat_map(|b| b.iter().enumerate())
            .filter(|(i, _)| !kept.get(*i).copied().unwrap_or(false))
            .map(|(_, &x)| x)
            .sum()
    }

    /// One rank's shard store under `sharded`: 1/dp of one slot region for each of
    /// `streamed` blocks.
    pub fn shard_store_bytes(&self, dp: u64, streamed: u64) -> u64 {
        self.region_capacity(dp)
            .values()
            .map(|cap| cap / dp.max(1) * streamed)
            .sum()
    }
}

/// Every dtype any block of `groups` holds (safetensors' names): what
/// [`crate::compute_dtype::ComputeElement::auto`] reads of a checkpoint.
pub fn stored_dtypes(groups: &[GroupBytes]) -> impl Iterator<Item = &str> {
    groups
        .iter()
        .flat_map(|g| g.blocks_by_dtype.keys().map(String::as_str))
}

/// Which of `blocks` blocks stay on the device when `n` of them do: spread evenly, each
/// stride starting with a kept block (block b when ⌊(L−b)·n/L⌋ > ⌊(L−b−1)·n/L⌋), so the
/// copies that remain are spaced evenly between the computes and the first of a pass has
/// a kept block's compute to hide behind even when nothing was prefetched (a request's
/// first pass). All of them when `n` ≥ `blocks`.
pub fn resident_block_mask(blocks: usize, n: u64) -> Vec<bool> {
    let (l, n) = (blocks as u64, n.min(blocks as u64));
    (0..l)
        .map(|b| (l - b) * n / l > (l - b - 1) * n / l)
        .collect()
}

/// Where a plan puts the weights: the strategy, dp, K, and which groups stay whole on the
/// device although the strategy streams (a component the plan keeps resident).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub strategy: Strategy,
    /// Ranks the weights shard over: every rank of the process, `dp` groups × `sp` ranks
    /// each ([`crate::topology::Topology::ranks`]).
    pub dp: u64,
    /// K; ignored when nothing streams.
    pub slots: u64,
    /// Per group (in the order of the groups), whether it stays whole on the device.
    /// Every group is resident under `resident` whatever this says.
    pub resident: Vec<bool>,
    /// Blocks of every other group that stay on the device too
    /// ([`resident_block_mask`]); a group with no more blocks than this is whole.
    pub resident_blocks: u64,
    /// Per group (in the order of the groups), blocks kept in place of
    /// `resident_blocks`; `None` (or a group past the end) takes `resident_blocks`.
    pub resident_blocks_by_group: Vec<Option<u64>>,
}

impl Placement {
    /// `strategy` with nothing kept resident beyond what the strategy keeps.
    pub fn new(strategy: Strategy, dp: u64, slots: u64, groups: usize) -> Placement {
        Placement {
            strategy,
            dp,
            slots,
            resident: vec![false; groups],
            resident_blocks: 0,
            resident_blocks_by_group: Vec::new(),
        }
    }

    /// Blocks of group `g` kept on the device when it is not whole: its own count where
    /// one is given, else `resident_blocks`.
    pub fn blocks_kept(&self, g: usize) -> u64 {
        self.resident_blocks_by_group
            .get(g)
            .copied()
            .flatten()
            .unwrap_or(self.resident_blocks)
    }

    /// Whether group `g` of `blocks` blocks stays whole on the device.
    pub fn is_resident(&self, g: usize, blocks: usize) -> bool {
        self.strategy == Strategy::Resident
            || self.resident.get(g).copied().unwrap_or(false)
            || self.blocks_kept(g) >= blocks as u64
    }

    /// Which blocks of group `g` (of `blocks` blocks) stay on the device.
    pub fn kept(&self, g: usize, blocks: usize) -> Vec<bool> {
        if self.is_resident(g, blocks) {
            vec![true; blocks]
        } else {
            resident_block_mask(blocks, self.blocks_kept(g))
        }
    }

    /// Whether any block of `groups` streams through the slots.
    pub fn streams(&self, groups: &[GroupBytes]) -> bool {
        self.strategy.streams()
            && groups
                .iter()
                .enumerate()
                .any(|(g, group)| !self.is_resident(g, group.blocks()))
    }

    /// Keeps `n` blocks of each group of every component `by_component` names (the rest
    /// keep `resident_blocks`).
    pub fn with_component_blocks(
        mut self,
        groups: &[GroupBytes],
        by_component: &BTreeMap<String, u64>,
    ) -> Self {
        self.resident_blocks_by_group = groups
            .iter()
            .map(|g| by_component.get(&g.component).copied())
            .collect();
        self
    }

    /// Marks the groups of `components` resident.
    pub fn with_resident_components(
        mut self,
        groups: &[GroupBytes],
        components: &[String],
    ) -> Self {
        self.resident = groups
            .iter()
            .map(|g| components.contains(&g.component))
            .collect();
        self
    }
}

/// `component=n` pairs joined by commas (`transformer=20,text_encoder=0`): blocks kept of
/// each group of the components named, in place of the one count for every group. The
/// planner writes it ([`format_component_blocks`]) and the engine's
/// `--resident-blocks-by-component` reads it, so both go through this code.
pub fn parse_component_blocks(s: &str) -> crate::Result<BTreeMap<String, u64>> {
    let mut out = BTreeMap::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let bad = || {
            crate::Error::invalid(
                "resident-blocks-by-component",
                format!("`{part}`: expected component=blocks, e.g. transformer=20"),
            )
        };
        let (c, n) = part.split_once('=').ok_or_else(bad)?;
        let (c, n) = (c.trim(), n.trim().parse::<u64>().map_err(|_| bad())?);
        if c.is_empty() {
            return Err(bad());
        }
        if out.insert(c.to_string(), n).is_some() {
            return Err(crate::Error::invalid(
                "resident-blocks-by-component",
                format!("`{c}` is named twice"),
            ));
        }
    }
    Ok(out)
}

/// What [`parse_component_blocks`] reads back as `counts`.
pub fn format_component_blocks(counts: &BTreeMap<String, u64>) -> String {
    counts
        .iter()
        .map(|(c, n)| format!("{c}={n}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// Device bytes of one rank by purpose (see the module doc for each term).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct DeviceBytes {
    pub block_weights: u64,
    pub slots: u64,
    pub resident_weights: u64,
    pub activations: u64,
    pub overhead: u64,
    /// The decoder beside the ranks: its weights and its decode peak
    /// ([`crate::decode::DecoderBytes::total`]).
    pub decoder: u64,
}

impl DeviceBytes {
    /// These bytes with a decoder of `d` beside the rank.
    pub fn with_decoder(self, d: crate::decode::DecoderBytes) -> DeviceBytes {
        DeviceBytes {
            decoder: d.total(),
            ..self
        }
    }

    /// Everything the rank allocates for weights (what its device budget is charged; the
    /// decoder beside it is not the rank's).
    pub fn weights(&self) -> u64 {
        [self.block_weights, self.slots, self.resident_weights]
            .into_iter()
            .fold(0u64, u64::saturating_add)
    }

    pub fn total(&self) -> u64 {
        [
            self.weights(),
            self.activations,
            self.overhead,
            self.decoder,
        ]
        .into_iter()
        .fold(0u64, u64::saturating_add)
    }
}

/// Bytes of one slot for the groups that stream under `p`: per dtype, the largest padded
/// region of any of them.
pub fn slot_bytes(groups: &[GroupBytes], p: &Placement) -> u64 {
    let mut cap: BTreeMap<&str, u64> = BTreeMap::new();
    for (g, group) in groups.iter().enumerate() {
        if p.is_resident(g, group.blocks()) {
            continue;
        }
        for (d, c) in group.region_capacity(p.dp) {
            let e = cap.entry(d).or_default();
            *e = (*e).max(c);
        }
    }
    cap.values().sum()
}

/// Device bytes one rank needs under `p`: the groups' blocks as placed, `outside` bytes
/// of resident prologues, epilogues and decoder, `activations` for the largest request
/// and `overhead` for the runtime.
pub fn device_bytes(
    groups: &[GroupBytes],
    p: &Placement,
    outside: u64,
    activations: u64,
    overhead: u64,
) -> DeviceBytes {
    let block_weights = groups
        .iter()
        .enumerate()
        .map(|(g, group)| {
            let kept = p.kept(g, group.blocks());
            let streamed = kept.iter().filter(|k| !**k).count() as u64;
            let shards = if p.strategy == Strategy::Sharded {
                group.shard_store_bytes(p.dp, streamed)
            } else {
                0
            };
            group.kept_bytes(p.dp, &kept).saturating_add(shards)
        })
        .fold(0u64, u64::saturating_add);
    let slots = if p.streams(groups) {
        p.slots.saturating_mul(slot_bytes(groups, p))
    } else {
        0
    };
    DeviceBytes {
        block_weights,
        slots,
        resident_weights: outside,
        activations,
        overhead,
        decoder: 0,
    }
}

/// Buffers in a rank's staging ring: one being copied to the device, one being filled,
/// one filled ahead. The engine's default (`EngineOptions::staging_buffers`) and the
/// planner's figure.
pub const STAGING_BUFFERS: u64 = 3;

/// Bytes of one staging buffer: the largest unit a rank copies from the host at once,
/// one block's worth of what it streams (a whole slot under `offload`, its 1/dp shard of
/// one under `offload-sharded`). 0 where nothing streams from the host.
pub fn staging_buffer_bytes(groups: &[GroupBytes], p: &Placement) -> u64 {
    if !p.streams(groups) {
        return 0;
    }
    match p.strategy {
        Strategy::Resident | Strategy::Sharded => 0,
        Strategy::Offload => slot_bytes(groups, p),
        // Every dtype's slot region is a multiple of dp × ALIGN, so this is exact.
        Strategy::OffloadSharded => slot_bytes(groups, p) / p.dp.max(1),
    }
}

/// Page-locked host bytes of one rank's staging ring of `buffers` buffers.
pub fn staging_ring_bytes(groups: &[GroupBytes], p: &Placement, buffers: u64) -> u64 {
    staging_buffer_bytes(groups, p).saturating_mul(buffers)
}

/// Page-locked host bytes a pod holds when the device cannot register the mapping and the
/// engine stages through rings instead: dp rings of [`STAGING_BUFFERS`] buffers, whatever
/// the model's depth. `resident` and `sharded` copy once at start and pin nothing.
pub fn pinned_host_bytes(groups: &[GroupBytes], p: &Placement) -> u64 {
    staging_ring_bytes(groups, p, STAGING_BUFFERS).saturating_mul(p.dp.max(1))
}

/// Host bytes one pod needs of its own: the staging rings and `overhead` for the process.
/// The model's mapping is page cache, one copy per node that every pod there shares
/// ([`node_host_bytes`]).
pub fn pod_host_bytes(groups: &[GroupBytes], p: &Placement, overhead: u64) -> u64 {
    pinned_host_bytes(groups, p).saturating_add(overhead)
}

/// Host bytes a node needs for `pods` pods of one model: one page-cache copy of its
/// `checkpoint_bytes`, however many pods map it, and each pod's own bytes.
pub fn node_host_bytes(checkpoint_bytes: u64, pod: u64, pods: u64) -> u64 {
    checkpoint_bytes.saturating_add(pod.saturating_mul(pods))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(component: &str, f32s: &[u64], bf16s: &[u64]) -> GroupBytes {
        let mut m = BTreeMap::new();
        m.insert("F32".to_string(), f32s.to_vec());
        m.insert("BF16".to_string(), bf16s.to_vec());
        GroupBytes {
            component: component.into(),
            blocks_by_dtype: m,
        }
    }

    #[test]
    fn counts_by_component_read_back_what_is_written() {
        let m = parse_component_blocks(" transformer=20, text_encoder=0").unwrap();
        assert_eq!(m.len(), 2);
        assert_eq!(
            parse_component_blocks(&format_component_blocks(&m)).unwrap(),
            m
        );
        assert!(parse_component_blocks("").unwrap().is_empty());
        for bad in ["transformer", "transformer=x", "=3", "a=1,a=2"] {
            let e = parse_component_blocks(bad).unwrap_err().to_string();
            assert!(e.contains("resident-blocks-by-component"), "{e}");
        }
        // Per group: the named components' own count, the others the one for every group.
        let groups = vec![
            group("text_encoder", &[1, 1], &[1, 1]),
            group("transformer", &[1, 1, 1], &[1, 1, 1]),
        ];
        let p = Placement {
            resident_blocks: 1,
            ..Placement::new(Strategy::Offload, 1, 2, 2)
        }
        .with_component_blocks(&groups, &parse_component_blocks("transformer=2").unwrap());
        assert_eq!((p.blocks_kept(0), p.blocks_kept(1)), (1, 2));
        assert_eq!(p.kept(1, 3), vec![true, true, false]);
        assert!(p.is_resident(0, 1));
    }

    #[test]
    fn kept_blocks_are_spread_evenly() {
        let mask = |l, n| {
            resident_block_mask(l, n)
                .iter()
                .map(|k| if *k { 'k' } else { '.' })
                .collect::<String>()
        };
        assert_eq!(mask(10, 0), "..........");
        assert_eq!(mask(10, 5), "k.k.k.k.k.");
        assert_eq!(mask(10, 2), "k....k....");
        assert_eq!(mask(6, 3), "k.k.k.");
        assert_eq!(mask(12, 11), "kkkkkkkkkkk.");
        assert_eq!(mask(12, 1), "k...........");
        assert_eq!(mask(4, 9), "kkkk");
        for l in 1..40 {
            for n in 0..=l {
                let m = resident_block_mask(l, n as u64);
                assert_eq!(m.iter().filter(|k| **k).count(), n, "{l} {n}");
            }
        }
    }

    #[test]
    fn kept_blocks_move_from_slots_to_block_weights() {
        let tr = group(
            "transformer",
            &[300, 300, 300, 300],
            &[5000, 5000, 5000, 5000],
        );
        let groups = vec![tr];
        let p = |n| Placement {
            resident_blocks: n,
            ..Placement::new(Strategy::OffloadSharded, 2, 2, 1)
        };
        let none = device_bytes(&groups, &p(0), 0, 0, 0);
        let two = device_bytes(&groups, &p(2), 0, 0, 0);
        assert_eq!(none.block_weights, 0);
        assert_eq!(two.block_weights, 2 * (512 + 5120));
        assert_eq!(two.slots, none.slots);
        // The rings do not grow or shrink with the blocks kept: one shard per buffer.
        assert_eq!(pinned_host_bytes(&groups, &p(2)), 2 * 3 * (512 + 5120) / 2);
        // Every block kept streams nothing: no slots.
        assert!(!p(4).streams(&groups));
        assert_eq!(device_bytes(&groups, &p(4), 0, 0, 0).slots, 0);
        // Sharded: the store holds only the streamed blocks' shards.
        let sharded = Placement {
            resident_blocks: 1,
            ..Placement::new(Strategy::Sharded, 2, 2, 1)
        };
        let b = device_bytes(&groups, &sharded, 0, 0, 0);
        assert_eq!(b.block_weights, (512 + 5120) + 3 * (256 + 2560));
    }

    #[test]
    fn terms_by_strategy() {
        let te = group("text_encoder", &[100, 100], &[1000, 1000]);
        let tr = group("transformer", &[300, 200, 300], &[5000, 5000, 4000]);
        let groups = vec![te, tr];
        let dp = 2;
        // Padding unit 512: 100 → 512, 1000 → 1024, 300/200 → 512, 5000 → 5120, 4000 → 4096.
        let all = |s| Placement::new(s, dp, 3, 2);
        let resident = device_bytes(&groups, &all(Strategy::Resident), 7, 11, 13);
        assert_eq!(
            resident.block_weights,
            2 * (512 + 1024) + 3 * 512 + 2 * 5120 + 4096
        );
        assert_eq!(resident.slots, 0);
        assert_eq!(resident.total(), resident.block_weights + 7 + 11 + 13);
        // A decoder beside the rank adds its weights and peak to the total, not to what
        // the rank charges for weights.
        let d = crate::decode::DecoderBytes {
            weights: 17,
            peak: 19,
        };
        let decoding = resident.with_decoder(d);
        assert_eq!(decoding.weights(), resident.weights());
        assert_eq!(decoding.total(), resident.total() + 17 + 19);
        // One slot: per dtype the largest padded region of any group.
        let slot = 512 + 5120;
        let offload = device_bytes(&groups, &all(Strategy::Offload), 0, 0, 0);
        assert_eq!((offload.block_weights, offload.slots), (0, 3 * slot));
        let sharded = device_bytes(&groups, &all(Strategy::Sharded), 0, 0, 0);
        assert_eq!(
            sharded.block_weights,
            2 * (512 / 2 + 1024 / 2) + 3 * (512 / 2 + 5120 / 2)
        );
        // The text encoder kept whole: slots shrink to the transformer's regions.
        let p = all(Strategy::OffloadSharded)
            .with_resident_components(&groups, &["text_encoder".to_string()]);
        let mixed = device_bytes(&groups, &p, 0, 0, 0);
        assert_eq!(mixed.block_weights, 2 * (512 + 1024));
        assert_eq!(mixed.slots, 3 * (512 + 5120));
        // Per rank a ring of 3 shards of one slot; per pod dp rings.
        assert_eq!(staging_buffer_bytes(&groups, &p), (512 + 5120) / 2);
        assert_eq!(pinned_host_bytes(&groups, &p), 2 * 3 * (512 + 5120) / 2);
        assert_eq!(
            pinned_host_bytes(&groups, &all(Strategy::Offload)),
            2 * 3 * slot
        );
        assert_eq!(pinned_host_bytes(&groups, &all(Strategy::Sharded)), 0);
        assert_eq!(pinned_host_bytes(&groups, &all(Strategy::Resident)), 0);
        // Everything resident under a streaming strategy: no slots.
        let every = all(Strategy::Offload).with_resident_components(
            &groups,
            &["text_encoder".to_string(), "transformer".to_string()],
        );
        assert!(!every.streams(&groups));
        assert_eq!(device_bytes(&groups, &every, 0, 0, 0).slots, 0);
        assert_eq!(pinned_host_bytes(&groups, &every), 0);
    }

    #[test]
    fn the_staging_ring_does_not_grow_with_depth() {
        // 8 and 32 blocks of the same shape: the same ring, where a pinned copy of what
        // streams would be four times larger.
        let deep = |l: usize| group("transformer", &vec![300; l], &vec![5000; l]);
        for dp in [1u64, 2, 4] {
            let p = Placement::new(Strategy::OffloadSharded, dp, 2, 1);
            let (g8, g32) = (vec![deep(8)], vec![deep(32)]);
            let ring = pinned_host_bytes(&g8, &p);
            assert_eq!(ring, pinned_host_bytes(&g32, &p));
            assert_eq!(ring, STAGING_BUFFERS * slot_bytes(&g8, &p));
            assert!(ring < g32[0].bytes(), "{ring} vs {}", g32[0].bytes());
            assert_eq!(staging_ring_bytes(&g8, &p, 2), 2 * slot_bytes(&g8, &p) / dp);
        }
    }
}
