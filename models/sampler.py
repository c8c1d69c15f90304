"""Sampling a family of models/family.py: encode, draw each sample's noise from its own seed, walk the
family's schedule with its solver (models/loop.py, the loop every sampler runs), decode. How the velocity
is computed (one process, or the guidance branches on two: parallel/cfg.py) is passed in.
"""

import numpy as np
import torch

from models.family import Components, Family
from models.loop import denoise
from models.pipeline import NonFiniteVideo, nonfinite_samples


def guided_velocity(family: Family, parts: Components, cond, uncond, scale: float):
    """velocity(x, t) on one process: both branches, guided by the family's rule (uncond None: no
    guidance)."""

    def velocity(x, t):
        v = family.velocity(parts, x, t, cond)
        return v if uncond is None else family.guide(v, family.velocity(parts, x, t, uncond), scale)

    return velocity


@torch.no_grad()
def generate_images(
    family: Family,
    parts: Components,
    prompts: list,
    negative_prompt: str,
    seeds: list,
    size: tuple,
    steps: int,
    guidance: float,
    max_length: int,
    progress=None,
    velocity_of=guided_velocity,
    device=None,
) -> np.ndarray:
    """Images (B, frames, height, width, 3) float32 in [0, 1] of `prompts`, prompt i from seeds[i]'s noise
    (`size`: frames, height, width). `velocity_of(family, parts, cond, uncond, scale)` builds the velocity
    (parallel/cfg.py's splits the branches). NaN or inf: NonFiniteVideo, as models/pipeline.generate."""
    cond = family.encode(parts, prompts, max_length)
    uncond = None
    if family.guided(guidance):
        uncond = family.encode(parts, [negative_prompt] * len(prompts), max_length, negative=True)
    device = device or next(parts.transformer.parameters()).device  # a host-held (offloaded) model: given
    noise = family.noise(parts, seeds, *size).to(device)
    velocity = velocity_of(family, parts, cond, uncond, guidance)
    latents = denoise(family.schedule(parts, steps, noise), noise, velocity, progress)
    bad = {i: "the denoised latents" for i in nonfinite_samples(latents)}
    if len(bad) == len(prompts):
        raise NonFiniteVideo(bad, None)
    images = family.decode(parts, latents)  # (B, 3, T, H, W) in [-1, 1]
    bad.update({i: "the decoded video" for i in nonfinite_samples(images) if i not in bad})
    # in the VAE's dtype, then float32, as the pipelines' image processor
    images = (images / 2 + 0.5).clamp(0, 1).float().permute(0, 2, 3, 4, 1).cpu().numpy()
    if bad:
        raise NonFiniteVideo(dict(sorted(bad.items())), images)
    return images
