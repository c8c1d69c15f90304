"""Z-Image's single-stream DiT (diffusers' ZImageTransformer2DModel, basic mode) in tessera's style;
single-device code.

The image tokens pass the noise refiner (self-attention, modulated by the time), the caption the context
refiner (unmodulated); then the main blocks run both with one set of weights, attending jointly. Each
stream is padded to a multiple of 32 tokens with a learned pad token, which attends like any token. RoPE
has three axes: caption token j sits at (1 + j, 0, 0), image token (f, h, w) at (P + 1 + f, h, w) with P
the caption's padded length (so each sample has its own), the image's pad tokens at (0, 0, 0). Module
names are diffusers' except `blocks` (its `layers`), so weights.py's map is one rename. The output is
negated, in float32: the velocity (noise - x0) the pipeline steps with.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.attention import SelfAttentionOperator, make_attention
from models.layers import RMSNorm, WholeSequence, apply_rope, timestep_features

PAD_TO = 32  # diffusers' SEQ_MULTI_OF
ADALN_DIM = 256  # the time embedding's width (min(dim, 256))


@dataclass
class ZImageCond:
    """What Z-Image takes beside latents and timestep: Qwen3's second-to-last hidden state (text.py)."""

    text: torch.Tensor  # (B, L, text_dim), padded to the batch's longest prompt
    text_mask: torch.Tensor | None  # (B, L) bool, True on a real token; None: every token is real


@dataclass
class ZImageContext:
    """What the blocks read besides the image tokens (`ZImageTransformer.condition`)."""

    temb: torch.Tensor  # (B, 256): the modulations' input
    text: torch.Tensor  # (B, P, D): the caption after the context refiner, each padded to 32 (pad tokens)
    text_mask: torch.Tensor | None  # (B, P) bool: within each caption's padded length; None: all
    rope: torch.Tensor  # (B, N, Dh/2, 2): the image tokens' rotary angles (this rank's under a split)
    text_rope: torch.Tensor  # (P, Dh/2, 2)


def padded_length(n: int) -> int:
    return n + (-n) % PAD_TO


def rope_angles(positions: torch.Tensor, axes_dims, theta: float) -> torch.Tensor:
    """Positions (N, 3) -> (N, Dh/2, 2) (cos, sin): each axis rotates its own share of channel pairs,
    computed as diffusers' RopeEmbedder (float64 angles, float32, complex64 polar) on the CPU."""
    parts = []
    for axis, dim in enumerate(axes_dims):
        freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        angles = torch.outer(positions[:, axis].cpu().to(torch.float64), freqs).float()
        parts.append(torch.polar(torch.ones_like(angles), angles).to(torch.complex64))
    return torch.view_as_real(torch.cat(parts, dim=-1)).to(positions.device)


class ZJointAttention(nn.Module):
    """The main blocks' attention: image q, k, v (B, H, N, Dh) and caption q, k, v (B, H, P, Dh), the
    caption's batch padding masked -> (image output, caption output). Image first, as diffusers orders
    the sequence (kind "joint": parallel/ replaces it by assignment, keeping `kernel`)."""

    kind = "joint"

    def __init__(self, backend: str = "sdpa"):
        super().__init__()
        self.kernel = make_attention(backend)

    def forward(self, q, k, v, text_q, text_k, text_v, text_mask):
        n, mask = q.shape[2], None
        if text_mask is not None:
            mask = torch.cat([text_mask.new_ones(q.shape[0], n), text_mask], dim=1)[:, None, None, :].bool()
        cat = lambda a, b: torch.cat([a, b], dim=2)  # noqa: E731
        out = self.kernel(cat(q, text_q), cat(k, text_k), cat(v, text_v), mask)
        return out[:, :, :n], out[:, :, n:]


class MaskedAttention(nn.Module):
    """The context refiner's attention over the caption, whole on every rank (kind "whole"), its batch
    padding masked."""

    kind = "whole"

    def __init__(self, backend: str = "sdpa"):
        super().__init__()
        self.kernel = make_attention(backend)

    def forward(self, q, k, v, mask):
        return self.kernel(q, k, v, None if mask is None else mask[:, None, None, :])


