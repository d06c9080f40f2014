//! The CUDA backend's decisions, kept free of CUDA so the default build tests them: how
//! many slots fit in the free device memory (`--slots auto`), which device to run on and
//! how weights reach it (`--host-memory`).

use std::fmt;
use std::str::FromStr;

use crate::memory::{self, GroupBytes, Placement};
use crate::{Error, Result, Strategy};

/// `--device`: where the ranks compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    /// Threads stand in for streams; always available.
    Cpu,
    /// NVIDIA GPUs; an error when none is present or the binary lacks the `cuda` feature.
    Cuda,
    /// CUDA when a GPU is present, else CPU.
    #[default]
    Auto,
}

impl FromStr for DeviceChoice {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "cpu" => Ok(DeviceChoice::Cpu),
            "cuda" | "gpu" => Ok(DeviceChoice::Cuda),
            "auto" => Ok(DeviceChoice::Auto),
            other => Err(Error::invalid(
                "device",
                format!("`{other}`: expected cpu, cuda or auto"),
            )),
        }
    }
}

/// `--slots`: a fixed K or as many as the device memory allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotsChoice {
    Fixed(usize),
    Auto,
}

impl Default for SlotsChoice {
    fn default() -> Self {
        SlotsChoice::Fixed(2)
    }
}

impl FromStr for SlotsChoice {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        if s == "auto" {
            return Ok(SlotsChoice::Auto);
        }
        s.parse()
            .map(SlotsChoice::Fixed)
            .map_err(|_| Error::invalid("slots", format!("`{s}`: expected a number ≥ 2 or `auto`")))
    }
}

impl fmt::Display for SlotsChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SlotsChoice::Fixed(k) => write!(f, "{k}"),
            SlotsChoice::Auto => f.write_str("auto"),
        }
    }
}

/// `--resident-blocks`: how many blocks of each streamed group stay on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResidentBlocks {
    Fixed(usize),
    /// As many as fit the device memory budget after the slots, the activations and the
    /// overhead ([`auto_resident_blocks`]).
    Auto,
}

impl Default for ResidentBlocks {
    fn default() -> Self {
        ResidentBlocks::Fixed(0)
    }
}

impl FromStr for ResidentBlocks {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        if s == "auto" {
            return Ok(ResidentBlocks::Auto);
        }
        s.parse().map(ResidentBlocks::Fixed).map_err(|_| {
            Error::invalid(
                "resident-blocks",
                format!("`{s}`: expected a number of blocks or `auto`"),
            )
        })
    }
}

impl fmt::Display for ResidentBlocks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ResidentBlocks::Fixed(n) => write!(f, "{n}"),
            ResidentBlocks::Auto => f.write_str("auto"),
        }
    }
}

/// `--resident-blocks-by-component`: blocks kept of each group of the components named
/// (`transformer=20,text_encoder=0`), in place of `--resident-blocks`' one count for
/// every group; read and written by the core's one code
/// ([`memory::parse_component_blocks`]), as the planner writes it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BlocksByComponent(pub std::collections::BTreeMap<String, u64>);

impl FromStr for BlocksByComponent {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(BlocksByComponent(memory::parse_component_blocks(s)?))
    }
}

impl fmt::Display for BlocksByComponent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&memory::format_component_blocks(&self.0))
    }
}

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

/// `--host-memory`: how weights reach a GPU from the mapped checkpoint (see
/// `cuda::host`). The CPU backend reads the mapping directly under `auto` and stages
/// through the ring under `pin`; it refuses the other two.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HostMode {
    /// Register the mapping read-only, else a private writable mapping of the same files,
    /// else stage through a ring per rank; says which and why.
    #[default]
    Auto,
    /// Register (read-only, else the private writable mapping), or fail.
    Register,
    /// Stage through a bounded ring of pinned buffers per rank
    /// ([`crate::execution::staging`]).
    Pin,
    /// Plain pageable copies (slow; for comparison).
    Pageable,
}

impl FromStr for HostMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "auto" => HostMode::Auto,
            "register" => HostMode::Register,
            "pin" => HostMode::Pin,
            "pageable" => HostMode::Pageable,
            other => {
                return Err(Error::invalid(
                    "host-memory",
                    format!("`{other}`: expected auto, register, pin or pageable"),
                ))
            }
        })
    }
}

impl fmt::Display for HostMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            HostMode::Auto => "auto",
            HostMode::Register => "register",
            HostMode::Pin => "pin",
            HostMode::Pageable => "pageable",
        })
    }
}

/// Most slots `--slots auto` takes: past a few blocks of lookahead, more slots only hold
/// memory that activations could use.
pub const MAX_AUTO_SLOTS: usize = 8;

/// Device memory a rank must leave free for activations, candle's scratch, cuBLAS and
/// NCCL: the larger of 2 GiB and 1/16 of the device.
pub fn activation_reserve(total: u64) -> u64 {
    (2u64 << 30).max(total / 16)
}

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

/// The capacity a rank's [`super::super::budget::DeviceBudget`] gets: the free memory
/// measured after initialisation less the reserve, never more than a
/// `--device-memory-mib` cap. The reserve is the fixed floor of [`activation_reserve`], or
/// the largest request's `activations` (from the memory model, which scales with tokens)
/// when they need more: a fixed reserve ignores resolution. The runtime's own memory
/// (context, kernels, cuBLAS, NCCL) is already gone from `free`, which setup reads after
/// a warm-up.
pub fn budget_capacity(free: u64, total: u64, cap: Option<u64>, activations: u64) -> u64 {
    let reserve = activation_reserve(total).max(activations);
    let real = free.saturating_sub(reserve);
    cap.map_or(real, |c| c.min(real))
}

