#!/usr/bin/env python3
"""Reference side of the step caches' parity on Cosmos3: diffusers' own hooks (`apply_sea_cache`
through `transformer.enable_cache(SeaCacheConfig(..))`, `apply_first_block_cache`,
`apply_mag_cache`, `apply_taylorseer_cache`) on the committed tiny Cosmos3 pipeline
(engine/tests/fixtures/cosmos3-tiny), which engine/tests/cosmos3_cache.rs checks.

    $(engine/parity/venv | tail -n 1) engine/parity/cosmos3_cache_reference.py engine/tests/fixtures

For each case (a cache and its parameters, a request of the fixture, guided or not) it runs
`Cosmos3OmniPipeline` on the CPU in float32 from seeded initial latents and writes to
DIR/cosmos3-tiny-cache-reference.safetensors:

  <case>.init      the initial latents
  <case>.latents   final latents (before the VAE)
  <case>.computed  [steps, rows] int64: 1 where the decoder stack really ran for that row (cache
                   context `cond`, then `uncond` under guidance)
  <case>.ratios    the ratios MagCache's calibration run records (context `cond`)

and the cases with their requests and settings to DIR/cosmos3-tiny-cache-reference.json.
Which steps ran is read from a forward hook on the last decoder layer's generation MLP, which runs
only when the stack is computed (SeaCache replaces `_run_decoder_stack` and returns before calling it; First-
Block Cache and MagCache return from their tail hooks without calling it). TaylorSeer's lite mode
skips the modules matching `^[^.]*block[^.]*\.[^.]+$`, which no Cosmos3 module matches (its
decoder layers are `layers.N`): diffusers computes every layer and predicts `proj_out`, so for
TaylorSeer a step counts as computed when `proj_out` really ran; the engine skips the layers
whose result the prediction replaces, and its latents are the same.

First-Block Cache and MagCache do not run on Cosmos3 in diffusers 0.42.1 as shipped: their hooks
look the block's streams up by the literal names `hidden_states` and `encoder_hidden_states`,
while the block registry names Cosmos3's `gen_seq` and `und_seq` (`hidden_states_argument_name`,
`encoder_hidden_states_argument_name`), so First-Block Cache fails at its first step and MagCache
at its first skip. For those two this script reads the names through the registry
(`cache_hooks.by_name`, the one change) and runs diffusers' hooks otherwise as they are: the reference is the
hooks' own definition over the generation stream.

On Cosmos3 diffusers cuts SeaCache's residual after the pathways' final norms (`norm`,
`norm_moe_gen`): a skipped step's generation output is its input plus the last residual
(extrapolated linearly from the last two at `residual_order` 1), and the gate reads the latents
through the SEA filter (a 3D spectral filter over frames, rows and columns at the step's sigma).
"""

import argparse
import os
import sys

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cache_hooks import Recorder, apply, by_name, hook_cases, write_reference  # noqa: E402
from cosmos3_reference import FIXTURE_REQUESTS, latent_shape, load_pipe  # noqa: E402
from wan_reference import versions  # noqa: E402

STEPS = 12
SEED = 7


# name -> (request of the fixture, cache setting as the engine reads it, guidance): SeaCache's
# cases, then the other hooks' with the video request guided and the image unguided.
def cases():
    sea = {"kind": "sea", "threshold": 0.25}  # diffusers' defaults otherwise
    zero = {"kind": "sea", "threshold": 0.4, "residual_order": 0, "max_consecutive_cached": 3,
            "retention_steps": 2, "cache_end_steps": 2}
    loose = {"kind": "sea", "threshold": 0.6, "max_consecutive_cached": 0}
    hooks = {name: ("video" if guidance > 1.0 else "image", cache, guidance)
             for name, (cache, guidance) in hook_cases(0.1, 0.1, 4.0).items()}
    return {
        "video_guided": ("video", sea, 4.0),
        "video_unguided": ("video", sea, 1.0),
        "video_order0_guided": ("video", zero, 4.0),
        "image_guided": ("image", loose, 6.0),
        "image_unguided": ("image", sea, 1.0),
        **hooks,
    }


def run_case(model, req, cache, guidance, init):
    pipe = load_pipe(model)
    t = pipe.transformer
    rows = 1 if guidance == 1.0 else 2
    if cache["kind"] == "taylorseer":
        rec = Recorder(t, t.proj_out, wrap=True)
    else:
        rec = Recorder(t, t.layers[-1].mlp_moe_gen)
    apply(t, cache, STEPS)
    with torch.no_grad():
        out = pipe(
            prompt=req["prompt"],
            negative_prompt=req["negative_prompt"],
            num_frames=req["frames"],
            height=req["height"],
            width=req["width"],
            fps=24.0,
            num_inference_steps=STEPS,
            guidance_scale=guidance,
            latents=init.clone(),
            output_type="latent",
            enable_safety_check=False,
        )
    computed = rec.close(STEPS, rows)
    latents = out.video if hasattr(out, "video") else out[0]
    return latents.float().contiguous(), computed, rec.calibrated


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", help="e.g. engine/tests/fixtures")
    p.add_argument("--only", default=None, help="one case (to inspect it)")
    a = p.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    by_name()
    model = os.path.join(a.dir, "cosmos3-tiny")

    def run_one(i, _name, case):
        which, cache, guidance = case
        req = FIXTURE_REQUESTS[which]
        shape = latent_shape(req["frames"], req["height"], req["width"])
        init = torch.randn(shape, generator=torch.Generator().manual_seed(SEED + i))
        latents, computed, calibrated = run_case(model, req, cache, guidance, init)
        request = {k: req[k] for k in ("prompt", "negative_prompt", "frames", "height", "width")}
        entry = {"request": request, "cache": cache, "guidance": guidance}
        return entry, {"init": init}, latents, computed, calibrated

    desc = {"model": "cosmos3-tiny", "steps": STEPS, "versions": versions()}
    write_reference(a.dir, "cosmos3-tiny-cache-reference", cases(), run_one, desc, a.only)


if __name__ == "__main__":
    main()
