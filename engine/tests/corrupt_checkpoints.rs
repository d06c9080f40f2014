//! Corrupt checkpoints that used to open cleanly and then fail requests: a Qwen-Image
//! scheduler or tokenizer config no request can run on, a chat template that renders without
//! bound, and config type errors. Each folder is written by the synth tools and then
//! corrupted; each must be refused when it opens (what `serve` and `inspect` both do), fast,
//! naming the file and the field.

mod common;

use std::path::{Path, PathBuf};
use std::time::Instant;

use layerwise_engine::engine::Model;
use serde_json::Value;

/// Rewrites the JSON file `path` with `edit` applied.
fn edit_json(path: &Path, edit: impl FnOnce(&mut Value)) {
    let mut v: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

/// Opens `root` as `serve` does and returns the refusal, which must name every one of
/// `parts`; prints how long the refusal took.
fn refused(root: &Path, parts: &[&str]) -> String {
    let t = Instant::now();
    let e = match Model::open(root) {
        Ok(_) => panic!(
            "{} opened; expected a refusal naming {parts:?}",
            root.display()
        ),
        Err(e) => e,
    };
    let msg = e.to_string();
    eprintln!(
        "refused in {:.1} ms: {msg}",
        t.elapsed().as_secs_f64() * 1e3
    );
    for p in parts {
        assert!(msg.contains(p), "`{msg}` does not name {p}");
    }
    assert_eq!(
        e.http_status(),
        500,
        "a checkpoint's fault, not a client's: {msg}"
    );
    msg
}

fn qwen_image(dir: &Path) -> PathBuf {
    common::qwen_image_tiny(dir, 1)
}

#[test]
fn a_qwen_image_scheduler_that_fails_large_images_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let root = qwen_image(dir.path());
    let config = root.join("scheduler/scheduler_config.json");
    // exp(mu) overflows for images past a few hundred tokens: small requests would run and
    // large ones would each be refused as a bad `steps`.
    edit_json(&config, |v| v["max_shift"] = 1000.0.into());
    refused(&root, &["scheduler_config.json", "max_shift"]);
}

#[test]
fn a_qwen_image_scheduler_too_short_for_the_default_steps_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let root = qwen_image(dir.path());
    let config = root.join("scheduler/scheduler_config.json");
    edit_json(&config, |v| v["num_train_timesteps"] = 10.into());
    refused(
        &root,
        &["scheduler_config.json", "num_train_timesteps", "50 steps"],
    );
}

#[test]
fn a_qwen_image_tokenizer_that_swallows_the_template_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let root = qwen_image(dir.path());
    // One added token spanning the template's system message: the template tokenizes to a
    // handful of ids and nothing is left after the pipeline drops its first 34, for every
    // prompt.
    let prefix = layerwise_engine::components::qwen2_5_vl::prompt::PROMPT_TEMPLATE
        .split("{}")
        .next()
        .unwrap();
    edit_json(&root.join("tokenizer/tokenizer_config.json"), |v| {
        v["added_tokens_decoder"] = serde_json::json!({ "300": { "content": prefix } });
    });
    refused(&root, &["tokenizer", "none left"]);
}

/// Cosmos3's chat template, replaced by `source`.
fn cosmos3_with_template(dir: &Path, source: &str) -> PathBuf {
    let root = common::cosmos3_tiny(dir, 1);
    std::fs::write(root.join("text_tokenizer/chat_template.jinja"), source).unwrap();
    root
}

#[test]
fn a_chat_template_that_renders_without_bound_is_refused_at_start() {
    let normal = layerwise_engine::components::qwen2_5_vl::synth::SYNTH_CHAT_TEMPLATE;
    // A megabyte of padding after every prompt: each request would tokenize and run it.
    let dir = tempfile::tempdir().unwrap();
    let root = cosmos3_with_template(dir.path(), &format!("{normal}{{{{ 'x' * 1000000 }}}}"));
    refused(&root, &["chat_template.jinja", "renders over"]);
    // A loop of ten billion turns: stopped by its fuel, not by a watchdog.
    let dir = tempfile::tempdir().unwrap();
    let spin = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}";
    let root = cosmos3_with_template(dir.path(), &format!("{spin}{normal}"));
    refused(&root, &["chat_template.jinja", "instructions"]);
    // The template as synthesized opens.
    let dir = tempfile::tempdir().unwrap();
    Model::open(&cosmos3_with_template(dir.path(), normal)).unwrap();
}

/// `layerwise inspect ROOT`'s failure, which must name every one of `parts`.
fn inspect_refuses(root: &Path, parts: &[&str]) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_layerwise"))
        .args(["inspect", "--model-roots"])
        .arg(root.parent().unwrap())
        .arg(root)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "inspect passed {}: {err}",
        root.display()
    );
    for p in parts {
        assert!(err.contains(p), "`{err}` does not name {p}");
    }
}

#[test]
fn config_type_errors_name_the_file_and_field_in_serve_and_inspect_alike() {
    // A scheduler field of the wrong type: serve refused it naming `(document)`, and inspect
    // never read the scheduler at all.
    let dir = tempfile::tempdir().unwrap();
    let root = qwen_image(dir.path());
    let config = root.join("scheduler/scheduler_config.json");
    edit_json(&config, |v| v["shift"] = "three".into());
    let msg = refused(&root, &["scheduler_config.json", "`shift`"]);
    assert!(!msg.contains("(document)"), "{msg}");
    inspect_refuses(&root, &["scheduler_config.json", "`shift`"]);
    // A field of the wrong type in the scheduler and in a model's config: the field, not
    // the value.
    let dir = tempfile::tempdir().unwrap();
    let root = qwen_image(dir.path());
    let config = root.join("scheduler/scheduler_config.json");
    edit_json(&config, |v| v["time_shift_type"] = 7.into());
    refused(&root, &["scheduler_config.json", "`time_shift_type`"]);
    edit_json(&config, |v| v["time_shift_type"] = "exponential".into());
    edit_json(&root.join("transformer/config.json"), |v| {
        v["num_layers"] = "one".into()
    });
    refused(&root, &["transformer/config.json", "`num_layers`"]);
    inspect_refuses(&root, &["transformer/config.json", "`num_layers`"]);
    // The files serve checks beyond the headers, inspect checks too.
    let dir = tempfile::tempdir().unwrap();
    let root = qwen_image(dir.path());
    edit_json(&root.join("scheduler/scheduler_config.json"), |v| {
        v["num_train_timesteps"] = 10.into()
    });
    inspect_refuses(&root, &["scheduler_config.json", "num_train_timesteps"]);
    let dir = tempfile::tempdir().unwrap();
    let root = cosmos3_with_template(dir.path(), "{{ 'x' * 1000000 }}");
    inspect_refuses(&root, &["chat_template.jinja"]);
}
