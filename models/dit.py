"""A Diffusion Transformer for images (1 frame) and videos.

Follows DiT (Peebles & Xie, https://arxiv.org/abs/2212.09748) with adaLN-Zero conditioning on the
timestep, plus what video models added since: 3D patches, 3D rotary positions (any frame count and
aspect ratio), cross-attention to text tokens (PixArt-alpha, https://arxiv.org/abs/2310.00426) and
QK-normalisation. Single-device code: nothing here knows about processes.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.attention import make_attention

# Sizes: depth, width and heads. Parameter counts (with a 4096-wide text encoder) are printed by
# `python -m models.dit`.
DiT_models = {
    "DiT-tiny": dict(depth=2, hidden_size=64, num_heads=4),  # tests
    "DiT-demo": dict(depth=4, hidden_size=128, num_heads=4),  # the CPU demo
    "DiT-S": dict(depth=12, hidden_size=384, num_heads=6),
    "DiT-B": dict(depth=12, hidden_size=768, num_heads=12),
    "DiT-L": dict(depth=24, hidden_size=1024, num_heads=16),
    "DiT-XL": dict(depth=28, hidden_size=1152, num_heads=16),
    "DiT-2B": dict(depth=28, hidden_size=2048, num_heads=16),
    "DiT-5B": dict(depth=32, hidden_size=3072, num_heads=24),
}


def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def apply_rope(x, rope):
    """Rotate channel pairs of x (B, H, N, Dh) by the angles in rope (N, Dh/2, 2) = (cos, sin)."""
    cos, sin = rope[..., 0], rope[..., 1]
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)


class RotaryEmbedding3D(nn.Module):
    """Rotary positions over (time, height, width): each axis rotates its own share of channel pairs,
    so any grid size works without interpolation. Holds no state: angles are computed per grid."""

    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head dim, got {head_dim}")
        pairs = head_dim // 2
        self.axis_pairs = (pairs - 2 * (pairs // 3), pairs // 3, pairs // 3)  # time gets the remainder
        self.theta = theta

    def forward(self, grid: tuple[int, int, int], device) -> torch.Tensor:
        angles = []
        for axis, (size, n) in enumerate(zip(grid, self.axis_pairs)):
            freqs = self.theta ** (-torch.arange(n, dtype=torch.float32, device=device) / max(n, 1))
            pos = torch.arange(size, dtype=torch.float32, device=device)
            axis_angles = torch.outer(pos, freqs)  # (size, n)
            shape = [1, 1, 1, n]
            shape[axis] = size
            angles.append(axis_angles.view(shape).expand(*grid, n))
        angles = torch.cat(angles, dim=-1).reshape(-1, sum(self.axis_pairs))  # (N, Dh/2)
        return torch.stack((angles.cos(), angles.sin()), dim=-1)  # (N, Dh/2, 2)


class PatchEmbed3D(nn.Module):
    def __init__(self, patch_size, in_channels, hidden_size):
        super().__init__()
        self.patch_size = tuple(patch_size)
        self.proj = nn.Conv3d(in_channels, hidden_size, kernel_size=self.patch_size, stride=self.patch_size)

    def forward(self, x):
        x = self.proj(x)  # (B, D, t, h, w)
        grid = tuple(x.shape[2:])
        return x.flatten(2).transpose(1, 2), grid  # (B, N, D)


class TimestepEmbedder(nn.Module):
    """t in [0, 1] -> sinusoidal features of 1000*t -> MLP."""

    def __init__(self, hidden_size, frequency_size=256):
        super().__init__()
        self.frequency_size = frequency_size
        self.mlp = nn.Sequential(nn.Linear(frequency_size, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size))

    def forward(self, t):
        half = self.frequency_size // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = 1000 * t.float()[:, None] * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return self.mlp(emb.to(self.mlp[0].weight.dtype))


class SelfAttention(nn.Module):
    def __init__(self, hidden_size, num_heads, qk_norm, attention_backend):
        super().__init__()
        self.num_heads = num_heads
        head_dim = hidden_size // num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.q_norm = nn.RMSNorm(head_dim, eps=1e-6) if qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(head_dim, eps=1e-6) if qk_norm else nn.Identity()
        self.inner_attention = make_attention(attention_backend)  # swappable: (B, H, N, Dh) contract
        self.proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, x, rope):
        B, N, D = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)  # 3 x (B, H, N, Dh)
        q, k = apply_rope(self.q_norm(q), rope), apply_rope(self.k_norm(k), rope)
        x = self.inner_attention(q, k, v)  # (B, H, N, Dh)
        return self.proj(x.transpose(1, 2).reshape(B, N, D))


class CrossAttention(nn.Module):
    """Image/video tokens attend to text tokens; padded text tokens are masked out."""

    def __init__(self, hidden_size, num_heads, qk_norm):
        super().__init__()
        self.num_heads = num_heads
        head_dim = hidden_size // num_heads
        self.q = nn.Linear(hidden_size, hidden_size)
        self.kv = nn.Linear(hidden_size, 2 * hidden_size)
        self.q_norm = nn.RMSNorm(head_dim, eps=1e-6) if qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(head_dim, eps=1e-6) if qk_norm else nn.Identity()
        self.proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, x, y, y_mask):
        B, N, D = x.shape
        L = y.shape[1]
        q = self.q_norm(self.q(x).view(B, N, self.num_heads, -1).transpose(1, 2))  # (B, H, N, Dh)
        k, v = self.kv(y).view(B, L, 2, self.num_heads, -1).permute(2, 0, 3, 1, 4)  # 2 x (B, H, L, Dh)
        x = F.scaled_dot_product_attention(q, self.k_norm(k), v, attn_mask=y_mask[:, None, None, :])
        return self.proj(x.transpose(1, 2).reshape(B, N, D))


class DiTBlock(nn.Module):
    def __init__(self, hidden_size, num_heads, mlp_ratio, qk_norm, attention_backend):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = SelfAttention(hidden_size, num_heads, qk_norm, attention_backend)
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=True, eps=1e-6)
        self.cross_attn = CrossAttention(hidden_size, num_heads, qk_norm)
        self.norm3 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        hidden_mlp = int(hidden_size * mlp_ratio)
        self.mlp = nn.Sequential(
            nn.Linear(hidden_size, hidden_mlp), nn.GELU(approximate="tanh"), nn.Linear(hidden_mlp, hidden_size)
        )
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))

    def forward(self, x, c, y, y_mask, rope):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa), rope)
        x = x + self.cross_attn(self.norm2(x), y, y_mask)
        x = x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm3(x), shift_mlp, scale_mlp))
        return x


class FinalLayer(nn.Module):
    def __init__(self, hidden_size, patch_volume, out_channels):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, patch_volume * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class WholeSequence(nn.Module):
    """Where the token sequence is split across processes and gathered again. On one device both are
    the identity; `parallel/` assigns a sequence-parallel replacement to `DiT.sequence`."""

    def shard(self, x, rope):
        return x, rope

    def gather(self, x):
        return x


class DiT(nn.Module):
    def __init__(self, in_channels, text_dim, depth, hidden_size, num_heads, patch_size=(1, 2, 2),
                 mlp_ratio=4.0, qk_norm=True, attention_backend="sdpa", rope_theta=10000.0):
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
        self.in_channels = in_channels
        self.patch_size = tuple(patch_size)
        self.num_heads = num_heads
        self.x_embedder = PatchEmbed3D(patch_size, in_channels, hidden_size)
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.y_embedder = nn.Sequential(nn.Linear(text_dim, hidden_size), nn.GELU(approximate="tanh"),
                                        nn.Linear(hidden_size, hidden_size))
        self.pooled_embedder = nn.Linear(hidden_size, hidden_size)  # the mean text token joins the timestep in c
        self.rope = RotaryEmbedding3D(hidden_size // num_heads, rope_theta)
        self.sequence = WholeSequence()
        self.blocks = nn.ModuleList(
            [DiTBlock(hidden_size, num_heads, mlp_ratio, qk_norm, attention_backend) for _ in range(depth)]
        )
        self.final_layer = FinalLayer(hidden_size, math.prod(self.patch_size), in_channels)
        self.init_weights()

    def check_input_shape(self, frames, height, width):
        """Raise if a latent of this size cannot be cut into whole patches."""
        for name, size, p in zip(("frames", "height", "width"), (frames, height, width), self.patch_size):
            if size % p:
                raise ValueError(f"latent {name} {size} is not divisible by the patch size {p} "
                                 f"(model.patch_size={list(self.patch_size)})")

    def forward(self, x, t, y, y_mask):
        """x: (B, C, T, H, W) latents; t: (B,) in [0, 1]; y: (B, L, text_dim) text tokens; y_mask: (B, L) bool."""
        self.check_input_shape(*x.shape[2:])
        dtype = self.x_embedder.proj.weight.dtype  # bf16 under mixed precision; t stays float32
        x, y = x.to(dtype), y.to(dtype)
        x, grid = self.x_embedder(x)  # (B, N, D)
        rope = self.rope(grid, x.device)  # (N, Dh/2, 2)
        x, rope = self.sequence.shard(x, rope)  # (B, N_local, D); the identity on one device
        y = self.y_embedder(y)  # (B, L, D)
        c = self.t_embedder(t) + self.pooled_embedder(masked_mean(y, y_mask))  # (B, D)
        for block in self.blocks:
            x = block(x, c, y, y_mask, rope)  # (B, N_local, D)
        x = self.sequence.gather(x)  # (B, N, D)
        x = self.final_layer(x, c)  # (B, N, pt*ph*pw*C)
        return self.unpatchify(x, grid)  # (B, C, T, H, W)

    def unpatchify(self, x, grid):
        B = x.shape[0]
        (t, h, w), (pt, ph, pw) = grid, self.patch_size
        x = x.view(B, t, h, w, pt, ph, pw, self.in_channels)
        x = x.permute(0, 7, 1, 4, 2, 5, 3, 6)  # (B, C, t, pt, h, ph, w, pw)
        return x.reshape(B, self.in_channels, t * pt, h * ph, w * pw)

    @torch.no_grad()
    def init_weights(self, zero_init: bool = True):
        """(Re-)initialise every parameter; also used after building on the meta device.
        zero_init=False replaces adaLN-Zero's zeros with small random weights, so that an untrained
        model's output depends on every weight (tests and benchmarks of parallel sampling)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
                m.reset_parameters()
        w = self.x_embedder.proj.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.zeros_(self.x_embedder.proj.bias)
        for layer in (self.t_embedder.mlp[0], self.t_embedder.mlp[2]):
            nn.init.normal_(layer.weight, std=0.02)
        # adaLN-Zero: every block starts as the identity, and so does the text path into it.
        zero_or_small = nn.init.zeros_ if zero_init else (lambda w: nn.init.normal_(w, std=0.05))
        for block in self.blocks:
            zero_or_small(block.adaLN_modulation[-1].weight)
            zero_or_small(block.adaLN_modulation[-1].bias)
            zero_or_small(block.cross_attn.proj.weight)
        zero_or_small(self.final_layer.adaLN_modulation[-1].weight)
        zero_or_small(self.final_layer.adaLN_modulation[-1].bias)
        zero_or_small(self.final_layer.linear.weight)
        zero_or_small(self.final_layer.linear.bias)


def masked_mean(y, mask):
    m = mask.to(y.dtype).unsqueeze(-1)
    return (y * m).sum(1) / m.sum(1).clamp(min=1.0)


def build_dit(model_cfg, in_channels: int, text_dim: int) -> DiT:
    """The DiT named by a recipe's `model` section."""
    if model_cfg.size not in DiT_models:
        raise ValueError(f"unknown model size '{model_cfg.size}'; choose one of {', '.join(DiT_models)}")
    return DiT(in_channels=in_channels, text_dim=text_dim, patch_size=tuple(model_cfg.patch_size),
               mlp_ratio=model_cfg.mlp_ratio, qk_norm=model_cfg.qk_norm,
               attention_backend=model_cfg.attention_backend, rope_theta=model_cfg.rope_theta,
               **DiT_models[model_cfg.size])


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":
    with torch.device("meta"):
        for name, size in DiT_models.items():
            print(f"{name:10s} {count_parameters(DiT(16, 4096, **size)) / 1e6:10.1f} M parameters")
