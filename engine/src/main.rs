//! `layerwise`: the command line (`layerwise_engine::cli`). This executable links no CUDA
//! library, so it starts on any machine; a command that may use a GPU runs inside the CUDA
//! library beside it once the NVIDIA driver loads (`layerwise_engine::launch`).

fn main() {
    std::process::exit(layerwise_engine::launch::main(
        std::env::args_os().collect(),
    ));
}
