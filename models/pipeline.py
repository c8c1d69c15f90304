"""Text-to-video generation on one device: encode the prompts, denoise seeded noise, decode in tiles.
Shared by train.py (previews), infer.py and scripts/eval_demo.py; sampling across processes passes
its own sampler and decode in (parallel/pipefusion.py, parallel/vae.py).
"""

import contextlib

import numpy as np
import torch

from models import tiling
from models.flow import RectifiedFlow
from models.image_condition import ConditionedModel
from models.text_encoder import TextEncoder
from models.vae import LatentSpace


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
    `sampler` replaces flow.sample(model, ...) (e.g. parallel/sampling.py's ParallelSampler), `decode`
    the VAE decode in the recipe's tiles (vae.tile_latent, vae.tile_overlap) on this device (e.g.
    parallel/vae.py's shared_decoder, which shares the tiles among ranks). `condition`: image-to-video's
    (models/image_condition.py encode_condition), or None. A sample with NaN or inf in its latents or its
    decoded video raises NonFiniteVideo (after decoding the others, which it carries)."""
    seeds = list(range(len(prompts))) if seeds is None else seeds
    # `device`: where the sampling runs (a model under train.cpu_offload keeps its weights on the CPU)
    device = device or next(model.parameters()).device
    latent_shape = vae.latent_shape(frames, height, width, flow.patch_size)
    noise = torch.stack(
        [torch.randn(latent_shape, generator=torch.Generator().manual_seed(s)) for s in seeds]
    ).to(device)
    y, y_mask = text_encoder(prompts, device)
    neg_y, neg_mask = text_encoder([negative_prompt] * len(prompts), device)
    autocast = (
        torch.autocast(device.type, dtype=autocast_dtype)
        if autocast_dtype is not None
        else contextlib.nullcontext()
    )
    with autocast:
        if sampler is None:
            if condition is not None:
                model = ConditionedModel(model, condition)
            latents = flow.sample(
                model, noise, y, y_mask, neg_y, neg_mask, steps=steps, guidance=guidance, progress=progress
            )
        else:
            extra = {} if condition is None else dict(condition=condition)
            latents = sampler(
                flow,
                noise,
                y,
                y_mask,
                neg_y,
                neg_mask,
                steps=steps,
                guidance=guidance,
                progress=progress,
                **extra,
            )
    if condition is not None and condition.first_frame:  # TI2V: the given frame's latent, as diffusers
        latents = torch.cat([condition.latent.to(latents.dtype), latents[:, :, 1:]], dim=2)
    # Checked before the clamp, which would turn inf into a plausible white. The latents (and so the
    # decoded videos) are the same on every rank that shares them: each reaches the same verdict.
    bad = {i: "the denoised latents" for i in nonfinite_samples(latents)}
    if len(bad) == len(prompts):  # nothing worth decoding
        raise NonFiniteVideo(bad, None)
    if decode is None:
        videos = tiling.decode(vae, latents.float(), vae.tile_latent, vae.tile_overlap)  # [-1, 1]
    else:
        videos = decode(latents.float())
    bad.update({i: "the decoded video" for i in nonfinite_samples(videos) if i not in bad})
    videos = ((videos.clamp(-1, 1) + 1) / 2).permute(0, 2, 3, 4, 1).float().cpu().numpy()
    if bad:
        raise NonFiniteVideo(dict(sorted(bad.items())), videos)
    return videos


def generate_checked(*args, **kwargs) -> tuple:
    """generate's (videos, {index in the batch: where NaN or inf was found}): the videos of those indices
    are not to be used, and `videos` is None when none is finite."""
    try:
        return generate(*args, **kwargs), {}
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
