//! Scaled dot-product attention whose working memory does not grow with the square of
//! the sequence: a 480p, 81-frame Wan request is about 32k tokens, whose full score
//! matrix (40 heads × 32k × 32k × 4 bytes, 170 GB per sample) fits no device.
//!
//! On a CUDA device attention runs as one fused kernel (`execution::cuda::attention`): it
//! walks the keys in tiles with an online softmax, so scores only ever exist in a block's
//! shared memory. Everywhere else, and on CUDA when [`ATTENTION_KERNEL_ENV`] asks for it,
//! queries go through in chunks of rows sized so one chunk's scores and softmax stay under
//! [`ATTENTION_CHUNK_BYTES`]. Either way every row sees every key and its softmax is the
//! ordinary, max-subtracted one: nothing is approximated. The two differ in summation
//! order (within about 1e-6 relative of each other), never within one device: every
//! strategy, dp and K runs the same path on the same shapes, so outputs stay bit-identical
//! across them.
//!
//! The budget, [`attention_peak_bytes`] and the kernel choice are metadata (the planner
//! sizes activation memory with them, without the compute runtime); the math needs
//! `runtime`.

use std::sync::OnceLock;

use crate::{Error, Result};

/// Most bytes one chunk's scores and their softmax may hold. Larger chunks mean fewer,
/// fuller matrix products (on a GPU each chunk costs a handful of kernel launches); at
/// this size a 14B Wan request at 480p × 81 frames runs 51 query rows per chunk, and a
/// request whose whole score matrix fits runs in one chunk.
pub const ATTENTION_CHUNK_BYTES: u64 = 512 << 20;

/// Query rows per chunk for `heads` heads attending from `sq` queries to `sk` keys:
/// as many as keep the chunk's scores and softmax (2 × heads × rows × sk × 4 bytes)
/// within `budget`, at least one, at most `sq`. Depends on neither the batch nor the
/// device, so every rank splits a sample the same way.
pub fn chunk_rows(heads: usize, sq: usize, sk: usize, budget: u64) -> usize {
    let per_row = 2 * 4 * heads.max(1) as u64 * sk.max(1) as u64;
    let rows = (budget / per_row).max(1);
    usize::try_from(rows).unwrap_or(usize::MAX).min(sq.max(1))
}

/// Peak bytes of attention's working memory (scores and softmax of one chunk) for a
/// batch of `b` samples with `h` heads, `sq` queries and `sk` keys. Samples run one
/// after another, so `b` does not multiply it; the result stays within
/// [`ATTENTION_CHUNK_BYTES`] unless a single query row (2 × h × sk × 4 bytes) exceeds it.
///
/// One formula for every device: the planner does not know which kind a pod gets, and
/// this bounds both paths. The chunks hold exactly this; the fused CUDA kernel holds its
/// scores in on-chip shared memory (a fixed ~38 KiB per resident block, no device memory
/// at all) and allocates nothing in device memory but its output, which the families
/// count per token like any other activation. So on CUDA the term is headroom, not need.
pub fn attention_peak_bytes(b: usize, h: usize, sq: usize, sk: usize) -> u64 {
    if b == 0 || sq == 0 || sk == 0 {
        return 0;
    }
    let rows = chunk_rows(h, sq, sk, ATTENTION_CHUNK_BYTES) as u64;
    2 * 4 * h as u64 * rows * sk as u64
}

/// The environment variable that picks the attention path on CUDA: `fused` (the default)
/// or `chunked` (the query chunks every other device runs; for comparing the two, as
/// engine/gpu-check does). Read once per process; the CPU always runs in chunks.
pub const ATTENTION_KERNEL_ENV: &str = "LAYERWISE_ATTENTION";

/// Which attention path CUDA tensors take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionKernel {
    /// The fused kernel, when it takes the shapes (head dims up to 128); else chunks.
    Fused,
    /// Query chunks, as on the CPU.
    Chunked,
}

impl AttentionKernel {
    /// The path [`ATTENTION_KERNEL_ENV`] names; unset or empty is `fused`.
    pub fn parse(value: Option<&str>) -> Result<Self> {
        match value.map(str::trim) {
            None | Some("") | Some("fused") => Ok(Self::Fused),
            Some("chunked") => Ok(Self::Chunked),
            Some(other) => Err(Error::invalid(
                ATTENTION_KERNEL_ENV,
                format!("`{other}`: want `fused` or `chunked`"),
            )),
        }
    }

