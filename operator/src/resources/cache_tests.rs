//! `workload.cache` from the DiffusionDeployment to the engine: the pod's environment
//! read back through `layerwise serve`'s own arguments gives the setting the CRD names,
//! and the engine's figure of what it holds is the one the planner reserved.

use clap::{Args, Command, FromArgMatches};
use serde_json::json;

use super::*;
use crds::DiffusionDeployment;
use layerwise_engine::cache::StepCache;
use layerwise_engine::server::ServeArgs;

fn dd(cache: Option<serde_json::Value>) -> DiffusionDeployment {
    let mut workload = json!({ "maxSteps": 40 });
    if let Some(c) = cache {
        workload["cache"] = c;
    }
    serde_json::from_value(json!({
        "apiVersion": "layerwise.dev/v1alpha1",
        "kind": "DiffusionDeployment",
        "metadata": { "name": "wan", "namespace": "ns" },
        "spec": {
            "model": { "family": "wan", "location": { "hostPath": "/models/wan" } },
            "workload": workload,
        },
    }))
    .unwrap()
}

/// `layerwise serve` as the pod runs it: its arguments, then each environment entry an
/// argument reads as that argument's flag (the process environment is not read).
fn serve_args(d: &DiffusionDeployment) -> Result<ServeArgs, clap::Error> {
    let deployment = deployment(
        d,
        &super::tests::plan(),
        1,
        "engine:test",
        &EnginePods::default(),
        &[],
    );
    let pod = deployment.spec.unwrap().template.spec.unwrap();
    let c = &pod.containers[0];
    let command = ServeArgs::augment_args(Command::new("serve"));
    let mut argv = vec!["serve".to_string()];
    for e in c.env.iter().flatten() {
        let Some(value) = &e.value else { continue };
        let flag = command
            .get_arguments()
            .find(|a| a.get_env().is_some_and(|n| n == e.name.as_str()))
            .and_then(|a| a.get_long());
        if let Some(long) = flag {
            argv.extend([format!("--{long}"), value.clone()]);
        }
    }
    argv.extend(c.args.iter().flatten().skip(1).cloned());
    let m = command.try_get_matches_from(argv)?;
    ServeArgs::from_arg_matches(&m)
}

#[test]
fn the_engine_parses_the_workloads_cache_as_the_crd_names_it() {
    let d = dd(Some(json!({
        "kind": "mag", "threshold": 0.04, "retentionRatio": 0.25, "ratios": [1.0, 0.98, 0.95],
    })));
    let a = serve_args(&d).unwrap();
    let want = StepCache::Mag {
        threshold: 0.04,
        max_skip_steps: 3,
        retention_ratio: 0.25,
        ratios: Some(vec![1.0, 0.98, 0.95]),
        calibrate: false,
    };
    assert_eq!(a.cache.as_ref(), Some(&want));
    let workload = &d.spec.workload;
    assert_eq!(workload.cache.as_ref().unwrap().step_cache().unwrap(), want);
    // What the engine keeps free for it is what the planner reserved.
    assert_eq!(
        a.cache.unwrap().hold(),
        crate::planner::cache_hold(workload)
    );
    assert_ne!(crate::planner::cache_hold(workload), Default::default());

    // No cache: no variable, and the engine runs none.
    let plain = dd(None);
    assert_eq!(serve_args(&plain).unwrap().cache, None);
    assert_eq!(
        crate::planner::cache_hold(&plain.spec.workload),
        Default::default()
    );
}

#[test]
fn a_setting_the_engine_refuses_fails_its_flag_by_name() {
    // Past the schema's rules (an API server that skipped them): the engine's flag
    // refuses it, naming the flag and the parameter.
    let d = dd(Some(json!({ "kind": "taylorseer", "maxOrder": 9 })));
    let e = serve_args(&d).unwrap_err().to_string();
    assert!(e.contains("--cache.max_order"), "{e}");
}
