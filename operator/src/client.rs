//! The operator's Kubernetes client: kube's own service stack with one more layer on top
//! that counts every request by verb and resource into the metrics
//! (`layerwise_operator_api_requests_total`). What the operator costs the apiserver is then
//! a figure on `/metrics`, per reconcile and per fleet, not a guess.

use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Method, Request, Uri};
use kube::client::ClientBuilder;
use kube::{Client, Config};
use tower::{Layer, Service};

use crate::telemetry::Telemetry;

/// A client for `config` whose requests are counted into `telemetry`.
pub fn counted(config: Config, telemetry: Arc<Telemetry>) -> kube::Result<Client> {
    Ok(ClientBuilder::try_from(config)?
        .with_layer(&CountLayer { telemetry })
        .build())
}

/// The verb and resource of a request to the Kubernetes API, as the apiserver's audit log
/// names them: `GET` of a collection is `list` (`watch` with `?watch=`), of one object
/// `get`; the resource carries its subresource (`pods/status`). Discovery and anything
/// else outside a resource path is `other`.
pub fn classify(method: &Method, uri: &Uri) -> (&'static str, String) {
    let segments: Vec<&str> = uri.path().split('/').filter(|s| !s.is_empty()).collect();
    let rest = match segments.as_slice() {
        ["api", _version, rest @ ..] => rest,
        ["apis", _group, _version, rest @ ..] => rest,
        _ => &[][..],
    };
    // Namespaced paths: namespaces/<ns>/<resource>/...
    let rest = match rest {
        ["namespaces", _ns, tail @ ..] if !tail.is_empty() => tail,
        _ => rest,
    };
    let (resource, collection) = match rest {
        [] => ("other".to_string(), false),
        [r] => (r.to_string(), true),
        [r, _name] => (r.to_string(), false),
        [r, _name, sub, ..] => (format!("{r}/{sub}"), false),
    };
    let watching = uri
        .query()
        .is_some_and(|q| q.split('&').any(|p| p == "watch=true" || p == "watch=1"));
    let verb = match *method {
        Method::GET if watching => "watch",
        Method::GET if collection => "list",
        Method::GET => "get",
        Method::POST => "create",
        Method::PUT => "update",
        Method::PATCH => "patch",
        Method::DELETE if collection => "deletecollection",
        Method::DELETE => "delete",
        _ => "other",
    };
    (verb, resource)
}

/// The counting layer.
#[derive(Clone)]
pub struct CountLayer {
    telemetry: Arc<Telemetry>,
}

impl<S> Layer<S> for CountLayer {
    type Service = Counted<S>;

    fn layer(&self, inner: S) -> Counted<S> {
        Counted {
            inner,
            telemetry: self.telemetry.clone(),
        }
    }
}

/// A service that counts each request, then hands it on unchanged.
#[derive(Clone)]
pub struct Counted<S> {
    inner: S,
    telemetry: Arc<Telemetry>,
}

impl<S, B> Service<Request<B>> for Counted<S>
where
    S: Service<Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let (verb, resource) = classify(req.method(), req.uri());
        self.telemetry.metrics.api_request(verb, &resource);
        self.inner.call(req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(method: Method, uri: &str) -> (&'static str, String) {
        classify(&method, &uri.parse().unwrap())
    }

    #[test]
    fn names_verbs_and_resources_as_the_audit_log_does() {
        let cases = [
            (Method::GET, "/api/v1/nodes?limit=500", ("list", "nodes")),
            (
                Method::GET,
                "/api/v1/nodes?watch=true&resourceVersion=7",
                ("watch", "nodes"),
            ),
            (Method::GET, "/api/v1/nodes/n1", ("get", "nodes")),
            (
                Method::GET,
                "/api/v1/namespaces/ns/pods?labelSelector=a%3Db",
                ("list", "pods"),
            ),
            (
                Method::PATCH,
                "/apis/layerwise.dev/v1alpha1/namespaces/ns/diffusiondeployments/dd/status?fieldManager=x",
                ("patch", "diffusiondeployments/status"),
            ),
            (
                Method::PATCH,
                "/apis/layerwise.dev/v1alpha1/diffusionnodes/n1",
                ("patch", "diffusionnodes"),
            ),
            (
                Method::POST,
                "/api/v1/namespaces/ns/secrets",
                ("create", "secrets"),
            ),
            (Method::GET, "/api/v1/namespaces/ns", ("get", "namespaces")),
            (Method::GET, "/api/v1/namespaces", ("list", "namespaces")),
            (
                Method::DELETE,
                "/apis/apps/v1/namespaces/ns/deployments/d",
                ("delete", "deployments"),
            ),
            (Method::GET, "/version", ("get", "other")),
            (Method::GET, "/apis", ("get", "other")),
        ];
        for (method, uri, (verb, resource)) in cases {
            assert_eq!(c(method, uri), (verb, resource.to_string()), "{uri}");
        }
    }
}
