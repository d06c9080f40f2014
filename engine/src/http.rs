//! Serving the router over TCP with the limits a server facing untrusted clients keeps,
//! from hyper's own connection layer: a deadline on reading each request's headers (which
//! also closes idle keep-alive connections), a cap on open connections (more wait in the
//! listen backlog, so `/healthz` is always answered once one frees), and a shutdown that
//! drains connections for a bounded time and then closes what is left. The body's own
//! deadline is applied where the body is read ([`super::api`]).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1::Builder;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// Connection limits of the HTTP server.
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    /// A request's headers must arrive within this (idle connections close after it too).
    pub header_timeout: Duration,
    /// Connections served at once.
    pub max_connections: usize,
    /// After shutdown begins, how long open connections may take to finish.
    pub drain: Duration,
}

impl HttpLimits {
    /// For a server of probes and scrapes only (the agent's and the operator's): a few
    /// connections, short deadlines.
    pub const PROBES: HttpLimits = HttpLimits {
        header_timeout: Duration::from_secs(10),
        max_connections: 64,
        drain: Duration::from_secs(5),
    };
}

/// Serves `app` on `listener` until `shutdown` resolves, then drains open connections for at
/// most `limits.drain` and closes the rest.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: HttpLimits,
    shutdown: impl Future<Output = ()>,
) {
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    // HTTP/1.1, one request per connection: a generation is seconds to minutes of work, so
    // reconnecting costs nothing, and no connection can sit idle between requests holding
    // a slot. hyper's header deadline runs from a request's first byte; a client that
    // connects and sends nothing is closed at the same deadline below.
    let mut builder = Builder::new();
    builder
        .timer(TokioTimer::new())
        .keep_alive(false)
        .header_read_timeout(limits.header_timeout);
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            p = permits.clone().acquire_owned() => p.expect("the semaphore is never closed"),
            () = &mut shutdown => break,
        };
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of descriptors and the like: wait a moment, keep serving.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let (app, builder, watcher) = (app.clone(), builder.clone(), graceful.watcher());
        let first_byte = limits.header_timeout;
        tokio::spawn(async move {
            // A client that connects and sends nothing is closed at the header deadline.
            let mut byte = [0u8; 1];
            if !matches!(
                tokio::time::timeout(first_byte, stream.peek(&mut byte)).await,
                Ok(Ok(1))
            ) {
                return drop(permit);
            }
            let service = TowerToHyperService::new(app);
            let conn = builder.serve_connection(TokioIo::new(stream), service);
            if let Err(e) = watcher.watch(conn).await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
            drop(permit);
        });
    }
    drop(listener);
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(limits.drain) => {
            tracing::warn!(drain = ?limits.drain, "connections still open after the drain period; closing them");
        }
    }
}
