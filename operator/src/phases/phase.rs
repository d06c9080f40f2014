//! What every phase of a reconcile returns: go on with a value, or stop for a typed reason
//! ([`Stop`]) that the reconcile records the same way whichever phase stopped.

use std::ops::ControlFlow;

use crate::report::Stop;

/// What a phase returns: go on with a `T`, or stop for a reason.
pub(super) type Phase<T> = ControlFlow<Stop, T>;
