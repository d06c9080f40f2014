#!/usr/bin/env python3
"""Reference side of the Wan 2.1 / 2.2 text-to-video parity: diffusers' own WanPipeline.

Subcommands
  make OUT [--two-experts] [--seed S] [--dtype fp32|bf16] [--scheduler unipc|flow-euler]
      Builds a tiny random Wan pipeline (trained Unigram tokenizer, UMT5 text encoder, one or
      two WanTransformer3DModel experts, AutoencoderKLWan, scheduler) and saves it with
      `pipe.save_pretrained(OUT, safe_serialization=True)` in diffusers' WanPipeline layout.
  run MODEL --prompt P ... --latents IN --out OUT
      Runs WanPipeline.from_pretrained(MODEL) on the CPU in float32 from the given initial
      latents; saves the text embeddings, per-step and final latents and the decoded frames.
  fixture DIR
      Writes the committed tiny fixtures: DIR/wan-tiny (two experts), DIR/wan21-tiny (one), and
      for each a -reference.safetensors (`run` of FIXTURE_REQUEST) and a -reference.json.
  component {text,vae,scheduler,transformer} ...
      One component at a time, for piecewise debugging.

Every tensor file is safetensors. Nothing is downloaded: weights are random, seeded.
Run it with the Python that `engine/parity/venv` prints.
"""

import argparse
import json
import os
import shutil

# One thread for the tokenizers library (the Unigram trainer) and no fork warnings; the
# tokenizer's scores are re-estimated deterministically anyway (build_tokenizer).
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")

import numpy as np
import torch
from safetensors.torch import load_file, save_file

# The request the tiny fixture is built for: WanPipeline's default max_sequence_length is 512;
# the tiny fixture uses 16 (passed as the call argument).
DEFAULT_MAX_SEQUENCE_LENGTH = 16
BOUNDARY_RATIO = 0.875  # Wan 2.2 A14B: transformer for t >= 875, transformer_2 below.

# --- the tiny configs ---------------------------------------------------------------------------

