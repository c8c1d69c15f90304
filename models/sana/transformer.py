"""Sana's transformer (Xie et al., arXiv 2410.10629) in tessera's style; single-device code.

A single-stream DiT on DC-AE latents: linear (ReLU-kernel) self-attention, cross-attention to Gemma-2 tokens,
a GLUMBConv feed-forward whose 3x3 depthwise convolution mixes neighbouring tokens, and adaLN-single. The
parameter names are diffusers' `SanaTransformer2DModel`'s, but for `blocks.` in place of
`transformer_blocks.` (models/sana/weights.py maps them). The operators parallel/ may replace by assignment
carry a `kind`: `attn1.inner_attention` ("linear"), `attn2.inner_attention` ("cross"), `ff.conv_depth`
("grid_conv").
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.layers import RMSNorm, TimestepMLP, WholeSequence, split_heads, timestep_features


@dataclass
class SanaConditioning:
    """What Sana is given beside latents and timestep (models/sana/text.py `encode_text` makes it)."""

    text: torch.Tensor  # (B, L, caption_channels): Gemma-2's last hidden states
    text_mask: torch.Tensor | None  # (B, L): 1 (or True) for a real token, 0 for padding; None: all real


@dataclass
class BlockInputs:
    """What every block reads besides its tokens (SanaTransformer.condition)."""

    modulation: torch.Tensor  # (B, 6, D): adaLN-single's projection of the time embedding, shared by blocks
    temb: torch.Tensor  # (B, D): the time embedding, the final layer's modulation input
    context: torch.Tensor  # (B, L, D): the projected, RMS-normalised text tokens
    context_bias: torch.Tensor | None  # (B, 1, 1, L): 0 for a real text token, -10000 for padding

    def rows(self, index):
        """The inputs of the samples `index` (the first-block step cache runs the others' blocks only)."""
        bias = None if self.context_bias is None else self.context_bias[index]
        return BlockInputs(self.modulation[index], self.temb[index], self.context[index], bias)


class LinearAttention(nn.Module):
    """Linear attention with a ReLU kernel, kind "linear". q, k, v: (B, H, N, Dh), heads dim 1, q and k
    already through the ReLU; returns (B, H, N, Dh) in q's dtype.

    With S = sum over tokens n of [v_n; 1] k_n^T ((B, H, Dh + 1, Dh), float32 as diffusers computes it),
    token n's output is (S q_n)[:Dh] / ((S q_n)[Dh] + 1e-15). Only S sums over tokens: a sequence-parallel
    replacement takes `key_value_sums` of its own tokens, adds them over all ranks, then `attend`s its own
    queries. A padded token would add relu(k_pad) [v_pad; 1]^T to S, which is not zero (a zero token leaves
    adaLN as the block's shift, whose key is not zero): the replacement must drop padded tokens from the
    sums (k = 0 there)."""

    kind = "linear"

    def key_value_sums(self, k, v):
        v = F.pad(v.float().transpose(-1, -2), (0, 0, 0, 1), value=1.0)  # (B, H, Dh + 1, N): a row of ones
        return torch.matmul(v, k.float())  # (B, H, Dh + 1, Dh)

    def attend(self, q, sums):
        out = torch.matmul(sums, q.float().transpose(-1, -2))  # (B, H, Dh + 1, N)
        return (out[:, :, :-1] / (out[:, :, -1:] + 1e-15)).transpose(-1, -2)  # (B, H, N, Dh)

    def forward(self, q, k, v):
        return self.attend(q, self.key_value_sums(k, v)).to(q.dtype)


class ContextAttention(nn.Module):
    """Softmax attention of the image tokens to a context (the text), kind "cross": q (B, H, N, Dh), k and v
    (B, H, L, Dh), bias (B, 1, 1, L) added to the scores (or None); returns (B, H, N, Dh). The context is
    whole on every rank, so a sequence-parallel run needs no collective here."""

    kind = "cross"

    def forward(self, q, k, v, bias):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


class GridConv(nn.Conv2d):
    """The 3x3 depthwise convolution over the token grid (zero padding at its edges), kind "grid_conv":
    tokens (B, N, C) in (t, h, w) order with grid (t, h, w) -> (B, N, C); each frame on its own. Its
    parameters are nn.Conv2d's (`weight` (C, 1, 3, 3), `bias` (C,)), so names match diffusers' conv_depth.
    A sequence-parallel replacement needs whole rows per rank, one neighbour row from each side, and zeros
    (never padding tokens) beyond the grid's edges."""

    kind = "grid_conv"

    def __init__(self, channels):
        super().__init__(channels, channels, 3, padding=1, groups=channels)

    def forward(self, tokens, grid):
        B, N, C = tokens.shape
        t, h, w = grid
        x = tokens.reshape(B * t, h, w, C).permute(0, 3, 1, 2)  # (B t, C, h, w)
        x = F.conv2d(x, self.weight, self.bias, padding=1, groups=C)
        return x.permute(0, 2, 3, 1).reshape(B, N, C)


class LinearSelfAttention(nn.Module):
    """attn1: projections, RMSNorm of q and k across heads (Sana 1.5, qk_norm), ReLU, LinearAttention."""

    def __init__(self, dim, heads, head_dim, bias, qk_norm):
        super().__init__()
        inner = heads * head_dim
        self.heads = heads
        self.to_q = nn.Linear(dim, inner, bias=bias)
        self.to_k = nn.Linear(dim, inner, bias=bias)
        self.to_v = nn.Linear(dim, inner, bias=bias)
        self.norm_q = RMSNorm(inner, eps=1e-5) if qk_norm else None
        self.norm_k = RMSNorm(inner, eps=1e-5) if qk_norm else None
        self.inner_attention = LinearAttention()  # swappable: kind "linear"
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])

    def forward(self, x):
        B, N, _ = x.shape
        q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)  # 3 x (B, N, H Dh)
        if self.norm_q is not None:
            q, k = self.norm_q(q), self.norm_k(k)
        q, k, v = (split_heads(p, self.heads) for p in (q, k, v))  # (B, H, N, Dh)
        out = self.inner_attention(F.relu(q), F.relu(k), v)
        out = self.to_out[0](out.transpose(1, 2).reshape(B, N, -1).to(x.dtype))
        return out.clip(-65504, 65504) if x.dtype == torch.float16 else out  # as diffusers, for float16


