//! The CUDA backend (cargo feature `cuda`): the pipeline's three kinds of work on three
//! CUDA streams per rank (candle's compute stream, a copy stream, a gather stream),
//! ordered only by events; slots allocated once as candle tensors and written in place;
//! weights read from the mapped checkpoint through registered host memory or a staging
//! ring; the dp ranks' shards all-gathered with NCCL. One process drives dp GPUs, one
//! thread each.
//!
//! [`plan`] holds the decisions (device choice, `--slots auto`, `--host-memory`) and is
//! compiled and tested without the feature. [`resolve`] answers "CPU or GPU?" in every
//! build: a build with the feature probes for the driver library before
//! touching CUDA; the `layerwise` executable, which links no CUDA (see `crate::launch`),
//! reports why the CUDA library beside it could not run, or that there is none.

pub mod attention;
pub mod dl;
pub mod plan;

#[cfg(feature = "cuda")]
mod backend;
#[cfg(feature = "cuda")]
mod comm;
#[cfg(feature = "cuda")]
mod host;
#[cfg(feature = "cuda")]
mod probe;
#[cfg(feature = "cuda")]
pub mod seq;

#[cfg(feature = "cuda")]
pub use backend::{CudaBackend, CudaEvent, CudaStream};
#[cfg(feature = "cuda")]
pub use comm::{NcclComm, NcclGroup};
#[cfg(feature = "cuda")]
pub use host::{HostMemory, HostPath};
#[cfg(feature = "cuda")]
pub use probe::{probe, Probe};

pub use plan::{DeviceChoice, HostMode};

use std::sync::{Once, OnceLock};

use crate::decode::DeviceKind;
use crate::{Error, Result};

/// Where the ranks will compute.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolved {
    Cpu { why: String },
    Cuda { devices: usize },
}

impl Resolved {
    /// The kind of device the ranks compute on.
    pub fn kind(&self) -> DeviceKind {
        match self {
            Resolved::Cpu { .. } => DeviceKind::Cpu,
            Resolved::Cuda { .. } => DeviceKind::Cuda,
        }
    }

    /// The device rank `rank` computes on, for work beside the ranks (the server's
    /// decoder): the CPU, or GPU `rank` with a stream of its own, so that work runs beside
    /// the rank's passes rather than between them.
    pub fn rank_device(&self, rank: usize) -> Result<candle_core::Device> {
        #[cfg(not(feature = "cuda"))]
        let _ = rank;
        match self {
            Resolved::Cpu { .. } => Ok(candle_core::Device::Cpu),
            #[cfg(feature = "cuda")]
            Resolved::Cuda { .. } => {
                candle_core::Device::new_cuda_with_stream(rank).map_err(|e| Error::Rank {
                    rank,
                    msg: format!("open GPU {rank} beside the rank: {e}"),
                })
            }
            #[cfg(not(feature = "cuda"))]
            Resolved::Cuda { .. } => unreachable!("resolve never picks CUDA without the feature"),
        }
    }
}

/// Why there is no GPU, and whether one could have been used: a build with a CUDA
/// backend that finds no device says so louder than a CPU-only build.
struct Unusable {
    why: String,
    has_backend: bool,
}

/// Why this process has no CUDA although its build ships a backend for it: set by the
/// executable's launcher when the CUDA library beside it cannot run here (no driver, a
/// library that does not load). Read by [`resolve`] in builds without the feature.
static UNUSABLE: OnceLock<String> = OnceLock::new();

/// Records, once and before any run, why the CUDA backend this build ships cannot run.
pub fn set_unusable(why: String) {
    let _ = UNUSABLE.set(why);
}

/// Resolves `--device` for `dp` ranks. `cuda` fails with the reason when there is no
/// usable GPU (or fewer than dp); `auto` falls back to the CPU and says why (a warning,
/// once per process, when the build has a CUDA backend that cannot run here).
pub fn resolve(choice: DeviceChoice, dp: usize) -> Result<Resolved> {
    if choice == DeviceChoice::Cpu {
        return Ok(Resolved::Cpu {
            why: "asked for".into(),
        });
    }
    match (choice, detect(dp)) {
        (_, Ok(devices)) => Ok(Resolved::Cuda { devices }),
        (DeviceChoice::Auto, Err(u)) => {
            if u.has_backend {
                static WARNED: Once = Once::new();
                WARNED.call_once(|| {
                    tracing::warn!(
                        "--device auto: no usable GPU, computing on the CPU: {}",
                        u.why
                    )
                });
            }
            Ok(Resolved::Cpu { why: u.why })
        }
        (_, Err(u)) => Err(Error::device("--device cuda: no usable GPU", u.why)),
    }
}

