//! Spatial tiling of a VAE decode, as diffusers' `tiled_decode` does it: the latents cut
//! into overlapping squares decoded one at a time, each tile's rows (columns) that overlap
//! the tile above (to the left) blended linearly into that tile's last ones, then each tile
//! cropped to its stride and the crops laid edge to edge. A decode's peak then follows a
//! tile's size, not the frame's. Both VAEs that tile use it: the causal video VAE
//! (`AutoencoderKLWan`) and DiT's `AutoencoderKL`, whose tile arithmetic differs only in how
//! the sizes are derived ([`Grid::new`] takes them already derived).
//!
//! Tensors are [frames, channels, height, width]; the blend is per frame, so a clip's
//! chunks tile exactly as its whole frames would.

use candle_core::{Device, Tensor};

use crate::{Error, Result};

/// Where the tiles of one frame lie, in latent pixels, and how their decoded outputs are
/// blended and cropped, in output pixels of the decoder (before any unpatchify).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grid {
    /// (first latent row, latent rows) of each row of tiles, clipped at the frame's edge.
    pub rows: Vec<(usize, usize)>,
    /// The same for the columns.
    pub cols: Vec<(usize, usize)>,
    /// Output rows (columns) a tile shares with the one above (to its left) and blends.
    pub blend: usize,
    /// Output rows (columns) of each tile kept after blending: its stride.
    pub keep: usize,
    /// The assembled frame's output height and width (the crops are cut to it).
    pub out: (usize, usize),
}

impl Grid {
    /// Tiles `tile` latent pixels a side starting every `stride` latent pixels over a
    /// `latent` (height, width) frame, whose decoded tiles overlap by `blend` output pixels
    /// and keep `keep`; the frame decodes to `out`. Refuses a zero tile or stride by name.
    pub fn new(
        latent: (usize, usize),
        tile: usize,
        stride: usize,
        blend: usize,
        keep: usize,
        out: (usize, usize),
    ) -> Result<Grid> {
        if tile == 0 || stride == 0 || keep == 0 {
            return Err(Error::invalid(
                "tile",
                format!(
                    "a tile of {tile} latent pixels at stride {stride} (keeping {keep} output pixels) is empty: the tile and its stride must each cover at least one latent pixel"
                ),
            ));
        }
        let starts = |n: usize| -> Vec<(usize, usize)> {
            (0..n)
                .step_by(stride)
                .map(|s| (s, tile.min(n - s)))
                .collect()
        };
        Ok(Grid {
            rows: starts(latent.0),
            cols: starts(latent.1),
            blend,
            keep,
            out,
        })
    }

    /// Tiles in the frame.
    pub fn len(&self) -> usize {
        self.rows.len() * self.cols.len()
    }

    /// Whether the grid has no tile (never, for a frame of at least one pixel).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Latent pixels each tile decodes, in tile order (row by row).
    pub fn tiles(&self) -> impl Iterator<Item = ((usize, usize), (usize, usize))> + '_ {
        self.rows
            .iter()
            .flat_map(move |&r| self.cols.iter().map(move |&c| (r, c)))
    }

    /// The frame from its decoded tiles (row by row, [F, C, h, w] each): each blended with
    /// the already blended tiles above and to its left, as diffusers blends them in place,
    /// cropped to the stride, laid edge to edge and cut to [`Grid::out`].
    pub fn assemble(&self, decoded: Vec<Tensor>) -> Result<Tensor> {
        let n = self.cols.len();
        if decoded.len() != self.len() {
            return Err(Error::bug(format!(
                "{} decoded tiles for a grid of {}",
                decoded.len(),
                self.len()
            )));
        }
        // Each tile is freed as its blended copy replaces it; only the row above stays.
        let mut tiles = decoded.into_iter();
        let mut above: Vec<Tensor> = Vec::with_capacity(n);
        let mut bands = Vec::with_capacity(self.rows.len());
        for i in 0..self.rows.len() {
            let mut blended: Vec<Tensor> = Vec::with_capacity(n);
            for j in 0..n {
                let mut tile = tiles.next().expect("the grid's count of tiles");
                if i > 0 {
                    tile = blend(&above[j], &tile, self.blend, 2)?;
                }
                if j > 0 {
                    tile = blend(&blended[j - 1], &tile, self.blend, 3)?;
                }
                blended.push(tile);
            }
            let crops = blended
                .iter()
                .map(|t| crop(t, self.keep))
                .collect::<Result<Vec<_>>>()?;
            bands.push(Tensor::cat(&crops, 3)?);
            above = blended;
        }
        drop(above);
        let frame = Tensor::cat(&bands, 2)?;
        drop(bands);
        let (_, _, h, w) = frame.dims4()?;
        if (h, w) == self.out {
            return Ok(frame);
        }
        Ok(frame
            .narrow(2, 0, self.out.0.min(h))?
            .narrow(3, 0, self.out.1.min(w))?
            .contiguous()?)
    }
}

