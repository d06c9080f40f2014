//! The groups of blocks a model streams ([`Streamed`]): their layouts and mappings, the
//! components kept whole or in part on the device, and the slot shape that fits a block of
//! any group that streams. The memory model and the planner read the same placement.

use std::sync::Arc;

use crate::checkpoint::Mapped;
use crate::layout::{GroupLayout, SlotShape};
use crate::memory::{GroupBytes, Placement};
use crate::{Error, Result, Strategy};

/// The groups of blocks a model streams, for one dp: each group's layout, mapped
/// component and pipeline component name, which groups stay whole on the device (the
/// components a plan keeps resident), and the slot shape that fits a block of any group
/// that streams.
#[derive(Clone)]
pub struct Streamed {
    pub layouts: Arc<Vec<GroupLayout>>,
    pub mapped: Vec<Mapped>,
    /// Per group, the component it belongs to (`text_encoder`, `transformer`, ...).
    pub components: Vec<String>,
    /// Per group, whether its blocks stay whole on the device under a streaming strategy.
    pub resident: Vec<bool>,
    /// Blocks of every other group that stay on the device too, spread evenly
    /// ([`crate::memory::resident_block_mask`]).
    pub resident_blocks: usize,
    /// Per group, blocks kept in place of `resident_blocks`
    /// (`--resident-blocks-by-component`).
    pub resident_blocks_by_group: Vec<Option<u64>>,
    pub shape: SlotShape,
}

impl Streamed {
    /// The groups of `layouts` (mapped from `mapped`, belonging to `components`), with the
    /// groups of `resident_components` kept whole on the device, `resident_blocks` of every
    /// other group kept, or of the components `by_component` names, their count. Names no
    /// component of the model: an error that lists the ones it has.
    pub fn new(
        layouts: Vec<GroupLayout>,
        mapped: Vec<Mapped>,
        components: Vec<String>,
        resident_components: &[String],
        resident_blocks: usize,
        by_component: &std::collections::BTreeMap<String, u64>,
    ) -> Result<Streamed> {
        if layouts.len() != mapped.len() || layouts.len() != components.len() || layouts.is_empty()
        {
            return Err(Error::bug(format!(
                "groups: {} block layouts for {} mapped components ({} named)",
                layouts.len(),
                mapped.len(),
                components.len()
            )));
        }
        let dp = layouts[0].dp;
        if layouts.iter().any(|l| l.dp != dp) {
            return Err(Error::bug("dp: block layouts for different dp"));
        }
        let named = resident_components
            .iter()
            .map(|c| ("resident-components", c))
            .chain(
                by_component
                    .keys()
                    .map(|c| ("resident-blocks-by-component", c)),
            );
        for (field, c) in named {
            if !components.contains(c) {
                let mut names = components.clone();
                names.dedup();
                return Err(Error::invalid(
                    field,
                    format!(
                        "`{c}` is not a streamed component of this model (it has {})",
                        names.join(", ")
                    ),
                ));
            }
        }
        let resident: Vec<bool> = components
            .iter()
            .map(|c| resident_components.contains(c))
            .collect();
        let resident_blocks_by_group: Vec<Option<u64>> = components
            .iter()
            .map(|c| by_component.get(c).copied())
            .collect();
        // A group with no more blocks than are kept is whole: it needs no slot.
        let whole: Vec<bool> = layouts
            .iter()
            .zip(&resident)
            .zip(&resident_blocks_by_group)
            .map(|((l, &r), n)| r || n.unwrap_or(resident_blocks as u64) >= l.blocks.len() as u64)
            .collect();
        let shape = SlotShape::of(&layouts, &whole);
        Ok(Streamed {
            layouts: Arc::new(layouts),
            mapped,
            components,
            resident,
            resident_blocks,
            resident_blocks_by_group,
            shape,
        })
    }

    pub fn dp(&self) -> usize {
        self.layouts[0].dp
    }

    /// Each group's block bytes, for the memory model.
    pub fn bytes(&self) -> Vec<GroupBytes> {
        self.layouts
            .iter()
            .zip(&self.components)
            .map(|(l, c)| GroupBytes::of(c, l))
            .collect()
    }

    /// Where `strategy` with K = `slots` puts these groups' weights.
    pub fn placement(&self, strategy: Strategy, slots: usize) -> Placement {
        Placement {
            strategy,
            dp: self.dp() as u64,
            slots: slots as u64,
            resident: self.resident.clone(),
            resident_blocks: self.resident_blocks as u64,
            resident_blocks_by_group: self.resident_blocks_by_group.clone(),
        }
    }

    /// Which blocks of group `g` stay on the device under `strategy` (all of them for a
    /// group kept whole), by the memory model's one rule.
    pub fn kept(&self, strategy: Strategy, g: usize) -> Vec<bool> {
        self.placement(strategy, 0)
            .kept(g, self.layouts[g].blocks.len())
    }

    /// The largest padded block over every group.
    pub fn largest_padded_block(&self) -> u64 {
        self.layouts
            .iter()
            .map(GroupLayout::largest_padded_block)
            .max()
            .unwrap_or(0)
    }
}
