//! Block sharding math: how a block's bytes are packed into a device slot, and which
//! bytes of the mapped checkpoint each rank copies. Pure functions, no I/O.
//!
//! A block's tensors are grouped by dtype. Each group is packed back to back (in file
//! order, so neighbouring tensors make one copy), padded to a multiple of `dp × ALIGN`,
//! and split into `dp` equal shards: rank r copies bytes `[r·S, (r+1)·S)` of every group,
//! and one all-gather per group fills in the rest. A slot holds one region per dtype,
//! sized to the largest padded group over all blocks, so any block fits any slot.

use std::collections::BTreeMap;

use safetensors::Dtype;

use crate::checkpoint::header::dtype_size;
use crate::checkpoint::Component;
use crate::families::TensorSpec;
use crate::{Error, Result};

/// Shard boundaries are multiples of this many bytes (what DMA engines and NCCL like).
pub const ALIGN: u64 = 256;

/// A contiguous run of checkpoint bytes and where it lands in a slot group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Index into the component's files.
    pub file: usize,
    /// Absolute offset in that file.
    pub src: u64,
    /// Offset within the slot group.
    pub dst: u64,
    pub len: u64,
}

/// One tensor's place in a slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotTensor {
    /// Name relative to the block prefix.
    pub name: String,
    pub shape: Vec<usize>,
    pub group: usize,
    /// Byte offset within the slot group.
    pub offset: u64,
    pub len: u64,
}

/// One dtype's bytes of one block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupLayout {
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

impl GroupLayout {
    /// The runs rank `rank` copies for its shard, clipped to its byte range, with `dst`
    /// still relative to the start of the group.
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
    /// Indexed like [`ModelLayout::groups`]; a block without a dtype has an empty group.
    pub groups: Vec<GroupLayout>,
    pub tensors: Vec<SlotTensor>,
}

impl BlockLayout {
    pub fn padded_bytes(&self) -> u64 {
        self.groups.iter().map(|g| g.padded).sum()
    }
    pub fn bytes(&self) -> u64 {
        self.groups.iter().map(|g| g.bytes).sum()
    }
}

/// Every block's layout for a given dp, and the slot shape that fits them all.
#[derive(Debug, Clone)]
pub struct ModelLayout {
    pub dp: usize,
    /// Dtypes of the slot regions, in region order.
    pub groups: Vec<Dtype>,
    /// Bytes of each slot region (largest padded group over blocks).
    pub group_capacity: Vec<u64>,
    pub blocks: Vec<BlockLayout>,
}

fn round_up(x: u64, m: u64) -> u64 {
    x.div_ceil(m) * m
}

impl ModelLayout {
    /// Lays out blocks `0..num_blocks` whose tensors are `prefix(i) + spec.name`.
    pub fn new(
        component: &Component,
        specs: &[TensorSpec],
        num_blocks: usize,
        prefix: impl Fn(usize) -> String,
        dp: usize,
    ) -> Result<ModelLayout> {
        if dp == 0 {
            return Err(Error::invalid("dp", "must be at least 1"));
        }
        let mut dtypes: Vec<Dtype> = Vec::new();
        let mut per_block = Vec::with_capacity(num_blocks);
        for i in 0..num_blocks {
            let pre = prefix(i);
            // (dtype) → [(file, src, len, spec index)]
            let mut by_dtype: BTreeMap<Dtype, Vec<(usize, u64, u64, usize)>> = BTreeMap::new();
            for (si, spec) in specs.iter().enumerate() {
                let name = format!("{pre}{}", spec.name);
                let &(file, ti) = component.index.get(&name).ok_or_else(|| {
                    Error::tensor(&component.dir, &name, "missing from the checkpoint")
                })?;
                let info = &component.files[file].tensors[ti];
                by_dtype
                    .entry(info.dtype)
                    .or_default()
                    .push((file, info.offset, info.len, si));
                if !dtypes.contains(&info.dtype) {
                    dtypes.push(info.dtype);
                }
            }
            per_block.push(by_dtype);
        }
        // Widest dtype first keeps every region aligned for its element type.
        dtypes.sort_by_key(|d| std::cmp::Reverse(dtype_size(*d).unwrap_or(1)));
        let unit = dp as u64 * ALIGN;
        let mut blocks = Vec::with_capacity(num_blocks);
        let mut group_capacity = vec![0u64; dtypes.len()];
        for (i, mut by_dtype) in per_block.into_iter().enumerate() {
            let mut groups = Vec::with_capacity(dtypes.len());
            let mut tensors = Vec::with_capacity(specs.len());
            for (gi, dtype) in dtypes.iter().enumerate() {
                let mut items = by_dtype.remove(dtype).unwrap_or_default();
                items.sort();
                let mut pieces: Vec<Piece> = Vec::new();
                let mut at = 0u64;
                for (file, src, len, si) in items {
                    tensors.push(SlotTensor {
                        name: specs[si].name.clone(),
                        shape: specs[si].shape.clone(),
                        group: gi,
                        offset: at,
                        len,
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
                group_capacity[gi] = group_capacity[gi].max(padded);
                groups.push(GroupLayout {
                    dtype: *dtype,
                    bytes: at,
                    padded,
                    shard: padded / dp as u64,
                    pieces,
                });
            }
            blocks.push(BlockLayout {
                index: i,
                groups,
                tensors,
            });
        }
        Ok(ModelLayout {
            dp,
            groups: dtypes,
            group_capacity,
            blocks,
        })
    }

    /// Bytes of one slot.
    pub fn slot_bytes(&self) -> u64 {
        self.group_capacity.iter().sum()
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

#[cfg(test)]
mod tests {
    use super::*;

    fn group(pieces: Vec<Piece>, bytes: u64, dp: usize) -> GroupLayout {
        let padded = round_up(bytes, dp as u64 * ALIGN);
        GroupLayout {
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
            let g = group(pieces.clone(), 1777, dp);
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
