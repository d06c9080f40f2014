//! How the `layerwise` executable starts on machines with and without a GPU.
//!
//! The executable links no CUDA library, so the loader never refuses it. A build with the
//! CUDA backend ships a second file beside it, `liblayerwise_cuda.so`: the same commands
//! compiled with the `cuda` feature and linked against the driver, cuBLAS, NVRTC, cuRAND
//! and NCCL. For a command that may use a GPU, the executable first opens the driver
//! library (`libcuda.so.1`, `RTLD_NOW | RTLD_LOCAL`); only when that loads does it open
//! the CUDA library and run the whole command inside it, through a plain C entry point
//! (argc and argv in, exit code out), so no Rust type crosses between the two separately
//! linked copies of the engine. Otherwise the executable runs the command itself, on the
//! CPU, and `--device auto` / `--device cuda` say why there is no GPU.

use std::ffi::{c_char, c_int, CStr, CString, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::PathBuf;

use crate::cli;
use crate::execution::cuda::{self, dl};

/// The CUDA library's file name, looked for beside the executable.
pub const LIBRARY: &str = "liblayerwise_cuda.so";
/// A path to the CUDA library, to use instead of the one beside the executable.
pub const LIBRARY_ENV: &str = "LAYERWISE_CUDA_LIBRARY";
/// `int layerwise_cuda_main(int argc, const char *const *argv)`: runs one command line.
pub const ENTRY: &CStr = c"layerwise_cuda_main";
/// `const char *layerwise_cuda_abi(void)`: the [`ABI`] the library was built with.
pub const ABI_SYMBOL: &CStr = c"layerwise_cuda_abi";
/// The engine's version and the entry point's contract. The executable hands commands
/// only to a library that answers exactly this.
pub const ABI: &CStr = match CStr::from_bytes_with_nul(
    concat!("layerwise ", env!("CARGO_PKG_VERSION"), "; entry abi 1\0").as_bytes(),
) {
    Ok(s) => s,
    Err(_) => panic!("the ABI string has a NUL inside"),
};

type Entry = unsafe extern "C" fn(c_int, *const *const c_char) -> c_int;
type AbiFn = unsafe extern "C" fn() -> *const c_char;

/// What the executable found beside itself.
pub enum Found {
    /// The CUDA library, loaded along with the driver: run the command in it.
    Cuda(CudaLibrary),
    /// No CUDA library: a CPU-only build.
    Nothing,
    /// A CUDA library that cannot run here, and why.
    Unusable(String),
}

/// The loaded CUDA library's entry point.
pub struct CudaLibrary {
    // Kept open (never closed): the entry point lives in it.
    _lib: dl::Library,
    entry: Entry,
}

impl CudaLibrary {
    /// Runs the command line `args` (the program name first) in the library and returns
    /// its exit code.
    pub fn run(&self, args: &[OsString]) -> i32 {
        // Arguments from the OS are C strings already: none holds a NUL.
        let owned: Vec<CString> = args
            .iter()
            .map(|a| CString::new(a.as_bytes()).expect("an argument without NUL bytes"))
            .collect();
        let mut argv: Vec<*const c_char> = owned.iter().map(|a| a.as_ptr()).collect();
        argv.push(std::ptr::null());
        let argc = c_int::try_from(owned.len()).expect("fewer than 2^31 arguments");
        // SAFETY: `entry` is the library's `layerwise_cuda_main`, whose signature the
        // ABI check vouched for; argv holds argc valid strings and a final null, all
        // alive for the call.
        unsafe { (self.entry)(argc, argv.as_ptr()) }
    }
}

/// Looks for the CUDA library (`$LAYERWISE_CUDA_LIBRARY`, else beside the executable)
/// and loads it if the NVIDIA driver loads.
pub fn find() -> Found {
    let (path, named) = match std::env::var_os(LIBRARY_ENV) {
        Some(p) if !p.is_empty() => (PathBuf::from(p), true),
        _ => match std::env::current_exe() {
            Ok(exe) => (exe.with_file_name(LIBRARY), false),
            Err(_) => return Found::Nothing,
        },
    };
    if !path.is_file() && named {
        return Found::Unusable(format!("{LIBRARY_ENV}={}: no such file", path.display()));
    }
    if !path.is_file() {
        return Found::Nothing;
    }
    // The driver first: without it the library cannot load, and the answer to give is
    // "no NVIDIA driver", not which of its CUDA libraries the loader missed first. The
    // handle is never closed, so the library opened next finds the driver loaded.
    if let Err(why) = dl::open_driver(false) {
        return Found::Unusable(why);
    }
    match open(&path) {
        Ok(lib) => Found::Cuda(lib),
        Err(why) => Found::Unusable(format!(
            "the CUDA library {} cannot run: {why}",
            path.display()
        )),
    }
}

fn open(path: &std::path::Path) -> Result<CudaLibrary, String> {
    let name = CString::new(path.as_os_str().as_bytes()).map_err(|e| e.to_string())?;
    let lib = dl::Library::open(&name, false)?;
    let abi = lib.symbol(ABI_SYMBOL)?;
    // SAFETY: `layerwise_cuda_abi` is `const char *(void)` in every library that exports
    // it, and returns a static NUL-terminated string.
    let theirs = unsafe {
        let abi: AbiFn = std::mem::transmute(abi);
        CStr::from_ptr(abi())
    };
    if theirs != ABI {
        return Err(format!(
            "it was built as {theirs:?} and this executable as {ABI:?}: install the pair from one build"
        ));
    }
    let entry = lib.symbol(ENTRY)?;
    // SAFETY: the ABI matched, so the entry point has the signature of `Entry`.
    let entry: Entry = unsafe { std::mem::transmute(entry) };
    Ok(CudaLibrary { _lib: lib, entry })
}

/// The executable's `main`: a command that may use a GPU runs in the CUDA library when it
/// can; everything else, and everything when it cannot, runs here.
pub fn main(args: Vec<OsString>) -> i32 {
    if cli::may_use_gpu(&args) {
        match find() {
            Found::Cuda(lib) => return lib.run(&args),
            Found::Nothing => {}
            Found::Unusable(why) => cuda::set_unusable(why),
        }
    }
    cli::main(args)
}

/// The CUDA library's side of [`ENTRY`]: decodes argv and runs the command. A panic ends
/// as exit code 101, as it would in an executable, instead of unwinding into C.
///
/// # Safety
///
/// `argv` points to `argc` valid NUL-terminated strings.
pub unsafe fn library_main(argc: c_int, argv: *const *const c_char) -> c_int {
    let args: Vec<OsString> = (0..usize::try_from(argc).unwrap_or(0))
        // SAFETY: the caller's promise.
        .map(|i| unsafe { CStr::from_ptr(*argv.add(i)) })
        .map(|a| OsString::from_vec(a.to_bytes().to_vec()))
        .collect();
    let code = std::panic::catch_unwind(|| cli::main(args)).unwrap_or(101);
    // This library's standard output is not the executable's: flush it before returning.
    let _ = std::io::Write::flush(&mut std::io::stdout());
    code
}
