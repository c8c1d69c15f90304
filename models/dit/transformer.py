"""A Diffusion Transformer for images (1 frame) and videos; single-device code.

DiT (Peebles & Xie) with adaLN-Zero timestep conditioning, plus 3D patches, 3D rotary positions,
cross-attention to text tokens (PixArt-alpha) and QK-normalisation. Four options (adaln="single",
qk_norm_across_heads, pooled_text=False, text_mask=False), set by the `Wan*` sizes, make it Wan 2.1/2.2
exactly; models/dit/wan.py maps the weights. docs/internals.md says what each option changes.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.attention import SelfAttentionOperator
from models.layers import (
    RMSNorm,
    WholeSequence,
    apply_rope,
    count_parameters,
    parameter_generator,
    split_heads,
    token_rows,
)

# Sizes: depth, width and heads. Parameter counts (with a 4096-wide text encoder) are printed by
# `python -m models.dit.transformer`.
DiT_models = {
    "DiT-tiny": dict(depth=2, hidden_size=64, num_heads=4),  # tests
    "DiT-demo": dict(depth=4, hidden_size=128, num_heads=4),  # the CPU demo until 2026-11-28 (its runs load)
    "DiT-demo-96": dict(depth=4, hidden_size=96, num_heads=4),  # the CPU demo (configs/demo.yaml)
    "DiT-S": dict(depth=12, hidden_size=384, num_heads=6),
    "DiT-B": dict(depth=12, hidden_size=768, num_heads=12),
    "DiT-L": dict(depth=24, hidden_size=1024, num_heads=16),
    "DiT-XL": dict(depth=28, hidden_size=1152, num_heads=16),
    "DiT-2B": dict(depth=28, hidden_size=2048, num_heads=16),
    "DiT-5B": dict(depth=32, hidden_size=3072, num_heads=24),
}
WAN_OPTIONS = dict(
    adaln="single", qk_norm_across_heads=True, pooled_text=False, text_mask=False, absolute_positions=False
)
DiT_models.update(
    {  # Wan's text encoder is UMT5-XXL (4096 wide, 512 tokens); Wan2.2-5B needs its 48-channel VAE
        "Wan2.1-1.3B": dict(depth=30, hidden_size=1536, num_heads=12, ffn_dim=8960, **WAN_OPTIONS),
        "Wan2.1-14B": dict(depth=40, hidden_size=5120, num_heads=40, ffn_dim=13824, **WAN_OPTIONS),
        "Wan2.2-5B": dict(depth=30, hidden_size=3072, num_heads=24, ffn_dim=14336, **WAN_OPTIONS),
    }
)


def modulate(norm, x, shift, scale):
    """norm(x) * (1 + scale) + shift in float32, back in x's dtype; shift and scale are (B, 1, D)."""
    return (norm(x.float()) * (1 + scale) + shift).to(x.dtype)


class FP32LayerNorm(nn.LayerNorm):
    """LayerNorm computed in float32 whatever the dtype of its input and weights (bf16 under FSDP's
    mixed precision); returns float32."""

    def forward(self, x):
        weight = self.weight.float() if self.weight is not None else None
        bias = self.bias.float() if self.bias is not None else None
        return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps)


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


