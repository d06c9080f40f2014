//! Bare linear layers (x Wᵀ + b, f32, on the CPU) at the shapes of a DiT-XL/2 block at
//! 256 px under guidance: 512 rows (2 samples × 256 tokens) through the attention
//! projections (1152 → 1152) and the feed-forward (1152 → 4608 → 1152). scripts/bench-cpu
//! runs it beside PyTorch's `F.linear` on the same shapes, to tell the matrix products
//! apart from the rest of a step. Prints one line per shape: `linear M K N <ms>...`.
//! Threads: candle's (RAYON_NUM_THREADS).

use std::time::Instant;

use candle_core::{Device, Module, Tensor};
use candle_nn::Linear;

fn main() -> anyhow::Result<()> {
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
        let layer = Linear::new(w, Some(b));
        layer.forward(&x)?; // warm-up
        let mut ms = Vec::with_capacity(reps);
        for _ in 0..reps {
            let start = Instant::now();
            let y = layer.forward(&x)?;
            ms.push(start.elapsed().as_secs_f64() * 1e3);
            drop(y);
        }
        let each: Vec<String> = ms.iter().map(|m| format!("{m:.2}")).collect();
        println!("linear {rows} {k} {n} {}", each.join(" "));
    }
    Ok(())
}
