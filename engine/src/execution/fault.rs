//! What poisons a stream, as it travels from the work that failed, through the events the
//! stream records, to whoever waits on them: a failure of this rank's own (a copy, a
//! collective, a stalled peer: a message naming what failed), or a collective that gave up
//! because another rank failed first ([`Abandoned`]). The second keeps its type the whole
//! way, through both backends' streams and through the candle custom op the all-gather
//! runs in, so the rank loop picks a failed run's root cause by variant, not by text.

use std::fmt;

use crate::error::{Abandoned, Error};

/// Why a stream stopped; cloned to every waiter of the events it records afterwards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// This rank's own transfer, collective or wait failed.
    Failed(String),
    /// Another rank failed first, and this rank's collective gave up.
    Abandoned(Abandoned),
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fault::Failed(msg) => f.write_str(msg),
            Fault::Abandoned(a) => a.fmt(f),
        }
    }
}

impl From<String> for Fault {
    fn from(msg: String) -> Self {
        Fault::Failed(msg)
    }
}

impl From<Abandoned> for Fault {
    fn from(a: Abandoned) -> Self {
        Fault::Abandoned(a)
    }
}

impl Fault {
    /// The engine's error for this fault: [`Error::Abandoned`] for an abandoned
    /// collective, what `failed` makes of the message for a failure of this rank's own.
    pub fn into_error(self, failed: impl FnOnce(String) -> Error) -> Error {
        match self {
            Fault::Failed(msg) => failed(msg),
            Fault::Abandoned(a) => Error::Abandoned(a),
        }
    }

    /// The error a candle custom op returns for this fault. An abandoned collective goes
    /// boxed as a std error, which [`Fault::from_candle`] takes back out; a failure goes as
    /// its message.
    pub fn into_candle(self) -> candle_core::Error {
        match self {
            Fault::Failed(msg) => candle_core::Error::msg(msg),
            Fault::Abandoned(a) => candle_core::Error::WrappedContext {
                context: format!("{} abandoned", a.what),
                wrapped: Box::new(a),
            },
        }
    }

    /// The fault behind a candle error that `what` (a custom op) returned: the
    /// [`Abandoned`] that [`Fault::into_candle`] boxed, whatever candle wrapped around it
    /// since, or a failure whose message starts with `what`.
    pub fn from_candle(e: candle_core::Error, what: &str) -> Fault {
        match abandoned_in(&e) {
            Some(a) => Fault::Abandoned(a.clone()),
            None => Fault::Failed(format!("{what}: {e}")),
        }
    }
}

/// The [`Abandoned`] boxed somewhere in `e`, looking through candle's wrappers (a
/// backtrace, a context, a path).
fn abandoned_in(e: &candle_core::Error) -> Option<&Abandoned> {
    use candle_core::Error as C;
    match e {
        C::WrappedContext { wrapped, .. } | C::Cuda(wrapped) => wrapped.downcast_ref(),
        C::WithBacktrace { inner, .. } | C::Context { inner, .. } | C::WithPath { inner, .. } => {
            abandoned_in(inner)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn abandoned() -> Abandoned {
        Abandoned {
            rank: 0,
            what: "all-gather",
            cause: "rank 1 failed: panicked: disk on fire".into(),
        }
    }

    #[test]
    fn an_abandoned_collective_survives_a_candle_error_and_its_wrappers() {
        let e = Fault::Abandoned(abandoned()).into_candle();
        assert_eq!(
            Fault::from_candle(e, "all-gather"),
            Fault::Abandoned(abandoned())
        );
        let wrapped = candle_core::Error::WithBacktrace {
            inner: Box::new(
                Fault::Abandoned(abandoned())
                    .into_candle()
                    .context("layerwise-all-gather"),
            ),
            backtrace: Box::new(std::backtrace::Backtrace::disabled()),
        };
        let f = Fault::from_candle(wrapped, "all-gather");
        assert_eq!(f, Fault::Abandoned(abandoned()));
        let e = f.into_error(Error::Transfer);
        assert!(matches!(e, Error::Abandoned(ref a) if a.rank == 0), "{e}");
        assert_eq!(
            e.to_string(),
            "rank 0: all-gather abandoned: rank 1 failed: panicked: disk on fire"
        );
    }

    #[test]
    fn a_failure_stays_a_message_naming_the_op() {
        let e = Fault::Failed("shard past the store".into()).into_candle();
        let f = Fault::from_candle(e, "all-gather");
        // (Starts with: candle appends a backtrace when RUST_BACKTRACE asks for one.)
        assert!(
            matches!(&f, Fault::Failed(m) if m.starts_with("all-gather: shard past the store")),
            "{f}"
        );
        let e = f.into_error(Error::Transfer);
        assert!(matches!(e, Error::Transfer(_)), "{e}");
    }
}