def absolute_position_embedding(grid: tuple[int, int, int], dim: int, device) -> torch.Tensor:
    """Fixed sin-cos features of each token's absolute place (N, dim), added to the patch tokens
    (the original DiT's, in 3-D). RoPE alone is relative: attention then looks the same from every
    token, and a small model trained briefly cannot tell where in the frame it is, so it scatters
    fragments of an object that belongs in one place. Space is counted from the grid's centre (buckets
    centre-crop) and time from the first frame (buckets keep a clip's first frames), so a place means
    the same in every bucket. Each axis gets its own share of channels, as in RotaryEmbedding3D."""
    per_axis = (dim - 2 * (dim // 3), dim // 3, dim // 3)
    features = []
    for axis, (size, n) in enumerate(zip(grid, per_axis)):
        half = n // 2
        freqs = 10000.0 ** (-torch.arange(half, dtype=torch.float32, device=device) / max(half, 1))
        pos = torch.arange(size, dtype=torch.float32, device=device) - (0 if axis == 0 else (size - 1) / 2)
        angles = torch.outer(pos, freqs)  # (size, half)
        axis_features = torch.cat([angles.sin(), angles.cos(), angles.new_zeros(size, n - 2 * half)], dim=-1)
        shape = [1, 1, 1, n]
        shape[axis] = size
        features.append(axis_features.view(shape).expand(*grid, n))
    return torch.cat(features, dim=-1).reshape(-1, dim)


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
    """t in [0, 1] -> sinusoidal features of 1000*t -> MLP, in float32 whatever the parameter dtype (bf16
    under FSDP's mixed precision) or autocast says, as Wan keeps its time embedder; returns float32."""

    def __init__(self, hidden_size, frequency_size=256):
        super().__init__()
        self.frequency_size = frequency_size
        self.mlp = nn.Sequential(
            nn.Linear(frequency_size, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size)
        )

    def forward(self, t):
        half = self.frequency_size // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = 1000 * t.float()[:, None] * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        first, activation, second = self.mlp
        with torch.autocast(t.device.type, enabled=False):
            return float32_linear(second, activation(float32_linear(first, emb)))


def float32_linear(layer: nn.Linear, x):
    """`layer` applied in float32 whatever its parameters' dtype, with a LoRA adapter's update if it has one
    (models/lora.py LoRALinear: an adapter on t_embedder must not be skipped silently)."""
    out = F.linear(x, layer.weight.float(), layer.bias.float())
    return out + layer.lora_update(x).float() if hasattr(layer, "lora_update") else out


def qk_norm_layer(hidden_size, num_heads, enabled, across_heads):
    """RMSNorm of queries or keys: per head (weight of size head_dim) or across heads (size D, before
    the head split, as Wan does)."""
    if not enabled:
        return nn.Identity()
    return nn.RMSNorm(hidden_size if across_heads else hidden_size // num_heads, eps=1e-6)


def norm_heads(x, norm, num_heads, across_heads):
    """(B, N, D) -> normalised (B, N, H, Dh), heads last but one: elementwise work on this layout reads
    memory in order (on the transposed one it ran 3.5x longer in eager mode on an H100)."""
    B, N, D = x.shape
    if across_heads:
        return norm(x).view(B, N, num_heads, D // num_heads)
    return norm(x.view(B, N, num_heads, D // num_heads))


class SelfAttention(nn.Module):
    def __init__(self, hidden_size, num_heads, qk_norm, attention_backend, qk_norm_across_heads=False):
        super().__init__()
        self.num_heads, self.across_heads = num_heads, qk_norm_across_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.qkv.fused_projections = 3  # q, k, v in row thirds: a LoRA gives each its own adapter
        self.q_norm = qk_norm_layer(hidden_size, num_heads, qk_norm, qk_norm_across_heads)
        self.k_norm = qk_norm_layer(hidden_size, num_heads, qk_norm, qk_norm_across_heads)
        self.inner_attention = SelfAttentionOperator(attention_backend)  # kind "self": swappable
        self.proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, x, rope):
        B, N, D = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # 3 x (B, N, D): the norms run on this rank's tokens
        H, across = self.num_heads, self.across_heads
        rope = rope[:, None]  # (N, 1, Dh/2, 2): one angle per token, the same for every head
        q = apply_rope(norm_heads(q, self.q_norm, H, across), rope).transpose(1, 2)  # (B, H, N, Dh)
        k = apply_rope(norm_heads(k, self.k_norm, H, across), rope).transpose(1, 2)
        x = self.inner_attention(q, k, split_heads(v, self.num_heads))  # (B, H, N, Dh)
        return self.proj(x.transpose(1, 2).reshape(B, N, D))


class CrossAttention(nn.Module):
    """Image/video tokens attend to text tokens; padded text tokens are masked out (y_mask None: none).
    With `image_tokens` (Wan's image-to-video), the context's first `image_tokens` tokens are an image's:
    the queries attend to them through their own keys and values (Wan's k_img, v_img and their norm), and
    that output is added to the text attention's before the projection."""

    def __init__(self, hidden_size, num_heads, qk_norm, qk_norm_across_heads=False, image_tokens=0):
        super().__init__()
        self.num_heads, self.across_heads, self.image_tokens = num_heads, qk_norm_across_heads, image_tokens
        self.q = nn.Linear(hidden_size, hidden_size)
        self.kv = nn.Linear(hidden_size, 2 * hidden_size)
        self.kv.fused_projections = 2
        self.q_norm = qk_norm_layer(hidden_size, num_heads, qk_norm, qk_norm_across_heads)
        self.k_norm = qk_norm_layer(hidden_size, num_heads, qk_norm, qk_norm_across_heads)
        if image_tokens:
            self.image_kv = nn.Linear(hidden_size, 2 * hidden_size)
            self.image_kv.fused_projections = 2
            self.image_k_norm = qk_norm_layer(hidden_size, num_heads, qk_norm, qk_norm_across_heads)
        self.proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, x, y, y_mask):
        B, N, D = x.shape
        H, across, n_image = self.num_heads, self.across_heads, self.image_tokens
        image, y = y[:, :n_image], y[:, n_image:]  # the image's tokens come first in the context
        k, v = self.kv(y).chunk(2, dim=-1)  # 2 x (B, L, D)
        mask = None if y_mask is None else y_mask[:, None, None, n_image:]
        q = norm_heads(self.q(x), self.q_norm, H, across).transpose(1, 2)  # (B, H, N, Dh)
        k = norm_heads(k, self.k_norm, H, across).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, split_heads(v, H), attn_mask=mask)
        if n_image:
            k, v = self.image_kv(image).chunk(2, dim=-1)
            k = norm_heads(k, self.image_k_norm, H, across).transpose(1, 2)
            out = out + F.scaled_dot_product_attention(q, k, split_heads(v, H))
        return self.proj(out.transpose(1, 2).reshape(B, N, D))


class ImageEmbedder(nn.Module):
    """CLIP image features (B, L, image_dim) -> context tokens (B, L, D), as Wan's img_emb: a float32
    LayerNorm, a feed-forward (image_dim -> image_dim -> D, exact GELU), a float32 LayerNorm. With
    `positions` (FLF2V: two images of L/2 tokens each, given as 2B rows), a learnt position embedding over
    the pair's L tokens first."""

    def __init__(self, image_dim, hidden_size, tokens, positions=False):
        super().__init__()
        self.norm1 = FP32LayerNorm(image_dim, eps=1e-5)
        self.ff = nn.Sequential(nn.Linear(image_dim, image_dim), nn.GELU(), nn.Linear(image_dim, hidden_size))
        self.norm2 = FP32LayerNorm(hidden_size, eps=1e-5)
        self.pos_embed = nn.Parameter(torch.zeros(1, tokens, image_dim)) if positions else None

    def forward(self, features):
        if self.pos_embed is not None:  # (2B, L/2, C): first and last image -> (B, L, C)
            features = features.reshape(-1, self.pos_embed.shape[1], features.shape[-1]) + self.pos_embed
        dtype = self.ff[0].weight.dtype  # the norms run in float32, the feed-forward in the weights' dtype
        return self.norm2(self.ff(self.norm1(features).to(dtype))).to(dtype)


class DiTBlock(nn.Module):
    def __init__(
        self,
        hidden_size,
        num_heads,
        mlp_hidden,
        qk_norm,
        attention_backend,
        adaln="zero",
        qk_norm_across_heads=False,
        image_tokens=0,
    ):
        super().__init__()
        self.norm1 = FP32LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = SelfAttention(hidden_size, num_heads, qk_norm, attention_backend, qk_norm_across_heads)
        self.norm2 = FP32LayerNorm(hidden_size, elementwise_affine=True, eps=1e-6)
        self.cross_attn = CrossAttention(hidden_size, num_heads, qk_norm, qk_norm_across_heads, image_tokens)
        self.norm3 = FP32LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(hidden_size, mlp_hidden),
            nn.GELU(approximate="tanh"),
            nn.Linear(mlp_hidden, hidden_size),
        )
        if adaln == "zero":
            self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))
        else:
            self.scale_shift_table = nn.Parameter(torch.randn(1, 6, hidden_size) / hidden_size**0.5)

    def modulation(self, c):
        """Six (B, 1, D) float32 tensors: shift, scale and gate of the attention, then of the MLP.
        c is the time embedding (B, D) for adaLN-Zero, the shared projection (B, 6, D) for adaLN-single;
        with a timestep per token (Wan2.2 TI2V) (B, n, D) or (B, n, 6, D), and the six are (B, n, D)."""
        if hasattr(self, "adaLN_modulation"):
            m = self.adaLN_modulation(c).float().unflatten(-1, (6, -1))
        else:
            m = self.scale_shift_table.float() + c.float()  # (1, 6, D) broadcasts over a token axis too
        return m.chunk(6, dim=1) if m.dim() == 3 else m.unbind(2)

    def forward(self, x, c, y, y_mask, rope):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.modulation(c)
        x = (x.float() + self.attn(modulate(self.norm1, x, shift_msa, scale_msa), rope) * gate_msa).to(
            x.dtype
        )
        x = x + self.cross_attn(self.norm2(x).to(x.dtype), y, y_mask)
        return (x.float() + self.mlp(modulate(self.norm3, x, shift_mlp, scale_mlp)) * gate_mlp).to(x.dtype)


