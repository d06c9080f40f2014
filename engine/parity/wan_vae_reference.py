"""Reference outputs of diffusers' AutoencoderKLWan decoder, for checking layerwise's.

What it does
    1. Builds a diffusers ``AutoencoderKLWan`` from a preset (``tiny``: diffusers' own test
       config; ``wan21``: the published Wan 2.1 VAE's shapes; ``tiny22``: diffusers' Wan 2.2
       5B pipeline test VAE, residual with 2x2 patches, with the published Wan 2.2 latent
       statistics; ``wan22``: the published Wan2.2-TI2V-5B VAE's shapes) with seeded random
       weights.
       Every parameter gets seeded noise on top of its init, so parts that start at one
       (the RMS norms' gains) or zero (biases) matter, and the decoder's last conv is scaled
       up so the frames span [-1, 1] and the final clamp is exercised.
    2. ``save_pretrained``s it (safetensors) into ``--out``: ``config.json`` and
       ``diffusion_pytorch_model.safetensors``, exactly a diffusers ``vae/`` folder.
    3. Draws latents in the pipeline's (normalised) space, decodes them with WanPipeline's
       exact lines (``latents / (1 / latents_std) + latents_mean``, then
       ``vae.decode(latents).sample``) in float32, and writes ``reference.safetensors``:
       for each clip length T in ``--frames``, ``latents_T`` [1, z, T, h, w] and
       ``video_T`` [1, 3, 1 + 4 (T - 1), s h, s w], s = 8 (Wan 2.1) or 16 (Wan 2.2).

How it is used
    The engine's test (``engine/src/components/wan_vae/parity_tests.rs``) loads the folder
    with the Rust decoder, decodes each ``latents_T`` and compares with ``video_T``:
    always against the committed ``engine/tests/fixtures/wan-vae-tiny/`` (Wan 2.1) and
    ``engine/tests/fixtures/wan22-vae-tiny/`` (Wan 2.2), and also against a folder named by
    ``LAYERWISE_WAN_VAE_REFERENCE`` when set (e.g. a full-size one).
    CI does not run this script: it needs torch and diffusers, which the engine does not.

How the committed fixtures were made (the Python that ``engine/parity/venv`` prints, or any
with torch, diffusers 0.42.1 and safetensors, as ``$PYTHON``):
    $PYTHON engine/parity/wan_vae_reference.py --config tiny --frames 3 1 \\
        --latent-size 4 --seed 0 --out engine/tests/fixtures/wan-vae-tiny
    $PYTHON engine/parity/wan_vae_reference.py --config tiny22 --frames 3 1 \\
        --latent-size 2 3 --seed 0 --out engine/tests/fixtures/wan22-vae-tiny

A full-size check (about 500 MB of f32 weights for wan21, a minute or so on a CPU; for
wan22 2.8 GB, written in about a minute and checked in about as long):
    $PYTHON engine/parity/wan_vae_reference.py --config wan21 --frames 3 --latent-size 8 \\
        --out target/wan-vae-wan21-reference
    LAYERWISE_WAN_VAE_REFERENCE=$PWD/target/wan-vae-wan21-reference \\
        cargo test --workspace --lib families::wan::vae -- --nocapture
(and the same with ``--config wan22 --frames 2 --latent-size 2 3``).

Tiled decode (``--tiled-from``): loads a folder this script wrote (the committed fixture's
weights are kept as they are), decodes fresh latents with diffusers' ``enable_tiling`` at
tile sample size ``--tile`` and stride ``--stride`` (both in output pixels; small enough
that the tiny fixtures' frames split into overlapping tiles), and writes
``tiled-reference.safetensors`` into that folder: ``latents`` [1, z, T, h, w], ``video``
[1, 3, F, H, W] and ``tile`` [size, stride]. The committed ones:
    $PYTHON engine/parity/wan_vae_reference.py --tiled-from engine/tests/fixtures/wan-vae-tiny \
        --tile 16 8 --frames 2 --latent-size 3 5 --seed 3
    $PYTHON engine/parity/wan_vae_reference.py --tiled-from engine/tests/fixtures/wan22-vae-tiny \
        --tile 32 16 --frames 2 --latent-size 2 3 --seed 3
"""

import argparse
import json
import os

import torch
from diffusers import AutoencoderKLWan
from safetensors.torch import save_file