/// The first `keep` rows and columns of a tile (all of a shorter one).
fn crop(t: &Tensor, keep: usize) -> Result<Tensor> {
    let (_, _, h, w) = t.dims4()?;
    Ok(t.narrow(2, 0, keep.min(h))?.narrow(3, 0, keep.min(w))?)
}

/// diffusers' `blend_v` (`dim` 2) or `blend_h` (`dim` 3): `b`'s first e rows (columns),
/// e = min(both sizes, `extent`), become `a`'s last e weighted 1 - y/e plus their own
/// weighted y/e.
fn blend(a: &Tensor, b: &Tensor, extent: usize, dim: usize) -> Result<Tensor> {
    let e = extent.min(a.dim(dim)?).min(b.dim(dim)?);
    if e == 0 {
        return Ok(b.clone());
    }
    // Weights as diffusers computes them: in double, applied as float32 scalars.
    let ramp = |f: fn(f64) -> f64| -> Result<Tensor> {
        let w: Vec<f32> = (0..e).map(|y| f(y as f64 / e as f64) as f32).collect();
        let mut shape = [1usize; 4];
        shape[dim] = e;
        Ok(Tensor::from_vec(w, &shape[..], &Device::Cpu)?.to_device(b.device())?)
    };
    let from_a = a
        .narrow(dim, a.dim(dim)? - e, e)?
        .broadcast_mul(&ramp(|r| 1.0 - r)?)?;
    let own = b.narrow(dim, 0, e)?.broadcast_mul(&ramp(|r| r)?)?;
    let head = (from_a + own)?;
    let rest = b.dim(dim)? - e;
    if rest == 0 {
        return Ok(head);
    }
    Ok(Tensor::cat(&[head, b.narrow(dim, e, rest)?], dim)?)
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;
    use crate::testing::max_abs_diff;

    #[test]
    fn tiles_start_every_stride_and_are_clipped_at_the_edge() {
        let g = Grid::new((5, 3), 2, 1, 8, 8, (40, 24)).unwrap();
        assert_eq!(g.rows, vec![(0, 2), (1, 2), (2, 2), (3, 2), (4, 1)]);
        assert_eq!(g.cols, vec![(0, 2), (1, 2), (2, 1)]);
        assert_eq!(g.len(), 15);
        let err = Grid::new((5, 3), 2, 0, 8, 8, (40, 24)).unwrap_err();
        assert!(err.to_string().contains("tile"), "{err}");
    }

    #[test]
    fn blending_ramps_from_the_neighbour_to_the_tile() {
        // a is all 1, b all 0: b's first rows become 1 - y/e.
        let a = Tensor::ones((1, 1, 4, 2), candle_core::DType::F32, &Device::Cpu).unwrap();
        let b = Tensor::zeros((1, 1, 3, 2), candle_core::DType::F32, &Device::Cpu).unwrap();
        let v = blend(&a, &b, 2, 2).unwrap();
        let rows: Vec<f32> = v
            .narrow(3, 0, 1)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(rows, vec![1.0, 0.5, 0.0]);
        // The extent is capped by the shorter tile.
        let a = Tensor::ones((1, 1, 3, 2), candle_core::DType::F32, &Device::Cpu).unwrap();
        let h = blend(&a, &b, 9, 3).unwrap();
        let cols: Vec<f32> = h
            .narrow(2, 0, 1)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(cols, vec![1.0, 0.5]);
    }

    #[test]
    fn tiles_of_one_image_assemble_back_into_it() {
        // Tiles cut from one image agree on their overlaps, so blending changes nothing.
        let image = crate::execution::weights::seeded_noise(4, &[2, 3, 40, 24]).unwrap();
        let g = Grid::new((5, 3), 2, 1, 8, 8, (40, 24)).unwrap();
        let tiles = g
            .tiles()
            .map(|((r, rl), (c, cl))| image.narrow(2, 8 * r, 8 * rl)?.narrow(3, 8 * c, 8 * cl))
            .collect::<candle_core::Result<Vec<_>>>()
            .unwrap();
        let whole = g.assemble(tiles).unwrap();
        assert_eq!(whole.dims(), image.dims());
        assert!(max_abs_diff(&whole, &image) < 1e-6);
    }
}