class FinalLayer(nn.Module):
    def __init__(self, hidden_size, patch_volume, out_channels, adaln="zero"):
        super().__init__()
        self.norm_final = FP32LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, patch_volume * out_channels)
        if adaln == "zero":
            self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))
        else:
            self.scale_shift_table = nn.Parameter(torch.randn(1, 2, hidden_size) / hidden_size**0.5)

    def forward(self, x, temb):
        """temb: (B, D), or (B, N, D) with a timestep per token."""
        if hasattr(self, "adaLN_modulation"):
            m = self.adaLN_modulation(temb).float().unflatten(-1, (2, -1))
        else:
            m = self.scale_shift_table.float() + temb.float().unsqueeze(-2)
        shift, scale = m.chunk(2, dim=1) if m.dim() == 3 else m.unbind(2)
        return self.linear(modulate(self.norm_final, x, shift, scale))


@dataclass
class Conditioning:
    temb: torch.Tensor  # (B, D) time (and pooled text) embedding: the final layer's modulation input
    c: torch.Tensor  # the blocks' modulation input: temb, or adaLN-single's shared (B, 6, D) projection
    y: torch.Tensor  # (B, L, D) embedded text tokens
    block_mask: torch.Tensor | None  # (B, L) text mask for cross-attention; None: every text token attended
    # A timestep per token (Wan2.2 TI2V): temb and c hold one row per distinct timestep, (U, D) and (U, D)
    # or (U, 6, D), and token_index (B, N) each token's row: gathered for the tokens a rank holds.
    token_index: torch.Tensor | None = None
    rope: torch.Tensor | None = None  # the patch pieces': the whole grid's rotary angles (N, Dh/2, 2)

    def rows(self, index):
        """The conditioning of the samples `index` (the first-block step cache runs the others' blocks
        only); a timestep per token keeps its distinct rows and takes the samples' token_index."""
        mask = None if self.block_mask is None else self.block_mask[index]
        if self.token_index is not None:
            return Conditioning(self.temb, self.c, self.y[index], mask, self.token_index[index], self.rope)
        return Conditioning(self.temb[index], self.c[index], self.y[index], mask, None, self.rope)


