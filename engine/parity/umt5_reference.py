#!/usr/bin/env python3
"""Reference side of the UMT5 text encoder and prompt tokenizer parity: transformers' own
`UMT5EncoderModel` and `T5TokenizerFast`, called exactly as diffusers' WanPipeline calls them.

Usage
    $(engine/parity/venv | tail -n 1) engine/parity/umt5_reference.py engine/tests/fixtures
    (or any Python with torch, transformers and tokenizers as $PYTHON)

Writes DIR/umt5-tiny/ (the engine test `engine/tests/umt5_parity.rs` reads it):
    tokenizer/                 a Unigram tokenizer TRAINED with the `tokenizers` library on CORPUS,
                               wrapped as T5TokenizerFast (<pad>=0, </s>=1, <unk>=2) and saved
                               with save_pretrained
    text_encoder/              a tiny UMT5EncoderModel (Umt5Config::tiny() but its vocabulary is
                               the trained tokenizer's size), seeded and perturbed, float32,
                               one model.safetensors
    text_encoder_sharded_bf16/ the same model loaded in bfloat16 (the `wo` matrices stay float32,
                               as transformers keeps them) and saved in 20 KB shards:
                               model-0000N-of-0000M.safetensors + model.safetensors.index.json
    reference.safetensors      for PROMPTS at MAX_LENGTH, tokenized as WanPipeline tokenizes:
                               input_ids, attention_mask (int64 [P, M]); last_hidden_state (raw
                               encoder output, float32 [P, M, d_model]); last_hidden_state_bf16
                               (the sharded bf16 folder run in float32); prompt_embeds (WanPipeline's
                               masking of last_hidden_state: rows past each prompt's length zeroed)
    reference.json             the prompts, max length, versions; prompt_clean of CLEAN_CASES;
                               transformers' relative position buckets for offsets -600..600; and,
                               when synth-tokenizer/ exists, transformers' ids for PROMPTS with it

synth-tokenizer/ (tokenizer.json, tokenizer_config.json) is written by the engine, not here:
`LAYERWISE_BLESS=1 cargo test -p layerwise-engine --lib families::umt5::synth` writes
`synth_tokenizer_json(0)` there, and this script checks that transformers loads it.

The trainer's scores vary a little from run to run (it iterates hash maps), so a fresh run writes a
slightly different tokenizer, and the references with it: the folder is consistent in itself.
"""

import json
import os
import shutil
import sys

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")

import torch
from safetensors.torch import save_file

MAX_LENGTH = 16
SEED = 0

# The tiny encoder: Umt5Config::tiny() in engine/src/components/umt5/config.rs.
TINY = dict(
    d_model=32,
    d_kv=8,
    num_heads=4,
    d_ff=64,
    num_layers=2,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    feed_forward_proj="gated-gelu",
)
VOCAB_SIZE = 256

# Prompts for the references: a short one, one with odd whitespace and HTML entities, one that
# WanPipeline truncates at MAX_LENGTH, and the empty negative prompt.
PROMPTS = [
    "A fox in the snow.",
    "  The cat\tis\n\n carefully &amp;amp; slowly   stirring  the batter &lt;3\u00a0 ",
    "A young woman walks along the beach at sunset, her hair blowing in the wind, while two "
    "children fly a kite in the green field behind her.",
    "",
]

# prompt_clean cases: whitespace (Python's \s, Unicode included) and html.unescape applied twice.
CLEAN_CASES = [
    "plain",
    "  lead and trail  ",
    "tabs\tand\nnewlines\r\nand\x0bvt\x0cff",
    "unicode\u00a0nbsp\u2003em\u3000ideo\u2028ls\x1cfs\x85nel",
    "&amp; &lt; &gt; &quot; &apos; &#39; &#x27; &#X41;",
    "&amp;amp; twice &amp;lt; &amp;amp;amp; thrice",
    "&ampnot semicolon &lt3 &copy2024 &notit; &notin; &hellip; &mdash;",
    "&#0; &#13; &#128; &#150; &#x9f; &#xD800; &#1114112; &#99999999999; &#1; &#xfffe; &#65;",
    "&unknown; &; & amp; &#; &#x; &#xZ; &AMP; &Eacute &eacute; &lang; &rang;",
    "caf\u00e9 &nbsp;x&nbsp; y &ensp;z&thinsp;",
    "&amp&amp; &AElig; &aeligx &frac12; &sup2; &yuml;",
    "\x1c \x1f lead sep\x1dmid trail \x1e",
    "&#32;&#9;spaces from references&#x20; &nbsp;",
    "&abcdefghijklmnopqrstuvwxyzabcdefghijkl; &amp\rx &amp\x0bx",
]

