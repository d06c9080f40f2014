"""What the step caches' reference scripts share: diffusers' hooks applied from the setting the
engine reads (`{"kind": ..., parameters}`), and a recorder of which transformer calls really ran
their blocks and of MagCache's calibrated ratios."""

import torch


def flux_ratios():
    from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS

    return [float(x) for x in FLUX_MAG_RATIOS]


def by_name():
    """Makes the hooks look a block's streams up through the block registry's argument names.

    diffusers 0.42.1's First-Block Cache and MagCache hooks ask for `hidden_states` and
    `encoder_hidden_states` by those literal names; a block whose forward names them otherwise
    (Cosmos3's `gen_seq` and `und_seq`, which the registry records as
    `hidden_states_argument_name` and `encoder_hidden_states_argument_name`) makes them fail.
    This is the one change to diffusers a reference makes, and only where the names differ."""
    from diffusers.hooks._helpers import TransformerBlockMetadata

    lookup = TransformerBlockMetadata._get_parameter_from_args_kwargs

    def named(self, identifier, args=(), kwargs=None):
        names = {"hidden_states": self.hidden_states_argument_name,
                 "encoder_hidden_states": self.encoder_hidden_states_argument_name}
        return lookup(self, names.get(identifier, identifier), args, kwargs)

    TransformerBlockMetadata._get_parameter_from_args_kwargs = named


def apply(transformer, c, steps):
    """Applies the cache setting `c` to `transformer` through diffusers' own hook (TaylorSeer in
    lite mode with float32 factors, as the engine keeps them)."""
    from diffusers import SeaCacheConfig
    from diffusers.hooks import (
        FirstBlockCacheConfig,
        MagCacheConfig,
        TaylorSeerCacheConfig,
        apply_first_block_cache,
        apply_mag_cache,
        apply_taylorseer_cache,
    )

    if c["kind"] == "sea":
        keys = ("threshold", "residual_order", "retention_steps", "cache_end_steps",
                "max_consecutive_cached", "power_exp")
        transformer.enable_cache(SeaCacheConfig(**{k: c[k] for k in keys if k in c}))
    elif c["kind"] == "first_block":
        apply_first_block_cache(transformer, FirstBlockCacheConfig(threshold=c["threshold"]))
    elif c["kind"] == "mag":
        apply_mag_cache(
            transformer,
            MagCacheConfig(
                threshold=c.get("threshold", 0.06),
                mag_ratios=c.get("ratios"),
                calibrate=c.get("calibrate", False),
                num_inference_steps=steps,
            ),
        )
    elif c["kind"] == "taylorseer":
        apply_taylorseer_cache(
            transformer,
            TaylorSeerCacheConfig(
                cache_interval=c["cache_interval"],
                disable_cache_before_step=c["disable_cache_before_step"],
                disable_cache_after_step=c.get("disable_cache_after_step"),
                max_order=c["max_order"],
                taylor_factors_dtype=torch.float32,
                use_lite_mode=True,
            ),
        )
    else:
        raise ValueError(f"unknown cache kind {c['kind']!r}")


class Recorder:
    """Counts the transformer's calls and which of them ran `marker` (a module that runs only
    when the blocks are computed; a module's own forward hooks fire even when a cache hook
    returns without calling it, so it must sit inside the skipped part), and keeps the ratios
    MagCache's calibration records. Install before `apply`; `close` after the run."""

    def __init__(self, transformer, marker, wrap=False):
        import diffusers.hooks.mag_cache as mc

        self.calls, self.ran, self.calibrated = 0, set(), []

        def count(*_):
            self.calls += 1

        transformer.register_forward_pre_hook(count)
        if wrap:
            # Wrapped before a hook takes `forward` as the original: runs only when computed.
            forward = marker.forward

            def marked(*a, **k):
                self.ran.add(self.calls - 1)
                return forward(*a, **k)

            marker.forward = marked
        else:
            marker.register_forward_hook(lambda *_: self.ran.add(self.calls - 1))
        self._mc, self._advance = mc, mc.MagCacheBlockHook._advance_step
        advance = self._advance

        def recorded(hook, state):
            if hook.config.calibrate and state.step_index + 1 >= hook.config.num_inference_steps:
                self.calibrated.append(list(state.calibration_ratios))
            return advance(hook, state)

        mc.MagCacheBlockHook._advance_step = recorded

    def close(self, steps, rows):
        """[steps, rows] int64: 1 where the call of that step and row ran its blocks."""
        self._mc.MagCacheBlockHook._advance_step = self._advance
        assert self.calls == steps * rows, (self.calls, steps, rows)
        return torch.tensor([[int(s * rows + r in self.ran) for r in range(rows)] for s in range(steps)])


def hook_cases(fbc_threshold, mag_threshold, guidance):
    """The First-Block Cache, MagCache and TaylorSeer cases each family's reference runs, guided
    at `guidance` and unguided: name -> (setting as the engine reads it, guidance). MagCache
    takes Flux's ratios (and `mag_threshold`, or diffusers' default where None)."""
    fbc = {"kind": "first_block", "threshold": fbc_threshold}
    mag = {"kind": "mag", "ratios": flux_ratios()}
    if mag_threshold is not None:
        mag["threshold"] = mag_threshold
    ts1 = {"kind": "taylorseer", "cache_interval": 3, "disable_cache_before_step": 2, "max_order": 1}
    ts2 = {"kind": "taylorseer", "cache_interval": 4, "disable_cache_before_step": 3, "max_order": 2,
           "disable_cache_after_step": 10}
    return {
        "first_block_guided": (fbc, guidance),
        "first_block_unguided": (fbc, 1.0),
        "mag_guided": (mag, guidance),
        "mag_unguided": (mag, 1.0),
        "mag_calibrate": ({"kind": "mag", "calibrate": True}, guidance),
        "taylorseer_guided": (ts1, guidance),
        "taylorseer_unguided": (ts2, 1.0),
    }


def write_reference(out_dir, stem, cases, run_one, desc, only=None):
    """Runs `run_one(index, name, case)` for each case (or `only` that one, printing it and
    writing nothing) and writes OUT_DIR/STEM.safetensors and OUT_DIR/STEM.json. `run_one`
    returns (the case's entry in the JSON, its own tensors, the final latents, the decisions
    [steps, rows] and MagCache's calibrations)."""
    import json
    import os

    from safetensors.torch import save_file

    tensors, desc = {}, {**desc, "cases": {}}
    for i, (name, case) in enumerate(cases.items()):
        if only and name != only:
            continue
        entry, own, latents, computed, calibrated = run_one(i, name, case)
        tensors.update({f"{name}.{k}": v.contiguous() for k, v in own.items()})
        tensors[f"{name}.latents"] = latents.float().contiguous()
        tensors[f"{name}.computed"] = computed.contiguous()
        if calibrated:
            tensors[f"{name}.ratios"] = torch.tensor(calibrated[0], dtype=torch.float32)
        desc["cases"][name] = entry
        print(f"{name}: computed {computed.t().tolist()}", flush=True)
    if only:
        return
    save_file(tensors, os.path.join(out_dir, f"{stem}.safetensors"))
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(desc, f, indent=2)
        f.write("\n")
