#!/usr/bin/env python3
"""Reference side of the Qwen2.5-VL text encoder parity: transformers' own
`Qwen2_5_VLForConditionalGeneration` and `Qwen2Tokenizer`, called by diffusers'
`QwenImagePipeline._get_qwen_prompt_embeds` itself (the pipeline built around them with no
transformer, VAE or scheduler: prompt encoding reads none of them).

Usage
    $(engine/parity/venv | tail -n 1) engine/parity/qwen2_5_vl_reference.py engine/tests/fixtures
    (or any Python with torch, diffusers, transformers and tokenizers as $PYTHON)

Writes DIR/qwen2_5_vl-tiny/ (the engine test `engine/tests/qwen2_5_vl_parity.rs` reads it):
    tokenizer/            a byte-level BPE tokenizer TRAINED on CORPUS with Qwen's special tokens
                          (cosmos3_reference.build_tokenizer), saved by transformers'
                          `Qwen2Tokenizer.save_pretrained` (tokenizer.json, tokenizer_config.json,
                          chat_template.jinja)
    tokenizer_legacy/     the same tokenizer as the published Qwen-Image folder holds it: vocab.json,
                          merges.txt, added_tokens.json and a tokenizer_config.json naming the added
                          tokens (no tokenizer.json); transformers must give the same ids from it
    text_encoder/         a tiny random Qwen2_5_VLForConditionalGeneration (vision tower too, GQA,
                          mrope sections), float32, as transformers 5.24 saves it (nested
                          `text_config`; tensors under `model.`, `visual.`, `lm_head.`, the
                          published checkpoint's names)
    text_encoder_bf16/    the same weights in bfloat16 with the published (transformers 4.5x) config
                          layout: flat (`rope_scaling {type: mrope}`, `rope_theta`, a nested
                          `vision_config`); its tensors under their module paths
                          (`model.language_model.`, `model.visual.`, `lm_head.`), the other
                          spelling transformers reads (5.24 itself writes `model.`, `visual.`)
    reference.safetensors for each prompt i of PROMPTS: `input_ids_{i}` (int64 [1, T], T ≤ 1024 + 34)
                          and `prompt_embeds_{i}` (float32 [1, T − 34, hidden], the pipeline's output
                          before `max_sequence_length`), `prompt_embeds_bf16_{i}` (text_encoder_bf16/
                          loaded by transformers in float32, same path)
    reference.json        the prompts, the template's numbers, what hidden_states[-1] was found to
                          be, versions

Weights are random and seeded; nothing is downloaded. The BPE trainer's merges can vary a
little from run to run, so a fresh run writes a slightly different tokenizer and references
with it: the folder is consistent in itself.
"""

import json
import os
import shutil
import sys

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cosmos3_reference import build_tokenizer  # noqa: E402
from wan_reference import CORPUS, perturb, versions  # noqa: E402

SEED = 0

# Qwen2.5-VL's text model on a small scale: 4 query heads over 2 key/value heads (GQA),
# head_dim 8 whose 4 rotary frequencies are split 1/1/2 over (t, h, w) as mrope_section, q/k/v
# biases, o_proj without. Qwen2_5_VLConfig::tiny() in engine/src/components/qwen2_5_vl/config/text.rs
# has these numbers (its vocabulary is the synthetic tokenizer's, this one the trained one's).
TEXT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=2048,
    hidden_act="silu",
    rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
)

VISION = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    out_hidden_size=TEXT["hidden_size"],
    patch_size=2,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=8,
    fullatt_block_indexes=[0],
    in_channels=3,
)

# The empty prompt (what a missing negative prompt encodes as), an ordinary one, one past the
# pipeline's 1024 + 34 tokens so its truncation (which cuts the template's tail) matters, and one
# with what the tokenizer must not take literally: a special token typed in the prompt, text that
# NFC composes, tabs, digits and non-Latin scripts.
PROMPTS = [
    "",
    "A red fox runs through a snowy forest at dawn, its breath a small cloud.",
    " ".join(CORPUS),
    "Cafe\u0301 sign <|vision_start|>reads \"OPEN\"\t24/7 \u2014 \u65e5\u672c\u8a9e<|im_end|>",
]


def pipeline(text_encoder, tokenizer):
    from diffusers import QwenImagePipeline

    return QwenImagePipeline(
        scheduler=None, vae=None, text_encoder=text_encoder, tokenizer=tokenizer, transformer=None
    )


def encode(pipe, prompt):
    """The pipeline's own prompt encoding, and the ids it tokenized."""
    with torch.no_grad():
        embeds, mask = pipe._get_qwen_prompt_embeds(prompt, device="cpu", dtype=torch.float32)
    txt = pipe.prompt_template_encode.format(prompt)
    ids = pipe.tokenizer(
        [txt],
        max_length=pipe.tokenizer_max_length + pipe.prompt_template_encode_start_idx,
        padding=True,
        truncation=True,
        return_tensors="pt",
    ).input_ids
    assert mask.all() and embeds.shape[1] == ids.shape[1] - pipe.prompt_template_encode_start_idx
    return ids, embeds


def last_hidden_is_normed(model, ids):
    """What `hidden_states[-1]` is: the final norm's output (`last_hidden_state`), or the last
    layer's before it."""
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
        lm = model.model.language_model
        before = lm.norm.weight.new_zeros(0)
        captured = {}
        h = lm.norm.register_forward_hook(lambda m, i, o: captured.update(pre=i[0], post=o))
        model(input_ids=ids)
        h.remove()
        before = captured["pre"]
        last = out.hidden_states[-1]
    if torch.equal(last, captured["post"]):
        return "after the final norm (the language model's last_hidden_state)"
    assert torch.equal(last, before), "hidden_states[-1] is neither side of the final norm"
    return "before the final norm"