class CrossAttention(nn.Module):
    """attn2: the image tokens attend to the text tokens through ContextAttention."""

    def __init__(self, dim, context_dim, heads, head_dim, qk_norm):
        super().__init__()
        inner = heads * head_dim
        self.heads = heads
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(context_dim, inner)
        self.to_v = nn.Linear(context_dim, inner)
        self.norm_q = RMSNorm(inner, eps=1e-5) if qk_norm else None
        self.norm_k = RMSNorm(inner, eps=1e-5) if qk_norm else None
        self.inner_attention = ContextAttention()  # swappable: kind "cross"
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])

    def forward(self, x, context, bias):
        B, N, _ = x.shape
        q, k, v = self.to_q(x), self.to_k(context), self.to_v(context)
        if self.norm_q is not None:
            q, k = self.norm_q(q), self.norm_k(k)
        out = self.inner_attention(*(split_heads(p, self.heads) for p in (q, k, v)), bias)  # (B, H, N, Dh)
        return self.to_out[0](out.transpose(1, 2).reshape(B, N, -1).to(q.dtype))


class GLUMBConv(nn.Module):
    """Sana's feed-forward: 1x1 conv to 2 x hidden, SiLU, the 3x3 depthwise GridConv, x * SiLU(gate), 1x1
    conv back (no bias). The 1x1 convolutions run as linear layers on the tokens (same weights)."""

    def __init__(self, dim, mlp_ratio):
        super().__init__()
        hidden = int(mlp_ratio * dim)
        self.conv_inverted = nn.Conv2d(dim, 2 * hidden, 1)
        self.conv_depth = GridConv(2 * hidden)  # swappable: kind "grid_conv"
        self.conv_point = nn.Conv2d(hidden, dim, 1, bias=False)

    def forward(self, x, grid):
        x = F.silu(
            F.linear(x, self.conv_inverted.weight.flatten(1), self.conv_inverted.bias)
        )  # (B, N, 2 hidden)
        x, gate = self.conv_depth(x, grid).chunk(2, dim=-1)
        return F.linear(x * F.silu(gate), self.conv_point.weight.flatten(1))  # (B, N, D)


class SanaBlock(nn.Module):
    def __init__(
        self,
        dim,
        heads,
        head_dim,
        cross_heads,
        cross_head_dim,
        context_dim,
        mlp_ratio,
        attention_bias,
        qk_norm,
        norm_eps,
        norm_affine,
    ):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=norm_eps)
        self.attn1 = LinearSelfAttention(dim, heads, head_dim, attention_bias, qk_norm)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=norm_affine, eps=norm_eps)
        self.attn2 = CrossAttention(dim, context_dim, cross_heads, cross_head_dim, qk_norm)
        self.ff = GLUMBConv(dim, mlp_ratio)
        self.scale_shift_table = nn.Parameter(torch.randn(6, dim) / dim**0.5)

    def forward(self, x, modulation, context, context_bias, grid):
        """x (B, N, D); modulation (B, 6, D); context (B, L, D); context_bias (B, 1, 1, L); grid (t, h, w)."""
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
            self.scale_shift_table[None] + modulation
        ).chunk(6, dim=1)  # 6 x (B, 1, D)
        x = x + gate_msa * self.attn1((self.norm1(x) * (1 + scale_msa) + shift_msa).to(x.dtype))
        # the raw tokens: no norm, modulation or gate. Summed in diffusers' order, which sets the result's
        # memory layout: a bf16 matmul on the other layout rounds differently
        x = self.attn2(x, context, context_bias) + x
        return x + gate_mlp * self.ff(self.norm2(x) * (1 + scale_mlp) + shift_mlp, grid)


