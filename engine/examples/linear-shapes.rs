//! Bare linear layers (x Wᵀ + b, f32, on the CPU) at the shapes of a DiT-XL/2 block at
//! 256 px under guidance: 512 rows (2 samples × 256 tokens) through the attention
//! projections (1152 → 1152) and the feed-forward (1152 → 4608 → 1152), by the engine's
//! `fused::linear` (what the blocks run) and by candle's `Linear`. scripts/bench-cpu runs
//! it beside PyTorch's `F.linear` on the same shapes, to tell the matrix products apart
//! from the rest of a step. Prints one line per shape and implementation:
//! `linear M K N <ms>...` (the engine's) and `candle M K N <ms>...`.
//! Threads: rayon's (RAYON_NUM_THREADS).

use std::time::Instant;

use anyhow::Result;
use candle_core::{Device, Module, Tensor};
use layerwise_engine::components::fused;

fn time(reps: usize, f: impl Fn() -> Result<Tensor>) -> Result<Vec<String>> {
    f()?; // warm-up
    let mut ms = Vec::with_capacity(reps);
    for _ in 0..reps {
        let start = Instant::now();
        let y = f()?;
        ms.push(format!("{:.2}", start.elapsed().as_secs_f64() * 1e3));
        drop(y);
    }
    Ok(ms)
}

fn main() -> Result<()> {
    let reps: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(5);
    let dev = Device::Cpu;
    let rows = 512;
    for (k, n) in [(1152, 1152), (1152, 4608), (4608, 1152)] {
        let x = Tensor::randn(0f32, 1.0, (2, rows / 2, k), &dev)?;
        let w = Tensor::randn(0f32, 0.02, (n, k), &dev)?;
        let b = Tensor::randn(0f32, 0.02, n, &dev)?;
        let ours = time(reps, || Ok(fused::linear(&x, &w, Some(&b))?))?;
        println!("linear {rows} {k} {n} {}", ours.join(" "));
        let layer = candle_nn::Linear::new(w.clone(), Some(b.clone()));
        let candle = time(reps, || Ok(layer.forward(&x)?))?;
        println!("candle {rows} {k} {n} {}", candle.join(" "));
    }
    Ok(())
}