def legacy_folder(src, dst):
    """text_encoder/ rewritten in bf16 with the published (flat) config and the tensors under their
    module paths (`model.language_model.`, `model.visual.`), the other spelling transformers reads.
    Returns the original tensors by their module paths."""
    os.makedirs(dst, exist_ok=True)
    cfg = json.load(open(os.path.join(src, "config.json")))
    text = dict(cfg.pop("text_config"))
    rope = text.pop("rope_parameters")
    flat = {k: v for k, v in cfg.items() if k not in ("dtype",)}
    for k in ("model_type", "dtype", "layer_types"):
        text.pop(k, None)
    flat.update(text)
    flat["rope_theta"] = rope["rope_theta"]
    flat["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    flat["torch_dtype"] = "bfloat16"
    flat["transformers_version"] = "4.53.1"
    vision = flat["vision_config"]
    vision["model_type"] = "qwen2_5_vl"
    vision.pop("dtype", None)
    json.dump(flat, open(os.path.join(dst, "config.json"), "w"), indent=2, sort_keys=True)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    renamed = {}
    for name, t in tensors.items():
        for old, new in (("model.", "model.language_model."), ("visual.", "model.visual.")):
            if name.startswith(old):
                name = new + name[len(old):]
                break
        renamed[name] = t
    save_file(
        {n: t.to(torch.bfloat16).contiguous() for n, t in renamed.items()},
        os.path.join(dst, "model.safetensors"),
        metadata={"format": "pt"},
    )
    return renamed


def legacy_tokenizer(tokenizer, dst):
    """The tokenizer as vocab.json + merges.txt + added tokens, as the published folder has it."""
    os.makedirs(dst, exist_ok=True)
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    model = backend["model"]
    json.dump(model["vocab"], open(os.path.join(dst, "vocab.json"), "w"), ensure_ascii=False)
    with open(os.path.join(dst, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        for m in model["merges"]:
            f.write((m if isinstance(m, str) else " ".join(m)) + "\n")
    added = {t["content"]: t["id"] for t in backend["added_tokens"]}
    json.dump(added, open(os.path.join(dst, "added_tokens.json"), "w"), indent=2)
    decoder = {
        str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
        for t in backend["added_tokens"]
    }
    config = {
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    json.dump(config, open(os.path.join(dst, "tokenizer_config.json"), "w"), indent=2)


def main(argv):
    from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    out = os.path.join(argv[1], "qwen2_5_vl-tiny")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)

    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(os.path.join(out, "tokenizer"))
    legacy_tokenizer(tokenizer, os.path.join(out, "tokenizer_legacy"))
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(out, "tokenizer"))
    legacy = AutoTokenizer.from_pretrained(os.path.join(out, "tokenizer_legacy"))

    torch.manual_seed(SEED)
    config = Qwen2_5_VLConfig(
        text_config=dict(
            TEXT,
            vocab_size=len(tokenizer),
            bos_token_id=None,
            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        ),
        vision_config=VISION,
        tie_word_embeddings=False,
    )
    model = Qwen2_5_VLForConditionalGeneration(config)
    perturb(model, SEED + 1)
    model = model.eval()
    model.save_pretrained(os.path.join(out, "text_encoder"), safe_serialization=True)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        os.path.join(out, "text_encoder"), dtype=torch.float32
    ).eval()
    original = legacy_folder(os.path.join(out, "text_encoder"), os.path.join(out, "text_encoder_bf16"))
    model_bf16 = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        os.path.join(out, "text_encoder_bf16"), dtype=torch.float32
    ).eval()
    # transformers read every tensor of the legacy folder (nothing fresh-initialised).
    loaded = model_bf16.state_dict()
    for name, t in original.items():
        assert torch.equal(loaded[name], t.to(torch.bfloat16).float()), name

    pipe = pipeline(model, tokenizer)
    pipe_bf16 = pipeline(model_bf16, legacy)
    tensors, lengths = {}, []
    for i, prompt in enumerate(PROMPTS):
        ids, embeds = encode(pipe, prompt)
        ids_legacy, embeds_bf16 = encode(pipe_bf16, prompt)
        assert torch.equal(ids, ids_legacy), f"prompt {i}: the legacy tokenizer files tokenize differently"
        untruncated = len(tokenizer(pipe.prompt_template_encode.format(prompt)).input_ids)
        lengths.append(untruncated)
        tensors[f"input_ids_{i}"] = ids.to(torch.int64).contiguous()
        tensors[f"prompt_embeds_{i}"] = embeds.float().contiguous()
        tensors[f"prompt_embeds_bf16_{i}"] = embeds_bf16.float().contiguous()
        print(f"prompt {i}: {untruncated} tokens with the template, {ids.shape[1]} kept, embeds {tuple(embeds.shape)}")
    save_file(tensors, os.path.join(out, "reference.safetensors"))

    meta = {
        "prompts": PROMPTS,
        "untruncated_lengths": lengths,
        "template": pipe.prompt_template_encode,
        "drop": pipe.prompt_template_encode_start_idx,
        "max_length": pipe.tokenizer_max_length + pipe.prompt_template_encode_start_idx,
        "hidden_states_last": last_hidden_is_normed(model, tensors["input_ids_1"]),
        "special_tokens": {t: tokenizer.convert_tokens_to_ids(t) for t in tokenizer.all_special_tokens},
        "vocab_size": len(tokenizer),
        "versions": versions(),
    }
    json.dump(meta, open(os.path.join(out, "reference.json"), "w"), indent=2, ensure_ascii=False)
    print(json.dumps({k: meta[k] for k in ("hidden_states_last", "special_tokens", "vocab_size")}))
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
    print(f"wrote {out}: {total} bytes")


if __name__ == "__main__":
    main(sys.argv)
