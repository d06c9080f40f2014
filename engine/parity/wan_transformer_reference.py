"""Reference forward of diffusers' WanTransformer3DModel, for checking layerwise's Wan transformer.

What it does
    1. Builds a tiny ``WanTransformer3DModel`` (the config of ``WanTransformerConfig::tiny()``)
       with seeded weights, then adds seeded noise to *every* parameter (norm scales,
       the modulation tables, biases), so that a Rust forward that ignored or misplaced
       any of them would miss the reference.
    2. ``save_pretrained``s it (safetensors) into ``--out``: ``config.json`` and
       ``diffusion_pytorch_model.safetensors``, as a diffusers checkpoint's
       ``transformer/`` folder looks.
    3. Runs one forward in float32 the way WanPipeline calls it under guidance: a batch
       of 2 latents [2, 16, F, H, W], one timestep for the batch, text embeddings
       [2, S, text_dim] whose tails are zero (the pipeline pads prompts with zeros), and
       writes ``reference.safetensors`` with ``latents``, ``timestep`` [1], ``text`` and
       diffusers' output ``sample`` [2, 16, F, H, W].

    The latent grid (2 frames × 3 × 4 patches by default) differs on every axis, so a
    swapped axis in the rotary embedding or the unpatchify shows.

How it is used
    ``engine/tests/wan_transformer_parity.rs`` loads the folder with the crate's checkpoint
    reader, runs prologue, every block and the epilogue, and compares with ``sample``.
    CI does not run this script; it needs torch and diffusers, which the engine does not.

How the committed fixture was made
    $(engine/parity/venv | tail -n 1) engine/parity/wan_transformer_reference.py \\
        --out engine/tests/fixtures/wan-transformer-tiny

    (``engine/parity/venv`` makes the pinned venv: diffusers 0.42.1, torch 2.15.0; any
    ``$PYTHON`` with those works too.) It also prints how far the float32 output is from
    the same forward in float64: the floor below which no f32 implementation can agree.
"""

import argparse
import copy
import json
import os

import torch
from safetensors.torch import save_file

# Mirrors WanTransformerConfig::tiny() (and wan_reference.py's TRANSFORMER_CONFIG).
TINY = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=12,
    in_channels=16,
    out_channels=16,
    text_dim=32,
    freq_dim=256,
    ffn_dim=32,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=32,
)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder to write (created)")
    parser.add_argument("--frames", type=int, default=2, help="latent frames F")
    parser.add_argument("--height", type=int, default=6, help="latent height H")
    parser.add_argument("--width", type=int, default=8, help="latent width W")
    parser.add_argument("--text-tokens", type=int, default=12)
    parser.add_argument("--timestep", type=float, default=873.25)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from diffusers import WanTransformer3DModel

    torch.manual_seed(args.seed)
    model = WanTransformer3DModel(**TINY).eval().float()
    g = torch.Generator().manual_seed(args.seed + 100)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(0.1 * torch.randn(p.shape, generator=g))

    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    cfg_path = os.path.join(args.out, "config.json")
    cfg = json.load(open(cfg_path))
    if cfg.pop("_name_or_path", None) is not None:
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
            f.write("\n")

    g = torch.Generator().manual_seed(args.seed + 1)
    shape = (2, TINY["in_channels"], args.frames, args.height, args.width)
    latents = torch.randn(shape, generator=g)
    text = torch.randn(2, args.text_tokens, TINY["text_dim"], generator=g)
    # The conditional prompt fills 8 tokens, the negative one 5; the rest is padding.
    text[0, 8:] = 0
    text[1, 5:] = 0
    timestep = torch.tensor([args.timestep], dtype=torch.float32)

    def forward(m, dtype):
        with torch.no_grad():
            return m(
                hidden_states=latents.to(dtype),
                timestep=timestep.expand(2),
                encoder_hidden_states=text.to(dtype),
                return_dict=False,
            )[0]

    sample = forward(model, torch.float32)
    exact = forward(copy.deepcopy(model).double(), torch.float64)
    floor = (sample.double() - exact).abs().max() / exact.abs().max()

    save_file(
        {
            "latents": latents.contiguous(),
            "timestep": timestep.contiguous(),
            "text": text.contiguous(),
            "sample": sample.contiguous(),
        },
        os.path.join(args.out, "reference.safetensors"),
    )
    total = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
    print(
        f"wrote {args.out}: latents {list(latents.shape)}, text {list(text.shape)}, t {args.timestep} "
        f"-> sample {list(sample.shape)}, max |sample| {sample.abs().max():.4g}, "
        f"f32 vs f64 max |diff| / max |ref| {floor:.3g}, {total} bytes"
    )


if __name__ == "__main__":
    main()
