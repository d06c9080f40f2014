//! The rules Prometheus holds a `/metrics` page to, as one pure function every binary's
//! tests run on what its `/metrics` really serves: the OpenMetrics text format the three
//! binaries write (`prometheus-client`), and the naming lint of `promtool check metrics`
//! (client_golang's `promlint`) on top of it. It lives here, beside [`crate::metric_names`],
//! so the engine, the operator and the agent are checked by one set of rules, and a CI
//! runner needs no Go toolchain for it.
//!
//! What is checked, family by family: a `# HELP` with text and one `# TYPE` of a known
//! type; valid names with no colon (colons are for recording rules), snake case, no type
//! word in the name, base units only (`seconds`, `bytes`, `ratio`: no `milliseconds`,
//! `megabytes`, `percent`, `fraction`, no abbreviations like `ms` or `mb`), and the unit as
//! the name's suffix (`copied_bytes_total`, not `bytes_copied_total`); counters exported as
//! `_total` samples and no other type ending in `_total`; reserved suffixes and labels
//! (`_bucket`, `_count`, `_sum`, `le`, `quantile`) only where they belong; histograms with
//! ascending `le` bounds ending in `+Inf`, cumulative counts, and `_count` equal to the
//! `+Inf` bucket; info metrics at 1; every sample parsed, no series twice; `# EOF` last.

use std::collections::{BTreeMap, BTreeSet};

/// The base units a name may end in (OpenMetrics' and Prometheus' naming guide).
const BASE_UNITS: &[&str] = &[
    "seconds", "bytes", "ratio", "meters", "grams", "volts", "amperes", "joules", "celsius",
];

/// Units that have a base unit instead, with it.
const NON_BASE_UNITS: &[(&str, &str)] = &[
    ("milliseconds", "seconds"),
    ("microseconds", "seconds"),
    ("nanoseconds", "seconds"),
    ("minutes", "seconds"),
    ("hours", "seconds"),
    ("days", "seconds"),
    ("kilobytes", "bytes"),
    ("megabytes", "bytes"),
    ("gigabytes", "bytes"),
    ("terabytes", "bytes"),
    ("kibibytes", "bytes"),
    ("mebibytes", "bytes"),
    ("gibibytes", "bytes"),
    ("bits", "bytes"),
    ("percent", "ratio"),
    ("fraction", "ratio"),
];

/// Abbreviated units promlint refuses in a name.
const ABBREVIATIONS: &[&str] = &[
    "s", "ms", "us", "ns", "sec", "secs", "min", "mins", "hr", "hrs", "b", "kb", "mb", "gb", "tb",
    "kib", "mib", "gib", "tib",
];

/// The metric types of the OpenMetrics text format.
const TYPES: &[&str] = &[
    "counter",
    "gauge",
    "histogram",
    "gaugehistogram",
    "summary",
    "info",
    "stateset",
    "unknown",
];

/// Everything wrong with `text`, one line each (empty when it passes).
pub fn lint(text: &str) -> Vec<String> {
    let mut problems = Vec::new();
    let mut families: BTreeMap<String, Family> = BTreeMap::new();
    let mut order: Vec<String> = Vec::new();
    let mut series = BTreeSet::new();
    let mut eof = false;
    for (n, line) in text.lines().enumerate() {
        let at = n + 1;
        if eof {
            problems.push(format!("line {at}: content after # EOF"));
            break;
        }
        if line == "# EOF" {
            eof = true;
        } else if let Some(rest) = line.strip_prefix("# ") {
            meta(rest, at, &mut families, &mut order, &mut problems);
        } else if line.is_empty() || line.starts_with('#') {
            problems.push(format!(
                "line {at}: not a sample or a # HELP/TYPE/UNIT line"
            ));
        } else {
            match parse_sample(line) {
                Ok(s) => {
                    let key = format!("{}{:?}", s.name, s.labels);
                    if !series.insert(key) {
                        problems.push(format!("line {at}: series {} twice", s.name));
                    }
                    match family_of(&s.name, &families) {
                        Some(f) => families.get_mut(&f).expect("found").samples.push(s),
                        None => problems.push(format!(
                            "line {at}: sample {} belongs to no declared family",
                            s.name
                        )),
                    }
                }
                Err(e) => problems.push(format!("line {at}: {e}: {line}")),
            }
        }
    }
    if !eof {
        problems.push("no # EOF at the end".into());
    }
    for name in &order {
        check_family(name, &families[name], &mut problems);
    }
    problems
}

#[derive(Default)]
struct Family {
    help: Option<String>,
    kind: Option<String>,
    samples: Vec<Sample>,
}

/// A sample's labels, name and value each, in their order.
type Labels = Vec<(String, String)>;

struct Sample {
    name: String,
    labels: Labels,
    value: f64,
}

