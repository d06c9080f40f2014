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

/// A tensor of one block where the checkpoint holds it, and the slot entry it becomes.
struct Found {
    /// Index into the component's files.
    file: usize,
    /// Absolute offset in that file.
    src: u64,
    len: u64,
    /// Name relative to the block prefix.
    name: String,
    shape: Vec<usize>,
    /// For an fp8 weight's scale: the weight it scales.
    scales: Option<String>,
}

/// A block's tensors by dtype, each list in the order the specs name them.
type FoundByDtype = BTreeMap<Dtype, Vec<Found>>;

/// Finds the tensors of the block whose names start with `prefix` (one per spec, and the
/// scale of each fp8 weight, whose bytes are the block's and travel with it); adds the
/// dtypes not met before to `dtypes`, in the order met. A tensor the checkpoint lacks is
/// an error naming it.
fn find_block(
    component: &Component,
    specs: &[TensorSpec],
    prefix: &str,
    dtypes: &mut Vec<Dtype>,
) -> Result<FoundByDtype> {
    let mut by_dtype = FoundByDtype::new();
    let mut add = |name: &str, rel: String, shape: Vec<usize>, scales: Option<String>| {
        let &(file, ti) = component
            .index
            .get(name)
            .ok_or_else(|| Error::tensor(&component.dir, name, "missing from the checkpoint"))?;
        let info = &component.files[file].tensors[ti];
        by_dtype.entry(info.dtype).or_default().push(Found {
            file,
            src: info.offset,
            len: info.len,
            name: rel,
            shape,
            scales,
        });
        if !dtypes.contains(&info.dtype) {
            dtypes.push(info.dtype);
        }
        Ok::<_, Error>(info.dtype)
    };
    for spec in specs {
        let name = format!("{prefix}{}", spec.name);
        let dtype = add(&name, spec.name.clone(), spec.shape.clone(), None)?;
        if dtype == Dtype::F8_E4M3 {
            let scale = crate::checkpoint::fp8::scale_of(component, &name)?;
            let (_, info) = component.get(&scale).expect("checked");
            let rel = scale[prefix.len()..].to_string();
            add(&scale, rel, info.shape.clone(), Some(spec.name.clone()))?;
        }
    }
    Ok(by_dtype)
}

/// Packs block `index`'s tensors into one region per dtype of `dtypes` (empty for a dtype
/// the block does not hold).
fn pack_block(
    index: usize,
    mut by_dtype: FoundByDtype,
    dtypes: &[Dtype],
    dp: usize,
) -> BlockLayout {
    let mut tensors = Vec::new();
    let regions = dtypes
        .iter()
        .enumerate()
        .map(|(region, dtype)| {
            let found = by_dtype.remove(dtype).unwrap_or_default();
            pack_region(region, *dtype, found, dp, &mut tensors)
        })
        .collect();
    BlockLayout {
        index,
        regions,
        tensors,
    }
}

/// Packs `found`, the tensors of one dtype, back to back in file order into region
/// `region`, padded to a multiple of `dp × ALIGN`, merging runs adjacent in one file into
/// one piece; pushes each tensor's place onto `tensors`.
fn pack_region(
    region: usize,
    dtype: Dtype,
    mut found: Vec<Found>,
    dp: usize,
    tensors: &mut Vec<SlotTensor>,
) -> RegionLayout {
    // Stable: two entries of the same bytes keep the order the specs name them in.
    found.sort_by_key(|f| (f.file, f.src, f.len));
    let mut pieces: Vec<Piece> = Vec::new();
    let mut at = 0u64;
    for f in found {
        let (file, src, len) = (f.file, f.src, f.len);
        tensors.push(SlotTensor {
            name: f.name,
            shape: f.shape,
            region,
            offset: at,
            len,
            scales: f.scales,
        });
        match pieces.last_mut() {
            Some(p) if p.file == file && p.src + p.len == src && p.dst + p.len == at => {
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
    let padded = round_up(at, dp as u64 * ALIGN);
    RegionLayout {
        dtype,
        bytes: at,
        padded,
        shard: padded / dp as u64,
        pieces,
    }
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
        let found = (0..num_blocks)
            .map(|i| find_block(component, specs, &prefix(i), &mut dtypes))
            .collect::<Result<Vec<_>>>()?;
        // Widest dtype first keeps every region aligned for its element type.
        dtypes.sort_by_key(|d| std::cmp::Reverse(dtype_size(*d).unwrap_or(1)));
        let blocks: Vec<BlockLayout> = found
            .into_iter()
            .enumerate()
            .map(|(i, by_dtype)| pack_block(i, by_dtype, &dtypes, dp))
            .collect();
        let mut region_capacity = vec![0u64; dtypes.len()];
        for b in &blocks {
            for (cap, region) in region_capacity.iter_mut().zip(&b.regions) {
                *cap = (*cap).max(region.padded);
            }
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
