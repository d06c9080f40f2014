//! How many slots a rank streams through and how many blocks it keeps, from the one memory
//! model: decisions every backend takes the same way (the CUDA backend from its free
//! memory, the CPU backend from its budget), so they live below both.

use crate::contract::SlotsChoice;
use crate::memory::{self, GroupBytes, Placement};
use crate::{Error, Result, Strategy};

/// The most blocks of each streamed group that stay on the device with `placement`'s K
/// while its weights (blocks, slots, and `outside` bytes) fit `budget`; 0 when none does.
pub fn auto_resident_blocks(
    groups: &[GroupBytes],
    placement: &Placement,
    outside: u64,
    budget: u64,
) -> usize {
    let most = groups.iter().map(GroupBytes::blocks).max().unwrap_or(0);
    (0..=most)
        .filter(|&n| {
            let p = Placement {
                resident_blocks: n as u64,
                ..placement.clone()
            };
            // Keeping every block is the resident strategy, not a streaming one.
            p.streams(groups) && memory::device_bytes(groups, &p, outside, 0, 0).weights() <= budget
        })
        .max()
        .unwrap_or(0)
}

/// Most slots `--slots auto` takes: past a few blocks of lookahead, more slots only hold
/// memory that activations could use.
pub const MAX_AUTO_SLOTS: usize = 8;

/// One rank's fixed device memory and the size of one slot, as the pipeline charges them
/// (from the one memory model, [`crate::memory`]).
#[derive(Debug, Clone, Copy)]
pub struct DeviceNeeds {
    /// Everything but the slots: resident prologue/epilogue, VAE, shard store or
    /// resident blocks.
    pub fixed: u64,
    /// Bytes of one slot (all dtype groups; 0 when nothing streams).
    pub slot: u64,
}

impl DeviceNeeds {
    /// What `placement` keeps on a device besides the slots, plus the slot size, for the
    /// streamed `groups` (one slot fits a block of any group that streams) and `outside`
    /// bytes of prologues, epilogues and decoder. `placement.slots` is ignored.
    pub fn of(groups: &[GroupBytes], placement: &Placement, outside: u64) -> DeviceNeeds {
        let one = Placement {
            slots: 1,
            ..placement.clone()
        };
        let b = memory::device_bytes(groups, &one, outside, 0, 0);
        DeviceNeeds {
            fixed: b.block_weights + b.resident_weights,
            slot: b.slots,
        }
    }
}

/// K for a rank: the number asked for, or (auto) as many slots as fit in `capacity`
/// after the fixed bytes, at most [`MAX_AUTO_SLOTS`]. Fails, naming the numbers, when
/// the plan does not fit, so the engine refuses to start instead of failing a request.
pub fn choose_slots(
    choice: SlotsChoice,
    strategy: Strategy,
    needs: DeviceNeeds,
    capacity: u64,
) -> Result<usize> {
    let streams = strategy.streams();
    let k = match choice {
        SlotsChoice::Fixed(k) => k,
        SlotsChoice::Auto if !streams => 0,
        SlotsChoice::Auto => {
            let room = capacity.saturating_sub(needs.fixed);
            (room / needs.slot.max(1)).min(MAX_AUTO_SLOTS as u64) as usize
        }
    };
    let min = crate::strategy::MIN_STREAMING_SLOTS as usize;
    if streams && k < min {
        let need = needs.fixed + min as u64 * needs.slot;
        return Err(Error::invalid(
            "slots",
            format!(
                "{strategy} needs at least {min} slots: {} fixed + {min} × {} per slot = {need} bytes, but the device has {capacity} bytes for weights",
                needs.fixed, needs.slot
            ),
        ));
    }
    let need = needs.fixed + if streams { k as u64 * needs.slot } else { 0 };
    if need > capacity {
        return Err(Error::invalid(
            "slots",
            format!(
                "{strategy} with {k} slots needs {need} bytes of device memory ({} fixed + {k} × {}), but the device has {capacity} bytes for weights",
                needs.fixed, needs.slot
            ),
        ));
    }
    Ok(k)
}

/// K on the CPU backend, whose device memory is the `--device-memory-mib` budget (None:
/// unlimited). `auto` fills that budget like [`choose_slots`] fills a GPU; without a
/// budget there is nothing to size from, which is an error for a streaming strategy
/// rather than a guess. A fixed K is checked by the pipeline's own accounting.
pub fn cpu_slots(
    choice: SlotsChoice,
    strategy: Strategy,
    needs: DeviceNeeds,
    budget: Option<u64>,
) -> Result<usize> {
    match (choice, budget) {
        (SlotsChoice::Fixed(k), _) => Ok(k),
        (SlotsChoice::Auto, Some(cap)) => choose_slots(choice, strategy, needs, cap),
        (SlotsChoice::Auto, None) if !strategy.streams() => Ok(0),
        (SlotsChoice::Auto, None) => Err(Error::invalid(
            "slots",
            "`--slots auto` sizes K from device memory, and the CPU backend has none to \
             size from: give --device-memory-mib, or a number of slots",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_slots_fill_free_memory_up_to_the_cap() {
        let needs = DeviceNeeds {
            fixed: 1000,
            slot: 100,
        };
        let k = |cap| choose_slots(SlotsChoice::Auto, Strategy::Offload, needs, cap);
        assert_eq!(k(1250).unwrap(), 2);
        assert_eq!(k(1599).unwrap(), 5);
        assert_eq!(k(1_000_000).unwrap(), MAX_AUTO_SLOTS);
        let e = k(1199).unwrap_err().to_string();
        assert!(e.contains("at least 2 slots") && e.contains("1199"), "{e}");
        assert_eq!(
            choose_slots(SlotsChoice::Auto, Strategy::Resident, needs, 1000).unwrap(),
            0
        );
        let e = choose_slots(SlotsChoice::Fixed(4), Strategy::Offload, needs, 1300)
            .unwrap_err()
            .to_string();
        assert!(e.contains("4 slots needs 1400 bytes"), "{e}");
        assert_eq!(
            choose_slots(SlotsChoice::Fixed(3), Strategy::Sharded, needs, 1300).unwrap(),
            3
        );
    }

    #[test]
    fn cpu_slots_size_from_the_budget_or_refuse() {
        let needs = DeviceNeeds {
            fixed: 1000,
            slot: 100,
        };
        let k = |choice, budget| cpu_slots(choice, Strategy::OffloadSharded, needs, budget);
        assert_eq!(k(SlotsChoice::Auto, Some(1350)).unwrap(), 3);
        assert_eq!(k(SlotsChoice::Auto, Some(1 << 40)).unwrap(), MAX_AUTO_SLOTS);
        assert_eq!(k(SlotsChoice::Fixed(5), None).unwrap(), 5);
        let e = k(SlotsChoice::Auto, None).unwrap_err().to_string();
        assert!(
            e.contains("--slots auto") && e.contains("--device-memory-mib"),
            "{e}"
        );
        let e = k(SlotsChoice::Auto, Some(1100)).unwrap_err().to_string();
        assert!(e.contains("at least 2 slots") && e.contains("1100"), "{e}");
        assert_eq!(
            cpu_slots(SlotsChoice::Auto, Strategy::Resident, needs, None).unwrap(),
            0
        );
    }
}