fn meta(
    rest: &str,
    at: usize,
    families: &mut BTreeMap<String, Family>,
    order: &mut Vec<String>,
    problems: &mut Vec<String>,
) {
    let mut parts = rest.splitn(3, ' ');
    let (keyword, name, arg) = (parts.next(), parts.next(), parts.next());
    let (Some(keyword), Some(name)) = (keyword, name) else {
        problems.push(format!("line {at}: a # line without a metric name"));
        return;
    };
    if !families.contains_key(name) {
        order.push(name.to_string());
    }
    let f = families.entry(name.to_string()).or_default();
    let arg = arg.unwrap_or("").trim();
    match keyword {
        "HELP" => {
            if f.help.replace(arg.to_string()).is_some() {
                problems.push(format!("line {at}: {name} has two # HELP lines"));
            }
        }
        "TYPE" => {
            if !TYPES.contains(&arg) {
                problems.push(format!("line {at}: {name} has unknown type {arg:?}"));
            }
            if f.kind.replace(arg.to_string()).is_some() {
                problems.push(format!("line {at}: {name} has two # TYPE lines"));
            }
        }
        "UNIT" => {
            if !arg.is_empty() && !name.ends_with(&format!("_{arg}")) {
                problems.push(format!("line {at}: {name} does not end in its unit {arg}"));
            }
        }
        other => problems.push(format!("line {at}: unknown # {other} line")),
    }
}

/// The declared family a sample belongs to: its own name, or its name less a suffix its
/// family's type adds.
fn family_of(sample: &str, families: &BTreeMap<String, Family>) -> Option<String> {
    if families.contains_key(sample) {
        return Some(sample.to_string());
    }
    [
        "_total", "_created", "_bucket", "_count", "_sum", "_info", "_gcount", "_gsum",
    ]
    .iter()
    .filter_map(|suffix| sample.strip_suffix(suffix))
    .find(|base| families.contains_key(*base))
    .map(str::to_string)
}

fn check_family(name: &str, f: &Family, problems: &mut Vec<String>) {
    let mut say = |what: String| problems.push(format!("{name}: {what}"));
    match f.help.as_deref() {
        None => say("no # HELP".into()),
        Some("") => say("empty # HELP text".into()),
        Some(_) => {}
    }
    let Some(kind) = f.kind.as_deref() else {
        return say("no # TYPE".into());
    };
    for what in name_problems(name, kind) {
        say(what);
    }
    let expected: &[&str] = match kind {
        "counter" => &["_total", "_created"],
        "histogram" => &["_bucket", "_count", "_sum", "_created"],
        "summary" => &["", "_count", "_sum", "_created"],
        "info" => &["_info"],
        _ => &[""],
    };
    for s in &f.samples {
        let suffix = &s.name[name.len()..];
        if !expected.contains(&suffix) {
            say(format!(
                "{kind} sample {} has a suffix its type does not add",
                s.name
            ));
        }
        for (l, _) in &s.labels {
            if !valid_name(l) || l.starts_with("__") {
                say(format!("invalid label name {l:?}"));
            } else if l.chars().any(|c| c.is_ascii_uppercase()) {
                say(format!("label {l} is not snake case"));
            }
            if l == "le" && kind != "histogram" && kind != "gaugehistogram" {
                say(format!("label le on a {kind}"));
            }
            if l == "quantile" && kind != "summary" {
                say(format!("label quantile on a {kind}"));
            }
        }
        if kind == "counter" && suffix == "_total" && (s.value < 0.0 || s.value.is_nan()) {
            say(format!("counter at {}", s.value));
        }
        if kind == "info" && s.value != 1.0 {
            say(format!("info metric at {}, not 1", s.value));
        }
    }
    if kind == "histogram" {
        check_histogram(name, &f.samples, problems);
    }
}

/// Name rules: characters, case, the type word, units and the `_total` suffix.
fn name_problems(name: &str, kind: &str) -> Vec<String> {
    let mut out = Vec::new();
    if name.contains(':') {
        out.push("a colon in the name (colons are for recording rules)".into());
    } else if !valid_name(name) {
        out.push("an invalid metric name".into());
    }
    if name.chars().any(|c| c.is_ascii_uppercase()) {
        out.push("the name is not snake case".into());
    }
    let words: Vec<&str> = name.split('_').collect();
    for t in ["counter", "gauge", "histogram", "summary"] {
        if words.contains(&t) {
            out.push(format!("the type word {t:?} in the name"));
        }
    }
    for (unit, base) in NON_BASE_UNITS {
        if words.contains(unit) {
            out.push(format!("unit {unit}: use the base unit {base}"));
        }
    }
    for a in ABBREVIATIONS {
        if words.contains(a) {
            out.push(format!("abbreviated unit {a:?}: spell the base unit out"));
        }
    }
    // A counter's family name is written without `_total` (its samples add it); any other
    // type may not end in it.
    if name.ends_with("_total") {
        out.push(format!("a {kind} family named with _total"));
    }
    for reserved in ["_bucket", "_count", "_sum", "_created"] {
        if name.ends_with(reserved) {
            out.push(format!("the reserved suffix {reserved}"));
        }
    }
    // The unit is the suffix: a base unit anywhere else, other than as `X_per_Y` at the
    // end, means the words around it are out of order.
    let last = words.len() - 1;
    for (i, w) in words.iter().enumerate() {
        let per_unit =
            (i + 2 == last && words[i + 1] == "per") || (i >= 2 && words[i - 1] == "per");
        if BASE_UNITS.contains(w) && i != last && !per_unit {
            out.push(format!("unit {w} is not the name's suffix"));
        }
    }
    out
}

