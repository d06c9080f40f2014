//! The `InferencePool` (Gateway API inference extension, `inference.networking.k8s.io/v1`)
//! a DiffusionDeployment may ask for, so a gateway and its endpoint picker route requests
//! to the engine pods. The operator holds no typed client for that API: it builds the pool
//! as a [`DynamicObject`] ([`pool`], pure), checks by discovery that the cluster serves the
//! API ([`unserved`], pure over the discovery answer), and applies or deletes it
//! ([`reconcile`]). A cluster without the API gets the `InferencePool` condition False with
//! reason [`UNAVAILABLE`] naming the API, not a failed reconcile.

use crds::DiffusionDeployment;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::APIResourceList;
use kube::api::{DeleteParams, Patch, PatchParams};
use kube::core::{ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::events::EventType;
use kube::{Api, ResourceExt};
use serde_json::json;

use crate::conditions as cond;
use crate::context::{Context, MANAGER};
use crate::error::{kube, Result};
use crate::report::Report;
use crate::requests::model_id;
use crate::resources::{self, ENGINE_PORT};

pub const GROUP: &str = "inference.networking.k8s.io";
pub const VERSION: &str = "v1";
pub const KIND: &str = "InferencePool";
pub const PLURAL: &str = "inferencepools";
/// The `InferencePool` condition's reason when the cluster does not serve the API.
pub const UNAVAILABLE: &str = "InferencePoolUnavailable";

/// The InferencePool API as kube's dynamic client addresses it.
pub fn api_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, VERSION, KIND), PLURAL)
}

/// Whether `dd`'s spec asks for an InferencePool.
pub fn wanted(dd: &DiffusionDeployment) -> bool {
    dd.spec.inference_pool.as_ref().is_some_and(|p| p.enabled)
}

/// The InferencePool of `dd` when its spec enables one: its name and namespace, owned by it
/// (collected with it), selecting the engine pods by the labels the engine Service selects
/// them by, targeting the engine's HTTP port (which also serves the `/metrics` an endpoint
/// picker reads), with the spec's endpoint picker.
pub fn pool(dd: &DiffusionDeployment) -> Option<DynamicObject> {
    let routing = dd.spec.inference_pool.as_ref().filter(|p| p.enabled)?;
    let mut spec = json!({
        "selector": { "matchLabels": resources::selector_labels(dd) },
        "targetPorts": [{ "number": ENGINE_PORT }],
    });
    if let Some(picker) = &routing.endpoint_picker_ref {
        let mut r = json!({
            "name": picker.name,
            "failureMode": picker.failure_mode.as_str(),
        });
        if let Some(group) = &picker.group {
            r["group"] = json!(group);
        }
        if let Some(kind) = &picker.kind {
            r["kind"] = json!(kind);
        }
        if let Some(port) = &picker.port {
            r["port"] = json!({ "number": port.number });
        }
        spec["endpointPickerRef"] = r;
    }
    let mut obj = DynamicObject::new(&dd.name_any(), &api_resource()).data(json!({ "spec": spec }));
    obj.metadata = resources::owned_meta(dd);
    Some(obj)
}

/// Why the cluster cannot hold an InferencePool, given discovery's list of the resources
/// its `inference.networking.k8s.io/v1` serves (`None`: the group version is not served at
/// all); `None` when it can.
pub fn unserved(served: Option<&APIResourceList>) -> Option<String> {
    let has = served.is_some_and(|l| l.resources.iter().any(|r| r.name == PLURAL));
    (!has).then(|| {
        format!(
            "spec.inferencePool.enabled is true, but the cluster does not serve the {KIND} API \
             ({PLURAL}.{GROUP}/{VERSION}): install the Gateway API inference extension's CRDs; \
             no InferencePool was created"
        )
    })
}

/// What the cluster's discovery says of the InferencePool API.
async fn discover(ctx: &Context) -> Result<Option<APIResourceList>> {
    match ctx
        .client
        .list_api_group_resources(&format!("{GROUP}/{VERSION}"))
        .await
    {
        Ok(list) => Ok(Some(list)),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(None),
        Err(e) => Err(kube(format!("discovering {GROUP}/{VERSION}"))(e)),
    }
}

