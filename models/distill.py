"""Distribution-matching distillation (DMD2: Yin et al., "Improved Distribution Matching Distillation for
Fast Image Synthesis", 2024): the pieces of one step, on one device (parallel/drive/distill.py runs them).

The student (the generator) samples from noise in its few steps; its sample, noised again, is predicted
clean by the frozen teacher (guided) and by a critic trained on the student's samples; the student moves
along critic - teacher, normalised per sample. Velocities are flow matching's (noise - x0): at
x = (1 - sigma) x0 + sigma noise, the clean sample is x - sigma v. Which choices follow DMD2 and which
follow the pipelines, and why: docs/distill.md.
"""

import torch
import torch.nn.functional as F


def per_sample(sigma: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """sigma (B,) shaped to broadcast over x (B, ...), in x's dtype."""
    return sigma.to(x.device, x.dtype).view(-1, *([1] * (x.dim() - 1)))


def noised(x0, noise, sigma):
    """(1 - sigma) x0 + sigma noise, sigma (B,)."""
    s = per_sample(sigma, x0)
    return (1 - s) * x0 + s * noise


def clean(x, sigma, v):
    """The clean sample a velocity v predicts at x, noise level sigma (B,)."""
    return x - per_sample(sigma, x) * v


@torch.no_grad()
def simulate(velocity, noise, schedule, k: int):
    """x at schedule.sigmas[k]: the student's first k steps from `noise` with the family's own solver
    (models/loop.py Schedule.step: Euler, or Sana's DPM-Solver), so that training sees the inputs sampling
    will (DMD2's backward simulation). velocity(x, sigma (B,))."""
    x, state, sigmas = noise, None, schedule.sigmas
    for i in range(k):
        x, state = schedule.step(x, velocity(x, sigmas[i].expand(noise.shape[0])), i, state)
    return x.to(noise.dtype)


def matching_gradient(x0, x0_real, x0_fake):
    """DMD's gradient on the student's sample x0: (critic's - teacher's prediction), divided per sample by
    the mean |x0 - teacher's prediction| (DMD2 eq. 7's normalisation: the step does not depend on how far
    the sample is). A sample the teacher predicts exactly (normaliser 0) takes no step; a NaN in the
    predictions stays NaN, for the failure guard to stop on (DMD2's nan_to_num would hide it)."""
    dims = tuple(range(1, x0.dim()))
    normaliser = (x0 - x0_real).abs().float().mean(dim=dims, keepdim=True)
    diff = (x0_fake - x0_real).float()
    return torch.where(normaliser > 0, diff / normaliser.where(normaliser > 0, 1.0), 0.0 * diff)


def matching_loss(x0, x0_real, x0_fake):
    """0.5 * mean (x0 - stop_gradient(x0 - g))^2, g = matching_gradient: its gradient with respect to x0 is
    g / x0.numel(), and its value 0.5 * mean(g^2) (DMD2's and FastVideo's form)."""
    grad = matching_gradient(x0.detach(), x0_real, x0_fake)
    return 0.5 * F.mse_loss(x0.float(), (x0.detach().float() - grad))


def draw_sigmas(generators: list, low: float, high: float, shift: float) -> torch.Tensor:
    """One noise level a sample, from its own generator: u uniform in [low, high], shifted as flow matching
    shifts (shift u / (1 + (shift - 1) u))."""
    u = torch.cat([low + (high - low) * torch.rand(1, generator=g) for g in generators])
    return shift * u / (1 + (shift - 1) * u)


def draw_noise(shape, generators: list) -> torch.Tensor:
    """Noise (B, *shape), sample i's from generators[i] alone."""
    return torch.stack([torch.randn(tuple(shape), generator=g) for g in generators])