/// One histogram series: its buckets (`le`, count) and its `_count`.
type Series = (Vec<(f64, f64)>, Option<f64>);

fn check_histogram(name: &str, samples: &[Sample], problems: &mut Vec<String>) {
    // Series by their labels other than `le`.
    let mut groups: BTreeMap<Labels, Series> = BTreeMap::new();
    for s in samples {
        let rest: Vec<_> = s
            .labels
            .iter()
            .filter(|(l, _)| l != "le")
            .cloned()
            .collect();
        let g = groups.entry(rest).or_default();
        if s.name.ends_with("_bucket") {
            match s
                .labels
                .iter()
                .find(|(l, _)| l == "le")
                .map(|(_, v)| parse_value(v))
            {
                Some(Ok(le)) => g.0.push((le, s.value)),
                _ => problems.push(format!("{name}: a bucket without a numeric le")),
            }
        } else if s.name.ends_with("_count") {
            g.1 = Some(s.value);
        }
    }
    for (labels, (buckets, count)) in groups {
        let mut say = |what: &str| problems.push(format!("{name}{labels:?}: {what}"));
        if buckets.windows(2).any(|w| w[0].0 >= w[1].0) {
            say("le bounds not ascending");
        }
        if buckets.windows(2).any(|w| w[0].1 > w[1].1) {
            say("bucket counts not cumulative");
        }
        match buckets.last() {
            Some((le, n)) if *le == f64::INFINITY => {
                if count != Some(*n) {
                    say("_count differs from the +Inf bucket");
                }
            }
            _ => say("no +Inf bucket"),
        }
    }
}

fn valid_name(s: &str) -> bool {
    let mut c = s.chars();
    c.next()
        .is_some_and(|f| f.is_ascii_alphabetic() || f == '_' || f == ':')
        && c.all(|x| x.is_ascii_alphanumeric() || x == '_' || x == ':')
}

fn parse_value(v: &str) -> Result<f64, String> {
    match v {
        "+Inf" | "Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        "NaN" => Ok(f64::NAN),
        _ => v
            .parse()
            .map_err(|_| format!("value {v:?} is not a number")),
    }
}

/// `name{l="v",...} value [timestamp] [# exemplar]`.
fn parse_sample(line: &str) -> Result<Sample, String> {
    let end = line
        .find(['{', ' '])
        .ok_or_else(|| "a sample without a value".to_string())?;
    let name = line[..end].to_string();
    if !valid_name(&name) {
        return Err(format!("invalid metric name {name:?}"));
    }
    let mut rest = &line[end..];
    let mut labels = Vec::new();
    if let Some(body) = rest.strip_prefix('{') {
        let (parsed, after) = parse_labels(body)?;
        labels = parsed;
        rest = after;
    }
    let rest = rest.split(" # ").next().unwrap_or("");
    let mut fields = rest.split_whitespace();
    let value = parse_value(fields.next().ok_or("a sample without a value")?)?;
    if let Some(ts) = fields.next() {
        parse_value(ts).map_err(|_| format!("timestamp {ts:?} is not a number"))?;
    }
    if fields.next().is_some() {
        return Err("text after the timestamp".into());
    }
    let mut seen = BTreeSet::new();
    for (l, _) in &labels {
        if !seen.insert(l) {
            return Err(format!("label {l} twice"));
        }
    }
    Ok(Sample {
        name,
        labels,
        value,
    })
}

