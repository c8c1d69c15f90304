"""Text- and image-to-video sampling with tessera's DiT on one device, as train.py (previews), infer.py
and scripts/ call it: the DiT's parts (models/dit/family.py) sampled along the one path every family
takes (models/sampler.py generate_images). Sampling across processes passes its own `sampler` (the
schedule's walk: parallel/compute/sampling.py) and `decode` (parallel/compute/vae.py) in.
"""

import numpy as np
import torch

from models.dit.family import DiTFamily, DiTParts
from models.flow import RectifiedFlow
from models.sampler import (
    NonFiniteVideo,
    Sampling,
    checked,
    generate_images,
    nonfinite_samples,
    serial_denoise,
)
from models.text_encoder import TextEncoder
from models.vae import LatentSpace

__all__ = ["DIT", "NonFiniteVideo", "generate", "generate_checked", "nonfinite_samples"]

DIT = DiTFamily()


@torch.no_grad()
def generate(
    model,
    vae: LatentSpace,
    text_encoder: TextEncoder,
    flow: RectifiedFlow,
    prompts: list[str],
    frames: int,
    height: int,
    width: int,
    steps: int,
    guidance: float,
    negative_prompt: str = "",
    seeds: list[int] | None = None,
    autocast_dtype=None,
    progress=None,
    sampler=None,
    decode=None,
    device=None,
    condition=None,
) -> np.ndarray:
    """Videos (B, frames, height, width, 3) as float32 in [0, 1]. Prompt i starts from noise seeded by
    seeds[i] (default: i), so a video does not depend on which other prompts share its batch or rank.
    `sampler` walks the schedule in place of the serial loop (generate_images' `denoise_with`: e.g.
    parallel/compute/sampling.py's ParallelSampler), `decode(latents)` replaces the VAE decode in the recipe's
    tiles (vae.tile_latent, vae.tile_overlap) on this device (e.g. parallel/compute/vae.py's shared_decoder,
    which shares the tiles among ranks). `condition`: image-to-video's (models/image_condition.py
    encode_condition), or None. A sample with NaN or inf in its latents or its decoded video raises
    NonFiniteVideo (after decoding the others, which it carries)."""
    seeds = list(range(len(prompts))) if seeds is None else seeds
    # `device`: where the sampling runs (a model under train.cpu_offload keeps its weights on the CPU)
    device = device or next(model.parameters()).device
    parts = DiTParts(
        model,
        None,
        text_encoder,
        vae,
        cache=flow.cache,
        flow=flow,
        condition=condition,
        autocast=autocast_dtype,
        device=device,
    )
    # max_length: its text encoder pads to text_encoder.max_length itself
    sampling = Sampling(prompts, seeds, (frames, height, width), steps, guidance, negative_prompt)
    return generate_images(
        DIT,
        parts,
        sampling,
        progress=progress,
        denoise_with=sampler or serial_denoise,
        device=device,
        decode=None if decode is None else (lambda latents: decode(latents.float())),
    )


def generate_checked(*args, **kwargs) -> tuple:
    """generate's (videos, {index in the batch: where NaN or inf was found}): models/sampler.py checked."""
    return checked(generate, *args, **kwargs)
