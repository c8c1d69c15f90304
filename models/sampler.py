"""Sampling a family of models/family.py, the one path every family takes (tessera's DiT included):
encode, draw each sample's noise from its own seed, walk the family's schedule with its solver, decode. How
the schedule is walked is passed in: the family's loop with the velocity on one process (`serial_denoise`)
or the guidance branches on two (parallel/compute/cfg.py), or patch by patch through PipeFusion's stages
(parallel/compute/pipefusion.py).
"""

from dataclasses import dataclass

import numpy as np
import torch

from models.family import Components, Family


@dataclass
class Sampling:
    """What one sampling draws: prompt i from seeds[i]'s noise (so an image does not depend on the prompts
    that share its batch), at `size` (frames, height, width), in `steps` steps at guidance scale
    `guidance` against `negative_prompt`; `max_length`: the text length the family encodes (its
    pipeline's max_sequence_length)."""

    prompts: list
    seeds: list
    size: tuple
    steps: int
    guidance: float
    negative_prompt: str = ""
    max_length: int = 0
    images: list | None = None  # image-to-video: each prompt's first frame (PIL); None: text-to-video
    last_images: list | None = None  # FLF2V: each prompt's last frame (PIL), or None

    def __post_init__(self):
        if len(self.seeds) != len(self.prompts):
            raise ValueError(f"{len(self.prompts)} prompts and {len(self.seeds)} seeds: one seed per prompt")


def guided_velocity(family: Family, parts: Components, cond, uncond, scale: float):
    """velocity(x, t) on one process: both branches, guided by the family's rule (uncond None, or a step
    whose scale does not guide: the conditional branch alone)."""

    def velocity(x, t):
        step_scale = family.guidance.at(parts, t, scale)
        if uncond is None or not family.guidance.guided(step_scale):
            return family.steps.velocity(parts, x, t, cond)
        return family.steps.guided(family.guidance, parts, x, t, cond, uncond, step_scale)

    return velocity


def serial_denoise(family: Family, parts: Components, schedule, noise, cond, uncond, scale: float, progress):
    """The latents at the schedule's end, on this process: the family's loop, both branches here."""
    velocity = guided_velocity(family, parts, cond, uncond, scale)
    return family.steps.walk(parts, schedule, noise, velocity, progress)


@torch.no_grad()
def generate_images(
    family: Family,
    parts: Components,
    sampling: Sampling,
    progress=None,
    denoise_with=serial_denoise,
    device=None,
    conditioning=None,
    decode=None,
    sound: list | None = None,
) -> np.ndarray:
    """Images (B, frames, height, width, 3) float32 in [0, 1] of `sampling`'s prompts.
    `denoise_with(family, parts, schedule, noise, cond, uncond, scale, progress)` walks the schedule
    (serial_denoise's signature); `decode(latents)` replaces family.steps.decode (parallel/compute/vae.py's,
    which shares the tiles among ranks). `sound`: a list that receives (waveforms (B, channels, samples)
    float32 numpy, sample rate) of a family that samples sound (Steps.decode_audio). A sample with NaN or
    inf in its latents or its decoded images raises NonFiniteVideo (after decoding the others, which it
    carries)."""
    prompts, guidance = sampling.prompts, sampling.guidance
    if conditioning is not None:  # (cond, uncond) of these prompts, encoded before (training's previews)
        cond, uncond = conditioning
    else:
        cond, uncond = family.conditionings(parts, sampling)
    device = device or next(parts.transformer.parameters()).device  # a host-held (offloaded) model: given
    noise = family.steps.noise(parts, sampling.seeds, *sampling.size).to(device)
    schedule = family.steps.schedule(parts, sampling.steps, noise)
    with family.steps.context(parts):
        latents = denoise_with(family, parts, schedule, noise, cond, uncond, guidance, progress)
    latents = family.steps.finish(parts, latents)
    # Checked before the clamp, which would turn inf into a plausible white. The latents (and so the
    # decoded images) are the same on every rank that shares them: each reaches the same verdict.
    bad = {i: "the denoised latents" for i in nonfinite_samples(latents)}
    if len(bad) == len(prompts):  # nothing worth decoding
        raise NonFiniteVideo(bad, None)
    # (B, 3, T, H, W) in [-1, 1]
    images = family.steps.decode(parts, latents) if decode is None else decode(latents)
    bad.update({i: "the decoded video" for i in nonfinite_samples(images) if i not in bad})
    audio = family.steps.decode_audio(parts, latents) if sound is not None else None
    if audio is not None:
        bad.update({i: "the decoded sound" for i in nonfinite_samples(audio[0]) if i not in bad})
        sound.append((audio[0].float().cpu().numpy(), audio[1]))
    # in the VAE's dtype, then float32, as the pipelines' image processor
    images = (images / 2 + 0.5).clamp(0, 1).float().permute(0, 2, 3, 4, 1).cpu().numpy()
    if bad:
        raise NonFiniteVideo(dict(sorted(bad.items())), images)
    return images


def checked(sample, *args, **kwargs) -> tuple:
    """(sample(*args, **kwargs), {}) of a sampling function raising NonFiniteVideo (generate_images),
    or, when it raised, (the videos it carries, {index in the batch: where
    NaN or inf was found}): the videos of those indices are not to be used, and None when none is
    finite."""
    try:
        return sample(*args, **kwargs), {}
    except NonFiniteVideo as e:
        return e.videos, e.bad


class NonFiniteVideo(ValueError):
    """Sampling gave NaN or inf: `bad` {index in the batch: where it was found}, `videos` the batch's
    videos (those of `bad` unusable; None when no sample was finite)."""

    def __init__(self, bad: dict, videos):
        self.bad, self.videos = bad, videos
        found = "; ".join(f"sample {i}: in {where}" for i, where in bad.items())
        super().__init__(f"sampling gave NaN or inf values ({found})")


def nonfinite_samples(x: torch.Tensor) -> list[int]:
    """The samples (first dimension) of `x` holding NaN or inf."""
    return (~torch.isfinite(x).flatten(1).all(1)).nonzero().flatten().tolist()