/// Labels up to the closing brace, and what follows it.
fn parse_labels(mut s: &str) -> Result<(Labels, &str), String> {
    let mut out = Vec::new();
    loop {
        if let Some(after) = s.strip_prefix('}') {
            return Ok((out, after));
        }
        let eq = s.find('=').ok_or("a label without a value")?;
        let name = s[..eq].to_string();
        s = s[eq + 1..]
            .strip_prefix('"')
            .ok_or_else(|| format!("label {name}'s value is not quoted"))?;
        let mut value = String::new();
        let mut chars = s.char_indices();
        let close = loop {
            match chars.next() {
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c @ ('\\' | '"'))) => value.push(c),
                    _ => return Err(format!("label {name}: a bad escape")),
                },
                Some((_, c)) => value.push(c),
                None => return Err(format!("label {name}: an unterminated value")),
            }
        };
        out.push((name, value));
        s = &s[close + 1..];
        s = s.strip_prefix(',').unwrap_or(s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "# HELP layerwise_copied_bytes Bytes copied.
# TYPE layerwise_copied_bytes counter
layerwise_copied_bytes_total{rank=\"0\"} 100
# HELP layerwise_rank_busy_ratio Busy share.
# TYPE layerwise_rank_busy_ratio gauge
layerwise_rank_busy_ratio{rank=\"0\"} 0.5
# HELP layerwise_wait_seconds Wait.
# TYPE layerwise_wait_seconds histogram
layerwise_wait_seconds_sum 3.0
layerwise_wait_seconds_count 2
layerwise_wait_seconds_bucket{le=\"1.0\"} 1
layerwise_wait_seconds_bucket{le=\"+Inf\"} 2
# HELP layerwise_engine_build The build.
# TYPE layerwise_engine_build info
layerwise_engine_build_info{version=\"0.1.0\"} 1
# EOF
";

    fn problems_of(text: &str) -> String {
        lint(text).join("\n")
    }

    #[test]
    fn a_conforming_page_passes() {
        assert_eq!(lint(GOOD), Vec::<String>::new());
    }

    #[test]
    fn the_old_engine_names_fail() {
        for (old, why) in [
            (
                "layerwise_bytes_copied counter",
                "unit bytes is not the name's suffix",
            ),
            (
                "layerwise_video_seconds_generated counter",
                "unit seconds is not the name's suffix",
            ),
            (
                "layerwise_rank_busy_fraction gauge",
                "use the base unit ratio",
            ),
            ("layerwise_wait_ms gauge", "abbreviated unit \"ms\""),
            (
                "layerwise_wait_milliseconds gauge",
                "use the base unit seconds",
            ),
            (
                "layerwise_jobs_total gauge",
                "a gauge family named with _total",
            ),
            ("layerwise_queue_gauge gauge", "the type word \"gauge\""),
            ("layerwise:queue gauge", "a colon in the name"),
        ] {
            let name = old.split(' ').next().unwrap();
            let text = format!("# HELP {name} x\n# TYPE {old}\n# EOF\n");
            let p = problems_of(&text);
            assert!(p.contains(why), "{old}: {p}");
        }
    }

    #[test]
    fn structure_is_checked() {
        for (edit, why) in [
            (
                (
                    "# HELP layerwise_copied_bytes Bytes copied.",
                    "# HELP layerwise_copied_bytes",
                ),
                "empty # HELP",
            ),
            (
                ("layerwise_copied_bytes_total{", "layerwise_copied_bytes{"),
                "suffix its type does not add",
            ),
            (("{le=\"+Inf\"} 2", "{le=\"+Inf\"} 3"), "_count differs"),
            (("{le=\"1.0\"} 1", "{le=\"1.0\"} 5"), "not cumulative"),
            (("# EOF\n", ""), "no # EOF"),
            (
                ("_info{version=\"0.1.0\"} 1", "_info{version=\"0.1.0\"} 2"),
                "not 1",
            ),
            (
                ("{rank=\"0\"} 0.5", "{rank=\"0\",rank=\"1\"} 0.5"),
                "label rank twice",
            ),
            (
                ("# TYPE layerwise_rank_busy_ratio gauge\n", ""),
                "no # TYPE",
            ),
            (
                (
                    "layerwise_rank_busy_ratio{rank=\"0\"} 0.5",
                    "layerwise_rank_busy_ratio{le=\"1\"} 0.5",
                ),
                "label le on a gauge",
            ),
        ] {
            assert!(GOOD.contains(edit.0), "{}", edit.0);
            let p = problems_of(&GOOD.replacen(edit.0, edit.1, 1));
            assert!(p.contains(why), "{why}: {p}");
        }
        let twice = GOOD.replace(
            "layerwise_rank_busy_ratio{rank=\"0\"} 0.5",
            "layerwise_rank_busy_ratio{rank=\"0\"} 0.5\nlayerwise_rank_busy_ratio{rank=\"0\"} 0.6",
        );
        assert!(problems_of(&twice).contains("twice"));
    }

    #[test]
    fn a_compound_unit_ends_the_name() {
        let text =
            "# HELP a_warm_bytes_per_second x\n# TYPE a_warm_bytes_per_second gauge\n# EOF\n";
        assert_eq!(lint(text), Vec::<String>::new());
    }
}
