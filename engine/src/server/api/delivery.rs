//! The answer to a request that queued a job carries the job until it is sent. hyper drops a
//! request's handler, and the answer it made, when the client's side of the connection
//! closes before the answer is written (a half-close included: hyper reads end-of-file
//! from a client with a request in flight as the client going away). A job whose answer was
//! dropped would run for nobody, so the [`Submission`] rides in the answer's body and
//! cancels the job when the body is dropped before its last byte was handed to hyper;
//! once it was, the client has its answer and the job is its own.

use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use axum::response::Response;
use http_body::{Body as HttpBody, Frame, SizeHint};

use crate::server::scheduler::Submission;

/// `response`, whose body now holds `job` until it has been sent.
pub(super) fn deliver(response: Response, job: Submission) -> Response {
    let (parts, body) = response.into_parts();
    Response::from_parts(
        parts,
        Body::new(Delivering {
            inner: body,
            job: Some(job),
        }),
    )
}

/// A body that answers its job's submission once its end is reached.
struct Delivering {
    inner: Body,
    job: Option<Submission>,
}

impl Delivering {
    fn sent(&mut self) {
        if let Some(mut job) = self.job.take() {
            job.answered();
        }
    }
}

impl HttpBody for Delivering {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = self.get_mut();
        let frame = Pin::new(&mut this.inner).poll_frame(cx);
        // hyper stops polling a body that says it has ended, so its last frame is the end.
        if matches!(frame, Poll::Ready(None)) || this.inner.is_end_stream() {
            this.sent();
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