CORPUS = """
A fox in the snow looks up at the falling flakes.
A red fox runs through a quiet forest at dawn.
The cat is carefully stirring the batter while the dog watches.
Two children fly a kite in the green field on a windy afternoon.
A young woman walks along the beach at sunset, her hair blowing in the wind.
An old man reads a book on a bench in the park.
A small boat drifts slowly across a calm blue lake under the mountains.
Rain falls on the city street at night and the lights reflect in the puddles.
A horse gallops across the wide plain as the sun goes down.
The camera slowly pans across a desert of tall sand dunes.
A chef slices fresh vegetables on a wooden board in a busy kitchen.
Waves crash on the rocky shore under a dark and stormy sky.
A hummingbird hovers beside a bright flower, its wings a blur.
Snow covers the roofs of a small village with warm lights in every window.
A robot walks through an empty factory filled with dust and light.
Blurry, low quality, static, overexposed, worst quality, ugly, deformed hands.
High quality, cinematic lighting, sharp focus, smooth motion, realistic colors.
Fireworks explode over the harbor and their colors shimmer on the water.
A panda chews bamboo in a misty green valley.
A butterfly lands on a leaf covered in morning dew.
A train crosses an old stone bridge over a deep river gorge.
A musician plays the violin on a stage under soft purple light.
Clouds race over jagged peaks in a time lapse.
A golden retriever jumps into a swimming pool and splashes everyone nearby.
Autumn leaves spiral down from the maple trees in slow motion.
A lighthouse sweeps its beam across the foggy bay.
An astronaut floats above the earth, tethered to the space station.
Steam rises from a bowl of noodles on a crowded market stall.
A skateboarder glides down a hill past colorful houses.
Jellyfish pulse gently through the dark ocean, glowing blue and pink.
A knight in shining armor rides toward a castle on a hill.
Children splash through puddles in yellow raincoats and boots.
A drone shot follows a river winding through a canyon.
Candles flicker on a birthday cake as everyone sings.
An owl turns its head in the moonlit barn.
""".strip().splitlines()


def versions():
    import tokenizers
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "tokenizers": tokenizers.__version__}


def prompt_clean(text):
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean as clean

    return clean(text)


def train_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import T5TokenizerFast

    special = ["<pad>", "</s>", "<unk>"]
    tok = Tokenizer(models.Unigram())
    # What T5TokenizerFast itself sets: split on whitespace, "▁" before every word.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)]
    )
    trainer = trainers.UnigramTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=special,
        unk_token="<unk>",
        shrinking_factor=0.75,
        max_piece_length=12,
        n_sub_iterations=2,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    vocab = [tuple(v) for v in json.loads(tok.to_str())["model"]["vocab"]]
    assert [v[0] for v in vocab[:3]] == special, vocab[:3]
    # extra_ids=0: no <extra_id_N> sentinels (span-corruption training only).
    hf = T5TokenizerFast(vocab=vocab, extra_ids=0)
    assert (hf.pad_token_id, hf.eos_token_id, hf.unk_token_id) == (0, 1, 2)
    return hf