/// The oldest driver that loads the PTX this build ships: CUDA 13.0's PTX (candle's
/// kernels, the engine's own, NVRTC's) needs a driver that supports CUDA 13.0, the
/// 580 series (`cuDriverGetVersion` reports 13000).
pub const MIN_DRIVER_VERSION: i32 = 13000;

/// The oldest compute capability the kernels are built for: the engine's kernels are
/// `compute_80` PTX, which the driver JIT-compiles for 8.0 (A100) and everything newer
/// (L4/L40S 8.9, H100/H200 9.0, B200 10.0); candle's use bf16 instructions of 8.0.
pub const MIN_COMPUTE_CAPABILITY: (i32, i32) = (8, 0);

/// Whether GPUs `0..capabilities.len()` can run this build with `driver`
/// (`cuDriverGetVersion`), or why not, in a sentence. Decided before any kernel module
/// loads, so `--device auto` can still fall back to the CPU.
pub fn gpus_usable(driver: i32, capabilities: &[(i32, i32)]) -> std::result::Result<(), String> {
    if driver < MIN_DRIVER_VERSION {
        return Err(format!(
            "the NVIDIA driver supports CUDA {}.{}, but this build's kernels are CUDA {}.{} PTX, which needs a 580-series driver or newer",
            driver / 1000,
            driver % 1000 / 10,
            MIN_DRIVER_VERSION / 1000,
            MIN_DRIVER_VERSION % 1000 / 10
        ));
    }
    for (i, &(major, minor)) in capabilities.iter().enumerate() {
        if (major, minor) < MIN_COMPUTE_CAPABILITY {
            return Err(format!(
                "GPU {i} has compute capability {major}.{minor}; the kernels need {}.{} or newer (A100, L4, L40S, H100, H200, B200)",
                MIN_COMPUTE_CAPABILITY.0, MIN_COMPUTE_CAPABILITY.1
            ));
        }
    }
    Ok(())
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
    fn budget_leaves_the_activation_reserve() {
        let gib = 1u64 << 30;
        assert_eq!(budget_capacity(100 * gib, 128 * gib, None, 0), 92 * gib);
        assert_eq!(
            budget_capacity(100 * gib, 128 * gib, Some(10 * gib), 0),
            10 * gib
        );
        assert_eq!(budget_capacity(gib, 8 * gib, None, 0), 0);
    }

    #[test]
    fn the_reserve_grows_with_the_largest_requests_activations() {
        let gib = 1u64 << 30;
        // Small requests: the fixed floor (1/16 of 128 GiB) holds.
        assert_eq!(
            budget_capacity(100 * gib, 128 * gib, None, 2 * gib),
            92 * gib
        );
        // A large video's 20 GiB of activations come off whole.
        assert_eq!(
            budget_capacity(100 * gib, 128 * gib, None, 20 * gib),
            80 * gib
        );
        // Saturates instead of wrapping.
        assert_eq!(budget_capacity(gib, 8 * gib, None, u64::MAX), 0);
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

    #[test]
    fn choices_parse() {
        assert_eq!("auto".parse::<SlotsChoice>().unwrap(), SlotsChoice::Auto);
        assert_eq!("3".parse::<SlotsChoice>().unwrap(), SlotsChoice::Fixed(3));
        for bad in ["x", "-1", "2.5", ""] {
            let e = bad.parse::<SlotsChoice>().unwrap_err().to_string();
            assert!(e.contains("slots") && e.contains("`auto`"), "{e}");
        }
        assert_eq!(SlotsChoice::Auto.to_string(), "auto");
        assert_eq!(SlotsChoice::Fixed(4).to_string(), "4");
        for mode in ["auto", "register", "pin", "pageable"] {
            assert_eq!(mode.parse::<HostMode>().unwrap().to_string(), mode);
        }
        let e = "pinned".parse::<HostMode>().unwrap_err().to_string();
        assert!(
            e.contains("host-memory") && e.contains("auto, register, pin or pageable"),
            "{e}"
        );
        assert_eq!("cuda".parse::<DeviceChoice>().unwrap(), DeviceChoice::Cuda);
        assert!("tpu"
            .parse::<DeviceChoice>()
            .unwrap_err()
            .to_string()
            .contains("cpu, cuda or auto"));
    }

    #[test]
    fn gpus_need_a_cuda_13_driver_and_capability_8_0() {
        let h200 = [(9, 0), (9, 0)];
        assert_eq!(gpus_usable(13000, &h200), Ok(()));
        assert_eq!(
            gpus_usable(13010, &[(8, 0), (8, 9), (10, 0), (12, 0)]),
            Ok(())
        );
        let e = gpus_usable(12080, &h200).unwrap_err();
        assert!(e.contains("CUDA 12.8") && e.contains("580"), "{e}");
        let e = gpus_usable(13000, &[(9, 0), (7, 5)]).unwrap_err();
        assert!(
            e.contains("GPU 1") && e.contains("7.5") && e.contains("8.0"),
            "{e}"
        );
        // No device to check is the probe's business (it reports none), not this one's.
        assert_eq!(gpus_usable(13000, &[]), Ok(()));
    }
}
