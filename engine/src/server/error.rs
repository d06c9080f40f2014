//! [`ApiError`]: the error every handler and the scheduler answer with. It lives apart from
//! the server's wiring in `mod.rs` so that the modules that answer with it (the scheduler,
//! its actor, the API, forwarding) depend on this file alone, not on the module that
//! declares them; its HTTP form is in [`super::api`] beside the other response bodies.

use std::sync::Arc;

use crate::Error;

/// An error on its way to an HTTP response (shared: one failure may answer many waiters).
#[derive(Debug, Clone)]
pub struct ApiError(pub Arc<Error>);

impl From<Error> for ApiError {
    fn from(e: Error) -> Self {
        ApiError(Arc::new(e))
    }
}
