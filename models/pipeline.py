"""Building the frozen components and the DiT from a recipe, and text-to-video generation with them.
Shared by train.py (previews), infer.py and scripts/eval_demo.py."""

import contextlib

import numpy as np
import torch

from models.dit import DiT, build_dit
from models.flow import RectifiedFlow
from models.text_encoder import TextEncoder, build_text_encoder
from models.util import seeded
from models.vae import LatentSpace, build_vae


def build_frozen(cfg, device) -> tuple[TextEncoder, LatentSpace]:
    """The text encoder and the VAE (frozen, on `device`)."""
    return build_text_encoder(cfg.text_encoder).to(device), build_vae(cfg.vae).to(device)


def build_model(cfg, text_encoder: TextEncoder, vae: LatentSpace) -> DiT:
    """The DiT with weights fixed by train.seed alone: every rank and every run builds the same one."""
    with seeded(cfg.train.seed):
        return build_dit(cfg.model, in_channels=vae.latent_channels, text_dim=text_encoder.dim)


@torch.no_grad()
def generate(model, vae: LatentSpace, text_encoder: TextEncoder, flow: RectifiedFlow, prompts: list[str],
             frames: int, height: int, width: int, steps: int, guidance: float, negative_prompt: str = "",
             seeds: list[int] | None = None, autocast_dtype=None, progress=None) -> np.ndarray:
    """Videos (B, frames, height, width, 3) as float32 in [0, 1]. Prompt i starts from noise seeded by
    seeds[i] (default: i), so a video does not depend on which other prompts share its batch or rank."""
    seeds = list(range(len(prompts))) if seeds is None else seeds
    device = next(model.parameters()).device
    latent_shape = vae.latent_shape(frames, height, width, flow.patch_size)
    noise = torch.stack([torch.randn(latent_shape, generator=torch.Generator().manual_seed(s))
                         for s in seeds]).to(device)
    y, y_mask = text_encoder(prompts, device)
    neg_y, neg_mask = text_encoder([negative_prompt] * len(prompts), device)
    autocast = (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None
                else contextlib.nullcontext())
    with autocast:
        latents = flow.sample(model, noise, y, y_mask, neg_y, neg_mask, steps=steps, guidance=guidance,
                              progress=progress)
    videos = vae.decode(latents.float())  # (B, 3, T, H, W) in [-1, 1]
    return ((videos.clamp(-1, 1) + 1) / 2).permute(0, 2, 3, 4, 1).float().cpu().numpy()
