"""Reference outputs of diffusers' DiTPipeline, for checking layerwise end to end.

What it does
    Loads a DiT pipeline folder (a real DiT-XL/2 checkpoint, or one written by
    ``layerwise synth``) with diffusers' own ``DiTTransformer2DModel``, ``AutoencoderKL``
    and ``DDIMScheduler`` classes, starts from the given latents instead of torch's noise,
    and runs the denoising loop of ``DiTPipeline.__call__`` (classifier-free guidance on
    the latent channels, learned sigma split off, DDIM step) in float32 on the CPU. It
    writes ``latents`` (final, before the VAE) and ``image`` (decoded, in [-1, 1]) to
    ``--out``.

How it is used
    ``engine/parity/dit_parity`` writes seeded latents, runs this script and
    ``layerwise generate --init-latents ... --save-latents ...`` on the same folder, and
    prints the largest differences. CI does not run it: it needs torch and diffusers.

Requirements: ``pip install torch diffusers safetensors numpy``.
"""

import argparse

import torch
from diffusers import AutoencoderKL, DDIMScheduler, DiTTransformer2DModel
from safetensors.torch import load_file, save_file


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="diffusers DiT pipeline folder")
    ap.add_argument("--latents", required=True, help="safetensors file with tensor `latents` [B, C, h, w]")
    ap.add_argument("--class-label", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--guidance", type=float, required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    torch.set_grad_enabled(False)
    transformer = DiTTransformer2DModel.from_pretrained(f"{a.model}/transformer", torch_dtype=torch.float32).eval()
    vae = AutoencoderKL.from_pretrained(f"{a.model}/vae", torch_dtype=torch.float32).eval()
    scheduler = DDIMScheduler.from_pretrained(f"{a.model}/scheduler")

    latents = load_file(a.latents)["latents"].float()
    batch = latents.shape[0]
    channels = transformer.config.in_channels
    guided = a.guidance > 1
    model_input = torch.cat([latents] * 2) if guided else latents
    labels = torch.tensor([a.class_label] * batch)
    labels_input = torch.cat([labels, torch.tensor([1000] * batch)]) if guided else labels

    scheduler.set_timesteps(a.steps)
    for t in scheduler.timesteps:
        if guided:
            half = model_input[: len(model_input) // 2]
            model_input = torch.cat([half, half], dim=0)
        model_input = scheduler.scale_model_input(model_input, t)
        timesteps = t[None].expand(model_input.shape[0])
        noise_pred = transformer(model_input, timestep=timesteps, class_labels=labels_input).sample
        if guided:
            eps, rest = noise_pred[:, :channels], noise_pred[:, channels:]
            cond_eps, uncond_eps = torch.split(eps, len(eps) // 2, dim=0)
            half_eps = uncond_eps + a.guidance * (cond_eps - uncond_eps)
            noise_pred = torch.cat([torch.cat([half_eps, half_eps], dim=0), rest], dim=1)
        if transformer.config.out_channels // 2 == channels:
            model_output, _ = torch.split(noise_pred, channels, dim=1)
        else:
            model_output = noise_pred
        model_input = scheduler.step(model_output, t, model_input).prev_sample

    final = model_input.chunk(2, dim=0)[0] if guided else model_input
    image = vae.decode(final / vae.config.scaling_factor).sample
    save_file({"latents": final.contiguous(), "image": image.contiguous()}, a.out)


if __name__ == "__main__":
    main()