TRANSFORMER_CONFIG = dict(
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

TEXT_ENCODER_CONFIG = dict(
    d_model=32,
    d_kv=8,
    num_heads=4,
    d_ff=64,
    num_layers=2,
    feed_forward_proj="gated-gelu",
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    dropout_rate=0.0,
    layer_norm_epsilon=1e-6,
    pad_token_id=0,
    eos_token_id=1,
    decoder_start_token_id=0,
)

VAE_CONFIG = dict(
    base_dim=3,
    z_dim=16,
    dim_mult=[1, 1, 1, 1],
    num_res_blocks=1,
    temperal_downsample=[False, True, True],
)

# The decoder's last conv is scaled by this after the random init, so the decoded frames span
# much of [-1, 1] (and the pipeline's clamp is exercised a little) instead of a flat grey.
VAE_OUT_GAIN = 6.0

# As the published Wan 2.1 / 2.2 T2V diffusers folders configure UniPC (flow_shift 3.0).
UNIPC_CONFIG = dict(
    num_train_timesteps=1000,
    prediction_type="flow_prediction",
    use_flow_sigmas=True,
    flow_shift=3.0,
    solver_order=2,
    solver_type="bh2",
    predict_x0=True,
    lower_order_final=True,
    final_sigmas_type="zero",
    timestep_spacing="linspace",
)

TOKENIZER_VOCAB_SIZE = 256

# A small English corpus for the tokenizer: prompt-like sentences about scenes and motion.
CORPUS = """
A cat and a dog baking a cake together in a kitchen.
The cat is carefully measuring flour, while the dog is stirring the batter with a wooden spoon.
The kitchen is cozy, with sunlight streaming through the window.
A red fox runs through a snowy forest at dawn.
An astronaut rides a horse across the surface of the moon.
Waves crash against the rocky shore under a stormy sky.
A small boat sails slowly across a calm blue lake surrounded by mountains.
A busy city street at night, with neon lights reflecting on the wet road.
A young woman walks along the beach, her hair blowing in the wind.
Two children play with a kite in a green field on a sunny afternoon.
A hummingbird hovers near a bright red flower, its wings a blur.
Close-up of a steaming cup of coffee on a wooden table.
A train moves through the countryside past fields of yellow flowers.
Fireworks explode over the river, lighting up the night sky in many colors.
An old man reads a newspaper on a park bench while pigeons gather around him.
A drone shot of a waterfall cascading into a deep green pool.
A robot walks slowly through an abandoned factory filled with dust and light.
Snow falls gently on a quiet village with warm lights in the windows.
A chef slices vegetables quickly on a cutting board.
A panda eats bamboo in a misty forest.
The camera pans across a desert with tall sand dunes under a clear sky.
A golden retriever jumps into a swimming pool and splashes water everywhere.
Leaves fall from the trees in an autumn park, slow motion.
A butterfly lands on a leaf covered in morning dew.
A musician plays the violin on a stage under soft blue light.
Clouds drift over the peaks of snowy mountains in a time lapse.
A horse gallops across a wide open plain at sunset.
Rain drops run down a window while a city blurs in the background.
A little girl blows out the candles on her birthday cake and everyone claps.
Bright tones, overexposed, static, blurred details, subtitles, style, works, paintings, images.
Overall gray, worst quality, low quality, JPEG compression residue, ugly, incomplete.
Extra fingers, poorly drawn hands, poorly drawn faces, deformed, disfigured.
Misshapen limbs, fused fingers, still picture, messy background, three legs.
Many people in the background, walking backwards, blurry, low resolution, noisy, distorted.
High quality, cinematic lighting, detailed, sharp focus, smooth motion, realistic colors.
""".strip().splitlines()


# --- helpers ----------------------------------------------------------------------------------------


def versions():
    import diffusers
    import tokenizers
    import transformers

    return {
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }


def perturb(module, seed):
    """Adds seeded noise to every parameter (sorted by name) so that parts that are zero or one at
    init (biases, norms, scale_shift_table, relative attention biases) are non-trivial."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
            std = p.float().std().item() if p.numel() > 1 else 0.0
            amp = 0.5 * std if std > 1e-6 else 0.1
            p.add_((torch.randn(p.shape, generator=g, dtype=torch.float32) * amp).to(p.dtype))


class StepRecorder:
    """A pipeline's `callback_on_step_end` that keeps the latents after each step and the step's
    timestep; `tensors` gives what the parity tests read of them (and the scheduler's sigmas)."""

    def __init__(self):
        self.latents, self.timesteps = [], []

    def __call__(self, pipe, i, t, kw):
        self.latents.append(kw["latents"].detach().clone())
        self.timesteps.append(t.detach().clone())
        return kw

    def tensors(self, pipe):
        return {
            "step_latents": torch.stack(self.latents),  # latents after each step
            "latents": self.latents[-1],  # final latents, before the VAE
            "timesteps": torch.stack(self.timesteps),  # int64 for UniPC, float32 for flow-match Euler
            "sigmas": pipe.scheduler.sigmas.float().clone(),
        }


def t5_pre_tokenizer():
    from tokenizers import pre_tokenizers

    # What transformers' T5Tokenizer sets: split on whitespace, then "▁" before every word.
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
        ]
    )


