"""Qwen-Image's sampling pieces, as diffusers' QwenImagePipeline does them: the noise, the schedule (its
sigmas with the resolution-dependent shift, then plain Euler steps), true CFG with the per-token norm
rescale, and the latent normalisation with the VAE config's latents_mean / latents_std.
"""

import math

import numpy as np
import torch

from models.qwen_image.transformer import pack_latents, unpack_latents

# FlowMatchEulerDiscreteScheduler's defaults for the keys the schedule reads; a scheduler_config.json
# overrides them (Qwen-Image's: dynamic shifting, max_image_seq_len 8192, max_shift 0.9, shift_terminal
# 0.02 at release).
SCHEDULER_DEFAULTS = dict(
    num_train_timesteps=1000,
    shift=1.0,
    use_dynamic_shifting=False,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
    shift_terminal=None,
    time_shift_type="exponential",
)
_UNSUPPORTED = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "invert_sigmas",
                "stochastic_sampling")  # fmt: skip


def calculate_shift(image_tokens: int, base_seq_len=256, max_seq_len=4096, base_shift=0.5, max_shift=1.15):
    """mu, linear in the image token count between (base_seq_len, base_shift) and (max_seq_len, max_shift)."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_tokens * slope + (base_shift - slope * base_seq_len)


def sigmas(steps: int, image_tokens: int, scheduler_config: dict | None = None) -> torch.Tensor:
    """The noise levels of `steps` Euler steps, then 0: (steps + 1,) float32. The pipeline's
    linspace(1, 1/steps, steps), shifted as the scheduler does (dynamic: exp(mu) / (exp(mu) + 1/s - 1)
    with mu = calculate_shift(image_tokens); else the static shift), then stretched to end at
    shift_terminal if set. In float32 numpy, in diffusers' order of operations."""
    config = {**SCHEDULER_DEFAULTS, **(scheduler_config or {})}
    wrong = [key for key in _UNSUPPORTED if config.get(key)]
    if wrong or config["time_shift_type"] not in ("exponential", "linear"):
        raise ValueError(f"Qwen-Image's schedule does not support {wrong or config['time_shift_type']}")
    s = np.linspace(1.0, 1 / steps, steps).astype(np.float32)
    if config["use_dynamic_shifting"]:
        mu = calculate_shift(
            image_tokens,
            config["base_image_seq_len"],
            config["max_image_seq_len"],
            config["base_shift"],
            config["max_shift"],
        )
        e = math.exp(mu) if config["time_shift_type"] == "exponential" else mu
        s = e / (e + (1 / s - 1) ** 1.0)
    else:
        shift = config["shift"]
        s = shift * s / (1 + (shift - 1) * s)
    if config["shift_terminal"]:
        one_minus = 1 - s
        s = 1 - one_minus / (one_minus[-1] / (1 - config["shift_terminal"]))
    return torch.cat([torch.from_numpy(s).to(torch.float32), torch.zeros(1)])


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