class ZAttention(nn.Module):
    """Projections (no bias), per-head RMSNorm on queries and keys, RoPE, then `operator`."""

    def __init__(self, dim: int, num_heads: int, operator: nn.Module):
        super().__init__()
        self.num_heads, head_dim = num_heads, dim // num_heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.norm_q, self.norm_k = RMSNorm(head_dim, eps=1e-5), RMSNorm(head_dim, eps=1e-5)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim, bias=False)])
        self.operator = operator

    def qkv(self, x, rope):
        """(B, N, D) -> q, k, v (B, H, N, Dh); rope (B or 1, N, Dh/2, 2)."""
        heads = lambda y: y.unflatten(-1, (self.num_heads, -1))  # noqa: E731
        q, k = self.norm_q(heads(self.to_q(x))), self.norm_k(heads(self.to_k(x)))
        q, k = apply_rope(q, rope[:, :, None]), apply_rope(k, rope[:, :, None])
        return (y.transpose(1, 2) for y in (q, k, heads(self.to_v(x))))

    def out(self, y, dtype):
        return self.to_out[0](y.transpose(1, 2).flatten(2).to(dtype))

    def forward(self, x, rope, *extra):
        return self.out(self.operator(*self.qkv(x, rope), *extra), x.dtype)

    def joint(self, x, text, rope, text_rope, text_mask):
        image, caption = self.operator(*self.qkv(x, rope), *self.qkv(text, text_rope[None]), text_mask)
        return self.out(image, x.dtype), self.out(caption, text.dtype)


class SwiGLU(nn.Module):
    """diffusers' Z-Image FeedForward: w2(silu(w1 x) * w3 x), no biases."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1, self.w2 = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ZImageBlock(nn.Module):
    """One block: attention and feed-forward, each between two RMSNorms, gated and scaled by the time
    embedding where `modulation` (tanh gates, 1 + scales; no shifts)."""

    def __init__(self, dim: int, num_heads: int, eps: float, modulation: bool, operator: nn.Module):
        super().__init__()
        self.attention = ZAttention(dim, num_heads, operator)
        self.feed_forward = SwiGLU(dim, int(dim / 3 * 8))
        self.attention_norm1, self.ffn_norm1 = RMSNorm(dim, eps=eps), RMSNorm(dim, eps=eps)
        self.attention_norm2, self.ffn_norm2 = RMSNorm(dim, eps=eps), RMSNorm(dim, eps=eps)
        if modulation:
            self.adaLN_modulation = nn.Sequential(nn.Linear(min(dim, ADALN_DIM), 4 * dim))

    def modulations(self, temb):
        """(scale_msa, gate_msa, scale_mlp, gate_mlp), each (B, 1, D); ones (no gate, no scale) without."""
        if temb is None:
            return None, None, None, None
        scale_msa, gate_msa, scale_mlp, gate_mlp = self.adaLN_modulation(temb).unsqueeze(1).chunk(4, dim=2)
        return 1.0 + scale_msa, gate_msa.tanh(), 1.0 + scale_mlp, gate_mlp.tanh()

    def _added(self, x, out, gate):
        out = self.attention_norm2(out)
        return x + (out if gate is None else gate * out)

    def _ffn(self, x, scale, gate):
        h = self.ffn_norm1(x)
        out = self.ffn_norm2(self.feed_forward(h if scale is None else h * scale))
        return x + (out if gate is None else gate * out)

    def refine(self, x, rope, *extra, temb=None):
        """A refiner block: one stream (B, N, D); `extra` the operator's (the context refiner's mask). The
        refiners are not `blocks`: their weights are the root's under FSDP2, gathered with it."""
        scale_msa, gate_msa, scale_mlp, gate_mlp = self.modulations(temb)
        h = self.attention_norm1(x)
        x = self._added(x, self.attention(h if scale_msa is None else h * scale_msa, rope, *extra), gate_msa)
        return self._ffn(x, scale_mlp, gate_mlp)

    def forward(self, x, text, temb, rope, text_rope, text_mask):
        """A main block: the image tokens (B, N, D) and the caption (B, P, D), attending jointly (called as
        the module: FSDP2 gathers a block's weights, and checkpointing wraps it, around its call)."""
        scale_msa, gate_msa, scale_mlp, gate_mlp = self.modulations(temb)
        image, caption = self.attention.joint(
            self.attention_norm1(x) * scale_msa, self.attention_norm1(text) * scale_msa, rope, text_rope,
            text_mask,
        )  # fmt: skip
        x, text = self._added(x, image, gate_msa), self._added(text, caption, gate_msa)
        return self._ffn(x, scale_mlp, gate_mlp), self._ffn(text, scale_mlp, gate_mlp)


class TimestepEmbedder(nn.Module):
    """diffusers' Z-Image TimestepEmbedder: 256 sinusoidal features (cos first) of t in float32, then
    Linear, SiLU, Linear (`mlp.0`, `mlp.2`) in the weights' dtype."""

    def __init__(self, dim: int, mid: int = 1024, frequency_size: int = 256):
        super().__init__()
        self.frequency_size = frequency_size
        self.mlp = nn.Sequential(nn.Linear(frequency_size, mid), nn.SiLU(), nn.Linear(mid, dim))

    def forward(self, t):
        return self.mlp(timestep_features(t, self.frequency_size).to(self.mlp[0].weight.dtype))


