//! The DiffusionDeployment CRD's own rules, applied to a spec read from a file or flags, so
//! that `layerwise-operator plan` refuses what `kubectl apply` would refuse before the
//! planner sees it. The rules are read from the schema the CRD types generate (the one
//! committed under `crds/`), never restated: unknown fields, bounds (`minimum`, `maximum`,
//! lengths, enums), and the `x-kubernetes-validations` rules written as comparisons of
//! `self` with numbers (`self >= 8 && self <= 16384`, `self > 0.0`), which are every bound
//! the planner reads. Rules of other shapes (across fields, on strings) the API server
//! evaluates; the planner refuses contradictory settings itself.

use crds::DiffusionDeployment;
use kube::CustomResourceExt;
use serde_json::Value;

/// What in `spec` (a DiffusionDeployment's `spec`, as JSON) breaks the CRD's rules, each as
/// `spec.<path>: <why>`; empty where nothing does.
pub fn check_spec(spec: &Value) -> Vec<String> {
    let crd = serde_json::to_value(DiffusionDeployment::crd()).expect("a CRD serializes");
    let schema = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
    let mut broken = Vec::new();
    check(schema, spec, "spec", &mut broken);
    broken
}

/// Checks `value` at `path` against `schema`, pushing what breaks it onto `broken`.
fn check(schema: &Value, value: &Value, path: &str, broken: &mut Vec<String>) {
    if value.is_null() && schema["nullable"] == Value::Bool(true) {
        return;
    }
    for rule in schema["x-kubernetes-validations"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let text = rule["rule"].as_str().unwrap_or_default();
        if comparison(text, value) == Some(false) {
            let why = rule["message"].as_str().unwrap_or(text);
            broken.push(format!("{path}: {why} (got {value})"));
        }
    }
    bounds(schema, value, path, broken);
    match value {
        Value::Object(fields) => {
            let properties = schema["properties"].as_object();
            let open = schema["x-kubernetes-preserve-unknown-fields"] == Value::Bool(true);
            for (name, v) in fields {
                let at = format!("{path}.{name}");
                match (
                    properties.and_then(|p| p.get(name)),
                    &schema["additionalProperties"],
                ) {
                    (Some(s), _) => check(s, v, &at, broken),
                    (None, extra @ Value::Object(_)) => check(extra, v, &at, broken),
                    (None, _) if open || properties.is_none() => {}
                    (None, _) => broken.push(format!("{at}: no such field")),
                }
            }
            for name in schema["required"].as_array().into_iter().flatten() {
                let name = name.as_str().unwrap_or_default();
                if !fields.contains_key(name) {
                    broken.push(format!("{path}.{name}: required"));
                }
            }
        }
        Value::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                check(&schema["items"], v, &format!("{path}[{i}]"), broken);
            }
        }
        _ => {}
    }
}

/// The schema's own bounds on `value`: type, numeric range, length, enum.
fn bounds(schema: &Value, value: &Value, path: &str, broken: &mut Vec<String>) {
    let ty = schema["type"].as_str().unwrap_or_default();
    let fits = match (ty, value) {
        ("integer", Value::Number(n)) => n.is_i64() || n.is_u64(),
        ("number", Value::Number(_)) | ("string", Value::String(_)) => true,
        ("boolean", Value::Bool(_)) | ("object", Value::Object(_)) => true,
        ("array", Value::Array(_)) | ("", _) => true,
        _ => false,
    };
    if !fits {
        broken.push(format!("{path}: must be of type {ty} (got {value})"));
        return;
    }
    if let (Some(x), Some(min)) = (value.as_f64(), schema["minimum"].as_f64()) {
        if x < min {
            broken.push(format!("{path}: must be at least {min} (got {value})"));
        }
    }
    if let (Some(x), Some(max)) = (value.as_f64(), schema["maximum"].as_f64()) {
        if x > max {
            broken.push(format!("{path}: must be at most {max} (got {value})"));
        }
    }
    if let Some(s) = value.as_str() {
        let len = s.chars().count() as u64;
        if schema["minLength"].as_u64().is_some_and(|m| len < m) {
            broken.push(format!(
                "{path}: must not be empty or shorter (got {value})"
            ));
        }
        if schema["maxLength"].as_u64().is_some_and(|m| len > m) {
            broken.push(format!("{path}: too long (got {len} characters)"));
        }
    }
    if let Some(allowed) = schema["enum"].as_array() {
        if !allowed.contains(value) {
            let names: Vec<String> = allowed.iter().map(Value::to_string).collect();
            broken.push(format!(
                "{path}: must be one of {} (got {value})",
                names.join(", ")
            ));
        }
    }
}

