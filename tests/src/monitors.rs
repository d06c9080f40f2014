//! The Prometheus Operator's monitors as Prometheus would follow them, without Prometheus:
//! enough of its CRDs for the apiserver to take the chart's ServiceMonitors and PodMonitors,
//! and the scrape targets those monitors select in the test cluster, resolved the way the
//! Prometheus Operator's service discovery does (a ServiceMonitor: the Services its selector
//! and namespace selector pick, the endpoint's named port, that port's target port on the
//! pods the Service selects; a PodMonitor: the pods its selector picks and the named
//! container port). The cluster has no Endpoints (loopback pod IPs), so a Service's pods are
//! found by its selector, as the endpoints controller would.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::ListParams;
use kube::{Api, Client, ResourceExt};
use serde_json::Value;

use crate::tools::{ok, tool};

/// Just enough of the Prometheus Operator's CRDs for the apiserver to take the chart's
/// monitors (any fields; the real CRDs validate them on a real cluster).
pub const CRDS: &str = r#"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: podmonitors.monitoring.coreos.com}
spec:
  group: monitoring.coreos.com
  scope: Namespaced
  names: {kind: PodMonitor, plural: podmonitors, singular: podmonitor, listKind: PodMonitorList}
  versions:
    - name: v1
      served: true
      storage: true
      schema: {openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}}
---
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: servicemonitors.monitoring.coreos.com}
spec:
  group: monitoring.coreos.com
  scope: Namespaced
  names: {kind: ServiceMonitor, plural: servicemonitors, singular: servicemonitor, listKind: ServiceMonitorList}
  versions:
    - name: v1
      served: true
      storage: true
      schema: {openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}}
"#;

/// The CRDs' names, for waiting until they are established.
pub const CRD_NAMES: [&str; 2] = [
    "podmonitors.monitoring.coreos.com",
    "servicemonitors.monitoring.coreos.com",
];

/// Applies [`CRDS`] (they stay, like any cluster's CRDs) and waits until they are served.
pub fn install() -> Result<()> {
    ok(
        tool(
            "kubectl",
            &["apply", "--server-side", "-f", "-"],
            Some(CRDS),
        )?,
        "kubectl apply of the monitor CRDs",
    )?;
    for crd in CRD_NAMES {
        let name = format!("crd/{crd}");
        let args = [
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            &name,
        ];
        ok(
            tool("kubectl", &args, None)?,
            "kubectl wait of the monitor CRDs",
        )?;
    }
    Ok(())
}

/// One scrape target a monitor selects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// `ServiceMonitor/<name>` or `PodMonitor/<name>`.
    pub monitor: String,
    pub pod: String,
    pub addr: SocketAddr,
    pub path: String,
}

