//! What a run streams and the device bytes around it, known before any device is open:
//! the groups with the blocks `--resident-blocks` keeps (`auto` sized from the budget), and
//! the refusal to start when the memory model's need is more than `--device-memory-mib`.

use super::options::EngineOptions;
use crate::contract::ResidentBlocks;
use crate::execution::family::FamilyRuntime;
use crate::execution::pipeline::Streamed;
use crate::layout::GroupLayout;
use crate::memory::{self, GroupBytes};
use crate::slots;
use crate::{Error, Result};

/// What a run streams and the device bytes around it, known before any device is open.
pub(super) struct Sizing {
    /// The groups it streams, with the blocks `--resident-blocks` keeps.
    pub(super) streamed: Streamed,
    /// Each group's block bytes, for the memory model.
    pub(super) groups: Vec<GroupBytes>,
    /// Device bytes outside the slots that every rank keeps (prologues, epilogues,
    /// decoder), in the memory model's term: the profile's file sizes, which the
    /// operator's plan uses, so that a plan it records is one this engine starts with and
    /// accounts to the byte.
    pub(super) outside: u64,
    /// What the weights may take of `--device-memory-mib`: the rest is the activations',
    /// the runtime's and the decoder's beside the ranks. None without a budget.
    pub(super) weights_budget: Option<u64>,
}

impl Sizing {
    /// Sizes a run of `family` over `layouts` (its groups for `opts.dp`), with the blocks
    /// kept on the device that `--resident-blocks` asks for.
    pub(super) fn new(
        family: &dyn FamilyRuntime,
        opts: &EngineOptions,
        layouts: Vec<GroupLayout>,
    ) -> Result<Sizing> {
        let outside = family.resident_bytes(opts.decode);
        let weights_budget = (opts.device_memory != u64::MAX).then(|| {
            opts.device_memory
                .saturating_sub(opts.activations)
                .saturating_sub(opts.overhead)
                .saturating_sub(opts.decoder.total())
        });
        let streamed_with = |n: usize| {
            Streamed::new(
                layouts.clone(),
                family.mappings(),
                family.group_components(),
                &opts.resident_components,
                n,
                &opts.resident_blocks_by_component,
            )
        };
        let resident_blocks = match opts.resident_blocks {
            ResidentBlocks::Fixed(n) => n,
            ResidentBlocks::Auto if !opts.strategy.streams() => 0,
            ResidentBlocks::Auto => {
                let Some(budget) = weights_budget else {
                    return Err(Error::invalid(
                        "resident-blocks",
                        "`--resident-blocks auto` keeps as many blocks as the device memory budget holds after the slots: give --device-memory-mib, or a number of blocks",
                    ));
                };
                auto_resident_blocks(&streamed_with(0)?, opts, outside, budget)?
            }
        };
        let streamed = streamed_with(resident_blocks)?;
        if resident_blocks > 0 {
            tracing::info!(
                resident_blocks,
                "blocks of each streamed group kept on the device"
            );
        }
        Ok(Sizing {
            groups: streamed.bytes(),
            streamed,
            outside,
            weights_budget,
        })
    }
}

/// `--resident-blocks auto`: as many blocks of each streamed group as `budget` holds
/// beside the slots, with K first chosen from the budget with no block kept. `none` is
/// the run's groups with no block kept.
fn auto_resident_blocks(
    none: &Streamed,
    opts: &EngineOptions,
    outside: u64,
    budget: u64,
) -> Result<usize> {
    let groups = none.bytes();
    let needs = slots::DeviceNeeds::of(&groups, &none.placement(opts.strategy, 0), outside);
    let k = slots::cpu_slots(opts.slots, opts.strategy, needs, Some(budget))?;
    Ok(slots::auto_resident_blocks(
        &groups,
        &none.placement(opts.strategy, k),
        outside,
        budget,
    ))
}

/// Refuses to start when the memory model's need for this run (K = `slots`) is larger
/// than the device memory budget, naming both figures and the terms.
pub(super) fn check_budget(
    groups: &[GroupBytes],
    streamed: &Streamed,
    opts: &EngineOptions,
    slots: usize,
    outside: u64,
) -> Result<()> {
    if opts.device_memory == u64::MAX {
        return Ok(());
    }
    let need = memory::device_bytes(
        groups,
        &streamed.placement(opts.strategy, slots),
        outside,
        opts.activations,
        opts.overhead,
    )
    .with_decoder(opts.decoder);
    if need.total() > opts.device_memory {
        return Err(Error::invalid(
            "device-memory",
            format!(
                "{} with dp {} and {slots} slots needs {} bytes per rank (block weights {}, slots {}, resident {}, activations {}, overhead {}, decoder {}), but the budget is {} bytes (--device-memory-mib)",
                opts.strategy,
                opts.dp,
                need.total(),
                need.block_weights,
                need.slots,
                need.resident_weights,
                need.activations,
                need.overhead,
                need.decoder,
                opts.device_memory
            ),
        ));
    }
    Ok(())
}
