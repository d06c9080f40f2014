// Fused scaled-dot-product attention: o = softmax(q kᵀ · scale) v, one pass over the keys
// per block of query rows, without the [Sq, Sk] score matrix ever existing in memory.
//
// A block owns kRows query rows of one (batch, head). It walks the keys in tiles of kKeys,
// staging each K tile and then the V tile in shared memory, and keeps per row a running
// maximum m and a running sum l of exp(score − m): when a tile raises a row's maximum, the
// row's sum and its output accumulator are rescaled by exp(m_old − m_new) before the tile's
// contribution is added (the "online softmax"). Scores, sums and the accumulator are f32.
// Working memory is the block's shared tiles (38 KiB), whatever Sq and Sk.
//
// Layout: q [BH, Sq, D], k [BH, Sk, D], v [BH, Sk, Dv], o [BH, Sq, Dv], contiguous, f32,
// with D, Dv ≤ kMaxDim. Launch: kThreads threads per block, a 1-D grid of
// BH × ceil(Sq / kRows) blocks (engine/src/execution/cuda/attention.rs holds the same
// numbers; a test compares them).
//
// Built to PTX for a virtual architecture (see engine/build.rs). The same source compiles
// with a host C++ compiler through kernels/emulate.h, which is how the tests run it on
// machines without a GPU: it must stay within what that header emulates (no warp
// intrinsics, no reliance on implicit warp synchrony; every thread reaches every
// __syncthreads).

constexpr int kRows = 32;     // query rows per block
constexpr int kKeys = 32;     // keys per tile (a power of two: the softmax rotates by it)
constexpr int kThreads = 128; // threads per block
constexpr int kMaxDim = 128;  // largest D and Dv

// Row strides of the shared tiles, in floats. Multiples of 4 so rows can be read as
// float4; the +4 spreads a warp's reads of different rows over all banks.
constexpr int kStride = kMaxDim + 4;
constexpr int kPStride = kKeys + 4;

// Scores: each thread computes 4 rows × 2 keys of the kRows × kKeys tile.
constexpr int kScoreCols = 16; // threads across the keys
constexpr int kScoreRowStep = kThreads / kScoreCols;
// Output: each thread owns one float4 column of up to 8 rows.
constexpr int kOutRows = 8;

static_assert((kKeys & (kKeys - 1)) == 0, "kKeys must be a power of two");
static_assert(kRows * kKeys == kThreads * 4 * 2, "score micro-tile is 4 x 2");
static_assert(kScoreRowStep * 4 == kRows && kScoreCols * 2 == kKeys, "score mapping");
static_assert(kThreads >= 2 * kRows, "the softmax warp and the V loaders run side by side");
static_assert(kRows * (kMaxDim / 4) <= kThreads * kOutRows, "output registers");

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }

__device__ __forceinline__ float dot4(float4 a, float4 b, float acc) {
    acc += a.x * b.x;
    acc += a.y * b.y;
    acc += a.z * b.z;
    acc += a.w * b.w;
    return acc;
}

// Copies rows [0, valid) of a [rows, cols] row-major matrix into a tile of kStride floats
// per row, zero-filling the rest of the first `rows` rows up to a multiple of 4 columns
// (padding must read as zero: a masked key's probability is 0, and 0 × garbage could be NaN).
// Threads first, first + step, ... share the work.
__device__ __forceinline__ void load_tile(float* tile, const float* __restrict__ src, int valid,
                                          int rows, int cols, int first, int step) {
    const int quads = (cols + 3) / 4;
    for (int item = first; item < rows * quads; item += step) {
        const int r = item / quads;
        const int c = (item - r * quads) * 4;
        float x[4];
        for (int i = 0; i < 4; ++i) {
            x[i] = (r < valid && c + i < cols) ? src[(long long)r * cols + c + i] : 0.0f;
        }
        *reinterpret_cast<float4*>(tile + r * kStride + c) = make_float4(x[0], x[1], x[2], x[3]);
    }
}

