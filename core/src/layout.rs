//! Block sharding math: how a block's bytes are packed into a device slot, and which
//! bytes of the mapped checkpoint each rank copies. Pure functions, no I/O.
//!
//! A model streams one or more **groups** of structurally similar blocks (a transformer's
//! blocks, a text encoder's layers, a second expert's blocks). Within a block, tensors are
//! packed by dtype into **regions**: each region is packed back to back (in file order, so
//! neighbouring tensors make one copy), padded to a multiple of `dp × ALIGN`, and split
//! into `dp` equal shards: rank r copies bytes `[r·S, (r+1)·S)` of every region, and one
//! all-gather per region fills in the rest. Every group's blocks pass through the same K
//! slots, so a slot holds one region per dtype of any group, each sized to the largest
//! padded region over all blocks of all groups ([`SlotShape`]): any block fits any slot,
//! and a pass over one group can prefetch the first blocks of the next group's pass.

use std::collections::BTreeMap;

use safetensors::Dtype;

use crate::checkpoint::header::dtype_size;
use crate::checkpoint::Component;
use crate::family::TensorSpec;
use crate::{Error, Result};

/// Shard boundaries are multiples of this many bytes (what DMA engines and NCCL like).
pub const ALIGN: u64 = 256;

/// A contiguous run of checkpoint bytes and where it lands in a slot region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Index into the component's files.
    pub file: usize,
    /// Absolute offset in that file.
    pub src: u64,
    /// Offset within the slot region.
    pub dst: u64,
    pub len: u64,
}

/// One tensor's place in a slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotTensor {
    /// Name relative to the block prefix.
    pub name: String,
    pub shape: Vec<usize>,
    /// Index into the group's [`GroupLayout::dtypes`].
    pub region: usize,
    /// Byte offset within the slot region.
    pub offset: u64,
    pub len: u64,
    /// For an fp8 weight's scale ([`crate::checkpoint::fp8`]), which travels in the
    /// block's F32 region: the weight it scales (relative name).
    pub scales: Option<String>,
}

/// One dtype's bytes of one block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionLayout {
    pub dtype: Dtype,
    /// Bytes of tensor data (before padding).
    pub bytes: u64,
    /// Padded size: `dp × shard`.
    pub padded: u64,
    /// Bytes per rank.
    pub shard: u64,
    /// Source runs, sorted by `dst`, merged where adjacent in the file.
    pub pieces: Vec<Piece>,
}

impl RegionLayout {
    /// The runs rank `rank` copies for its shard, clipped to its byte range, with `dst`
    /// still relative to the start of the region.
    pub fn shard_pieces(&self, rank: usize) -> Vec<Piece> {
        let (lo, hi) = (rank as u64 * self.shard, (rank as u64 + 1) * self.shard);
        self.pieces
            .iter()
            .filter_map(|p| {
                let (s, e) = (p.dst.max(lo), (p.dst + p.len).min(hi));
                (s < e).then(|| Piece {
                    file: p.file,
                    src: p.src + (s - p.dst),
                    dst: s,
                    len: e - s,
                })
            })
            .collect()
    }
}

/// The packed layout of one block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockLayout {
    pub index: usize,
    /// Indexed like [`GroupLayout::dtypes`]; a block without a dtype has an empty region.
    pub regions: Vec<RegionLayout>,
    pub tensors: Vec<SlotTensor>,
}

impl BlockLayout {
    pub fn padded_bytes(&self) -> u64 {
        self.regions.iter().map(|g| g.padded).sum()
    }
    pub fn bytes(&self) -> u64 {
        self.regions.iter().map(|g| g.bytes).sum()
    }
}

/// Every block's layout of one group for a given dp, and the regions that fit them all.
#[derive(Debug, Clone)]
pub struct GroupLayout {
    pub dp: usize,
    /// Dtypes of the regions, in region order.
    pub dtypes: Vec<Dtype>,
    /// Bytes of each region (largest padded region over this group's blocks).
    pub region_capacity: Vec<u64>,
    pub blocks: Vec<BlockLayout>,
}

