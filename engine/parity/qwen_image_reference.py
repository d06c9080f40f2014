#!/usr/bin/env python3
"""Reference side of the Qwen-Image text-to-image parity: diffusers' own QwenImagePipeline.

Subcommands
  make OUT [--seed S]
      Builds a tiny random Qwen-Image pipeline (a byte-level BPE tokenizer trained on a small
      embedded corpus with Qwen's special tokens, a Qwen2_5_VLForConditionalGeneration text
      encoder with a tiny vision tower, a QwenImageTransformer2DModel, an
      AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler with the published model's
      dynamic shifting and terminal shift) and saves it with
      `pipe.save_pretrained(OUT, safe_serialization=True)`. Nothing is downloaded: weights
      are random, seeded.
  run MODEL --prompt P ... --latents IN --out OUT
      Runs QwenImagePipeline.from_pretrained(MODEL) on the CPU in float32 from the given
      packed initial latents; saves the token ids, prompt embeddings, per-step and final
      latents and the decoded image.
  fixture DIR
      Writes the committed tiny fixture: DIR/qwen-image-tiny, and for each request of
      FIXTURE_REQUESTS a DIR/qwen-image-tiny-{name}-reference.safetensors and one
      DIR/qwen-image-tiny-reference.json.

How the committed fixture was made (the Python that `engine/parity/venv` prints as $PYTHON):
    $PYTHON engine/parity/qwen_image_reference.py fixture engine/tests/fixtures
The engine's test (`engine/tests/qwen_image.rs`) runs the fixture's requests and compares.
"""

import argparse
import json
import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from cosmos3_reference import build_tokenizer
from wan_reference import StepRecorder, perturb, versions

# --- the tiny configs ---------------------------------------------------------------------------

# Qwen2.5-VL's language model on a small scale: GQA (4 query heads over 2 key/value heads),
# head_dim 8 whose 4 rotary frequencies are split 2/1/1 over the mrope sections; a tiny
# vision tower the pipeline never runs.
TEXT_CONFIG = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=2048,
    rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]},
)
VISION_CONFIG = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    out_hidden_size=32,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=112,
    fullatt_block_indexes=[0],
)

# The published transformer's structure on a small scale: 2 double-stream blocks of 2 heads x
# 16, the rotary head split 4/6/6 over (frame, row, column); latents of 16 channels in 2x2
# patches (64 per token).
TRANSFORMER_CONFIG = dict(
    patch_size=2,
    in_channels=64,
    out_channels=16,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    guidance_embeds=False,
    axes_dims_rope=(4, 6, 6),
)

# The Wan 2.1 VAE's structure (8x spatial, z_dim 16) at width 8.
VAE_CONFIG = dict(
    base_dim=8,
    z_dim=16,
    dim_mult=[1, 1, 1, 1],
    num_res_blocks=1,
    temperal_downsample=[False, True, True],
)
VAE_OUT_GAIN = 6.0

# The published Qwen-Image scheduler: shift by the image's sequence length, to a terminal 0.02.
SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000,
    shift=1.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=0.9,
    base_image_seq_len=256,
    max_image_seq_len=8192,
    shift_terminal=0.02,
    time_shift_type="exponential",
)


def build_text_encoder(seed, vocab):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    cfg = Qwen2_5_VLConfig(text_config=dict(TEXT_CONFIG, vocab_size=vocab),
                           vision_config=VISION_CONFIG, vocab_size=vocab)
    torch.manual_seed(seed)
    te = Qwen2_5_VLForConditionalGeneration(cfg)
    perturb(te, seed + 1)
    return te.eval()


def build_vae(seed):
    from diffusers import AutoencoderKLQwenImage

    g = torch.Generator().manual_seed(seed + 7)
    z = VAE_CONFIG["z_dim"]
    mean = (torch.randn(z, generator=g) * 0.5).tolist()
    std = (torch.rand(z, generator=g) * 2.0 + 0.5).tolist()
    torch.manual_seed(seed + 2)
    vae = AutoencoderKLQwenImage(**VAE_CONFIG, latents_mean=[round(m, 4) for m in mean],
                                 latents_std=[round(s, 4) for s in std])
    perturb(vae, seed + 3)
    with torch.no_grad():
        vae.decoder.conv_out.weight.mul_(VAE_OUT_GAIN)
    return vae.eval()


def cmd_make(a):
    from diffusers import (FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)

    tokenizer = build_tokenizer()
    torch.manual_seed(a.seed + 4)
    transformer = QwenImageTransformer2DModel(**TRANSFORMER_CONFIG)
    perturb(transformer, a.seed + 5)
    pipe = QwenImagePipeline(
        transformer=transformer.eval(),
        text_encoder=build_text_encoder(a.seed + 10, len(tokenizer)),
        tokenizer=tokenizer,
        vae=build_vae(a.seed),
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
    )
    pipe.save_pretrained(a.out, safe_serialization=True)
    print(f"saved {a.out}: vocab {len(tokenizer)}")


def load_pipe(model):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(model, dtype=torch.float32)
    pipe.to("cpu")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def prompt_ids(pipe, prompt):
    """The ids the pipeline's text encoder reads for `prompt` (template applied, truncated)."""
    drop = pipe.prompt_template_encode_start_idx
    tokens = pipe.tokenizer(pipe.prompt_template_encode.format(prompt),
                            max_length=pipe.tokenizer_max_length + drop, truncation=True)
    return torch.tensor(tokens.input_ids, dtype=torch.int64)


