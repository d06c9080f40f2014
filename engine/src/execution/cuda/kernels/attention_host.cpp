// Runs attention.cu's kernel on the host through emulate.h (engine/tests/attention_kernel.rs
// builds and drives it):
//
//   attention_host CASE OUT
//
// CASE: u32 bh, sq, sk, d, dv; f32 scale; then q [bh, sq, d], k [bh, sk, d], v [bh, sk, dv]
// (little-endian f32). OUT: o [bh, sq, dv]. The grid runs twice, blocks in order and in
// reverse; outputs that differ by a bit (blocks that depend on each other or on stale
// shared memory) fail the run.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "emulate.h"
#include "attention.cu"

namespace {

bool read_all(std::FILE* f, void* dst, size_t bytes) { return std::fread(dst, 1, bytes, f) == bytes; }

}  // namespace

int main(int argc, char** argv) {
    if (argc != 3) {
        std::fprintf(stderr, "usage: attention_host CASE OUT\n");
        return 2;
    }
    std::FILE* in = std::fopen(argv[1], "rb");
    if (!in) {
        std::fprintf(stderr, "attention_host: cannot open %s\n", argv[1]);
        return 2;
    }
    uint32_t dims[5];
    float scale;
    if (!read_all(in, dims, sizeof dims) || !read_all(in, &scale, sizeof scale)) {
        std::fprintf(stderr, "attention_host: %s: short header\n", argv[1]);
        return 2;
    }
    const size_t bh = dims[0], sq = dims[1], sk = dims[2], d = dims[3], dv = dims[4];
    if (d > size_t(kMaxDim) || dv > size_t(kMaxDim) || sq == 0 || sk == 0) {
        std::fprintf(stderr, "attention_host: unsupported case sq %zu sk %zu d %zu dv %zu\n", sq, sk, d, dv);
        return 2;
    }
    std::vector<float> q(bh * sq * d), k(bh * sk * d), v(bh * sk * dv);
    if (!read_all(in, q.data(), q.size() * 4) || !read_all(in, k.data(), k.size() * 4) ||
        !read_all(in, v.data(), v.size() * 4)) {
        std::fprintf(stderr, "attention_host: %s: short data\n", argv[1]);
        return 2;
    }
    std::fclose(in);

    const dim3 grid{unsigned(bh * ((sq + kRows - 1) / kRows)), 1, 1};
    const dim3 block{unsigned(kThreads), 1, 1};
    std::vector<float> o(bh * sq * dv, NAN), again(bh * sq * dv, NAN);
    emulate::launch(layerwise_attention_f32, grid, block, false, q.data(), k.data(), v.data(),
                    o.data(), int(sq), int(sk), int(d), int(dv), scale);
    emulate::launch(layerwise_attention_f32, grid, block, true, q.data(), k.data(), v.data(),
                    again.data(), int(sq), int(sk), int(d), int(dv), scale);
    if (std::memcmp(o.data(), again.data(), o.size() * 4) != 0) {
        std::fprintf(stderr, "attention_host: the output depends on the order blocks run in\n");
        return 3;
    }

    std::FILE* out = std::fopen(argv[2], "wb");
    if (!out || std::fwrite(o.data(), 4, o.size(), out) != o.size() || std::fclose(out) != 0) {
        std::fprintf(stderr, "attention_host: cannot write %s\n", argv[2]);
        return 2;
    }
    return 0;
}
