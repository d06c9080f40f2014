//! Records the NVIDIA driver library as needed by this library whatever `libcuda.so` the
//! link saw. A driver or a toolkit's stub defines every symbol cudarc asks for, but the
//! link-only placeholder of engine/cuda-check (on a machine without a driver) defines
//! none, and the linker's `--as-needed` would then drop the entry. The driver must be
//! among this library's own dependencies: the executable opens it `RTLD_LOCAL`, so its
//! symbols reach this library only through that entry.

fn main() {
    println!("cargo:rustc-link-arg-cdylib=-Wl,--push-state,--no-as-needed,-lcuda,--pop-state");
}
