#!/usr/bin/env python3
"""Reference side of SeaCache's parity: diffusers' own hook (`SeaCacheConfig` through
`transformer.enable_cache`, i.e. `apply_sea_cache`) on the committed tiny Cosmos3 pipeline
(engine/tests/fixtures/cosmos3-tiny), which engine/tests/sea_cache.rs checks.

    $(engine/parity/venv | tail -n 1) engine/parity/sea_cache_reference.py engine/tests/fixtures

For each case (SeaCache's parameters, a request of the fixture, guided or not) it runs
`Cosmos3OmniPipeline` on the CPU in float32 from seeded initial latents and writes to
DIR/cosmos3-tiny-sea-cache-reference.safetensors:

  <case>.init      the initial latents
  <case>.latents   final latents (before the VAE)
  <case>.computed  [steps, rows] int64: 1 where the decoder stack really ran for that row (cache
                   context `cond`, then `uncond` under guidance)

and the cases with their requests and settings to DIR/cosmos3-tiny-sea-cache-reference.json.
Which steps ran is read from a forward hook on the last decoder layer, which runs only when the
stack is computed (SeaCache replaces `_run_decoder_stack` and returns before calling it).

On Cosmos3 diffusers cuts SeaCache's residual after the pathways' final norms (`norm`,
`norm_moe_gen`): a skipped step's generation output is its input plus the last residual
(extrapolated linearly from the last two at `residual_order` 1), and the gate reads the latents
through the SEA filter (a 3D spectral filter over frames, rows and columns at the step's sigma).
"""

import argparse
import json
import os
import sys

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cosmos3_reference import FIXTURE_REQUESTS, latent_shape, load_pipe  # noqa: E402
from wan_reference import versions  # noqa: E402

STEPS = 12
SEED = 7


# name -> (request of the fixture, cache setting as the engine reads it, guidance)
def cases():
    sea = {"kind": "sea", "threshold": 0.25}  # diffusers' defaults otherwise
    zero = {"kind": "sea", "threshold": 0.4, "residual_order": 0, "max_consecutive_cached": 3,
            "retention_steps": 2, "cache_end_steps": 2}
    loose = {"kind": "sea", "threshold": 0.6, "max_consecutive_cached": 0}
    return {
        "video_guided": ("video", sea, 4.0),
        "video_unguided": ("video", sea, 1.0),
        "video_order0_guided": ("video", zero, 4.0),
        "image_guided": ("image", loose, 6.0),
        "image_unguided": ("image", sea, 1.0),
    }


def config(c):
    from diffusers import SeaCacheConfig

    keys = ("threshold", "residual_order", "retention_steps", "cache_end_steps",
            "max_consecutive_cached", "power_exp")
    return SeaCacheConfig(**{k: c[k] for k in keys if k in c})


def run_case(model, req, cache, guidance, init):
    pipe = load_pipe(model)
    t = pipe.transformer
    rows = 1 if guidance == 1.0 else 2
    calls, ran = [0], set()

    def count(_m, _a, _k):
        calls[0] += 1

    def mark(_m, _a, _o):
        ran.add(calls[0] - 1)

    t.register_forward_pre_hook(count, with_kwargs=True)
    t.layers[-1].register_forward_hook(mark)
    t.enable_cache(config(cache))
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
    assert calls[0] == STEPS * rows, calls
    computed = torch.tensor([[int(s * rows + r in ran) for r in range(rows)] for s in range(STEPS)])
    latents = out.video if hasattr(out, "video") else out[0]
    return latents.float().contiguous(), computed


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", help="e.g. engine/tests/fixtures")
    p.add_argument("--only", default=None, help="one case (to inspect it)")
    a = p.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    model = os.path.join(a.dir, "cosmos3-tiny")
    tensors = {}
    desc = {"model": "cosmos3-tiny", "steps": STEPS, "cases": {}, "versions": versions()}
    for i, (name, (which, cache, guidance)) in enumerate(cases().items()):
        if a.only and name != a.only:
            continue
        req = FIXTURE_REQUESTS[which]
        shape = latent_shape(req["frames"], req["height"], req["width"])
        init = torch.randn(shape, generator=torch.Generator().manual_seed(SEED + i))
        latents, computed = run_case(model, req, cache, guidance, init)
        tensors[f"{name}.init"] = init.contiguous()
        tensors[f"{name}.latents"] = latents
        tensors[f"{name}.computed"] = computed.contiguous()
        request = {k: req[k] for k in ("prompt", "negative_prompt", "frames", "height", "width")}
        desc["cases"][name] = {"request": request, "cache": cache, "guidance": guidance}
        print(f"{name}: computed {computed.t().tolist()}", flush=True)
    if a.only:
        return
    save_file(tensors, os.path.join(a.dir, "cosmos3-tiny-sea-cache-reference.safetensors"))
    with open(os.path.join(a.dir, "cosmos3-tiny-sea-cache-reference.json"), "w") as f:
        json.dump(desc, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
