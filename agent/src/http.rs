//! `/metrics` and `/healthz`. Healthy means the node loop ticked recently: a stuck loop
//! (a hung API call, a deadlock) fails the liveness probe and gets the agent restarted.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;

use crate::metrics::Metrics;

/// A loop that has not ticked for this long is unhealthy.
pub const STALE_AFTER: Duration = Duration::from_secs(60);

/// What the handlers read.
pub struct AppState {
    pub metrics: Arc<Metrics>,
    /// Unix seconds of the node loop's last tick.
    pub last_tick: AtomicU64,
}

impl AppState {
    pub fn new(metrics: Arc<Metrics>) -> Self {
        AppState {
            metrics,
            last_tick: AtomicU64::new(now()),
        }
    }

    pub fn tick(&self) {
        self.last_tick.store(now(), Ordering::Relaxed);
    }
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

pub fn app(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .with_state(state)
}

async fn metrics(State(s): State<Arc<AppState>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.encode(),
    )
}

async fn healthz(State(s): State<Arc<AppState>>) -> impl IntoResponse {
    let age = now().saturating_sub(s.last_tick.load(Ordering::Relaxed));
    if age > STALE_AFTER.as_secs() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("node loop last ticked {age}s ago\n"),
        )
    } else {
        (StatusCode::OK, "ok\n".to_string())
    }
}