def build_tokenizer():
    """A Unigram model like T5/UMT5's SentencePiece, trained on CORPUS, wrapped as transformers'
    T5Tokenizer: <pad>=0, </s>=1, <unk>=2, and a TemplateProcessing post-processor that appends </s>.

    The `tokenizers` UnigramTrainer chooses the pieces. Its scores are not reproducible from run to
    run (it iterates hash maps, so float sums and ties vary), while its piece set is; so the scores are
    then re-estimated deterministically: one hard-EM pass (Viterbi segmentation of the corpus with
    the `tokenizers` Unigram model, starting from substring counts), log relative frequency, rounded
    to 4 decimals, pieces ordered by score then text."""
    from collections import Counter

    from tokenizers import Tokenizer, models, trainers
    from transformers import T5Tokenizer

    special = ["<pad>", "</s>", "<unk>"]
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = t5_pre_tokenizer()
    trainer = trainers.UnigramTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=special,
        unk_token="<unk>",
        shrinking_factor=0.75,
        max_piece_length=16,
        n_sub_iterations=2,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    trained = json.loads(tok.to_str())["model"]["vocab"]
    assert [v[0] for v in trained[:3]] == special, trained[:3]
    pieces = sorted(p for p, _ in trained[3:])

    words = Counter(w for line in CORPUS for w in line.split())
    texts = {w: "▁" + w for w in words}

    def occurrences(text, piece):
        return sum(text.startswith(piece, i) for i in range(len(text)))

    def unigram(scores):
        vocab = [(t, 0.0) for t in special] + [(p, scores[p]) for p in pieces]
        t = Tokenizer(models.Unigram(vocab, unk_id=2, byte_fallback=False))
        t.pre_tokenizer = t5_pre_tokenizer()
        return t

    counts = {p: sum(f * occurrences(texts[w], p) for w, f in words.items()) for p in pieces}
    total = sum(counts.values()) + len(pieces)
    seg = unigram({p: float(np.log((counts[p] + 1) / total)) for p in pieces})
    usage = Counter()
    for w in sorted(words):
        for piece in seg.encode(w, add_special_tokens=False).tokens:
            usage[piece] += words[w]
    total = sum(usage[p] for p in pieces) + 0.5 * len(pieces)
    scores = {p: round(float(np.log((usage[p] + 0.5) / total)), 4) for p in pieces}
    vocab = [(t, 0.0) for t in special] + sorted(((p, scores[p]) for p in pieces), key=lambda ps: (-ps[1], ps[0]))
    # extra_ids=0: no <extra_id_N> sentinels (they only matter for span-corruption training).
    hf = T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=512)
    assert hf.pad_token_id == 0 and hf.eos_token_id == 1 and hf.unk_token_id == 2
    return hf


def make_scheduler(kind, flow_shift):
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    if kind == "unipc":
        return UniPCMultistepScheduler(**{**UNIPC_CONFIG, "flow_shift": flow_shift})
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=flow_shift)


def to_bf16_in_place(folder, cls):
    """Re-saves a component in bf16 the way diffusers/transformers load it with torch_dtype=bf16:
    the modules in the class's _keep_in_fp32_modules stay float32."""
    model = cls.from_pretrained(folder, dtype=torch.bfloat16)
    tmp = folder + ".bf16"
    model.save_pretrained(tmp, safe_serialization=True)
    shutil.rmtree(folder)
    os.rename(tmp, folder)
    cfg_path = os.path.join(folder, "config.json")
    cfg = json.load(open(cfg_path))
    if cfg.pop("_name_or_path", None) is not None:  # the temporary folder's path: not part of the model
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
            f.write("\n")


# --- make -------------------------------------------------------------------------------------------