class PatchEmbed(nn.Module):
    """Holds the patch convolution under diffusers' name (patch_embed.proj); SanaTransformer.embed runs it."""

    def __init__(self, in_channels, dim, patch_size):
        super().__init__()
        self.proj = nn.Conv2d(in_channels, dim, patch_size, stride=patch_size)


class AdaLNSingle(nn.Module):
    """adaLN-single (PixArt-alpha): a time embedding, and one projection of it to the six modulations that
    every block adds to its own table."""

    def __init__(self, dim):
        super().__init__()
        self.emb = nn.ModuleDict({"timestep_embedder": TimestepMLP(256, dim)})
        self.linear = nn.Linear(dim, 6 * dim)

    def forward(self, timestep, dtype):
        """timestep (B,) on the 0..1000 scale -> (B, 6 D) modulation, (B, D) time embedding."""
        temb = self.emb["timestep_embedder"](timestep_features(timestep, 256).to(dtype))
        return self.linear(F.silu(temb)), temb


class CaptionProjection(nn.Module):
    def __init__(self, in_dim, dim):
        super().__init__()
        self.linear_1, self.linear_2 = nn.Linear(in_dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        return self.linear_2(F.gelu(self.linear_1(x), approximate="tanh"))


def sincos_position_embedding(h, w, dim, base_size, interpolation_scale, device):
    """diffusers' 2-D sin-cos embedding (get_2d_sincos_pos_embed) of an (h, w) token grid, (h w, dim) float32:
    each axis is stretched to base_size positions, then divided by interpolation_scale; the first dim/2
    channels encode the column, the last dim/2 the row (sin, then cos, over float64 frequencies)."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64, device=device) / (dim / 4))

    def axis(size, count, repeat):
        pos = torch.arange(size, dtype=torch.float32, device=device)
        pos = pos / (size / base_size) / interpolation_scale
        angles = pos.double()[:, None] * omega[None]  # (size, dim/4)
        return torch.cat([angles.sin(), angles.cos()], dim=1).repeat_interleave(repeat, 0).repeat(count, 1)

    return torch.cat([axis(w, h, 1), axis(h, 1, w)], dim=1).float()


class SanaTransformer(nn.Module):
    """Keyword arguments are diffusers' SanaTransformer2DModel config keys, with its defaults (the 1600M
    model's; models/sana/weights.py `build_sana` takes a config dict)."""

    def __init__(
        self,
        in_channels=32,
        out_channels=32,
        num_attention_heads=70,
        attention_head_dim=32,
        num_layers=20,
        num_cross_attention_heads=20,
        cross_attention_head_dim=112,
        cross_attention_dim=2240,
        caption_channels=2304,
        mlp_ratio=2.5,
        attention_bias=False,
        sample_size=32,
        patch_size=1,
        norm_elementwise_affine=False,
        norm_eps=1e-6,
        interpolation_scale=None,
        qk_norm=None,
        timestep_scale=1.0,
    ):
        super().__init__()
        dim = num_attention_heads * attention_head_dim
        self.in_channels, self.out_channels = in_channels, out_channels or in_channels
        self.num_heads, self.patch_size, self.timestep_scale = num_attention_heads, patch_size, timestep_scale
        # sin-cos positions only where the config sets interpolation_scale (the 2K and 4K releases)
        self.pos_embed_base, self.interpolation_scale = sample_size // patch_size, interpolation_scale
        self.patch_embed = PatchEmbed(in_channels, dim, patch_size)
        self.time_embed = AdaLNSingle(dim)
        self.caption_projection = CaptionProjection(caption_channels, dim)
        self.caption_norm = RMSNorm(dim, eps=1e-5)
        self.sequence = WholeSequence()
        self.blocks = nn.ModuleList(
            SanaBlock(
                dim,
                num_attention_heads,
                attention_head_dim,
                num_cross_attention_heads,
                cross_attention_head_dim,
                cross_attention_dim,
                mlp_ratio,
                attention_bias,
                qk_norm is not None,
                norm_eps,
                norm_elementwise_affine,
            )
            for _ in range(num_layers)
        )
        self.scale_shift_table = nn.Parameter(torch.randn(2, dim) / dim**0.5)
        self.proj_out = nn.Linear(dim, patch_size * patch_size * self.out_channels)

    def architecture(self) -> dict:
        """The config it was built from (weights.py `build_sana`): kept in checkpoints, checked on resume."""
        return dict(getattr(self, "_architecture", {}))

    def forward(self, x, t, cond: SanaConditioning):
        """x: (B, C, 1, H, W) latents; t: (B,) in [0, 1], the diffusers timestep / 1000 (in float64, 1000 t
        stays the integer the release's sampler gives); cond: the text. Returns the velocity, like x."""
        tokens, grid = self.embed(x)  # (B, N, D)
        inputs = self.condition(t, cond)
        tokens, _ = self.sequence.shard(tokens, None)  # (B, N_local, D); no positions travel to the blocks
        for block in self.blocks:
            tokens = block(tokens, inputs.modulation, inputs.context, inputs.context_bias, grid)
        tokens = self.sequence.gather(tokens)  # (B, N, D)
        return self.unpatchify(self.final_layer(tokens, inputs.temb), grid)  # (B, C, 1, H, W)

    # The pieces of `forward`, for parallel/ to run one by one.

    def embed(self, x):
        """Latents (B, C, 1, H, W) -> tokens (B, N, D) in (h, w) order, and the token grid (1, h, w)."""
        p = self.patch_size
        if x.dim() != 5 or x.shape[2] != 1 or x.shape[-2] % p or x.shape[-1] % p:
            shape = tuple(x.shape)
            raise ValueError(f"Sana takes latents (B, C, 1, H, W), H and W multiples of {p}; got {shape}")
        x = self.patch_embed.proj(x[:, :, 0].to(self.patch_embed.proj.weight.dtype))  # (B, D, h, w)
        grid = (1, x.shape[2], x.shape[3])
        tokens = x.flatten(2).transpose(1, 2)
        if self.interpolation_scale is not None:
            pos = sincos_position_embedding(
                *grid[1:], tokens.shape[-1], self.pos_embed_base, self.interpolation_scale, tokens.device
            )
            tokens = (tokens + pos).to(tokens.dtype)
        return tokens, grid

    def condition(self, t, cond: SanaConditioning) -> BlockInputs:
        """The time embedding, its shared modulation and the embedded text. Needs no block."""
        dtype = self.patch_embed.proj.weight.dtype
        timestep = (t.double() * 1000).float() * self.timestep_scale  # the release's integer timesteps
        modulation, temb = self.time_embed(timestep, dtype)
        context = self.caption_norm(self.caption_projection(cond.text.to(dtype)))  # (B, L, D)
        bias = None
        if cond.text_mask is not None:  # diffusers' additive mask, not -inf: the same scores
            bias = ((1 - cond.text_mask.to(dtype)) * -10000.0)[:, None, None, :]
        return BlockInputs(modulation.unflatten(1, (6, -1)), temb, context, bias)

    # PipeFusion's (parallel/compute/pipefusion.py): the blocks on one patch of whole token rows.

    def patch_context(self, t, cond: SanaConditioning, grid) -> BlockInputs:
        return self.condition(t, cond)

    def companion(self, inputs: BlockInputs):
        """No stream passes beside the image tokens (the text is read, not updated)."""
        return None

    def patch_blocks(self, indices, tokens, companion, inputs: BlockInputs, grid, start: int, end: int):
        """Blocks `indices` on tokens start:end (B, n, D) of the token grid (1, h, w): the convolution sees
        the patch's rows only (PipeFusion's replacement adds their neighbours)."""
        grid = (1, (end - start) // grid[2], grid[2])
        for index in indices:
            tokens = self.blocks[index](tokens, inputs.modulation, inputs.context, inputs.context_bias, grid)
        return tokens, companion

    def patch_final(self, tokens, ctx, start: int, end: int):
        """The final layer on the tokens start:end."""
        return self.final_layer(tokens, ctx.temb)

    def final_layer(self, tokens, temb):
        """(B, N, D) -> (B, N, p p C): LayerNorm, shift and scale (table + time embedding), projection."""
        shift, scale = (self.scale_shift_table[None] + temb[:, None]).chunk(2, dim=1)
        return self.proj_out(F.layer_norm(tokens, tokens.shape[-1:], eps=1e-6) * (1 + scale) + shift)

    def unpatchify(self, tokens, grid):
        B, (_, h, w), p = tokens.shape[0], grid, self.patch_size
        x = tokens.reshape(B, h, w, p, p, self.out_channels).permute(0, 5, 1, 3, 2, 4)  # (B, C, h, p, w, p)
        return x.reshape(B, self.out_channels, 1, h * p, w * p).contiguous()  # a copy: FSDP2 hooks no views
