//! What each rank of one engine process does: `dp` groups, each serving its own request,
//! of `sp` ranks that split that request's latent sequence (Ulysses sequence parallelism).
//!
//! Every rank of the process, whatever its group, shares the streamed weights: a block's
//! host copy and all-gather run over all `dp × sp` ranks (each copies 1/(dp·sp) of it), so
//! adding sequence parallelism moves no more weight bytes per block. Within a group, each
//! rank holds a contiguous slice of the latent tokens ([`split`]); before attention an
//! all-to-all gives each rank every token of a slice of the heads, after it another one
//! gives the tokens back, so each rank attends over the whole sequence for its heads. The
//! text, the timestep and the sampler's latents stay whole on every rank of the group.
//!
//! The split is contiguous, as even as it can be, and the same on every rank; sequences
//! and head counts that `sp` does not divide are split unevenly rather than padded, so no
//! shape is refused for its divisibility, only for having fewer heads than `sp`.

use std::fmt;
use std::ops::Range;

use crate::{Error, Result};

/// The most ranks one request may be split across: the all-to-all's cost per rank grows
/// with the group, and no shipped family has fewer heads than this.
pub const MAX_SP: usize = 16;

/// `dp` groups of `sp` ranks: rank `r` is member `r % sp` of group `r / sp`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Topology {
    /// Requests served at once: one per group.
    pub dp: usize,
    /// Ranks per group, splitting one request's sequence.
    pub sp: usize,
}

impl Default for Topology {
    fn default() -> Self {
        Topology { dp: 1, sp: 1 }
    }
}

impl Topology {
    /// `dp` groups of `sp` ranks; both at least 1, `sp` at most [`MAX_SP`].
    pub fn new(dp: usize, sp: usize) -> Result<Topology> {
        if dp == 0 {
            return Err(Error::invalid("dp", "must be at least 1"));
        }
        if sp == 0 || sp > MAX_SP {
            return Err(Error::invalid(
                "sp",
                format!("{sp}: must be between 1 and {MAX_SP}"),
            ));
        }
        dp.checked_mul(sp)
            .ok_or_else(|| Error::invalid("sp", format!("dp {dp} × sp {sp} overflows")))?;
        Ok(Topology { dp, sp })
    }

    /// Ranks (devices) in the process: `dp × sp`. The weights shard over all of them.
    pub fn ranks(&self) -> usize {
        self.dp * self.sp
    }

    /// The group rank `rank` serves requests in.
    pub fn group(&self, rank: usize) -> usize {
        rank / self.sp
    }

    /// Rank `rank`'s place in its group (0 leads: it takes the group's requests and
    /// returns their outputs).
    pub fn member(&self, rank: usize) -> usize {
        rank % self.sp
    }

    /// The ranks of group `group`.
    pub fn members(&self, group: usize) -> Range<usize> {
        group * self.sp..(group + 1) * self.sp
    }
}

impl fmt::Display for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "dp {} × sp {}", self.dp, self.sp)
    }
}

/// Member `member`'s share of `n` items split contiguously over `parts`: the first
/// `n % parts` members hold one more. The one split of tokens and heads every rank and
/// the memory model use.
pub fn split(n: usize, parts: usize, member: usize) -> Range<usize> {
    let parts = parts.max(1);
    let (base, extra) = (n / parts, n % parts);
    let start = member * base + member.min(extra);
    let len = base + usize::from(member < extra);
    start.min(n)..(start + len).min(n)
}

/// The most items any member holds of `n` split over `parts` ([`split`]'s first share).
pub fn largest_share(n: u64, parts: u64) -> u64 {
    n.div_ceil(parts.max(1))
}

/// Checks that a model with `heads` attention heads can run with `sp` ranks per request:
/// each rank of a group attends over at least one head.
pub fn check_heads(heads: usize, sp: usize, what: &str) -> Result<()> {
    if sp > heads {
        return Err(Error::invalid(
            "sp",
            format!("{sp}: {what} has {heads} attention heads, and each rank of a request needs at least one"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_is_contiguous_even_and_covers_everything() {
        for n in 0..40 {
            for parts in 1..7 {
                let shares: Vec<_> = (0..parts).map(|m| split(n, parts, m)).collect();
                assert_eq!(shares[0].start, 0);
                assert_eq!(shares.last().unwrap().end, n);
                for w in shares.windows(2) {
                    assert_eq!(w[0].end, w[1].start, "n {n} parts {parts}");
                }
                let lens: Vec<_> = shares.iter().map(|r| r.len()).collect();
                let (lo, hi) = (lens.iter().min().unwrap(), lens.iter().max().unwrap());
                assert!(hi - lo <= 1, "n {n} parts {parts}: {lens:?}");
                assert_eq!(*hi as u64, largest_share(n as u64, parts as u64));
            }
        }
        assert_eq!(split(10, 4, 0), 0..3);
        assert_eq!(split(10, 4, 3), 8..10);
    }

    #[test]
    fn ranks_map_to_groups_and_members() {
        let t = Topology::new(2, 3).unwrap();
        assert_eq!(t.ranks(), 6);
        assert_eq!((t.group(4), t.member(4)), (1, 1));
        assert_eq!(t.members(1), 3..6);
        assert_eq!(t.to_string(), "dp 2 × sp 3");
    }

    #[test]
    fn bad_topologies_name_the_field() {
        let e = Topology::new(0, 1).unwrap_err().to_string();
        assert!(e.contains("dp"), "{e}");
        for sp in [0, MAX_SP + 1] {
            let e = Topology::new(1, sp).unwrap_err().to_string();
            assert!(e.contains("sp") && e.contains(&sp.to_string()), "{e}");
        }
        let e = check_heads(2, 4, "the transformer")
            .unwrap_err()
            .to_string();
        assert!(e.contains("2 attention heads"), "{e}");
        check_heads(4, 4, "x").unwrap();
    }
}