# The published Wan 2.2 VAE's (z_dim 48) latent statistics.
WAN22_LATENTS_MEAN = [
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813,
    0.0891, 0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108,
    -0.2158, 0.2502, -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313,
    -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944,
    0.3573, -0.0548, -0.1681, -0.0667,
]
WAN22_LATENTS_STD = [
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
    0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
    0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
]

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
    # diffusers' Wan225BPipelineFastTests VAE (tests/pipelines/wan/test_wan_22.py), with the
    # published latent statistics for its zeros and ones so that the pipeline's per-channel
    # denormalisation is exercised; mirrors WanVaeConfig::tiny22().
    "tiny22": dict(
        base_dim=3,
        z_dim=48,
        in_channels=12,
        out_channels=12,
        is_residual=True,
        patch_size=2,
        latents_mean=WAN22_LATENTS_MEAN,
        latents_std=WAN22_LATENTS_STD,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        scale_factor_spatial=16,
        scale_factor_temporal=4,
        temperal_downsample=[False, True, True],
    ),
    # Wan-AI/Wan2.2-TI2V-5B-Diffusers' vae/config.json (also Cosmos3's VAE); mirrors
    # WanVaeConfig::wan22().
    "wan22": dict(
        base_dim=160,
        decoder_base_dim=256,
        z_dim=48,
        in_channels=12,
        out_channels=12,
        is_residual=True,
        patch_size=2,
        latents_mean=WAN22_LATENTS_MEAN,
        latents_std=WAN22_LATENTS_STD,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=2,
        scale_factor_spatial=16,
        scale_factor_temporal=4,
        temperal_downsample=[False, True, True],
    ),
}

# Keys the published config.json carries that diffusers 0.42.1's constructor does not take
# (it ignores them on load, and always clamps): written into the saved config as published.
CONFIG_EXTRAS = {"wan22": {"clip_output": False}}

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
    parser.add_argument("--out", help="folder to write (created)")
    parser.add_argument("--frames", type=int, nargs="+", default=[3, 1], help="latent clip lengths")
    parser.add_argument(
        "--latent-size",
        type=int,
        nargs="+",
        default=[4],
        help="latent height and width (one value: square)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiled-from", help="a folder this script wrote: write its tiled decode")
    parser.add_argument("--tile", type=int, nargs=2, metavar=("SIZE", "STRIDE"), default=[16, 8])
    args = parser.parse_args()
    if args.tiled_from:
        return tiled(args)
    if not args.out:
        parser.error("--out is required (or --tiled-from)")

    torch.manual_seed(args.seed)
    vae = AutoencoderKLWan(**PRESETS[args.config]).eval().float()
    perturb(vae, args.seed + 1)
    with torch.no_grad():
        vae.decoder.conv_out.weight.mul_(OUT_GAIN)
        vae.decoder.conv_out.bias.mul_(OUT_GAIN)

    os.makedirs(args.out, exist_ok=True)
    vae.save_pretrained(args.out, safe_serialization=True)
    extras = CONFIG_EXTRAS.get(args.config)
    if extras:
        path = os.path.join(args.out, "config.json")
        with open(path) as f:
            written = json.load(f)
        written.update(extras)
        with open(path, "w") as f:
            json.dump(written, f, indent=2, sort_keys=True)
            f.write("\n")

    cfg = vae.config
    tensors = {}
    generator = torch.Generator().manual_seed(args.seed + 2)
    if len(args.latent_size) not in (1, 2):
        parser.error("--latent-size takes a side, or a height and a width")
    height, width = (args.latent_size * 2)[:2]
    for t in args.frames:
        latents = torch.randn(1, cfg.z_dim, t, height, width, generator=generator)
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


def tiled(args):
    """diffusers' tiled decode of seeded latents through the folder's VAE."""
    vae = AutoencoderKLWan.from_pretrained(args.tiled_from).eval().float()
    size, stride = args.tile
    vae.enable_tiling(
        tile_sample_min_height=size,
        tile_sample_min_width=size,
        tile_sample_stride_height=stride,
        tile_sample_stride_width=stride,
    )
    cfg = vae.config
    height, width = (args.latent_size * 2)[:2]
    generator = torch.Generator().manual_seed(args.seed)
    latents = torch.randn(1, cfg.z_dim, args.frames[0], height, width, generator=generator)
    with torch.no_grad():
        latents_mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(latents.dtype)
        latents_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(latents.dtype)
        z = latents / latents_std + latents_mean
        video = vae.decode(z, return_dict=False)[0]
        vae.disable_tiling()
        whole = vae.decode(z, return_dict=False)[0]
    seams = (video - whole).abs().max().item()
    print(f"tiled {size}/{stride}: video {list(video.shape)}, max |tiled - untiled| {seams:.3e}")
    path = os.path.join(args.tiled_from, "tiled-reference.safetensors")
    save_file(
        {
            "latents": latents.contiguous(),
            "video": video.contiguous(),
            "tile": torch.tensor([size, stride], dtype=torch.float32),
        },
        path,
    )
    print(f"wrote {path}: {os.path.getsize(path)} bytes")


if __name__ == "__main__":
    main()