def perturb(model, seed):
    """Seeded noise on every parameter, so the norms (ones at init) are not trivial."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            std = p.float().std().item() if p.numel() > 1 else 0.0
            amp = 0.5 * std if std > 1e-6 else 0.1
            p.add_(torch.randn(p.shape, generator=g) * amp)


def tokenize(tokenizer, prompts):
    """Exactly the tokenizer call of WanPipeline._get_t5_prompt_embeds."""
    return tokenizer(
        [prompt_clean(p) for p in prompts],
        padding="max_length",
        max_length=MAX_LENGTH,
        truncation=True,
        add_special_tokens=True,
        return_attention_mask=True,
        return_tensors="pt",
    )


def encode(folder, ids, mask):
    from transformers import UMT5EncoderModel

    model = UMT5EncoderModel.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids, mask).last_hidden_state


def pipeline_masking(hidden, mask):
    """WanPipeline's: keep each prompt's first seq_len rows, zeros after."""
    seq_lens = mask.gt(0).sum(dim=1).long()
    rows = [u[:v] for u, v in zip(hidden, seq_lens)]
    return torch.stack([torch.cat([u, u.new_zeros(hidden.shape[1] - u.size(0), u.size(1))]) for u in rows])


def buckets(lo, hi):
    from transformers import UMT5Config
    from transformers.models.umt5.modeling_umt5 import UMT5Attention

    attn = UMT5Attention(UMT5Config(**TINY, vocab_size=VOCAB_SIZE), has_relative_attention_bias=True)
    rel = torch.arange(lo, hi + 1, dtype=torch.long)
    return attn._relative_position_bucket(rel).tolist()


def main(root):
    from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel

    out = os.path.join(root, "umt5-tiny")
    synth = os.path.join(out, "synth-tokenizer")
    keep = None
    if os.path.isdir(synth):  # written by the engine: keep it across the rewrite
        keep = {f: open(os.path.join(synth, f), "rb").read() for f in os.listdir(synth)}
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(out)

    train_tokenizer().save_pretrained(os.path.join(out, "tokenizer"))
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(out, "tokenizer"))  # as the pipeline loads it

    torch.manual_seed(SEED)
    model = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), **TINY)).eval()
    perturb(model, SEED + 1)
    te = os.path.join(out, "text_encoder")
    model.save_pretrained(te)
    sharded = os.path.join(out, "text_encoder_sharded_bf16")
    UMT5EncoderModel.from_pretrained(te, dtype=torch.bfloat16).save_pretrained(sharded, max_shard_size="20KB")
    shards = sorted(f for f in os.listdir(sharded) if f.endswith(".safetensors"))
    assert len(shards) > 1 and os.path.exists(os.path.join(sharded, "model.safetensors.index.json")), shards

    inputs = tokenize(tokenizer, PROMPTS)
    ids, mask = inputs.input_ids, inputs.attention_mask
    hidden = encode(te, ids, mask)
    hidden_bf16 = encode(sharded, ids, mask)
    save_file(
        {
            "input_ids": ids.contiguous(),
            "attention_mask": mask.contiguous(),
            "last_hidden_state": hidden.contiguous(),
            "last_hidden_state_bf16": hidden_bf16.contiguous(),
            "prompt_embeds": pipeline_masking(hidden, mask).contiguous(),
        },
        os.path.join(out, "reference.safetensors"),
    )
    ref = {
        "prompts": PROMPTS,
        "max_length": MAX_LENGTH,
        "untruncated_lengths": [len(tokenizer(prompt_clean(p)).input_ids) for p in PROMPTS],
        "clean": [[c, prompt_clean(c)] for c in CLEAN_CASES],
        "buckets": {"from": -600, "to": 600, "bucket": buckets(-600, 600)},
        "versions": versions(),
    }
    if keep is not None:
        os.makedirs(synth)
        for f, data in keep.items():
            with open(os.path.join(synth, f), "wb") as fh:
                fh.write(data)
        synth_tok = AutoTokenizer.from_pretrained(synth)
        ref["synth_tokenizer"] = {
            "class": type(synth_tok).__name__,
            "input_ids": tokenize(synth_tok, PROMPTS).input_ids.tolist(),
            "untruncated_lengths": [len(synth_tok(prompt_clean(p)).input_ids) for p in PROMPTS],
        }
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1, ensure_ascii=False)
        f.write("\n")
    for dirpath, _, files in os.walk(out):  # safetensors writes 0600; these are plain data files
        for f in files:
            os.chmod(os.path.join(dirpath, f), 0o644)
    print(out)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