def reference(pipe, prompt, negative_prompt, height, width, steps, guidance, init):
    """QwenImagePipeline.__call__ from the given packed initial latents; returns the tensors
    `run` saves. The pipeline's own rule (`do_true_cfg`): true classifier-free guidance when
    the scale is above 1 and a negative prompt is given (None: none is, and it runs unguided
    whatever the scale)."""
    guided = guidance > 1.0 and negative_prompt is not None
    record = StepRecorder()
    with torch.no_grad():
        embeds, _ = pipe.encode_prompt(prompt, device="cpu")
        result = pipe(
            prompt=prompt,
            negative_prompt=negative_prompt,
            true_cfg_scale=guidance,
            height=height,
            width=width,
            num_inference_steps=steps,
            latents=init.clone(),
            output_type="np",
            callback_on_step_end=record,
        )
        out = {
            "input_ids": prompt_ids(pipe, prompt),
            "prompt_embeds": embeds[0].contiguous(),
        }
        if guided:
            negative, _ = pipe.encode_prompt(negative_prompt, device="cpu")
            out["negative_input_ids"] = prompt_ids(pipe, negative_prompt)
            out["negative_prompt_embeds"] = negative[0].contiguous()
    image = np.asarray(result.images[0], dtype=np.float32)  # [H, W, 3] in [0, 1]
    out.update({
        "init_latents": init,
        "image": torch.from_numpy(np.ascontiguousarray(image)),
        **record.tensors(pipe),
    })
    return {k: v.contiguous() for k, v in out.items()}


def latent_shape(height, width):
    """The packed latents QwenImagePipeline draws: [1, (H/16)(W/16), 4 z_dim]."""
    return (1, (height // 16) * (width // 16), 4 * VAE_CONFIG["z_dim"])


def cmd_run(a):
    pipe = load_pipe(a.model)
    init = load_file(a.latents)["latents"].float()
    out = reference(pipe, a.prompt, a.negative_prompt, a.height, a.width, a.steps, a.guidance,
                    init)
    save_file(out, a.out)
    print(f"timesteps {out['timesteps'].tolist()} image {tuple(out['image'].shape)} "
          f"tokens {out['input_ids'].numel()}")


# --- fixture ----------------------------------------------------------------------------------------

# A guided image whose prompt and negative prompt differ in length (so do their sequences),
# on a non-square 4x6 patch grid; an unguided one on another grid; and one at the default
# scale with no negative prompt, which the pipeline runs unguided.
FIXTURE_REQUESTS = {
    "guided": dict(prompt="A fox in the snow.", negative_prompt="blurry, low quality",
                   height=64, width=96, steps=3, guidance=4.0),
    "unguided": dict(prompt="A red fox runs through a snowy forest at dawn.",
                     negative_prompt="", height=48, width=32, steps=2, guidance=1.0),
    "no_negative": dict(prompt="A fox in the snow.", negative_prompt=None,
                        height=32, width=64, steps=2, guidance=4.0),
}


def cmd_fixture(a):
    model = os.path.join(a.dir, "qwen-image-tiny")
    cmd_make(argparse.Namespace(out=model, seed=a.seed))
    pipe = load_pipe(model)
    desc = {"model": "qwen-image-tiny", "model_seed": a.seed, "requests": {},
            "versions": versions()}
    for i, (name, req) in enumerate(FIXTURE_REQUESTS.items()):
        shape = latent_shape(req["height"], req["width"])
        init = torch.randn(shape, generator=torch.Generator().manual_seed(a.latents_seed + i))
        out = reference(pipe, init=init, **req)
        save_file(out, os.path.join(a.dir, f"qwen-image-tiny-{name}-reference.safetensors"))
        desc["requests"][name] = {
            **req,
            "latents_shape": list(shape),
            "latents_seed": a.latents_seed + i,
            "timesteps": out["timesteps"].tolist(),
            "tokens": out["input_ids"].numel(),
        }
        print(f"{name}: timesteps {out['timesteps'].tolist()} tokens {out['input_ids'].numel()}")
    desc["keys"] = {
        "input_ids": "[L] the prompt's ids as the text encoder reads them (template applied)",
        "negative_input_ids": "[L'] the negative prompt's (guided requests only)",
        "prompt_embeds": "[L-34, D] encode_prompt's output: the last hidden states past the template's first 34 tokens",
        "negative_prompt_embeds": "[L'-34, D] the negative prompt's (guided requests only)",
        "init_latents": "[1, S, 64] the packed initial latents passed as latents=",
        "step_latents": "[N, 1, S, 64] packed latents after each scheduler step",
        "latents": "[1, S, 64] final packed latents, before unpacking and the VAE",
        "image": "[H, W, 3] float32 in [0, 1], output_type='np'",
        "timesteps": "[N] float32",
        "sigmas": "[N+1] float32",
    }
    with open(os.path.join(a.dir, "qwen-image-tiny-reference.json"), "w") as f:
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
    r.add_argument("--negative-prompt", default=None,
                   help="left out: none, as QwenImagePipeline's default (unguided)")
    r.add_argument("--height", type=int, default=64)
    r.add_argument("--width", type=int, default=96)
    r.add_argument("--steps", type=int, default=3)
    r.add_argument("--guidance", type=float, default=4.0)
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
