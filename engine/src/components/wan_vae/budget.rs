//! The decoder's peak as the planner and the engine count it ([`DecodeCost`]): a walk over
//! the decoder's layout that follows, op for op, what `decoder` and `layers` allocate and
//! when they free it, in elements per latent pixel of the tile being decoded. Where the
//! decode code changes what it keeps, this walk changes with it; the counting-allocator
//! test (`engine/tests/decode_memory.rs`) holds the two together.

use std::ops::Add;

use layerwise_core::decode::{DecodeCost, PeakPoint};

use super::{Upsample, WanVaeConfig};

/// Elements per latent pixel: at the first chunk (one frame everywhere), and in a later
/// chunk per latent frame of it plus a part its length does not change.
/// Query rows per attention score block, so a large frame's [HW, HW] scores never exist
/// whole (the decoder's `AttentionBlock`).
pub const ATTENTION_QUERY_BLOCK: usize = 4096;

#[derive(Debug, Clone, Copy, Default)]
struct Amt {
    first: u64,
    per: u64,
    fixed: u64,
}

impl Add for Amt {
    type Output = Amt;
    fn add(self, o: Amt) -> Amt {
        Amt {
            first: self.first + o.first,
            per: self.per + o.per,
            fixed: self.fixed + o.fixed,
        }
    }
}

impl Amt {
    fn times(self, n: u64) -> Amt {
        Amt {
            first: self.first * n,
            per: self.per * n,
            fixed: self.fixed * n,
        }
    }
}

/// Where the pass is: pixels per latent pixel, frames per latent frame of a later chunk.
#[derive(Debug, Clone, Copy)]
struct Level {
    q: u64,
    m: u64,
}

impl Level {
    /// A tensor of `c` channels here.
    fn t(self, c: usize) -> Amt {
        let c = c as u64;
        Amt {
            first: c * self.q,
            per: c * self.q * self.m,
            fixed: 0,
        }
    }

    /// A causal conv's past in its input sequence: two frames (zeros at the first chunk).
    fn past(self, c: usize) -> Amt {
        let c = c as u64;
        Amt {
            first: 2 * c * self.q,
            per: 0,
            fixed: 2 * c * self.q,
        }
    }

    /// The frames a causal conv keeps for the next chunk: its input's last one at the
    /// first chunk, two after.
    fn next(self, c: usize) -> Amt {
        let c = c as u64;
        Amt {
            first: c * self.q,
            per: 0,
            fixed: 2 * c * self.q,
        }
    }
}

#[derive(Default)]
struct Walk {
    points: Vec<PeakPoint>,
    cache_first: u64,
    cache: u64,
}

impl Walk {
    fn point(&mut self, live: Amt, lv: Level, im2col_channels: usize, attention: bool) {
        self.points.push(PeakPoint {
            first: live.first,
            per_latent_frame: live.per,
            fixed: live.fixed,
            im2col_channels: im2col_channels as u64,
            pixels_per_latent: lv.q,
            frames_per_latent: lv.m,
            attention,
        });
    }

    /// The convolution's own buffers on the CPU: a contiguous copy of its input (per
    /// frame for a 1×1) and its output.
    fn conv_inner(lv: Level, cin: usize, cout: usize) -> Amt {
        lv.t(cin) + lv.t(cout)
    }

    /// `CausalConv3d::forward_cached` with three taps on `x` (held by the caller, in
    /// `held`): the cache's next frames, the sequence with its past, the sum over taps.
    /// A resampler's time conv (`time`) skips the first chunk and keeps nothing from it.
    fn conv_cached(&mut self, held: Amt, lv: Level, cin: usize, cout: usize, k: usize, time: bool) {
        self.cache += 2 * cin as u64 * lv.q;
        if !time {
            self.cache_first += cin as u64 * lv.q;
        }
        let base = held + lv.next(cin) + lv.t(cin) + lv.past(cin);
        let first = |mut a: Amt| {
            if time {
                a.first = 0;
            }
            a
        };
        let conv = first(base + lv.t(cout) + Self::conv_inner(lv, cin, cout));
        self.point(conv, lv, cin * k * k, false);
        self.point(first(base + lv.t(cout).times(3)), lv, 0, false);
    }

    /// A convolution without a cache (the post-quant and shortcut 1×1×1s, the
    /// resampler's 3×3), then its bias.
    fn conv_plain(&mut self, held: Amt, lv: Level, cin: usize, cout: usize, k: usize) {
        self.point(
            held + Self::conv_inner(lv, cin, cout),
            lv,
            cin * k * k,
            false,
        );
        self.point(held + lv.t(cout).times(2), lv, 0, false);
    }

