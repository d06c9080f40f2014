"""References for the flow-matching samplers (`engine/src/samplers/flow/`): diffusers'
UniPCMultistepScheduler and FlowMatchEulerDiscreteScheduler stepped over whole schedules with
seeded random model outputs, as WanPipeline drives them (`set_timesteps(steps)`,
`set_begin_index(0)`, one `step()` per timestep).

    $(engine/parity/venv | tail -n 1) engine/parity/flow_samplers_reference.py engine/tests/fixtures/flow-samplers

writes, per case, `CASE/scheduler_config.json` (diffusers' own `save_config`) and
`CASE/reference.safetensors`; the inputs shared by every case go to `inputs.safetensors`:

- inputs: `steps{S}.sample` [1,16,2,4,4] (the initial sample) and `steps{S}.model_outputs`
  [S,1,16,2,4,4] (the model output fed at each step), float32, seeded per S;
- reference: `steps{S}.timesteps` [S] (what the pipeline passes to the transformer, as
  float32; UniPC's are int64 in diffusers, all integers), `steps{S}.sigmas` [S+1] float32, and
  `steps{S}.samples` [S,1,16,2,4,4] (the sample after each step).
"""

import json
import os
import sys

import diffusers
import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler
from safetensors.torch import save_file

SHAPE = (1, 16, 2, 4, 4)
STEPS = (1, 2, 4, 10)

# The published Wan 2.1 / 2.2 text-to-video folders' UniPC (480p: flow_shift 3.0, 720p: 5.0).
WAN_UNIPC = dict(
    num_train_timesteps=1000,
    prediction_type="flow_prediction",
    use_flow_sigmas=True,
    flow_shift=3.0,
    solver_order=2,
    solver_type="bh2",
    predict_x0=True,
    lower_order_final=True,
    disable_corrector=[],
    final_sigmas_type="zero",
    timestep_spacing="linspace",
)

# name: (class, config, step counts). The last two leave the published configs to exercise the
# general paths: third order (a 2x2 predictor and 3x3 corrector solve), bh1 (whose last step
# to sigma 0 is inf * 0 in diffusers, hence sigma_min), a disabled corrector, a terminal shift,
# an inverted Euler schedule. A terminal shift with one step is 0/0 in diffusers, so those
# cases start at two steps.
CASES = {
    "unipc-shift3": (UniPCMultistepScheduler, WAN_UNIPC, STEPS),
    "unipc-shift5": (UniPCMultistepScheduler, {**WAN_UNIPC, "flow_shift": 5.0}, STEPS),
    "euler-shift3": (FlowMatchEulerDiscreteScheduler, dict(num_train_timesteps=1000, shift=3.0), STEPS),
    "unipc-order3": (
        UniPCMultistepScheduler,
        {**WAN_UNIPC, "flow_shift": 5.0, "solver_order": 3, "solver_type": "bh1",
         "disable_corrector": [1], "shift_terminal": 0.05, "final_sigmas_type": "sigma_min"},
        STEPS[1:],
    ),
    "euler-terminal-inverted": (
        FlowMatchEulerDiscreteScheduler,
        dict(num_train_timesteps=1000, shift=5.0, shift_terminal=0.1, invert_sigmas=True),
        STEPS[1:],
    ),
}


def inputs(steps):
    g = torch.Generator().manual_seed(1000 + steps)
    sample = torch.randn(SHAPE, generator=g, dtype=torch.float32)
    outs = torch.randn((steps,) + SHAPE, generator=g, dtype=torch.float32)
    return sample, outs


def run(cls, folder, steps, sample, outs):
    sched = cls.from_pretrained(folder)  # what the engine reads, read back
    sched.set_timesteps(steps)
    sched.set_begin_index(0)
    samples = []
    for i, t in enumerate(sched.timesteps):
        sample = sched.step(outs[i], t, sample, return_dict=False)[0]
        samples.append(sample)
    return {
        f"steps{steps}.timesteps": sched.timesteps.to(torch.float32).contiguous(),
        f"steps{steps}.sigmas": sched.sigmas.to(torch.float32).contiguous(),
        f"steps{steps}.samples": torch.stack(samples).contiguous(),
    }


def main(out):
    os.makedirs(out, exist_ok=True)
    shared = {}
    for steps in STEPS:
        sample, outs = inputs(steps)
        shared[f"steps{steps}.sample"] = sample
        shared[f"steps{steps}.model_outputs"] = outs
    save_file(shared, os.path.join(out, "inputs.safetensors"))
    for name, (cls, config, step_counts) in CASES.items():
        folder = os.path.join(out, name)
        cls(**config).save_config(folder)
        ref = {}
        for steps in step_counts:
            ref.update(run(cls, folder, steps, shared[f"steps{steps}.sample"], shared[f"steps{steps}.model_outputs"]))
            assert torch.isfinite(ref[f"steps{steps}.samples"]).all(), (name, steps)
        save_file(ref, os.path.join(folder, "reference.safetensors"),
                  metadata={"diffusers": diffusers.__version__, "torch": torch.__version__,
                            "numpy": np.__version__, "steps": json.dumps(list(step_counts)),
                            # torch's float32 expm1 rounds differently with and without AVX.
                            "cpu_capability": torch.backends.cpu.get_cpu_capability()})
        print(name, [(s, ref[f"steps{s}.timesteps"].tolist()) for s in step_counts[:3]])


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
