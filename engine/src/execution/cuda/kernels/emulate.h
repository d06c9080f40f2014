// Runs this folder's CUDA kernels on the host, so tests check the kernel source itself on
// machines without a GPU: include this header, then the .cu file, and call
// emulate::launch(kernel, grid, block, args...).
//
// What it emulates, and no more: one std::thread per CUDA thread of a block, with
// threadIdx/blockIdx/blockDim/gridDim as (thread-)locals; __syncthreads() as a
// std::barrier across the block's threads, so a missing barrier shows as a race; __shared__
// arrays as function statics, shared by the block's threads. Blocks run one after another
// (the shared arrays are reused), in the order the caller asks, so a kernel whose blocks
// depend on each other or on what an earlier block left in shared memory gives different
// results for different orders. No warps: kernels written for it use no warp intrinsics
// and do not rely on implicit warp synchrony. Math comes from <math.h> (expf, fmaxf); the
// host compiler does not contract a * b + c into an FMA as nvcc does, which moves results
// by an ulp or so.
#pragma once

#include <math.h>

#include <barrier>
#include <thread>
#include <vector>

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

struct alignas(16) float4 {
    float x, y, z, w;
};

inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

namespace emulate {
inline thread_local dim3 thread_idx;
inline thread_local dim3 block_idx;
inline dim3 block_dim;
inline dim3 grid_dim;
inline std::barrier<>* block_barrier = nullptr;

// Runs `kernel` over `grid` with `block` threads per block; blocks in index order, or
// from the last to the first with `reverse`.
template <class... Params, class... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, bool reverse, Args... args) {
    const unsigned threads = block.x * block.y * block.z;
    const unsigned blocks = grid.x * grid.y * grid.z;
    std::barrier<> barrier(threads);
    block_barrier = &barrier;
    block_dim = block;
    grid_dim = grid;
    std::vector<std::thread> pool;
    pool.reserve(threads);
    for (unsigned t = 0; t < threads; ++t) {
        pool.emplace_back([&, t] {
            thread_idx = dim3{t % block.x, t / block.x % block.y, t / (block.x * block.y)};
            for (unsigned i = 0; i < blocks; ++i) {
                const unsigned b = reverse ? blocks - 1 - i : i;
                block_idx = dim3{b % grid.x, b / grid.x % grid.y, b / (grid.x * grid.y)};
                kernel(args...);
                // No thread starts the next block while another still reads the shared
                // arrays in this one.
                barrier.arrive_and_wait();
            }
        });
    }
    for (auto& t : pool) t.join();
    block_barrier = nullptr;
}
}  // namespace emulate

#define threadIdx (::emulate::thread_idx)
#define blockIdx (::emulate::block_idx)
#define blockDim (::emulate::block_dim)
#define gridDim (::emulate::grid_dim)

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)

inline void __syncthreads() { emulate::block_barrier->arrive_and_wait(); }
