"""Sampling a family of models/family.py: encode, draw each sample's noise from its own seed, walk the
family's schedule with its solver, decode. How the schedule is walked is passed in: models/loop.py's loop
with the velocity on one process (`serial_denoise`) or the guidance branches on two (parallel/cfg.py),
or patch by patch through PipeFusion's stages (parallel/pipefusion_family.py).
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


def serial_denoise(family: Family, parts: Components, schedule, noise, cond, uncond, scale: float, progress):
    """The latents at the schedule's end, on this process: models/loop.py's loop, both branches here."""
    return denoise(schedule, noise, guided_velocity(family, parts, cond, uncond, scale), progress)


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
    denoise_with=serial_denoise,
    device=None,
    conditioning=None,
) -> np.ndarray:
    """Images (B, frames, height, width, 3) float32 in [0, 1] of `prompts`, prompt i from seeds[i]'s noise
    (`size`: frames, height, width). `denoise_with(family, parts, schedule, noise, cond, uncond, scale,
    progress)` walks the schedule (serial_denoise's signature). NaN or inf: NonFiniteVideo, as
    models/pipeline.generate."""
    if conditioning is not None:  # (cond, uncond) of these prompts, encoded before (training's previews)
        cond, uncond = conditioning
    else:
        cond, uncond = family.encode(parts, prompts, max_length), None
        if family.guided(guidance):
            uncond = family.encode(parts, [negative_prompt] * len(prompts), max_length, negative=True)
    device = device or next(parts.transformer.parameters()).device  # a host-held (offloaded) model: given
    noise = family.noise(parts, seeds, *size).to(device)
    schedule = family.schedule(parts, steps, noise)
    latents = denoise_with(family, parts, schedule, noise, cond, uncond, guidance, progress)
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