fn round_up(x: u64, m: u64) -> u64 {
    x.div_ceil(m) * m
}

impl GroupLayout {
    /// Lays out blocks `0..num_blocks` whose tensors are `prefix(i) + spec.name`.
    pub fn new(
        component: &Component,
        specs: &[TensorSpec],
        num_blocks: usize,
        prefix: impl Fn(usize) -> String,
        dp: usize,
    ) -> Result<GroupLayout> {
        if dp == 0 {
            return Err(Error::invalid("dp", "must be at least 1"));
        }
        let mut dtypes: Vec<Dtype> = Vec::new();
        let mut per_block = Vec::with_capacity(num_blocks);
        for i in 0..num_blocks {
            let pre = prefix(i);
            // (dtype) → [(file, src, len, entry index)]; an entry is (relative name,
            // shape, the weight a scale scales).
            let mut by_dtype: BTreeMap<Dtype, Vec<(usize, u64, u64, usize)>> = BTreeMap::new();
            let mut entries: Vec<(String, Vec<usize>, Option<String>)> = Vec::new();
            for spec in specs {
                let name = format!("{pre}{}", spec.name);
                let mut add = |name: &str, entry: (String, Vec<usize>, Option<String>)| {
                    let &(file, ti) = component.index.get(name).ok_or_else(|| {
                        Error::tensor(&component.dir, name, "missing from the checkpoint")
                    })?;
                    let info = &component.files[file].tensors[ti];
                    by_dtype.entry(info.dtype).or_default().push((
                        file,
                        info.offset,
                        info.len,
                        entries.len(),
                    ));
                    entries.push(entry);
                    if !dtypes.contains(&info.dtype) {
                        dtypes.push(info.dtype);
                    }
                    Ok::<_, Error>(info.dtype)
                };
                let dtype = add(&name, (spec.name.clone(), spec.shape.clone(), None))?;
                // An fp8 weight's scale travels with its block (its bytes are the block's).
                if dtype == Dtype::F8_E4M3 {
                    let scale = crate::checkpoint::fp8::scale_of(component, &name)?;
                    let (_, info) = component.get(&scale).expect("checked");
                    let rel = scale[pre.len()..].to_string();
                    add(&scale, (rel, info.shape.clone(), Some(spec.name.clone())))?;
                }
            }
            per_block.push((by_dtype, entries));
        }
        // Widest dtype first keeps every region aligned for its element type.
        dtypes.sort_by_key(|d| std::cmp::Reverse(dtype_size(*d).unwrap_or(1)));
        let unit = dp as u64 * ALIGN;
        let mut blocks = Vec::with_capacity(num_blocks);
        let mut region_capacity = vec![0u64; dtypes.len()];
        for (i, (mut by_dtype, entries)) in per_block.into_iter().enumerate() {
            let mut regions = Vec::with_capacity(dtypes.len());
            let mut tensors = Vec::with_capacity(specs.len());
            for (gi, dtype) in dtypes.iter().enumerate() {
                let mut items = by_dtype.remove(dtype).unwrap_or_default();
                items.sort();
                let mut pieces: Vec<Piece> = Vec::new();
                let mut at = 0u64;
                for (file, src, len, ei) in items {
                    let (name, shape, scales) = entries[ei].clone();
                    tensors.push(SlotTensor {
                        name,
                        shape,
                        region: gi,
                        offset: at,
                        len,
                        scales,
                    });
                    match pieces.last_mut() {
                        Some(p)
                            if p.file == file && p.src + p.len == src && p.dst + p.len == at =>
                        {
                            p.len += len
                        }
                        _ => pieces.push(Piece {
                            file,
                            src,
                            dst: at,
                            len,
                        }),
                    }
                    at += len;
                }
                let padded = round_up(at, unit);
                region_capacity[gi] = region_capacity[gi].max(padded);
                regions.push(RegionLayout {
                    dtype: *dtype,
                    bytes: at,
                    padded,
                    shard: padded / dp as u64,
                    pieces,
                });
            }
            blocks.push(BlockLayout {
                index: i,
                regions,
                tensors,
            });
        }
        Ok(GroupLayout {
            dp,
            dtypes,
            region_capacity,
            blocks,
        })
    }

