"""Reference forwards of diffusers' QwenImageTransformer2DModel, for checking layerwise's Qwen-Image transformer.

What it does
    1. Builds a tiny ``QwenImageTransformer2DModel`` (the config of
       ``QwenImageTransformerConfig::tiny()``) with seeded weights, then adds seeded noise
       to *every* parameter (the per-head q/k norm scales, the text norm, biases), so that
       a Rust forward that ignored or misplaced any of them would miss the reference.
    2. ``save_pretrained``s it (safetensors) into ``--out``: ``config.json`` and
       ``diffusion_pytorch_model.safetensors``, as a diffusers checkpoint's
       ``transformer/`` folder looks.
    3. Runs one float32 forward per case the way QwenImagePipeline calls it: packed
       latents [1, F·H·W, in_channels], ``timestep`` t / 1000, prompt embeddings
       [1, M, joint_attention_dim] without padding (so ``encoder_hidden_states_mask=None``,
       as the pipeline passes for an unpadded prompt) and ``img_shapes=[[(F, H, W)]]``.
       Writes ``reference.safetensors`` with ``{case}.latents``, ``{case}.timestep`` [1],
       ``{case}.text`` and diffusers' output ``{case}.sample`` [1, F·H·W, 4·out_channels],
       and ``reference.json`` naming each case's grid, text length and timestep.

    The cases: a non-square 1 × 4 × 6 grid (rows and columns centre differently), an odd
    1 × 5 × 3 grid (the centred positions are asymmetric: -3..1 and -2..0) and a 2-frame
    2 × 3 × 2 grid; every text length differs from its image length, so a swapped axis, a
    text offset off by one or a swapped stream shows.

How it is used
    ``engine/tests/qwen_image_transformer_parity.rs`` loads the folder with the crate's
    checkpoint reader, runs prologue, every block and the epilogue for each case, and
    compares with ``sample``. CI does not run this script; it needs torch and diffusers,
    which the engine does not.

How the committed fixture was made
    $(engine/parity/venv | tail -n 1) engine/parity/qwen_image_transformer_reference.py \\
        --out engine/tests/fixtures/qwen-image-transformer-tiny

    (``engine/parity/venv`` makes the pinned venv: diffusers 0.42.1, torch 2.15.0.) It
    also prints how far each float32 output is from the same forward in float64: the floor
    below which no f32 implementation can agree.
"""

import argparse
import copy
import json
import os

import torch
from safetensors.torch import save_file

# Mirrors QwenImageTransformerConfig::tiny().
TINY = dict(
    patch_size=2,
    in_channels=16,
    out_channels=4,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=24,
    guidance_embeds=False,
    axes_dims_rope=(4, 6, 6),
)

# (name, (frames, rows, columns) of the patch grid, prompt tokens, timestep as passed: t / 1000)
CASES = [
    ("wide", (1, 4, 6), 7, 0.87325),
    ("odd", (1, 5, 3), 11, 0.3125),
    ("frames", (2, 3, 2), 5, 0.0415),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder to write (created)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(args.seed)
    model = QwenImageTransformer2DModel(**TINY).eval().float()
    g = torch.Generator().manual_seed(args.seed + 100)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    exact_model = copy.deepcopy(model).double()

    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    cfg_path = os.path.join(args.out, "config.json")
    cfg = json.load(open(cfg_path))
    if cfg.pop("_name_or_path", None) is not None:
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
            f.write("\n")

    g = torch.Generator().manual_seed(args.seed + 1)
    tensors, cases = {}, []
    for name, grid, text_tokens, t in CASES:
        tokens = grid[0] * grid[1] * grid[2]
        latents = torch.randn(1, tokens, TINY["in_channels"], generator=g)
        text = torch.randn(1, text_tokens, TINY["joint_attention_dim"], generator=g)
        timestep = torch.tensor([t], dtype=torch.float32)

        def forward(m, dtype):
            with torch.no_grad():
                return m(
                    hidden_states=latents.to(dtype),
                    encoder_hidden_states=text.to(dtype),
                    encoder_hidden_states_mask=None,
                    timestep=timestep.to(dtype),
                    img_shapes=[[grid]],
                    return_dict=False,
                )[0]

        sample = forward(model, torch.float32)
        exact = forward(exact_model, torch.float64)
        floor = float((sample.double() - exact).abs().max() / exact.abs().max())
        tensors.update(
            {
                f"{name}.latents": latents.contiguous(),
                f"{name}.timestep": timestep.contiguous(),
                f"{name}.text": text.contiguous(),
                f"{name}.sample": sample.contiguous(),
            }
        )
        cases.append(
            {"name": name, "grid": list(grid), "text_tokens": text_tokens, "timestep": t, "f64_floor": floor}
        )
        print(
            f"{name}: grid {grid}, text {text_tokens} -> sample {list(sample.shape)}, "
            f"max |sample| {sample.abs().max():.4g}, f32 vs f64 max |diff| / max |ref| {floor:.3g}"
        )

    save_file(tensors, os.path.join(args.out, "reference.safetensors"))
    with open(os.path.join(args.out, "reference.json"), "w") as f:
        json.dump({"cases": cases}, f, indent=2)
        f.write("\n")
    total = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
    print(f"wrote {args.out}: {total} bytes")


if __name__ == "__main__":
    main()
