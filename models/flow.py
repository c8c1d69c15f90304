"""Rectified flow (flow matching) objective and sampler.

x_t = (1 - t) x0 + t noise, and the model predicts the velocity v = noise - x0 (Liu et al.,
https://arxiv.org/abs/2209.03003; SD3, https://arxiv.org/abs/2403.03206). Training timesteps come
from a logit-normal density, shifted towards noise as the token count grows (SD3 section 5.3.2:
shift = base * sqrt(tokens / reference)). Sampling integrates with diffusers'
FlowMatchEulerDiscreteScheduler on the same shifted schedule, with classifier-free guidance.
"""

import math

import torch
import torch.nn.functional as F

from models.loop import Schedule
from models.step_cache import walk_cached
from models.vae import num_tokens


class RectifiedFlow:
    def __init__(self, flow_cfg, patch_size, cache=None, timesteps=(0.0, 1.0)):
        """`cache`: a models.step_cache.StepCache (sample.cache), or None: every step calls the model.
        `timesteps`: the [low, high) range training draws from (expert_timesteps: one Wan 2.2 expert's)."""
        self.cache = cache
        self.timesteps = tuple(timesteps)
        self.model_calls = 0  # calls of the last walk() that ran every block (first_block: per-sample mean)
        self.logit_mean = flow_cfg.logit_mean
        self.logit_std = flow_cfg.logit_std
        self.shift_base = flow_cfg.shift
        self.shift_reference_tokens = flow_cfg.shift_reference_tokens
        self.patch_size = tuple(patch_size)

    def num_tokens(self, latent: torch.Tensor) -> int:
        return num_tokens(latent.shape[1:], self.patch_size)

    def shift_for(self, num_tokens: int) -> float:
        if (
            self.shift_reference_tokens == 0
        ):  # a fixed shift, as Wan's pipeline uses (3.0 at 480p, 5.0 at 720p)
            return self.shift_base
        return self.shift_base * math.sqrt(num_tokens / self.shift_reference_tokens)

    def sample_timestep(self, num_tokens: int, generator: torch.Generator) -> float:
        """A shifted logit-normal timestep; inside self.timesteps, the density restricted to that range (the
        first draw that falls there: the same on every rank, as the generator is the sample's own)."""
        low, high = self.timesteps
        s = self.shift_for(num_tokens)
        for _ in range(100_000):
            u = torch.sigmoid(self.logit_mean + self.logit_std * torch.randn(1, generator=generator)).item()
            t = s * u / (1 + (s - 1) * u)
            if low <= t < high or (t == high == 1.0):
                return t
        raise ValueError(
            f"no training timestep fell in [{low}, {high}) in 100000 draws: the expert's range is too narrow "
            "for flow.logit_mean/logit_std and the shift"
        )

    def draw(self, latent_shape, generators: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
        """Noise (B, *latent_shape) and timesteps (B,), sample i drawn from generators[i] alone: a sample's
        noise does not depend on the batch size, the rank it lands on or the parallel layout."""
        tokens = num_tokens(latent_shape, self.patch_size)
        t = torch.tensor([self.sample_timestep(tokens, g) for g in generators])
        noise = torch.stack([torch.randn(tuple(latent_shape), generator=g) for g in generators])
        return noise, t

    def training_loss(self, model, x0, y, y_mask, noise, t, from_frame: int = 0) -> torch.Tensor:
        """Mean squared error of the predicted velocity at x_t = (1 - t) x0 + t noise, over the latent
        frames from `from_frame` on (Wan2.2 TI2V: 1, its first frame is given)."""
        noise, t = noise.to(x0.device, x0.dtype), t.to(x0.device)
        t_ = t.view(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
        x_t = (1 - t_) * x0 + t_ * noise
        v = model(x_t, t, y, y_mask)
        return F.mse_loss(v[:, :, from_frame:].float(), (noise - x0)[:, :, from_frame:].float())

    def sigmas(self, noise, steps: int) -> torch.Tensor:
        """The noise levels of `steps` Euler steps, then 0: (steps + 1,) float32, from diffusers'
        FlowMatchEulerDiscreteScheduler on the shift for this latent's token count."""
        from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler

        scheduler = FlowMatchEulerDiscreteScheduler(shift=self.shift_for(self.num_tokens(noise)))
        scheduler.set_timesteps(steps, device=noise.device)
        return scheduler.sigmas.to(noise.device)

    @staticmethod
    def euler_step(x, v, sigmas, i: int):
        """x at sigmas[i + 1] from x at sigmas[i] and the velocity v, in float32 (the latent stays float32
        under autocast): the scheduler's Euler step, applied by PipeFusion patch by patch too."""
        return x.float() + (sigmas[i + 1] - sigmas[i]) * v.float()

    def walk(self, schedule: Schedule, noise, velocity, progress=None):
        """models/step_cache.py walk_cached over `schedule` with this flow's cache (every layout's velocity
        passes here, PipeFusion's plan reads the same cache); `model_calls` then counts the steps that ran
        every block."""
        x, self.model_calls = walk_cached(self.cache, schedule, noise, velocity, progress)
        return x

    def schedule(self, sigmas) -> Schedule:
        """models/loop.py's schedule of `sigmas`: the model is told sigma itself, and the step is Euler's."""
        return Schedule(sigmas, sigmas[:-1], lambda x, v, i, state: (self.euler_step(x, v, sigmas, i), None))


def expert_timesteps(expert: str, boundary) -> tuple[float, float]:
    """The timesteps a Wan 2.2 expert samples, as diffusers switches them: the high-noise expert at
    t >= boundary, the low-noise one below; every one without an expert (model.expert=none)."""
    return {"none": (0.0, 1.0), "high": (boundary, 1.0), "low": (0.0, boundary)}[expert]
