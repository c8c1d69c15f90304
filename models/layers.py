"""Building blocks the model families share, in diffusers' arithmetic (so that each family stays exact
against its diffusers model, bf16 included); single-device code."""

import math
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.attention import JointAttention


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


class ActivatedProjection(nn.Module):
    """diffusers' GELU (tanh) and LinearActivation (`silu`): `proj`, then the activation."""

    def __init__(self, dim_in: int, dim_out: int, activation: str = "gelu-approximate"):
        super().__init__()
        self.proj, self.activation = nn.Linear(dim_in, dim_out), activation

    def forward(self, x):
        x = self.proj(x)
        return F.silu(x) if self.activation == "silu" else F.gelu(x, approximate="tanh")


class FeedForward(nn.Module):
    """diffusers' FeedForward with activation_fn "gelu-approximate" (or "linear-silu": `silu`), inner width
    int(dim * mult): net.0.proj, net.1 (its dropout), net.2."""

    def __init__(self, dim: int, mult: float = 4, activation: str = "gelu-approximate"):
        super().__init__()
        inner = int(dim * mult)
        self.net = nn.Sequential(
            ActivatedProjection(dim, inner, activation), nn.Identity(), nn.Linear(inner, dim)
        )

    def forward(self, x):
        return self.net(x)


class AdaNormOut(nn.Module):
    """diffusers' AdaLayerNormContinuous as the MMDiTs use it before their output projection: LayerNorm
    without affine, then scale and shift (in that order) from SiLU(temb)."""

    def __init__(self, dim: int):
        super().__init__()
        self.silu = nn.SiLU()
        self.linear = nn.Linear(dim, 2 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, x, temb):
        scale, shift = self.linear(self.silu(temb).to(x.dtype)).chunk(2, dim=1)
        return self.norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]


def apply_rope(x, rope):
    """Rotate channel pairs of x (B, H, N, Dh) by the angles in rope (N, Dh/2, 2) = (cos, sin); or of x
    (B, N, H, Dh) by rope[:, None]."""
    # As complex numbers, (x1 + i x2)(cos + i sin): one multiply over contiguous memory. The same
    # arithmetic on the strided halves x[..., 0::2], x[..., 1::2] ran ~100 of 660 ms of kernel time in
    # an eager training step at Wan2.1-1.3B dims on an H100. Compiled, inductor runs the complex multiply
    # as an eager kernel inside the graph; the compiled step time did not change (docs/benchmarks_history.md).
    pairs = torch.view_as_complex(x.float().contiguous().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * torch.view_as_complex(rope.float())).flatten(-2).to(x.dtype)


class DualStreamAttention(nn.Module):
    """diffusers' joint attention projections (its names): both streams' q, k, v and outputs, per-head RMSNorm
    on queries and keys, and the joint operator (models/attention.py: parallel/ swaps it). A family's own
    forward runs them."""

    def __init__(self, dim: int, num_heads: int, backend: str = "sdpa"):
        super().__init__()
        self.num_heads, head_dim = num_heads, dim // num_heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim) for _ in range(3))
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (nn.Linear(dim, dim) for _ in range(3))
        self.norm_q, self.norm_k = RMSNorm(head_dim), RMSNorm(head_dim)
        self.norm_added_q, self.norm_added_k = RMSNorm(head_dim), RMSNorm(head_dim)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim)])  # diffusers' to_out.0 (to_out.1 is a dropout)
        self.to_add_out = nn.Linear(dim, dim)
        self.joint_attention = JointAttention(backend)

    def _heads(self, x, norm=None, rope=None):
        """(B, S, D) -> (B, H, S, Dh), normalised and rotated in the (B, S, H, Dh) layout as diffusers."""
        x = x.unflatten(-1, (self.num_heads, -1))
        if norm is not None:
            x = norm(x)
        if rope is not None:
            x = apply_rope(x, rope[:, None])  # rope (S, 1, Dh/2, 2): the same angle for every head
        return x.transpose(1, 2)


def token_rows(per_token: torch.Tensor, start: int, end: int, dim: int = 1) -> torch.Tensor:
    """Tokens start:end of a per-token tensor along `dim`, zero-padded past its end (a split's padding:
    row 0's modulation)."""
    n = per_token.shape[dim]
    part = per_token.narrow(dim, min(start, n), min(end, n) - min(start, n))
    if part.shape[dim] < end - start:
        shape = list(part.shape)
        shape[dim] = end - start - part.shape[dim]
        part = torch.cat([part, part.new_zeros(shape)], dim=dim)
    return part


def split_heads(x, num_heads):
    """(B, N, D) -> (B, H, N, Dh)."""
    B, N, D = x.shape
    return x.view(B, N, num_heads, D // num_heads).transpose(1, 2)


class WholeSequence(nn.Module):
    """Where the token sequence is split across processes and gathered again. On one device both are
    the identity; `parallel/` assigns a sequence-parallel replacement to `DiT.sequence`."""

    def shard(self, x, rope):
        return x, rope

    def gather(self, x):
        return x

    def valid_tokens(self, local: int) -> int:
        """How many of this process's `local` tokens are real, not padding."""
        return local

    def start(self, local: int) -> int:
        """Where this process's `local` tokens start in the (padded) sequence."""
        return 0


def parameter_generator(seed: int, name: str) -> torch.Generator:
    """The CPU generator of one parameter: the same for a name and seed in every process and layout."""
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def beside_patch(tokens, companion, image_rope, count: int, beside: int, start: int, end: int) -> tuple:
    """A patch's image-stream input when `beside` reference tokens end the companion (Qwen-Image-Edit's,
    FLUX.2's patch pieces): (the patch's tokens then the references', the text, their angles: rows
    start:end of the image's first `count`, zeros past them, then the references')."""
    text = companion[:, : companion.shape[1] - beside]
    rope = token_rows(image_rope[:count], start, end, dim=0)
    if beside:
        tokens = torch.cat([tokens, companion[:, -beside:]], dim=1)
        rope = torch.cat([rope, image_rope[count:]])
    return tokens, text, rope


def beside_split(tokens, text, n: int, beside: int) -> tuple:
    """beside_patch's inverse on the blocks' output: (the patch's n tokens, the companion)."""
    return (tokens[:, :n], torch.cat([text, tokens[:, n:]], dim=1)) if beside else (tokens, text)


class PiecesOf:
    """A transformer's patch pieces (PipeFusion's, the first-block cache's) with some of them replaced by a
    subclass (an embedding that reads a condition beside the latents): what the instance lacks is the
    model's."""

    def __init__(self, model):
        self.model = model

    def __getattr__(self, name):  # only what the instance lacks (a copy's lookups before __init__: none)
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)
