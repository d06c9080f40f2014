"""Reference outputs of diffusers' AutoencoderKL decoder, for checking layerwise's VAE.

What it does
    1. Builds a diffusers ``AutoencoderKL`` from a config (``tiny``, ``sd`` or a
       ``config.json`` path) with seeded weights. diffusers initialises every GroupNorm
       to weight 1 / bias 0; the script perturbs those too, so that the check would catch
       a decoder that ignored them.
    2. ``save_pretrained``s it (safetensors) into ``--out``: ``config.json`` and
       ``diffusion_pytorch_model.safetensors``, exactly as a diffusers checkpoint's
       ``vae/`` folder looks.
    3. Draws fixed latents in the *sampler's* space, decodes them the way DiTPipeline
       does (``vae.decode(latents / scaling_factor)``, plus ``shift_factor`` when the
       config has one) in float32, and writes ``reference.safetensors`` into ``--out``
       with two tensors: ``latents`` [B, C, h, w] and ``sample`` [B, 3, H, W].

How it is used
    The engine's parity test (``engine/tests/vae_parity.rs``) loads the folder with the
    Rust decoder, decodes ``latents`` and compares with ``sample``:

    * always, against the committed fixture ``engine/tests/fixtures/vae-tiny/``;
    * in addition, when ``LAYERWISE_VAE_REFERENCE`` names a folder this script wrote
      (for example the full-size ``--config sd`` VAE), against that folder.

    CI does not run this script; it needs torch and diffusers, which the engine does not.

How the committed fixture was made
    python engine/parity/vae_reference.py --config tiny --batch 2 --latent-size 8 \\
        --seed 0 --out engine/tests/fixtures/vae-tiny

    ``tiny`` here must stay equal to ``VaeConfig::tiny()`` in
    ``engine/src/family/vae.rs`` (the Rust test checks that it is).

A full-size check (about 330 MB of weights, a minute or two on a CPU):
    python engine/parity/vae_reference.py --config sd --latent-size 32 --out target/vae-sd-reference
    LAYERWISE_VAE_REFERENCE=$PWD/target/vae-sd-reference cargo test -p layerwise-engine --test vae_parity -- --nocapture

Requirements: ``pip install torch diffusers safetensors numpy``.
"""

import argparse
import json
import os

import torch
from diffusers import AutoencoderKL
from safetensors.torch import save_file

PRESETS = {
    # Mirrors VaeConfig::tiny(): the real VAE's 8x upscale at toy widths.
    "tiny": dict(
        block_out_channels=[8, 16, 16, 16],
        layers_per_block=1,
        norm_num_groups=8,
        sample_size=64,
    ),
    # Mirrors VaeConfig::sd(): the shapes of stabilityai/sd-vae-ft-ema (DiT-XL/2's VAE).
    "sd": dict(
        block_out_channels=[128, 256, 512, 512],
        layers_per_block=2,
        norm_num_groups=32,
        sample_size=256,
    ),
}


def build_config(name):
    if name in PRESETS:
        n = len(PRESETS[name]["block_out_channels"])
        return dict(
            in_channels=3,
            out_channels=3,
            latent_channels=4,
            act_fn="silu",
            scaling_factor=0.18215,
            down_block_types=["DownEncoderBlock2D"] * n,
            up_block_types=["UpDecoderBlock2D"] * n,
            **PRESETS[name],
        )
    with open(name) as f:
        cfg = json.load(f)
    return {k: v for k, v in cfg.items() if not k.startswith("_")}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="tiny", help="tiny, sd, or a config.json path")
    parser.add_argument("--out", required=True, help="folder to write (created)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--latent-size", type=int, default=8, help="latent height and width")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    vae = AutoencoderKL(**build_config(args.config)).eval().float()
    with torch.no_grad():
        for module in vae.modules():
            if isinstance(module, torch.nn.GroupNorm):
                module.weight.add_(0.1 * torch.randn_like(module.weight))
                module.bias.add_(0.1 * torch.randn_like(module.bias))

    os.makedirs(args.out, exist_ok=True)
    vae.save_pretrained(args.out, safe_serialization=True)

    cfg = vae.config
    generator = torch.Generator().manual_seed(args.seed + 1)
    latents = torch.randn(
        args.batch, cfg.latent_channels, args.latent_size, args.latent_size, generator=generator
    )
    with torch.no_grad():
        z = 1 / cfg.scaling_factor * latents
        if cfg.shift_factor is not None:
            z = z + cfg.shift_factor
        sample = vae.decode(z).sample

    save_file(
        {"latents": latents.contiguous(), "sample": sample.contiguous()},
        os.path.join(args.out, "reference.safetensors"),
    )
    total = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
    print(
        f"wrote {args.out}: latents {list(latents.shape)} -> sample {list(sample.shape)}, "
        f"sample range [{sample.min().item():.3f}, {sample.max().item():.3f}], {total} bytes"
    )


if __name__ == "__main__":
    main()