/// Every target the ServiceMonitors and PodMonitors of namespace `ns` select: pods with an
/// IP, each endpoint's port resolved to a number. A port a monitor names that a selected pod
/// does not have is an error naming both (Prometheus would drop the target silently).
pub async fn targets(client: &Client, ns: &str) -> Result<Vec<Target>> {
    let get = |kind: &str| -> Result<Vec<Value>> {
        let text = ok(
            tool("kubectl", &["get", kind, "-n", ns, "-o", "json"], None)?,
            "kubectl get of the monitors",
        )?;
        let list: Value = serde_json::from_str(&text)?;
        Ok(list["items"].as_array().cloned().unwrap_or_default())
    };
    let pods: Vec<Pod> = Api::<Pod>::all(client.clone())
        .list(&ListParams::default())
        .await?
        .items;
    let services: Vec<Service> = Api::<Service>::all(client.clone())
        .list(&ListParams::default())
        .await?
        .items;
    let mut out = Vec::new();
    for m in get("servicemonitors.monitoring.coreos.com")? {
        let monitor = format!(
            "ServiceMonitor/{}",
            m["metadata"]["name"].as_str().unwrap_or("")
        );
        for s in services
            .iter()
            .filter(|s| in_namespaces(&m, &s.namespace().unwrap_or_default()))
            .filter(|s| selects(&m["spec"]["selector"], &json_labels(s.labels())))
        {
            let spec = s.spec.clone().unwrap_or_default();
            let Some(selector) = spec.selector.filter(|s| !s.is_empty()) else {
                continue;
            };
            for e in m["spec"]["endpoints"].as_array().into_iter().flatten() {
                let Some(port) = spec
                    .ports
                    .iter()
                    .flatten()
                    .find(|p| p.name.as_deref() == e["port"].as_str())
                else {
                    continue;
                };
                let target = port
                    .target_port
                    .clone()
                    .unwrap_or(IntOrString::Int(port.port));
                for p in pods.iter().filter(|p| {
                    p.namespace() == s.namespace()
                        && selector.iter().all(|(k, v)| p.labels().get(k) == Some(v))
                }) {
                    out.extend(target_of(&monitor, p, &target, e)?);
                }
            }
        }
    }
    for m in get("podmonitors.monitoring.coreos.com")? {
        let monitor = format!(
            "PodMonitor/{}",
            m["metadata"]["name"].as_str().unwrap_or("")
        );
        for p in pods
            .iter()
            .filter(|p| in_namespaces(&m, &p.namespace().unwrap_or_default()))
            .filter(|p| selects(&m["spec"]["selector"], &json_labels(p.labels())))
        {
            for e in m["spec"]["podMetricsEndpoints"]
                .as_array()
                .into_iter()
                .flatten()
            {
                let port = IntOrString::String(e["port"].as_str().unwrap_or("").to_string());
                out.extend(target_of(&monitor, p, &port, e)?);
            }
        }
    }
    Ok(out)
}

/// An object's labels as the JSON map [`selects`] reads.
fn json_labels(labels: &BTreeMap<String, String>) -> Value {
    Value::Object(
        labels
            .iter()
            .map(|(k, v)| (k.clone(), Value::String(v.clone())))
            .collect(),
    )
}

/// The target of endpoint `e` on pod `p` at `port` (a number, or a container port's name);
/// none while the pod has no IP.
fn target_of(monitor: &str, p: &Pod, port: &IntOrString, e: &Value) -> Result<Option<Target>> {
    let pod = p.name_any();
    let Some(ip) = p.status.as_ref().and_then(|s| s.pod_ip.clone()) else {
        return Ok(None);
    };
    let number = match port {
        IntOrString::Int(n) => *n,
        IntOrString::String(name) => p
            .spec
            .iter()
            .flat_map(|s| &s.containers)
            .flat_map(|c| c.ports.iter().flatten())
            .find(|c| c.name.as_deref() == Some(name.as_str()))
            .map(|c| c.container_port)
            .with_context(|| format!("{monitor} scrapes port {name}, which pod {pod} lacks"))?,
    };
    let ip: IpAddr = ip.parse().with_context(|| format!("pod {pod}: IP {ip}"))?;
    Ok(Some(Target {
        monitor: monitor.to_string(),
        pod,
        addr: SocketAddr::new(ip, u16::try_from(number)?),
        path: e["path"].as_str().unwrap_or("/metrics").to_string(),
    }))
}

/// Whether a label selector (`matchLabels` only, as the chart writes them) selects an
/// object with `labels` (a JSON map).
pub fn selects(selector: &Value, labels: &Value) -> bool {
    selector["matchLabels"]
        .as_object()
        .is_some_and(|m| m.iter().all(|(k, v)| labels.get(k) == Some(v)))
}

/// Whether a monitor's `namespaceSelector` takes `namespace` (its own when it has none).
pub fn in_namespaces(monitor: &Value, namespace: &str) -> bool {
    let sel = &monitor["spec"]["namespaceSelector"];
    if sel["any"] == true {
        return true;
    }
    match sel["matchNames"].as_array() {
        Some(names) => names.iter().any(|n| n == namespace),
        None => monitor["metadata"]["namespace"] == namespace,
    }
}