#[cfg(feature = "cuda")]
fn detect(dp: usize) -> std::result::Result<usize, Unusable> {
    let unusable = |why| Unusable {
        why,
        has_backend: true,
    };
    match probe() {
        Probe::Absent(why) => Err(unusable(why)),
        Probe::Present { devices, .. } if devices < dp => Err(unusable(format!(
            "dp={dp} needs {dp} GPUs, this machine has {devices}"
        ))),
        Probe::Present {
            devices,
            driver,
            capabilities,
        } => match plan::gpus_usable(driver, &capabilities[..dp]) {
            Ok(()) => Ok(devices),
            Err(why) => Err(unusable(why)),
        },
    }
}

#[cfg(not(feature = "cuda"))]
fn detect(_dp: usize) -> std::result::Result<usize, Unusable> {
    Err(match UNUSABLE.get() {
        Some(why) => Unusable {
            why: why.clone(),
            has_backend: true,
        },
        None => Unusable {
            why: "this build has no CUDA backend: built without the `cuda` feature, and no \
                  liblayerwise_cuda.so beside the executable"
                .into(),
            has_backend: false,
        },
    })
}

#[cfg(feature = "cuda")]
mod setup {
    use std::sync::Arc;
    use std::time::Duration;

    use candle_core::cuda_backend::cudarc::driver::CudaContext;
    use candle_core::{DType, Device, Tensor};

    use crate::execution::backend::Backend;

    use super::host::cuda;
    use super::plan::budget_capacity;
    use super::{CudaBackend, HostMemory, HostMode, NcclComm, NcclGroup};
    use crate::contract::SlotsChoice;
    use crate::execution::pipeline::Streamed;
    use crate::slots::{choose_slots, DeviceNeeds};
    use crate::{Result, Strategy};

    /// One rank's GPU, ready for a pipeline.
    pub struct CudaRank {
        pub backend: Arc<CudaBackend>,
        pub comm: NcclComm,
        /// Capacity for this rank's `DeviceBudget`: free memory at start less the
        /// activation reserve, capped by what `--device-memory-mib` leaves the weights.
        pub capacity: u64,
    }

    /// The GPUs of one process.
    pub struct CudaRanks {
        pub ranks: Vec<CudaRank>,
        pub group: Arc<NcclGroup>,
        pub host: Arc<HostMemory>,
        /// K after `--slots auto` (the smallest over ranks).
        pub slots: usize,
    }

    /// What [`setup`] needs to know.
    pub struct CudaOptions {
        pub strategy: Strategy,
        pub slots: SlotsChoice,
        /// What the weights may take of `--device-memory-mib` (the rest is the
        /// activations' and the runtime's), if a budget was given.
        pub weights_budget: Option<u64>,
        /// The rank's fixed bytes and slot size, from the memory model.
        pub needs: DeviceNeeds,
        pub host: HostMode,
        pub timeout: Duration,
        /// The compute dtype, which the warm-up runs in.
        pub dtype: DType,
        /// Activation bytes of the largest request this rank accepts (0: unknown), which
        /// the reserve grows to cover.
        pub activations: u64,
    }

