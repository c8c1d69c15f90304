"""Qwen-Image's sampling pieces, as diffusers' QwenImagePipeline does them: the noise, the schedule (its
sigmas with the resolution-dependent shift, then plain Euler steps), true CFG with the per-token norm
rescale, and the latent normalisation with the VAE config's latents_mean / latents_std. The schedule is
FlowMatchEulerDiscreteScheduler's, shared in models/loop.py (LTX-2's too).
"""

import torch

from models.loop import calculate_shift, sigmas  # noqa: F401  (Qwen-Image's schedule)
from models.qwen_image.transformer import pack_latents, unpack_latents


def image_tokens(height: int, width: int, patch: int = 2) -> int:
    """The token count the shift reads, for a latent of height x width (one frame)."""
    return (height // patch) * (width // patch)


def true_cfg(v_cond, v_uncond, scale: float, patch: int = 2):
    """The pipeline's guidance on velocities (B, C, T, H, W): uncond + scale (cond - uncond), rescaled so
    that each token's norm (over its C*p*p packed values) is the conditional one's. The pipeline uses it
    only with a negative prompt and scale > 1; separate passes, as the two texts' lengths may differ."""
    grid = (v_cond.shape[2], v_cond.shape[3] // patch, v_cond.shape[4] // patch)
    cond, uncond = pack_latents(v_cond, patch), pack_latents(v_uncond, patch)  # (B, N, C*p*p)
    combined = uncond + scale * (cond - uncond)
    combined = combined * (
        torch.norm(cond, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True)
    )
    return unpack_latents(combined, grid, patch)


def _stats(vae_config: dict, like: torch.Tensor):
    shape = (1, vae_config["z_dim"], 1, 1, 1)
    mean = torch.tensor(vae_config["latents_mean"]).view(shape).to(like.device, like.dtype)
    return mean, 1.0 / torch.tensor(vae_config["latents_std"]).view(shape).to(like.device, like.dtype)


def normalize_latents(z: torch.Tensor, vae_config: dict) -> torch.Tensor:
    """VAE latents (B, z_dim, T, H, W) -> the transformer's space: (z - mean) / std, written as the
    pipelines write it (times 1/std)."""
    mean, inv_std = _stats(vae_config, z)
    return (z - mean) * inv_std


def denormalize_latents(x: torch.Tensor, vae_config: dict) -> torch.Tensor:
    """The transformer's latents -> the VAE decoder's: x * std + mean (as x / (1/std) + mean, the
    pipeline's)."""
    mean, inv_std = _stats(vae_config, x)
    return x / inv_std + mean


def initial_noise(shape, generator: torch.Generator | None = None, dtype=torch.float32, device="cpu"):
    """Noise (B, C, T, H, W) with T = 1, the values the pipeline draws from one generator for its
    (B, 1, C, H, W) latent: with one frame both layouts hold the same numbers in the same order."""
    B, C, T, H, W = shape
    if T != 1:
        raise ValueError(f"Qwen-Image samples images (T = 1), got T = {T}")
    return torch.randn((B, 1, C, H, W), generator=generator, dtype=dtype, device=device).view(B, C, 1, H, W)