@dataclass
class Pass:
    """One forward between DiT.begin and DiT.end: this rank's tokens (B, N_local, D), the token grid,
    their rotary angles and the blocks' modulation, context and context mask."""

    tokens: torch.Tensor
    grid: tuple
    rope: torch.Tensor
    c: torch.Tensor
    temb: torch.Tensor
    y: torch.Tensor
    y_mask: torch.Tensor | None


class DiT(nn.Module):
    def __init__(
        self,
        in_channels,
        text_dim,
        depth,
        hidden_size,
        num_heads,
        patch_size=(1, 2, 2),
        mlp_ratio=4.0,
        qk_norm=True,
        attention_backend="sdpa",
        rope_theta=10000.0,
        ffn_dim=None,
        adaln="zero",
        qk_norm_across_heads=False,
        pooled_text=True,
        text_mask=True,
        absolute_positions=False,
        image_dim=None,
        image_tokens=None,
        image_positions=False,
        out_channels=None,
    ):
        """image_dim, image_tokens, image_positions: Wan's image-to-video conditioning (None, 0, False:
        none): CLIP features of width image_dim, image_tokens of them per sample (257 for one image, 514
        for FLF2V's first and last), image_positions FLF2V's learnt position embedding over them.
        out_channels: the predicted velocity's channels, when the input has more (Wan I2V: 16 noisy + 4
        mask + 16 condition channels in, 16 out); None: in_channels."""
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
        image_tokens = (257 if image_tokens is None else image_tokens) if image_dim else 0  # CLIP ViT-H/14
        if adaln not in ("zero", "single"):
            raise ValueError(f"adaln must be 'zero' or 'single', got '{adaln}'")
        self.in_channels = in_channels
        self.out_channels = out_channels or in_channels
        self.patch_size = tuple(patch_size)
        self.num_heads = num_heads
        self.text_mask = text_mask
        self.absolute_positions = absolute_positions
        mlp_hidden = ffn_dim or int(hidden_size * mlp_ratio)
        self._architecture = dict(
            in_channels=in_channels,
            text_dim=text_dim,
            depth=depth,
            hidden_size=hidden_size,
            num_heads=num_heads,
            patch_size=self.patch_size,
            ffn_dim=mlp_hidden,
            qk_norm=qk_norm,
            rope_theta=rope_theta,
            adaln=adaln,
            qk_norm_across_heads=qk_norm_across_heads,
            pooled_text=pooled_text,
            text_mask=text_mask,
            absolute_positions=absolute_positions,
            image_dim=image_dim,
            image_tokens=image_tokens,
            image_positions=bool(image_dim and image_positions),
            out_channels=self.out_channels,
        )
        if image_dim and image_tokens < 1:
            raise ValueError(
                f"image_dim={image_dim} needs image_tokens >= 1 (model.image_tokens), got {image_tokens}"
            )
        self.image_tokens = image_tokens
        self._add_embedders(hidden_size, text_dim, pooled_text, image_dim, image_positions, adaln)
        self.rope = RotaryEmbedding3D(hidden_size // num_heads, rope_theta)
        self.sequence = WholeSequence()
        block = (hidden_size, num_heads, mlp_hidden, qk_norm, attention_backend, adaln, qk_norm_across_heads)
        self.blocks = nn.ModuleList([DiTBlock(*block, self.image_tokens) for _ in range(depth)])
        self.final_layer = FinalLayer(hidden_size, math.prod(self.patch_size), self.out_channels, adaln)
        self.init_weights()

    def _add_embedders(self, hidden_size, text_dim, pooled_text, image_dim, image_positions, adaln) -> None:
        """The patch, time, text (and pooled text, image) embedders and adaLN-single's projection, in the
        order their parameters are seeded."""
        self.x_embedder = PatchEmbed3D(self.patch_size, self.in_channels, hidden_size)
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.y_embedder = nn.Sequential(
            nn.Linear(text_dim, hidden_size), nn.GELU(approximate="tanh"), nn.Linear(hidden_size, hidden_size)
        )
        # the mean text token joins the time embedding
        self.pooled_embedder = nn.Linear(hidden_size, hidden_size) if pooled_text else None
        self.image_embedder = (
            ImageEmbedder(image_dim, hidden_size, self.image_tokens, image_positions) if image_dim else None
        )
        # adaLN-single: one projection of the time embedding, shared by every block
        self.time_proj = (
            nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size)) if adaln == "single" else None
        )

    def architecture(self) -> dict:
        """What the model was built with: dims, patch size and options (compared with a pretrained
        folder's)."""
        return dict(self._architecture)

    def check_input_shape(self, frames, height, width):
        """Raise if a latent of this size cannot be cut into whole patches."""
        for name, size, p in zip(("frames", "height", "width"), (frames, height, width), self.patch_size):
            if size % p:
                raise ValueError(
                    f"latent {name} {size} is not divisible by the patch size {p} "
                    f"(model.patch_size={list(self.patch_size)})"
                )

    def forward(self, x, t, y, y_mask, image=None):
        """x: (B, C, T, H, W) latents; t: (B,) in [0, 1], or (B, N) a timestep per token (Wan2.2 TI2V: 0 on
        the given first frame's tokens); y: (B, L, text_dim) text tokens; y_mask: (B, L) bool; image:
        CLIP features (B, image_tokens, image_dim) (FLF2V: (2B, image_tokens / 2, image_dim), first and
        last image) for a model with image_dim, else None."""
        state = self.begin(x, t, y, y_mask, image)
        tokens = state.tokens
        for block in self.blocks:
            tokens = block(tokens, state.c, state.y, state.y_mask, state.rope)  # (B, N_local, D)
        return self.end(state, tokens)

    def begin(self, x, t, y, y_mask, image=None) -> "Pass":
        """forward up to the blocks: this rank's tokens and what the blocks read besides them."""
        tokens, grid = self.embed(x)  # (B, N, D)
        rope = self.rope(grid, tokens.device)  # (N, Dh/2, 2)
        cond = self.condition(t, y, y_mask, image)
        c, temb = cond.c, cond.temb
        if cond.token_index is not None:  # the modulation of this rank's tokens (padding: row 0's)
            c = c[self.sequence.shard(cond.token_index.unsqueeze(-1), rope)[0].squeeze(-1)]
            temb = temb[cond.token_index]  # (B, N, D): the final layer's, after the gather
        tokens, rope = self.sequence.shard(tokens, rope)  # (B, N_local, D); the identity on one device
        return Pass(tokens, grid, rope, c, temb, cond.y, cond.block_mask)

    def end(self, state: "Pass", tokens):
        """forward after the blocks: the blocks' output `tokens` (B, N_local, D) -> (B, C, T, H, W)."""
        tokens = self.sequence.gather(tokens)  # (B, N, D)
        return self.unpatchify(self.final_layer(tokens, state.temb), state.grid)

    # The pieces of `forward`, also run one by one by parallel/compute/pipefusion.py, whose stages hold only
    # some of the blocks and see one patch of tokens at a time.

    def embed(self, x):
        """Latents (B, C, T, H, W) -> tokens (B, N, D) in (t, h, w) order, and the token grid (t, h, w)."""
        self.check_input_shape(*x.shape[2:])
        tokens, grid = self.x_embedder(x.to(self.x_embedder.proj.weight.dtype))
        if self.absolute_positions:
            tokens = tokens + absolute_position_embedding(grid, tokens.shape[-1], tokens.device).to(
                tokens.dtype
            )
        return tokens, grid

    def condition(self, t, y, y_mask, image=None) -> "Conditioning":
        """What every block reads besides its tokens: the time embedding, its modulation input and the
        embedded context (the image's tokens, if any, then the text's). Needs no block and no
        x_embedder, so every PipeFusion stage can compute it."""
        dtype = self.y_embedder[0].weight.dtype  # bf16 under mixed precision; t stays float32
        y = y.to(dtype)
        if not self.text_mask:  # Wan: padding tokens are zeros, and attended
            y = y * y_mask.unsqueeze(-1).to(y.dtype)
        y = self.y_embedder(y)  # (B, L, D)
        if t.dim() == 2:  # a timestep per token: each distinct value embedded once, then gathered
            if self.pooled_embedder is not None:
                raise ValueError("a timestep per token needs model.pooled_text=false (Wan's)")
            values, index = torch.unique(t, return_inverse=True)
            temb = self.t_embedder(values).to(dtype)  # (U, D)
            token_index = index  # (B, N): forward and PipeFusion gather the rows of their tokens
        else:
            token_index = None
            temb = self.t_embedder(t).to(dtype)  # (B, D), computed in float32
            if self.pooled_embedder is not None:
                temb = temb + self.pooled_embedder(masked_mean(y, y_mask))
        c = temb if self.time_proj is None else self.time_proj(temb).unflatten(1, (6, -1))  # (B or U, [6,] D)
        block_mask = y_mask if self.text_mask else None
        if (image is None) != (self.image_embedder is None):
            raise ValueError(
                "this model is conditioned on an image (model.image_dim is set): give one"
                if image is None
                else "an image was given to a model without image conditioning (model.image_dim is null)"
            )
        if image is not None:  # the image's tokens go ahead of the text's; the context is never split
            image = self.image_embedder(image.to(dtype))
            if image.shape[1] != self.image_tokens:
                raise ValueError(
                    f"the image encoder gives {image.shape[1]} tokens per sample and the model expects "
                    f"{self.image_tokens} (model.image_tokens)"
                )
            y = torch.cat([image.to(y.dtype), y], dim=1)
            if block_mask is not None:
                block_mask = torch.cat([block_mask.new_ones(image.shape[:2]), block_mask], dim=1)
        return Conditioning(temb, c, y, block_mask, token_index)

    # PipeFusion's patch pieces (parallel/compute/pipefusion.py): the blocks on tokens start:end of the
    # grid's sequence, whole rows; tokens past the sequence's end are a split's padding.

    def patch_context(self, t, cond, grid) -> Conditioning:
        """What the blocks read at timestep t ((B,), or (B, N) one per token), besides the tokens: a
        DiTText's text and CLIP features through `condition`, and the rotary angles."""
        ctx = self.condition(t, cond.text, cond.text_mask, cond.image_features)
        ctx.rope = self.rope(grid, ctx.y.device)
        return ctx

    def companion(self, ctx: Conditioning):
        """No stream passes beside the video tokens (the text is read, not updated)."""
        return None

    def patch_blocks(self, indices, tokens, companion, ctx: Conditioning, grid, start: int, end: int):
        c = ctx.c if ctx.token_index is None else ctx.c[token_rows(ctx.token_index, start, end)]
        rope = token_rows(ctx.rope, start, end, dim=0)
        for index in indices:
            tokens = self.blocks[index](tokens, c, ctx.y, ctx.block_mask, rope)
        return tokens, companion

    def patch_final(self, tokens, ctx: Conditioning, start: int, end: int):
        """The final layer on the tokens start:end (B, n, D) -> (B, n, pt ph pw C)."""
        temb = ctx.temb if ctx.token_index is None else ctx.temb[ctx.token_index[:, start:end]]
        return self.final_layer(tokens, temb)

    def unpatchify(self, x, grid):
        B = x.shape[0]
        (t, h, w), (pt, ph, pw) = grid, self.patch_size
        x = x.view(B, t, h, w, pt, ph, pw, self.out_channels)
        x = x.permute(0, 7, 1, 4, 2, 5, 3, 6)  # (B, C, t, pt, h, ph, w, pw)
        return x.reshape(B, self.out_channels, t * pt, h * ph, w * pw)

    @torch.no_grad()
    def init_weights(self, zero_init: bool = True, seed: int | None = None):
        """(Re-)initialise every parameter; also used after building on the meta device.
        zero_init=False replaces adaLN-Zero's zeros with small random weights, so that an untrained
        model's output depends on every weight (tests and benchmarks of parallel sampling). With a seed,
        each parameter draws from its own generator, seeded by (seed, its name): the weights then do not
        depend on how the model is split, and parallel/build/init.py makes the same ones shard by shard."""
        for name, p in self.named_parameters():
            module = self.get_submodule(name.rpartition(".")[0])
            if seed is None:
                init_parameter(name, p, module, zero_init)
            else:  # drawn on the host in float32 (a CPU generator), so equal on every device
                whole = torch.empty(p.shape, dtype=torch.float32)
                init_parameter(name, whole, module, zero_init, parameter_generator(seed, name))
                p.copy_(whole)


