"""Building blocks the model families share, in diffusers' arithmetic (so that each family stays exact
against its diffusers model, bf16 included); single-device code."""

import math

import torch
import torch.nn as nn


class RMSNorm(nn.Module):
    """diffusers' RMSNorm: the mean square in float32, the weight applied in the weight's dtype (torch's
    nn.RMSNorm rounds otherwise under bf16)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(self.weight.dtype)
        return x * self.weight


class TimestepMLP(nn.Module):
    """diffusers' TimestepEmbedding: linear_1, SiLU, linear_2 (its parameter names)."""

    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.linear_1, self.act, self.linear_2 = nn.Linear(in_dim, dim), nn.SiLU(), nn.Linear(dim, dim)

    def forward(self, x):
        return self.linear_2(self.act(self.linear_1(x)))


def timestep_features(t: torch.Tensor, size: int = 256, scale: float = 1.0) -> torch.Tensor:
    """(B,) -> (B, size) float32 sinusoidal features, cos first: diffusers' Timesteps(size,
    flip_sin_to_cos=True, downscale_freq_shift=0, scale) (scale applied after the product, as there)."""
    half = size // 2
    exponent = -math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half
    args = scale * (t[:, None].float() * torch.exp(exponent)[None])
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