    /// Bytes of one slot.
    pub fn slot_bytes(&self) -> u64 {
        self.region_capacity.iter().sum()
    }

    /// The largest padded block.
    pub fn largest_padded_block(&self) -> u64 {
        self.blocks
            .iter()
            .map(BlockLayout::padded_bytes)
            .max()
            .unwrap_or(0)
    }
}

/// The regions of one device slot that fits a block of any streamed group: per dtype, the
/// largest padded region over those groups; and where each group's regions land in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotShape {
    pub dtypes: Vec<Dtype>,
    /// Bytes of each slot region.
    pub capacity: Vec<u64>,
    /// Per group, per region of that group: the slot region it uses (empty for a group
    /// that stays resident and never passes through a slot).
    pub region_of: Vec<Vec<usize>>,
}

impl SlotShape {
    /// The slot for the groups that stream: those whose `resident` entry is false (a
    /// missing entry streams).
    pub fn of(groups: &[GroupLayout], resident: &[bool]) -> SlotShape {
        let streams = |i: usize| !resident.get(i).copied().unwrap_or(false);
        let mut dtypes: Vec<Dtype> = Vec::new();
        for g in groups
            .iter()
            .enumerate()
            .filter(|(i, _)| streams(*i))
            .map(|(_, g)| g)
        {
            for d in &g.dtypes {
                if !dtypes.contains(d) {
                    dtypes.push(*d);
                }
            }
        }
        // Widest dtype first keeps every region aligned for its element type.
        dtypes.sort_by_key(|d| std::cmp::Reverse(dtype_size(*d).unwrap_or(1)));
        let mut capacity = vec![0u64; dtypes.len()];
        let region_of = groups
            .iter()
            .enumerate()
            .map(|(i, g)| {
                if !streams(i) {
                    return Vec::new();
                }
                g.dtypes
                    .iter()
                    .zip(&g.region_capacity)
                    .map(|(d, &cap)| {
                        let r = dtypes.iter().position(|x| x == d).expect("collected");
                        capacity[r] = capacity[r].max(cap);
                        r
                    })
                    .collect()
            })
            .collect();
        SlotShape {
            dtypes,
            capacity,
            region_of,
        }
    }

    /// Bytes of one slot.
    pub fn bytes(&self) -> u64 {
        self.capacity.iter().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(pieces: Vec<Piece>, bytes: u64, dp: usize) -> RegionLayout {
        let padded = round_up(bytes, dp as u64 * ALIGN);
        RegionLayout {
            dtype: Dtype::F32,
            bytes,
            padded,
            shard: padded / dp as u64,
            pieces,
        }
    }

    #[test]
    fn shards_cover_every_byte_once() {
        let pieces = vec![
            Piece {
                file: 0,
                src: 100,
                dst: 0,
                len: 1000,
            },
            Piece {
                file: 1,
                src: 8,
                dst: 1000,
                len: 777,
            },
        ];
        for dp in 1..=5 {
            let g = region(pieces.clone(), 1777, dp);
            assert_eq!(g.padded % (dp as u64 * ALIGN), 0);
            let mut covered = vec![0u8; g.padded as usize];
            for r in 0..dp {
                for p in g.shard_pieces(r) {
                    assert!(
                        p.dst >= r as u64 * g.shard && p.dst + p.len <= (r as u64 + 1) * g.shard
                    );
                    // The source offset moves with the destination offset.
                    let orig = pieces
                        .iter()
                        .find(|o| o.dst <= p.dst && p.dst < o.dst + o.len)
                        .unwrap();
                    assert_eq!(p.src - orig.src, p.dst - orig.dst);
                    for b in p.dst..p.dst + p.len {
                        covered[b as usize] += 1;
                    }
                }
            }
            assert!(covered[..1777].iter().all(|&c| c == 1), "dp={dp}");
            assert!(covered[1777..].iter().all(|&c| c == 0));
        }
    }
}
