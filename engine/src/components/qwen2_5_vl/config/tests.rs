//! The Qwen2.5-VL config's layouts, presets, checks and tensor names.

use std::path::Path;

use layerwise_core::family::TensorSpec;
use serde_json::Value;

use super::*;
use crate::Result;

/// The published Qwen-Image `text_encoder/config.json`'s language-model fields, flat.
const PUBLISHED: &str = r#"{
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_act": "silu", "hidden_size": 3584, "image_token_id": 151655,
    "initializer_range": 0.02, "intermediate_size": 18944,
    "max_position_embeddings": 128000, "max_window_layers": 28, "model_type": "qwen2_5_vl",
    "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"},
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": false,
    "torch_dtype": "bfloat16", "transformers_version": "4.53.1", "use_cache": true,
    "use_sliding_window": false, "video_token_id": 151656,
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280,
        "intermediate_size": 3420, "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584,
        "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14,
        "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2, "temporal_patch_size": 2, "model_type": "qwen2_5_vl"},
    "vision_end_token_id": 151653, "vision_start_token_id": 151652,
    "vision_token_id": 151654, "vocab_size": 152064
}"#;

fn parse(text: &str) -> Result<Qwen25VlConfig> {
    let doc: Value = serde_json::from_str(text).expect("JSON");
    Qwen25VlConfig::from_json(&doc, Path::new("config.json"))
}

#[test]
fn published_flat_layout_is_the_7b_preset() {
    let cfg = parse(PUBLISHED).expect("published config");
    assert_eq!(cfg, Qwen25VlConfig::qwen2_5_vl_7b());
    assert_eq!((cfg.head_dim(), cfg.groups_per_kv()), (128, 7));
}

#[test]
fn nested_layout_round_trips_and_wins_over_flat_fields() {
    let tiny = Qwen25VlConfig::tiny();
    assert_eq!(parse(&tiny.to_json().to_string()).expect("nested"), tiny);
    // transformers reads `text_config` alone when it is there.
    let mut doc = tiny.to_json();
    doc["hidden_size"] = 3584.into();
    doc["num_hidden_layers"] = 28.into();
    assert_eq!(parse(&doc.to_string()).expect("nested"), tiny);
}

#[test]
fn seven_b_language_model_has_the_published_parameter_count() {
    let cfg = Qwen25VlConfig::qwen2_5_vl_7b();
    let n: usize = cfg
        .all_specs(TensorPrefix::Model)
        .iter()
        .map(TensorSpec::numel)
        .sum();
    // 7.07 B: the 7.6 B model less its 545 M lm_head and 0.67 B vision tower.
    assert!((7_000_000_000..7_100_000_000).contains(&n), "{n}");
    let g = cfg.block_group(TensorPrefix::LanguageModel);
    assert_eq!(g.prefix, "model.language_model.layers.");
    assert_eq!(
        g.block_of("model.language_model.layers.27.self_attn.k_proj.bias"),
        Some(27)
    );
    // About 0.3 MB a token: a 1058-token prompt holds about 0.3 GB at a layer's peak.
    assert_eq!(
        cfg.encoder_bytes_per_token(),
        4 * (3 * 3584 + 6 * 3584 + 3 * 512 + 3 * 18944)
    );
    let k = g.block.iter().find(|s| s.name == "self_attn.k_proj.weight");
    assert_eq!(k.map(|s| s.shape.clone()), Some(vec![512, 3584]));
}

#[test]
fn validate_names_the_field() {
    let err = |text: String| parse(&text).unwrap_err().to_string();
    let nested = |f: &dyn Fn(&mut Value)| {
        let mut doc = Qwen25VlConfig::tiny().to_json();
        f(&mut doc["text_config"]);
        doc.to_string()
    };
    assert!(err(nested(&|t| t["hidden_act"] = "gelu".into())).contains("text_config.hidden_act"));
    assert!(err(nested(&|t| t["num_key_value_heads"] = 3.into()))
        .contains("text_config.num_key_value_heads"));
    assert!(err(nested(
        &|t| t["rope_parameters"]["mrope_section"] = serde_json::json!([2, 2, 2])
    ))
    .contains("text_config.rope_parameters.mrope_section"));
    assert!(err(nested(
        &|t| t["rope_parameters"]["rope_type"] = "yarn".into()
    ))
    .contains("rope_type"));
    assert!(err(nested(&|t| t["use_sliding_window"] = true.into())).contains("use_sliding_window"));
    assert!(err(nested(&|t| t["hidden_size"] = "wide".into())).contains("text_config.hidden_size"));
    let flat = PUBLISHED.replace("\"num_attention_heads\": 28", "\"num_attention_heads\": 0");
    let e = err(flat);
    assert!(
        e.contains("num_attention_heads") && !e.contains("text_config."),
        "{e}"
    );
    assert!(err(PUBLISHED.replace("\"qwen2_5_vl\"", "\"qwen2_vl\"")).contains("model_type"));
    assert!(
        err(PUBLISHED.replace("Qwen2_5_VLForConditionalGeneration", "Qwen2VL"))
            .contains("architectures")
    );
}

#[test]
fn unused_tensors_are_the_vision_tower_and_the_head() {
    assert!(is_unused("lm_head.weight"));
    assert!(is_unused("visual.blocks.0.attn.qkv.weight"));
    assert!(is_unused("model.visual.merger.mlp.0.bias"));
    assert!(!is_unused("model.norm.weight"));
    assert!(!is_unused(
        "model.language_model.layers.0.mlp.up_proj.weight"
    ));
}
