//! The fused attention kernel on CUDA (`kernels/attention.cu`): softmax(q kᵀ · scale) v in
//! one pass over the keys with an online softmax, so no score matrix, not even a chunk of
//! one, exists in device memory. `components::attention` sends attention on CUDA tensors here
//! and keeps its query chunks on the CPU.
//!
//! The launch geometry and limits below are the kernel's (a test reads them from the
//! source) and are compiled in every build; the launch itself needs the `cuda` feature,
//! whose build script compiles the kernel to PTX (engine/build.rs). The kernel source is
//! tested on every machine by running it on the host through `kernels/emulate.h`
//! (engine/tests/attention_kernel.rs).

/// Query rows one block computes (`kRows`).
pub const ROWS_PER_BLOCK: usize = 32;
/// Threads per block (`kThreads`).
pub const THREADS_PER_BLOCK: u32 = 128;
/// Largest head dimension of queries and keys, and of values (`kMaxDim`).
pub const MAX_HEAD_DIM: usize = 128;
/// Keys per tile staged in shared memory (`kKeys`).
pub const KEYS_PER_TILE: usize = 32;
/// Shared memory of one block: the query tile, the K/V tile (rows of `MAX_HEAD_DIM + 4`
/// floats), the probability tile and one float per row. All the working memory the kernel
/// has, whatever the sequence lengths.
pub const SHARED_BYTES: usize = 4
    * (ROWS_PER_BLOCK * (MAX_HEAD_DIM + 4)
        + KEYS_PER_TILE * (MAX_HEAD_DIM + 4)
        + ROWS_PER_BLOCK * (KEYS_PER_TILE + 4)
        + ROWS_PER_BLOCK);

// Static shared memory stops at 48 KiB; more needs an opt-in at launch.
const _: () = assert!(SHARED_BYTES <= 48 << 10);

/// Blocks of a launch for `bh` (sample, head) pairs of `sq` queries, when the kernel
/// takes this problem: head dims within [`MAX_HEAD_DIM`], a grid within CUDA's
/// 2³¹ − 1 blocks and lengths that fit its `int` arguments.
pub fn grid_blocks(bh: usize, sq: usize, sk: usize, d: usize, dv: usize) -> Option<u32> {
    let dims_fit = (1..=MAX_HEAD_DIM).contains(&d) && (1..=MAX_HEAD_DIM).contains(&dv);
    let lengths_fit = sq > 0 && sk > 0 && i32::try_from(sq.max(sk)).is_ok();
    if !dims_fit || !lengths_fit || bh == 0 {
        return None;
    }
    let blocks = bh.checked_mul(sq.div_ceil(ROWS_PER_BLOCK))?;
    u32::try_from(blocks).ok().filter(|&b| b <= i32::MAX as u32)
}

#[cfg(feature = "cuda")]
pub use fused::fused_attention;

#[cfg(feature = "cuda")]
mod fused {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{CpuStorage, CudaStorage, CustomOp3, DType, Layout, Shape, Tensor};

    use super::{grid_blocks, THREADS_PER_BLOCK};
    use crate::Result;

    /// The kernel as PTX for a virtual architecture, JIT-compiled by the driver on first
    /// use for the GPU at hand (engine/build.rs says which architecture and why).
    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/attention.ptx"));
    const MODULE: &str = "layerwise_attention";
    const FUNCTION: &str = "layerwise_attention_f32";

    /// softmax(q kᵀ · scale) v for q [B, H, Sq, D], k [B, H, Sk, D], v [B, H, Sk, Dv] on one
    /// CUDA device, with f32 scores, sums and accumulation whatever the inputs' dtype (f16
    /// and bf16 inputs are widened first, the output narrowed back). `None` when the kernel
    /// does not take these shapes (a head dim above 128, a grid beyond CUDA's): the caller
    /// computes in chunks instead.
    pub fn fused_attention(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        scale: f64,
    ) -> Result<Option<Tensor>> {
        let (b, h, sq, d) = q.dims4()?;
        let (_, _, sk, dv) = v.dims4()?;
        if grid_blocks(b * h, sq, sk, d, dv).is_none() {
            return Ok(None);
        }
        let dtype = q.dtype();
        let f32 = |t: &Tensor| -> Result<Tensor> { Ok(t.to_dtype(DType::F32)?.contiguous()?) };
        let op = FusedAttention {
            scale: scale as f32,
        };
        let out = f32(q)?.apply_op3_no_bwd(&f32(k)?, &f32(v)?, &op)?;
        Ok(Some(out.to_dtype(dtype)?))
    }

    struct FusedAttention {
        scale: f32,
    }

    fn refused(msg: String) -> candle_core::Error {
        candle_core::Error::Msg(format!("fused attention: {msg}"))
    }

    impl CustomOp3 for FusedAttention {
        fn name(&self) -> &'static str {
            "fused-attention"
        }

