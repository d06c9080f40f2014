//! Qwen-Image's 3D rotary position embedding (diffusers' `QwenEmbedRope` with
//! `scale_rope=True`): each head's channels split into a frame part, a row part and a
//! column part (`axes_dims_rope`), and the pairs of channels in each part rotate by the
//! token's position on that axis times the pair's frequency. Image tokens sit at frames
//! 0..F and at rows and columns centred on 0; text tokens sit on the diagonal after the
//! image, at the same position on all three axes. Frequencies and angles are formed in
//! f32 as diffusers forms them (its tables are f32); only the cosines and sines go through
//! f64, so they round once.

use candle_core::{Device, Tensor};

use super::config::QwenImageTransformerConfig;
pub use crate::components::rotary::apply;
use crate::components::rotary::{f32_frequencies, RotaryTables};
use crate::Result;

/// Base of the rotary frequencies (diffusers' `theta`).
const THETA: f64 = 10000.0;

/// Image rows (or columns) of a side of `n` patches, centred: -⌈n/2⌉..⌊n/2⌋.
fn centred(n: usize) -> impl Iterator<Item = i64> {
    let neg = n.div_ceil(2) as i64;
    (0..n as i64).map(move |i| i - neg)
}

/// The rotation of every (token, channel pair) of a joint sequence of `text_tokens` text
/// tokens followed by a `frames × rows × cols` patch grid (the order the blocks attend
/// in), as two tables [text_tokens + tokens, head_dim / 2] (cosines, sines). Image tokens
/// are frame-major, then row, then column, as the pipeline packs them; each token's pairs
/// are the frame part's, then the row part's, then the column part's. Refuses positions
/// outside diffusers' tables (`config::ROPE_POSITIONS`).
pub fn tables(
    cfg: &QwenImageTransformerConfig,
    grid: (usize, usize, usize),
    text_tokens: usize,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    QwenImageTransformerConfig::check_positions(grid, text_tokens)?;
    let (frames, rows, cols) = grid;
    let (df, dh, dw) = cfg.rope_dims();
    let (ff, fh, fw) = (
        f32_frequencies(df, THETA),
        f32_frequencies(dh, THETA),
        f32_frequencies(dw, THETA),
    );
    let tokens = text_tokens + frames * rows * cols;
    let mut t = RotaryTables::new(tokens, cfg.attention_head_dim / 2);
    let mut push = |positions: [i64; 3]| {
        for (pos, part) in positions.iter().zip([&ff, &fh, &fw]) {
            for freq in part.iter() {
                // torch.outer(index, freqs) of an integer index and f32 frequencies: f32.
                t.push((*pos as f32 * freq) as f64);
            }
        }
    };
    let offset = QwenImageTransformerConfig::text_position_offset(grid) as i64;
    for i in 0..text_tokens as i64 {
        push([offset + i; 3]);
    }
    for f in 0..frames as i64 {
        for r in centred(rows) {
            for c in centred(cols) {
                push([f, r, c]);
            }
        }
    }
    t.finish(device)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_and_columns_are_centred_and_text_follows() {
        assert_eq!(centred(4).collect::<Vec<_>>(), vec![-2, -1, 0, 1]);
        assert_eq!(centred(5).collect::<Vec<_>>(), vec![-3, -2, -1, 0, 1]);
        // Tiny head 16 = 4 (frames: 2 pairs) + 6 (rows: 3) + 6 (columns: 3).
        let cfg = QwenImageTransformerConfig::tiny();
        let (cos, sin) = tables(&cfg, (2, 3, 4), 2, &Device::Cpu).unwrap();
        assert_eq!(cos.dims(), &[2 + 24, 8]);
        let sin: Vec<Vec<f32>> = sin.to_vec2().unwrap();
        // Pair 0 of every part has frequency 1, so its sine is sin(position).
        let first = |row: &Vec<f32>| [row[0], row[2], row[5]];
        let want = |p: [f64; 3]| p.map(|x| x.sin() as f32);
        // Text starts at max(3/2, 4/2) = 2 on every axis.
        assert_eq!(first(&sin[0]), want([2.0, 2.0, 2.0]));
        assert_eq!(first(&sin[1]), want([3.0, 3.0, 3.0]));
        // The first image token: frame 0, row -2, column -2; the last: 1, 0, 1.
        assert_eq!(first(&sin[2]), want([0.0, -2.0, -2.0]));
        assert_eq!(first(&sin[25]), want([1.0, 0.0, 1.0]));
    }

    #[test]
    fn positions_beyond_the_tables_are_refused() {
        let cfg = QwenImageTransformerConfig::tiny();
        let e = tables(&cfg, (1, 8, 8), 4093, &Device::Cpu)
            .unwrap_err()
            .to_string();
        assert!(e.contains("4097"), "{e}");
    }
}
