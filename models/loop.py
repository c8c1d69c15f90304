"""The one sampling loop: a schedule (noise levels, the timesteps the model is told, the solver's step)
walked with a velocity function. Every family of models/family.py (tessera's DiT and Wan included) samples
through it (models/sampler.py). What differs is the velocity function: guided on one process or across
ranks (parallel/compute/cfg.py), behind a step cache (models/step_cache.py `CachedVelocity`), or one
expert's. PipeFusion walks the same schedule patch by patch in its own (step, patch) loop, calling the same
blocks and the same solver step (parallel/compute/pipefusion.py). Here too:
FlowMatchEulerDiscreteScheduler's noise levels (`sigmas`, Qwen-Image's and LTX-2's) and its Euler step.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Schedule:
    """The steps of one sampling: the solver goes from sigmas[i] to sigmas[i + 1] with the velocity the
    transformer gives at timesteps[i]; `step(x, v, i, state) -> (x, state)` is the solver's step (state:
    what a multistep solver keeps between steps, None at the first)."""

    sigmas: torch.Tensor  # (N + 1,) float32, the last 0
    timesteps: torch.Tensor  # (N,) what the transformer is told at each step
    step: Callable


def denoise(schedule: Schedule, x, velocity, progress=None):
    """x at the last noise level from `x` at the first: velocity(x, t) at each step, then the solver's
    step; progress(done, total) after each."""
    steps, state = len(schedule.timesteps), None
    for i in range(steps):
        x, state = schedule.step(x, velocity(x, schedule.timesteps[i]), i, state)
        if progress is not None:
            progress(i + 1, steps)
    return x


def euler(sigmas):
    """diffusers' FlowMatchEulerDiscreteScheduler step over `sigmas` (Schedule.step): the sum in float32,
    the latents in the model's dtype between steps (the pipelines')."""

    def step(x, v, i, state):
        return (x.float() + (sigmas[i + 1] - sigmas[i]) * v).to(v.dtype), None

    return step


# FlowMatchEulerDiscreteScheduler's defaults for the keys `sigmas` reads; a scheduler_config.json overrides
# them (Qwen-Image's: dynamic shifting, max_image_seq_len 8192, max_shift 0.9, shift_terminal 0.02 at
# release; LTX-2's: dynamic shifting between 1024 and 4096 tokens).
SCHEDULER_DEFAULTS = dict(
    num_train_timesteps=1000,
    shift=1.0,
    use_dynamic_shifting=False,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
    shift_terminal=None,
    time_shift_type="exponential",
)
UNSUPPORTED = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "invert_sigmas",
                "stochastic_sampling")  # fmt: skip


def calculate_shift(image_tokens: int, base_seq_len=256, max_seq_len=4096, base_shift=0.5, max_shift=1.15):
    """mu, linear in the image token count between (base_seq_len, base_shift) and (max_seq_len, max_shift)."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_tokens * slope + (base_shift - slope * base_seq_len)


def sigmas(
    steps: int, image_tokens: int, scheduler_config: dict | None = None, start=None, mu: float | None = None
) -> torch.Tensor:
    """The noise levels of `steps` Euler steps, then 0: (steps + 1,) float32. The pipeline's
    linspace(1, 1/steps, steps), shifted as the scheduler does (dynamic: exp(mu) / (exp(mu) + 1/s - 1)
    with mu = calculate_shift(image_tokens); else the static shift), then stretched to end at
    shift_terminal if set. In float32 numpy, in diffusers' order of operations. `start`: the unshifted
    levels a pipeline passes instead (Z-Image's torch.linspace, which rounds otherwise); `mu`: the shift a
    pipeline computes its own way (FLUX.2's empirical one) instead of calculate_shift's."""
    config = {**SCHEDULER_DEFAULTS, **(scheduler_config or {})}
    wrong = [key for key in UNSUPPORTED if config.get(key)]
    if wrong or config["time_shift_type"] not in ("exponential", "linear"):
        raise ValueError(
            "FlowMatchEulerDiscreteScheduler's schedule here does not support "
            f"{wrong or config['time_shift_type']}"
        )
    s = np.linspace(1.0, 1 / steps, steps).astype(np.float32) if start is None else start
    if config["use_dynamic_shifting"]:
        mu = mu if mu is not None else calculate_shift(
            image_tokens,
            config["base_image_seq_len"],
            config["max_image_seq_len"],
            config["base_shift"],
            config["max_shift"],
        )
        e = math.exp(mu) if config["time_shift_type"] == "exponential" else mu
        s = e / (e + (1 / s - 1) ** 1.0)
    else:
        shift = config["shift"]
        s = shift * s / (1 + (shift - 1) * s)
    if config["shift_terminal"]:
        one_minus = 1 - s
        s = 1 - one_minus / (one_minus[-1] / (1 - config["shift_terminal"]))
    return torch.cat([torch.from_numpy(s).to(torch.float32), torch.zeros(1)])
