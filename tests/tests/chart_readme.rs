//! The chart README's values table is generated from `values.yaml`, its defaults and the
//! comments above each key, so it cannot drift from the chart: this test fails when the
//! table differs from what `values.yaml` gives, and `LAYERWISE_BLESS=1` rewrites it.
//! A key whose value is a map is one row (its value as JSON) unless a key inside it has a
//! comment of its own; then each of those keys is a row.

use std::path::Path;

use serde_json::Value;

const BEGIN: &str = "<!-- values: generated from values.yaml by tests/tests/chart_readme.rs (LAYERWISE_BLESS=1 cargo test -p layerwise-e2e --test chart_readme) -->";
const END: &str = "<!-- end of values -->";

/// Each key of `values.yaml` in file order: its dotted path and the comment above it (or
/// after its value on the same line).
fn commented_keys(yaml: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut stack: Vec<(usize, String)> = Vec::new();
    let mut pending: Vec<String> = Vec::new();
    for line in yaml.lines() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        if trimmed.is_empty() {
            pending.clear();
            continue;
        }
        if let Some(c) = trimmed.strip_prefix('#') {
            pending.push(c.trim().to_string());
            continue;
        }
        if trimmed.starts_with("- ") || trimmed == "-" {
            pending.clear();
            continue;
        }
        let Some((key, rest)) = trimmed.split_once(':') else {
            continue;
        };
        if key.contains(' ') || !(rest.is_empty() || rest.starts_with(' ')) {
            continue;
        }
        while stack.last().is_some_and(|(i, _)| *i >= indent) {
            stack.pop();
        }
        let key = key.trim_matches('"').to_string();
        let path = stack
            .iter()
            .map(|(_, k)| k.as_str())
            .chain([key.as_str()])
            .collect::<Vec<_>>()
            .join(".");
        let inline = rest.split_once(" # ").map(|(_, c)| c.trim().to_string());
        let mut comment = pending.join(" ");
        if let Some(c) = inline {
            comment = if comment.is_empty() {
                c
            } else {
                format!("{comment} {c}")
            };
        }
        out.push((path, comment));
        stack.push((indent, key));
        pending.clear();
    }
    out
}

fn lookup<'a>(values: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(values, |v, k| v.get(k))
}

/// The table's rows, in file order.
fn table(yaml: &str) -> String {
    let values: Value = serde_saphyr::from_str(yaml).expect("values.yaml parses");
    let keys = commented_keys(yaml);
    let mut rows = vec![
        "| key | default | description |".to_string(),
        "|---|---|---|".to_string(),
    ];
    let mut collapsed: Option<String> = None;
    for (path, comment) in &keys {
        if collapsed
            .as_deref()
            .is_some_and(|c| path.starts_with(&format!("{c}.")))
        {
            continue;
        }
        let Some(value) = lookup(&values, path) else {
            continue;
        };
        let inner_comment = keys
            .iter()
            .any(|(p, c)| p.starts_with(&format!("{path}.")) && !c.is_empty());
        if value.as_object().is_some_and(|o| !o.is_empty()) && inner_comment {
            continue;
        }
        collapsed = Some(path.clone());
        rows.push(format!(
            "| `{path}` | `{}` | {} |",
            value.to_string().replace('|', "\\|"),
            comment.replace('|', "\\|")
        ));
    }
    rows.join("\n")
}

#[test]
fn the_readme_lists_every_value_with_its_default() {
    let chart = Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/layerwise");
    let yaml = std::fs::read_to_string(chart.join("values.yaml")).unwrap();
    let readme_path = chart.join("README.md");
    let readme = std::fs::read_to_string(&readme_path).unwrap();
    let (head, rest) = readme
        .split_once(BEGIN)
        .expect("README.md has the values marker");
    let (_, tail) = rest.split_once(END).expect("README.md has the end marker");
    let want = format!("{head}{BEGIN}\n\n{}\n\n{END}{tail}", table(&yaml));
    if std::env::var_os("LAYERWISE_BLESS").is_some() {
        std::fs::write(&readme_path, &want).unwrap();
    }
    assert!(
        readme == want,
        "charts/layerwise/README.md's values table differs from values.yaml; run LAYERWISE_BLESS=1 cargo test -p layerwise-e2e --test chart_readme"
    );
}

#[test]
fn keys_comments_and_nesting_are_read_from_the_file() {
    let yaml = "# head\n\n# The port.\nport: 80\nimage:\n  # Where.\n  repository: a\n  tag: \"\" # defaults to appVersion\nresources:\n  requests:\n    cpu: 5m\nlist:\n  - a\n";
    let keys = commented_keys(yaml);
    assert_eq!(
        keys,
        [
            ("port", "The port."),
            ("image", ""),
            ("image.repository", "Where."),
            ("image.tag", "defaults to appVersion"),
            ("resources", ""),
            ("resources.requests", ""),
            ("resources.requests.cpu", ""),
            ("list", ""),
        ]
        .map(|(p, c)| (p.to_string(), c.to_string()))
    );
    let t = table(yaml);
    assert!(t.contains("| `port` | `80` | The port. |"), "{t}");
    assert!(
        t.contains("| `image.tag` | `\"\"` | defaults to appVersion |"),
        "{t}"
    );
    assert!(
        t.contains("| `resources` | `{\"requests\":{\"cpu\":\"5m\"}}` |  |"),
        "{t}"
    );
    assert!(t.contains("| `list` | `[\"a\"]` |  |"), "{t}");
    assert!(!t.contains("`image` |"), "{t}");
}
