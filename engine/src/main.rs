//! `layerwise`: the command line (`layerwise_engine::cli`). This executable links no CUDA
//! library, so it starts on any machine; a command that may use a GPU runs inside the CUDA
//! library beside it once the NVIDIA driver loads (`layerwise_engine::launch`).

/// Counts every heap byte, so `--stats`, `bench` and the server's metrics report what the
/// CPU backend's phases really hold (`layerwise_engine::measure`).
#[global_allocator]
static ALLOC: layerwise_engine::measure::CountingAlloc = layerwise_engine::measure::CountingAlloc;

fn main() {
    std::process::exit(layerwise_engine::launch::main(
        std::env::args_os().collect(),
    ));
}