/// The verdict of `rule` on `value` where the rule compares `self` with numbers, joined by
/// `&&`; `None` for a rule of any other shape or a value that is no number.
fn comparison(rule: &str, value: &Value) -> Option<bool> {
    let x = value.as_f64()?;
    let mut verdict = true;
    for part in rule.split("&&") {
        let rest = part.trim().strip_prefix("self")?.trim_start();
        let (op, number) = [">=", "<=", "==", "!=", ">", "<"]
            .into_iter()
            .find_map(|op| rest.strip_prefix(op).map(|n| (op, n)))?;
        let n: f64 = number.trim().parse().ok()?;
        verdict &= match op {
            ">=" => x >= n,
            "<=" => x <= n,
            "==" => x == n,
            "!=" => x != n,
            ">" => x > n,
            _ => x < n,
        };
    }
    Some(verdict)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(extra: Value) -> Value {
        let mut s = json!({
            "model": { "family": "wan", "location": { "hostPath": "/m" } }
        });
        for (k, v) in extra.as_object().unwrap() {
            s[k] = v.clone();
        }
        s
    }

    #[test]
    fn a_spec_within_the_rules_passes() {
        let s = spec(json!({
            "workload": { "maxWidth": 1280, "maxHeight": 720, "maxFrames": 81, "maxLatencySeconds": 600.0 },
            "strategy": "sharded", "dp": 2, "slots": 2,
            "accelerator": { "rates": { "deviceTflops": 400.0 } }
        }));
        assert_eq!(check_spec(&s), Vec::<String>::new());
    }

    #[test]
    fn the_crds_own_bounds_and_messages_refuse_what_the_api_server_would() {
        let s = spec(json!({
            "workload": { "maxWidth": 4, "maxFrames": 2000, "maxLatencySeconds": 0.0, "maxHieght": 720 },
            "slots": 1,
            "accelerator": { "rates": { "peerGBps": -1.0 } }
        }));
        let broken = check_spec(&s).join("\n");
        for want in [
            "spec.workload.maxWidth: maxWidth must be between 8 and 16384 (got 4)",
            "spec.workload.maxFrames: maxFrames must be between 1 and 1024 (got 2000)",
            "spec.workload.maxLatencySeconds: maxLatencySeconds must be positive",
            "spec.workload.maxHieght: no such field",
            "spec.slots:",
            "spec.accelerator.rates.peerGBps: peerGBps must be positive",
        ] {
            assert!(broken.contains(want), "{want}\nin\n{broken}");
        }
        let s = json!({ "model": { "location": { "hostPath": "/m" } }, "dp": "two" });
        let broken = check_spec(&s).join("\n");
        assert!(broken.contains("spec.model.family: required"), "{broken}");
        assert!(
            broken.contains("spec.dp: must be of type integer"),
            "{broken}"
        );
    }

    #[test]
    fn only_comparisons_of_self_with_numbers_are_evaluated() {
        assert_eq!(comparison("self >= 8 && self <= 16", &json!(9)), Some(true));
        assert_eq!(
            comparison("self >= 8 && self <= 16", &json!(17)),
            Some(false)
        );
        assert_eq!(comparison("self > 0.0", &json!(0.0)), Some(false));
        assert_eq!(comparison("self.startsWith('/')", &json!("/m")), None);
        assert_eq!(comparison("self == oldSelf", &json!(3)), None);
        assert_eq!(comparison("self >= 1", &json!("x")), None);
    }
}