def cmd_make(a):
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    seed = a.seed
    tokenizer = build_tokenizer()

    torch.manual_seed(seed + 1)
    te_cfg = UMT5Config(vocab_size=len(tokenizer), **TEXT_ENCODER_CONFIG)
    text_encoder = UMT5EncoderModel(te_cfg).eval()
    perturb(text_encoder, seed + 101)

    def expert(k):
        torch.manual_seed(seed + 10 + k)
        t = WanTransformer3DModel(**TRANSFORMER_CONFIG).eval()
        perturb(t, seed + 110 + k)
        return t

    transformer = expert(0)
    transformer_2 = expert(1) if a.two_experts else None

    torch.manual_seed(seed + 20)
    vae = AutoencoderKLWan(**VAE_CONFIG).eval()
    perturb(vae, seed + 120)
    with torch.no_grad():  # a random decoder's output is nearly flat grey: give the frames some contrast
        vae.decoder.conv_out.weight.mul_(VAE_OUT_GAIN)
        vae.decoder.conv_out.bias.mul_(VAE_OUT_GAIN)

    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=make_scheduler(a.scheduler, a.flow_shift),
        transformer=transformer,
        transformer_2=transformer_2,
        boundary_ratio=a.boundary_ratio if a.two_experts else None,
    )
    if os.path.exists(a.out):
        shutil.rmtree(a.out)
    pipe.save_pretrained(a.out, safe_serialization=True)
    if a.dtype == "bf16":
        to_bf16_in_place(os.path.join(a.out, "text_encoder"), UMT5EncoderModel)
        for sub in ["transformer", "transformer_2"] if a.two_experts else ["transformer"]:
            to_bf16_in_place(os.path.join(a.out, sub), WanTransformer3DModel)
    for root, _, files in os.walk(a.out):  # safetensors writes 0600; these are plain data files
        for f in files:
            os.chmod(os.path.join(root, f), 0o644)
    print(a.out)


# --- run --------------------------------------------------------------------------------------------


