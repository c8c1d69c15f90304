"""Sana's sampling pieces as the release runs them; single-device code.

The release samples with diffusers' DPMSolverMultistepScheduler as the hub's scheduler_config.json sets it
(RELEASE_SCHEDULER: flow sigmas shifted by 3, flow prediction, DPM-Solver++ of order 2, midpoint), classic
classifier-free guidance on one [uncond, cond] batch, and decodes z / scaling_factor with the DC-AE. Here
are the schedule, one solver step, the guidance rule and the latent scaling, as plain code.
"""

from dataclasses import dataclass

import numpy as np
import torch

RELEASE_SCHEDULER = dict(  # Efficient-Large-Model/Sana_1600M_1024px_diffusers scheduler/scheduler_config.json
    algorithm_type="dpmsolver++",
    solver_order=2,
    solver_type="midpoint",
    prediction_type="flow_prediction",
    use_flow_sigmas=True,
    flow_shift=3.0,
    final_sigmas_type="zero",
    lower_order_final=True,
    euler_at_final=False,
    num_train_timesteps=1000,
    timestep_spacing="linspace",
    thresholding=False,
)
DCAE_SCALING_FACTOR = 0.41407  # the release VAE's vae/config.json scaling_factor (DC-AE f32c32)


@dataclass
class SanaSchedule:
    sigmas: torch.Tensor  # (N + 1,) float32, from just under 1 to 0: the solver's noise levels
    timesteps: torch.Tensor  # (N,) float64: the model's t at each step, floor(1000 sigma) / 1000


def flow_schedule(steps: int, shift: float = 3.0, train_steps: int = 1000) -> SanaSchedule:
    """The release's schedule for `steps` steps: sigma = shift s / (1 + (shift - 1) s) over s evenly spaced
    from 1 - 1/train_steps down to 0, then a final 0 (shift 3; the 4K model's 6). The model is told the
    integer timestep floor(train_steps sigma), as diffusers' DPMSolverMultistepScheduler hands it, not
    sigma itself."""
    s = 1.0 - np.linspace(1, 1 / train_steps, steps + 1)
    s = np.flip(shift * s / (1 + (shift - 1) * s))[:-1].copy()  # float64, as diffusers computes them
    timesteps = torch.from_numpy(s * train_steps).to(torch.int64)
    sigmas = torch.from_numpy(np.concatenate([s, [0.0]]).astype(np.float32))
    return SanaSchedule(sigmas, timesteps.double() / train_steps)


def _lambda(sigma):
    """log(alpha / sigma) of a flow sigma (alpha = 1 - sigma): +inf at sigma = 0."""
    return torch.log(1 - sigma) - torch.log(sigma)


def dpm_solver_step(x, velocity, sigmas, i: int, previous=None):
    """One DPM-Solver++(2M) step from sigmas[i] to sigmas[i + 1] (Lu et al., arXiv 2211.01095), as diffusers'
    DPMSolverMultistepScheduler takes it with RELEASE_SCHEDULER. x: the latents at sigmas[i]; velocity: the
    (guided) flow prediction there; previous: the data prediction the step before returned (None at the
    first step). Returns (latents at sigmas[i + 1], this step's data prediction: the next `previous`).
    First order at the first step (no history) and the last (sigma 0: it lands on the data prediction);
    second-order midpoint otherwise. Computed in float32; the latents come back in velocity's dtype."""
    x0 = x - sigmas[i] * velocity  # flow prediction -> data prediction
    sigma_t, sigma_s = sigmas[i + 1], sigmas[i]
    alpha_t = 1 - sigma_t
    h = _lambda(sigma_t) - _lambda(sigma_s)
    sample = x.to(torch.float32)
    if previous is None or i == len(sigmas) - 2:
        out = (sigma_t / sigma_s) * sample - (alpha_t * (torch.exp(-h) - 1.0)) * x0
    else:
        r0 = (_lambda(sigma_s) - _lambda(sigmas[i - 1])) / h
        d1 = (1.0 / r0) * (x0 - previous)
        out = (
            (sigma_t / sigma_s) * sample
            - (alpha_t * (torch.exp(-h) - 1.0)) * x0
            - 0.5 * (alpha_t * (torch.exp(-h) - 1.0)) * d1
        )
    return out.to(velocity.dtype), x0


def classifier_free_guidance(uncond, cond, scale: float):
    """SanaPipeline's guidance on the float32 velocities of the [uncond, cond] batch (4.5 in the release)."""
    return uncond + scale * (cond - uncond)


def normalize_latents(z, scaling_factor: float = DCAE_SCALING_FACTOR):
    """DC-AE latents -> the transformer's latent space (Sana's training scales them by the factor)."""
    return z * scaling_factor


def denormalize_latents(z, scaling_factor: float = DCAE_SCALING_FACTOR):
    """The transformer's latents -> DC-AE latents, as SanaPipeline passes them to vae.decode."""
    return z / scaling_factor


def latent_shape(height: int, width: int, channels: int = 32, vae_scale_factor: int = 32) -> tuple:
    """(C, 1, h, w) of the latents of a height x width image; the size asked is the size sampled."""
    if height % vae_scale_factor or width % vae_scale_factor:
        raise ValueError(f"Sana's image size must be a multiple of {vae_scale_factor}, got {height}x{width}")
    return channels, 1, height // vae_scale_factor, width // vae_scale_factor
