"""The one sampling loop: a schedule (noise levels, the timesteps the model is told, the solver's step)
walked with a velocity function. Every sampler in tessera runs it: tessera's DiT and Wan
(models/flow.py, on one process or with the guidance branches and tokens split: parallel/sampling.py) and
the families of models/family.py (models/sampler.py). What differs is the velocity function: guided on one
process or across ranks, behind a step cache (models/step_cache.py `CachedVelocity`), or one expert's.
PipeFusion walks the same schedule patch by patch in its own (step, patch) loop, calling the same blocks
(parallel/pipefusion.py, parallel/pipefusion_family.py).
"""

from models.family import Schedule


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
