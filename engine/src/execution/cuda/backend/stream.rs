//! A CUDA stream and event that carry the first failure of the work enqueued on them: a
//! stream that failed poisons every event recorded on it afterwards, so whoever waits on
//! one learns of the failure (a [`Fault`], typed) instead of hanging.

use std::sync::{Arc, Mutex};

use candle_core::cuda_backend::cudarc::driver as cu;

use crate::execution::fault::Fault;

/// A CUDA stream with the first error of any work enqueued on it.
pub struct CudaStream {
    pub(super) name: String,
    pub(in crate::execution::cuda) inner: Arc<cu::CudaStream>,
    pub(super) error: Arc<Mutex<Option<Fault>>>,
}

impl CudaStream {
    pub(in crate::execution::cuda) fn poison(&self, why: Fault) {
        tracing::error!(stream = %self.name, error = %why, "stream failed");
        self.error.lock().expect("stream lock").get_or_insert(why);
    }
    pub(super) fn error(&self) -> Option<Fault> {
        self.error.lock().expect("stream lock").clone()
    }
    pub fn name(&self) -> &str {
        &self.name
    }
}

pub(super) struct EventInner {
    pub(super) ev: std::result::Result<cu::CudaEvent, String>,
    pub(super) error: Mutex<Option<Fault>>,
}

/// A CUDA event plus the error of the stream that last recorded it.
#[derive(Clone)]
pub struct CudaEvent(pub(super) Arc<EventInner>);

impl CudaEvent {
    pub(super) fn fail(&self, why: Fault) {
        self.0.error.lock().expect("event lock").get_or_insert(why);
    }
    pub(super) fn error(&self) -> Option<Fault> {
        if let Err(e) = &self.0.ev {
            return Some(Fault::Failed(e.clone()));
        }
        self.0.error.lock().expect("event lock").clone()
    }
}
