//! The Secrets a pod's environment reads (`secretKeyRef`), fetched as a kubelet fetches
//! them when it starts the container.

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::{Api, Client};

/// A Secret's key as a container's `secretKeyRef` names it: (Secret, key).
pub(super) type SecretKey = (String, String);

/// The values of the Secrets' keys the pod's container takes into its environment, read as
/// a kubelet reads them when it starts the container. A key that is not there (yet) fails
/// the start, as `CreateContainerConfigError` does.
pub(super) async fn secret_values(
    client: &Client,
    namespace: &str,
    pod: &Pod,
) -> Result<BTreeMap<SecretKey, String>> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let mut values = BTreeMap::new();
    let containers = pod.spec.iter().flat_map(|s| &s.containers);
    for e in containers.flat_map(|c| c.env.iter().flatten()) {
        let Some(r) = e
            .value_from
            .as_ref()
            .and_then(|f| f.secret_key_ref.as_ref())
        else {
            continue;
        };
        let secret = secrets
            .get(&r.name)
            .await
            .with_context(|| format!("env {}: reading Secret {}", e.name, r.name))?;
        let value = secret
            .data
            .as_ref()
            .and_then(|d| d.get(&r.key))
            .with_context(|| format!("env {}: Secret {} has no key {}", e.name, r.name, r.key))?;
        let value = String::from_utf8(value.0.clone()).with_context(|| {
            format!(
                "env {}: Secret {} key {} is not text",
                e.name, r.name, r.key
            )
        })?;
        values.insert((r.name.clone(), r.key.clone()), value);
    }
    Ok(values)
}
