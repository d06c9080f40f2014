#!/usr/bin/env python3
"""Reference side of the step caches' parity on Qwen-Image: diffusers' own hooks
(`apply_first_block_cache`, `apply_mag_cache`, `apply_taylorseer_cache`) on the committed tiny
Qwen-Image pipeline (engine/tests/fixtures/qwen-image-tiny), which
engine/tests/qwen_image_cache.rs checks.

    $(engine/parity/venv | tail -n 1) engine/parity/qwen_image_cache_reference.py engine/tests/fixtures

For each case (a cache and its parameters, guided by a negative prompt or not) it runs
`QwenImagePipeline` on the CPU in float32 from seeded packed initial latents and writes to
DIR/qwen-image-tiny-cache-reference.safetensors:

  <case>.init      the packed initial latents [1, S, 64]
  <case>.latents   final packed latents (before the VAE)
  <case>.computed  [steps, rows] int64: 1 where the last block's image feed-forward really ran
                   for that row (cache context `cond`, then `uncond` under guidance); for
                   TaylorSeer, where `proj_out` really ran (its lite mode predicts it)
  <case>.ratios    the ratios MagCache's calibration run records (context `cond`)

and the cases with their settings to DIR/qwen-image-tiny-cache-reference.json. The hooks run
on `QwenImageTransformerBlock` as diffusers registers it (the image stream is the block's
`hidden_states`, so First-Block Cache's and MagCache's residuals are the image stream's).
"""

import argparse
import os
import sys

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cache_hooks import Recorder, apply, hook_cases, write_reference  # noqa: E402
from qwen_image_reference import latent_shape, load_pipe  # noqa: E402
from wan_reference import versions  # noqa: E402

STEPS = 12
SEED = 11
REQUEST = dict(prompt="A fox in the snow.", negative_prompt="blurry, low quality", height=64, width=96)


# name -> (cache setting as the engine reads it, guidance)
def cases():
    return hook_cases(0.45, 0.1, 4.0)


def run_case(model, cache, guidance, init):
    pipe = load_pipe(model)
    t = pipe.transformer
    rows = 2 if guidance > 1.0 else 1
    if cache["kind"] == "taylorseer":
        rec = Recorder(t, t.proj_out, wrap=True)
    else:
        rec = Recorder(t, t.transformer_blocks[-1].img_mlp)
    apply(t, cache, STEPS)
    with torch.no_grad():
        out = pipe(
            prompt=REQUEST["prompt"],
            negative_prompt=REQUEST["negative_prompt"],
            true_cfg_scale=guidance,
            height=REQUEST["height"],
            width=REQUEST["width"],
            num_inference_steps=STEPS,
            latents=init.clone(),
            output_type="latent",
        )
    computed = rec.close(STEPS, rows)
    return out.images.float().contiguous(), computed, rec.calibrated


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", help="e.g. engine/tests/fixtures")
    p.add_argument("--only", default=None, help="one case (to inspect it)")
    a = p.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    model = os.path.join(a.dir, "qwen-image-tiny")

    def run_one(i, _name, case):
        cache, guidance = case
        shape = latent_shape(REQUEST["height"], REQUEST["width"])
        init = torch.randn(shape, generator=torch.Generator().manual_seed(SEED + i))
        latents, computed, calibrated = run_case(model, cache, guidance, init)
        return {"cache": cache, "guidance": guidance}, {"init": init}, latents, computed, calibrated

    desc = {"model": "qwen-image-tiny", "steps": STEPS, **REQUEST, "versions": versions()}
    write_reference(a.dir, "qwen-image-tiny-cache-reference", cases(), run_one, desc, a.only)


if __name__ == "__main__":
    main()
