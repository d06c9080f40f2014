//! The CUDA backend's decisions, kept free of CUDA so the default build tests them: which
//! device to run on, how weights reach it (`--host-memory`), the memory a GPU keeps free
//! and whether its driver runs this build. How many slots fit (`--slots auto`) is the
//! memory model's decision, the same on every backend ([`crate::slots`]).

use std::fmt;
use std::str::FromStr;

use crate::{Error, Result};

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

/// Device memory a rank must leave free for activations, candle's scratch, cuBLAS and
/// NCCL: the larger of 2 GiB and 1/16 of the device.
pub fn activation_reserve(total: u64) -> u64 {
    (2u64 << 30).max(total / 16)
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
    fn choices_parse() {
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
