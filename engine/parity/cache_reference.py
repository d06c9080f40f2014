#!/usr/bin/env python3
"""Reference side of the step caches' parity: diffusers' own hooks on the committed tiny Wan 2.1
pipeline (engine/tests/fixtures/wan21-tiny), which engine/tests/step_cache.rs checks.

    $(engine/parity/venv | tail -n 1) engine/parity/cache_reference.py engine/tests/fixtures

For each case (a cache, its parameters, guided or not) it applies the hook to the pipeline's
transformer (`apply_first_block_cache`, `apply_mag_cache`, `apply_taylorseer_cache`), runs
`WanPipeline` on the CPU in float32 from the fixture's initial latents, and writes to
DIR/wan21-tiny-cache-reference.safetensors:

  <case>.latents   final latents (before the VAE)
  <case>.computed  [steps, rows] int64: 1 where the transformer's last block really ran for that
                   row (cache context `cond`, then `uncond` under guidance)
  mag_calibrate.ratios  the ratios MagCache's calibration run records (context `cond`)

and the cases with their settings to DIR/wan21-tiny-cache-reference.json. Which blocks ran is
read from a forward hook on the last block's self-attention, which only runs when the block
computes (a skipping hook returns before calling the block).

Notes on the settings: TaylorSeer runs in its lite mode (`use_lite_mode=True`: the blocks are
skipped, `proj_out` predicted), the one that skips blocks; its default patterns (`^blocks.*attn`)
match no module of WanTransformer3DModel (its attentions are `attn1` and `attn2`), so the default
mode changes nothing on Wan. The Taylor factors are kept in float32 (diffusers' default is
bfloat16), as the engine keeps them.
"""

import argparse
import os
import sys

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cache_hooks import Recorder, apply, hook_cases, write_reference  # noqa: E402
from wan_reference import FIXTURE_REQUEST, load_pipe, versions  # noqa: E402

STEPS = 12
# The committed fixture's request (prompt, negative prompt, frames, size, max_sequence_length), at
# more steps so that the caches have steps to skip.
REQUEST = {k: v for k, v in FIXTURE_REQUEST.items() if not k.startswith("guidance")} | {"steps": STEPS}


# name -> (cache setting as the engine reads it, guidance); MagCache at diffusers' threshold.
def cases():
    return hook_cases(0.09, None, 5.0)


def run_case(model, init, cache, guidance):
    pipe = load_pipe(model)
    t = pipe.transformer
    rows = 2 if guidance > 1.0 else 1
    rec = Recorder(t, t.blocks[-1].attn1)
    apply(t, cache, STEPS)
    out = pipe(
        prompt=REQUEST["prompt"],
        negative_prompt=REQUEST["negative_prompt"],
        height=REQUEST["height"],
        width=REQUEST["width"],
        num_frames=REQUEST["frames"],
        num_inference_steps=STEPS,
        guidance_scale=guidance,
        latents=init.clone(),
        output_type="latent",
        max_sequence_length=REQUEST["max_sequence_length"],
    )
    computed = rec.close(STEPS, rows)
    return out.frames.float().contiguous(), computed, rec.calibrated


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", help="e.g. engine/tests/fixtures")
    p.add_argument("--only", default=None, help="one case (to inspect it)")
    a = p.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    model = os.path.join(a.dir, "wan21-tiny")
    init = load_file(os.path.join(a.dir, "wan21-tiny-reference.safetensors"))["init_latents"]

    def run_one(_i, _name, case):
        cache, guidance = case
        latents, computed, calibrated = run_case(model, init, cache, guidance)
        return {"cache": cache, "guidance": guidance}, {}, latents, computed, calibrated

    desc = {"model": "wan21-tiny", **REQUEST, "versions": versions()}
    write_reference(a.dir, "wan21-tiny-cache-reference", cases(), run_one, desc, a.only)


if __name__ == "__main__":
    main()
