//! Which failures end what: the root cause a failed rank's peers and the server quote
//! ([`first_cause`]), and an output whose latents are not finite, which fails its request.

use crate::execution::work::Output;
use crate::{Error, Result};

/// What a failed rank poisons its peers' collectives and the coordinator with, for them to
/// give up quoting, and what the server says of the engine's end: its failure, naming it;
/// for a rank that only gave up itself, the first failure it quotes, so every peer (and the
/// server, whichever rank it hears first) quotes the root cause however the poisons raced.
pub fn first_cause(rank: usize, e: &Error) -> String {
    match e {
        Error::Abandoned(a) => a.cause.clone(),
        // Named once: "rank 1 failed: panicked: ..." rather than "rank 1 failed: rank 1: ...".
        Error::Rank { rank: r, msg } if *r == rank => format!("rank {rank} failed: {msg}"),
        _ => format!("rank {rank} failed: {e}"),
    }
}

/// An output whose latents are not all finite is a failed request, not a black image: the
/// weights hold NaN or infinity, or the request overflows.
pub(super) fn finite(out: Result<Output>) -> Result<Output> {
    let o = out?;
    let values = o
        .latents
        .flatten_all()?
        .to_dtype(candle_core::DType::F32)?
        .to_vec1::<f32>()?;
    if let Some(n) = values.iter().position(|x| !x.is_finite()) {
        return Err(Error::NotFinite {
            what: format!(
                "the final latents hold {} (value {n} of {}): the weights hold NaN or infinity, or the request overflows; the checkpoint may be corrupt",
                values[n],
                values.len()
            ),
        });
    }
    Ok(o)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Abandoned;

    /// A failure names its rank once; a rank that only gave up passes on the cause it quotes.
    #[test]
    fn the_first_cause_names_the_failed_rank_once() {
        let cause = "rank 1 failed: panicked: disk on fire";
        let gave_up = Error::Abandoned(Abandoned {
            rank: 0,
            what: "all-gather",
            cause: cause.into(),
        });
        assert_eq!(first_cause(0, &gave_up), cause);
        let own = Error::Rank {
            rank: 1,
            msg: "panicked: disk on fire".into(),
        };
        assert_eq!(first_cause(1, &own), cause);
        let transfer = Error::Transfer("no progress for 1s".into());
        assert_eq!(
            first_cause(2, &transfer),
            "rank 2 failed: weight transfer failed: no progress for 1s"
        );
    }
}