extern "C" __global__ void __launch_bounds__(kThreads)
    layerwise_attention_f32(const float* __restrict__ q, const float* __restrict__ k,
                            const float* __restrict__ v, float* __restrict__ o, int sq, int sk,
                            int d, int dv, float scale) {
    __shared__ __align__(16) float q_s[kRows * kStride];
    __shared__ __align__(16) float kv_s[kKeys * kStride]; // the K tile, then the V tile
    __shared__ __align__(16) float p_s[kRows * kPStride]; // scores, then probabilities
    __shared__ float row_s[kRows]; // per tile the rescale factor, at the end 1 / l

    const int tid = threadIdx.x;
    const int tiles = (sq + kRows - 1) / kRows;
    const long long bh = blockIdx.x / tiles;
    const int row0 = (blockIdx.x % tiles) * kRows;
    const int rows = imin(kRows, sq - row0);
    const float* kb = k + bh * sk * d;
    const float* vb = v + bh * sk * dv;
    const int dq = (d + 3) / 4;
    const int vq = (dv + 3) / 4;

    // Score micro-tile: rows sr + kScoreRowStep·i, keys sc + kScoreCols·j.
    const int sr = tid / kScoreCols;
    const int sc = tid % kScoreCols;
    // Output: column quad `oq` of rows og + ostep·i. Threads across the columns are
    // rounded up to a power of two so a warp shares rows (P reads are broadcasts).
    int ocols = 1;
    while (ocols < vq) ocols *= 2;
    const int oq = tid % ocols;
    const int og = tid / ocols;
    const int ostep = kThreads / ocols;
    const bool owns = oq < vq;

    // The softmax state of row `tid` (threads below kRows only).
    float m_run = -INFINITY;
    float l_run = 0.0f;
    float4 acc[kOutRows];
#pragma unroll
    for (int i = 0; i < kOutRows; ++i) acc[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);

    load_tile(q_s, q + (bh * sq + row0) * d, rows, kRows, d, tid, kThreads);

    for (int kv0 = 0; kv0 < sk; kv0 += kKeys) {
        const int n = imin(kKeys, sk - kv0);
        __syncthreads(); // the previous tile's V and P are no longer read (and q_s is in)
        load_tile(kv_s, kb + (long long)kv0 * d, n, kKeys, d, tid, kThreads);
        __syncthreads();

        float s[4][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}, {0.0f, 0.0f}, {0.0f, 0.0f}};
        for (int c = 0; c < dq; ++c) {
            float4 a[4];
            float4 b[2];
#pragma unroll
            for (int i = 0; i < 4; ++i)
                a[i] = *reinterpret_cast<const float4*>(q_s + (sr + kScoreRowStep * i) * kStride + 4 * c);
#pragma unroll
            for (int j = 0; j < 2; ++j)
                b[j] = *reinterpret_cast<const float4*>(kv_s + (sc + kScoreCols * j) * kStride + 4 * c);
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 2; ++j) s[i][j] = dot4(a[i], b[j], s[i][j]);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int key = sc + kScoreCols * j;
                p_s[(sr + kScoreRowStep * i) * kPStride + key] = key < n ? s[i][j] * scale : -INFINITY;
            }
        __syncthreads(); // scores are in; K is no longer read

        if (tid < kRows) {
            // One thread per row. Each starts at its own column so the warp's reads land
            // in different banks; the order of a row's sum is fixed, so results are too.
            float* row = p_s + tid * kPStride;
            float m_new = m_run;
            for (int j = 0; j < kKeys; ++j) m_new = fmaxf(m_new, row[(j + tid) & (kKeys - 1)]);
            // m_run is -inf before the first tile: the factor is 0 and nothing is kept.
            // m_new is finite: every tile holds at least one key.
            const float alpha = expf(m_run - m_new);
            float sum = 0.0f;
            for (int j = 0; j < kKeys; ++j) {
                const int c = (j + tid) & (kKeys - 1);
                const float p = expf(row[c] - m_new);
                row[c] = p;
                sum += p;
            }
            l_run = l_run * alpha + sum;
            m_run = m_new;
            row_s[tid] = alpha;
        } else {
            load_tile(kv_s, vb + (long long)kv0 * dv, n, kKeys, dv, tid - kRows, kThreads - kRows);
        }
        __syncthreads(); // probabilities, factors and V are in

#pragma unroll
        for (int i = 0; i < kOutRows; ++i) {
            const int r = og + ostep * i;
            if (!owns || r >= kRows) continue;
            const float alpha = row_s[r];
            float4 a = acc[i];
            a.x *= alpha;
            a.y *= alpha;
            a.z *= alpha;
            a.w *= alpha;
            for (int j = 0; j < kKeys; j += 4) {
                const float4 p = *reinterpret_cast<const float4*>(p_s + r * kPStride + j);
                const float* vj = kv_s + j * kStride + 4 * oq;
                const float4 v0 = *reinterpret_cast<const float4*>(vj);
                const float4 v1 = *reinterpret_cast<const float4*>(vj + kStride);
                const float4 v2 = *reinterpret_cast<const float4*>(vj + 2 * kStride);
                const float4 v3 = *reinterpret_cast<const float4*>(vj + 3 * kStride);
                a.x += p.x * v0.x + p.y * v1.x + p.z * v2.x + p.w * v3.x;
                a.y += p.x * v0.y + p.y * v1.y + p.z * v2.y + p.w * v3.y;
                a.z += p.x * v0.z + p.y * v1.z + p.z * v2.z + p.w * v3.z;
                a.w += p.x * v0.w + p.y * v1.w + p.z * v2.w + p.w * v3.w;
            }
            acc[i] = a;
        }
    }

    __syncthreads(); // the last tile's factors are no longer read
    if (tid < kRows) row_s[tid] = 1.0f / l_run; // l ≥ 1: the row's maximum contributes exp(0)
    __syncthreads();

    float* ob = o + (bh * sq + row0) * dv;
#pragma unroll
    for (int i = 0; i < kOutRows; ++i) {
        const int r = og + ostep * i;
        if (!owns || r >= rows) continue;
        const float inv = row_s[r];
        const float out[4] = {acc[i].x * inv, acc[i].y * inv, acc[i].z * inv, acc[i].w * inv};
        for (int c = 0; c < 4 && 4 * oq + c < dv; ++c) ob[(long long)r * dv + 4 * oq + c] = out[c];
    }
}
