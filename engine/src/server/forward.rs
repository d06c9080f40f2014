//! Requests for a job another replica owns, sent on to that replica: the middleware in
//! front of every per-job route (`/v1/jobs/{id}...`, `/v1/videos/{id}...`).
//!
//! Behind a Service a client's poll lands on any replica. This one reads the id
//! ([`super::ids`]): its own job goes to the handler; a forged or unknown id is a 404 without
//! any connection made; a job of another replica is fetched from it over HTTP, with a
//! deadline on connecting, on the answer's headers and between the body's chunks, a bound
//! on the body's bytes, and the body streamed back as it comes (an MP4 is not held here). A
//! forwarded request carries [`FORWARDED_BY`] and is never sent on again, so two replicas
//! that disagree about an address cannot bounce a request between them. An owner that
//! cannot be reached is gone (its pod was deleted, or restarted at another address): the
//! client gets a 410 naming the job at once, not a hang.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderName, HeaderValue};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::task::JoinHandle;
use tokio::time::{Instant, Sleep};

use super::error::ApiError;
use super::ids::Owner;
use super::scheduler::Shared;
use crate::Error;

/// Marks a request one replica sent on to another (its value: the sender's address).
pub const FORWARDED_BY: HeaderName = HeaderName::from_static("x-layerwise-forwarded-by");

/// How a replica talks to the owner of a job.
#[derive(Debug, Clone, Copy)]
pub struct Forwarding {
    /// Connecting to the owner; past it the owner counts as gone.
    pub connect_timeout: Duration,
    /// The owner's answer must start within this, and each chunk of its body follow the
    /// last within it.
    pub timeout: Duration,
    /// Most bytes of an answer passed on (the largest result a replica keeps).
    pub max_body: u64,
}

impl Default for Forwarding {
    fn default() -> Self {
        Forwarding {
            connect_timeout: Duration::from_secs(2),
            timeout: Duration::from_secs(10),
            max_body: 1 << 30,
        }
    }
}

/// What [`route_job`] reads: the job ids and metrics the scheduler shares, and how to reach
/// another replica.
#[derive(Clone)]
pub struct JobRouting {
    pub shared: std::sync::Arc<Shared>,
    pub forwarding: Forwarding,
}

/// The middleware: the request goes to the handler when this replica owns the job, to the
/// owner when another does, and is answered here when the id names no job anyone could own.
pub async fn route_job(
    State(s): State<JobRouting>,
    Path(params): Path<HashMap<String, String>>,
    req: Request,
    next: Next,
) -> Response {
    let Some(id) = params.get("id") else {
        return next.run(req).await;
    };
    let shared = &s.shared;
    let owner = match shared.ids.parse(id) {
        Ok(Owner::Here(_)) => return next.run(req).await,
        Ok(Owner::Peer(owner)) => owner,
        Err(e) => return ApiError::from(e).into_response(),
    };
    let outcome = if let Some(from) = req.headers().get(FORWARDED_BY) {
        // The sender took the owner for another replica, and so does this one: whatever
        // holds that address now is not the job's owner.
        tracing::info!(job = %id, %owner, from = ?from, "a forwarded request for a job this replica does not own");
        Err(Error::ReplicaGone {
            job: id.clone(),
            owner: owner.to_string(),
        })
    } else {
        forward(s.forwarding, shared.ids.me(), owner, id, req).await
    };
    match outcome {
        Ok(r) => {
            shared.metrics.forwarded("ok");
            r
        }
        Err(e) => {
            shared.metrics.forwarded(e.label());
            ApiError::from(e).into_response()
        }
    }
}