@torch.no_grad()
def init_parameter(
    name: str, tensor: torch.Tensor, module: nn.Module, zero_init: bool = True, generator=None
):
    """The DiT's initialisation of one parameter (`name` as in DiT.named_parameters(), `module` the one
    that owns it), in place. The one place the init rules live."""
    kind = name.rpartition(".")[2]
    if kind == "pos_embed":  # FLF2V's image position embedding starts at zero, as Wan's
        nn.init.zeros_(tensor)
    elif kind == "scale_shift_table":  # adaLN-single (PixArt-alpha, Wan): random tables of scale 1/sqrt(D)
        nn.init.normal_(tensor, std=tensor.shape[-1] ** -0.5, generator=generator)
    elif isinstance(module, (nn.LayerNorm, nn.RMSNorm, RMSNorm)):  # the families' own RMSNorm too
        nn.init.ones_(tensor) if kind == "weight" else nn.init.zeros_(tensor)
    elif (
        ".adaLN_modulation." in f".{name}"
        or name.startswith("final_layer.linear.")
        or name.endswith("cross_attn.proj.weight")
    ):
        # adaLN-Zero: every block starts as the identity, and so does the text path into it
        if zero_init:
            nn.init.zeros_(tensor)
        else:
            nn.init.normal_(tensor, std=0.05, generator=generator)
    elif kind == "bias":
        nn.init.zeros_(tensor)
    elif name.startswith(("t_embedder.mlp.", "time_proj.")):
        nn.init.normal_(tensor, std=0.02, generator=generator)
    else:  # Linear and the patch embedding's Conv3d: Xavier-uniform over (out, everything else)
        fan_out, fan_in = tensor.shape[0], tensor[0].numel()
        bound = math.sqrt(6.0 / (fan_in + fan_out))
        nn.init.uniform_(tensor, -bound, bound, generator=generator)