/// Applies the InferencePool `dd` asks for, or deletes the one a former spec asked for
/// (once per spec without one, as [`Context::no_pool`] keeps), and reports it in the
/// `InferencePool` condition (removed while none is asked for).
pub async fn reconcile(dd: &DiffusionDeployment, ctx: &Context, r: &mut Report) -> Result<()> {
    let id = model_id(dd);
    let uid = dd.uid().unwrap_or_default();
    let name = dd.name_any();
    let ar = api_resource();
    let pools: Api<DynamicObject> =
        Api::namespaced_with(ctx.client.clone(), &dd.namespace().unwrap_or_default(), &ar);
    let Some(desired) = pool(dd) else {
        r.clear(cond::INFERENCE_POOL);
        if ctx.no_pool.lock().expect("not poisoned").contains(&uid) {
            return Ok(());
        }
        match pools.delete(&name, &DeleteParams::default()).await {
            Ok(_) => {
                let note = format!("deleted InferencePool {name}: the spec asks for none");
                r.event(EventType::Normal, "InferencePoolDeleted", "Route", note);
            }
            // No such pool, or no such API: nothing to delete either way.
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(kube(format!("deleting InferencePool of {id}"))(e)),
        }
        ctx.no_pool.lock().expect("not poisoned").insert(uid);
        return Ok(());
    };
    ctx.no_pool.lock().expect("not poisoned").remove(&uid);
    if let Some(why) = unserved(discover(ctx).await?.as_ref()) {
        r.fault(cond::INFERENCE_POOL, UNAVAILABLE, "Route", &why);
        return Ok(());
    }
    pools
        .patch(
            &name,
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&desired),
        )
        .await
        .map_err(kube(format!("applying InferencePool of {id}")))?;
    let msg = format!(
        "InferencePool {name} selects the engine pods on port {ENGINE_PORT}{}",
        match dd
            .spec
            .inference_pool
            .as_ref()
            .and_then(|p| p.endpoint_picker_ref.as_ref())
        {
            Some(p) => format!("; endpoint picker {}", p.name),
            None => "; no endpoint picker named".into(),
        }
    );
    if !r.was_true(cond::INFERENCE_POOL) {
        r.event(
            EventType::Normal,
            "InferencePoolApplied",
            "Route",
            msg.clone(),
        );
    }
    r.set(cond::INFERENCE_POOL, true, "Applied", msg);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::APIResource;

    fn dd(spec: serde_json::Value) -> DiffusionDeployment {
        let mut v = json!({
            "apiVersion": "layerwise.dev/v1alpha1",
            "kind": "DiffusionDeployment",
            "metadata": { "name": "wan", "namespace": "ns", "uid": "u-1" },
            "spec": { "model": { "family": "wan", "location": { "hostPath": "/models/wan" } } },
        });
        for (k, x) in spec.as_object().unwrap() {
            v["spec"][k] = x.clone();
        }
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn no_pool_unless_enabled() {
        assert!(pool(&dd(json!({}))).is_none());
        let off = dd(
            json!({ "inferencePool": { "enabled": false, "endpointPickerRef": { "name": "epp", "port": { "number": 9002 } } } }),
        );
        assert!(pool(&off).is_none());
        assert!(!wanted(&off));
    }

    #[test]
    fn the_pool_selects_the_engine_pods_on_the_engine_port_owned_by_the_deployment() {
        let d = dd(json!({ "inferencePool": { "enabled": true } }));
        let p = pool(&d).unwrap();
        let v = serde_json::to_value(&p).unwrap();
        assert_eq!(v["apiVersion"], "inference.networking.k8s.io/v1");
        assert_eq!(v["kind"], "InferencePool");
        assert_eq!(p.metadata.name.as_deref(), Some("wan"));
        assert_eq!(p.metadata.namespace.as_deref(), Some("ns"));
        let owner = &p.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str(), owner.uid.as_str()),
            ("DiffusionDeployment", "wan", "u-1")
        );
        assert_eq!(owner.controller, Some(true));
        // The same pods the engine Service sends to.
        let service = resources::service(&d);
        let selector = service.spec.unwrap().selector.unwrap();
        assert_eq!(
            v["spec"]["selector"]["matchLabels"],
            serde_json::to_value(&selector).unwrap()
        );
        assert_eq!(v["spec"]["targetPorts"], json!([{ "number": ENGINE_PORT }]));
        assert!(v["spec"].get("endpointPickerRef").is_none(), "{v}");
    }

    #[test]
    fn the_pool_names_the_specs_endpoint_picker() {
        let d = dd(
            json!({ "inferencePool": { "enabled": true, "endpointPickerRef": {
            "name": "wan-epp", "port": { "number": 9002 }, "failureMode": "FailOpen" } } }),
        );
        let v = serde_json::to_value(pool(&d).unwrap()).unwrap();
        assert_eq!(
            v["spec"]["endpointPickerRef"],
            json!({ "name": "wan-epp", "port": { "number": 9002 }, "failureMode": "FailOpen" })
        );
        // Unset failure mode: the API's default, written out.
        let d = dd(
            json!({ "inferencePool": { "enabled": true, "endpointPickerRef": {
            "group": "", "kind": "Service", "name": "epp", "port": { "number": 9002 } } } }),
        );
        let v = serde_json::to_value(pool(&d).unwrap()).unwrap();
        assert_eq!(
            v["spec"]["endpointPickerRef"],
            json!({ "group": "", "kind": "Service", "name": "epp", "port": { "number": 9002 }, "failureMode": "FailClose" })
        );
    }

    #[test]
    fn a_cluster_without_the_api_is_refused_naming_it() {
        let why = unserved(None).unwrap();
        assert!(
            why.contains("inferencepools.inference.networking.k8s.io/v1")
                && why.contains("spec.inferencePool.enabled"),
            "{why}"
        );
        // The group version served, but without the pools (another of its kinds only).
        let other = APIResourceList {
            group_version: "inference.networking.k8s.io/v1".into(),
            resources: vec![APIResource {
                name: "inferenceobjectives".into(),
                kind: "InferenceObjective".into(),
                namespaced: true,
                ..Default::default()
            }],
        };
        assert!(unserved(Some(&other)).is_some());
        let served = APIResourceList {
            resources: vec![APIResource {
                name: PLURAL.into(),
                kind: KIND.into(),
                namespaced: true,
                ..Default::default()
            }],
            ..other
        };
        assert_eq!(unserved(Some(&served)), None);
    }
}