/// One exchange with the owner: its status, headers and (streamed, bounded) body, or why
/// there is none.
async fn forward(
    f: Forwarding,
    me: Option<SocketAddr>,
    owner: SocketAddr,
    id: &str,
    req: Request,
) -> Result<Response, Error> {
    let unreachable = |msg: String| Error::ReplicaUnreachable {
        job: id.to_string(),
        owner: owner.to_string(),
        msg,
    };
    let path = req
        .uri()
        .path_and_query()
        .map_or_else(|| req.uri().path().to_string(), |p| p.as_str().to_string());
    let mut out = hyper::Request::builder()
        .method(req.method().clone())
        .uri(path)
        .body(Body::empty())
        .map_err(|e| unreachable(format!("cannot make the request: {e}")))?;
    let headers = out.headers_mut();
    headers.insert(
        header::HOST,
        HeaderValue::from_str(&owner.to_string()).expect("an address is a header value"),
    );
    // The owner checks the caller's credential itself ([`super::owner`]).
    if let Some(auth) = req.headers().get(header::AUTHORIZATION) {
        headers.insert(header::AUTHORIZATION, auth.clone());
    }
    let from = me.map_or_else(|| "unknown".to_string(), |a| a.to_string());
    headers.insert(
        FORWARDED_BY,
        HeaderValue::from_str(&from).expect("an address is a header value"),
    );

    let stream = match tokio::time::timeout(f.connect_timeout, TcpStream::connect(owner)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            tracing::info!(job = %id, %owner, error = %e, "the owner of a job is gone");
            return Err(gone(id, owner));
        }
        Err(_) => {
            tracing::info!(job = %id, %owner, timeout = ?f.connect_timeout, "the owner of a job did not take the connection");
            return Err(gone(id, owner));
        }
    };
    let exchange = async {
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| unreachable(e.to_string()))?;
        let conn = AbortOnDrop(tokio::spawn(async move {
            let _ = conn.await;
        }));
        let answer = sender
            .send_request(out)
            .await
            .map_err(|e| unreachable(e.to_string()))?;
        Ok::<_, Error>((answer, conn))
    };
    let (answer, conn) = tokio::time::timeout(f.timeout, exchange)
        .await
        .map_err(|_| unreachable(format!("no answer within {:?}", f.timeout)))??;
    let (parts, body) = answer.into_parts();
    if let Some(n) = body.size_hint().exact().filter(|n| *n > f.max_body) {
        return Err(unreachable(format!(
            "its answer of {n} bytes is over the {}-byte bound",
            f.max_body
        )));
    }
    tracing::debug!(job = %id, %owner, status = %parts.status, "forwarded");
    let body = Bounded {
        inner: body,
        left: f.max_body,
        idle: f.timeout,
        deadline: Box::pin(tokio::time::sleep(f.timeout)),
        _conn: conn,
    };
    let mut r = Response::new(Body::new(body));
    *r.status_mut() = parts.status;
    for (name, value) in &parts.headers {
        if !HOP_BY_HOP.contains(name) {
            r.headers_mut().append(name.clone(), value.clone());
        }
    }
    Ok(r)
}

fn gone(id: &str, owner: SocketAddr) -> Error {
    Error::ReplicaGone {
        job: id.to_string(),
        owner: owner.to_string(),
    }
}

/// Headers of one connection, not of the answer.
const HOP_BY_HOP: [HeaderName; 4] = [
    header::CONNECTION,
    header::TRANSFER_ENCODING,
    header::TE,
    header::UPGRADE,
];

/// The owner's connection task, ended when the answer's body is dropped (read to its end,
/// or given up by the client), so a stalled owner holds nothing here.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The owner's body as it arrives, cut off past `left` bytes or when a chunk is `idle` late.
struct Bounded {
    inner: Incoming,
    left: u64,
    idle: Duration,
    deadline: Pin<Box<Sleep>>,
    _conn: AbortOnDrop,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl HttpBody for Bounded {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    let n = data.len() as u64;
                    if n > this.left {
                        return Poll::Ready(Some(Err(
                            "the owner's answer is over the bound".into()
                        )));
                    }
                    this.left -= n;
                }
                let next = Instant::now() + this.idle;
                this.deadline.as_mut().reset(next);
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => match this.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Some(Err(format!(
                    "the owner sent nothing for {:?}",
                    this.idle
                )
                .into()))),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
