"""HunyuanVideo 1.5's transformer (diffusers' HunyuanVideo15Transformer3DModel) in tessera's style;
single-device code.

The video tokens and one context stream attend jointly in every dual-stream block, each stream with its
own weights. The context packs, per sample, its real tokens first: the SigLIP image tokens (image-to-video
only), the ByT5 glyph text, then the Qwen2.5-VL text refined by its token refiner, each tagged by a
condition-type embedding; the padding after them is masked as keys (diffusers also masks it as queries,
whose outputs nothing reads). Module names are diffusers' except `blocks` (diffusers: `transformer_blocks`).
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.layers import (
    AdaNormOut,
    DualStreamAttention,
    FeedForward,
    TimestepMLP,
    WholeSequence,
    timestep_features,
    token_rows,
)


@dataclass
class HunyuanVideo15Cond:
    """What the transformer takes beside latents and timestep (text.py encodes it)."""

    text: torch.Tensor  # (B, L, text_dim): Qwen2.5-VL's hidden states of the prompt
    text_mask: torch.Tensor | None  # (B, L) bool, True on a real token; None: every token is real
    glyph: torch.Tensor  # (B, L2, glyph_dim): ByT5's hidden states of the quoted text to draw
    glyph_mask: torch.Tensor | None  # (B, L2) bool, or None
    image: torch.Tensor | None = None  # (B, Li, image_dim) SigLIP features (image-to-video); None: text
    # (B, C + 1, T, H, W): the given frames' latents and their mask, beside the noisy latents; None: zeros
    image_latents: torch.Tensor | None = None


def pairwise_mask(mask: torch.Tensor) -> torch.Tensor:
    """(B, S) bool -> (B, 1, S, S): a query and a key attend when both are real (diffusers' mask; a padded
    query's row is all False, which SDPA answers with zeros)."""
    return mask[:, None, None, :] & mask[:, None, :, None]


class SelfAttention(nn.Module):
    """The token refiner's attention (diffusers' Attention with biased projections, no norms)."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim) for _ in range(3))
        self.to_out = nn.ModuleList([nn.Linear(dim, dim)])

    def forward(self, x, mask):
        heads = lambda t: t.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)  # noqa: E731
        out = F.scaled_dot_product_attention(
            heads(self.to_q(x)), heads(self.to_k(x)), heads(self.to_v(x)), mask
        )
        return self.to_out[0](out.transpose(1, 2).flatten(2).to(x.dtype))


class RefinerBlock(nn.Module):
    """One block of the token refiner: attention and MLP over the text alone, gated by the time and pooled
    text embedding."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = SelfAttention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.ff = FeedForward(dim, mlp_ratio, "silu")  # linear-silu
        self.norm_out = nn.Module()
        self.norm_out.linear = nn.Linear(dim, 2 * dim)  # diffusers' HunyuanVideo15AdaNorm: the two gates

    def forward(self, x, temb, mask):
        gate_msa, gate_mlp = self.norm_out.linear(F.silu(temb)).chunk(2, dim=1)
        x = x + self.attn(self.norm1(x), mask) * gate_msa[:, None]
        return x + self.ff(self.norm2(x)) * gate_mlp[:, None]


class TokenRefiner(nn.Module):
    """Qwen2.5-VL's text -> the context stream's text: projected, then refined by blocks that see the
    time and the text's masked mean (diffusers' HunyuanVideo15TokenRefiner)."""

    def __init__(self, in_dim: int, dim: int, num_heads: int, depth: int, mlp_ratio: float):
        super().__init__()
        self.time_text_embed = nn.Module()
        self.time_text_embed.timestep_embedder = TimestepMLP(256, dim)
        # PixArt's text projection: linear_1, SiLU, linear_2, as the timestep MLP
        self.time_text_embed.text_embedder = TimestepMLP(in_dim, dim)
        self.proj_in = nn.Linear(in_dim, dim)
        self.token_refiner = nn.Module()
        self.token_refiner.refiner_blocks = nn.ModuleList(
            [RefinerBlock(dim, num_heads, mlp_ratio) for _ in range(depth)]
        )

    def forward(self, text, timestep, text_mask):
        """text (B, L, in_dim), timestep (B,) the pipeline's (1000 sigma in the model's dtype), text_mask
        (B, L) bool or None (every token real)."""
        if text_mask is None:
            pooled, mask = text.mean(dim=1), None
        else:
            weights = text_mask.float().unsqueeze(-1)
            pooled = ((text * weights).sum(dim=1) / weights.sum(dim=1)).to(text.dtype)
            mask = pairwise_mask(text_mask.bool())
        embed = self.time_text_embed
        temb = embed.timestep_embedder(timestep_features(timestep).to(pooled.dtype))
        temb = temb + embed.text_embedder(pooled)
        x = self.proj_in(text)
        for block in self.token_refiner.refiner_blocks:
            x = block(x, temb, mask)
        return x


class GlyphProjection(nn.Module):
    """ByT5's glyph text -> the context stream (diffusers' HunyuanVideo15ByT5TextProjection)."""

    def __init__(self, in_dim: int, hidden: int, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(in_dim)
        self.linear_1, self.linear_2 = nn.Linear(in_dim, hidden), nn.Linear(hidden, hidden)
        self.linear_3 = nn.Linear(hidden, dim)

    def forward(self, x):
        x = F.gelu(self.linear_1(self.norm(x)))
        return self.linear_3(F.gelu(self.linear_2(x)))


class ImageProjection(nn.Module):
    """SigLIP's image tokens -> the context stream (diffusers' HunyuanVideo15ImageProjection)."""

    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.norm_in, self.linear_1 = nn.LayerNorm(in_dim), nn.Linear(in_dim, in_dim)
        self.linear_2, self.norm_out = nn.Linear(in_dim, dim), nn.LayerNorm(dim)

    def forward(self, x):
        return self.norm_out(self.linear_2(F.gelu(self.linear_1(self.norm_in(x)))))


class HunyuanVideo15Attention(DualStreamAttention):
    """Both streams' projections, per-head RMSNorm on queries and keys, RoPE on the video's, then the joint
    operator (models/attention.py, kind "joint": parallel/ swaps it). diffusers also masks the padded
    context tokens as queries; their outputs are never read (they are keys nowhere), so the video tokens'
    are the same."""

    def forward(self, x, context, context_mask, rope):
        """x (B, N, D) video tokens (this rank's), context (B, L, D), context_mask (B, L) bool or None, rope
        (N, Dh/2, 2) -> both outputs."""
        q, k = self._heads(self.to_q(x), self.norm_q, rope), self._heads(self.to_k(x), self.norm_k, rope)
        c_q = self._heads(self.add_q_proj(context), self.norm_added_q)
        c_k = self._heads(self.add_k_proj(context), self.norm_added_k)
        x, context = self.joint_attention(
            q, k, self._heads(self.to_v(x)), c_q, c_k, self._heads(self.add_v_proj(context)), context_mask
        )
        x, context = x.transpose(1, 2).flatten(2).to(q.dtype), context.transpose(1, 2).flatten(2).to(q.dtype)
        return self.to_out[0](x), self.to_add_out(context)


class AdaNormZero(nn.Module):
    """diffusers' AdaLayerNormZero (layer norm): the normalised input shifted and scaled, and the other four
    modulations (gate_msa, shift_mlp, scale_mlp, gate_mlp)."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, 6 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, x, temb):
        shift, scale, gate, shift_mlp, scale_mlp, gate_mlp = self.linear(F.silu(temb)).chunk(6, dim=1)
        return self.norm(x) * (1 + scale[:, None]) + shift[:, None], gate, shift_mlp, scale_mlp, gate_mlp


class HunyuanVideo15Block(nn.Module):
    """One dual-stream block: each stream modulated by the time embedding, joint attention, then each
    stream's own MLP, with gated residuals."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, backend: str = "sdpa"):
        super().__init__()
        self.norm1, self.norm1_context = AdaNormZero(dim), AdaNormZero(dim)
        self.attn = HunyuanVideo15Attention(dim, num_heads, backend)
        norm = lambda: nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)  # noqa: E731
        self.norm2, self.ff = norm(), FeedForward(dim, mlp_ratio)
        self.norm2_context, self.ff_context = norm(), FeedForward(dim, mlp_ratio)

    def forward(self, x, context, temb, context_mask, rope):
        x_in, gate, shift_mlp, scale_mlp, gate_mlp = self.norm1(x, temb)
        c_in, c_gate, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(context, temb)
        attn, c_attn = self.attn(x_in, c_in, context_mask, rope)
        x = x + attn * gate[:, None]
        context = context + c_attn * c_gate[:, None]
        x_in = self.norm2(x) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        c_in = self.norm2_context(context) * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]
        x = x + gate_mlp[:, None] * self.ff(x_in)
        return x, context + c_gate_mlp[:, None] * self.ff_context(c_in)