def load_pipe(model, dtype="float32"):
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(model, dtype=getattr(torch, dtype))
    pipe.to("cpu")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tokenize(pipe, prompt, max_sequence_length):
    """Exactly the tokenizer call of WanPipeline._get_t5_prompt_embeds."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    return pipe.tokenizer(
        [prompt_clean(prompt)],
        padding="max_length",
        max_length=max_sequence_length,
        truncation=True,
        add_special_tokens=True,
        return_attention_mask=True,
        return_tensors="pt",
    )


def reference(pipe, prompt, negative_prompt, frames, height, width, steps, guidance, guidance_2,
              max_sequence_length, init):
    """WanPipeline.__call__ from the given initial latents; returns the tensors `run` saves."""
    m = max_sequence_length
    inputs = tokenize(pipe, prompt, m)
    out = {"input_ids": inputs.input_ids, "attention_mask": inputs.attention_mask}
    cfg = guidance > 1.0
    if cfg:
        neg = tokenize(pipe, negative_prompt or "", m)
        out["negative_input_ids"] = neg.input_ids
        out["negative_attention_mask"] = neg.attention_mask
    with torch.no_grad():
        pe, ne = pipe.encode_prompt(
            prompt=prompt,
            negative_prompt=negative_prompt,
            do_classifier_free_guidance=cfg,
            max_sequence_length=m,
            device=torch.device("cpu"),
        )
    out["prompt_embeds"] = pe
    if ne is not None:
        out["negative_prompt_embeds"] = ne

    record, experts = StepRecorder(), []
    boundary = pipe.config.boundary_ratio
    boundary_t = None if boundary is None else boundary * pipe.scheduler.config.num_train_timesteps

    def on_step_end(p, i, t, kw):
        experts.append(0 if boundary_t is None or t >= boundary_t else 1)
        return record(p, i, t, kw)

    result = pipe(
        prompt=prompt,
        negative_prompt=negative_prompt,
        height=height,
        width=width,
        num_frames=frames,
        num_inference_steps=steps,
        guidance_scale=guidance,
        guidance_scale_2=guidance_2,
        latents=init.clone(),
        output_type="np",
        callback_on_step_end=on_step_end,
        callback_on_step_end_tensor_inputs=["latents"],
        max_sequence_length=m,
    )
    out["init_latents"] = init
    out.update(record.tensors(pipe))
    out["frames"] = torch.from_numpy(np.ascontiguousarray(result.frames[0])).float()  # [F, H, W, 3] in [0,1]
    out["experts"] = torch.tensor(experts, dtype=torch.int64)  # 0: transformer, 1: transformer_2
    return {k: v.contiguous() for k, v in out.items()}


def cmd_run(a):
    pipe = load_pipe(a.model, a.torch_dtype)
    init = load_file(a.latents)["latents"].float()
    out = reference(pipe, a.prompt, a.negative_prompt, a.frames, a.height, a.width, a.steps, a.guidance,
                    a.guidance_2, a.max_sequence_length, init)
    save_file(out, a.out)
    print(
        f"timesteps {out['timesteps'].tolist()} experts {out['experts'].tolist()} "
        f"frames {tuple(out['frames'].shape)} latents {tuple(out['latents'].shape)} "
        f"seq_len {int(out['attention_mask'].sum())}"
    )


# --- fixture ----------------------------------------------------------------------------------------

# The request the committed fixtures hold (engine/tests/fixtures). 9 frames (4k+1: 3 latent frames,
# so the VAE's causal cache and both temporal upsamples run), 32x48 (a 2x3 patch grid: H != W),
# 4 steps whose timesteps are 999, 900 (>= 875: transformer) and 750, 500 (transformer_2).
FIXTURE_REQUEST = dict(
    prompt="A fox in the snow.",
    negative_prompt="blurry, low quality, static",
    frames=9,
    height=32,
    width=48,
    steps=4,
    guidance=5.0,
    guidance_2=3.0,
    max_sequence_length=16,
)


def cmd_fixture(a):
    """Writes DIR/wan-tiny (two experts) and DIR/wan21-tiny (one), each with a -reference.safetensors
    of `run` for FIXTURE_REQUEST and a -reference.json describing it. Both folders come from the same
    seed, so their shared components are byte-identical."""
    for name, two in [("wan-tiny", True), ("wan21-tiny", False)]:
        model = os.path.join(a.dir, name)
        cmd_make(argparse.Namespace(out=model, two_experts=two, boundary_ratio=BOUNDARY_RATIO, seed=a.seed,
                                    dtype="fp32", scheduler="unipc", flow_shift=3.0))
        req = dict(FIXTURE_REQUEST)
        if not two:
            req["guidance_2"] = None
        g = torch.Generator().manual_seed(a.latents_seed)
        shape = (1, 16, (req["frames"] - 1) // 4 + 1, req["height"] // 8, req["width"] // 8)
        init = torch.randn(shape, generator=g)
        pipe = load_pipe(model)
        out = reference(pipe, init=init, **req)
        save_file(out, os.path.join(a.dir, f"{name}-reference.safetensors"))
        desc = {
            "model": name,
            **req,
            "boundary_ratio": BOUNDARY_RATIO if two else None,
            "seed": 0,
            "model_seed": a.seed,
            "latents_seed": a.latents_seed,
            "latents_shape": list(shape),
            "latents_draw": "torch.randn(latents_shape, generator=torch.Generator().manual_seed(latents_seed))",
            "scheduler": "UniPCMultistepScheduler flow_prediction, use_flow_sigmas, flow_shift 3.0",
            "timesteps": out["timesteps"].tolist(),
            "experts": out["experts"].tolist(),
            "dtype": "float32",
            "keys": {
                "init_latents": "[1,16,T,h,w] the initial latents passed to WanPipeline(latents=...)",
                "input_ids": "[1,M] tokenizer ids of prompt_clean(prompt), padded to max_sequence_length",
                "attention_mask": "[1,M]",
                "negative_input_ids": "[1,M]",
                "negative_attention_mask": "[1,M]",
                "prompt_embeds": "[1,M,32] encode_prompt: encoder output, rows past seq_len zeroed",
                "negative_prompt_embeds": "[1,M,32]",
                "step_latents": "[S,1,16,T,h,w] latents after each scheduler step",
                "latents": "[1,16,T,h,w] final latents, before the VAE (= step_latents[-1])",
                "frames": "[F,H,W,3] float32 in [0,1], output_type='np'",
                "timesteps": "[S] int64",
                "sigmas": "[S+1] float32 scheduler sigmas",
                "experts": "[S] int64: 0 transformer, 1 transformer_2",
            },
            "versions": versions(),
        }
        with open(os.path.join(a.dir, f"{name}-reference.json"), "w") as f:
            json.dump(desc, f, indent=2)
            f.write("\n")
        print(f"{name}: timesteps {desc['timesteps']} experts {desc['experts']}")


# --- components -------------------------------------------------------------------------------------


def cmd_text(a):
    pipe = load_pipe(a.model, a.torch_dtype)
    inputs = tokenize(pipe, a.prompt, a.max_sequence_length)
    with torch.no_grad():
        hidden = pipe.text_encoder(inputs.input_ids, inputs.attention_mask).last_hidden_state.float()
        embeds = pipe._get_t5_prompt_embeds(a.prompt, max_sequence_length=a.max_sequence_length)
    save_file(
        {
            "input_ids": inputs.input_ids.contiguous(),
            "attention_mask": inputs.attention_mask.contiguous(),
            "last_hidden_state": hidden.contiguous(),  # the raw encoder output, padding rows included
            "prompt_embeds": embeds.float().contiguous(),  # rows past seq_len zeroed, as the pipeline does
        },
        a.out,
    )
    print(f"ids {inputs.input_ids.tolist()} seq_len {int(inputs.attention_mask.sum())}")


def cmd_vae(a):
    pipe = load_pipe(a.model, a.torch_dtype)
    vae = pipe.vae
    latents = load_file(a.latents)["latents"].to(vae.dtype)
    with torch.no_grad():
        # The exact lines of WanPipeline.__call__ after the denoising loop.
        latents_mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(latents.dtype)
        latents_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(latents.dtype)
        z = latents / latents_std + latents_mean
        video = vae.decode(z, return_dict=False)[0]
        frames = pipe.video_processor.postprocess_video(video, output_type="np")
    save_file(
        {
            "latents": latents.float().contiguous(),
            "denormalized": z.float().contiguous(),  # what vae.decode receives
            "video": video.float().contiguous(),  # [B, 3, F, H, W], clamped to [-1, 1]
            "frames": torch.from_numpy(np.ascontiguousarray(frames[0])).float(),  # [F, H, W, 3] in [0, 1]
        },
        a.out,
    )
    print(f"video {tuple(video.shape)}")


def cmd_scheduler(a):
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    cfg_path = os.path.join(a.model, "scheduler", "scheduler_config.json")
    cls_name = json.load(open(cfg_path))["_class_name"]
    cls = {"UniPCMultistepScheduler": UniPCMultistepScheduler, "FlowMatchEulerDiscreteScheduler": FlowMatchEulerDiscreteScheduler}[cls_name]
    sched = cls.from_pretrained(a.model, subfolder="scheduler")
    sched.set_timesteps(a.steps, device="cpu")
    sched.set_begin_index(0)  # as WanPipeline does
    shape = tuple(int(x) for x in a.shape.split(","))
    g = torch.Generator().manual_seed(a.seed)
    sample = torch.randn(shape, generator=g)
    sample_in = sample.clone()
    outs, samples = [], []
    for t in sched.timesteps:
        mo = torch.randn(shape, generator=g)
        sample = sched.step(mo, t, sample, return_dict=False)[0]
        outs.append(mo)
        samples.append(sample.clone())
    save_file(
        {
            "timesteps": sched.timesteps.clone().contiguous(),
            "sigmas": sched.sigmas.float().clone().contiguous(),
            "sample_in": sample_in.contiguous(),
            "model_outputs": torch.stack(outs).contiguous(),
            "samples": torch.stack(samples).contiguous(),  # samples[i]: after step i
        },
        a.out,
    )
    print(f"{cls_name} timesteps {sched.timesteps.tolist()} sigmas {[round(float(s), 6) for s in sched.sigmas]}")


def cmd_transformer(a):
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel.from_pretrained(a.model, subfolder=a.subfolder, dtype=getattr(torch, a.torch_dtype))
    model.eval()
    latents = load_file(a.latents)["latents"].to(model.dtype)
    embeds = load_file(a.prompt_embeds)[a.embeds_key].to(model.dtype)
    t = float(a.timestep)
    timestep = torch.tensor([int(t)] if t.is_integer() else [t]).expand(latents.shape[0])
    with torch.no_grad():
        out = model(hidden_states=latents, timestep=timestep, encoder_hidden_states=embeds, return_dict=False)[0]
    save_file({"noise_pred": out.float().contiguous(), "timestep": timestep.contiguous()}, a.out)
    print(f"noise_pred {tuple(out.shape)} max|.| {out.abs().max():.4g}")


# --- cli --------------------------------------------------------------------------------------------


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    m = sub.add_parser("make", help="build and save a tiny random Wan pipeline")
    m.add_argument("out")
    m.add_argument("--two-experts", action="store_true", help="Wan 2.2 A14B style: transformer_2 + boundary_ratio")
    m.add_argument("--boundary-ratio", type=float, default=BOUNDARY_RATIO)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: transformer(s) and text encoder in bf16, _keep_in_fp32_modules in fp32")
    m.add_argument("--scheduler", choices=["unipc", "flow-euler"], default="unipc")
    m.add_argument("--flow-shift", type=float, default=3.0)
    m.set_defaults(fn=cmd_make)

    def common(sp):
        sp.add_argument("model")
        sp.add_argument("--torch-dtype", default="float32", help="dtype for from_pretrained (default float32)")

    r = sub.add_parser("run", help="run diffusers' WanPipeline from given latents")
    common(r)
    r.add_argument("--prompt", required=True)
    r.add_argument("--negative-prompt", default=None)
    r.add_argument("--frames", type=int, required=True)
    r.add_argument("--height", type=int, required=True)
    r.add_argument("--width", type=int, required=True)
    r.add_argument("--steps", type=int, required=True)
    r.add_argument("--guidance", type=float, required=True)
    r.add_argument("--guidance-2", type=float, default=None)
    r.add_argument("--max-sequence-length", type=int, default=DEFAULT_MAX_SEQUENCE_LENGTH)
    r.add_argument("--latents", required=True, help="safetensors with `latents` [1,16,(F-1)/4+1,H/8,W/8]")
    r.add_argument("--out", required=True)
    r.set_defaults(fn=cmd_run)

    fx = sub.add_parser("fixture", help="write the committed tiny fixtures and their references")
    fx.add_argument("dir", help="e.g. engine/tests/fixtures")
    fx.add_argument("--seed", type=int, default=0)
    fx.add_argument("--latents-seed", type=int, default=0)
    fx.set_defaults(fn=cmd_fixture)

    c = sub.add_parser("component", help="one component at a time")
    csub = c.add_subparsers(dest="component", required=True)
    t = csub.add_parser("text")
    common(t)
    t.add_argument("--prompt", required=True)
    t.add_argument("--max-sequence-length", type=int, default=DEFAULT_MAX_SEQUENCE_LENGTH)
    t.add_argument("--out", required=True)
    t.set_defaults(fn=cmd_text)
    v = csub.add_parser("vae")
    common(v)
    v.add_argument("--latents", required=True, help="safetensors with normalized `latents` (what the loop ends with)")
    v.add_argument("--out", required=True)
    v.set_defaults(fn=cmd_vae)
    s = csub.add_parser("scheduler")
    s.add_argument("model")
    s.add_argument("--steps", type=int, required=True)
    s.add_argument("--shape", default="1,16,2,4,4")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", required=True)
    s.set_defaults(fn=cmd_scheduler)
    x = csub.add_parser("transformer")
    common(x)
    x.add_argument("--subfolder", default="transformer", help="transformer or transformer_2")
    x.add_argument("--latents", required=True)
    x.add_argument("--timestep", required=True)
    x.add_argument("--prompt-embeds", required=True)
    x.add_argument("--embeds-key", default="prompt_embeds")
    x.add_argument("--out", required=True)
    x.set_defaults(fn=cmd_transformer)

    a = p.parse_args(argv)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    a.fn(a)


if __name__ == "__main__":
    main()
