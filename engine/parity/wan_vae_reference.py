"""Reference outputs of diffusers' AutoencoderKLWan decoder, for checking layerwise's.

What it does
    1. Builds a diffusers ``AutoencoderKLWan`` from a preset (``tiny``: diffusers' own test
       config; ``wan21``: the published Wan 2.1 VAE's shapes) with seeded random weights.
       Every parameter gets seeded noise on top of its init, so parts that start at one
       (the RMS norms' gains) or zero (biases) matter, and the decoder's last conv is scaled
       up so the frames span [-1, 1] and the final clamp is exercised.
    2. ``save_pretrained``s it (safetensors) into ``--out``: ``config.json`` and
       ``diffusion_pytorch_model.safetensors``, exactly a diffusers ``vae/`` folder.
    3. Draws latents in the pipeline's (normalised) space, decodes them with WanPipeline's
       exact lines (``latents / (1 / latents_std) + latents_mean``, then
       ``vae.decode(latents).sample``) in float32, and writes ``reference.safetensors``:
       for each clip length T in ``--frames``, ``latents_T`` [1, z, T, h, w] and
       ``video_T`` [1, 3, 1 + 4 (T - 1), 8h, 8w].

How it is used
    The engine's test (``engine/src/families/wan/vae/parity_tests.rs``) loads the folder
    with the Rust decoder, decodes each ``latents_T`` and compares with ``video_T``:
    always against the committed ``engine/tests/fixtures/wan-vae-tiny/``, and also against
    a folder named by ``LAYERWISE_WAN_VAE_REFERENCE`` when set (e.g. the full-size one).
    CI does not run this script: it needs torch and diffusers, which the engine does not.

How the committed fixture was made (the Python that ``engine/parity/venv`` prints, or any
with torch, diffusers 0.42.1 and safetensors, as ``$PYTHON``):
    $PYTHON engine/parity/wan_vae_reference.py --config tiny --frames 3 1 \\
        --latent-size 4 --seed 0 --out engine/tests/fixtures/wan-vae-tiny

A full-size check (about 500 MB of f32 weights, a minute or so on a CPU):
    $PYTHON engine/parity/wan_vae_reference.py --config wan21 --frames 3 --latent-size 8 \\
        --out target/wan-vae-wan21-reference
    LAYERWISE_WAN_VAE_REFERENCE=$PWD/target/wan-vae-wan21-reference \\
        cargo test -p layerwise-engine --lib families::wan::vae -- --nocapture
"""

import argparse
import os

import torch
from diffusers import AutoencoderKLWan
from safetensors.torch import save_file

PRESETS = {
    # diffusers' own AutoencoderKLWan test config; mirrors WanVaeConfig::tiny().
    "tiny": dict(
        base_dim=3,
        z_dim=16,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
    ),
    # diffusers' defaults are the published Wan 2.1 VAE; mirrors WanVaeConfig::wan21().
    "wan21": dict(),
}

# The decoder's last conv is scaled by this after the random init: a random decoder's
# frames are nearly flat, and the check should see contrast and some clamping.
OUT_GAIN = 2.0


def perturb(module, seed):
    """Seeded noise on every parameter, in name order, at half its init's spread."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
            std = p.float().std().item() if p.numel() > 1 else 0.0
            amp = 0.5 * std if std > 1e-6 else 0.1
            p.add_(torch.randn(p.shape, generator=g, dtype=torch.float32) * amp)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--out", required=True, help="folder to write (created)")
    parser.add_argument("--frames", type=int, nargs="+", default=[3, 1], help="latent clip lengths")
    parser.add_argument("--latent-size", type=int, default=4, help="latent height and width")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    vae = AutoencoderKLWan(**PRESETS[args.config]).eval().float()
    perturb(vae, args.seed + 1)
    with torch.no_grad():
        vae.decoder.conv_out.weight.mul_(OUT_GAIN)
        vae.decoder.conv_out.bias.mul_(OUT_GAIN)

    os.makedirs(args.out, exist_ok=True)
    vae.save_pretrained(args.out, safe_serialization=True)

    cfg = vae.config
    tensors = {}
    generator = torch.Generator().manual_seed(args.seed + 2)
    for t in args.frames:
        latents = torch.randn(1, cfg.z_dim, t, args.latent_size, args.latent_size, generator=generator)
        with torch.no_grad():
            # WanPipeline.__call__'s lines after the denoising loop.
            latents_mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(latents.dtype)
            latents_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(latents.dtype)
            z = latents / latents_std + latents_mean
            video = vae.decode(z, return_dict=False)[0]
        tensors[f"latents_{t}"] = latents.contiguous()
        tensors[f"video_{t}"] = video.contiguous()
        clamped = (video.abs() == 1.0).float().mean().item()
        print(
            f"T={t}: latents {list(latents.shape)} -> video {list(video.shape)}, "
            f"std {video.std().item():.3f}, {100 * clamped:.1f}% clamped"
        )
    save_file(tensors, os.path.join(args.out, "reference.safetensors"))
    total = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
    print(f"wrote {args.out}: {total} bytes")


if __name__ == "__main__":
    main()
