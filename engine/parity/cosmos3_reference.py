#!/usr/bin/env python3
"""Reference side of the Cosmos3 text-to-image / text-to-video parity: diffusers' own
Cosmos3OmniPipeline.

Subcommands
  make OUT [--seed S]
      Builds a tiny random Cosmos3 pipeline (a byte-level BPE tokenizer trained on a small
      embedded corpus with Qwen's chat template and special tokens, a Cosmos3OmniTransformer
      with both pathways, GQA and interleaved 3D rotary positions, the 48-channel residual
      AutoencoderKLWan of Wan 2.2, UniPC with flow sigmas) and saves it with
      `pipe.save_pretrained(OUT, safe_serialization=True)`. Nothing is downloaded: weights
      are random, seeded.
  run MODEL --prompt P ... --latents IN --out OUT
      Runs Cosmos3OmniPipeline.from_pretrained(MODEL) on the CPU in float32 from the given
      initial latents; saves the token ids, per-step and final latents and the decoded frames.
  fixture DIR
      Writes the committed tiny fixture: DIR/cosmos3-tiny, and for each request of
      FIXTURE_REQUESTS (an image and a video, both with guidance) a
      DIR/cosmos3-tiny-{name}-reference.safetensors and one DIR/cosmos3-tiny-reference.json.

How the committed fixture was made (the Python that `engine/parity/venv` prints as $PYTHON):
    $PYTHON engine/parity/cosmos3_reference.py fixture engine/tests/fixtures
The engine's test (`engine/tests/cosmos3.rs`) runs the fixture's requests and compares.
"""

import argparse
import json
import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from wan_reference import CORPUS, StepRecorder, perturb, versions

# --- the tiny configs ---------------------------------------------------------------------------

# Qwen3-shaped on a small scale: 4 query heads sharing 2 key/value heads (GQA), head_dim 16 whose
# 8 rotary frequencies are split 4/2/2 over (t, h, w) and interleaved as Qwen3-VL does; the
# published defaults elsewhere (fps modulation on, spatial ids reset, the 15000-position margin
# between text and vision, timestep_scale 0.001).
TRANSFORMER_CONFIG = dict(
    head_dim=16,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    latent_channel=48,
    latent_patch_size=2,
    patch_latent_dim=192,
    rope_theta=5000000.0,
    rope_axes_dim=[4, 2, 2],
    rms_norm_eps=1e-6,
    base_fps=24,
    enable_fps_modulation=True,
    unified_3d_mrope_reset_spatial_ids=True,
    unified_3d_mrope_temporal_modality_margin=15000,
    timestep_scale=0.001,
    hidden_act="silu",
    qk_norm_for_text=True,
    use_und_k_norm_for_gen=False,
)

# The residual (Wan 2.2) VAE: 48 latent channels, patch 2, so 16 pixels per latent.
VAE_CONFIG = dict(
    base_dim=8,
    decoder_base_dim=8,
    z_dim=48,
    dim_mult=[1, 1, 1, 1],
    num_res_blocks=1,
    temperal_downsample=[False, True, True],
    is_residual=True,
    in_channels=12,
    out_channels=12,
    patch_size=2,
    scale_factor_spatial=16,
    scale_factor_temporal=4,
)

VAE_OUT_GAIN = 6.0

UNIPC_CONFIG = dict(
    num_train_timesteps=1000,
    prediction_type="flow_prediction",
    use_flow_sigmas=True,
    flow_shift=5.0,
    solver_order=2,
    solver_type="bh2",
    predict_x0=True,
    lower_order_final=True,
    final_sigmas_type="zero",
    timestep_spacing="linspace",
)

TOKENIZER_VOCAB_SIZE = 400
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
]