    /// This process's choice, from [`ATTENTION_KERNEL_ENV`] as it was at the first call.
    pub fn from_env() -> Result<Self> {
        static VALUE: OnceLock<Option<String>> = OnceLock::new();
        let value = VALUE.get_or_init(|| {
            std::env::var_os(ATTENTION_KERNEL_ENV).map(|v| v.to_string_lossy().into_owned())
        });
        Self::parse(value.as_deref())
    }
}

#[cfg(feature = "runtime")]
pub use compute::{attention, attention_with_budget, causal_attention};

#[cfg(feature = "runtime")]
mod compute {
    use candle_core::Tensor;

    use super::{chunk_rows, AttentionKernel, ATTENTION_CHUNK_BYTES};
    use crate::components::flops::matmul;
    use crate::{Error, Result};

    /// softmax(q kᵀ · scale) v for q [B, H, Sq, D], k [B, H, Sk, D], v [B, H, Sk, Dv]:
    /// [B, H, Sq, Dv]. On a CUDA device the fused kernel (unless [`super::ATTENTION_KERNEL_ENV`]
    /// says `chunked`, or a head dim exceeds what it takes), elsewhere query chunks within
    /// [`ATTENTION_CHUNK_BYTES`].
    pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
        check_shapes(q, k, v)?;
        if AttentionKernel::from_env()? == AttentionKernel::Fused {
            if let Some(out) = fused(q, k, v, scale)? {
                // The kernel's two products, q kᵀ and p v, over every (query, key) pair.
                let (b, h, sq, d) = q.dims4()?;
                let (sk, dv) = (k.dim(2)?, v.dim(3)?);
                crate::components::flops::add(
                    crate::components::flops::product_flops(b * h, sq, d, sk)
                        + crate::components::flops::product_flops(b * h, sq, sk, dv),
                );
                return Ok(out);
            }
        }
        attention_with_budget(q, k, v, scale, ATTENTION_CHUNK_BYTES)
    }

    /// The fused kernel's result, for tensors on a CUDA device whose shapes it takes.
    #[cfg(feature = "cuda")]
    fn fused(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Option<Tensor>> {
        if !q.device().is_cuda() {
            return Ok(None);
        }
        crate::execution::cuda::attention::fused_attention(q, k, v, scale)
    }

    /// Builds without CUDA hold no CUDA tensors.
    #[cfg(not(feature = "cuda"))]
    fn fused(_: &Tensor, _: &Tensor, _: &Tensor, _: f64) -> Result<Option<Tensor>> {
        Ok(None)
    }

    /// (B, H, Sq, Sk) of q [B, H, Sq, D], k [B, H, Sk, D], v [B, H, Sk, Dv], or an error
    /// naming the shapes.
    fn check_shapes(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(usize, usize, usize, usize)> {
        let refuse = || {
            Error::bug(format!("attention: q {:?}, k {:?}, v {:?}: want [B, H, Sq, D], [B, H, Sk, D], [B, H, Sk, Dv] with Sq, Sk ≥ 1",
                    q.dims(),
                    k.dims(),
                    v.dims()
                ),
            )
        };
        let (b, h, sq, d) = q.dims4().map_err(|_| refuse())?;
        let (kb, kh, sk, kd) = k.dims4().map_err(|_| refuse())?;
        let (vb, vh, vs, _) = v.dims4().map_err(|_| refuse())?;
        if (kb, kh, kd) != (b, h, d) || (vb, vh, vs) != (b, h, sk) || sq == 0 || sk == 0 {
            return Err(refuse());
        }
        Ok((b, h, sq, sk))
    }

    /// Causal attention: query row i attends to keys 0..=i, for q, k, v [B, H, S, D] of one
    /// length. In query chunks within [`ATTENTION_CHUNK_BYTES`] on every device (no fused
    /// kernel), each chunk against the keys up to its last row with the later ones masked.
    pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
        let (b, h, sq, sk) = check_shapes(q, k, v)?;
        if sq != sk {
            return Err(Error::bug(format!(
                "attention: causal attention over {sq} queries and {sk} keys: want one length"
            )));
        }
        let rows = chunk_rows(h, sq, sk, ATTENTION_CHUNK_BYTES);
        let mut samples = Vec::with_capacity(b);
        for i in 0..b {
            let (qi, ki, vi) = (q.get(i)?, k.get(i)?.contiguous()?, v.get(i)?.contiguous()?);
            let mut chunks = Vec::with_capacity(sq.div_ceil(rows));
            let mut start = 0;
            while start < sq {
                let n = rows.min(sq - start);
                let keys = start + n;
                let mask: Vec<f32> = (0..n)
                    .flat_map(|r| {
                        (0..keys).map(move |c| {
                            if c > start + r {
                                f32::NEG_INFINITY
                            } else {
                                0.0
                            }
                        })
                    })
                    .collect();
                let mask = Tensor::from_vec(mask, (n, keys), q.device())?.to_dtype(q.dtype())?;
                let qc = (qi.narrow(1, start, n)? * scale)?;
                let kt = ki.narrow(1, 0, keys)?.t()?;
                let scores = matmul(&qc, &kt)?.broadcast_add(&mask)?;
                let probs = softmax(&scores)?;
                chunks.push(matmul(&probs, &vi.narrow(1, 0, keys)?.contiguous()?)?);
                start += n;
            }
            samples.push(Tensor::cat(&chunks, 1)?);
        }
        Ok(Tensor::stack(&samples, 0)?)
    }

    /// The fewest query rows a chunk of [`attention_with_budget`] runs with, against `sk`
    /// keys of value width `dv`: enough that the CPU's matrix products take their general
    /// path (not the one-row, at-most-256-outputs or at-most-64 × 64 ones), whose sums run
    /// over the inner dimension in an order set by its length alone. So a query row's
    /// output does not depend on how many rows share its chunk: a rank holding part of a
    /// sequence ([`crate::execution::seq::Split`]) computes its rows' bits as the whole
    /// would. Chunks with fewer rows run padded with zero queries (small ones only: at
    /// video sizes chunks hold more than this).
    pub fn general_rows(sk: usize, dv: usize) -> usize {
        let narrow = sk.min(dv).max(1);
        let past_small = if narrow <= 64 { 65 } else { 2 };
        (256 / narrow + 1).max(past_small)
    }

    /// Softmax over the last dimension: the fused kernel for f32 on the CPU, else candle's.
    pub(super) fn softmax(scores: &Tensor) -> Result<Tensor> {
        if crate::components::fused::fast(&[scores]) {
            return crate::components::fused::softmax_scaled(scores, 1.0);
        }
        Ok(candle_nn::ops::softmax_last_dim(scores)?)
    }

    /// [`attention`] in query chunks within `budget`, on any device (tests force many
    /// chunks with it; on CUDA it is what `chunked` runs).
    pub fn attention_with_budget(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        scale: f64,
        budget: u64,
    ) -> Result<Tensor> {
        let (b, h, sq, sk) = check_shapes(q, k, v)?;
        let rows = chunk_rows(h, sq, sk, budget);
        let floor = general_rows(sk, v.dim(3)?);
        // One sample at a time: its chunks, and so its bits, do not depend on which
        // other samples share the batch.
        let mut samples = Vec::with_capacity(b);
        for i in 0..b {
            let (qi, vi) = (q.get(i)?, v.get(i)?.contiguous()?);
            let kt = k.get(i)?.contiguous()?.t()?;
            let mut chunks = Vec::with_capacity(sq.div_ceil(rows));
            let mut start = 0;
            while start < sq {
                let n = rows.min(sq - start);
                // Scaling the queries costs rows × D, scaling the scores rows × Sk.
                let qc = qi.narrow(1, start, n)?;
                let qc = if n < floor {
                    qc.pad_with_zeros(1, 0, floor - n)?
                } else {
                    qc
                };
                let probs = softmax(&matmul(&(qc * scale)?, &kt)?)?;
                let out = matmul(&probs, &vi)?;
                chunks.push(if n < floor { out.narrow(1, 0, n)? } else { out });
                start += n;
            }
            samples.push(Tensor::cat(&chunks, 1)?);
        }
        Ok(Tensor::stack(&samples, 0)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_bytes_stay_within_the_budget_for_video_sizes() {
        // Wan 14B (40 heads) and 1.3B (12) at 480p × 81 frames: 21 × 30 × 52 tokens.
        let s = 21 * 30 * 52;
        for h in [12, 40] {
            let peak = attention_peak_bytes(2, h, s, s);
            assert!(peak <= ATTENTION_CHUNK_BYTES, "{h} heads: {peak}");
            // Not wastefully small either: more than half the budget is used.
            assert!(peak > ATTENTION_CHUNK_BYTES / 2, "{h} heads: {peak}");
            assert_eq!(peak, attention_peak_bytes(1, h, s, s));
        }
        // Small requests hold only what they need.
        assert_eq!(attention_peak_bytes(2, 2, 36, 36), 2 * 4 * 2 * 36 * 36);
        // Cross-attention to 512 text tokens chunks too (5.4 GB at once).
        assert_eq!(chunk_rows(40, s, 512, ATTENTION_CHUNK_BYTES), 3276);
        assert!(attention_peak_bytes(2, 40, s, 512) <= ATTENTION_CHUNK_BYTES);
        assert_eq!(chunk_rows(40, s, s, ATTENTION_CHUNK_BYTES), 51);
        assert_eq!(chunk_rows(1, 10, 1 << 40, 1), 1);
    }

    #[test]
    fn the_kernel_choice_is_fused_unless_chunked_is_asked_for() {
        use AttentionKernel::*;
        assert_eq!(AttentionKernel::parse(None).unwrap(), Fused);
        assert_eq!(AttentionKernel::parse(Some("")).unwrap(), Fused);
        assert_eq!(AttentionKernel::parse(Some("fused")).unwrap(), Fused);
        assert_eq!(AttentionKernel::parse(Some(" chunked\n")).unwrap(), Chunked);
        let e = AttentionKernel::parse(Some("flash"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(ATTENTION_KERNEL_ENV) && e.contains("flash"),
            "{e}"
        );
    }

    #[cfg(feature = "runtime")]
    mod compute {
        use candle_core::{Device, Tensor};

        use super::super::compute::softmax;
        use super::super::{attention, attention_with_budget, chunk_rows};

        fn random(seed: u64, shape: &[usize]) -> Tensor {
            crate::execution::weights::seeded_noise(seed, shape).unwrap()
        }

        /// The whole score matrix at once, through the softmax the chunks run: the
        /// reference the chunks must reproduce.
        fn unchunked(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Tensor {
            let scores = (q.matmul(&k.t().unwrap()).unwrap() * scale).unwrap();
            softmax(&scores).unwrap().matmul(v).unwrap()
        }

        use crate::testing::max_abs_diff;

        #[test]
        fn chunked_equals_unchunked() {
            let (b, h, sq, sk, d) = (2, 3, 37, 29, 8);
            // Scores of a few units, so the softmax is far from uniform.
            let q = (random(1, &[b, h, sq, d]) * 2.0).unwrap();
            let k = random(2, &[b, h, sk, d]);
            let v = random(3, &[b, h, sk, 5]);
            let scale = 1.0 / (d as f64).sqrt();
            let reference = unchunked(&q, &k, &v, scale);
            // Budgets of 1 row, 4 rows, an uneven 10 (37 = 3 × 10 + 7) and everything.
            for rows in [1u64, 4, 10, 1000] {
                let budget = rows * 2 * 4 * (h * sk) as u64;
                assert_eq!(
                    chunk_rows(h, sq, sk, budget),
                    (rows as usize).min(sq),
                    "{rows}"
                );
                let ours = attention_with_budget(&q, &k, &v, scale, budget).unwrap();
                assert_eq!(ours.dims(), &[b, h, sq, 5]);
                let diff = max_abs_diff(&ours, &reference);
                assert!(diff < 1e-6, "{rows} rows per chunk: {diff}");
            }
            let default = attention(&q, &k, &v, scale).unwrap();
            assert!(max_abs_diff(&default, &reference) < 1e-6);
        }

        #[test]
        fn a_sample_does_not_depend_on_its_batch() {
            let (h, s, d) = (2, 23, 4);
            let q = random(4, &[2, h, s, d]);
            let k = random(5, &[2, h, s, d]);
            let v = random(6, &[2, h, s, d]);
            let budget = 3 * 2 * 4 * (h * s) as u64;
            let both = attention_with_budget(&q, &k, &v, 0.5, budget).unwrap();
            for i in 0..2 {
                let one = |t: &Tensor| t.narrow(0, i, 1).unwrap();
                let alone = attention_with_budget(&one(&q), &one(&k), &one(&v), 0.5, budget)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
                let shared = one(&both).flatten_all().unwrap().to_vec1::<f32>().unwrap();
                assert_eq!(alone, shared, "sample {i}");
            }
        }

        #[test]
        fn mismatched_shapes_are_refused() {
            let q = Tensor::zeros((1, 2, 3, 4), candle_core::DType::F32, &Device::Cpu).unwrap();
            let k = Tensor::zeros((1, 2, 5, 6), candle_core::DType::F32, &Device::Cpu).unwrap();
            let e = attention(&q, &k, &k, 1.0).unwrap_err().to_string();
            assert!(e.contains("attention"), "{e}");
        }
    }
}
