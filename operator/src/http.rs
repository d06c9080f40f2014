//! `/metrics`, `/healthz` and `/readyz`, served through the engine's HTTP layer
//! (`layerwise_engine::http::serve`: header deadline, connection cap, bounded drain).
//!
//! Liveness is the process answering. Readiness is [`Health::ready`]: a standby is ready
//! (it has nothing to do until it holds the lease, and a rollout of two replicas must not
//! wait on the one that stands by); the leader is ready once its stores are synced.
//!
//! [`Health::ready`]: crate::telemetry::Health::ready

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;

use crate::telemetry::Telemetry;

pub fn app(telemetry: Arc<Telemetry>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(telemetry)
}

async fn metrics(State(t): State<Arc<Telemetry>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        t.metrics.encode(),
    )
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(t): State<Arc<Telemetry>>) -> impl IntoResponse {
    match t.health.ready() {
        Ok(why) => (StatusCode::OK, why),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, why),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    async fn get(t: &Arc<Telemetry>, path: &str) -> (StatusCode, String) {
        let req = axum::http::Request::get(path).body(Body::empty()).unwrap();
        let res = app(t.clone()).oneshot(req).await.unwrap();
        let status = res.status();
        let body = res.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    #[tokio::test]
    async fn probes_follow_the_lease_and_the_stores() {
        let t = Arc::new(Telemetry::default());
        assert_eq!(get(&t, "/healthz").await.0, StatusCode::OK);
        let (status, body) = get(&t, "/readyz").await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert!(body.contains("standby"), "{body}");
        t.lead(true);
        let (status, body) = get(&t, "/readyz").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        t.synced();
        assert_eq!(get(&t, "/readyz").await.0, StatusCode::OK);
        t.metrics.planned("resident");
        let (status, body) = get(&t, "/metrics").await;
        assert_eq!(status, StatusCode::OK);
        assert!(body.contains("layerwise_operator_leader 1"), "{body}");
        assert!(
            body.contains("layerwise_operator_plans_total{strategy=\"resident\"} 1"),
            "{body}"
        );
        assert!(
            body.contains("layerwise_operator_build_info{version=\""),
            "{body}"
        );
        assert_eq!(get(&t, "/nothing").await.0, StatusCode::NOT_FOUND);
    }

    #[tokio::test]
    async fn metrics_pass_prometheus_rules() {
        // Every family with a series, so the rules see each one's samples.
        let t = Arc::new(Telemetry::default());
        t.metrics
            .reconciled(std::time::Duration::from_millis(3), Some("kube"));
        t.metrics.stopped("Unschedulable");
        t.metrics.planned("resident");
        t.metrics.scrape_failed("ns/d", 1);
        t.metrics.api_request("get", "pods");
        let (_, body) = get(&t, "/metrics").await;
        assert_eq!(
            layerwise_core::exposition::lint(&body),
            Vec::<String>::new(),
            "{body}"
        );
    }
}