class FinalLayer(nn.Module):
    """LayerNorm without affine, scaled by 1 + a projection of SiLU(temb), then the output projection."""

    def __init__(self, dim: int, out: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(dim, out)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(min(dim, ADALN_DIM), dim))

    def forward(self, x, temb):
        return self.linear(self.norm_final(x) * (1.0 + self.adaLN_modulation(temb)).unsqueeze(1))


class ZImageTransformer(nn.Module):
    """Z-Image's transformer (diffusers' config names; one patch size, as released)."""

    def __init__(
        self,
        in_channels: int = 16,
        dim: int = 3840,
        n_layers: int = 30,
        n_refiner_layers: int = 2,
        n_heads: int = 30,
        norm_eps: float = 1e-5,
        cap_feat_dim: int = 2560,
        rope_theta: float = 256.0,
        t_scale: float = 1000.0,
        axes_dims=(32, 48, 48),
        patch_size: int = 2,
        f_patch_size: int = 1,
        attention_backend: str = "sdpa",
    ):
        super().__init__()
        if dim % n_heads or sum(axes_dims) != dim // n_heads:
            raise ValueError(
                f"dim {dim} must be n_heads {n_heads} x a head dim equal to sum(axes_dims) {axes_dims}"
            )
        self.in_channels = self.out_channels = in_channels
        self.patch, self.key = (f_patch_size, patch_size, patch_size), f"{patch_size}-{f_patch_size}"
        self.rope_theta, self.axes_dims, self.t_scale = rope_theta, tuple(axes_dims), t_scale
        self._architecture = dict(
            in_channels=in_channels, dim=dim, n_layers=n_layers, n_refiner_layers=n_refiner_layers,
            n_heads=n_heads, norm_eps=norm_eps, cap_feat_dim=cap_feat_dim, rope_theta=rope_theta,
            t_scale=t_scale, axes_dims=tuple(axes_dims), patch_size=patch_size, f_patch_size=f_patch_size,
        )  # fmt: skip
        token = f_patch_size * patch_size * patch_size * in_channels
        self.all_x_embedder = nn.ModuleDict({self.key: nn.Linear(token, dim)})
        self.all_final_layer = nn.ModuleDict({self.key: FinalLayer(dim, token)})
        block = lambda modulation, operator: ZImageBlock(dim, n_heads, norm_eps, modulation, operator)  # noqa: E731
        self.noise_refiner = nn.ModuleList(
            [block(True, SelfAttentionOperator(attention_backend)) for _ in range(n_refiner_layers)]
        )
        self.context_refiner = nn.ModuleList(
            [block(False, MaskedAttention(attention_backend)) for _ in range(n_refiner_layers)]
        )
        self.t_embedder = TimestepEmbedder(min(dim, ADALN_DIM))
        self.cap_embedder = nn.Sequential(RMSNorm(cap_feat_dim, eps=norm_eps), nn.Linear(cap_feat_dim, dim))
        self.x_pad_token = nn.Parameter(torch.zeros(1, dim))
        self.cap_pad_token = nn.Parameter(torch.zeros(1, dim))
        self.sequence = WholeSequence()  # parallel/ assigns a sequence-parallel replacement
        self.blocks = nn.ModuleList(
            [block(True, ZJointAttention(attention_backend)) for _ in range(n_layers)]
        )

    def architecture(self) -> dict:
        return dict(self._architecture)

    def forward(self, x, t, cond: ZImageCond):
        """x: (B, C, T, H, W) latents; t: (B,) the model's time, 1 - sigma; cond: the caption -> the
        velocity (B, C, T, H, W) float32."""
        tokens, grid = self.embed(x)
        ctx = self.condition(t, cond, grid)
        tokens, ctx.rope = shard(self.sequence, tokens, ctx.rope)
        tokens = self.run_blocks(tokens, ctx)
        tokens = self.sequence.gather(tokens)
        return self.unpatchify(self.final_layer(tokens, ctx.temb), grid)

    # The pieces of `forward`. Not PipeFusion's and the first-block cache's patch pieces (patch_blocks):
    # the noise refiner attends over every image token before the first block, and diffusers' first-block
    # cache measures the first main block over the joint sequence, caption included.

    def embed(self, x):
        """Latents (B, C, T, H, W) -> tokens (B, N, D), N the grid's t*h*w padded to 32 with the pad token,
        in (t, h, w) order, channels in (pt, ph, pw, c) order; and the grid."""
        (B, C, T, H, W), (pt, ph, pw) = x.shape, self.patch
        if C != self.in_channels or T % pt or H % ph or W % pw:
            raise ValueError(
                f"Z-Image takes latents of {self.in_channels} channels with (T, H, W) divisible by "
                f"{self.patch}; got (B, C, T, H, W) = {tuple(x.shape)}"
            )
        grid = (T // pt, H // ph, W // pw)
        x = x.to(self.all_x_embedder[self.key].weight.dtype).reshape(
            B, C, grid[0], pt, grid[1], ph, grid[2], pw
        )
        tokens = self.all_x_embedder[self.key](
            x.permute(0, 2, 4, 6, 3, 5, 7, 1).reshape(B, -1, pt * ph * pw * C)
        )
        n = tokens.shape[1]
        pad = self.x_pad_token.to(tokens.dtype).expand(B, padded_length(n) - n, -1)
        return torch.cat([tokens, pad], dim=1), grid

    def caption(self, cond: ZImageCond) -> tuple:
        """The embedded caption (B, P, D), each sample's real tokens then pad tokens to its multiple of 32
        (then zeros to the batch's longest), its mask (None when every sample's length is P) and the
        padded lengths."""
        dtype = self.cap_embedder[1].weight.dtype
        text, (B, L) = self.cap_embedder(cond.text.to(dtype)), cond.text.shape[:2]
        real = [L] * B if cond.text_mask is None else cond.text_mask.sum(1).tolist()
        lengths = [padded_length(int(n)) for n in real]
        out = text.new_zeros(B, max(lengths), text.shape[-1])
        for i, (n, p) in enumerate(zip(real, lengths)):
            out[i, :n], out[i, n:p] = text[i, :n], self.cap_pad_token.to(dtype)
        mask = (
            torch.arange(out.shape[1], device=out.device)[None]
            < torch.tensor(lengths, device=out.device)[:, None]
        )
        return out, None if min(lengths) == max(lengths) else mask, lengths

    def condition(self, t, cond: ZImageCond, grid) -> ZImageContext:
        """The time embedding, the refined caption and both streams' rotary angles: needs no main block."""
        dtype = self.all_x_embedder[self.key].weight.dtype
        temb = self.t_embedder(t.float() * self.t_scale).to(dtype)
        text, mask, lengths = self.caption(cond)
        device = text.device
        text_positions = torch.zeros(text.shape[1], 3, dtype=torch.long, device=device)
        text_positions[:, 0] = torch.arange(1, text.shape[1] + 1, device=device)
        text_rope = rope_angles(text_positions, self.axes_dims, self.rope_theta)
        for block in self.context_refiner:
            text = block.refine(text, text_rope[None], mask)
        n = grid[0] * grid[1] * grid[2]
        cells = torch.stack(torch.meshgrid(*(torch.arange(s) for s in grid), indexing="ij"), -1).view(n, 3)
        ropes = {}
        for length in set(lengths):  # the image's first axis starts after the caption's padded length
            positions = torch.zeros(padded_length(n), 3, dtype=torch.long)
            positions[:n] = cells + torch.tensor([length + 1, 0, 0])
            ropes[length] = rope_angles(positions, self.axes_dims, self.rope_theta).to(device)
        rope = torch.stack([ropes[length] for length in lengths])
        return ZImageContext(temb, text, mask, rope, text_rope)

    def run_blocks(self, tokens, ctx: ZImageContext):
        """The noise refiner, then the main blocks with the caption, on the image tokens (B, n, D)."""
        for refiner in self.noise_refiner:
            tokens = refiner.refine(tokens, ctx.rope, temb=ctx.temb)
        text = ctx.text
        for block in self.blocks:
            tokens, text = block(tokens, text, ctx.temb, ctx.rope, ctx.text_rope, ctx.text_mask)
        return tokens

    def final_layer(self, tokens, temb):
        return self.all_final_layer[self.key](tokens, temb)

    def unpatchify(self, tokens, grid):
        """(B, N, pt*ph*pw*C) -> the velocity (B, C, T, H, W) float32: the grid's tokens (the padding
        dropped), negated (diffusers' pipeline negates the model's output before its step)."""
        (f, h, w), (pt, ph, pw), B = grid, self.patch, tokens.shape[0]
        x = tokens[:, : f * h * w].reshape(B, f, h, w, pt, ph, pw, self.out_channels)
        return (
            -x.permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(B, self.out_channels, f * pt, h * ph, w * pw).float()
        )


def shard(sequence, tokens, rope):
    """`sequence.shard` of the image tokens with their per-sample angles (B, N, Dh/2, 2): the angles travel
    token-major, (N, B * Dh/2, 2), as the shard slices them."""
    B, N, half, _ = rope.shape
    tokens, flat = sequence.shard(tokens, rope.permute(1, 0, 2, 3).reshape(N, B * half, 2))
    return tokens, flat.reshape(-1, B, half, 2).permute(1, 0, 2, 3).contiguous()