    /// `WanRMS_norm` then SiLU: two tensors of the input's size and the norms.
    fn norm_silu(&mut self, held: Amt, lv: Level, c: usize) {
        self.point(held + lv.t(c).times(2) + lv.t(1), lv, 0, false);
    }

    /// `ResidualBlock::forward`, its input in `held`.
    fn resnet(&mut self, held: Amt, lv: Level, cin: usize, cout: usize) {
        let mut held = held;
        if cin != cout {
            self.conv_plain(held, lv, cin, cout, 1);
            held = held + lv.t(cout);
        }
        self.norm_silu(held, lv, cin);
        self.conv_cached(held + lv.t(cin), lv, cin, cout, 3, false);
        self.norm_silu(held + lv.t(cout), lv, cout);
        self.conv_cached(held + lv.t(cout), lv, cout, cout, 3, false);
        self.point(held + lv.t(cout).times(2), lv, 0, false);
    }

    /// `AttentionBlock::forward`, its input in `held`: the tokens, the fused qkv and its
    /// three parts, the output blocks beside the scores; then the projection.
    fn attention(&mut self, held: Amt, lv: Level, c: usize) {
        self.norm_silu(held, lv, c);
        self.point(held + lv.t(c).times(8), lv, 0, true);
        self.point(
            held + lv.t(c).times(10) + Self::conv_inner(lv, c, c),
            lv,
            c,
            false,
        );
    }

    /// `Resample::forward` on its own input of `d` channels, `outside` held by callers;
    /// the level after it.
    fn resample(&mut self, outside: Amt, lv: Level, d: usize, out: usize, mode: Upsample) -> Level {
        let mut lv = lv;
        if mode == Upsample::SpatioTemporal {
            self.conv_cached(outside + lv.t(d), lv, d, 2 * d, 1, true);
            lv.m *= 2;
        }
        let up = Level {
            q: 4 * lv.q,
            m: lv.m,
        };
        self.point(outside + lv.t(d) + up.t(d), up, 0, false);
        self.conv_plain(outside + up.t(d), up, d, out, 3);
        up
    }
}

impl WanVaeConfig {
    /// What the decoder holds at its peak per split of a decode, from its layout: the walk
    /// of [`DecodeCost`]'s points through `WanVaeDecoder`'s pass.
    pub fn decode_cost(&self) -> DecodeCost {
        let layout = self.decoder_layout();
        let mut w = Walk::default();
        let mut lv = Level { q: 1, m: 1 };
        let z = layout.z_dim;
        // The tile's latents, held by the caller through the pass.
        let held = lv.t(z);
        w.conv_plain(held, lv, z, z, 1);
        w.conv_cached(held + lv.t(z), lv, z, layout.mid, 3, false);
        w.resnet(held + lv.t(layout.mid), lv, layout.mid, layout.mid);
        w.attention(held + lv.t(layout.mid), lv, layout.mid);
        w.resnet(held + lv.t(layout.mid), lv, layout.mid, layout.mid);
        let mut c = layout.mid;
        for block in &layout.up_blocks {
            let input = lv.t(c);
            // With a shortcut the block's input stays until the end.
            let outside = if block.shortcut.is_some() {
                held + input
            } else {
                held
            };
            for &(cin, cout) in &block.resnets {
                w.resnet(outside + lv.t(cin), lv, cin, cout);
            }
            let before = lv;
            if let Some(mode) = block.upsample {
                lv = w.resample(outside, lv, block.dim, block.out, mode);
            }
            if let Some(s) = block.shortcut {
                // DupUp: two copies of the repeated input beside the block's output, then
                // the sum.
                let dup = Amt {
                    first: (s.cout * s.factor_t) as u64 * 4 * before.q,
                    per: (s.cout * s.factor_t) as u64 * 4 * before.q * before.m,
                    fixed: 0,
                };
                w.point(held + input + lv.t(block.out) + dup.times(2), lv, 0, false);
                w.point(held + input + lv.t(block.out).times(2) + dup, lv, 0, false);
            }
            c = block.out;
        }
        w.norm_silu(held + lv.t(c), lv, c);
        w.conv_cached(held + lv.t(c), lv, c, layout.out_channels, 3, false);
        DecodeCost {
            upscale: self.upscale() as u64,
            temporal_upscale: self.temporal_upscale() as u64,
            latent_channels: z as u64,
            out_channels: self.video_channels() as u64,
            attention_block: ATTENTION_QUERY_BLOCK as u64,
            cache_first: w.cache_first,
            cache: w.cache,
            points: w.points,
        }
    }
}