        fn cpu_fwd(
            &self,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> candle_core::Result<(CpuStorage, Shape)> {
            Err(refused(
                "runs on CUDA only; on the CPU attention runs in query chunks".into(),
            ))
        }

        fn cuda_fwd(
            &self,
            qs: &CudaStorage,
            ql: &Layout,
            ks: &CudaStorage,
            kl: &Layout,
            vs: &CudaStorage,
            vl: &Layout,
        ) -> candle_core::Result<(CudaStorage, Shape)> {
            let (b, h, sq, d) = ql.shape().dims4()?;
            let (kb, kh, sk, kd) = kl.shape().dims4()?;
            let (vb, vh, vk, dv) = vl.shape().dims4()?;
            if (kb, kh, kd) != (b, h, d) || (vb, vh, vk) != (b, h, sk) {
                return Err(refused(format!(
                    "q {:?}, k {:?}, v {:?} do not agree",
                    ql.dims(),
                    kl.dims(),
                    vl.dims()
                )));
            }
            if !(ql.is_contiguous() && kl.is_contiguous() && vl.is_contiguous()) {
                return Err(refused("q, k and v must be contiguous".into()));
            }
            let blocks = grid_blocks(b * h, sq, sk, d, dv).ok_or_else(|| {
                refused(format!(
                    "sq {sq}, sk {sk}, d {d}, dv {dv} for {} heads are beyond the kernel",
                    b * h
                ))
            })?;
            let dev = qs.device();
            let q = qs.as_cuda_slice::<f32>()?.slice(ql.start_offset()..);
            let k = ks.as_cuda_slice::<f32>()?.slice(kl.start_offset()..);
            let v = vs.as_cuda_slice::<f32>()?.slice(vl.start_offset()..);
            // SAFETY: every element is written by the kernel before anyone reads it (each
            // query row of each head belongs to exactly one block, which writes all of its
            // Dv values).
            let out = unsafe { dev.alloc::<f32>(b * h * sq * dv) }?;
            let func = dev.get_or_load_custom_func(FUNCTION, MODULE, PTX)?;
            // In range: grid_blocks accepted the lengths as i32.
            let (sq_i, sk_i, d_i, dv_i) = (sq as i32, sk as i32, d as i32, dv as i32);
            let mut launch = func.builder();
            launch.arg(&q);
            launch.arg(&k);
            launch.arg(&v);
            launch.arg(&out);
            launch.arg(&sq_i);
            launch.arg(&sk_i);
            launch.arg(&d_i);
            launch.arg(&dv_i);
            launch.arg(&self.scale);
            let cfg = LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (THREADS_PER_BLOCK, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the arguments match the kernel's signature (three const float
            // pointers, one float pointer, four ints, a float); q, k and v hold
            // [B·H, S, D|Dv] contiguous f32 from their offsets and `out` holds B·H·Sq·Dv,
            // which is all the kernel reads and writes for this grid.
            unsafe { launch.launch(cfg) }.w()?;
            Ok((
                CudaStorage::wrap_cuda_slice(out, dev.clone()),
                Shape::from((b, h, sq, dv)),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The constants of the kernel source, which the launch and the emulation both use.
    fn kernel_constant(name: &str) -> usize {
        let src = include_str!("kernels/attention.cu");
        let prefix = format!("constexpr int {name} = ");
        let line = src
            .lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .unwrap_or_else(|| panic!("attention.cu declares no `{prefix}`"));
        let value = line.split(';').next().unwrap().trim();
        value.parse().unwrap_or_else(|_| panic!("{name} = {value}"))
    }

    #[test]
    fn launch_geometry_matches_the_kernel() {
        assert_eq!(kernel_constant("kRows"), ROWS_PER_BLOCK);
        assert_eq!(kernel_constant("kKeys"), KEYS_PER_TILE);
        assert_eq!(kernel_constant("kThreads"), THREADS_PER_BLOCK as usize);
        assert_eq!(kernel_constant("kMaxDim"), MAX_HEAD_DIM);
    }

    #[test]
    fn grid_covers_every_row_and_refuses_what_the_kernel_cannot_take() {
        assert_eq!(grid_blocks(80, 32760, 32760, 128, 128), Some(80 * 1024));
        assert_eq!(grid_blocks(3, 33, 7, 4, 5), Some(6));
        assert_eq!(grid_blocks(1, 1, 1, 1, 1), Some(1));
        assert_eq!(grid_blocks(1, 10, 10, 129, 64), None);
        assert_eq!(grid_blocks(1, 10, 10, 64, 256), None);
        assert_eq!(grid_blocks(1, 0, 10, 64, 64), None);
        assert_eq!(grid_blocks(1, 10, 1 << 31, 64, 64), None);
        assert_eq!(grid_blocks(1 << 40, 10, 10, 64, 64), None);
    }
}