    /// Runs one of each kind of kernel the families use (fill, cast, unary, binary,
    /// affine, reduce, softmax, indexing, convolution, cuBLAS GEMM) on `device` in
    /// `dtype`, so their modules are loaded and cuBLAS has its handle and workspace
    /// before free memory is measured.
    fn warm_up(device: &Device, dtype: DType) -> candle_core::Result<()> {
        let x = Tensor::ones((2, 4, 8, 8), dtype, device)?;
        let w = Tensor::ones((4, 4, 2, 2), dtype, device)?;
        let y = x.conv2d(&w, 0, 2, 1, 1)?.flatten_from(1)?;
        let z = y.matmul(&y.t()?)?.to_dtype(DType::F32)?;
        let p = candle_nn::ops::softmax_last_dim(&z)?;
        let g = ((p.gelu_erf()?.silu()? + 1.0)?.sqrt()? * 0.5)?;
        let r = g.mean_keepdim(1)?.broadcast_add(&g)?.exp()?;
        let idx = Tensor::new(&[1u32, 0], device)?;
        let _ = r
            .index_select(&idx, 0)?
            .to_dtype(dtype)?
            .to_device(&Device::Cpu)?;
        device.synchronize()
    }

    /// Opens GPUs 0..dp, their NCCL group and the host path, and sizes K, failing before
    /// any request when the plan does not fit a device.
    pub fn setup(streamed: &Streamed, o: &CudaOptions) -> Result<CudaRanks> {
        let dp = streamed.dp();
        // The first rank's context chooses and prepares the host path for every rank.
        let first = CudaContext::new(0).map_err(|e| cuda("open GPU 0", e))?;
        let host = Arc::new(HostMemory::setup(&first, streamed, o.strategy, o.host)?);
        tracing::info!(path = %host.path, reason = %host.reason, "host memory for weights");
        let mut backends = Vec::with_capacity(dp);
        for rank in 0..dp {
            backends.push(Arc::new(CudaBackend::new(
                rank,
                rank,
                host.clone(),
                o.timeout,
            )?));
        }
        let contexts: Vec<_> = backends.iter().map(|b| b.context().clone()).collect();
        // Only the strategies that gather need NCCL (and the pools' peer access).
        let (group, comms) = match o.strategy {
            Strategy::Sharded | Strategy::OffloadSharded => NcclGroup::init(&contexts)?,
            Strategy::Resident | Strategy::Offload => NcclGroup::without_collectives(&contexts),
        };
        // The watchdog of each rank aborts the group when its device stops progressing.
        for b in &backends {
            let g = group.clone();
            b.set_on_stall(Box::new(move |why| g.poison(why)));
        }
        // Free memory is read only now: after NCCL's buffers, and after a warm-up has
        // loaded the kernel modules and created the cuBLAS handle and workspace, which
        // all come out of the same memory the slots would be sized into.
        let needs = o.needs;
        let mut capacities = Vec::with_capacity(dp);
        let mut slots = usize::MAX;
        for b in &backends {
            warm_up(b.device(), o.dtype).map_err(|e| crate::Error::Rank {
                rank: b.rank(),
                msg: format!("warm-up: {e}"),
            })?;
            let (free, total) = b.mem_info()?;
            let cap = budget_capacity(free, total, o.weights_budget, o.activations);
            let k =
                choose_slots(o.slots, o.strategy, needs, cap).map_err(|e| crate::Error::Rank {
                    rank: b.rank(),
                    msg: e.to_string(),
                })?;
            tracing::info!(
                rank = b.rank(),
                free,
                total,
                capacity = cap,
                slots = k,
                "device memory after initialisation"
            );
            slots = slots.min(k);
            capacities.push(cap);
        }
        let ranks = backends
            .into_iter()
            .zip(comms)
            .zip(capacities)
            .map(|((backend, comm), capacity)| CudaRank {
                backend,
                comm,
                capacity,
            })
            .collect();
        Ok(CudaRanks {
            ranks,
            group,
            host,
            slots,
        })
    }
}

#[cfg(feature = "cuda")]
pub use setup::{setup, CudaOptions, CudaRank, CudaRanks};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_is_always_available() {
        assert!(matches!(
            resolve(DeviceChoice::Cpu, 4).unwrap(),
            Resolved::Cpu { .. }
        ));
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn without_the_feature_cuda_is_refused_and_auto_falls_back() {
        let e = resolve(DeviceChoice::Cuda, 1).unwrap_err().to_string();
        assert!(e.contains("without the `cuda` feature"), "{e}");
        let Resolved::Cpu { why } = resolve(DeviceChoice::Auto, 1).unwrap() else {
            panic!("auto chose cuda")
        };
        assert!(why.contains("`cuda` feature"), "{why}");
    }
}