def rope_angles(grid, axes_dims, theta: float, device) -> torch.Tensor:
    """The video tokens' rotary angles (t*h*w, Dh/2, 2) = (cos, sin) in (t, h, w) token order: each axis
    rotates its own share of channel pairs, positions counted from 0 (diffusers'
    HunyuanVideo15RotaryPosEmbed)."""
    t, h, w = grid
    parts = []
    for axis, (size, dim) in enumerate(zip(grid, axes_dims)):
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32)[: dim // 2] / dim))
        angles = torch.outer(torch.arange(size, dtype=torch.float32), inv_freq)  # (size, dim/2)
        shape = [1, 1, 1, dim // 2]
        shape[axis] = size
        parts.append(angles.view(shape).expand(t, h, w, dim // 2))
    angles = torch.cat(parts, dim=-1).reshape(t * h * w, -1)
    return torch.stack([angles.cos(), angles.sin()], dim=-1).to(device)


@dataclass
class HunyuanVideo15Context:
    """What every block reads besides the video tokens (`HunyuanVideo15Transformer.condition`)."""

    temb: torch.Tensor  # (B, D): the time embedding
    context: torch.Tensor  # (B, L, D): the packed context stream entering the first block
    context_mask: torch.Tensor | None  # (B, L) bool: its real tokens, which lead; None: all real
    rope: torch.Tensor | None = None  # PipeFusion's and the step cache's: the video's rotary angles

    def rows(self, index):
        """The context of the samples `index` (the first-block step cache runs the others' blocks)."""
        mask = None if self.context_mask is None else self.context_mask[index]
        return HunyuanVideo15Context(self.temb[index], self.context[index], mask, self.rope)


class HunyuanVideo15Transformer(nn.Module):
    """HunyuanVideo 1.5's transformer. in_channels counts what the pipeline concatenates (the latents, the
    image condition's latents and its mask: 65 released), out_channels the latents'."""

    def __init__(
        self,
        in_channels: int = 65,
        out_channels: int = 32,
        num_heads: int = 16,
        head_dim: int = 128,
        depth: int = 54,
        refiner_depth: int = 2,
        mlp_ratio: float = 4.0,
        patch_size: int = 1,
        patch_size_t: int = 1,
        text_dim: int = 3584,
        glyph_dim: int = 1472,
        image_dim: int = 1152,
        rope_theta: float = 256.0,
        rope_axes_dim=(16, 56, 56),
        attention_backend: str = "sdpa",
    ):
        super().__init__()
        dim = num_heads * head_dim
        if sum(rope_axes_dim) != head_dim:
            raise ValueError(f"rope_axes_dim {list(rope_axes_dim)} must add up to the head dim {head_dim}")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.patch = (patch_size_t, patch_size, patch_size)
        self.rope_theta, self.rope_axes_dim = rope_theta, tuple(rope_axes_dim)
        self._architecture = dict(
            in_channels=in_channels,
            out_channels=out_channels,
            num_heads=num_heads,
            head_dim=head_dim,
            depth=depth,
            refiner_depth=refiner_depth,
            mlp_ratio=mlp_ratio,
            patch_size=patch_size,
            patch_size_t=patch_size_t,
            text_dim=text_dim,
            glyph_dim=glyph_dim,
            image_dim=image_dim,
            rope_theta=rope_theta,
            rope_axes_dim=tuple(rope_axes_dim),
        )
        self.x_embedder = nn.Module()
        self.x_embedder.proj = nn.Conv3d(in_channels, dim, kernel_size=self.patch, stride=self.patch)
        self.image_embedder = ImageProjection(image_dim, dim)
        self.context_embedder = TokenRefiner(text_dim, dim, num_heads, refiner_depth, 4.0)  # always 4x
        self.context_embedder_2 = GlyphProjection(glyph_dim, 2048, dim)
        self.time_embed = nn.Module()
        self.time_embed.timestep_embedder = TimestepMLP(256, dim)
        self.cond_type_embed = nn.Embedding(3, dim)  # 0: the text, 1: the glyph text, 2: the image
        self.sequence = WholeSequence()  # parallel/ assigns a sequence-parallel replacement
        self.blocks = nn.ModuleList(
            [HunyuanVideo15Block(dim, num_heads, mlp_ratio, attention_backend) for _ in range(depth)]
        )
        self.norm_out = AdaNormOut(dim)
        self.proj_out = nn.Linear(dim, patch_size_t * patch_size * patch_size * out_channels)

    def architecture(self) -> dict:
        return dict(self._architecture)

    def forward(self, x, t, cond: HunyuanVideo15Cond):
        """x: (B, C, T, H, W) latents; t: (B,) the diffusers timestep / 1000; cond: the texts (and the
        image) -> the velocity (B, C_out, T, H, W)."""
        tokens, grid = self.embed(x, cond.image_latents)
        ctx = self.condition(t, cond)
        rope = rope_angles(grid, self.rope_axes_dim, self.rope_theta, x.device)
        tokens, rope = self.sequence.shard(tokens, rope)  # (B, N_local, D); the identity on one device
        context = ctx.context  # (B, L, D): whole on every rank
        for block in self.blocks:
            tokens, context = block(tokens, context, ctx.temb, ctx.context_mask, rope)
        tokens = self.sequence.gather(tokens)
        return self.unpatchify(self.final_layer(tokens, ctx.temb), grid)

    # The pieces of `forward`, for sequence parallelism, PipeFusion and the step cache to call one by one.

    def embed(self, x, given=None):
        """Latents (B, C, T, H, W) and beside them the condition's latents and mask (`given`; None: zeros,
        text-to-video, as the pipeline's) -> tokens (B, N, D) in (t, h, w) order, and the token grid."""
        if given is None:
            given = x.new_zeros(x.shape[0], self.in_channels - x.shape[1], *x.shape[2:])
        x = torch.cat([x, given.to(x.dtype)], dim=1)
        if x.shape[1] != self.in_channels or any(s % p for s, p in zip(x.shape[2:], self.patch)):
            raise ValueError(
                f"HunyuanVideo 1.5 takes latents of {self.in_channels} channels (with the condition's) and "
                f"(T, H, W) divisible by {self.patch}; got (B, C, T, H, W) = {tuple(x.shape)}"
            )
        x = self.x_embedder.proj(x.to(self.x_embedder.proj.weight.dtype))
        return x.flatten(2).transpose(1, 2), tuple(x.shape[2:])

    def condition(self, t, cond: HunyuanVideo15Cond) -> HunyuanVideo15Context:
        """The time embedding and the packed context stream; needs no block."""
        dtype = self.x_embedder.proj.weight.dtype
        timestep = (t.float() * 1000).to(dtype)  # the pipeline's: 1000 sigma rounded to the model's dtype
        temb = self.time_embed.timestep_embedder(timestep_features(timestep).to(dtype))
        kind = lambda n, like: self.cond_type_embed.weight[n].to(like.dtype)  # noqa: E731
        text = self.context_embedder(cond.text.to(dtype), timestep, cond.text_mask)
        streams = [(text + kind(0, text), cond.text_mask)]
        glyph = self.context_embedder_2(cond.glyph.to(dtype))
        streams.insert(0, (glyph + kind(1, glyph), cond.glyph_mask))
        if cond.image is not None:  # text-to-video: no image tokens (diffusers masks zeros out)
            image = self.image_embedder(cond.image.to(dtype))
            streams.insert(0, (image + kind(2, image), None))
        context, mask = pack_streams(streams)
        return HunyuanVideo15Context(temb, context, mask)

    def patch_context(self, t, cond: HunyuanVideo15Cond, grid) -> HunyuanVideo15Context:
        """What the blocks read at timestep t, besides the tokens: `condition`'s and the rotary angles."""
        ctx = self.condition(t, cond)
        ctx.rope = rope_angles(grid, self.rope_axes_dim, self.rope_theta, ctx.temb.device)
        return ctx

    def companion(self, ctx: HunyuanVideo15Context):
        """The stream that passes through the blocks beside a patch's video tokens: the context."""
        return ctx.context

    def patch_blocks(self, indices, tokens, context, ctx: HunyuanVideo15Context, grid, start, end):
        """Blocks `indices` on video tokens start:end (B, n, D) and the context stream -> both; under a
        split, tokens past the shard's real ones are padding."""
        rope = token_rows(ctx.rope, start, end, dim=0)
        for index in indices:
            tokens, context = self.blocks[index](tokens, context, ctx.temb, ctx.context_mask, rope)
        return tokens, context

    def patch_final(self, tokens, ctx, start: int, end: int):
        """The final layer on the tokens start:end."""
        return self.final_layer(tokens, ctx.temb)

    def final_layer(self, tokens, temb):
        return self.proj_out(self.norm_out(tokens, temb))

    def unpatchify(self, tokens, grid):
        (t, h, w), (pt, ph, pw), B = grid, self.patch, tokens.shape[0]
        x = tokens.reshape(B, t, h, w, -1, pt, ph, pw).permute(0, 4, 1, 5, 2, 6, 3, 7)
        return x.reshape(B, -1, t * pt, h * ph, w * pw).contiguous()


def pack_streams(streams: list) -> tuple:
    """[(tokens (B, L_i, D), mask (B, L_i) bool or None: all real), ...] -> the context (B, sum L_i, D) and
    its mask (None when every token is real): per sample every stream's real tokens in order, then every
    stream's padding zeroed (diffusers' order: real image, glyph, text, then the padding). A stable sort
    of the padding flags does it on the device, with no host sync."""
    tokens = torch.cat([t for t, _ in streams], dim=1)
    if all(mask is None for _, mask in streams):
        return tokens, None
    whole = lambda t: t.new_ones(t.shape[:2], dtype=torch.bool)  # noqa: E731
    mask = torch.cat([whole(t) if m is None else m.bool() for t, m in streams], dim=1)
    order = torch.sort((~mask).to(torch.uint8), dim=1, stable=True).indices  # real first, each in order
    tokens = torch.gather(tokens * mask[..., None].to(tokens.dtype), 1, order[..., None].expand_as(tokens))
    return tokens, torch.gather(mask, 1, order)