def masked_mean(y, mask):
    m = mask.to(y.dtype).unsqueeze(-1)
    return (y * m).sum(1) / m.sum(1).clamp(min=1.0)


ARCHITECTURE_OPTIONS = (
    "ffn_dim",
    "adaln",
    "qk_norm_across_heads",
    "pooled_text",
    "text_mask",
    "absolute_positions",
    "image_dim",
    "image_tokens",
    "image_positions",
)


def architecture_differences(ours: dict, theirs: dict) -> list[str]:
    """The DiT.architecture() entries that both dicts hold and that differ (a tuple equals a list)."""
    plain = lambda v: list(v) if isinstance(v, (tuple, list)) else v  # noqa: E731
    return [k for k in theirs if k in ours and plain(ours[k]) != plain(theirs[k])]


def recipe_key(name: str) -> str:
    """The recipe key that sets an entry of DiT.architecture(), for error messages."""
    return {
        "in_channels": "the VAE's latent channels (vae.*), or model.task (i2v/flf2v take 2 x those + 4)",
        "image_positions": "model.task (flf2v: two images with their positions)",
        "text_dim": "the text encoder's width (text_encoder.*)",
        "depth": "model.size",
        "hidden_size": "model.size",
        "num_heads": "model.size",
    }.get(name, f"model.{name} (or model.size)" if name in ARCHITECTURE_OPTIONS else f"model.{name}")


