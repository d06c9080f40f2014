//! Wan's 3D rotary position embedding (diffusers' `WanRotaryPosEmbed`): each head's
//! channels split into a frame part, a row part and a column part, and the pairs of
//! channels in each part rotate by the token's frame, row or column index times that
//! pair's frequency. Frequencies and angles are computed in f64, then rounded to f32, as
//! diffusers precomputes them.

use candle_core::{Device, Tensor};

use super::config::WanTransformerConfig;
pub use crate::components::rotary::apply;
use crate::components::rotary::RotaryTables;
use crate::{Error, Result};

/// Base of the rotary frequencies (diffusers' `theta`).
const THETA: f64 = 10000.0;

/// The rotation of every (token, channel pair) of a `frames × rows × cols` patch grid,
/// as two tables [tokens, head_dim / 2] (cosines, sines), in the token order of the
/// patch embedding (frame-major, then row, then column) and the pair order diffusers
/// applies them in: the frame part's pairs, then the row part's, then the column part's.
pub fn tables(
    cfg: &WanTransformerConfig,
    (frames, rows, cols): (usize, usize, usize),
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let max = cfg.rope_max_seq_len;
    if frames > max || rows > max || cols > max {
        return Err(Error::invalid(
            "latents",
            format!(
                "a {frames} × {rows} × {cols} patch grid exceeds the model's rotary tables \
                 (rope_max_seq_len {max} positions per axis)"
            ),
        ));
    }
    let (dt, dh, dw) = cfg.rope_dims();
    let freqs = |dim: usize| -> Vec<f64> {
        (0..dim / 2)
            .map(|j| 1.0 / THETA.powf((2 * j) as f64 / dim as f64))
            .collect()
    };
    let (ft, fh, fw) = (freqs(dt), freqs(dh), freqs(dw));
    let tokens = frames * rows * cols;
    let mut t = RotaryTables::new(tokens, cfg.attention_head_dim / 2);
    for f in 0..frames {
        for r in 0..rows {
            for c in 0..cols {
                for (pos, part) in [(f, &ft), (r, &fh), (c, &fw)] {
                    for freq in part.iter() {
                        t.push(pos as f64 * freq);
                    }
                }
            }
        }
    }
    t.finish(device)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_rotate_each_axis_by_its_own_index() {
        let cfg = WanTransformerConfig::tiny(); // head 12: 2 pairs per axis
        let (cos, sin) = tables(&cfg, (2, 3, 4), &Device::Cpu).unwrap();
        assert_eq!(cos.dims(), &[24, 6]);
        let sin: Vec<Vec<f32>> = sin.to_vec2().unwrap();
        let cos: Vec<Vec<f32>> = cos.to_vec2().unwrap();
        // Token (frame 1, row 2, column 3) is number 1·12 + 2·4 + 3 = 23. Pair 0 of each
        // part has frequency 1, pair 1 has 10000^(-2/4) = 0.01.
        let want = [1.0, 0.01, 2.0, 0.02, 3.0, 0.03f64];
        for (i, angle) in want.iter().enumerate() {
            assert!((sin[23][i] - angle.sin() as f32).abs() < 1e-7, "{i}");
            assert!((cos[23][i] - angle.cos() as f32).abs() < 1e-7, "{i}");
        }
        // The first token is not rotated at all.
        assert!(cos[0].iter().all(|&c| c == 1.0) && sin[0].iter().all(|&s| s == 0.0));
    }

    #[test]
    fn apply_rotates_interleaved_pairs() {
        // One token, one pair (x0, x1) = (1, 2) turned by a quarter: (-2, 1).
        let x = Tensor::new(&[[[[1f32, 2.0]]]], &Device::Cpu).unwrap();
        let cos = Tensor::new(&[[0f32]], &Device::Cpu).unwrap();
        let sin = Tensor::new(&[[1f32]], &Device::Cpu).unwrap();
        let y: Vec<f32> = apply(&x, &cos, &sin)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(y, vec![-2.0, 1.0]);
    }

    #[test]
    fn grids_beyond_the_tables_are_refused() {
        let cfg = WanTransformerConfig::tiny(); // 32 positions per axis
        let e = tables(&cfg, (1, 33, 2), &Device::Cpu)
            .unwrap_err()
            .to_string();
        assert!(e.contains("rope_max_seq_len"), "{e}");
    }
}