# Qwen's ChatML, in the shape Qwen3-VL's template takes for text-only messages (a system
# message when the first is one, then each message, then the assistant's opening).
CHAT_TEMPLATE = (
    "{%- if messages[0].role == 'system' -%}"
    "{%- if messages[0].content is string -%}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role != 'system' or not loop.first -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def build_tokenizer():
    """A byte-level BPE like Qwen2/Qwen3's (its pre-tokenizer split, byte-level alphabet),
    trained on CORPUS, with Qwen's special tokens and CHAT_TEMPLATE, as Qwen2TokenizerFast."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast

    split = Regex(
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(split, behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    hf = Qwen2TokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
    )
    assert hf.convert_tokens_to_ids("<|vision_start|>") == 3
    return hf


def build_vae(seed):
    from diffusers import AutoencoderKLWan

    g = torch.Generator().manual_seed(seed + 7)
    z = VAE_CONFIG["z_dim"]
    mean = (torch.randn(z, generator=g) * 0.5).tolist()
    std = (torch.rand(z, generator=g) * 2.0 + 0.5).tolist()
    torch.manual_seed(seed + 2)
    vae = AutoencoderKLWan(**VAE_CONFIG, latents_mean=[round(m, 4) for m in mean],
                           latents_std=[round(s, 4) for s in std])
    perturb(vae, seed + 3)
    with torch.no_grad():
        vae.decoder.conv_out.weight.mul_(VAE_OUT_GAIN)
    return vae.eval()


def cmd_make(a):
    from diffusers import Cosmos3OmniPipeline, Cosmos3OmniTransformer, UniPCMultistepScheduler

    tokenizer = build_tokenizer()
    torch.manual_seed(a.seed)
    transformer = Cosmos3OmniTransformer(**TRANSFORMER_CONFIG, vocab_size=len(tokenizer))
    perturb(transformer, a.seed + 1)
    pipe = Cosmos3OmniPipeline(
        transformer=transformer.eval(),
        text_tokenizer=tokenizer,
        vae=build_vae(a.seed),
        scheduler=UniPCMultistepScheduler(**UNIPC_CONFIG),
        enable_safety_checker=False,
    )
    pipe.save_pretrained(a.out, safe_serialization=True)
    print(f"saved {a.out}: vocab {len(tokenizer)}")


def load_pipe(model):
    from diffusers import Cosmos3OmniPipeline

    pipe = Cosmos3OmniPipeline.from_pretrained(model, dtype=torch.float32, enable_safety_checker=False)
    pipe.to("cpu")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference(pipe, prompt, negative_prompt, frames, height, width, steps, guidance, init, fps=24.0):
    """Cosmos3OmniPipeline.__call__ from the given initial latents; returns the tensors `run` saves."""
    cond, uncond = pipe.tokenize_prompt(prompt, negative_prompt, num_frames=frames, height=height,
                                        width=width, fps=fps)
    record = StepRecorder()
    with torch.no_grad():
        result = pipe(
            prompt=prompt,
            negative_prompt=negative_prompt,
            num_frames=frames,
            height=height,
            width=width,
            fps=fps,
            num_inference_steps=steps,
            guidance_scale=guidance,
            latents=init.clone(),
            output_type="np",
            callback_on_step_end=record,
            enable_safety_check=False,
        )
    video = np.asarray(result.video, dtype=np.float32)  # [F, H, W, 3] in [0, 1]
    out = {
        "input_ids": torch.tensor(cond, dtype=torch.int64),
        "negative_input_ids": torch.tensor(uncond, dtype=torch.int64),
        "init_latents": init,
        "frames": torch.from_numpy(np.ascontiguousarray(video)),
        **record.tensors(pipe),
    }
    return {k: v.contiguous() for k, v in out.items()}


def latent_shape(frames, height, width):
    z = VAE_CONFIG["z_dim"]
    return (1, z, (frames - 1) // 4 + 1, height // 16, width // 16)


def cmd_run(a):
    pipe = load_pipe(a.model)
    init = load_file(a.latents)["latents"].float()
    out = reference(pipe, a.prompt, a.negative_prompt, a.frames, a.height, a.width, a.steps,
                    a.guidance, init, fps=a.fps)
    save_file(out, a.out)
    print(f"timesteps {out['timesteps'].tolist()} frames {tuple(out['frames'].shape)} "
          f"tokens {out['input_ids'].numel()} / {out['negative_input_ids'].numel()}")


# --- fixture ----------------------------------------------------------------------------------------

# An image (one latent frame, 64x96: a 2x3 patch grid) and a video (9 frames: 3 latent frames,
# so the rotary time axis, the VAE's causal cache and both temporal upsamples run), both under
# guidance, whose prompt and negative prompt differ in length (so do their sequences).
FIXTURE_REQUESTS = {
    "image": dict(prompt="A fox in the snow.", negative_prompt="blurry, low quality", frames=1,
                  height=64, width=96, steps=3, guidance=6.0),
    "video": dict(prompt="A red fox runs through a snowy forest at dawn.", negative_prompt="static",
                  frames=9, height=64, width=96, steps=3, guidance=4.0),
}


def cmd_fixture(a):
    model = os.path.join(a.dir, "cosmos3-tiny")
    cmd_make(argparse.Namespace(out=model, seed=a.seed))
    pipe = load_pipe(model)
    desc = {"model": "cosmos3-tiny", "model_seed": a.seed, "requests": {}, "versions": versions()}
    for i, (name, req) in enumerate(FIXTURE_REQUESTS.items()):
        shape = latent_shape(req["frames"], req["height"], req["width"])
        init = torch.randn(shape, generator=torch.Generator().manual_seed(a.latents_seed + i))
        out = reference(pipe, init=init, **req)
        save_file(out, os.path.join(a.dir, f"cosmos3-tiny-{name}-reference.safetensors"))
        desc["requests"][name] = {
            **req,
            "fps": 24.0,
            "latents_shape": list(shape),
            "latents_seed": a.latents_seed + i,
            "timesteps": out["timesteps"].tolist(),
            "tokens": [out["input_ids"].numel(), out["negative_input_ids"].numel()],
        }
        print(f"{name}: timesteps {out['timesteps'].tolist()} tokens {desc['requests'][name]['tokens']}")
    desc["keys"] = {
        "input_ids": "[L] the conditional prompt's ids (templates, chat template, eos, <|vision_start|>)",
        "negative_input_ids": "[L'] the negative prompt's",
        "init_latents": "[1,48,T,h,w] the initial latents passed as latents=",
        "step_latents": "[S,1,48,T,h,w] latents after each scheduler step",
        "latents": "[1,48,T,h,w] final latents, before the VAE",
        "frames": "[F,H,W,3] float32 in [0,1], output_type='np'",
        "timesteps": "[S] int64",
        "sigmas": "[S+1] float32",
    }
    with open(os.path.join(a.dir, "cosmos3-tiny-reference.json"), "w") as f:
        json.dump(desc, f, indent=2)
        f.write("\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("out")
    m.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("run")
    r.add_argument("model")
    r.add_argument("--prompt", required=True)
    r.add_argument("--negative-prompt", default=None)
    r.add_argument("--frames", type=int, default=1)
    r.add_argument("--height", type=int, default=64)
    r.add_argument("--width", type=int, default=96)
    r.add_argument("--steps", type=int, default=3)
    r.add_argument("--guidance", type=float, default=6.0)
    r.add_argument("--fps", type=float, default=24.0)
    r.add_argument("--latents", required=True, help="safetensors with `latents`")
    r.add_argument("--out", required=True)
    f = sub.add_parser("fixture")
    f.add_argument("dir")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--latents-seed", type=int, default=0)
    a = p.parse_args(argv)
    {"make": cmd_make, "run": cmd_run, "fixture": cmd_fixture}[a.cmd](a)


if __name__ == "__main__":
    main()
