//! The decode's peak formula against what the decoder really allocates: the tiny Wan VAEs
//! (2.1's, and 2.2's residual, patchified one) decode clips at two splits (whole frames one
//! latent frame a chunk; tiles two latent frames a chunk) under a counting allocator, and
//! the high-water mark of the live bytes above what was live before the decode must lie
//! within [`DecodeCost::peak`]'s figure and 15 % under it (f32, on the CPU). Its own test
//! binary, so no other test's allocations share the process, and one test, so no two
//! decodes overlap.

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::Device;
use layerwise_engine::components::wan_vae::decoder::WanVaeDecoder;
use layerwise_engine::components::wan_vae::WanVaeConfig;
use layerwise_engine::decode::{ConvScratch, DecodeSetting, OutputSize, Tile};
use layerwise_engine::execution::weights::seeded_noise;

/// `System`, counting the bytes live and their high-water mark.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(n: usize) {
    let now = LIVE.fetch_add(n, Ordering::SeqCst) + n;
    PEAK.fetch_max(now, Ordering::SeqCst);
}

// SAFETY: every call is passed to `System` unchanged; the counters only observe sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::SeqCst);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::SeqCst);
            grew(new_size);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn load(cfg: &WanVaeConfig, fixture: &str) -> WanVaeDecoder {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(fixture);
    let w = candle_core::safetensors::load(
        dir.join("diffusion_pytorch_model.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    WanVaeDecoder::load(cfg, &w).unwrap()
}

/// Live bytes at the peak of decoding `latents` at `setting`, above those live before.
fn measure(vae: &WanVaeDecoder, latents: &candle_core::Tensor, setting: &DecodeSetting) -> u64 {
    let base = LIVE.load(Ordering::SeqCst);
    PEAK.store(base, Ordering::SeqCst);
    vae.decode_chunks_with(latents, setting, |frames| {
        drop(frames);
        Ok(())
    })
    .unwrap();
    (PEAK.load(Ordering::SeqCst) - base) as u64
}

#[test]
fn the_decode_peak_formula_bounds_the_measured_peak_within_fifteen_percent() {
    let threads = rayon::current_num_threads() as u64;
    let scratch = ConvScratch::Cpu { threads };
    let cases = [
        (
            WanVaeConfig::tiny(),
            "wan-vae-tiny",
            [1, 16, 4, 24, 32],
            64,
            48,
        ),
        (
            WanVaeConfig::tiny22(),
            "wan22-vae-tiny",
            [1, 48, 4, 12, 16],
            128,
            96,
        ),
    ];
    let mut failures = Vec::new();
    for (cfg, fixture, shape, size, stride) in cases {
        let vae = load(&cfg, fixture);
        let cost = cfg.decode_cost();
        let latents = seeded_noise(7, &shape).unwrap();
        let (t, h, w) = (shape[2] as u64, shape[3] as u64, shape[4] as u64);
        let up = cfg.upscale() as u64;
        let out = OutputSize {
            width: w * up,
            height: h * up,
            frames: 1 + cfg.temporal_upscale() as u64 * (t - 1),
        };
        let image = OutputSize { frames: 1, ..out };
        let settings = [
            (DecodeSetting::FRAME_BY_FRAME, out, latents.clone()),
            (
                DecodeSetting {
                    chunk: 2,
                    tile: Some(Tile { size, stride }),
                },
                out,
                latents.clone(),
            ),
            (
                DecodeSetting::FRAME_BY_FRAME,
                image,
                latents.narrow(2, 0, 1).unwrap(),
            ),
        ];
        // Once unmeasured: the threads' and the matmuls' first buffers.
        measure(&vae, &latents, &settings[1].0);
        for (setting, size, z) in &settings {
            let measured = measure(&vae, z, setting);
            let predicted = cost.peak(setting, size, 4, scratch);
            let ratio = predicted as f64 / measured as f64;
            println!(
                "{fixture} {}x{}x{} at {setting}: measured {measured} B, predicted {predicted} B ({ratio:.3}x), {threads} threads",
                size.width, size.height, size.frames
            );
            if !(1.0..=1.15).contains(&ratio) {
                failures.push(format!("{fixture} {setting}: {ratio:.3}"));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "predicted / measured out of [1, 1.15]: {failures:?}"
    );
}