DIMENSIONS = ("depth", "hidden_size", "num_heads")


def size_of(model_cfg) -> dict:
    """A recipe's `model` section's size: DiT_models[model.size], with model.depth, model.hidden_size and
    model.num_heads where set (its depth, width and heads; the options are build_dit's to apply)."""
    if model_cfg.size not in DiT_models:
        raise ValueError(f"unknown model size '{model_cfg.size}'; choose one of {', '.join(DiT_models)}")
    size = dict(DiT_models[model_cfg.size])
    size.update({k: model_cfg[k] for k in DIMENSIONS if model_cfg.get(k) is not None})
    return size


def build_dit(model_cfg, in_channels: int, text_dim: int) -> DiT:
    """The DiT named by a recipe's `model` section: the size's dims and options (size_of), then the
    recipe's options that are set (not None)."""
    arch = size_of(model_cfg)
    arch.update({key: model_cfg[key] for key in ARCHITECTURE_OPTIONS if model_cfg[key] is not None})
    task = model_cfg.get("task", "t2v")
    if task in ("i2v", "flf2v"):  # in: the noisy latent, a 4-channel mask, the frames' latent; out: velocity
        arch.update(out_channels=in_channels)
        in_channels = 2 * in_channels + 4
        if task == "flf2v" and arch.get("image_dim"):  # two images' tokens, with their position embedding
            arch.update(image_tokens=2 * (arch.get("image_tokens") or 257), image_positions=True)
    if arch.get("adaln", "zero") not in ("zero", "single"):
        raise ValueError(f"model.adaln must be 'zero' or 'single', got '{arch['adaln']}'")
    return DiT(
        in_channels=in_channels,
        text_dim=text_dim,
        patch_size=tuple(model_cfg.patch_size),
        mlp_ratio=model_cfg.mlp_ratio,
        qk_norm=model_cfg.qk_norm,
        attention_backend=model_cfg.attention_backend,
        rope_theta=model_cfg.rope_theta,
        **arch,
    )


if __name__ == "__main__":
    with torch.device("meta"):
        for name, size in DiT_models.items():
            print(f"{name:10s} {count_parameters(DiT(16, 4096, **size)) / 1e6:10.1f} M parameters")
